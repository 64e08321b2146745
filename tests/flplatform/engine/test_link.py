"""A run whose SuperLink is gone stops, failed with the reason, instead of training on.

The SuperLink is stood in for by what the watch checks, a real listening socket; the
round engine, ``flplatform.start`` and the SQL ledger are the real ones. A deployed
ServerApp's Grid call that waits for ever on its dead SuperLink (Flower's HttpGrid retries
without end) is stood in for by one that does the same, and Flower's stop handler by one
that exits as Flower's does; the signals are real ones, in pytest's main thread.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import FrameType

import pytest
from flwr.app import Message
from flwr.serverapp import Grid

from flplatform.core import keys
from flplatform.core.errors import RunFailed
from flplatform.engine import link
from flplatform.engine.link import (
    LinkedGrid,
    SuperLinkWatch,
    run_watched,
    superlink_address,
    superlink_watch,
    watch_superlink,
)
from flplatform.engine.strategy import ForwardingGrid
from flplatform.run.start import start
from storage import LedgerRepository
from strategies.local_sgd import LocalSGDAveraging
from tests.helpers.scripted_grid import ScriptedGrid
from tests.helpers.sites import MODEL, replying_site, trained

pytestmark = pytest.mark.usefixtures("task_identity")


@pytest.fixture
def superlink() -> Iterator[socket.socket]:
    """A socket listening on a free loopback port, as the SuperLink's Runtime API does."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen()
    yield server
    server.close()


def test_the_address_is_the_one_flower_started_the_process_with() -> None:
    argv = ["flwr-simulation", "--runtime-api-address", "127.0.0.1:9091", "--token", "t"]
    assert superlink_address(argv) == ("127.0.0.1", 9091)
    assert superlink_address(["flwr-serverapp", "--runtime-api-address=[::1]:9091"]) == (
        "::1",
        9091,
    )
    assert superlink_address(["x", "--simulationio-api-address", "10.0.0.2:7"]) == ("10.0.0.2", 7)
    assert superlink_address(["pytest", "-k", "link"]) is None
    assert superlink_address(["x", "--runtime-api-address"]) is None


def test_a_grid_outside_flower_is_left_as_it_is() -> None:
    grid = ScriptedGrid({})
    assert watch_superlink(grid, argv=["pytest"]) is grid
    watched = watch_superlink(grid, argv=["x", "--runtime-api-address", "127.0.0.1:1"])
    assert isinstance(watched, LinkedGrid)
    assert watch_superlink(watched, argv=["x", "--runtime-api-address", "127.0.0.1:1"]) is watched
    # A Grid forwarding to a watched one (a sweep's) is watched already, by that watch.
    forwarding = ForwardingGrid(watched)
    assert watch_superlink(forwarding, argv=["x", "--runtime-api-address", "127.0.0.1:1"]) is (
        forwarding
    )
    assert superlink_watch(forwarding) is watched.watch
    assert superlink_watch(grid) is None


def test_the_watch_fails_only_after_the_grace_and_forgives_a_link_that_came_back(
    superlink: socket.socket,
) -> None:
    address = superlink.getsockname()
    now = [0.0]
    watch = SuperLinkWatch(address, grace=3.0, interval=1.0, clock=lambda: now[0])
    watch.check()  # listening
    superlink.close()
    for t in (0.5, 1.0, 2.5):  # probed at 1.0 and 2.5 only; down for 1.5 s: not yet
        now[0] = t
        watch.check()
    now[0] = 4.0
    with pytest.raises(RunFailed, match=rf"SuperLink at 127.0.0.1:{address[1]} is gone \("):
        watch.check()

    # A SuperLink that answers again before the grace resets it.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as again:
        again.bind(("127.0.0.1", 0))
        again.listen()
        now[0] = 0.0
        watch = SuperLinkWatch(again.getsockname(), grace=3.0, interval=1.0, clock=lambda: now[0])
        watch._down_since = -2.0  # down since 2 s ago, as far as it knows
        now[0] = 1.0
        watch.check()
        now[0] = 10.0
        watch.check()  # it answered at 1.0: the clock of its absence restarted


