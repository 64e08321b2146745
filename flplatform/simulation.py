"""Start a simulated federation with Flower's own machinery.

``flplatform simulate`` runs exactly what ``flwr run .`` runs: a SuperLink in simulation
mode (started here, on free loopback ports, with runtime dependency installation off),
then ``flwr run`` of this project's Flower app with the run config as overrides. The
ServerApp writes the ledger; the caller follows progress by reading the ledger.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from flplatform.config import RunConfig
from flplatform.errors import ConfigError, RunFailed
from flplatform.flower_app import OPTIONS_ENV, AppRun, ConfigValue
from storage import (
    UPDATE_DROPPED,
    UPDATE_REJECTED,
    LedgerRepository,
    RoundRecord,
    RunRecord,
    UpdateRecord,
)
from storage.session import default_db_url, flplatform_home, normalize_db_url

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception)\b:")

# Called at every poll with the run (None until the ServerApp records it), its rounds so
# far, and the dropped and rejected updates of the latest round (so a display can say why).
ProgressCallback = Callable[[RunRecord | None, list[RoundRecord], list[UpdateRecord]], None]


def project_dir() -> Path:
    """The directory holding this project's pyproject.toml with ``[tool.flwr.app]``."""
    root = Path(__file__).resolve().parents[1]
    pyproject = root / "pyproject.toml"
    try:
        data = tomllib.loads(pyproject.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        data = {}
    if "app" not in data.get("tool", {}).get("flwr", {}):
        raise RunFailed(
            f"cannot find the Flower app: {pyproject} has no [tool.flwr.app]; "
            "install flplatform from its source tree (pip install -e .)"
        )
    return root


def work_home() -> Path:
    """Where runs keep their files (created): ``$FLPLATFORM_HOME`` or ``./.flplatform``."""
    home = flplatform_home()
    home.mkdir(parents=True, exist_ok=True)
    return home


def flower_environment(home: Path, *, python_path: Sequence[Path] = ()) -> dict[str, str]:
    """Environment for Flower processes: state under ``home``, no installs, no telemetry.

    ``python_path``: directories appended to ``PYTHONPATH`` (a user's model module found in
    the current directory). A Flower app's own directory needs none: Flower puts the
    installed app on ``sys.path`` in every process it starts.
    """
    env = dict(os.environ)
    # Options for flplatform.start() are the run's own (set by start_app), never inherited.
    env.pop(OPTIONS_ENV, None)
    if python_path:
        parts = [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []
        env["PYTHONPATH"] = os.pathsep.join([*parts, *(str(p) for p in python_path)])
    env.update(
        {
            "FLWR_HOME": str(home / "flwr"),
            # Each run would otherwise `uv sync` the dependencies into a fresh environment,
            # fetching a multi-GB CUDA torch; ours are installed already.
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLPLATFORM_HOME": str(home),
            # Flower's processes start each other by name (flower-superexec, flwr-serverapp):
            # they must find this environment's scripts first.
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
            "PYTHONUNBUFFERED": "1",
            "RAY_DEDUP_LOGS": "0",
            # Faster writes into fresh memory for torch tensors (see ARCHITECTURE.md).
            "THP_MEM_ALLOC_ENABLE": "1",
        }
    )
    (home / "flwr").mkdir(parents=True, exist_ok=True)
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _bin(name: str) -> str:
    """A console script of this environment (next to the running Python), else on PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise RunFailed(f"'{name}' is not installed; run the README's set-up command")
    return found


@dataclass
class SimulationProcess:
    """A running ``flwr run`` and the SuperLink it talks to."""

    superlink: subprocess.Popen[bytes]
    run: subprocess.Popen[bytes]
    log_path: Path
    superlink_log: Path

    def poll(self) -> int | None:
        """Exit code of ``flwr run``, or None while it runs."""
        return self.run.poll()

    def stop(self) -> None:
        """Stop ``flwr run`` (if still going) and the SuperLink, with its app processes.

        The SuperLink starts SuperExec in a session of its own, and SuperExec the
        simulation (ServerApp, Ray and its actors) in that one: their process groups are
        found (before anything is stopped) and stopped too. They would exit by themselves
        once their parent is gone, by raising SIGINT, which does nothing where SIGINT is
        ignored (a process started in the background by a shell).
        """
        groups = _descendant_groups(self.superlink.pid, self.run.pid)
        for proc in (self.run, self.superlink):
            if proc.poll() is None:
                _terminate_group(proc)
        _terminate_groups(groups - {self.run.pid, self.superlink.pid, os.getpgrp()})

    def last_error(self) -> str:
        """The most telling line of the run's output (see ``telling_line``)."""
        return telling_line(self.log_tail(60))

    def log_tail(self, lines: int = 20) -> str:
        """Last lines of the run's output, for error messages."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])


def telling_line(output: str) -> str:
    """The line of a process's output that says what went wrong, terminal colours removed.

    Flower's CLI prints its errors in a box (``╭─ Error ─╮``, ``│ text │`` lines, ``╰─╯``):
    the last such box's text, joined into one line. Else the last ``SomeError: message``
    line (a traceback's own), else the last line that mentions an error, else the last line.
    """
    tail = [_ANSI.sub("", line).strip() for line in output.splitlines()]
    tail = [line for line in tail if line]
    opened = [i for i, line in enumerate(tail) if line.startswith("╭") and "Error" in line]
    if opened:
        text = []
        for line in tail[opened[-1] + 1 :]:
            if not line.startswith("│"):
                break
            text.append(line.strip("│ "))
        if any(text):
            return " ".join(part for part in text if part)
    for line in reversed(tail):
        if _EXCEPTION_LINE.match(line) and line.split(":", 1)[-1].strip():
            return line
    for line in reversed(tail):
        if "error" in line.lower():
            return line
    return tail[-1] if tail else "no output"


def _descendant_groups(*roots: int) -> set[int]:
    """Process groups of every descendant of ``roots`` (Linux ``/proc``; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    groups: dict[int, int] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return set()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) < 3:
            continue
        pid, ppid, pgrp = int(entry.name), int(fields[1]), int(fields[2])
        children.setdefault(ppid, []).append(pid)
        groups[pid] = pgrp
    found: set[int] = set()
    todo = list(roots)
    seen = set(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in seen:
                seen.add(child)
                todo.append(child)
                found.add(groups[child])
    return found


def _terminate_groups(groups: set[int], timeout: float = 10) -> None:
    """SIGTERM each process group, then SIGKILL what is left after ``timeout`` seconds."""
    live = set()
    for group in groups:
        try:
            os.killpg(group, signal.SIGTERM)
            live.add(group)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + timeout
    while live and time.monotonic() < deadline:
        time.sleep(0.2)
        live = {g for g in live if _group_alive(g)}
    for group in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _terminate_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, PermissionError):
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


def federation_options(num_sites: int) -> str:
    """Flower's simulation federation: one SuperNode per site, one CPU per actor.

    Two to four actors fit a 2-core machine (each imports torch); more are started when
    asked, but each simulated site runs whenever an actor is free.
    """
    cpus = os.cpu_count() or 2
    actors = max(1, min(num_sites, cpus, 4))
    return f"num-supernodes={num_sites} client-resources-num-cpus=1 init-args-num-cpus={actors}"


def start_simulation(
    config: RunConfig, *, home: Path, log_name: str, app_dir: Path | None = None
) -> SimulationProcess:
    """Start a SuperLink and ``flwr run`` a Flower app (this project's by default)."""
    return start_app(
        app_dir or project_dir(),
        home=home,
        log_name=log_name,
        run_config=config.to_run_config(),
        num_sites=config.num_sites,
        python_path=_model_dirs(config.model),
    )


def _model_dirs(model: str) -> tuple[Path, ...]:
    """The directory a ``MODULE:FACTORY`` model's module was found in, when not installed."""
    if ":" not in model:
        return ()
    from clients.models import model_import_dir

    directory = model_import_dir(model)
    return (directory,) if directory is not None else ()


def start_app(
    app_dir: Path,
    *,
    home: Path,
    log_name: str,
    run_config: Mapping[str, ConfigValue],
    num_sites: int,
    extra_env: Mapping[str, str] | None = None,
    python_path: Sequence[Path] = (),
) -> SimulationProcess:
    """Start a SuperLink and ``flwr run app_dir`` on it with ``run_config`` overrides.

    ``extra_env`` reaches the ServerApp and ClientApp processes: the SuperLink starts
    them (through SuperExec) with its own environment.
    """
    env = flower_environment(home, python_path=python_path)
    env.update(extra_env or {})
    superlink, superlink_log = start_superlink(env, home=home, log_name=log_name)
    logs = home / "logs"
    overrides: list[str] = []
    if run_config:
        path = logs / f"{log_name}.run-config.toml"
        path.write_text(_toml(dict(run_config)))
        overrides = ["--run-config", str(path)]
    log_path = logs / f"{log_name}.log"
    try:
        run = subprocess.Popen(
            [
                _bin("flwr"),
                "run",
                str(app_dir),
                "local",
                *overrides,
                "--federation-config",
                federation_options(num_sites),
                "--stream",
            ],
            env=env,
            cwd=str(home),
            stdout=log_path.open("wb"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    except BaseException:
        stop_process(superlink)
        raise
    return SimulationProcess(superlink, run, log_path, superlink_log)


def start_superlink(
    env: dict[str, str], *, home: Path, log_name: str
) -> tuple[subprocess.Popen[bytes], Path]:
    """Start a simulation SuperLink on free loopback ports; return it and its log.

    ``env`` (from :func:`flower_environment`) is the SuperLink's, and so that of the app
    processes it starts; the ports are written into it, so that ``flwr run APP local``
    run with ``env`` uses this SuperLink.
    """
    http_port, control_port = free_port(), free_port()
    # `flwr run APP local` uses a SuperLink on these ports; we start it ourselves so that
    # it runs with our flags and stops with the run.
    env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"] = str(http_port)
    env["FLWR_LOCAL_CONTROL_API_PORT"] = str(control_port)
    logs = home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    superlink_log = logs / f"{log_name}.superlink.log"
    superlink = subprocess.Popen(
        [
            _bin("flower-superlink"),
            "--insecure",
            "--simulation",
            "--isolation",
            "subprocess",
            "--disable-runtime-dependency-installation",
            "--control-api-address",
            f"127.0.0.1:{control_port}",
            "--host",
            "127.0.0.1",
            "--port",
            str(http_port),
            "--database",
            str(logs / f"{log_name}.superlink.db"),
        ],
        env=env,
        stdout=superlink_log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for_port(http_port, superlink, superlink_log)
    except BaseException:  # Ctrl-C while it starts, too: nothing is left behind
        stop_process(superlink)
        raise
    return superlink, superlink_log


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """Stop a process started here, with its process group (SIGTERM, then SIGKILL)."""
    if proc.poll() is None:
        _terminate_group(proc)


def wait_for_port(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 30) -> None:
    """Return once something listens on 127.0.0.1:``port``; fail if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RunFailed(f"the SuperLink exited with code {proc.returncode}; see {log}")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(0.2)
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    _terminate_group(proc)
    raise RunFailed(f"the SuperLink did not start within {timeout:.0f} s; see {log}")


def _toml(values: Mapping[str, ConfigValue]) -> str:
    lines = []
    for key, value in values.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, int | float):
            text = repr(value)
        elif isinstance(value, str):
            text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        else:  # pragma: no cover - RunConfig only holds the types above
            raise ConfigError(f"cannot write config value {key}={value!r}")
        lines.append(f'"{key}" = {text}')
    return "\n".join(lines) + "\n"


# ===================================================================== run and follow
def ledger_url(config: RunConfig) -> str:
    """The absolute URL of the ledger ``config`` names (the ServerApp runs elsewhere)."""
    return normalize_db_url(config.db) if config.db else default_db_url()


def check_ledger(config: RunConfig) -> str:
    """Open (creating if needed) the ledger ``config`` names; return its absolute URL.

    Fails fast, before any start-up cost, with a ``StorageError`` saying what is wrong:
    another application's database, or a ledger the run could not write to.
    """
    # No --db: the default ledger, whose directory (the home) is created; a user-given URL's
    # directory is not (a typo should not start an empty ledger somewhere else).
    db_url = ledger_url(config)
    with LedgerRepository.open(db_url if config.db else None) as repository:
        repository.check_writable()
    return db_url


def run_simulation(
    config: RunConfig,
    *,
    app_dir: Path | None = None,
    on_progress: ProgressCallback | None = None,
    poll_interval: float = 0.5,
) -> RunRecord:
    """Run ``config`` as a Flower simulation and follow it through the ledger.

    Returns the finished run; raises ``RunFailed`` (after recording the failure in the
    ledger) when it does not finish, and ``StorageError`` when the ledger cannot be opened.
    """
    home = work_home()
    db_url = check_ledger(config)
    tag = uuid.uuid4().hex
    config = RunConfig.from_mapping({**config.to_run_config(), "run-tag": tag, "db": db_url})
    process = start_simulation(config, home=home, log_name=tag[:12], app_dir=app_dir)
    return _follow_to_end(process, config, on_progress, poll_interval)


def run_app(
    run: AppRun,
    *,
    on_progress: ProgressCallback | None = None,
    poll_interval: float = 0.5,
) -> RunRecord:
    """Run a user's Flower app directory (``flplatform run``) and follow it in the ledger.

    The run is found by ``run.tag``: flplatform's ServerApp reads it from the ``run-tag``
    key, ``flplatform.start`` from ``FLPLATFORM_OPTIONS``. Returns the finished run;
    raises ``RunFailed`` like :func:`run_simulation`.
    """
    home = work_home()
    process = start_app(
        run.app.path,
        home=home,
        log_name=run.tag[:12],
        run_config=run.run_config,
        num_sites=run.num_sites,
        extra_env=run.environment(),
        python_path=run.python_path,
    )
    # What _follow reads: where the run is recorded and its tag.
    follow = replace(RunConfig(), db=run.db_url, run_tag=run.tag)
    try:
        return _follow_to_end(process, follow, on_progress, poll_interval)
    except RunFailed:
        if process.poll() != 0 or _has_run(follow):
            raise
        raise RunFailed(
            f"app '{run.app.name}' recorded no run in the ledger ({process.last_error()}); "
            f"`flplatform run` follows ServerApps that call flplatform.start(...) or are "
            f"flplatform's own; log: {process.log_path}"
        ) from None


def _has_run(config: RunConfig) -> bool:
    with LedgerRepository.open(config.db) as repository:
        return repository.find_run_by_tag(config.run_tag) is not None


def _follow_to_end(
    process: SimulationProcess,
    config: RunConfig,
    on_progress: ProgressCallback | None,
    poll_interval: float,
) -> RunRecord:
    """Follow a started run to its end, stop every process, and return its record."""
    db_url = config.db
    try:
        run_id = _follow(process, config, on_progress, poll_interval)
    except KeyboardInterrupt:
        process.stop()
        _close_unfinished(config, "interrupted by the user")
        raise
    finally:
        process.stop()
    with LedgerRepository.open(db_url) as repository:
        record = repository.get_run(run_id)
        if record.status == "running":  # the ServerApp died without a word
            repository.finish_run(
                run_id, status="failed", error=f"simulation exited: {process.last_error()}"
            )
            record = repository.get_run(run_id)
    if record.status != "finished":
        raise RunFailed(
            f"run {record.id} failed: {record.error or process.last_error()}; "
            f"log: {process.log_path}"
        )
    return record


def _follow(
    process: SimulationProcess,
    config: RunConfig,
    on_progress: ProgressCallback | None,
    poll_interval: float,
) -> int:
    """Poll the ledger until the run leaves "running" or Flower exits; return the run id."""
    run_id: int | None = None
    with LedgerRepository.open(config.db) as repository:
        while True:
            exited = process.poll() is not None
            record = repository.find_run_by_tag(config.run_tag)
            if record is not None:
                run_id = record.id
            if on_progress is not None:
                done = repository.list_rounds(record.id) if record else []
                on_progress(record, done, _latest_failures(repository, done))
            if exited or (record is not None and record.status != "running"):
                break
            time.sleep(poll_interval)
    if run_id is None:
        raise RunFailed(
            f"the simulation stopped before the ServerApp started (flwr exited with "
            f"{process.poll()}): {process.last_error()}; log: {process.log_path}"
        )
    return run_id


def _latest_failures(repository: LedgerRepository, done: list[RoundRecord]) -> list[UpdateRecord]:
    """The dropped and rejected updates of the latest round; no query when it had none."""
    if not done or not (done[-1].num_dropped or done[-1].num_rejected):
        return []
    latest = done[-1]
    return repository.list_updates(
        latest.run_id, round=latest.round, status=(UPDATE_DROPPED, UPDATE_REJECTED)
    )


def _close_unfinished(config: RunConfig, reason: str) -> None:
    with LedgerRepository.open(config.db) as repository:
        record = repository.find_run_by_tag(config.run_tag)
        if record is not None and record.status == "running":
            repository.finish_run(record.id, status="failed", error=reason)
