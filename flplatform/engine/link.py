"""A Grid that notices its SuperLink is gone, so that the run stops instead of training on.

In a simulation the ServerApp's Grid is in memory: flwr-simulation holds the federation's
state itself, so Grid calls go on answering after the SuperLink that started the run has
died, and Flower's parent monitors do not stop flwr-simulation either (the SIGINT they
raise is lost there). Unchecked, the ServerApp trains on and writes rounds into a run
whose SuperLink, and whose caller, are gone. ``LinkedGrid`` checks, at most once a
second and from the Grid calls the engine makes anyway, that something still listens at
the SuperLink's Runtime API address (the one Flower started this process with), and
raises ``RunFailed`` naming it once nothing has for ``LINK_GRACE_SECONDS``; the run is
then marked failed with that reason, like any run that stops early.

In a deployment (flwr-serverapp) the Grid talks to the SuperLink itself, over HTTP, and
Flower retries a call for ever while the SuperLink is unreachable: the call never
returns, and a check between calls never comes. So ``run_watched``, which runs the
rounds, also runs the same watch in a thread when the rounds run in the main thread
(flwr-serverapp's; flwr-simulation runs its ServerApp in a thread of its own, where the
checks between calls suffice): once the SuperLink is gone, the thread interrupts the main
thread with ``INTERRUPT_SIGNAL``, whose handler raises ``SuperLinkGone`` in the blocked
Grid call (only there: never in the ServerApp's own work, a ledger write, say). And when
the SuperLink's death makes Flower's own parent monitors raise SIGINT (SuperExec exits
when its SuperLink does, and flwr-serverapp when its SuperExec does), Flower's handler
would exit the process within seconds, the run left "running": while the rounds run, a
SIGINT or SIGTERM that finds the SuperLink unreachable first waits for the watch's
verdict, and a SuperLink found gone stops the run with that reason instead. The run is
recorded failed with it, never "stopped by the user".
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from types import FrameType
from typing import Any, TypeVar

from flwr.app import Message
from flwr.serverapp import Grid

from flplatform.core.errors import RunFailed
from flplatform.engine.strategy import ForwardingGrid

# Seconds nothing may listen at the SuperLink's address before the run stops: long enough
# for a probe that failed by chance, far shorter than a round.
LINK_GRACE_SECONDS = 3.0
PROBE_INTERVAL_SECONDS = 1.0
PROBE_TIMEOUT_SECONDS = 1.0
# Seconds between probes while a stop signal waits for the watch's verdict.
SETTLE_STEP_SECONDS = 0.2
# How Flower passes the SuperLink's Runtime API address to the processes it starts
# (flwr-simulation, flwr-serverapp); the second is its older, deprecated spelling.
ADDRESS_FLAGS = ("--runtime-api-address", "--simulationio-api-address")
# The signal by which the watch's thread interrupts the main thread (a POSIX one; where
# there is none, or something else handles it, only the checks between calls stop a run).
INTERRUPT_SIGNAL: signal.Signals | None = getattr(signal, "SIGUSR1", None)
# The signals Flower's processes stop on (and its parent monitors raise).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

Address = tuple[str, int]
T = TypeVar("T")


def superlink_address(argv: Sequence[str] | None = None) -> Address | None:
    """The SuperLink address this process was started with (``host:port``), or None."""
    args = list(sys.argv if argv is None else argv)
    for i, arg in enumerate(args):
        flag, _, value = arg.partition("=")
        if flag not in ADDRESS_FLAGS:
            continue
        if not value and i + 1 < len(args):
            value = args[i + 1]
        host, _, port = value.rpartition(":")
        if host and port.isdigit():
            return host.strip("[]"), int(port)
    return None


def probe(address: Address, timeout: float = PROBE_TIMEOUT_SECONDS) -> str | None:
    """None if something accepts a TCP connection at ``address``, else why not."""
    try:
        with socket.create_connection(address, timeout=timeout):
            return None
    except OSError as exc:
        return (exc.strerror or str(exc) or type(exc).__name__).lower()


def gone_reason(address: Address, why: str) -> str:
    """Why a run stopped whose SuperLink is gone, in one wording wherever it is noticed.

    ``why`` says how it was found gone: ``connection refused for 3 s`` (the watch), or
    ``killed by SIGKILL`` (the command that started the SuperLink, seeing it exit).
    """
    host, port = address
    return (
        f"the SuperLink at {host}:{port} is gone ({why}): it has exited, and the run "
        "cannot go on without it"
    )


class SuperLinkWatch:
    """Notice that the SuperLink has been unreachable for ``grace`` seconds.

    Thread-safe: the Grid's calls and ``run_watched``'s thread probe through one watch.

    Parameters
    ----------
    address : (host, port)
        The SuperLink's Runtime API address.
    grace : float, optional
        Seconds of failed probes in a row before the run stops (``LINK_GRACE_SECONDS``).
    interval : float, optional
        Least seconds between two probes (``PROBE_INTERVAL_SECONDS``); ``check`` is
        called far more often.
    clock : callable
        Monotonic seconds.
    """

    def __init__(
        self,
        address: Address,
        *,
        grace: float | None = None,
        interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.address = address
        self.grace = LINK_GRACE_SECONDS if grace is None else grace
        self.interval = PROBE_INTERVAL_SECONDS if interval is None else interval
        self._clock = clock
        # Reentrant: a stop signal's handler (``settle``) may run in the main thread
        # while that thread holds it.
        self._lock = threading.RLock()
        self._probed_at = -float("inf")
        self._down_since: float | None = None
        # Why the run cannot go on, once the SuperLink is found gone (for good: a run
        # whose SuperLink was gone that long has lost its messages in flight).
        self.gone: str | None = None
        self._calls = threading.local()  # .depth: Grid calls under way in this thread

    @property
    def in_call(self) -> bool:
        """Whether this thread is inside a Grid call (``LinkedGrid``) now."""
        return bool(getattr(self._calls, "depth", 0))

    def calling(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``call(*args, **kwargs)``, this thread noted as inside a Grid call meanwhile."""
        self._calls.depth = getattr(self._calls, "depth", 0) + 1
        try:
            return call(*args, **kwargs)
        finally:
            self._calls.depth -= 1

    def poll(self) -> str | None:
        """Probe the SuperLink if it is time; the reason it is gone, once it is."""
        with self._lock:
            if self.gone is not None:
                return self.gone
            now = self._clock()
            if now - self._probed_at < self.interval:
                return None
            self._probed_at = now
        return self._record(probe(self.address), now)

    def check(self) -> None:
        """Probe the SuperLink if it is time; raise ``RunFailed`` if it is gone."""
        gone = self.poll()
        if gone is not None:
            raise RunFailed(gone)

    def settle(self, timeout: float) -> str | None:
        """Probe until the SuperLink answers (None) or is found gone (why), ``timeout`` s at most.

        A SuperLink that answers at once costs one probe; one that does not is probed
        every ``SETTLE_STEP_SECONDS`` until the grace has passed. None also at the timeout.
        """
        deadline = self._clock() + timeout
        while True:
            now = self._clock()
            with self._lock:
                self._probed_at = now
            problem = probe(self.address)
            gone = self._record(problem, now)
            if gone is not None or problem is None or self._clock() >= deadline:
                return gone
            time.sleep(min(SETTLE_STEP_SECONDS, self.interval))

    def _record(self, problem: str | None, now: float) -> str | None:
        """Note one probe's outcome (started at ``now``); the reason, once it is gone."""
        with self._lock:
            if self.gone is not None:
                return self.gone
            if problem is None:
                self._down_since = None
                return None
            if self._down_since is None:
                self._down_since = now
            if now - self._down_since >= self.grace:
                self.gone = gone_reason(
                    self.address, f"{problem} for {now - self._down_since:.0f} s"
                )
            return self.gone


