"""Start a simulated federation with Flower's own machinery.

``flplatform simulate`` runs exactly what ``flwr run .`` runs: a SuperLink in simulation
mode (started here, on free loopback ports, with runtime dependency installation off),
then ``flwr run`` of this project's Flower app with the run config as overrides. The
ServerApp writes the ledger; the caller follows progress by reading the ledger.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

from flplatform.app.config import RunConfig
from flplatform.app.sweep import check_members, sweep_run_config
from flplatform.core.errors import ConfigError, RunFailed, RunStopped, StorageError
from flplatform.launch.app_directory import AppRun
from flplatform.launch.processes import (
    ProcessTree,
    StopRequested,
    listens_on,
    stop_reason,
)
from flplatform.run.options import OPTIONS_ENV, ConfigValue
from storage import (
    UPDATE_DROPPED,
    UPDATE_REJECTED,
    LedgerRepository,
    RoundRecord,
    RunRecord,
    UpdateRecord,
)
from storage.session import default_db_url, detach_password, flplatform_home, normalize_db_url

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception)\b:")

# Files under $FLPLATFORM_HOME/logs (the processes' output, run configs, the SuperLink's
# state) and whatever Flower's processes write are readable by their owner only: they may
# hold what the run was given and what its sites sent.
OWNER_ONLY_UMASK = 0o077

# Called at every poll with the run (None until the ServerApp records it), its rounds so
# far, and the dropped and rejected updates of the latest round (so a display can say why).
ProgressCallback = Callable[[RunRecord | None, list[RoundRecord], list[UpdateRecord]], None]

# The source tree's root: the directory above the flplatform package.
_PROJECT_ROOT = Path(__file__).resolve().parents[2]


def project_dir() -> Path:
    """The directory holding this project's pyproject.toml with ``[tool.flwr.app]``."""
    root = _PROJECT_ROOT
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
            # they must find this environment's scripts first, and flwr-simulation ours.
            "PATH": os.pathsep.join(
                [str(_simulation_script_dir(home)), str(Path(sys.executable).parent)]
                + ([env["PATH"]] if env.get("PATH") else [])
            ),
            "PYTHONUNBUFFERED": "1",
            "RAY_DEDUP_LOGS": "0",
            # torch backs large CPU tensors with transparent huge pages: fewer page faults
            # on the first write into fresh memory.
            "THP_MEM_ALLOC_ENABLE": "1",
        }
    )
    (home / "flwr").mkdir(parents=True, exist_ok=True)
    return env


def _simulation_script_dir(home: Path) -> Path:
    """A directory holding our ``flwr-simulation`` (``flplatform.launch.simulation_runtime``).

    SuperExec starts the simulation process by that name; ours runs Flower's with the
    Ray actors of dead sites replaced (see that module for why).
    """
    directory = home / "bin"
    directory.mkdir(parents=True, exist_ok=True)
    # The package's own root comes last on sys.path: where flplatform is installed, the
    # installed one is found first, as in the CLI.
    script = (
        f"#!{sys.executable}\n"
        "# Written by flplatform (flplatform/launch/simulation.py): Flower's flwr-simulation with\n"
        "# flplatform's adaptations (flplatform/launch/simulation_runtime.py).\n"
        "import sys\n"
        f"sys.path.append({str(_PROJECT_ROOT)!r})\n"
        "from flplatform.launch.simulation_runtime import main\n"
        "main()\n"
    )
    path = directory / "flwr-simulation"
    if not path.exists() or path.read_text() != script:
        # Written aside and renamed: another run starting now may be executing it.
        temporary = directory / f".flwr-simulation.{os.getpid()}"
        temporary.write_text(script)
        temporary.chmod(0o755)
        temporary.replace(path)
    return directory


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def flower_command(name: str) -> str:
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
    """A running ``flwr run``, the SuperLink it talks to, and every process below them."""

    superlink: subprocess.Popen[bytes]
    run: subprocess.Popen[bytes]
    log_path: Path
    superlink_log: Path
    tree: ProcessTree
    # Where the SuperLink listens (its Runtime API, on 127.0.0.1): the run's reason names
    # it as the ServerApp's own watch does (engine/link).
    superlink_port: int | None = None
    # Why the simulation ended early, when its SuperLink exited on its own (noted when
    # it is seen, before ``stop`` ends the SuperLink too).
    link_lost: str | None = None

    def poll(self) -> int | None:
        """Exit code of ``flwr run``, or None while it runs."""
        return self.run.poll()

    def superlink_exited(self) -> bool:
        """Whether the SuperLink exited on its own; the first time, note why."""
        code = self.superlink.poll()
        if code is not None and self.link_lost is None:
            from flplatform.engine.link import gone_reason  # (imports Flower: only now)

            how = describe_exit(code)
            if self.superlink_port is None:
                self.link_lost = f"the SuperLink exited ({how}) while the run was going"
            else:
                self.link_lost = gone_reason(("127.0.0.1", self.superlink_port), how)
            self.link_lost += f"; see {self.superlink_log}"
        return code is not None

    def stop(self) -> None:
        """Stop ``flwr run``, the SuperLink and every process they started (``ProcessTree``)."""
        self.tree.stop()

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


