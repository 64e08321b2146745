"""While it waits for replies, the engine asks the SuperLink less often as the wait goes on.

Every pull is a request the SuperLink answers from its database. A deployed round waits
seconds for Flower's SuperNodes (they poll every few seconds themselves); pulling every
50 ms all along made the SuperLink the busiest process of a deployment.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

import pytest
from flwr.app import Message, MessageType
from hypothesis import given
from hypothesis import strategies as st

from flplatform.core import keys
from flplatform.engine import mailbox as mailbox_module
from flplatform.engine.clock import WallClock
from flplatform.engine.discovery import site_query
from flplatform.engine.engine import RoundEngine
from flplatform.engine.mailbox import LONGEST_POLL_SECONDS, Mailbox, poll_wait
from strategies.local_sgd import LocalSGDAveraging
from tests.helpers.scripted_grid import Behaviour, ScriptedGrid
from tests.helpers.scripted_sites import MODEL, good, scripted

pytestmark = pytest.mark.usefixtures("task_identity")

SHORTEST = 0.05  # the engine's default poll interval


def test_hand_computed_waits() -> None:
    assert poll_wait(0.0, SHORTEST) == SHORTEST  # a reply just came: look again soon
    assert poll_wait(0.3, SHORTEST) == SHORTEST
    assert poll_wait(2.0, SHORTEST) == pytest.approx(0.2)  # a tenth of the wait
    assert poll_wait(4.0, SHORTEST) == pytest.approx(0.4)
    assert poll_wait(60.0, SHORTEST) == LONGEST_POLL_SECONDS == 0.5
    assert poll_wait(60.0, 0.0) == 0.5
    assert poll_wait(0.0, 0.0) == 0.0  # no shortest sleep: a busy loop only at first
    assert poll_wait(60.0, 3.0) == 3.0  # a longer interval asked for is kept


@given(
    st.floats(0, 1e6, allow_nan=False),
    st.floats(0, 1e6, allow_nan=False),
    st.floats(0, 5, allow_nan=False),
)
def test_the_wait_grows_with_the_time_waited_and_stays_within_its_bounds(
    waited: float, more: float, shortest: float
) -> None:
    wait = poll_wait(waited, shortest)
    assert shortest <= wait <= max(shortest, LONGEST_POLL_SECONDS)
    assert wait <= max(shortest, waited / 10)  # a reply is seen at most 10% of its wait late
    assert poll_wait(waited + more, shortest) >= wait


class CountingGrid(ScriptedGrid):
    """Counts the pulls made while training messages were out."""

    def __init__(self, behaviours: dict[int, Behaviour]) -> None:
        super().__init__(behaviours)
        self.pulls_while_training = 0

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        ids = list(message_ids)
        if any(m.metadata.message_type == MessageType.TRAIN for m in self.pushed):
            self.pulls_while_training += 1
        return super().pull_messages(ids)


def test_a_round_that_waits_seconds_pulls_a_few_dozen_times_and_takes_its_reply_promptly() -> None:
    training_seconds = 3.0
    first_seen: dict[str, float] = {}
    taken: list[float] = []  # how long after it was ready the reply was pulled

    def slow_site(msg: Message) -> Message | None:
        # answers its training message training_seconds after it was first pulled for
        now = time.monotonic()
        seen = first_seen.setdefault(msg.metadata.message_id, now)
        if now - seen < training_seconds:
            return None
        taken.append(now - (seen + training_seconds))
        return good(msg)

    quick = scripted("site-1", good)
    slow = scripted("site-2", slow_site)  # type: ignore[arg-type]
    grid = CountingGrid({1: quick, 2: lambda m: slow(m)})
    engine = RoundEngine(grid, LocalSGDAveraging(), required_sites=2)  # default interval
    engine.run(MODEL, num_rounds=1)

    # Every 50 ms all along: about 60 pulls. Now 50 ms for the first half second (10),
    # then each a tenth of the wait so far: log(3 / 0.5) / log(1.1), about 19 more.
    expected = 10 + math.log(training_seconds / 0.5) / math.log(1.1)
    assert grid.pulls_while_training <= expected + 6, grid.pulls_while_training
    # ... and the reply was pulled within a tenth of its wait (and a loaded machine's
    # scheduling) of its being ready
    assert len(taken) == 1 and taken[0] < 0.1 * training_seconds + 0.3, taken


class FakeTime:
    """The mailbox's clock: sleeping moves it on, and nothing else does."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.mark.parametrize("ready_after", [0.3, 1.95])
def test_an_exchange_takes_a_reply_that_comes_just_before_its_deadline(
    ready_after: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A site query answered just before the query's deadline is an answer, not silence:
    the exchange looks once more at its deadline, however long it was sleeping (here its
    looks are at 1.90 s and, without that last one, 2.09 s)."""
    clock = FakeTime()
    monkeypatch.setattr(mailbox_module, "time", clock)
    timeout = 2.0
    sent = clock.now

    def answers_late(msg: Message) -> Message | None:
        ready = clock.now - sent >= ready_after
        return scripted("site-1", good)(msg) if ready else None

    grid = ScriptedGrid({1: answers_late})
    mailbox = Mailbox(grid, WallClock(), lambda node_id: f"site-{node_id}", SHORTEST)
    [(dispatch, reply)] = mailbox.exchange(
        [site_query(1, timeout)], model_version=0, timeout=timeout
    )
    assert dispatch.message_id and reply is not None
    assert reply.content[keys.SITE_INFO][keys.SITE_NAME] == "site-1"
    assert clock.now - sent <= timeout + 1e-9  # and no later than the deadline
