"""``flplatform server``: a TLS SuperLink with registered sites, and a federation run on it.

What runs, and where:

* ``flower-superlink`` with TLS (the deployment's ``server.crt``), SuperNode
  authentication and its state in ``$FLPLATFORM_HOME/deployments/<id>/superlink.db``
  (node ids survive a restart), listening on 127.0.0.1 only: Flower 1.41 serves its
  Control API (unauthenticated) on the same port as the Fleet API;
* the Fleet gateway (``flplatform.deploy.gateway``) on the address sites dial, passing
  them the Fleet API only, and reporting refused connections;
* ``flwr run APP CONN --stream``, once every site is connected, through a CLI connection
  ``flplatform-<id>`` in ``$FLWR_HOME/config.toml``.

Each site's ``NAME.pub`` is registered with ``flwr supernode register``, which answers
with the node id Flower gives that key; the ids by name go to ``registry.json`` beside the
database, whose path the ServerApp gets in ``FLPLATFORM_SITE_REGISTRY`` (the SuperLink's
environment is that of the ServerApp processes it starts): the ledger then names each
site as registered, whatever the site claims. Keys registered before and no longer
among ``--sites`` are unregistered, so exactly the named sites can join.

The deployment is identified by its CA certificate: restarting ``flplatform server``
with the same ``--certs`` reuses its state. ``--insecure`` runs the SuperLink and the
gateway without TLS and without site authentication.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flplatform.app.config import RunConfig
from flplatform.core.errors import ConfigError, FLPlatformError, RunFailed
from flplatform.core.files import make_private_dirs
from flplatform.core.site_registry import REGISTRY_ENV, RegisteredSite, SiteRegistry
from flplatform.core.text import seconds_text
from flplatform.deploy.addresses import Address, parse_address
from flplatform.deploy.certs import ServerCerts, check_site_name, fingerprint, site_public_key
from flplatform.deploy.gateway import JOINED, LEFT, READY_LINE
from flplatform.engine.events import PRESENCE_EVENTS, presence_sentence
from flplatform.launch.flower import (
    OWNER_ONLY_UMASK,
    SimulationProcess,
    describe_exit,
    flower_command,
    flower_environment,
    logs_dir,
    private_file,
    start_flwr_run,
    start_on_free_port,
    telling_line,
)
from flplatform.launch.processes import ProcessTree
from flplatform.launch.simulation import ProgressCallback, follow_run
from flplatform.run.options import ConfigValue
from flplatform.run.run_record import DEPLOYMENT_ENV, WAIT_TIMEOUT_KEY
from storage import (
    RUN_RUNNING,
    LedgerRepository,
    RoundRecord,
    RunRecord,
    SiteRecord,
    UpdateRecord,
)

DEFAULT_ADDRESS = "0.0.0.0:9092"  # Flower's traditional Fleet API port
DEFAULT_WAIT_SECONDS = 600.0
# Seconds between `flwr supernode list` calls while waiting for the sites, at least: each
# is a Python process importing Flower (about 1.5 CPU-s). The list is read again as soon
# as that allows when the gateway reports a node that joined or left; else the wait
# between calls grows to a tenth of the time waited, LIST_LONGEST_SECONDS at most (a join
# the gateway says once a minute per address, as several --insecure sites behind one
# address do, is seen that late).
LIST_INTERVAL_SECONDS = 2.0
LIST_LONGEST_SECONDS = 10.0
# Seconds between looks at the gateway's reports while waiting.
GATEWAY_LOOK_SECONDS = 0.5
# Seconds between "still waiting for ..." lines.
WAITING_NOTE_SECONDS = 30.0
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]

# Says one line to the user (the CLI prints it literally).
Say = Callable[[str], None]


@dataclass(frozen=True)
class ServerPlan:
    """A checked ``flplatform server``: its sites, address, certificates and keys."""

    sites: tuple[str, ...]
    address: Address
    certs: ServerCerts | None  # None: --insecure
    public_keys: Mapping[str, Path] = field(default_factory=dict)  # site → NAME.pub
    fingerprints: Mapping[str, str] = field(default_factory=dict)  # site → SHA256:…
    wait_timeout: float = DEFAULT_WAIT_SECONDS

    @property
    def insecure(self) -> bool:
        return self.certs is None

    @property
    def deployment_id(self) -> str:
        """The deployment's name: its CA's, so a restart with the same --certs resumes it."""
        if self.certs is None:
            return "insecure"
        return "ca-" + hashlib.sha256(self.certs.ca_cert.read_bytes()).hexdigest()[:12]

    @property
    def connection(self) -> str:
        """The ``flwr`` CLI connection name for this deployment's SuperLink."""
        return f"flplatform-{self.deployment_id}"


