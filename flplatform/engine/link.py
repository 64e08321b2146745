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

In a deployment the Grid talks to the SuperLink itself, and Flower retries a call while
the SuperLink is unreachable (it may be restarted): the check runs between calls.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable, Sequence

from flwr.serverapp import Grid

from flplatform.engine.strategy import ForwardingGrid
from flplatform.errors import RunFailed

# Seconds nothing may listen at the SuperLink's address before the run stops: long enough
# for a probe that failed by chance, far shorter than a round.
LINK_GRACE_SECONDS = 3.0
PROBE_INTERVAL_SECONDS = 1.0
PROBE_TIMEOUT_SECONDS = 1.0
# How Flower passes the SuperLink's Runtime API address to the processes it starts
# (flwr-simulation, flwr-serverapp); the second is its older, deprecated spelling.
ADDRESS_FLAGS = ("--runtime-api-address", "--simulationio-api-address")

Address = tuple[str, int]


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


class SuperLinkWatch:
    """Raise ``RunFailed`` once the SuperLink has been unreachable for ``grace`` seconds.

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
        self._probed_at = -float("inf")
        self._down_since: float | None = None

    def check(self) -> None:
        """Probe the SuperLink if it is time; raise ``RunFailed`` if it is gone."""
        now = self._clock()
        if now - self._probed_at < self.interval:
            return
        self._probed_at = now
        problem = probe(self.address)
        if problem is None:
            self._down_since = None
            return
        if self._down_since is None:
            self._down_since = now
        if now - self._down_since >= self.grace:
            host, port = self.address
            raise RunFailed(
                f"the SuperLink at {host}:{port} is gone ({problem} for "
                f"{now - self._down_since:.0f} s): it has exited, and the run cannot go on "
                "without it"
            )


class LinkedGrid(ForwardingGrid):
    """``grid``, each of whose calls first checks that the SuperLink is still there."""

    def __init__(self, grid: Grid, watch: SuperLinkWatch) -> None:
        super().__init__(grid)
        self.watch = watch

    def _before(self) -> None:
        self.watch.check()


def watch_superlink(grid: Grid, argv: Sequence[str] | None = None) -> Grid:
    """``grid`` watched by a ``SuperLinkWatch`` when this process knows its SuperLink.

    A ServerApp run by Flower (flwr-simulation, flwr-serverapp) does; one run in-process
    (tests, Flower's ``run_simulation``) does not, and keeps its Grid as it is.
    """
    if isinstance(grid, LinkedGrid):
        return grid
    address = superlink_address(argv)
    return grid if address is None else LinkedGrid(grid, SuperLinkWatch(address))