def describe_exit(code: int) -> str:
    """A process's exit status in words: ``exit code 1``, ``killed by SIGKILL``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


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


ACTORS_ENV = "FLPLATFORM_SIMULATION_ACTORS"


def federation_options(num_sites: int) -> str:
    """Flower's simulation federation: one SuperNode per site, one CPU per actor.

    The actors are the processes the simulated sites train in, one site at a time each:
    ``FLPLATFORM_SIMULATION_ACTORS`` of them when set, else one per core, at most 4 and at
    most one per site (each imports torch; on 2 cores, two fit). Results on the simulated
    clock do not depend on it (each site's work is seeded by (seed, round, site)); a site
    slow in real time keeps the others of its actor waiting, against the real round timeout.
    """
    actors = simulation_actors(num_sites)
    return f"num-supernodes={num_sites} client-resources-num-cpus=1 init-args-num-cpus={actors}"


def simulation_actors(num_sites: int) -> int:
    """How many simulated sites train at once (see ``federation_options``)."""
    given = os.environ.get(ACTORS_ENV, "").strip()
    if not given:
        return max(1, min(num_sites, os.cpu_count() or 2, 4))
    if not (given.isascii() and given.isdecimal()) or int(given) < 1:
        raise ConfigError(
            f"{ACTORS_ENV} must be a whole number >= 1 (simulated sites training at once), "
            f"got {given!r}"
        )
    return min(int(given), num_sites)


def start_simulation(
    config: RunConfig,
    *,
    home: Path,
    log_name: str,
    tree: ProcessTree,
    app_dir: Path | None = None,
) -> SimulationProcess:
    """Start a SuperLink and ``flwr run`` a Flower app (this project's by default).

    The ledger's URL travels without its password, which reaches the ServerApp in its
    environment (``storage.session.detach_password``).
    """
    ledger, password_env = detach_password(config.db)
    return start_app(
        app_dir or project_dir(),
        home=home,
        log_name=log_name,
        tree=tree,
        run_config={**config.to_run_config(), "db": ledger},
        num_sites=config.num_sites,
        extra_env=password_env,
        python_path=model_dirs(config.model),
    )


def model_dirs(model: str) -> tuple[Path, ...]:
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
    tree: ProcessTree,
    run_config: Mapping[str, ConfigValue],
    num_sites: int,
    extra_env: Mapping[str, str] | None = None,
    python_path: Sequence[Path] = (),
) -> SimulationProcess:
    """Start a SuperLink and ``flwr run app_dir`` on it with ``run_config`` overrides.

    ``extra_env`` reaches the ServerApp and ClientApp processes: the SuperLink starts
    them (through SuperExec) with its own environment. Every process is started in
    ``tree``: whoever made it stops them (``tree.stop()``), also when this raises.
    """
    federation = federation_options(num_sites)  # a bad actor count fails before anything starts
    env = flower_environment(home, python_path=python_path)
    env.update(extra_env or {})
    superlink, superlink_log = start_superlink(env, home=home, log_name=log_name, tree=tree)
    extra = ["--federation-config", federation]
    run, log_path = start_flwr_run(
        app_dir,
        "local",
        extra,
        run_config=run_config,
        env=env,
        home=home,
        log_name=log_name,
        tree=tree,
    )
    port = int(env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"])  # set by start_superlink
    return SimulationProcess(superlink, run, log_path, superlink_log, tree, superlink_port=port)


def start_flwr_run(
    app_dir: Path,
    connection: str,
    extra_args: Sequence[str] = (),
    *,
    run_config: Mapping[str, ConfigValue],
    env: Mapping[str, str],
    home: Path,
    log_name: str,
    tree: ProcessTree,
) -> tuple[subprocess.Popen[bytes], Path]:
    """Start ``flwr run app_dir connection --stream`` in ``tree``; return it and its log.

    ``run_config`` goes in an owner-only TOML file (``--run-config``), not on the command
    line, where every user of the machine could read it.
    """
    logs = logs_dir(home)
    overrides: list[str] = []
    if run_config:
        path = logs / f"{log_name}.run-config.toml"
        with private_file(path) as file:
            file.write(run_config_toml(dict(run_config)).encode())
        overrides = ["--run-config", str(path)]
    log_path = logs / f"{log_name}.log"
    run = tree.popen(
        [
            flower_command("flwr"),
            "run",
            str(staged_app(app_dir, home)),
            connection,
            *overrides,
            *extra_args,
            "--stream",
        ],
        env=dict(env),
        cwd=str(home),
        stdout=private_file(log_path),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        umask=OWNER_ONLY_UMASK,
    )
    return run, log_path


# Directories Flower would walk file by file and pack nothing from: a virtual environment
# inside the app directory (the README's set-up makes .venv there: some 50,000 files, 3.5 s
# of CPU per start-up), git's store, bytecode caches.
NEVER_PACKED = frozenset({".git", "__pycache__"})
STAGED_KEPT_SECONDS = 7 * 24 * 3600  # a staged copy unused this long is removed


def staged_app(app_dir: Path, home: Path) -> Path:
    """A copy of what ``flwr run`` packs from ``app_dir``, for it to walk instead.

    Flower builds the FAB by walking every file under the app directory and filtering
    afterwards. The copy holds the files Flower's own filter keeps (its include and exclude
    patterns, the app's ``.gitignore``), found without entering virtual environments (any
    directory with a ``pyvenv.cfg``), git's store or this platform's home: the FAB holds
    what it held. The copy is named by its contents (``home/apps/<hash>``), made once per
    version of the app and shared by concurrent runs; copies unused for a week are removed.
    """
    from flwr.cli.utils import filter_paths_for_publish  # the filter `flwr run` applies

    root = app_dir.resolve()
    skip = {home.resolve(), flplatform_home().resolve()}
    found: dict[str, Path] = {}
    for directory, subdirs, names in os.walk(root):
        here = Path(directory)
        subdirs[:] = [
            d
            for d in subdirs
            if d not in NEVER_PACKED
            and (here / d).resolve() not in skip
            and not (here / d / "pyvenv.cfg").exists()
        ]
        for name in names:
            path = here / name
            if not path.is_symlink():  # Flower skips symlinks too
                found[path.relative_to(root).as_posix()] = path
    try:
        kept = filter_paths_for_publish(found)
        contents = {
            name: path.read_bytes() if isinstance(path, Path) else path
            for name, path in sorted(kept.items())
        }
    except OSError as exc:
        raise RunFailed(f"cannot read the app directory {root}: {exc}") from exc
    except Exception as exc:  # Flower's own refusal (a path nested too deep, ...)
        raise RunFailed(f"flwr run cannot pack {root}: {exc}") from exc
    digest = hashlib.sha256()
    for name, content in contents.items():
        digest.update(f"{name}\0{len(content)}\0".encode())
        digest.update(content)
    apps = home / "apps"
    staged = apps / digest.hexdigest()[:16]
    if not staged.is_dir():
        apps.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(dir=apps, prefix=".staging-"))
        try:
            for name, content in contents.items():
                target = building / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
            building.rename(staged)
        except OSError as exc:
            shutil.rmtree(building, ignore_errors=True)
            if not staged.is_dir():  # not a concurrent run that made the same copy first
                raise RunFailed(f"cannot stage the app {root} in {apps}: {exc}") from exc
    os.utime(staged)  # in use: kept
    _remove_unused(apps, keep=staged)
    return staged


def _remove_unused(apps: Path, *, keep: Path) -> None:
    """Staged copies (and half-made ones) nobody used for ``STAGED_KEPT_SECONDS``."""
    cutoff = time.time() - STAGED_KEPT_SECONDS
    for entry in apps.iterdir():
        with contextlib.suppress(OSError):
            if entry != keep and entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry)


def logs_dir(home: Path) -> Path:
    """``home/logs``, created if needed, owner-only (0700) also when an older run made it."""
    logs = home / "logs"
    logs.mkdir(mode=0o700, parents=True, exist_ok=True)
    logs.chmod(0o700)
    return logs


def private_file(path: Path) -> BinaryIO:
    """``path`` opened for writing from its start, readable by its owner only (0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a file an older run wrote may be readable by others
    return os.fdopen(fd, "wb")


def start_superlink(
    env: dict[str, str], *, home: Path, log_name: str, tree: ProcessTree | None = None
) -> tuple[subprocess.Popen[bytes], Path]:
    """Start a simulation SuperLink on free loopback ports; return it and its log.

    ``env`` (from :func:`flower_environment`) is the SuperLink's, and so that of the app
    processes it starts; the ports are written into it, so that ``flwr run APP local``
    run with ``env`` uses this SuperLink. It is started in ``tree`` (a tree of its own
    when None: stop it with :func:`stop_process`).
    """
    logs = logs_dir(home)
    superlink_log = logs / f"{log_name}.superlink.log"

    def start(http_port: int) -> subprocess.Popen[bytes]:
        control_port = free_port()
        # `flwr run APP local` uses a SuperLink on these ports; we start it ourselves so
        # that it runs with our flags and stops with the run.
        env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"] = str(http_port)
        env["FLWR_LOCAL_CONTROL_API_PORT"] = str(control_port)
        return (tree or ProcessTree()).popen(
            [
                flower_command("flower-superlink"),
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
            stdout=private_file(superlink_log),
            stderr=subprocess.STDOUT,
            umask=OWNER_ONLY_UMASK,  # its state database among what it writes
        )

    superlink, _ = start_on_free_port(start, superlink_log)
    return superlink, superlink_log


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """Stop a process started in a session of its own, and every process below it."""
    tree = ProcessTree()
    tree.adopt(proc)
    tree.stop()


def wait_for_port(
    port: int,
    proc: subprocess.Popen[bytes],
    log: Path,
    timeout: float = 30,
    *,
    what: str = "the SuperLink",
) -> None:
    """Return once ``proc`` listens on 127.0.0.1:``port``; fail if it exits first.

    Where ``/proc`` tells which process listens, another process that took the port
    meanwhile does not count (see :func:`start_on_free_port`).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RunFailed(f"{what} exited with code {proc.returncode}; see {log}")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(0.2)
            # Flower's servers listen in their main process; not False: /proc cannot tell
            if (
                sock.connect_ex(("127.0.0.1", port)) == 0
                and listens_on(proc.pid, port) is not False
            ):
                return
        time.sleep(0.1)
    stop_process(proc)
    raise StartTimedOut(f"{what} did not start within {timeout:.0f} s; see {log}")


class StartTimedOut(RunFailed):
    """A server process did not listen in time (and was stopped)."""


PORT_ATTEMPTS = 5
_PORT_TAKEN = re.compile(r"address already in use", re.IGNORECASE)


def start_on_free_port(
    start: Callable[[int], subprocess.Popen[bytes]],
    log: Path,
    *,
    what: str = "the SuperLink",
    attempts: int = PORT_ATTEMPTS,
    timeout: float = 30,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start a process listening on a loopback port chosen here; return it and the port.

    ``start(port)`` starts it, writing its output to ``log``. A port is free only when
    :func:`free_port` looks: another process (Ray opens dozens of ports) can bind it before
    ours does, and ours then exits with "address already in use". Such a process is started
    again on another port, ``attempts`` times in all; any other failure fails at once.
    A process that is still starting when this is interrupted is stopped.
    """
    attempt = 1
    while True:
        port = free_port()
        proc = start(port)
        try:
            wait_for_port(port, proc, log, timeout, what=what)
        except RunFailed:
            if attempt < attempts and proc.poll() is not None and _port_was_taken(log):
                attempt += 1
                continue
            raise
        except BaseException:  # Ctrl-C while it starts, too: nothing is left behind
            stop_process(proc)
            raise
        return proc, port


def _port_was_taken(log: Path) -> bool:
    with contextlib.suppress(OSError):
        return _PORT_TAKEN.search(log.read_text(errors="replace")) is not None
    return False


def run_config_toml(values: Mapping[str, ConfigValue]) -> str:
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
    ledger) when it does not finish, ``RunStopped`` when SIGINT or SIGTERM stopped it
    (see :func:`follow_run`), and ``StorageError`` when the ledger cannot be opened.
    """
    home = work_home()
    db_url = check_ledger(config)
    tag = uuid.uuid4().hex
    config = RunConfig.from_mapping({**config.to_run_config(), "run-tag": tag, "db": db_url})

    def start(tree: ProcessTree) -> SimulationProcess:
        return start_simulation(config, home=home, log_name=tag[:12], tree=tree, app_dir=app_dir)

    return follow_run(start, config, on_progress, poll_interval)


def resume_simulation(
    config: RunConfig,
    *,
    on_progress: ProgressCallback | None = None,
    poll_interval: float = 0.5,
) -> RunRecord:
    """Resume a run of the built-in app (``flplatform resume``): ``config`` is the run's own,
    with ``resume_run`` set, its ``run_tag`` and ``db``; the run must already be reopened
    (running) so that following it does not stop at once.

    Returns the finished run; raises like :func:`run_simulation`.
    """
    home = work_home()

    def start(tree: ProcessTree) -> SimulationProcess:
        return start_simulation(config, home=home, log_name=config.run_tag[:12], tree=tree)

    return follow_run(start, config, on_progress, poll_interval)


def run_app(
    run: AppRun,
    *,
    on_progress: ProgressCallback | None = None,
    poll_interval: float = 0.5,
) -> RunRecord:
    """Run a user's Flower app directory (``flplatform run``) and follow it in the ledger.

    The run is found by ``run.tag``: flplatform's ServerApp reads it from the ``run-tag``
    key, ``flplatform.start`` from ``FLPLATFORM_OPTIONS``. Returns the finished run;
    raises ``RunFailed`` and ``RunStopped`` like :func:`run_simulation`.
    """
    home = work_home()
    started: list[SimulationProcess] = []

    def start(tree: ProcessTree) -> SimulationProcess:
        process = start_app(
            run.app.path,
            home=home,
            log_name=run.tag[:12],
            tree=tree,
            run_config=run.run_config,
            num_sites=run.num_sites,
            extra_env=run.environment(),
            python_path=run.python_path,
        )
        started.append(process)
        return process

    # What _follow reads: where the run is recorded and its tag.
    follow = replace(RunConfig(), db=run.db_url, run_tag=run.tag)
    try:
        return follow_run(start, follow, on_progress, poll_interval)
    except RunStopped:
        raise
    except RunFailed:
        if not started or started[0].poll() != 0 or _has_run(follow):
            raise
        raise RunFailed(
            f"app '{run.app.name}' recorded no run in the ledger ({started[0].last_error()}); "
            f"`flplatform run` follows ServerApps that call flplatform.start(...) or are "
            f"flplatform's own; log: {started[0].log_path}"
        ) from None


def _has_run(config: RunConfig) -> bool:
    with LedgerRepository.open(config.db) as repository:
        return repository.find_run_by_tag(config.run_tag) is not None


def follow_run(
    start: Callable[[ProcessTree], SimulationProcess],
    config: RunConfig,
    on_progress: ProgressCallback | None = None,
    poll_interval: float = 0.5,
) -> RunRecord:
    """Start a simulation with ``start``, follow its run to the end, stop every process.

    Whatever happens, every process ``start`` started is stopped before this returns or
    raises (``ProcessTree``). Ctrl-C (``KeyboardInterrupt``) or ``StopRequested`` (the
    CLI's SIGINT and SIGTERM, see ``processes.stop_signals``), during start-up too, stops
    them first, then marks the run failed with "stopped by the user (SIGINT)" and raises
    ``RunStopped``: nothing is left running that could write to the run afterwards.
    """
    with ProcessTree() as tree:
        try:
            process = start(tree)
            run_id = _follow(process, config, on_progress, poll_interval)
            tree.stop()  # before the status is read: nothing may write to the run later
        except KeyboardInterrupt as exc:
            tree.stop()
            raise _stopped(config, exc) from None
    return _final_record(process, config, run_id)


def _stopped(config: RunConfig, exc: KeyboardInterrupt) -> RunStopped:
    """Mark the stopped run failed, if it was still running; return the error to raise."""
    reason = stop_reason(exc)
    code = exc.exit_code if isinstance(exc, StopRequested) else RunStopped.exit_code
    try:
        with LedgerRepository.open(config.db) as repository:
            record = repository.find_run_by_tag(config.run_tag)
            if record is None:
                return RunStopped(f"{reason} before the run started", exit_code=code)
            if record.status != "running":
                return RunStopped(f"{reason}; run {record.id} had {record.status}", exit_code=code)
            repository.finish_run(record.id, status="failed", error=reason)
    except StorageError as exc_storage:
        return RunStopped(
            f"{reason}; the run could not be marked failed: {exc_storage.reason}", exit_code=code
        )
    return RunStopped(
        f"run {record.id} {reason} after {record.rounds_completed} of "
        f"{record.num_rounds_planned} rounds; it is marked failed",
        exit_code=code,
    )


def _final_record(process: SimulationProcess, config: RunConfig, run_id: int) -> RunRecord:
    """The run once every process is stopped; ``RunFailed`` unless it finished."""
    record = _settled_record(process, config, run_id)
    if record.status != "finished":
        raise RunFailed(
            f"run {record.id} failed: {record.error or process.last_error()}; "
            f"log: {process.log_path}"
        )
    forget_snapshots(record)
    return record


def forget_snapshots(record: RunRecord) -> None:
    """Delete a finished run's site snapshots (only a resume needs them), where its
    simulated sites wrote them: the state root in the environment they ran with."""
    # The mods load torch: imported here, so the CLI starts without it.
    from strategies.mods.snapshots import forget_run

    # the sites' environment as flower_environment sets it: the home, the rest inherited
    forget_run(record.tag or "", environ={**os.environ, "FLPLATFORM_HOME": str(work_home())})


def _settled_record(process: SimulationProcess, config: RunConfig, run_id: int) -> RunRecord:
    """The run once every process is stopped; failed with the reason if it was left running."""
    with LedgerRepository.open(config.db) as repository:
        record = repository.get_run(run_id)
        if record.status == "running":  # the ServerApp died without a word
            reason = process.link_lost or f"simulation exited: {process.last_error()}"
            repository.finish_run(run_id, status="failed", error=reason)
            record = repository.get_run(run_id)
    return record


def _follow(
    process: SimulationProcess,
    config: RunConfig,
    on_progress: ProgressCallback | None,
    poll_interval: float,
) -> int:
    """Poll the ledger until the run leaves "running", Flower exits or the SuperLink dies.

    Returns the run id. Each poll records the process tree, so that the processes of a
    SuperLink that dies are still found and stopped.
    """
    run_id: int | None = None
    with LedgerRepository.open(config.db) as repository:
        while True:
            process.tree.record()
            # Both asked: when the SuperLink dies, `flwr run` (streaming from it) exits too.
            link_gone = process.superlink_exited()
            exited = process.poll() is not None or link_gone
            record = repository.find_run_by_tag(config.run_tag)
            if record is not None:
                run_id = record.id
                if link_gone and record.status == "running":
                    record = _fail_first(repository, record.id, process.link_lost or "")
            if on_progress is not None:
                done = repository.list_rounds(record.id) if record else []
                on_progress(record, done, _latest_failures(repository, done))
            if exited or (record is not None and record.status != "running"):
                break
            time.sleep(poll_interval)
    if run_id is None:
        reason = process.link_lost or f"flwr exited with {process.poll()}"
        raise RunFailed(
            f"the simulation stopped before the ServerApp started ({reason}): "
            f"{process.last_error()}; log: {process.log_path}"
        )
    return run_id


def _fail_first(repository: LedgerRepository, run_id: int, reason: str) -> RunRecord:
    """Mark the run failed with ``reason`` before its processes are stopped.

    Its SuperLink is gone: the ServerApp, still running until the tree is stopped, can
    then write nothing more to the run (the ledger refuses rows for a run that is not
    running), nor record some other reason of its own as it is stopped.
    """
    with contextlib.suppress(StorageError):  # it ended meanwhile, as it said itself
        repository.finish_run(run_id, status="failed", error=reason)
    return repository.get_run(run_id)


# ========================================================================== sweeps
# Called at every poll with the member's index (in the order given), then as
# ``ProgressCallback``: its run (None until recorded), its rounds so far, the latest
# round's dropped and rejected updates.
SweepProgress = Callable[[int, RunRecord | None, list[RoundRecord], list[UpdateRecord]], None]


class SweepFailed(RunFailed):
    """Runs of a sweep failed or never started; the others finished.

    ``records``: every member's run as the ledger has it, in the members' order (None for
    a member that never started).
    """

    def __init__(self, reason: str, records: Sequence[RunRecord | None]) -> None:
        super().__init__(reason)
        self.records = list(records)


def run_sweep(
    members: Sequence[RunConfig],
    *,
    on_progress: SweepProgress | None = None,
    poll_interval: float = 0.5,
) -> list[RunRecord]:
    """Run ``members`` in one Flower simulation, one after another, and follow each.

    One SuperLink and one Ray start-up; each member is a run of its own in the ledger
    (its own tag and name, and as its config its own options, so that ``flplatform
    resume`` continues it alone). They must share their sites and ledger
    (``sweep.check_members``). A member that fails is recorded failed and the next one
    runs. Ctrl-C or SIGTERM stops every process, marks the member that was running failed
    and raises ``RunStopped``; members not started get no run.

    Returns
    -------
    list of RunRecord
        Each member's finished run, in order.

    Raises
    ------
    ConfigError
        If the members cannot share one federation.
    SweepFailed
        Naming the members that failed or never started, once the others have finished
        (every recorded run is in the ledger, and in the error's ``records``).
    RunStopped, StorageError
        As :func:`run_simulation`.
    """
    check_members(members)
    home = work_home()
    db_url = check_ledger(members[0])
    tagged = [
        RunConfig.from_mapping(
            {**m.to_run_config(), "run-tag": uuid.uuid4().hex, "db": db_url, "name": m.run_name}
        )
        for m in members
    ]
    flower_config = sweep_run_config(tagged)
    log_name = tagged[0].run_tag[:12]
    run_ids: list[int | None] = [None] * len(tagged)
    current = tagged[0]
    with ProcessTree() as tree:
        try:
            ledger, password_env = detach_password(db_url)
            process = start_app(
                project_dir(),
                home=home,
                log_name=log_name,
                tree=tree,
                run_config={**flower_config, "db": ledger},
                num_sites=tagged[0].num_sites,
                extra_env=password_env,
                python_path=tuple(dict.fromkeys(d for m in tagged for d in model_dirs(m.model))),
            )
            for index, member in enumerate(tagged):
                current = member
                shown = None if on_progress is None else functools.partial(on_progress, index)
                try:
                    run_ids[index] = _follow(process, member, shown, poll_interval)
                except RunFailed:
                    break  # the simulation ended before this member started
            tree.stop()  # before the statuses are read: nothing may write to a run later
        except KeyboardInterrupt as exc:
            tree.stop()
            stopped = _stopped(current, exc)
            for member in tagged:
                if member is not current:
                    _stopped(member, exc)  # one the ServerApp began since the last poll
            raise stopped from None
    records = [
        _settled_record(process, member, run_id) if run_id is not None else None
        for member, run_id in zip(tagged, run_ids, strict=True)
    ]
    for record in records:
        if record is not None and record.status == "finished":
            forget_snapshots(record)
    troubles = [
        f"'{member.run_name}' "
        + (f"(run {record.id}) failed: {record.error}" if record else "never started")
        for member, record in zip(tagged, records, strict=True)
        if record is None or record.status != "finished"
    ]
    if troubles:
        never = "" if all(records) else f" ({process.last_error()})"
        raise SweepFailed(
            f"{len(troubles)} of {len(tagged)} runs of the sweep did not finish: "
            f"{'; '.join(troubles)}{never}; log: {process.log_path}",
            records,
        )
    return [record for record in records if record is not None]


def _latest_failures(repository: LedgerRepository, done: list[RoundRecord]) -> list[UpdateRecord]:
    """The dropped and rejected updates of the latest round; no query when it had none."""
    if not done or not (done[-1].num_dropped or done[-1].num_rejected):
        return []
    latest = done[-1]
    return repository.list_updates(
        latest.run_id, round=latest.round, status=(UPDATE_DROPPED, UPDATE_REJECTED)
    )