@dataclass(frozen=True)
class DeployedRun:
    """What to ``flwr run`` on the deployment: an app, its run config, its environment."""

    app_dir: Path
    run_config: Mapping[str, ConfigValue]
    tag: str
    extra_env: Mapping[str, str] = field(default_factory=dict)  # reaches the ServerApp
    python_path: tuple[Path, ...] = ()
    # The logs' names in the home's logs folder: the tag's start; a resume's, its own, so
    # that the logs of the start that died are kept.
    log_name: str = ""

    @property
    def logs(self) -> str:
        return self.log_name or self.tag[:12]


def plan_server(
    *,
    sites: Sequence[str],
    certs_dir: Path | None,
    address: str,
    wait_timeout: float,
    insecure: bool,
) -> ServerPlan:
    """Check everything ``flplatform server`` needs before it starts anything."""
    names = _checked_sites(sites)
    where = parse_address(address, "--address")
    if not wait_timeout > 0:
        raise ConfigError(f"--wait-timeout must be a number of seconds > 0, got {wait_timeout}")
    if insecure:
        if certs_dir is not None:
            raise ConfigError(
                "--insecure runs without TLS and without site keys: drop --certs, or drop "
                "--insecure to use them"
            )
        _check_bindable(where)
        return ServerPlan(sites=names, address=where, certs=None, wait_timeout=wait_timeout)
    if certs_dir is None:
        raise ConfigError(
            "--certs DIR is needed (the CA, the server certificate and each site's NAME.pub): "
            "make it with `flplatform certs init --out DIR`, put each site's NAME.pub in it; "
            "or run without TLS and site authentication with --insecure"
        )
    # Absolute: the SuperLink runs in the deployment's directory.
    certs_dir = certs_dir.expanduser().resolve()
    certs = ServerCerts.find(certs_dir)
    hosts = certs.hosts()
    # SuperExec and the gateway reach the SuperLink on 127.0.0.1 with the same certificate.
    if not certs.covers("127.0.0.1"):
        raise ConfigError(
            f"{certs.server_cert} is not valid for 127.0.0.1 (it is for {', '.join(hosts)}), "
            "where the server's own processes reach the SuperLink: make it again with "
            f"`flplatform certs init --out {certs_dir} --force --host 127.0.0.1 "
            + " ".join(f"--host {h}" for h in hosts)
            + "` (and send the new ca.crt to every site)"
        )
    if not where.is_wildcard and not certs.covers(where.host):
        raise ConfigError(
            f"--address {where}: sites dialling {where.host} would refuse {certs.server_cert}, "
            f"which is valid for {', '.join(hosts)} only; make it with "
            f"`flplatform certs init --out {certs_dir} --force --host {where.host} ...`"
        )
    keys = {name: site_public_key(certs_dir, name) for name in names}
    prints = {name: fingerprint(path) for name, path in keys.items()}
    shared = _repeated(prints)
    if shared:
        raise ConfigError(
            f"sites {' and '.join(shared)} have the same public key: each site makes its own "
            "with `flplatform certs site NAME --out DIR`"
        )
    _check_bindable(where)
    return ServerPlan(
        sites=names,
        address=where,
        certs=certs,
        public_keys=keys,
        fingerprints=prints,
        wait_timeout=wait_timeout,
    )


def _checked_sites(sites: Sequence[str]) -> tuple[str, ...]:
    names = tuple(s.strip() for s in sites if s.strip())
    if not names:
        raise ConfigError("--sites needs the sites' names, e.g. --sites london,ohio")
    for name in names:
        if name.isdigit():
            raise ConfigError(
                f"--sites {','.join(names)}: give the sites' names (each site has its own "
                "key, NAME.pub), not a count"
            )
        check_site_name(name)
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"--sites names {', '.join(repeated)} more than once")
    return names


def _repeated(prints: Mapping[str, str]) -> list[str]:
    by_print: dict[str, list[str]] = {}
    for name, value in prints.items():
        by_print.setdefault(value, []).append(name)
    return next((names for names in by_print.values() if len(names) > 1), [])


