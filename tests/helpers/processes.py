"""Real processes in the integration tests: what a command left running, the ``flplatform``
command in a subprocess, killed or waited for, and a deployment machine's home.

Processes are found the way a user would look for leftovers: every process seen below the
command while it ran (``/proc``, recorded beforehand, with its start time so that a reused
pid does not count) and every process in their sessions, except the tests' own session.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from sqlalchemy.engine import make_url

from flplatform.launch.flower import start_on_free_port
from flplatform.launch.processes import ProcessTree
from storage import LedgerRepository
from storage.session import create_ledger_engine, normalize_db_url
from tests.helpers.ledgers import sqlite_write_lock

ROOT = Path(__file__).resolve().parents[2]
STARTUP_SECONDS = 300.0  # Flower and Ray starting on a busy 2-core machine


class Leftovers:
    """Every process seen below ``root`` (pid → start time) and the sessions they are in."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: dict[int, int] = {}
        self.sessions: set[int] = set()

    def record(self) -> None:
        # A child the command started without a new session shares the tests' own session:
        # that session is pytest's (its controller, the other xdist workers, the shell that
        # started it), never a leftover, so only the pids seen count there.
        own_session = os.getsid(0)
        table = processes()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        todo = list(children.get(self.root, []))
        while todo:
            pid = todo.pop()
            _, sid, start, _ = table[pid]
            self.seen[pid] = start
            if sid != own_session:
                self.sessions.add(sid)
            todo.extend(children.get(pid, []))

    def alive(self) -> list[str]:
        """The recorded processes still running, with their command lines."""
        table = processes()
        left = [
            pid
            for pid, (_, sid, start, state) in table.items()
            if state != "Z" and (self.seen.get(pid) == start or sid in self.sessions)
        ]
        return [f"{pid} {cmdline(pid)}" for pid in left if pid != os.getpid()]

    def running(self) -> list[int]:
        """The recorded processes still running (pids)."""
        return [int(line.split()[0]) for line in self.alive()]

    def named(self, text: str) -> int:
        [pid] = [pid for pid in self.seen if text in cmdline(pid)]
        return pid


