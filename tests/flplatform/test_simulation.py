"""What a failed simulation's message quotes from Flower's output; its files' permissions;
what the command following a run records when the SuperLink it started dies."""

from __future__ import annotations

import logging
import os
import socket
import stat
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from flplatform.app.config import RunConfig
from flplatform.core.errors import ConfigError, RunFailed
from flplatform.engine.link import gone_reason
from flplatform.launch import flower, processes
from flplatform.launch.flower import (
    ACTORS_ENV,
    SimulationProcess,
    StartTimedOut,
    federation_options,
    flower_environment,
    logs_dir,
    private_file,
    start_on_free_port,
    telling_line,
    work_home,
)
from flplatform.launch.processes import ProcessTree, listens_on
from flplatform.launch.simulation import follow_run, forget_snapshots
from flplatform.launch.staging import staged_app
from storage import LedgerRepository
from strategies.mods.snapshots import state_root

ROOT = Path(__file__).resolve().parents[2]

FLOWER_PANEL = """\
Using SuperLink: local (127.0.0.1:43799)
\x1b[31m╭─ Error ─────────────────────────────────────╮\x1b[0m
│ The Flower App does not meet the project     │
│ structure requirements: 'a/b/c' exceeds the  │
│ maximum directory depth of 10.               │
╰──────────────────────────────────────────────╯
"""


def test_the_simulation_has_one_actor_per_core_unless_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ACTORS_ENV)
    cores = os.cpu_count() or 2
    assert f"init-args-num-cpus={min(3, cores, 4)}" in federation_options(3)
    assert "init-args-num-cpus=1" in federation_options(1)  # never more than the sites
    monkeypatch.setenv(ACTORS_ENV, "8")
    assert federation_options(12) == (
        "num-supernodes=12 client-resources-num-cpus=1 init-args-num-cpus=8"
    )
    assert "init-args-num-cpus=3" in federation_options(3)
    for bad in ("0", "-1", "two", "1.5", "²"):
        monkeypatch.setenv(ACTORS_ENV, bad)
        with pytest.raises(ConfigError, match=f"{ACTORS_ENV} must be a whole number >= 1"):
            federation_options(3)


def test_a_flower_error_box_is_quoted_whole_on_one_line() -> None:
    assert telling_line(FLOWER_PANEL) == (
        "The Flower App does not meet the project structure requirements: 'a/b/c' exceeds "
        "the maximum directory depth of 10."
    )


def test_a_traceback_gives_its_exception_line() -> None:
    output = "Traceback (most recent call last):\n  File 'x'\nValueError: bad k\nexiting\n"
    assert telling_line(output) == "ValueError: bad k"


def test_otherwise_the_last_line_mentioning_an_error_then_the_last_line() -> None:
    assert telling_line("start\nan error happened here\nbye\n") == "an error happened here"
    assert telling_line("start\nbye\n") == "bye"
    assert telling_line("") == "no output"


def test_the_logs_and_the_files_written_there_are_the_owners_only(tmp_path: Path) -> None:
    # An older flplatform made them readable by everyone; the next run takes that back.
    (tmp_path / "logs").mkdir(mode=0o755)
    old = tmp_path / "logs" / "run.log"
    old.write_text("what the last run said")
    old.chmod(0o644)

    logs = logs_dir(tmp_path)
    with private_file(old) as file:
        file.write(b"this run")
    with private_file(logs / "new.run-config.toml") as file:
        file.write(b"x = 1")

    assert stat.S_IMODE(logs.stat().st_mode) == 0o700
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in logs.iterdir()} == {
        "run.log": 0o600,
        "new.run-config.toml": 0o600,
    }
    assert old.read_text() == "this run"  # written from its start