def test_a_run_whose_superlink_dies_mid_round_stops_failed_with_the_reason(
    tmp_path: Path, superlink: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As flwr-simulation's in-memory Grid does, the sites go on answering nothing; the
    run stops at the watch's next probe after the grace, not at the round timeout."""
    port = superlink.getsockname()[1]
    monkeypatch.setattr(
        sys, "argv", ["flwr-simulation", "--runtime-api-address", f"127.0.0.1:{port}"]
    )
    monkeypatch.setattr(link, "LINK_GRACE_SECONDS", 0.3)
    monkeypatch.setattr(link, "PROBE_INTERVAL_SECONDS", 0.1)
    honest = replying_site("a", trained(1.0, examples=10, loss=1.0))

    def dies_in_round_2(msg: Message) -> Message | None:
        config = msg.content.config_records.get(keys.CONFIG)
        if config is not None and config.get(keys.SERVER_ROUND) == 2:
            superlink.close()  # the SuperLink is killed while round 2 trains
            return None
        return honest(msg)

    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    with pytest.raises(RunFailed, match="is gone") as raised:
        start(
            LocalSGDAveraging(), ScriptedGrid({1: dies_in_round_2}), MODEL, num_rounds=5, ledger=db
        )
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert (run.status, run.error) == ("failed", raised.value.reason)
        assert f"SuperLink at 127.0.0.1:{port} is gone (connection refused" in (run.error or "")
        assert [r.round for r in repo.list_rounds(run.id)] == [1]


# ============================================== a call that waits for ever, in the main thread
class RetriesForEver(ForwardingGrid):
    """Flower's HttpGrid: once nothing listens at the SuperLink's address, a pull retries
    for ever (Flower's retry invoker has no limit), waiting up to 20 s between tries and
    taking every error on the way for one to retry. Gives up after ``limit`` seconds, so
    that a watch that does not interrupt it fails the test instead of hanging it."""

    def __init__(self, grid: Grid, address: tuple[str, int], limit: float = 20.0) -> None:
        super().__init__(grid)
        self.address = address
        self.limit = limit

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        deadline = time.monotonic() + self.limit
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(self.address, timeout=1):
                    return super().pull_messages(message_ids)
            except Exception:  # as Flower's retry: try again
                pass
            threading.Event().wait(min(20.0, max(0.0, deadline - time.monotonic())))
        raise AssertionError("the blocked call was never interrupted")


def no_handlers_left() -> None:
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    assert not [t for t in threading.enumerate() if t.name == "superlink-watch"]


def test_a_call_waiting_for_ever_on_a_dead_superlink_is_interrupted_and_the_run_failed(
    tmp_path: Path, superlink: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No Grid call returns, so no check between calls comes: the watch's thread stops it."""
    port = superlink.getsockname()[1]
    monkeypatch.setattr(
        sys, "argv", ["flwr-serverapp", "--runtime-api-address", f"127.0.0.1:{port}"]
    )
    monkeypatch.setattr(link, "LINK_GRACE_SECONDS", 0.3)
    monkeypatch.setattr(link, "PROBE_INTERVAL_SECONDS", 0.1)
    honest = replying_site("a", trained(1.0, examples=10, loss=1.0))
    killed: list[float] = []

    def dies_in_round_2(msg: Message) -> Message | None:
        config = msg.content.config_records.get(keys.CONFIG)
        if config is not None and config.get(keys.SERVER_ROUND) == 2:
            superlink.close()
            killed.append(time.monotonic())
            return None
        return honest(msg)

    grid = RetriesForEver(ScriptedGrid({1: dies_in_round_2}), ("127.0.0.1", port))
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    with pytest.raises(RunFailed, match="is gone") as raised:
        start(LocalSGDAveraging(), grid, MODEL, num_rounds=5, ledger=db)
    took = time.monotonic() - killed[0]
    assert took < 10, f"stopped {took:.1f} s after the SuperLink died"  # not the 20 s retry
    with LedgerRepository.open(db) as repo:
        (run,) = repo.list_runs()
        assert (run.status, run.error) == ("failed", raised.value.reason)
        assert f"SuperLink at 127.0.0.1:{port} is gone (connection refused" in (run.error or "")
        assert [r.round for r in repo.list_rounds(run.id)] == [1]
    no_handlers_left()


@pytest.fixture
def flower_stop_handler() -> Iterator[list[int]]:
    """SIGINT and SIGTERM handled as flwr-serverapp handles them: Flower's exit (here a
    ``SystemExit``, as ``flwr_exit`` ends); the signals it got are listed."""
    got: list[int] = []

    def flower_exit(signum: int, frame: FrameType | None) -> None:
        got.append(signum)
        raise SystemExit(0)

    previous = {s: signal.signal(s, flower_exit) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield got
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class StoppedWhileWaiting(ScriptedGrid):
    """A Grid call waiting on the SuperLink when ``sig`` comes (raised in this process)."""

    def __init__(self, sig: signal.Signals) -> None:
        super().__init__({})
        self.sig = sig

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        signal.raise_signal(self.sig)
        threading.Event().wait(60)
        raise AssertionError(f"{self.sig.name} did not stop the call")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_flowers_stop_signal_on_a_dead_superlink_fails_the_run_with_the_superlinks_reason(
    superlink: socket.socket, flower_stop_handler: list[int], sig: signal.Signals
) -> None:
    """Flower's parent monitors raise SIGINT in flwr-serverapp when its SuperExec exits
    with the SuperLink; Flower's handler would exit with the run left "running". The
    signal finds the SuperLink not answering and waits for the watch's verdict instead
    (the watch's own thread, probing every 30 s here, has no part in it)."""
    port = superlink.getsockname()[1]
    watch = SuperLinkWatch(("127.0.0.1", port), grace=0.3, interval=30)
    grid = LinkedGrid(StoppedWhileWaiting(sig), watch)
    recorded: list[BaseException] = []

    def body() -> None:
        superlink.close()
        grid.pull_messages([])

    began = time.monotonic()
    with pytest.raises(RunFailed) as raised:
        run_watched(grid, body, recorded.append)
    assert time.monotonic() - began < 10  # not a call the signal left waiting 60 s
    assert f"SuperLink at 127.0.0.1:{port} is gone (connection refused" in raised.value.reason
    assert recorded == [raised.value]
    assert flower_stop_handler == []  # Flower's exit never ran
    no_handlers_left()


def test_a_stop_signal_while_the_superlink_answers_is_handled_as_before(
    superlink: socket.socket, flower_stop_handler: list[int]
) -> None:
    """Ctrl-C, or SIGTERM from whoever stops the run, with the SuperLink there: Flower's
    handler, at once; the handlers are the previous ones afterwards."""
    port = superlink.getsockname()[1]
    watch = SuperLinkWatch(("127.0.0.1", port), grace=0.3, interval=30)
    grid = LinkedGrid(StoppedWhileWaiting(signal.SIGINT), watch)
    recorded: list[BaseException] = []
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]

    began = time.monotonic()
    with pytest.raises(SystemExit):
        run_watched(grid, lambda: grid.pull_messages([]), recorded.append)
    assert time.monotonic() - began < 10  # not a call the signal left waiting 60 s
    assert flower_stop_handler == [signal.SIGINT]
    assert [type(e) for e in recorded] == [SystemExit]
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers
    no_handlers_left()


def test_nothing_but_a_grid_call_is_interrupted_the_next_call_stops_the_run(
    superlink: socket.socket,
) -> None:
    """The SuperLink found gone while the ServerApp computes (aggregates, writes the
    ledger): that goes on undisturbed, and the next Grid call raises."""
    address = superlink.getsockname()
    grid = LinkedGrid(ScriptedGrid({}), SuperLinkWatch(address, grace=0.3, interval=0.1))
    steps: list[str] = []

    def body() -> None:
        superlink.close()
        deadline = time.monotonic() + 1.5  # the thread signals ~10 times meanwhile
        while time.monotonic() < deadline:
            time.sleep(0.01)
        steps.append("computed")
        grid.pull_messages([])
        steps.append("pulled")

    with pytest.raises(RunFailed, match="is gone"):
        run_watched(grid, body, lambda exc: None)
    assert steps == ["computed"]
    no_handlers_left()


@pytest.mark.usefixtures("live_sigint")
def test_once_the_superlink_is_gone_it_is_the_reason_whatever_stopped_the_run(
    superlink: socket.socket,
) -> None:
    address = superlink.getsockname()
    superlink.close()
    watch = SuperLinkWatch(address, grace=0.0, interval=30)
    assert watch.poll() is not None  # gone at the first refused probe, with no grace
    recorded: list[BaseException] = []

    def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(RunFailed, match=rf"SuperLink at 127.0.0.1:{address[1]} is gone"):
        run_watched(LinkedGrid(ScriptedGrid({}), watch), interrupted, recorded.append)
    assert [type(e) for e in recorded] == [RunFailed]


def test_off_the_main_thread_the_checks_between_calls_stop_the_run(
    superlink: socket.socket,
) -> None:
    """flwr-simulation runs its ServerApp in a thread of its own: no handler, no thread;
    its in-memory Grid answers, and the next call after the grace raises."""
    address = superlink.getsockname()
    grid = LinkedGrid(ScriptedGrid({}), SuperLinkWatch(address, grace=0.3, interval=0.1))
    outcome: list[BaseException] = []
    during: list[object] = []

    def body() -> None:
        during.append(signal.getsignal(signal.SIGUSR1))
        during.append([t.name for t in threading.enumerate() if t.name == "superlink-watch"])
        superlink.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            grid.pull_messages([])
            time.sleep(0.02)

    def serverapp() -> None:
        try:
            run_watched(grid, body, lambda exc: None)
        except BaseException as exc:  # the outcome is the test's
            outcome.append(exc)

    thread = threading.Thread(target=serverapp)
    thread.start()
    thread.join(15)
    assert during == [signal.SIG_DFL, []]
    [failure] = outcome
    assert isinstance(failure, RunFailed) and "is gone (connection refused" in failure.reason