def _check_bindable(where: Address) -> None:
    """Refuse now an address this machine cannot listen on (in use, not its own)."""
    family = socket.AF_INET6 if ":" in where.host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((where.host, where.port))
    except OSError as exc:
        raise ConfigError(
            f"--address {where}: cannot listen there ({exc.strerror or exc}); give an address "
            "of this machine and a free port (0.0.0.0:PORT listens on every interface)"
        ) from None


# ====================================================================== state
@contextlib.contextmanager
def deployment_state(home: Path, plan: ServerPlan) -> Iterator[Path]:
    """The deployment's directory (owner-only), held for this command alone.

    Two servers of one deployment would share the SuperLink's database: the second is
    refused while the first runs.
    """
    state = home / "deployments" / plan.deployment_id
    make_private_dirs(state)
    lock = (state / "server.lock").open("a+")
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"another flplatform server is running this deployment ({state}) now; stop it first"
            ) from None
        yield state
    finally:
        lock.close()


# ====================================================================== Flower's CLI
class FlowerCli:
    """``flwr`` subcommands against this deployment's SuperLink, answers read as JSON."""

    def __init__(self, env: Mapping[str, str], connection: str, cwd: Path) -> None:
        self.env = dict(env)
        self.connection = connection
        self.cwd = cwd

    def call(self, *args: str) -> dict[str, Any]:
        """``flwr ARGS CONN --format json``; RunFailed with Flower's message when it fails."""
        command = [flower_command("flwr"), *args, self.connection, "--format", "json"]
        done = subprocess.run(
            command,
            env=self.env,
            cwd=self.cwd,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=120,
        )
        try:
            answer = json.loads(done.stdout)
        except json.JSONDecodeError:
            answer = None
        if not isinstance(answer, dict):
            raise RunFailed(
                f"`flwr {' '.join(args[:2])}` failed ({describe_exit(done.returncode)}): "
                f"{telling_line(done.stdout + done.stderr)}"
            )
        if not answer.get("success"):
            raise FlowerCliError(_flower_message(str(answer.get("error-message", ""))))
        return answer

    def register(self, public_key: Path, name: str) -> int:
        """Register a site's key; the node id Flower gave it."""
        answer = self.call("supernode", "register", str(public_key), "--name", name)
        return int(answer["node-id"])

    def unregister(self, node_id: int) -> None:
        self.call("supernode", "unregister", str(node_id))

    def nodes(self) -> dict[int, str]:
        """Every node the SuperLink knows: node id → status (registered, online, offline,
        unregistered)."""
        answer = self.call("supernode", "list")
        return {int(n["node-id"]): str(n["status"]) for n in answer.get("nodes", [])}


class FlowerCliError(RunFailed):
    """``flwr`` answered, but said no (its message, without the connection banner)."""


def _flower_message(text: str) -> str:
    # "Using SuperLink: NAME (ADDRESS)\n\n[code: 23] Public key already in use."
    lines = [line for line in text.splitlines() if line and not line.startswith("Using SuperLink")]
    return " ".join(lines) or "no reason given"


def write_connection(env: Mapping[str, str], plan: ServerPlan, link_port: int) -> None:
    """Add (or update) this deployment's connection in ``$FLWR_HOME/config.toml``.

    Other connections in the file (``local``, a user's own) are kept as they were.
    """
    import tomli_w

    from flplatform.core.flower_internals import default_flower_config  # imports Flower

    path = Path(env["FLWR_HOME"]) / "config.toml"
    try:
        text = path.read_text() if path.exists() else default_flower_config()
        config = tomllib.loads(text)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read Flower's configuration {path}: {exc}") from None
    connection: dict[str, Any] = {"address": f"127.0.0.1:{link_port}"}
    if plan.certs is None:
        connection["insecure"] = True
    else:
        connection["root-certificates"] = str(plan.certs.ca_cert.resolve())
    config.setdefault("superlink", {})[plan.connection] = connection
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(tomli_w.dumps(config))
    temporary.replace(path)


