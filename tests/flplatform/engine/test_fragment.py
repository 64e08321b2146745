"""Streaming sync: the model fragment a strategy declares for a message (``Work.fragment``)
reaches the ledger's update row, and survives a checkpoint of the work in flight."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message

from flplatform.core.checkpoint import StateProblems
from flplatform.engine.clock import Schedule
from flplatform.engine.engine import RoundEngine
from flplatform.engine.events import Dispatch
from flplatform.engine.mailbox import dispatch_from_state, dispatch_state
from flplatform.engine.rows import no_update
from flplatform.engine.strategy import Work
from flplatform.run.ledger import SqlLedger
from strategies.local_sgd import LocalSGDAveraging
from tests.helpers.scripted_grid import ScriptedGrid
from tests.helpers.sites import site

pytestmark = pytest.mark.usefixtures("task_identity")

MODEL = ArrayRecord({"w": Array(np.zeros(4, np.float32))})
FRAGMENTED_NODE = 1


class OneFragmentForNodeOne(LocalSGDAveraging):
    """Local SGD that declares fragment 2 for node 1's messages, the whole model for others."""

    def work_for(self, message: Message, *, server_round: int, model_version: int) -> Work:
        work = super().work_for(message, server_round=server_round, model_version=model_version)
        if message.metadata.dst_node_id == FRAGMENTED_NODE:
            return Work(period=work.period, model_version=work.model_version, fragment=2)
        return work


def test_the_fragment_a_strategy_declares_is_recorded_per_update(ledger) -> None:
    repo, run_id = ledger
    grid = ScriptedGrid({FRAGMENTED_NODE: site("a"), 2: site("b")})
    RoundEngine(
        grid,
        OneFragmentForNodeOne(),
        ledger=SqlLedger(repo, run_id),
        poll_interval=0.0,
        required_sites=2,
    ).run(MODEL, num_rounds=2)
    fragments = sorted((u.site, u.round, u.fragment) for u in repo.list_updates(run_id))
    assert fragments == [("a", 1, 2), ("a", 2, 2), ("b", 1, None), ("b", 2, None)]
    # Streaming sync's column is independent of the delayed strategy's.
    assert {u.delay for u in repo.list_updates(run_id)} == {None}


def _dispatch(**fields) -> Dispatch:
    return Dispatch(
        node_id=7,
        message_id="m",
        server_round=3,
        model_version=2,
        dispatched_at=1.0e9,
        deadline=math.inf,
        bytes_down=10,
        period=3,
        schedule=Schedule(dispatched_at=0.0),
        **fields,
    )


@pytest.mark.parametrize("fragment", [2, 0, None])
def test_a_row_carries_its_dispatch_fragment(fragment: int | None) -> None:
    row = no_update(
        _dispatch(fragment=fragment), "dropped", "x", site="a", version=3, virtual=False
    )
    assert row.fragment == fragment
    assert (row.period, row.delay) == (None, None)  # no delay declared: no period columns


@pytest.mark.parametrize("fragment", [2, None])
def test_checkpointed_work_keeps_its_fragment(fragment: int | None) -> None:
    problems = StateProblems("test")
    saved = dispatch_state(_dispatch(fragment=fragment))
    restored = dispatch_from_state(problems, saved, None)
    assert not problems.problems
    assert restored is not None and restored.fragment == fragment


def test_work_checkpointed_before_streaming_sync_is_of_the_whole_model() -> None:
    saved = dispatch_state(_dispatch())
    del saved["fragment"]
    problems = StateProblems("test")
    restored = dispatch_from_state(problems, saved, None)
    assert not problems.problems
    assert restored is not None and restored.fragment is None


def test_a_checkpointed_fragment_must_be_a_whole_number() -> None:
    saved = {**dispatch_state(_dispatch()), "fragment": 1.5}
    problems = StateProblems("test")
    assert dispatch_from_state(problems, saved, None) is None
    assert problems.problems == ["'fragment' must be a whole number, got 1.5"]