class LinkedGrid(ForwardingGrid):
    """``grid``, each of whose calls first checks that the SuperLink is still there.

    It also notes, per thread, when a call is under way (``SuperLinkWatch.calling``): the
    only place ``run_watched`` interrupts, as a call waiting on the SuperLink is the only
    thing that can wait for ever on it, and the Grid's network code is made to be
    interrupted (Ctrl-C); a ledger write or a checkpoint never is.
    """

    def __init__(self, grid: Grid, watch: SuperLinkWatch) -> None:
        super().__init__(grid)
        self.watch = watch

    def _before(self) -> None:
        self.watch.check()

    def get_node_ids(self) -> Iterable[int]:
        return self.watch.calling(super().get_node_ids)

    def get_nodes(self) -> Iterable[Any]:
        return self.watch.calling(super().get_nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.watch.calling(super().push_messages, messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.watch.calling(super().pull_messages, message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self.watch.calling(super().send_and_receive, messages, timeout=timeout)


def superlink_watch(grid: Grid) -> SuperLinkWatch | None:
    """The watch of ``grid``, or of a Grid it forwards to; None if it has none."""
    seen: Grid = grid
    while isinstance(seen, ForwardingGrid):
        if isinstance(seen, LinkedGrid):
            return seen.watch
        seen = seen._grid
    return None


def watch_superlink(grid: Grid, argv: Sequence[str] | None = None) -> Grid:
    """``grid`` watched by a ``SuperLinkWatch`` when this process knows its SuperLink.

    A ServerApp run by Flower (flwr-simulation, flwr-serverapp) does; one run in-process
    (tests, Flower's ``run_simulation``) does not, and keeps its Grid as it is. A Grid
    already watched (itself, or one it forwards to: a sweep's) is returned as it is.
    """
    if superlink_watch(grid) is not None:
        return grid
    address = superlink_address(argv)
    return grid if address is None else LinkedGrid(grid, SuperLinkWatch(address))


# ====================================================================== the main thread
class SuperLinkGone(BaseException):
    """Raised in the main thread, from a signal handler, inside a Grid call: the SuperLink
    is gone.

    A ``BaseException`` (as ``KeyboardInterrupt``), so that nothing on its way that
    handles errors (``except Exception``: a retry, the check of a reply) takes it for
    one; ``run_watched`` turns it into ``RunFailed``.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def run_watched(
    grid: Grid, body: Callable[[], T], on_failure: Callable[[BaseException], None]
) -> T:
    """``body()``, stopped if the SuperLink of ``grid``'s watch is found gone meanwhile.

    With no watch (a Grid outside Flower), or outside the main thread, this is ``body()``
    and the checks between Grid calls (``LinkedGrid``). In the main thread, a thread
    probes the SuperLink while ``body`` runs and interrupts it once the SuperLink is gone
    (see the module's notes), and a SIGINT or SIGTERM that finds the SuperLink not
    answering waits for the verdict first.

    If ``body`` raises, ``on_failure`` is called with what to record, and that is raised:
    ``RunFailed`` naming the SuperLink when it is gone (whatever stopped ``body``: the
    watch, a Grid call, or Flower's SIGINT), else what ``body`` raised. The watch's
    interruptions land inside Grid calls only, so never in ``on_failure``.
    """
    guard = _MainThreadGuard(superlink_watch(grid))
    try:
        guard.arm()  # (inside: a failure to arm is recorded and undone like any other)
        result = body()
    except BaseException as exc:
        guard.disarm()
        failure = guard.failure(exc)
        try:
            on_failure(failure)
        finally:
            guard.close()
        if failure is exc:
            raise
        # an error of its own that the SuperLink's end replaced keeps its traceback
        interruption = isinstance(exc, (SuperLinkGone, KeyboardInterrupt, SystemExit))
        raise failure from (None if interruption else exc)
    guard.close()
    return result


class _MainThreadGuard:
    """The thread and signal handlers of ``run_watched``; inert without a watch or off
    the main thread (it then only says which error to record)."""

    def __init__(self, watch: SuperLinkWatch | None) -> None:
        self.watch = watch
        self._armed = False
        self._settling = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._main = threading.main_thread().ident

    def arm(self) -> None:
        """Install the handlers and start the thread (in the main thread only)."""
        if (
            self.watch is None
            or INTERRUPT_SIGNAL is None
            or not hasattr(signal, "pthread_kill")
            or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(INTERRUPT_SIGNAL) is not signal.SIG_DFL
        ):
            return
        self._previous[INTERRUPT_SIGNAL] = signal.signal(INTERRUPT_SIGNAL, self._on_interrupt)
        for stop in STOP_SIGNALS:
            handler = signal.getsignal(stop)
            if callable(handler):  # a Python handler (Flower's): hold it for the verdict
                self._previous[stop] = signal.signal(stop, self._on_stop)
        self._armed = True
        self._thread = threading.Thread(target=self._watch, name="superlink-watch", daemon=True)
        self._thread.start()

    def disarm(self) -> None:
        """No more interruptions: the handlers do nothing more of their own."""
        self._armed = False
        self._stop.set()

    def close(self) -> None:
        """Disarm, wait for the thread, and put the previous handlers back."""
        self.disarm()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for signum, handler in self._previous.items():
            if signal.getsignal(signum) in (self._on_interrupt, self._on_stop):
                signal.signal(signum, handler)
        self._previous.clear()

    def failure(self, exc: BaseException) -> BaseException:
        """What to record and raise for ``exc``: the SuperLink's end if it is gone."""
        gone = self.watch.gone if self.watch is not None else None
        if isinstance(exc, SuperLinkGone):
            gone = exc.reason
        if gone is None or (isinstance(exc, RunFailed) and exc.reason == gone):
            return exc
        return RunFailed(gone)

    # ------------------------------------------------------------------ internals
    def _watch(self) -> None:
        """Probe every ``interval``; once the SuperLink is gone, signal the main thread, and
        again every ``interval`` until ``run_watched`` is done (an interruption outside a
        Grid call does nothing; one taken for something to retry is made again)."""
        assert self.watch is not None and INTERRUPT_SIGNAL is not None and self._main
        while not self._stop.wait(self.watch.interval):
            if self.watch.poll() is not None and self._armed:
                signal.pthread_kill(self._main, INTERRUPT_SIGNAL)

    def _interrupt(self) -> None:
        """Raise ``SuperLinkGone`` in the main thread if the SuperLink is gone and a Grid
        call is under way there (else the next call's check raises ``RunFailed``)."""
        watch = self.watch
        if watch is not None and watch.gone is not None and watch.in_call and self._armed:
            raise SuperLinkGone(watch.gone)

    def _on_interrupt(self, signum: int, frame: FrameType | None) -> None:
        self._interrupt()

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        """SIGINT or SIGTERM: the SuperLink's end if it is gone, else the previous handler.

        Flower's parent monitors raise SIGINT when SuperExec exits with its SuperLink:
        that one finds the SuperLink not answering, and waits for the watch's verdict.
        Once the SuperLink is gone, the signal is dropped where it cannot interrupt a Grid
        call: the run stops at the next call, or is being recorded failed already, and
        the process exits after.
        """
        previous = self._previous.get(signal.Signals(signum))
        if self.watch is not None and not self._settling:
            gone = self.watch.gone
            if gone is None and self._armed:
                self._settling = True
                try:
                    gone = self.watch.settle(self.watch.grace + 2 * self.watch.interval)
                finally:
                    self._settling = False
            if gone is not None:
                self._interrupt()
                return
        if callable(previous):
            previous(signum, frame)
