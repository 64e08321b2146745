"""``flplatform site``: one site's SuperNode, reading only that site's own data file.

The SuperNode dials the server's address with TLS, trusting the deployment's ``ca.crt``,
and signs its requests with the site's private key (``NAME.key``), which never leaves the
site. Before it starts, the site's files are checked, and one TLS handshake with the
server tells at once a server this CA did not sign, or one not speaking TLS. Flower's
SuperNode then serves every run the server starts until it is stopped: it retries while
the server is unreachable (a restart of the server is waited out), and exits when the
server refuses it, which is reported here in one line. One that gives up on a TLS error
(it exits, or stops serving) is started again (``run_site``).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import ssl
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from cryptography import x509

from flplatform.core.errors import ConfigError, DataError, RunFailed
from flplatform.deploy.addresses import Address, parse_address
from flplatform.deploy.certs import CA_CERT, SiteKey, check_site_name
from flplatform.launch.flower import (
    OWNER_ONLY_UMASK,
    StartTimedOut,
    describe_exit,
    flower_command,
    flower_environment,
    logs_dir,
    private_file,
    start_on_free_port,
    telling_line,
)
from flplatform.launch.processes import ProcessTree

PROBE_SECONDS = 10.0
# Seconds a SuperNode has to listen on its own port (it does before dialling the server):
# importing Flower takes a few seconds, more on a busy machine.
START_SECONDS = 120.0
# Seconds a SuperNode has to deregister after SIGTERM: the server then counts it gone at
# once; a SuperNode killed outright is counted connected for up to a minute, and one
# restarted within that minute waits to join (the server's gateway has it retry).
DEREGISTER_SECONDS = 5.0
POLL_SECONDS = 0.5
# A site's SuperNode logs kept in the home's logs folder, this start's included: one per
# start, so that a site restarted over and over (by hand, or a service manager) keeps its
# last few crashes to read and does not fill the disk.
KEPT_SITE_LOGS = 5
_NODE_ID = re.compile(r"SuperNode ID: (\d+)")
_RUN = re.compile(r"\[RUN (\d+)")
_CONNECTION_FAILED = "Connection attempt failed"
# What a SuperNode that gave up connecting prints (Flower's ExitCode.SUPERNODE_CONNECTION_
# ERROR; its process then exits with status 1, as for every error); the first restart
# after one waits this long, doubling each time the restarted one never joined.
GAVE_UP_CONNECTING = "Exit Code: 305"
RESTART_SECONDS = 2.0
MAX_RESTART_SECONDS = 60.0
# What a SuperNode's output says when the server refused the site (its key not
# registered, or active already past the gateway's rejoin window; no key), its
# certificate is not trusted, or it does not speak TLS (started again with --insecure):
# another start would meet the same (``refusal_reason``).
_FOR_GOOD = ("[code: 2004]", "[code: 2001]", "CERTIFICATE_VERIFY_FAILED", "WRONG_VERSION_NUMBER")
# What Flower's SuperNode logs when a request meets a TLS error (it gives the request up),
# and how long after it a SuperNode that has not exited is taken for stalled.
_TLS_ERROR = "SSL/TLS handshake error detected"
STALL_SECONDS = 10.0
_RECONNECTED = "Connection successful"

Say = Callable[[str], None]


@dataclass(frozen=True)
class SitePlan:
    """A checked ``flplatform site``."""

    name: str
    server: Address
    data: Path  # absolute: the ClientApp runs in another directory
    ca_cert: Path | None  # None: --insecure
    private_key: Path | None

    @property
    def insecure(self) -> bool:
        return self.ca_cert is None

    def node_config(self) -> str:
        """Flower's ``--node-config``: the site's file and name for the ClientApp."""
        return f'data-path="{self.data}" site-name="{self.name}"'


def plan_site(
    name: str, *, server: str, certs_dir: Path | None, data: Path, insecure: bool
) -> SitePlan:
    """Check the site's name, the server's address, its certificates and its data file."""
    check_site_name(name)
    address = parse_address(server, "--server")
    if address.is_wildcard:
        raise ConfigError(
            f"--server {address}: give the address the server is reached at (its name or IP "
            "address, as in its certificate), not a listening address"
        )
    data_file = _checked_data(name, data)
    if insecure:
        if certs_dir is not None:
            raise ConfigError(
                "--insecure runs without TLS and without the site's key: drop --certs, or "
                "drop --insecure to use them"
            )
        return SitePlan(name, address, data_file, ca_cert=None, private_key=None)
    if certs_dir is None:
        raise ConfigError(
            f"--certs DIR is needed: the server's ca.crt (from its administrator) and this "
            f"site's key, made with `flplatform certs site {name} --out DIR`; or connect "
            "without TLS and authentication with --insecure"
        )
    # Absolute: the SuperNode runs in another directory.
    certs_dir = certs_dir.expanduser().resolve()
    key = SiteKey.find(certs_dir, name)
    ca_cert = certs_dir / CA_CERT
    if not ca_cert.is_file():
        raise ConfigError(
            f"{ca_cert} is missing: the server's administrator sends it (they made it with "
            "`flplatform certs init`); put it beside your site key"
        )
    try:
        x509.load_pem_x509_certificate(ca_cert.read_bytes())
    except ValueError as exc:
        raise ConfigError(f"{ca_cert} is not a PEM certificate ({exc})") from None
    return SitePlan(name, address, data_file, ca_cert=ca_cert, private_key=key.private_key)


def _checked_data(name: str, data: Path) -> Path:
    """The site's data file, absolute, loaded once to check it is a site file."""
    from clients.datasets import load_site_file
    from clients.site_files import MANIFEST_FILE, TEST_FILE, read_manifest

    path = data.expanduser().resolve()
    if '"' in str(path):
        raise ConfigError(f"--data {data}: the path may not contain a double quote")
    if path.is_dir():
        raise ConfigError(
            f"--data {data} is a directory; give this site's own file, e.g. {data}/{name}.npz "
            "(written by `flplatform data split`)"
        )
    if path.name.lower() == TEST_FILE:
        raise ConfigError(
            f"--data {data} is a split's held-out test set (the server's), not a site's file"
        )
    x, _ = load_site_file(path)  # DataError naming the file and what is wrong
    if len(x) == 0:
        raise DataError(f"{path} holds no examples")
    if (path.parent / MANIFEST_FILE).is_file():
        owners = [s.name for s in read_manifest(path.parent).sites if s.path.resolve() == path]
        if owners and name not in owners:
            raise ConfigError(
                f"--data {data} is site '{owners[0]}''s file in its split "
                f"({path.parent / MANIFEST_FILE}), not {name}'s"
            )
    return path