def processes() -> dict[int, tuple[int, int, int, str]]:
    """pid → (ppid, session, start time, state) of every process."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            table[int(entry.name)] = (int(fields[1]), int(fields[3]), int(fields[19]), fields[0])
    return table


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "?"


def flplatform_cli(args: list[str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen(
        [sys.executable, "-c", "from flplatform.cli.app import main; main()", *args],
        env=env,
        cwd=cwd,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )


@contextlib.contextmanager
def commit_holder(db: str) -> Iterator[Callable[[], contextlib.AbstractContextManager[None]]]:
    """A way to hold the ledger's write lock, made once for many holds: while inside a hold,
    the run commits nothing (its writer waits: SQLite's busy timeout is 30 s, a PostgreSQL
    lock wait has no limit); readers read on. One PostgreSQL engine for all of them."""
    url = make_url(db)
    if url.get_backend_name() == "sqlite":
        yield lambda: sqlite_write_lock(str(url.database), timeout=30)
        return
    engine = create_ledger_engine(normalize_db_url(db))

    @contextlib.contextmanager
    def held() -> Iterator[None]:
        with engine.begin() as session:
            session.exec_driver_sql("LOCK TABLE runs, rounds, run_events IN EXCLUSIVE MODE")
            yield

    try:
        yield held
    finally:
        engine.dispose()


@contextlib.contextmanager
def rounds_reached(
    cli: subprocess.Popen[bytes],
    db: str,
    run_id: int | None,
    rounds: int,
    *,
    resumes: int = 0,
    hold: bool = False,
) -> Iterator[tuple[int, Leftovers]]:
    """Wait, while the command runs, until the run has ``rounds`` rounds and ``resumes``
    resumed events: a resume counts only once it has resumed, even when the command before
    it committed one more round than it was stopped for. Gives the run's id and every
    process the command started meanwhile.

    ``hold``: the ledger's commits are held from each look until the block ends
    (:func:`commit_holder`), so that the run is still at that round when the block acts on
    it; a run's last rounds take a fraction of a second, less than one look on a busy
    machine.
    """
    leftovers = Leftovers(cli.pid)
    deadline = time.monotonic() + STARTUP_SECONDS
    holder = commit_holder(db) if hold else contextlib.nullcontext(contextlib.nullcontext)
    with LedgerRepository.open(db) as repository, holder as held:
        while True:
            leftovers.record()
            with held():
                runs = repository.list_runs()
                run = next((r for r in runs if run_id is None or r.id == run_id), None)
                if (
                    run is not None
                    and run.rounds_completed >= rounds
                    and (
                        not resumes
                        or sum(e.kind == "resumed" for e in repository.list_events(run.id))
                        >= resumes
                    )
                ):
                    yield run.id, leftovers
                    return
            assert cli.poll() is None, "the command ended before the round came"
            assert time.monotonic() < deadline, "the round did not come"
            time.sleep(0.05)


def wait_for_rounds(
    cli: subprocess.Popen[bytes],
    db: str,
    run_id: int | None,
    rounds: int,
    *,
    resumes: int = 0,
) -> tuple[int, Leftovers]:
    """:func:`rounds_reached`, returned as soon as it is: the run goes on."""
    with rounds_reached(cli, db, run_id, rounds, resumes=resumes) as reached:
        return reached


def kill_after(
    cli: subprocess.Popen[bytes],
    db: str,
    run_id: int | None,
    rounds: int,
    *,
    resumes: int = 0,
    probe: Callable[[Leftovers], None] | None = None,
) -> int:
    """SIGKILL the command and everything below it once the run has ``rounds`` rounds and
    ``resumes`` resumed events (:func:`rounds_reached`), before it commits another.
    ``probe`` looks at the processes first, while they run."""
    with rounds_reached(cli, db, run_id, rounds, resumes=resumes, hold=True) as reached:
        found, leftovers = reached
        if probe is not None:
            probe(leftovers)
        crash(cli, leftovers)
    time.sleep(1.0)
    assert leftovers.alive() == []
    return found


def crash(proc: subprocess.Popen[bytes], below: Leftovers | None = None) -> None:
    """SIGKILL a process and every process below it at once, as a machine that dies
    (``below``: those recorded under it so far; else recorded now)."""
    if below is None:
        below = Leftovers(proc.pid)
        below.record()
    for pid in [proc.pid, *below.running()]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(10)


def wait_ok(cli: subprocess.Popen[bytes], log: Path) -> None:
    code = cli.wait(timeout=STARTUP_SECONDS * 3)
    text = log.read_text(errors="replace")
    assert code == 0, text[-3000:]
    assert "Traceback" not in text


class Machine:
    """A home of its own and the ``flplatform`` command run there."""

    def __init__(self, home: Path) -> None:
        home.mkdir(parents=True)
        self.home = home
        self.env = {
            **os.environ,
            "FLPLATFORM_HOME": str(home),
            "FLWR_HOME": str(home / "flwr"),
            "PYTHONPATH": str(ROOT),
        }

    def command(self, *args: str) -> list[str]:
        # SIGINT at Python's default, as from a terminal: a pytest-xdist worker starts its
        # children with SIGINT ignored, and the command keeps a signal it finds ignored so
        # (as a shell's background job), so Ctrl-C would not reach it
        start = (
            "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from flplatform.cli.app import main; main()"
        )
        return [sys.executable, "-c", start, *args]

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(*args),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def start(self, tree: ProcessTree, log: Path, *args: str) -> subprocess.Popen[bytes]:
        return tree.popen(
            self.command(*args),
            env=self.env,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def wait_for_text(log: Path, text: str, proc: subprocess.Popen[bytes], tree: ProcessTree,
                  timeout: float) -> str:  # fmt: skip
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tree.record()  # every process the commands start is known, to check none is left
        output = log.read_text(errors="replace")
        if text in output:
            return output
        assert proc.poll() is None, output[-3000:]
        time.sleep(0.5)
    raise AssertionError(f"no {text!r} within {timeout} s:\n{log.read_text()[-3000:]}")


def supernode(link_port: int, node_config: str) -> list[str]:
    """An insecure SuperNode of the SuperLink on 127.0.0.1:``link_port`` (no ``--port``:
    ``start_flower_server`` adds it)."""
    return [
        str(Path(sys.executable).parent / "flower-supernode"),
        "--insecure",
        "--superlink",
        f"127.0.0.1:{link_port}",
        "--node-config",
        node_config,
    ]


def start_flower_server(
    command: list[str],
    *,
    env: dict[str, str],
    log: Path,
    tree: ProcessTree | None = None,
    timeout: float = 60,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start a SuperLink or SuperNode with ``--port`` chosen here; return it and the port.

    Started again on another port when the one chosen was taken meanwhile (the other
    tests' Ray instances open dozens of ports): ``start_on_free_port``. Its output goes to
    ``log``; outside a ``tree`` it runs in a session of its own.
    """

    def start(port: int) -> subprocess.Popen[bytes]:
        args = [*command, "--port", str(port)]
        output = log.open("wb")
        if tree is not None:
            return tree.popen(
                args, env=env, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT
            )
        return subprocess.Popen(
            args,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    return start_on_free_port(start, log, what=Path(command[0]).name, timeout=timeout)