def test_a_finished_runs_snapshots_are_forgotten_where_its_sites_wrote_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The default set-up: neither variable set; the simulated sites get
    # FLPLATFORM_HOME=./.flplatform from flower_environment and write under it.
    monkeypatch.delenv("FLPLATFORM_SITE_STATE", raising=False)
    monkeypatch.delenv("FLPLATFORM_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    sites_root = state_root({}, flower_environment(work_home()))
    assert sites_root == tmp_path / ".flplatform" / "site-state"
    (sites_root / "run-tag-1" / "london").mkdir(parents=True)
    (sites_root / "run-tag-2" / "london").mkdir(parents=True)

    forget_snapshots(SimpleNamespace(tag="run-tag-1"))  # type: ignore[arg-type]

    assert sorted(p.name for p in sites_root.iterdir()) == ["run-tag-2"]


# Stands in for the ServerApp: when it is stopped (SIGTERM), it notes the run's status.
SERVERAPP = """
import signal, sys, time
from pathlib import Path
from storage import LedgerRepository
db, tag, seen = sys.argv[1:]
def stopped(signum, frame):
    with LedgerRepository.open(db) as repo:
        Path(seen).write_text(repo.find_run_by_tag(tag).status)
    sys.exit(0)
signal.signal(signal.SIGTERM, stopped)
Path(seen + ".ready").touch()
time.sleep(60)
"""
# Stands in for the SuperLink: killed with SIGKILL once the ServerApp is ready.
SUPERLINK = """
import os, signal, sys, time
from pathlib import Path
while not Path(sys.argv[1] + ".ready").exists():
    time.sleep(0.05)
os.kill(os.getpid(), signal.SIGKILL)
"""
# Stands in for `flwr run --stream`: it exits as soon as its stream from the SuperLink
# ends (its standard input, which the SuperLink holds the other end of), with Flower's
# message.
FLWR_RUN = """
import sys
sys.stdin.read()
print("Connection to the SuperLink is unavailable.")
sys.exit(1)
"""


def test_a_superlink_that_dies_fails_the_run_with_its_reason_before_the_serverapp_stops(
    tmp_path: Path,
) -> None:
    """``flplatform server`` (and ``simulate``) follow the run: the SuperLink they started
    dies, and `flwr run` with it; the run is failed with the reason the ServerApp's own
    watch gives, naming the SuperLink, before the processes are stopped (so that the
    ServerApp, stopped next, finds the run failed and can write nothing more), and every
    process is gone."""
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    tag = uuid.uuid4().hex
    with LedgerRepository.open(db) as repo:
        run_id = repo.create_run(
            name="r", strategy="local-sgd", seed=0, config={}, num_rounds_planned=9, tag=tag
        )
    seen = tmp_path / "seen-by-the-serverapp"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started: list[ProcessTree] = []

    def start(tree: ProcessTree) -> SimulationProcess:
        started.append(tree)
        tree.popen([sys.executable, "-c", SERVERAPP, db, tag, str(seen)], env=env)
        superlink = tree.popen(
            [sys.executable, "-c", SUPERLINK, str(seen)], env=env, stdout=subprocess.PIPE
        )
        log = tmp_path / "run.log"
        with log.open("wb") as output, superlink.stdout as stream:  # (the children's now)
            flwr_run = tree.popen([sys.executable, "-c", FLWR_RUN], stdin=stream, stdout=output)
        return SimulationProcess(
            superlink, flwr_run, log, tmp_path / "superlink.log", tree, superlink_port=4242
        )

    # Polled once a second: by the next poll after the kill, `flwr run` has exited too.
    with pytest.raises(RunFailed) as raised:
        follow_run(start, replace(RunConfig(), db=db, run_tag=tag), poll_interval=1.0)

    reason = gone_reason(("127.0.0.1", 4242), "killed by SIGKILL")
    assert reason == (
        "the SuperLink at 127.0.0.1:4242 is gone (killed by SIGKILL): it has exited, and "
        "the run cannot go on without it"
    )
    assert raised.value.reason.startswith(f"run {run_id} failed: {reason}; see ")
    with LedgerRepository.open(db) as repo:
        run = repo.get_run(run_id)
    assert run.status == "failed"
    assert run.error == f"{reason}; see {tmp_path / 'superlink.log'}"
    assert seen.read_text() == "failed"
    assert started[0].alive() == []


# ===================================================== the app directory flwr run walks
def _fab_names(app_dir: Path) -> set[str]:
    """The files Flower's own `flwr run` packs from ``app_dir``."""
    import io
    import zipfile

    from flwr.cli.build import build_fab_from_disk

    with zipfile.ZipFile(io.BytesIO(build_fab_from_disk(app_dir))) as fab:
        return set(fab.namelist())


def test_the_staged_app_packs_as_the_app_but_its_venv_git_store_and_home(tmp_path: Path) -> None:
    app = tmp_path / "app"
    (app / "pkg").mkdir(parents=True)
    (app / "pyproject.toml").write_text((ROOT / "examples/own_app/pyproject.toml").read_text())
    (app / "pkg" / "__init__.py").write_text("")
    (app / "pkg" / "task.py").write_text("X = 1\n")
    (app / "pkg" / "notes.md").write_text("kept\n")
    (app / "pkg" / "ignored.py").write_text("")
    (app / ".gitignore").write_text("pkg/ignored.py\n")
    (app / "data").mkdir()
    (app / "data" / "images.bin").write_bytes(b"\0" * 1000)  # not packed: never copied
    venv = app / "my-env"  # a virtualenv, whatever its name
    (venv / "lib").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (venv / "lib" / "site.py").write_text("")
    (app / ".cache").mkdir()
    (app / ".cache" / "kept.json").write_text("{}")  # hidden, not ignored: Flower packs it
    (app / "pkg" / "env").mkdir()
    (app / "pkg" / "env" / "world.py").write_text("")  # `env/` is excluded at the root only
    (app / ".git" / "objects").mkdir(parents=True)
    (app / ".git" / "objects" / "x.json").write_text("{}")  # git's store: never walked
    home = app / ".flplatform"  # the platform's home inside the app
    (home / "logs").mkdir(parents=True)
    (home / "logs" / "run.json").write_text("{}")

    unstaged = _fab_names(app)  # what Flower packs walking the app directory itself
    staged = staged_app(app, home)

    assert staged.parent == home / "apps"
    packed = _fab_names(staged)
    left_out = {"my-env/lib/site.py", ".flplatform/logs/run.json", ".git/objects/x.json"}
    assert left_out <= unstaged and packed == unstaged - left_out
    assert {".cache/kept.json", "pkg/env/world.py"} <= packed
    assert {"pkg/task.py", "pkg/notes.md"} <= packed and "pkg/ignored.py" not in packed
    assert not (staged / "data").exists() and not (staged / ".flplatform").exists()
    # Named by its contents: the same app stages to the same copy, a change to a new one.
    assert staged_app(app, home) == staged
    (app / "pkg" / "task.py").write_text("X = 2\n")
    changed = staged_app(app, home)
    assert changed != staged and (changed / "pkg" / "task.py").read_text() == "X = 2\n"
    assert (staged / "pkg" / "task.py").read_text() == "X = 1\n"  # never changed once made
    # A copy nobody used for more than a week goes when another is staged.
    week_ago = time.time() - 8 * 24 * 3600
    os.utime(staged, (week_ago, week_ago))
    assert staged_app(app, home) == changed and not staged.exists()


# ====================================== a port taken between choosing it and binding it
def _http_server(log: Path, started: list[int]):  # type: ignore[no-untyped-def]
    """A real server process on the port given, its output in ``log`` (Python's own:
    'Address already in use' when the port is taken, as Flower's servers say)."""

    def start(port: int) -> subprocess.Popen[bytes]:
        started.append(port)
        return subprocess.Popen(
            [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
            stdout=private_file(log),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    return start


def _taken_ports(count: int) -> list[socket.socket]:
    held = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        held.append(sock)
    return held


def test_a_server_whose_port_was_taken_meanwhile_starts_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken = _taken_ports(2)
    chosen = [sock.getsockname()[1] for sock in taken]
    real_free_port = flower.free_port
    monkeypatch.setattr(flower, "free_port", lambda: chosen.pop(0) if chosen else real_free_port())
    started: list[int] = []
    try:
        proc, port = start_on_free_port(
            _http_server(tmp_path / "server.log", started), tmp_path / "server.log"
        )
        try:
            assert started[:2] == [sock.getsockname()[1] for sock in taken]
            assert port == started[-1] and len(started) == 3
            assert proc.poll() is None
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass
        finally:
            proc.kill()
            proc.wait()
    finally:
        for sock in taken:
            sock.close()


def test_a_server_failing_otherwise_or_too_often_fails_with_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "server.log"
    taken = _taken_ports(2)
    ports = [sock.getsockname()[1] for sock in taken]
    try:
        monkeypatch.setattr(flower, "free_port", lambda: ports[0])
        started: list[int] = []
        with pytest.raises(RunFailed, match="the web server exited with code 1; see .*server.log"):
            start_on_free_port(_http_server(log, started), log, what="the web server", attempts=3)
        assert started == [ports[0]] * 3  # three tries, all on a taken port

        def broken(port: int) -> subprocess.Popen[bytes]:
            started.append(port)
            return subprocess.Popen(
                [sys.executable, "-c", "raise SystemExit('bad certificate')"],
                stdout=private_file(log),
                stderr=subprocess.STDOUT,
            )

        started.clear()
        with pytest.raises(RunFailed, match="exited with code 1"):
            start_on_free_port(broken, log)
        assert started == [ports[0]]  # not a taken port: no second try
    finally:
        for sock in taken:
            sock.close()


def test_proc_tells_which_process_listens_on_a_port() -> None:
    (mine,) = _taken_ports(1)
    free = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    free.bind(("127.0.0.1", 0))  # bound, not listening
    try:
        port = mine.getsockname()[1]
        assert listens_on(os.getpid(), port) is True
        assert listens_on(os.getppid(), port) is False  # another process
        assert listens_on(os.getpid(), free.getsockname()[1]) is None  # nobody listens there
    finally:
        mine.close()
        free.close()


def test_where_proc_lists_no_listener_a_connection_is_enough(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(processes, "_listening_entries", lambda net: [])  # as on WSL 1
    log, started = tmp_path / "server.log", []
    proc, port = start_on_free_port(_http_server(log, started), log)
    try:
        assert started == [port]
    finally:
        proc.kill()
        proc.wait()


def test_a_server_that_never_listens_is_stopped_and_said_to_be_late(tmp_path: Path) -> None:
    log, started = tmp_path / "server.log", []

    def silent(port: int) -> subprocess.Popen[bytes]:
        started.append(
            subprocess.Popen(
                [sys.executable, "-c", "import time; time.sleep(60)"],
                stdout=private_file(log),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        return started[-1]

    began = time.monotonic()
    with pytest.raises(StartTimedOut, match="the SuperLink did not start within 2 s"):
        start_on_free_port(silent, log, timeout=2)
    assert time.monotonic() - began < 30  # not the sleeper's 60 s
    (sleeper,) = started
    assert sleeper.wait(10) is not None  # stopped, not left behind


def test_flowers_tracebacks_for_an_app_without_a_query_function_are_dropped() -> None:
    # What Flower's simulation logs, per site, when the engine's site query reaches an app
    # that registers no @app.query() function; any other error stays in the log.
    from flplatform.launch.simulation_runtime import _NoQueryHandlerNoise

    def record(text: str) -> logging.LogRecord:
        return logging.LogRecord("flwr", logging.ERROR, "vce_api.py", 1, text, None, None)

    noise = _NoQueryHandlerNoise()
    dropped = [
        "An exception was raised when processing a message by RayBackend",
        "ray::ClientAppActor.run() ...\nValueError: No query function registered with name "
        "'default'",
    ]
    assert not any(noise.filter(record(text)) for text in dropped)
    kept = "ray::ClientAppActor.run() ...\nRuntimeError: disk on fire at this site"
    assert noise.filter(record(kept))