# ====================================================================== before starting
def probe_server(plan: SitePlan) -> str | None:
    """One TLS handshake (or none, with --insecure) with the server; what it showed.

    Raises ConfigError when the server cannot be the right one: a certificate the site's
    ca.crt does not trust or that is not valid for the name dialled, no TLS where TLS was
    expected, or TLS where plain HTTP was. Returns a note when the server cannot be
    reached now (the SuperNode keeps trying), else None.
    """
    try:
        raw = socket.create_connection((plan.server.host, plan.server.port), PROBE_SECONDS)
    except OSError as exc:
        return f"the server {plan.server} is not reachable now ({exc.strerror or exc})"
    with raw:
        if plan.ca_cert is None:
            return _probe_plain(raw, plan)
        context = ssl.create_default_context(cafile=str(plan.ca_cert))
        try:
            with context.wrap_socket(raw, server_hostname=plan.server.host):
                return None
        except ssl.SSLCertVerificationError as exc:
            raise ConfigError(
                f"the server {plan.server} presented a certificate that {plan.ca_cert} does "
                f"not accept ({exc.verify_message}): "
                + (
                    f"it is not valid for {plan.server.host} (the server's administrator "
                    f"adds it with `flplatform certs init --host {plan.server.host}`)"
                    if "mismatch" in str(exc.verify_message)
                    else "ask the server's administrator for this deployment's ca.crt"
                )
            ) from None
        except ssl.SSLError as exc:
            if "WRONG_VERSION_NUMBER" in str(exc) or "record layer" in str(exc):
                raise ConfigError(
                    f"the server {plan.server} does not speak TLS (it runs with --insecure?); "
                    "a site with --certs talks to it only over TLS"
                ) from None
            return f"TLS handshake with {plan.server} failed ({exc})"
        except OSError as exc:
            return f"the server {plan.server} closed the connection ({exc.strerror or exc})"


