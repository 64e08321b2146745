"""Flower's processes as flplatform starts them: a SuperLink, ``flwr run``, their environment.

A simulation is what ``flwr run .`` runs: a SuperLink in simulation mode (started here, on
free loopback ports, with runtime dependency installation off), then ``flwr run`` of a
Flower app with the run config as overrides. Every process goes into a ``ProcessTree``
that stops it with the command. A port is chosen here and taken by Flower later, so a
server whose port another process took in between is started again
(:func:`start_on_free_port`). Following a run and sweeps are ``launch.simulation``'s;
staging an app directory for ``flwr run`` is ``launch.staging``'s.
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from flplatform.app.config import RunConfig
from flplatform.core.errors import ConfigError, RunFailed
from flplatform.core.text import seconds_text
from flplatform.launch.processes import ProcessTree, listens_on
from flplatform.launch.staging import staged_app
from flplatform.run.options import OPTIONS_ENV, ConfigValue
from flplatform.run.owner import OWNER_ENV, owner_token
from flplatform.run.run_record import DEPLOYMENT_ENV
from storage.session import PASSWORD_ENV, detach_password, flplatform_home

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception)\b:")

# Files under $FLPLATFORM_HOME/logs (the processes' output, run configs, the SuperLink's
# state) and whatever Flower's processes write are readable by their owner only: they may
# hold what the run was given and what its sites sent.
OWNER_ONLY_UMASK = 0o077

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
    env.pop(DEPLOYMENT_ENV, None)  # flplatform server sets it for its own processes only
    # A ledger password reaches the ServerApp in a password file (storage.session.
    # detach_password), not in the environment of every process: Ray's included.
    env.pop(PASSWORD_ENV, None)
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
            # The simulation ends itself once this command is gone (run/owner.py).
            OWNER_ENV: owner_token() or "",
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
        "# Written by flplatform (flplatform/launch/flower.py): Flower's flwr-simulation with\n"
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


def logs_dir(home: Path) -> Path:
    """``home/logs``, created if needed, owner-only (0700) also when an older run made it."""
    logs = home / "logs"
    logs.mkdir(mode=0o700, parents=True, exist_ok=True)
    logs.chmod(0o700)
    return logs


def private_file(path: Path, *, append: bool = False) -> BinaryIO:
    """``path`` opened for writing, emptied first unless ``append``, readable by its owner
    only (0600). Every write goes to the file's end: the processes that share it (a
    SuperNode's SuperExec, a later start's) never write over each other's lines."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if append else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
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
    raise StartTimedOut(f"{what} did not start within {seconds_text(timeout)} s; see {log}")


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
