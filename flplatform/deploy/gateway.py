"""The Fleet gateway: the one address sites reach, passing on the Fleet API and nothing else.

Flower 1.41's SuperLink serves its three APIs on one HTTP(S) port: the Fleet API that
SuperNodes use, the Runtime API of its own ServerApp processes, and the Control API,
which has no authentication in Flower's open-source edition. Whoever reached that port
could register a key of their own (``flwr supernode register``) and join as a site, or
start a run, that is run code on the server. So ``flplatform server`` binds the SuperLink
to 127.0.0.1 and puts this gateway on the address sites dial: it terminates TLS with the
server's certificate, forwards ``POST /v1/fleet/...`` to the SuperLink (which still
checks every node's signature and registration itself) and refuses everything else.

Being the first to see each connection, it also reports what the SuperLink logs nowhere
or only as a status code: a TLS handshake that failed (a node speaking plain HTTP, a node
trusting another CA), a request for another API, a node refused by SuperNode
authentication (which site's key, if any), and sites connecting and leaving. Each report
is one line on stdout; ``flplatform server`` prints them as they come.

Run as ``python -m flplatform.deploy.gateway``; one thread per connection (a federation
has a handful of sites).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.server
import ipaddress
import json
import socket
import socketserver
import ssl
import string
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from flplatform.core.site_registry import SiteRegistry

FLEET_PREFIX = "/v1/fleet/"
# The Fleet API's actions, as Flower 1.41's SuperNode calls them (flwr/supernode/
# fleet_http_client.py). Only these exact paths are forwarded, and the path forwarded is
# this constant, never the client's: a prefix check would let "/v1/fleet/../control/..."
# through, as HTTP clients remove dot segments.
FLEET_ACTIONS = frozenset(
    {
        "register-node",
        "activate-node",
        "deactivate-node",
        "unregister-node",
        "send-node-heartbeat",
        "pull-messages",
        "push-messages",
        "get-run",
        "get-fab",
        "push-object",
        "pull-object",
        "confirm-message-received",
    }
)
FLEET_PATHS = {FLEET_PREFIX + action: action for action in FLEET_ACTIONS}
# A request body is held in memory before it is forwarded: one message envelope or one
# object (Flower chunks arrays at 5 MiB) fits many times over; more is refused (413).
MAX_BODY_BYTES = 64 * 2**20
# A larger body is read (and handed to the SuperLink, which parses it) only from a
# registered site whose request is signed: an anonymous peer cannot make the gateway and
# the SuperLink hold 64 MB per connection (16 of them peaked the SuperLink at 1.24 GB).
ANONYMOUS_BODY_BYTES = 2**20
# Flower's signed-request headers (flwr/supernode/node_auth_http_interceptor.py): the
# signature is over the timestamp, which must be this recent (Flower's tolerance + drift).
SIGNATURE_HEADER = "flwr-signature"
TIMESTAMP_HEADER = "flwr-timestamp"
SIGNATURE_MAX_AGE_SECONDS = 305.0
# Connections held at once, in all and from one address, that have not (yet) carried a
# registered site's signed request: past either, such a connection is closed for the new
# one (``_evicted``: an idle one first). A connection that carried a signed request is a
# site's and is never closed for another: a peer holding connections open, or opening them
# as fast as it can, cannot keep out the sites, also not those that share its address
# (behind one NAT).
MAX_CONNECTIONS = 128
MAX_CONNECTIONS_PER_ADDRESS = 16
# Connections one registered site may hold open (Flower's SuperNode keeps one or two):
# past it, that site's own oldest is closed, so that one site's key (stolen, or a client
# gone wrong) cannot take every slot the other sites need.
MAX_CONNECTIONS_PER_SITE = 8
# A connection still in its TLS handshake this young is closed for another only when every
# candidate is as young (a site's fresh connection on a slow link has time to finish it);
# and one past its handshake this recently, for its first request to arrive (a SuperNode
# sends it with its last handshake message under TLS 1.3, one round trip later under 1.2).
EVICTION_GRACE_SECONDS = 5.0
READY_GRACE_SECONDS = 0.5
# Flower's error code when the SuperLink will not activate a registered node
# (ApiErrorCode.FLEET_NODE_ACTIVATION_FAILED): a SuperNode with the site's key is active
# already. After a crash that is the dead one, until its heartbeat lapses (about a
# minute); the new one is told to retry (503, which Flower's SuperNode retries with
# back-off) rather than refused for good, so that a site restarted at once rejoins. For
# this long at most since the site's first such refusal: a second SuperNode of a site that
# is running (a copy of its directory), or a key the SuperLink no longer knows, then gets
# the SuperLink's refusal and exits with it instead of waiting for ever.
NODE_ACTIVATION_FAILED = 2004
REJOIN_WINDOW_SECONDS = 180.0
# Longest printed excerpt of what a refused peer sent (its request path).
MAX_QUOTED = 80
# A request's line and headers together (Flower's SuperNode sends well under 4 KiB: its
# key, signature and timestamp): the standard library alone allows 100 headers of 64 KiB,
# which made an anonymous connection hold 6 MB of headers, and the SuperLink read them.
MAX_HEAD_BYTES = 64 * 2**10
# An HTTP header name (RFC 9110's token) and a value the SuperLink can be handed (visible
# ASCII, spaces and tabs): anything else is refused (400) before it reaches the SuperLink.
_TOKEN = frozenset("!#$%&'*+-.^_`|~" + string.ascii_letters + string.digits)
HANDSHAKE_SECONDS = 10.0
# The Fleet client's own timeout is 30 s; a large object on a slow link may take longer.
UPSTREAM_TIMEOUT = httpx.Timeout(connect=10.0, read=300.0, write=300.0, pool=None)
# The same report about the same peer at most once a minute (a plain-text node retries
# for ever, with back-off).
REPEAT_SECONDS = 60.0
# Kinds of report remembered before the quiet ones are forgotten.
_KINDS_KEPT = 1024
# Flower's node-authentication header: base64 of the node's PEM public key.
PUBLIC_KEY_HEADER = "flwr-public-key"
READY_LINE = "listening on"
# How the reports of a node joining or leaving begin (`flplatform server` looks at
# Flower's node list again when it reads one).
JOINED, LEFT = "joined:", "left:"
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "date",
        "server",
        "expect",
        "forwarded",
        "x-forwarded-for",
        "x-forwarded-proto",
        "x-forwarded-host",
        "x-real-ip",
        "content-encoding",  # httpx hands back the body decoded
    }
)
# TLS handshake failures by OpenSSL reason, in words a server administrator acts on.
_HANDSHAKE_REASONS = {
    "HTTP_REQUEST": "it spoke plain HTTP (a site started with --insecure?)",
    "TLSV1_ALERT_UNKNOWN_CA": "it does not trust this server's certificate (a ca.crt from "
    "another deployment?)",
    "SSLV3_ALERT_BAD_CERTIFICATE": "it rejected this server's certificate (not valid for "
    "the name it dialled?)",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": "it rejected this server's certificate (not valid "
    "for the name it dialled?)",
    "WRONG_VERSION_NUMBER": "it did not speak TLS",
}


@dataclass(frozen=True)
class TlsFiles:
    """The server's certificate and key, and the CA that signed it."""

    certfile: Path
    keyfile: Path
    ca_certfile: Path


