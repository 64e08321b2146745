"""The processes a command starts, and stopping every one of them when it is told to stop.

``flplatform simulate`` starts a SuperLink and ``flwr run``, each in a session of its own.
The SuperLink starts SuperExec in another session, and SuperExec the simulation in that
one: flwr-simulation (the ServerApp), Ray's gcs_server, raylet, dashboard agents and the
ClientApp actors. Their parents do not stop them reliably: Flower's parent monitors raise
SIGINT, which flwr-simulation never acts on, so a simulation whose SuperLink died trains on;
and a process whose parent died is re-parented away from a walk down from ours. So a
``ProcessTree`` records, while the run goes, the sessions of everything below the processes
it started, and ``stop`` signals every live process of those sessions and every process it
ever saw below them: SIGTERM, then SIGKILL after a short grace.

Whoever runs the command stops it with SIGINT (Ctrl-C) or SIGTERM (``kill``, a service
manager): ``stop_signals`` turns both into ``StopRequested`` in the main thread, once, so
that the command can stop its processes and record why before it exits.

Linux reads ``/proc``; elsewhere only the started processes' own groups are signalled.

``listening_sockets`` says where processes listen (``/proc/net`` and their open files), so
that a check can see that a simulation's processes are reachable from this machine only.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, NamedTuple

from flplatform.run.owner import stat_fields

# Seconds a process has to exit after SIGTERM before it is killed. The SuperLink, SuperExec
# and `flwr run` exit within half a second of SIGTERM; flwr-simulation and Ray's processes
# do not exit at all while their driver lives (flwr-simulation's exit handler waits on a
# SuperLink that is already gone), so a longer grace only delays the stop.
TERM_GRACE_SECONDS = 1.0
# Seconds to wait for SIGKILLed processes to be gone (the kernel frees their memory).
KILL_WAIT_SECONDS = 3.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_PROC = Path("/proc")


class StopRequested(KeyboardInterrupt):
    """SIGINT or SIGTERM told the command to stop.

    A ``KeyboardInterrupt``, so that code which cleans up after Ctrl-C also cleans up after
    SIGTERM. ``exit_code`` is what a shell reports for a process the signal ended.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(self.name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def stop_reason(exc: BaseException) -> str:
    """Why a run stopped, for the ledger: which signal the user sent."""
    name = exc.name if isinstance(exc, StopRequested) else "SIGINT"
    return f"stopped by the user ({name})"


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """Raise ``StopRequested`` in the main thread on the first SIGINT or SIGTERM.

    Later signals are ignored until the block ends: the command is already stopping, and
    a second Ctrl-C must not cut short the stopping of its processes. A signal ignored
    when the block begins stays ignored: a shell runs a background job with SIGINT
    ignored, and such a job is stopped with SIGTERM. Outside the main thread (where
    Python cannot install handlers) the block changes nothing. The previous handlers are
    restored at the end.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if stopping:
            return
        stopping = True
        raise StopRequested(signum)

    previous: dict[signal.Signals, Any] = {}
    try:
        for stop in STOP_SIGNALS:
            if signal.getsignal(stop) is not signal.SIG_IGN:
                previous[stop] = signal.signal(stop, on_signal)
        yield
    finally:
        for stop, handler in previous.items():
            signal.signal(stop, handler)


@dataclass(frozen=True)
class _Proc:
    """One line of ``/proc/PID/stat``, the fields we need."""

    pid: int
    ppid: int
    pgrp: int
    sid: int
    start: int  # clock ticks after boot: tells a process from a later one with its pid
    state: str


def process_table() -> dict[int, _Proc] | None:
    """Every process on the machine, or None without ``/proc``."""
    if not _PROC.is_dir():
        return None
    table: dict[int, _Proc] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        fields = stat_fields(pid)
        if fields is None:
            continue
        table[pid] = _Proc(
            pid=pid,
            ppid=int(fields[1]),
            pgrp=int(fields[2]),
            sid=int(fields[3]),
            start=int(fields[19]),
            state=fields[0],
        )
    return table


def _live(proc: _Proc) -> bool:
    # A zombie has exited; it only waits for its parent to read its status.
    return proc.state not in ("Z", "X")


class ProcessTree:
    """The processes a command started, everything they started, and stopping them all.

    Start processes with ``popen`` (each gets a session of its own, so a terminal's
    Ctrl-C reaches only the command, which then stops them in order); call ``record``
    now and then while they run, so that processes re-parented after their parent died
    are still known; ``stop`` ends them all. Used as a context manager, it stops them
    when the block ends, however it ends.
    """

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[bytes]] = []
        # Never the session we were started in: it holds the user's shell (a child that
        # did not start a session of its own is found below the started ones, by pid).
        # A session we lead (setsid flplatform ...) holds only what we started.
        own = os.getsid(0)
        self._foreign_sessions: frozenset[int] = frozenset(() if own == os.getpid() else (own,))
        self._sessions: set[int] = set()
        self._seen: dict[int, int] = {}  # pid -> start time of every process recorded

    def __enter__(self) -> ProcessTree:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def popen(self, args: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """``subprocess.Popen`` in a new session, recorded as part of the tree.

        On Linux the child is also killed when this process dies, however it dies: a
        command killed with SIGKILL cannot stop its tree, and a SuperLink left behind would
        keep its ServerApp writing rounds into the run (its ServerApp stops when it goes:
        ``engine.link``). Linux ties this to the thread that started the child: start
        the tree's processes from a thread that outlives them (the CLI's main thread).
        """
        proc: subprocess.Popen[bytes] = subprocess.Popen(
            args, start_new_session=True, preexec_fn=_die_with_parent(), **kwargs
        )
        return self.adopt(proc)

    def adopt(self, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        """Make ``proc``, started in a session of its own, part of the tree; return it."""
        self.started.append(proc)
        self._sessions.add(proc.pid)  # a new session's id is its leader's pid
        return proc

    def record(self) -> None:
        """Note every process below the started ones, and the sessions they are in."""
        table = process_table()
        if table is None:
            return
        members = self._members(table)
        for proc in members:
            self._seen[proc.pid] = proc.start
        # A session none of whose processes lives is gone for good (no process can join
        # it), and forgetting it keeps a later process that reuses its id out of reach.
        self._sessions = (
            {p.sid for p in members} | {p.pid for p in self.started if _running(p)}
        ) - self._foreign_sessions

    def alive(self) -> list[int]:
        """Pids of the tree's processes still running (zombies excluded)."""
        table = process_table()
        if table is None:
            return [p.pid for p in self.started if _running(p)]
        return sorted(p.pid for p in self._members(table))

    def stop(
        self, *, grace: float = TERM_GRACE_SECONDS, kill_wait: float = KILL_WAIT_SECONDS
    ) -> list[int]:
        """SIGTERM every process of the tree, SIGKILL those left after ``grace`` seconds.

        Returns the pids still running after ``kill_wait`` more seconds (none, unless a
        process is stuck in the kernel). Safe to call again.
        """
        self.record()
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        deadline = time.monotonic() + kill_wait
        while time.monotonic() < deadline:
            self.record()  # a process started during the grace (Ray restarting a worker)
            if not self._signal_all(signal.SIGKILL):
                break
            time.sleep(0.05)
        return self.alive()

    # ------------------------------------------------------------------ internals
    def _members(self, table: dict[int, _Proc]) -> list[_Proc]:
        """Live processes of the tree: below a started one, in its sessions, or seen."""
        children: dict[int, list[int]] = {}
        for proc in table.values():
            children.setdefault(proc.ppid, []).append(proc.pid)
        found: set[int] = set()
        todo = [p.pid for p in self.started]
        while todo:
            pid = todo.pop()
            if pid in table and pid not in found:
                found.add(pid)
                todo.extend(children.get(pid, []))
        found |= {p.pid for p in table.values() if p.sid in self._sessions}
        found |= {pid for pid, t in self._seen.items() if pid in table and table[pid].start == t}
        found.discard(os.getpid())
        return [table[pid] for pid in found if _live(table[pid])]

    def _signal_all(self, signum: int) -> int:
        """Send ``signum`` to every live process of the tree; return how many there were."""
        for proc in self.started:
            proc.poll()  # reap the ones that exited, so they no longer count
        table = process_table()
        if table is None:  # no /proc: the started processes' groups are all we know
            live = [p for p in self.started if _running(p)]
            for proc in live:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signum)
            return len(live)
        members = self._members(table)
        for member in members:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(member.pid, signum)
        return len(members)


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to SIGKILL the child when its parent dies (None elsewhere)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def _running(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is None


# ============================================================== where processes listen
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Socket states in /proc/net/{tcp,udp}* (include/net/tcp_states.h): a TCP socket that
# accepts connections is LISTEN; a UDP socket that receives from anyone is not connected,
# which the kernel shows as CLOSE (ss -lu lists those as UNCONN).
_TCP_LISTEN = 0x0A
_UDP_UNCONNECTED = 0x07
# Each table of /proc/PID/net: its protocol and the state of its listening sockets.
_NET_TABLES = {
    "tcp": ("tcp", _TCP_LISTEN),
    "tcp6": ("tcp", _TCP_LISTEN),
    "udp": ("udp", _UDP_UNCONNECTED),
    "udp6": ("udp", _UDP_UNCONNECTED),
}


class ProcNetEntry(NamedTuple):
    """One socket of a ``/proc/net/{tcp,tcp6,udp,udp6}`` table: its local end and state."""

    address: IPAddress
    port: int
    state: int
    inode: int


@dataclass(frozen=True)
class ListeningSocket:
    """A socket a process listens on: TCP in LISTEN, or UDP not connected to a peer."""

    pid: int
    command: str  # the process's name (/proc/PID/comm), as ``ss -p`` shows it
    protocol: str  # "tcp" or "udp"
    address: IPAddress
    port: int

    @property
    def loopback(self) -> bool:
        """Whether only this machine can reach it (127.0.0.0/8, ::1, ::ffff:127.x.x.x)."""
        # gRPC listens on 127.0.0.1 through an IPv6 socket, bound to ::ffff:127.0.0.1.
        mapped = self.address.ipv4_mapped if self.address.version == 6 else None
        return self.address.is_loopback or (mapped is not None and mapped.is_loopback)

    def __str__(self) -> str:
        """As ``ss`` shows it: ``tcp [::ffff:127.0.0.1]:6379 (raylet, pid 7)``."""
        if self.address.version == 4:
            host = str(self.address)
        elif (mapped := self.address.ipv4_mapped) is not None:
            host = f"[::ffff:{mapped}]"  # Python before 3.13 writes ::ffff:7f00:1
        else:
            host = f"[{self.address}]"
        return f"{self.protocol} {host}:{self.port} ({self.command}, pid {self.pid})"


def parse_proc_net(text: str) -> list[ProcNetEntry]:
    """The sockets of a ``/proc/net/tcp``-style table (tcp, tcp6, udp, udp6).

    Each line after the header reads ``sl local_address rem_address st ... inode ...``,
    the local address as ``HEX_IP:HEX_PORT``.
    """
    entries: list[ProcNetEntry] = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        address, port = fields[1].split(":")
        entries.append(
            ProcNetEntry(
                address=_proc_net_address(address),
                port=int(port, 16),
                state=int(fields[3], 16),
                inode=int(fields[9]),
            )
        )
    return entries


def _proc_net_address(text: str) -> IPAddress:
    """An address as ``/proc/net`` prints it: hex, each 32-bit word in host byte order."""
    raw = bytes.fromhex(text)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(raw)


def listening_sockets(pids: Iterable[int]) -> list[ListeningSocket]:
    """Every TCP and UDP socket (IPv4 and IPv6) that the processes ``pids`` listen on.

    A socket is matched to a process through the process's open files (``/proc/PID/fd``
    links read ``socket:[INODE]``), so a process that exits meanwhile, or that this user
    may not inspect, is left out. Linux only; empty without ``/proc``.
    """
    listening: dict[str, list[tuple[str, ProcNetEntry]]] = {}  # per network namespace
    found: list[ListeningSocket] = []
    for pid in pids:
        proc = _PROC / str(pid)
        try:
            command = (proc / "comm").read_text().strip()
            inodes = _socket_inodes(proc)
            namespace = os.readlink(proc / "ns" / "net")
            if namespace not in listening:
                listening[namespace] = _listening_entries(proc / "net")
        except OSError:  # it exited while we looked, or is not ours to inspect
            continue
        found.extend(
            ListeningSocket(pid, command, protocol, entry.address, entry.port)
            for protocol, entry in listening[namespace]
            if entry.inode in inodes
        )
    return found


def _listening_entries(net: Path) -> list[tuple[str, ProcNetEntry]]:
    """The listening sockets of one network namespace, with their protocol."""
    entries: list[tuple[str, ProcNetEntry]] = []
    for table, (protocol, state) in _NET_TABLES.items():
        try:
            text = (net / table).read_text()
        except FileNotFoundError:  # a kernel without IPv6
            continue
        entries.extend((protocol, e) for e in parse_proc_net(text) if e.state == state)
    return entries


def _socket_inodes(proc: Path) -> set[int]:
    """The inodes of the sockets a process has open."""
    inodes = set()
    for fd in (proc / "fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed while we looked
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds the TCP socket listening on ``port``.

    None where ``/proc`` cannot tell: no listener on that port in the network namespace's
    tables (as on WSL 1, whose tables are empty), or the process's files unreadable.
    """
    proc = _PROC / str(pid)
    try:
        listeners = [
            entry
            for protocol, entry in _listening_entries(proc / "net")
            if protocol == "tcp" and entry.port == port
        ]
        if not listeners:
            return None
        inodes = _socket_inodes(proc)
    except OSError:
        return None
    return any(entry.inode in inodes for entry in listeners)