def _probe_plain(raw: socket.socket, plan: SitePlan) -> str | None:
    """With --insecure: refuse a server that answers a TLS hello (it would never answer us)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with context.wrap_socket(raw, server_hostname=plan.server.host):
            pass
    except (ssl.SSLError, OSError):
        return None  # not TLS: a plain-HTTP server, as --insecure expects
    raise ConfigError(
        f"the server {plan.server} speaks TLS: a site connects to it with --certs DIR (its "
        f"ca.crt and {plan.name}.key), not --insecure"
    )


# ====================================================================== running
def refusal_reason(output: str, plan: SitePlan) -> str:
    """Why the SuperNode exited, from its output, in one line."""
    if "[code: 2004]" in output:
        return (
            f"refused by the server: it does not accept {plan.name}'s key — either "
            f"{plan.name}.pub is not registered there (is {plan.name} in the server's --sites, "
            f"with this key?), or another SuperNode with this key is connected (is {plan.name} "
            "running elsewhere?)"
        )
    if "[code: 2001]" in output:
        return "refused by the server: it accepts only registered sites, and this node has no key"
    if "WRONG_VERSION_NUMBER" in output:
        return (
            f"the server {plan.server} does not speak TLS (it runs with --insecure?); a "
            "site with --certs talks to it only over TLS"
        )
    if "CERTIFICATE_VERIFY_FAILED" in output:
        return (
            f"the server's certificate is not accepted by {plan.ca_cert} (another "
            "deployment's CA, or not valid for the address dialled)"
        )
    return telling_line(output)


def site_log(home: Path, name: str) -> Path:
    """The log of this start of site ``name``'s SuperNode, in the home's logs folder.

    One of its own: processes of a SuperNode killed before (Flower's SuperExec and
    ClientApps outlive it for a while) still write to theirs, at their own offsets. The
    site's oldest logs beyond the newest ``KEPT_SITE_LOGS`` (this one counted) are removed;
    a process still writing to one keeps its file until it exits.
    """
    logs = logs_dir(home)
    pattern = re.compile(rf"site-{re.escape(name)}\.supernode\.\d+\.log")
    earlier = [p for p in logs.iterdir() if pattern.fullmatch(p.name)]
    earlier.sort(key=_modified, reverse=True)
    for old in earlier[KEPT_SITE_LOGS - 1 :]:
        old.unlink(missing_ok=True)
    return logs / f"site-{name}.supernode.{os.getpid()}.log"


def _modified(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # removed meanwhile by another start of the site
        return 0.0


def run_site(plan: SitePlan, *, home: Path, say: Say) -> None:
    """Start the site's SuperNode and stay with it until the user stops it.

    A SuperNode that exits because a connection to the server failed (Flower's SuperNode
    gives up on any TLS error, a connection the server closed in its handshake among
    them: a server's gateway crowded by a flood from the site's address) is started
    again, after ``RESTART_SECONDS`` doubling up to ``MAX_RESTART_SECONDS``, and said in
    one line each time: the site reconnects by itself. Raises ``RunFailed`` with the
    reason when it exits for any other reason (refused by the server, say);
    ``KeyboardInterrupt``/``StopRequested`` after stopping it.
    """
    env = flower_environment(home)
    log = site_log(home, plan.name)
    security = (
        ["--insecure"]
        if plan.ca_cert is None or plan.private_key is None
        else [
            "--root-certificates",
            str(plan.ca_cert),
            "--auth-supernode-private-key",
            str(plan.private_key),
        ]
    )
    started: list[subprocess.Popen[bytes]] = []
    failures = 0  # SuperNodes in a row that gave up connecting before they joined
    with ProcessTree() as tree:

        def start(port: int) -> subprocess.Popen[bytes]:
            started.append(
                tree.popen(
                    [
                        flower_command("flower-supernode"),
                        *security,
                        "--superlink",
                        str(plan.server),
                        # The SuperNode's own API for its ClientApp processes, on loopback.
                        "--port",
                        str(port),
                        "--node-config",
                        plan.node_config(),
                    ],
                    env=env,
                    cwd=str(home),
                    # a restart's output follows the last one's, in the same log
                    stdout=private_file(log, append=len(started) > 0),
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    umask=OWNER_ONLY_UMASK,  # what the site's ClientApps write stays the site's
                )
            )
            return started[-1]

        while True:
            # the first start writes the log afresh (a file of this name may be left by
            # an earlier process of the same pid, in a container)
            offset = _size(log) if started else 0
            try:
                node, _ = start_on_free_port(
                    start, log, what=f"site {plan.name}'s SuperNode", timeout=START_SECONDS
                )
            except StartTimedOut:
                raise
            except RunFailed:
                if not started or started[-1].poll() is None:
                    raise
                node = started[-1]  # it exited before it listened: say why, as below
            try:
                ended = _watch(node, tree, log, plan, say, offset)
            except KeyboardInterrupt:
                _deregister(node)
                raise
            if not (ended.stalled or connection_failed(ended.code, ended.output)):
                raise RunFailed(
                    f"site {plan.name}'s SuperNode exited ({describe_exit(ended.code)}): "
                    f"{refusal_reason(ended.output, plan)}; log: {log}"
                )
            failures = 0 if ended.joined else failures + 1
            wait = min(RESTART_SECONDS * 2 ** max(0, failures - 1), MAX_RESTART_SECONDS)
            what = (
                f"the SuperNode stopped serving after a TLS error on a connection to {plan.server}"
                if ended.stalled
                else f"a connection to {plan.server} failed and the SuperNode gave up "
                f"({telling_line(ended.output)})"
            )
            say(f"{what}; starting it again in {wait:g} s")
            _sleep_watching(tree, wait)


def connection_failed(code: int, output: str) -> bool:
    """Whether the SuperNode exited because a connection to the server failed (Flower's
    exit code 305 in its output), and not because the server refused the site or its
    certificate is not one to trust (which another try would not change)."""
    return (
        code != 0
        and GAVE_UP_CONNECTING in output
        and not any(marker in output for marker in _FOR_GOOD)
    )


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _sleep_watching(tree: ProcessTree, seconds: float) -> None:
    """Wait ``seconds``, recording the processes the last SuperNode left (its SuperExec,
    ClientApps), so that the tree stops them too."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        tree.record()
        time.sleep(min(POLL_SECONDS, max(0.0, deadline - time.monotonic())))