@dataclass(frozen=True)
class GatewayConfig:
    """Where to listen, where the SuperLink is, TLS (None: plain HTTP), the site registry."""

    host: str
    port: int
    upstream: str  # 127.0.0.1:PORT of the SuperLink
    tls: TlsFiles | None = None
    registry: Path | None = None


class Reports:
    """One-line reports on stdout. Reports of one kind (``key``: the line itself unless
    the caller names the kind) are said at most once a minute; the next one says how many
    were held back meanwhile. A kind said over a minute ago is forgotten (with its count),
    and at most ``_KINDS_KEPT`` are remembered, the oldest said forgotten first: a flood of
    distinct requests costs neither lines nor memory nor time."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # key → (said at, held back since), in the order they were said
        self._kinds: OrderedDict[str, tuple[float, int]] = OrderedDict()
        self._lock = threading.Lock()

    def say(self, line: str, *, key: str | None = None) -> None:
        now = self._clock()
        key = line if key is None else key
        with self._lock:
            while self._kinds:  # forget the kinds said over a minute ago
                oldest = next(iter(self._kinds))
                if now - self._kinds[oldest][0] < REPEAT_SECONDS:
                    break
                if oldest == key:  # said again after its minute: its count is reported
                    break
                del self._kinds[oldest]
            said_at, held = self._kinds.get(key, (-REPEAT_SECONDS, 0))
            if now - said_at < REPEAT_SECONDS:
                self._kinds[key] = (said_at, held + 1)
                return
            self._kinds[key] = (now, 0)
            self._kinds.move_to_end(key)
            while len(self._kinds) > _KINDS_KEPT:
                self._kinds.popitem(last=False)
        if held:
            line += f" ({held} more like it in the minute before)"
        self.emit(line)

    def emit(self, line: str) -> None:
        print(line, flush=True)


def handshake_reason(exc: BaseException) -> str:
    """Why a TLS handshake failed, in words (OpenSSL's reason when we know none better)."""
    reason = getattr(exc, "reason", None)
    if isinstance(reason, str) and reason in _HANDSHAKE_REASONS:
        return _HANDSHAKE_REASONS[reason]
    if isinstance(exc, TimeoutError | socket.timeout):
        return f"no TLS handshake within {HANDSHAKE_SECONDS:.0f} s"
    return f"TLS handshake failed ({exc})"


def key_fingerprint(header: str | None) -> str | None:
    """``SHA256:…`` of the key in Flower's public-key header, as ``ssh-keygen -l`` shows it.

    The same hash as ``flplatform.deploy.certs.fingerprint`` of the site's ``NAME.pub``,
    so a key is told by the fingerprint ``flplatform certs site`` printed.
    """
    if not header:
        return None
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    from flplatform.deploy.certs import line_fingerprint

    try:
        key = serialization.load_pem_public_key(base64.b64decode(header, validate=True))
        line = key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        return None
    return line_fingerprint(line)


def signature_holds(public_key: str, timestamp: str, signature: str) -> bool:
    """Whether ``signature`` (base64) is the key's (base64 PEM, Flower's header) ECDSA
    SHA-256 signature of ``timestamp`` (ISO 8601), and the timestamp is recent."""
    from datetime import datetime

    from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        signed_at = datetime.fromisoformat(timestamp)
        if signed_at.tzinfo is None:
            return False
        if abs(time.time() - signed_at.timestamp()) > SIGNATURE_MAX_AGE_SECONDS:
            return False
        key = serialization.load_pem_public_key(base64.b64decode(public_key, validate=True))
        if not isinstance(key, ec.EllipticCurvePublicKey):
            return False
        key.verify(
            base64.b64decode(signature, validate=True),
            timestamp.encode("ascii"),
            ec.ECDSA(hashes.SHA256()),
        )
    except (ValueError, TypeError, UnsupportedAlgorithm, InvalidSignature):
        return False
    return True


def quoted(text: str) -> str:
    """What a peer sent, safe to print: printable characters only, at most MAX_QUOTED."""
    text = text.split("?")[0]
    safe = "".join(c if c.isprintable() and c.isascii() else "?" for c in text[:MAX_QUOTED])
    return safe + ("…" if len(text) > MAX_QUOTED else "")


class _HeadTooLarge(Exception):
    """A request's line and headers passed ``MAX_HEAD_BYTES``."""


class _BoundedHead:
    """A connection's input whose ``readline`` (what request lines and headers are read
    with) stops at ``MAX_HEAD_BYTES`` per request; ``read`` (the body) is unbounded here:
    its length is checked before it is read."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.left = MAX_HEAD_BYTES

    def readline(self, limit: int = -1) -> bytes:
        if self.left <= 0:
            raise _HeadTooLarge
        line = self._raw.readline(self.left if limit < 0 else min(limit, self.left))
        self.left -= len(line)
        if self.left <= 0 and not line.endswith(b"\n"):
            raise _HeadTooLarge
        return line

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def _forwardable(headers: Any) -> bool:
    """Whether every header has a token for a name and a value of visible ASCII, spaces
    and tabs (what an HTTP client sends on: anything else made the forwarding fail)."""
    for name, value in headers.items():
        if not name or not set(name) <= _TOKEN:
            return False
        if not all(c == "\t" or " " <= c <= "~" for c in value):
            return False
    return True


class _Refused(Exception):
    """The connection was refused and reported; nothing more to do with it."""


@dataclass(eq=False)
class _Connection:
    """One open connection: its socket, its peer's address, and the registered site whose
    signed request came on it, if any (then it is never closed for another's)."""

    sock: Any
    source: str
    opened: float = 0.0  # time.monotonic()
    site: str | None = None  # the site's key fingerprint
    block: str = ""  # what it counts under (peer_block)
    ready: float | None = None  # when its TLS handshake ended (time.monotonic())


def _evicted(candidates: list[_Connection], now: float) -> _Connection | None:
    """Which of ``candidates`` (connections that carried no site's request, in the order
    to prefer) a newcomer's connection closes; None only when there is none.

    First the one past its handshake the longest, over ``READY_GRACE_SECONDS`` ago (a
    site's SuperNode sends its signed request as its handshake ends: such a connection is
    idle, a peer's); else the first in a handshake over ``EVICTION_GRACE_SECONDS`` old;
    else the oldest of all (not the oldest in its handshake: under a flood of fast
    handshakes, that is a site's, in its slower one). The newcomer is never refused for
    connections that are no site's: Flower's SuperNode takes a connection closed in its
    handshake for a fatal TLS error (it exits, or stops serving), so a site's new
    connection must get in, and a site's young one is among the last to go (a peer would
    have to open a whole address's share of connections meanwhile).
    """
    if not candidates:
        return None
    idle = [c for c in candidates if c.ready is not None and now - c.ready >= READY_GRACE_SECONDS]
    if idle:
        return min(idle, key=lambda c: c.ready or 0.0)
    stalled = (
        c for c in candidates if c.ready is None and now - c.opened >= EVICTION_GRACE_SECONDS
    )
    return next(stalled, None) or min(candidates, key=lambda c: c.opened)


def peer_block(address: str) -> str:
    """What a peer's connections are counted under: its IPv4 address, or its IPv6 /64.

    A host or a customer's network is given a whole IPv6 /64 (SLAAC needs one), so a peer
    counted by its /128 could open MAX_CONNECTIONS_PER_ADDRESS connections from each of
    2⁶⁴ addresses. An IPv4-mapped IPv6 address counts as its IPv4 address.
    """
    try:
        ip = ipaddress.ip_address(address.partition("%")[0])  # without a zone (fe80::1%eth0)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class FleetGateway(socketserver.ThreadingMixIn, http.server.HTTPServer):
    """The listening server; one ``_FleetHandler`` thread per connection."""

    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False

    def __init__(self, config: GatewayConfig, reports: Reports) -> None:
        self.config = config
        self.reports = reports
        self._count_lock = threading.Lock()
        self._open: dict[int, _Connection] = {}  # id(socket) → its connection, oldest first
        # site fingerprint → when the SuperLink first refused it as active already (since
        # its last activation), for REJOIN_WINDOW_SECONDS
        self.refused_since: dict[str, float] = {}
        self.registry = SiteRegistry.read(config.registry) if config.registry else None
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        self.address_family = family
        super().__init__((config.host, config.port), _FleetHandler)
        self.tls_context: ssl.SSLContext | None = None
        verify: ssl.SSLContext | bool = False
        if config.tls is not None:
            server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            server.minimum_version = ssl.TLSVersion.TLSv1_2
            server.load_cert_chain(config.tls.certfile, config.tls.keyfile)
            self.tls_context = server
            # The SuperLink presents the same certificate on 127.0.0.1.
            verify = ssl.create_default_context(cafile=str(config.tls.ca_certfile))
        scheme = "https" if config.tls is not None else "http"
        self.upstream = httpx.Client(
            base_url=f"{scheme}://{config.upstream}", verify=verify, timeout=UPSTREAM_TIMEOUT
        )

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve the connection in a thread of its own, closing one that carried no site's
        request when too many are open (``_evicted``; refusing this one only when every
        open connection is a site's)."""
        source = client_address[0]
        block = peer_block(source)
        now = time.monotonic()
        with self._count_lock:
            anonymous = [c for c in self._open.values() if not c.site]
            here = [c for c in anonymous if c.block == block]
            if len(here) >= MAX_CONNECTIONS_PER_ADDRESS:
                full, candidates = True, here
            elif len(self._open) >= MAX_CONNECTIONS:
                # from the address holding the most: a peer cannot evict another's by
                # spreading its connections over many addresses
                counts: dict[str, int] = {}
                for c in anonymous:
                    counts[c.block] = counts.get(c.block, 0) + 1
                full = True
                candidates = sorted(anonymous, key=lambda c: -counts[c.block])
            else:
                full, candidates = False, []
            # from the block holding the most (sorted keeps each block's order): _evicted
            # finds one whenever it is given any
            busiest = candidates[0].block if candidates else None
            evicted = _evicted([c for c in candidates if c.block == busiest], now)
            if evicted is not None:
                del self._open[id(evicted.sock)]
            crowded = full and evicted is None
            if not crowded:
                self._open[id(request)] = _Connection(request, source, opened=now, block=block)
        if evicted is not None:
            self.reports.say(
                f"closed a connection from {evicted.source} for a new one: too many "
                "connections open that carried no registered site's request",
                key=f"evicted {evicted.source}",
            )
            with contextlib.suppress(OSError):
                # The TCP socket's own shutdown: an SSLSocket's would drop its TLS state
                # under the thread that may be in its handshake. The thread then ends.
                socket.socket.shutdown(evicted.sock, socket.SHUT_RDWR)
        if crowded:
            self.reports.say(
                f"refused {source}: too many connections open at once",
                key=f"crowded {block}",
            )
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread (the process is out of them): its slot is free
            with self._count_lock:
                self._open.pop(id(request), None)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._count_lock:
                self._open.pop(id(request), None)

    def mark_ready(self, request: Any) -> None:
        """The connection ``request`` is past its TLS handshake (or has none)."""
        with self._count_lock:
            connection = self._open.get(id(request))
            if connection is not None:
                connection.ready = time.monotonic()

    def mark_site(self, request: Any, fingerprint: str) -> None:
        """The connection ``request`` carried the signed request of the registered site
        with key ``fingerprint``; past ``MAX_CONNECTIONS_PER_SITE`` of that site's, its
        oldest is closed."""
        with self._count_lock:
            connection = self._open.get(id(request))
            if connection is None:
                return
            connection.site = fingerprint
            held = [c for c in self._open.values() if c.site == fingerprint]  # oldest first
            evicted = held[0] if len(held) > MAX_CONNECTIONS_PER_SITE else None
            if evicted is not None:
                del self._open[id(evicted.sock)]
        if evicted is not None:
            self.reports.say(
                f"closed the oldest connection of {self.who(fingerprint)}: a site may hold "
                f"at most {MAX_CONNECTIONS_PER_SITE} open",
                key=f"site crowded {fingerprint}",
            )
            with contextlib.suppress(OSError):  # as in process_request
                socket.socket.shutdown(evicted.sock, socket.SHUT_RDWR)

    def is_site(self, request: Any) -> bool:
        with self._count_lock:
            connection = self._open.get(id(request))
            return connection is not None and connection.site is not None

    def get_request(self) -> tuple[Any, Any]:
        sock, address = super().get_request()
        if self.tls_context is None:
            return sock, address
        # The handshake happens in the connection's own thread (see _FleetHandler.setup),
        # so that a slow or failing client holds up no one and its failure is seen.
        return (
            self.tls_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False),
            address,
        )

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, _Refused | ConnectionError | TimeoutError | ssl.SSLError):
            return  # refused and reported, or the peer went away
        # One line, never a traceback: the server's console relays this log. One a minute
        # per peer and kind of error, whatever its text (which the peer may shape).
        source = client_address[0]
        kind = type(error).__name__
        self.reports.say(
            f"error serving {source}: {kind}: {quoted(str(error))}",
            key=f"error serving {source}: {kind}",
        )

    def server_close(self) -> None:
        super().server_close()
        upstream = getattr(self, "upstream", None)  # none yet when listening failed
        if upstream is not None:
            upstream.close()

    def who(self, fingerprint: str | None) -> str:
        """A node in words: its registered site, or its key's fingerprint."""
        if fingerprint is None:
            return "a SuperNode"
        if self.registry is None:  # no site authentication: every key is a node's own
            return f"a SuperNode (key {fingerprint})"
        name = next((s.name for s in self.registry.sites if s.fingerprint == fingerprint), None)
        return f"site {name}" if name else f"a SuperNode with unregistered key {fingerprint}"


class _FleetHandler(http.server.BaseHTTPRequestHandler):
    """One connection: its TLS handshake, then its requests, each forwarded or refused."""

    server: FleetGateway
    protocol_version = "HTTP/1.1"  # keep-alive: a SuperNode polls every 3 s
    # Seconds a connection may stay silent (no byte of a request): sites send one every
    # 3 s; a peer that trickles bytes or sits idle longer loses its connection.
    timeout = 120

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):
            self.request.settimeout(HANDSHAKE_SECONDS)
            try:
                self.request.do_handshake()
            except (ssl.SSLError, OSError) as exc:
                if _quiet(exc):  # a port scan, or a probe that only connected
                    raise _Refused from None
                source = self.client_address[0]
                self.server.reports.say(f"refused {source}: {handshake_reason(exc)}")
                raise _Refused from None
        self.server.mark_ready(self.request)
        super().setup()
        self._head = _BoundedHead(self.rfile)
        self.rfile = self._head  # type: ignore[assignment]  # read through, as a file

    def handle_one_request(self) -> None:
        self._head.left = MAX_HEAD_BYTES  # each request's line and headers
        try:
            super().handle_one_request()
        except _HeadTooLarge:
            self._refuse_head()

    def _refuse_head(self) -> None:
        source = self.client_address[0]
        self.server.reports.say(
            f"refused {source}: a request line and headers over {MAX_HEAD_BYTES:,} bytes",
            key=f"refused {source}: large head",
        )
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.wfile.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
            self.wfile.write(b"Connection: close\r\nContent-Length: 0\r\n\r\n")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass  # the SuperLink logs every request it serves; refusals are reported

    def do_POST(self) -> None:
        action = FLEET_PATHS.get(self.path)  # exact: no dot segments, query or encoding
        if action is None:
            self._refuse()
            return
        path = FLEET_PREFIX + action  # ours, not the client's
        length = self.headers.get("content-length")
        if length is None or not (length.isascii() and length.isdigit()):
            self.send_error(411 if length is None else 400)
            return
        digits = length.lstrip("0") or "0"  # (int() refuses more than 4300 digits)
        size = int(digits) if len(digits) <= len(str(MAX_BODY_BYTES)) else MAX_BODY_BYTES + 1
        if size > MAX_BODY_BYTES:
            self.send_error(413)
            return
        if not _forwardable(self.headers):
            source = self.client_address[0]
            self.server.reports.say(
                f"refused {source}: a header that is not HTTP's (its name not a token, or "
                "its value not printable ASCII)",
                key=f"refused {source}: malformed header",
            )
            self.send_error(400, "malformed header")
            return
        signer = None  # the registered site that signed this request, where it matters
        if action == "activate-node" or not self.server.is_site(self.request):
            signer = self._signing_site()
            if signer is not None and not self.server.is_site(self.request):
                self.server.mark_site(self.request, signer)  # (without site auth: none)
        if size > ANONYMOUS_BODY_BYTES and not self._trusted():
            source = self.client_address[0]
            self.server.reports.say(
                f"refused {source}: a {size:,}-byte body without a registered site's "
                "signature (above 1 MiB only sites may send)",
                key=f"refused {source}: large unsigned body",
            )
            self.send_error(401)
            return
        body = self.rfile.read(size)
        if len(body) != size:  # the peer closed first: nothing to forward
            self.close_connection = True
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        # The SuperLink trusts forwarding headers from 127.0.0.1, which we are: only the
        # peer's real address may reach it.
        headers["X-Forwarded-For"] = self.client_address[0]
        try:
            reply = self.server.upstream.post(path, content=body, headers=headers)
        except httpx.HTTPError as exc:
            upstream = self.server.config.upstream
            self.server.reports.say(
                f"cannot reach the SuperLink at {upstream}: {quoted(str(exc))}",
                key=f"cannot reach the SuperLink: {type(exc).__name__}",
            )
            self.send_error(502)
            return
        if action == "activate-node" and signer is not None and self._told_to_retry(reply, signer):
            self._note_retry()
            self.send_error(503, "the site's previous SuperNode is still counted active")
            return
        self._note(reply.status_code)
        self.send_response(reply.status_code)
        for key, value in reply.headers.items():
            if key.lower() not in _HOP_BY_HOP:
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(reply.content)))
        self.end_headers()
        self.wfile.write(reply.content)

    def do_GET(self) -> None:
        self._refuse()

    do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_GET

    # ------------------------------------------------------------------ internals
    def _trusted(self) -> bool:
        """Whether a large body may be read: from a site's connection, or from anyone
        without site authentication."""
        return self.server.registry is None or self.server.is_site(self.request)

    def _signing_site(self) -> str | None:
        """The key fingerprint of the registered site whose key the request carries with
        that key's fresh signature of its timestamp, as Flower's SuperNode signs every
        Fleet request (the SuperLink checks the same again); None if none, and without
        site authentication."""
        registry = self.server.registry
        if registry is None:
            return None
        header = self.headers.get(PUBLIC_KEY_HEADER)
        site = key_fingerprint(header)
        if site not in {s.fingerprint for s in registry.sites}:
            return None
        holds = signature_holds(
            header or "",
            self.headers.get(TIMESTAMP_HEADER) or "",
            self.headers.get(SIGNATURE_HEADER) or "",
        )
        return site if holds else None

    def _refuse(self) -> None:
        source = self.client_address[0]
        self.server.reports.say(
            f"refused {source}: {self.command} {quoted(self.path)} — only "
            "the Fleet API is served on this address (the SuperLink's Control API listens "
            "on the server's loopback only)",
            key=f"refused {source}: not the Fleet API",  # one line a minute, whatever paths
        )
        self.send_error(404, "only the Fleet API is served here")

    def _told_to_retry(self, reply: httpx.Response, signer: str) -> bool:
        """Whether ``signer``'s activation, which the SuperLink answered with ``reply``, is
        to be retried: refused as active already (``NODE_ACTIVATION_FAILED``) within
        ``REJOIN_WINDOW_SECONDS`` of the site's first such refusal. An activation that
        succeeds ends the site's window."""
        refused_since = self.server.refused_since
        if reply.status_code < 400:
            refused_since.pop(signer, None)
            return False
        try:
            error = json.loads(reply.content)
        except ValueError:
            return False
        if not (isinstance(error, dict) and error.get("code") == NODE_ACTIVATION_FAILED):
            return False
        first = refused_since.setdefault(signer, time.monotonic())
        return time.monotonic() - first < REJOIN_WINDOW_SECONDS

    def _note_retry(self) -> None:
        """Report a registered site told to retry joining (once a minute per site)."""
        source = self.client_address[0]
        who = self.server.who(key_fingerprint(self.headers.get(PUBLIC_KEY_HEADER)))
        self.server.reports.say(
            f"{who} from {source} must wait to join: the SuperLink still counts its previous "
            "SuperNode connected (a restart soon after a crash, or a second SuperNode with "
            f"its key); it retries until that one's heartbeat lapses, for "
            f"{REJOIN_WINDOW_SECONDS:.0f} s at most",
            key=f"retry {source}: {who}",
        )

    def _note(self, status: int) -> None:
        """Report a node joining, leaving, or refused by SuperNode authentication."""
        action = self.path[len(FLEET_PREFIX) :]
        source = self.client_address[0]
        if action == "register-node" and status >= 400:
            # A SuperNode without a private key asks to be registered with a fresh one.
            self.server.reports.say(
                f"refused a SuperNode from {source}: it has no registered key (started "
                "without a site's private key)"
            )
            return
        if status < 400 and action not in ("activate-node", "deactivate-node"):
            return
        who = self.server.who(key_fingerprint(self.headers.get(PUBLIC_KEY_HEADER)))
        if action == "activate-node" and status < 400:
            self.server.reports.say(f"{JOINED} {who} connected from {source}")
        elif action == "deactivate-node" and status < 400:
            self.server.reports.say(f"{LEFT} {who} disconnected ({source})")
        elif action == "activate-node":
            if who.startswith("site "):
                why = (
                    "the SuperLink counts this site connected already (a second SuperNode "
                    "with its key, or the key's registration out of step with the server's)"
                )
            else:
                why = "its key is not registered (it is not one of --sites)"
            # one line a minute per peer and site, whatever keys an intruder makes up
            kind = who if who.startswith("site ") else "an unregistered key"
            self.server.reports.say(
                f"refused {who} from {source}: {why}", key=f"refused {source}: {kind}"
            )
        elif status == 401:
            self.server.reports.say(
                f"refused {who} from {source}: its request's signature was not accepted",
                key=f"refused {source}: signature",
            )