# ====================================================================== registration
def register_sites(cli: FlowerCli, plan: ServerPlan, state: Path) -> SiteRegistry:
    """Make the SuperLink's registered keys exactly the sites' ``NAME.pub``; return them.

    A key registered by an earlier start keeps its node id (the SuperLink's database
    remembers it; ``registry.json`` remembers whose it is). A key no longer among the
    sites' (a site dropped from --sites, or a site's old key) is unregistered.
    """
    path = state / "registry.json"
    known = SiteRegistry.read(path) if path.exists() else SiteRegistry()
    nodes = cli.nodes()
    live = {node_id for node_id, status in nodes.items() if status != "unregistered"}
    registry = SiteRegistry()
    for name in plan.sites:
        key = plan.fingerprints[name]
        earlier = next((s for s in known.sites if s.fingerprint == key), None)
        if earlier is not None and earlier.node_id in live:
            node_id = earlier.node_id
        else:
            try:
                node_id = cli.register(plan.public_keys[name], name)
            except FlowerCliError as exc:
                raise _registration_refused(name, exc, plan, state) from None
            # Recorded at once: Flower registers a key only once, so a key registered
            # but not recorded (a later site failing) would lock its site out.
            known = known.with_site(RegisteredSite(name, node_id, key))
            known.write(path)
        registry = registry.with_site(RegisteredSite(name, node_id, key))
    ours = {s.node_id for s in registry.sites}
    for node_id in sorted(live - ours):
        cli.unregister(node_id)
    registry.write(path)
    return registry


def _registration_refused(
    name: str, exc: FlowerCliError, plan: ServerPlan, state: Path
) -> FLPlatformError:
    if "already in use" not in exc.reason:
        return RunFailed(f"registering site {name}'s key failed: {exc.reason}")
    return ConfigError(
        f"site {name}'s key ({plan.public_keys[name]}) is already known to this deployment's "
        f"SuperLink ({state / 'superlink.db'}) under a node flplatform has no record of. "
        "Flower registers a key only once: if the key was unregistered when "
        f"{name} was dropped from --sites, {name} makes a new key (`flplatform certs site "
        f"{name} --out DIR --force`) and sends the new {name}.pub; if {state / 'registry.json'} "
        f"was lost, remove {state} to start the deployment afresh"
    )