class Ended(NamedTuple):
    """How a SuperNode's watch ended: its exit code, what it wrote to its log this start,
    whether it had joined the server, and whether it was stopped here for having stalled
    (``_watch``)."""

    code: int
    output: str
    joined: bool
    stalled: bool = False


def _watch(
    node: subprocess.Popen[bytes],
    tree: ProcessTree,
    log: Path,
    plan: SitePlan,
    say: Say,
    offset: int = 0,
) -> Ended:
    """Say what the SuperNode does (connected, runs served, connection lost) until it
    exits (from ``offset`` in ``log``: this start's output).

    A SuperNode that logged a TLS error and has not exited ``STALL_SECONDS`` later is
    stopped here (it deregisters): Flower's SuperNode gives up the request a TLS error
    hit, and one that had joined then serves nothing more, its heartbeat stopped, while
    it runs on (seen with a connection the server's gateway closed in its handshake).
    """
    start = offset
    runs: set[str] = set()
    joined = connected = waiting = False
    tls_error_at: float | None = None
    while True:
        tree.record()
        code = node.poll()
        text = _read_from(log, start)
        new, offset = text[offset - start :], start + len(text)
        if tls_error_at is None and _TLS_ERROR in new:
            tls_error_at = time.monotonic()
        if (
            code is None
            and tls_error_at is not None
            and (time.monotonic() - tls_error_at >= STALL_SECONDS)
        ):
            _deregister(node)
            if node.poll() is None:  # it did not end on SIGTERM
                node.kill()
            return Ended(node.wait(), _read_from(log, start), joined, stalled=True)
        for line in new.splitlines():
            if match := _NODE_ID.search(line):
                joined = connected = True
                say(f"connected to {plan.server} as node {match.group(1)}")
            elif (match := _RUN.search(line)) and match.group(1) not in runs:
                runs.add(match.group(1))
                say(f"serving run {match.group(1)}")
            elif _CONNECTION_FAILED in line and connected:
                connected = False
                say(f"lost the server {plan.server}; retrying until it is back")
            elif _CONNECTION_FAILED in line and not joined and not waiting:
                # the server down, or (after a crash of this site) its previous SuperNode
                # still counted connected for up to a minute: the server says which
                waiting = True
                say(f"cannot join {plan.server} yet; retrying until it lets {plan.name} in")
            elif _RECONNECTED in line and joined and not connected:
                connected = True
                say(f"reconnected to {plan.server}")
        if code is not None:
            return Ended(code, text, joined)
        time.sleep(POLL_SECONDS)


def _read_from(path: Path, offset: int) -> str:
    """The text of ``path`` from byte ``offset``."""
    with path.open("rb") as file:
        file.seek(offset)
        return file.read().decode(errors="replace")


def _deregister(node: subprocess.Popen[bytes]) -> None:
    """SIGTERM the SuperNode alone first: it tells the server it is leaving, then exits."""
    if node.poll() is not None:
        return
    node.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):  # the tree's stop kills it
        node.wait(timeout=DEREGISTER_SECONDS)