def _quiet(exc: BaseException) -> bool:
    """A connection closed before it said anything: not worth a report."""
    return isinstance(exc, ssl.SSLEOFError | ConnectionResetError | BrokenPipeError) or (
        isinstance(exc, ssl.SSLError) and "EOF" in str(exc)
    )


def serve(config: GatewayConfig) -> None:
    """Listen and forward until the process is stopped."""
    reports = Reports()
    try:
        gateway = FleetGateway(config, reports)
    except OSError as exc:
        print(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}", flush=True)
        raise SystemExit(2) from None
    print(f"{READY_LINE} {config.host}:{config.port}", flush=True)
    with gateway:
        gateway.serve_forever(poll_interval=0.5)


def main(argv: list[str] | None = None) -> None:
    """``python -m flplatform.deploy.gateway`` (started by ``flplatform server``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="127.0.0.1:PORT of the SuperLink")
    parser.add_argument("--tls", nargs=3, type=Path, metavar=("CERT", "KEY", "CA_CERT"))
    parser.add_argument("--registry", type=Path)
    args = parser.parse_args(argv)
    serve(
        GatewayConfig(
            host=args.host,
            port=args.port,
            upstream=args.upstream,
            tls=TlsFiles(*args.tls) if args.tls else None,
            registry=args.registry,
        )
    )


if __name__ == "__main__":
    main()