# ====================================================================== processes
class LogTail:
    """The lines a process adds to its log, read as they come."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = ""

    def lines(self) -> list[str]:
        """Complete lines written since the last call."""
        try:
            with self.path.open("rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except OSError:
            return []
        self._offset += len(data)
        text = self._partial + data.decode(errors="replace")
        *complete, self._partial = text.split("\n")
        return [line.rstrip("\r") for line in complete if line.strip()]


# Beside the SuperLink's database: the version of the Flower that last opened it.
FLOWER_VERSION_FILE = "superlink.flower-version"


def claim_superlink_database(state: Path) -> None:
    """Refuse a SuperLink database that a newer Flower has opened; record the installed one.

    Flower migrates the SuperLink's database forward when it starts, and an older Flower
    then fails on it with Alembic's "Can't locate revision" (Flower 1.42 adds a column
    that 1.41 does not know). Said here, before anything starts, with what to do.
    """
    from flplatform.core.flower_internals import (  # imports Flower
        SUPPORTED_FLOWER,
        flower_version,
        release,
    )

    path, installed = state / FLOWER_VERSION_FILE, flower_version()
    try:
        recorded = path.read_text().strip() if path.exists() else ""
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    if recorded and release(recorded) > release(installed):
        oldest, beyond = SUPPORTED_FLOWER
        install = (
            f"Install Flower {recorded} (pip install 'flwr[simulation]=={recorded}'), or remove"
            if release(recorded) < release(beyond)
            else f"No Flower flplatform supports (>= {oldest}, < {beyond}) can open it: remove"
        )
        raise ConfigError(
            f"this deployment's SuperLink database ({state / 'superlink.db'}) was opened by "
            f"Flower {recorded}, which migrated it; the Flower installed here ({installed}) "
            f"cannot open it (Flower's migrations go forward only). {install} {state} to "
            "start this deployment afresh (its sites then register again)"
        )
    if recorded != installed:
        with private_file(path) as handle:  # the state directory is owner-only already
            handle.write(f"{installed}\n".encode())


def start_superlink(
    plan: ServerPlan, *, env: dict[str, str], state: Path, log: Path, tree: ProcessTree
) -> tuple[subprocess.Popen[bytes], int]:
    """Start the SuperLink on a free loopback port; return it and the port (after
    ``claim_superlink_database``)."""
    claim_superlink_database(state)
    security = (
        ["--insecure"]
        if plan.certs is None
        else [
            "--ssl-ca-certfile",
            str(plan.certs.ca_cert),
            "--ssl-certfile",
            str(plan.certs.server_cert),
            "--ssl-keyfile",
            str(plan.certs.server_key),
            "--enable-supernode-auth",
        ]
    )

    def start(port: int) -> subprocess.Popen[bytes]:
        return tree.popen(
            [
                flower_command("flower-superlink"),
                *security,
                "--database",
                str(state / "superlink.db"),
                "--disable-runtime-dependency-installation",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            env=env,
            cwd=str(state),
            stdout=private_file(log),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            umask=OWNER_ONLY_UMASK,  # its state database among what it writes
        )

    return start_on_free_port(start, log)


def start_gateway(
    plan: ServerPlan,
    *,
    env: Mapping[str, str],
    link_port: int,
    registry: Path | None,
    log: Path,
    tree: ProcessTree,
) -> subprocess.Popen[bytes]:
    """Start the Fleet gateway on the sites' address; return once it listens."""
    command = [
        sys.executable,
        "-m",
        "flplatform.deploy.gateway",
        "--host",
        plan.address.host,
        "--port",
        str(plan.address.port),
        "--upstream",
        f"127.0.0.1:{link_port}",
    ]
    if plan.certs is not None:
        certs = plan.certs
        command += ["--tls", str(certs.server_cert), str(certs.server_key), str(certs.ca_cert)]
    if registry is not None:
        command += ["--registry", str(registry)]
    # The gateway needs no secret: not the ledger's password the run's processes get.
    gateway_env = {k: v for k, v in env.items() if k not in ("PGPASSWORD", "PGPASSFILE")}
    gateway_env["PYTHONPATH"] = os.pathsep.join(
        [str(_PACKAGE_ROOT), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    )
    proc = tree.popen(
        command,
        env=gateway_env,
        stdout=private_file(log),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        umask=OWNER_ONLY_UMASK,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if READY_LINE in text:
            return proc
        if proc.poll() is not None:
            raise RunFailed(f"the Fleet gateway did not start: {telling_line(text)}; see {log}")
        time.sleep(0.1)
    raise RunFailed(f"the Fleet gateway did not start within 30 s; see {log}")


def node_news(reports: Sequence[str]) -> bool:
    """Whether the gateway's reports say a node joined or left (a refused peer, a flood's
    closed connections: no news of the sites)."""
    return any(line.startswith((JOINED, LEFT)) for line in reports)


def list_wait(waited: float) -> float:
    """Seconds until the next `flwr supernode list` when the gateway reported nothing,
    after ``waited`` seconds of waiting for the sites."""
    return min(max(LIST_INTERVAL_SECONDS, waited / 10), LIST_LONGEST_SECONDS)


def wait_for_sites(
    cli: FlowerCli,
    plan: ServerPlan,
    registry: SiteRegistry | None,
    *,
    link: subprocess.Popen[bytes],
    link_log: Path,
    on_poll: Callable[[], bool],
    say: Say,
) -> None:
    """Return once every site is connected; RunFailed naming the missing ones at the timeout.

    ``on_poll``: says the gateway's new reports; whether one said a node joined or left
    (then Flower's node list is read again ``LIST_INTERVAL_SECONDS`` after the last
    read at most, else after ``list_wait``). Without a registry (--insecure) nodes have
    no names: wait for as many as there are sites.
    """
    started = noted = time.monotonic()
    deadline = started + plan.wait_timeout
    listed_at: float | None = None
    news = False
    missing: list[str] = []
    joined: list[str] = []
    while True:
        news = on_poll() or news
        if link.poll() is not None:
            raise RunFailed(
                f"the SuperLink exited ({describe_exit(link.returncode)}) while waiting for "
                f"the sites; see {link_log}"
            )
        now = time.monotonic()
        if (
            listed_at is None
            or (news and now - listed_at >= LIST_INTERVAL_SECONDS)
            or now - listed_at >= list_wait(now - started)
            or (now >= deadline and now - listed_at >= GATEWAY_LOOK_SECONDS)
        ):
            listed_at, news = now, False
            missing, joined = _connected(cli, plan, registry)
            if not missing:
                on_poll()  # the gateway's last reports first
                say(f"all {len(plan.sites)} sites connected: {', '.join(joined)}")
                return
            now = time.monotonic()
        if now >= deadline:
            raise RunFailed(
                f"waited {seconds_text(plan.wait_timeout)} s and {', '.join(missing)} did not "
                f"connect (connected: {', '.join(joined) or 'none'}); each site runs "
                f"`flplatform site NAME --server {dial_hint(plan)} "
                + ("--insecure" if plan.insecure else "--certs DIR")
                + " --data FILE`"
                + ("" if plan.insecure else " with ca.crt and its NAME.key in DIR")
            )
        if now - noted >= WAITING_NOTE_SECONDS:
            noted = now
            say(f"waiting for {', '.join(missing)} ({deadline - now:.0f} s left)")
        time.sleep(min(GATEWAY_LOOK_SECONDS, max(0.0, deadline - now) + 0.01))


def _connected(
    cli: FlowerCli, plan: ServerPlan, registry: SiteRegistry | None
) -> tuple[list[str], list[str]]:
    """(the sites not connected, those connected), as Flower lists its nodes now."""
    online = {node_id for node_id, status in cli.nodes().items() if status == "online"}
    if registry is not None:
        missing = [s.name for s in registry.sites if s.node_id not in online]
        joined = [s.name for s in registry.sites if s.node_id in online]
    else:  # nodes name themselves (when the run asks them): count them
        short = len(plan.sites) - len(online)
        missing = [f"{short} of {len(plan.sites)} nodes"] if short > 0 else []
        joined = [f"{len(online)} unauthenticated nodes (--insecure)"] if online else []
    return missing, joined


def dial_hint(plan: ServerPlan) -> str:
    """The address sites give as ``--server``: ours, or the certificate's names with our port."""
    if not plan.address.is_wildcard:
        return str(plan.address)
    if plan.certs is None:
        return f"HOST:{plan.address.port}"
    return " or ".join(str(Address(h, plan.address.port)) for h in plan.certs.hosts())


def start_deployment(
    plan: ServerPlan,
    run: DeployedRun,
    *,
    home: Path,
    state: Path,
    tree: ProcessTree,
    gateway_log: LogTail,
    say: Say,
) -> SimulationProcess:
    """Start the SuperLink and the gateway, register the sites, wait for them, ``flwr run``.

    Every process is started in ``tree`` (the caller stops them, also when this raises).
    """
    logs = logs_dir(home)
    log_name = run.logs
    link_log = logs / f"{log_name}.superlink.log"
    env = flower_environment(home, python_path=run.python_path)
    env.update(run.extra_env)
    # its ServerApp records the run deployed with the run itself (run_record.DEPLOYED_EVENT),
    # and a resumed run may reopen here: its sites train
    env[DEPLOYMENT_ENV] = json.dumps(
        {
            "sites": list(plan.sites),
            "address": str(plan.address),
            "deployment": plan.deployment_id,
            WAIT_TIMEOUT_KEY: plan.wait_timeout,
        }
    )
    registry_path = None if plan.insecure else state / "registry.json"
    if registry_path is not None:
        env[REGISTRY_ENV] = str(registry_path)
    link, link_port = start_superlink(plan, env=env, state=state, log=link_log, tree=tree)
    write_connection(env, plan, link_port)
    cli = FlowerCli(env, plan.connection, cwd=home)
    registry = None
    if not plan.insecure:
        registry = register_sites(cli, plan, state)
        say(
            "registered "
            + ", ".join(f"{s.name} (node {s.node_id}, key {s.fingerprint})" for s in registry.sites)
        )
    start_gateway(
        plan,
        env=env,
        link_port=link_port,
        registry=registry_path,
        log=gateway_log.path,
        tree=tree,
    )
    gateway_log.lines()  # the "listening" line
    say(f"listening for sites on {plan.address}; they dial {dial_hint(plan)}")

    def report() -> bool:
        tree.record()
        lines = gateway_log.lines()
        for line in lines:
            say(line)
        return node_news(lines)

    wait_for_sites(cli, plan, registry, link=link, link_log=link_log, on_poll=report, say=say)
    flwr_run, log_path = start_flwr_run(
        run.app_dir,
        plan.connection,
        run_config=run.run_config,
        env=env,
        home=home,
        log_name=log_name,
        tree=tree,
    )
    return SimulationProcess(link, flwr_run, log_path, link_log, tree, superlink_port=link_port)


# Seconds Flower may take to mark a finished run finished in the SuperLink's state before
# the deployment stops it (else `flwr ls` shows the run failed once the SuperLink restarts).
WIND_DOWN_SECONDS = 15.0
# How often a deployment's follower reads the run's events for sites lost or back (s).
PRESENCE_EVERY = 2.0


class PresenceLines:
    """Says each site-lost and site-back event of a run once, as the engine recorded it;
    and, for ``--insecure`` (``unauthenticated``: the sites ``--sites`` listed), once which
    names the sites gave themselves.

    Without a registry a node is whoever it says it is: its answer to the engine's query
    names it in the ledger. Once as many sites as listed are recorded (or the run has ended
    with fewer), their names and node ids are said, and a name not listed is warned about.
    """

    def __init__(self, say: Say, *, unauthenticated: Sequence[str] | None = None) -> None:
        self.say = say
        self.seen: set[int] = set()
        self.next_read = 0.0
        self.unnamed = tuple(unauthenticated) if unauthenticated is not None else None

    def poll(self, run_id: int, db: str | None, *, final: bool = False) -> None:
        """Say what was not said yet: at most every ``PRESENCE_EVERY`` seconds, and
        always when ``final`` (the run has ended: its last events are said too)."""
        if time.monotonic() < self.next_read and not final:
            return
        self.next_read = time.monotonic() + PRESENCE_EVERY
        try:
            with LedgerRepository.open(db, create=False) as repository:
                events = repository.list_events(run_id)
                sites = repository.list_sites(run_id) if self.unnamed is not None else []
        except FLPlatformError:
            return  # a ledger that hiccups: read again next time
        if sites and (final or len(sites) >= len(self.unnamed or ())):
            self._say_names(sites)
        for event in events:
            if event.id not in self.seen and event.kind in PRESENCE_EVENTS:
                self.seen.add(event.id)
                self.say(presence_sentence(event.kind, event.detail))

    def _say_names(self, sites: Sequence[SiteRecord]) -> None:
        listed, self.unnamed = self.unnamed or (), None
        self.say(
            "the sites named themselves (unauthenticated, --insecure): "
            + ", ".join(f"{site.name} (node {site.node_id})" for site in sites)
        )
        unlisted = sorted({site.name for site in sites} - set(listed))
        if unlisted:
            self.say(
                f"warning: {', '.join(unlisted)} not among --sites {','.join(listed)}: "
                "without --certs any node may join under any name"
            )


def run_deployment(
    plan: ServerPlan,
    run: DeployedRun,
    follow: RunConfig,
    *,
    home: Path,
    say: Say,
    on_progress: ProgressCallback | None = None,
    poll_interval: float = 0.5,
) -> RunRecord:
    """Run ``run`` on the deployment and follow it in the ledger (``simulation.follow_run``).

    ``follow``: the ``RunConfig`` by which the run is found (its ``db`` and ``run_tag``).
    Returns the finished run; raises ``RunFailed`` when the sites do not come or the run
    fails, ``RunStopped`` on Ctrl-C or SIGTERM; every process is stopped in any case. The
    run's ServerApp records it with a ``deployed`` event naming the sites (``DEPLOYMENT_ENV``),
    so that ``flplatform resume`` will not train it here (``run_record.refuse_deployed``).
    A site the run loses, or gets back, is said at once (the engine's ledger events, read
    every ``PRESENCE_EVERY`` seconds).
    """
    presence = PresenceLines(say, unauthenticated=plan.sites if plan.insecure else None)
    with deployment_state(home, plan) as state:
        gateway_log = LogTail(home / "logs" / f"{run.logs}.gateway.log")

        def start(tree: ProcessTree) -> SimulationProcess:
            return start_deployment(
                plan, run, home=home, state=state, tree=tree, gateway_log=gateway_log, say=say
            )

        def progress(
            record: RunRecord | None, done: list[RoundRecord], failures: list[UpdateRecord]
        ) -> None:
            for line in gateway_log.lines():
                say(line)
            if record is not None:
                presence.poll(record.id, follow.db or None, final=record.status != RUN_RUNNING)
            if on_progress is not None:
                on_progress(record, done, failures)

        try:
            return follow_run(
                start, follow, progress, poll_interval, wind_down_seconds=WIND_DOWN_SECONDS
            )
        finally:
            for line in gateway_log.lines():
                say(line)
