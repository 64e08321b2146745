"""A deployment whose SuperLink dies (SIGKILL) after round 1, for real on 127.0.0.1.

Flower's own SuperLink, SuperExec, flwr-serverapp and SuperNodes. In a deployment the
ServerApp's Grid (Flower's HttpGrid) retries a call for ever while the SuperLink is
unreachable, so the ServerApp itself must notice (engine/link.py): with nobody following
the run (a SuperLink and sites started by hand, `flwr run` detached), the ServerApp stops
and marks its run failed, naming the SuperLink. Under `flplatform server`, which follows
the run, the command fails the run with the same wording, stops every process it started
and exits with one line. Either way: within 10 s, and no round is written afterwards.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flplatform.cli.app import app
from flplatform.launch.flower import flower_environment, free_port
from flplatform.launch.processes import ProcessTree
from storage import LedgerRepository, RunRecord
from tests.helpers.processes import (
    Leftovers,
    Machine,
    start_flower_server,
    supernode,
    wait_for_text,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.deploy,
    pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds processes in /proc (Linux)"),
]
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# The bound: the run is failed (and the ServerApp stopped) within it.
BOUND_SECONDS = 10.0
STARTUP_SECONDS = 300.0  # Flower starting, the sites joining, round 1, on a busy machine
# Flower's own exit, once the ServerApp has stopped: it gives up on the dead SuperLink
# after FORCE_EXIT_TIMEOUT_SECONDS (5 s).
EXIT_SECONDS = 10.0
SITES = ("london", "ohio")


def _run(repo: LedgerRepository) -> RunRecord | None:
    runs = repo.list_runs()
    return runs[0] if runs else None


def _wait_for_round_1(
    repo: LedgerRepository, leftovers: Leftovers, running: Callable[[], bool]
) -> RunRecord:
    deadline = time.monotonic() + STARTUP_SECONDS
    while (run := _run(repo)) is None or run.rounds_completed < 1:
        leftovers.record()  # so that what the SuperLink started is known once it is gone
        assert running(), "the run ended before round 1"
        assert time.monotonic() < deadline, "no round within the start-up time"
        time.sleep(0.3)
    leftovers.record()
    return run


def _failed_within(repo: LedgerRepository, since: float) -> tuple[RunRecord, float]:
    """The run once it is no longer running; fails the test after ``BOUND_SECONDS``."""
    while (run := _run(repo)) is not None and run.status == "running":
        assert time.monotonic() - since < BOUND_SECONDS, "still running: the ServerApp went on"
        time.sleep(0.1)
    assert run is not None
    return run, time.monotonic() - since


def _gone(leftovers: Leftovers, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := leftovers.alive()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _split(out: Path) -> None:
    done = CliRunner().invoke(app, ["data", "split", "--out", str(out), "--sites", ",".join(SITES)])
    assert done.exit_code == 0, done.output


# ============================================== nobody following: the ServerApp notices
def test_a_deployed_serverapp_whose_superlink_died_stops_and_marks_the_run_failed(
    tmp_path: Path, flplatform_home: Path
) -> None:
    _split(tmp_path / "sites")
    env = flower_environment(flplatform_home)
    logs = tmp_path / "logs"
    logs.mkdir()
    superlink, port = start_flower_server(
        [str(BIN / "flower-superlink"), "--insecure", "--disable-runtime-dependency-installation",
         "--host", "127.0.0.1"],
        env=env, log=logs / "superlink.log",
    )  # fmt: skip
    (flplatform_home / "flwr" / "config.toml").write_text(
        f'[superlink]\ndefault = "lab"\n[superlink.lab]\naddress = "127.0.0.1:{port}"\n'
        "insecure = true\n"
    )
    leftovers = Leftovers(superlink.pid)  # SuperExec and flwr-serverapp, below it
    sites: list[subprocess.Popen[bytes]] = []
    repo = LedgerRepository.open(f"sqlite:///{flplatform_home / 'ledger.db'}")
    try:
        for name in SITES:
            node_config = f'data-path="{tmp_path / "sites" / f"{name}.npz"}" site-name="{name}"'
            node, _ = start_flower_server(
                supernode(port, node_config),
                env=env,
                log=logs / f"{name}.log",
            )
            sites.append(node)
        # Detached (no --stream): nothing but the ServerApp follows the run.
        started = subprocess.run(
            [str(BIN / "flwr"), "run", str(ROOT), "lab", "-c",
             "num-server-rounds=200 local-steps=2 local-epochs=0 min-sites=2 "
             f"sites='{','.join(SITES)}'"],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert started.returncode == 0, started.stdout + started.stderr
        _wait_for_round_1(repo, leftovers, lambda: superlink.poll() is None)
        leftovers.named("flwr-serverapp")  # seen, so that it counts among the leftovers

        superlink.kill()
        superlink.wait()  # reaped, as by any parent: Flower's parent monitors then fire too
        killed = time.monotonic()
        run, took = _failed_within(repo, killed)
        print(f"the ServerApp marked the run failed {took:.1f} s after its SuperLink died")
        assert run.status == "failed"
        assert f"the SuperLink at 127.0.0.1:{port} is gone (connection refused for " in (
            run.error or ""
        ), run.error
        time.sleep(3)  # a ServerApp left training would record its next round by now
        after = _run(repo)
        assert after is not None and after.rounds_completed == run.rounds_completed

        left = _gone(leftovers, EXIT_SECONDS)
        assert left == [], f"left {time.monotonic() - killed:.1f} s after the SuperLink died"
    finally:
        repo.close()
        for proc in [superlink, *sites]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for line in leftovers.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split()[0]), signal.SIGKILL)


# ============================================== flplatform server: the command notices
def test_flplatform_server_whose_superlink_died_fails_the_run_and_exits_in_one_line(
    tmp_path: Path,
) -> None:
    server = Machine(tmp_path / "server")
    sites = {name: Machine(tmp_path / name) for name in SITES}
    split = server.home / "split"
    made = server.run("data", "split", "--out", str(split), "--sites", ",".join(SITES))
    assert made.returncode == 0, made.stderr
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    address = f"127.0.0.1:{free_port()}"
    logs = tmp_path / "logs"
    logs.mkdir()
    tree = ProcessTree()
    repo = LedgerRepository.open(db)  # created here first, so that both find it
    try:
        server_proc = server.start(
            tree, logs / "server.log",
            "server", "--insecure", "--sites", ",".join(SITES), "--address", address,
            "--rounds", "200", "--local-steps", "2", "--dataset", str(split),
            "--partition", "files", "--db", db, "--wait-timeout", "180",
        )  # fmt: skip
        leftovers = Leftovers(server_proc.pid)
        wait_for_text(logs / "server.log", "listening for sites", server_proc, tree, 120)
        for name, site in sites.items():
            site.start(
                tree, logs / f"{name}.log",
                "site", name, "--server", address, "--insecure",
                "--data", str(split / f"{name}.npz"),
            )  # fmt: skip
        _wait_for_round_1(repo, leftovers, lambda: server_proc.poll() is None)
        link = leftovers.named("flower-superlink")
        port = _flag(link, "--port")
        leftovers.named("flwr-serverapp")  # seen, so that it counts among the leftovers

        os.kill(link, signal.SIGKILL)
        killed = time.monotonic()
        run, took = _failed_within(repo, killed)
        server_proc.wait(BOUND_SECONDS - took)
        print(f"run failed {took:.1f} s, command exited {time.monotonic() - killed:.1f} s after")
        output = (logs / "server.log").read_text(errors="replace")
        assert server_proc.returncode == 7, output[-3000:]
        reason = f"the SuperLink at 127.0.0.1:{port} is gone (killed by SIGKILL): "
        assert run.status == "failed" and (run.error or "").startswith(reason), run.error
        assert "Traceback" not in output
        # --insecure: the nodes are counted, then named as they named themselves
        assert f"all {len(SITES)} sites connected: {len(SITES)} unauthenticated nodes" in output
        named = next(line for line in output.splitlines() if "named themselves" in line)
        assert all(f"{name} (node " in named for name in SITES), named
        last = output.strip().splitlines()[-1]
        assert last.startswith(f"error: run {run.id} failed: {reason}"), last
        time.sleep(3)
        after = _run(repo)
        assert after is not None and after.rounds_completed == run.rounds_completed
        assert leftovers.alive() == []
    finally:
        repo.close()
        tree.stop()


def _flag(pid: int, flag: str) -> str:
    """The value of ``flag`` on process ``pid``'s command line."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return args[args.index(flag) + 1]
