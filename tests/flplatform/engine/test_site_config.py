"""A run's site config rides on every message the engine sends, measured with it; a run
without one sends exactly what it sent before."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

from flplatform.core import keys
from tests.helpers.engine import engine_for, wire_bytes
from tests.helpers.scripted_grid import ScriptedGrid
from tests.helpers.sites import site

pytestmark = pytest.mark.usefixtures("task_identity")


MODEL = ArrayRecord({"w": Array(np.zeros(4, np.float32))})
SITE_CONFIG = ConfigRecord({"dataset": "digits", "seed": 3, "sites": "a,b"})


def test_every_message_carries_the_site_config_and_its_bytes_count(ledger) -> None:
    grid = ScriptedGrid({1: site("a"), 2: site("b")})
    engine = engine_for(grid, ledger, fraction_evaluate=1.0, site_config=SITE_CONFIG)
    engine.run(MODEL, num_rounds=2, federated_evaluation=True)
    kinds = {m.metadata.message_type for m in grid.pushed}
    assert kinds == {MessageType.QUERY, MessageType.TRAIN, MessageType.EVALUATE}
    for msg in grid.pushed:
        assert dict(msg.content[keys.RUN_CONFIG]) == dict(SITE_CONFIG)
    # The ledger's bytes are the stamped messages' as Flower's SuperLink counts them.
    trained = [m for m in grid.pushed if m.metadata.message_type == MessageType.TRAIN]
    replies = [
        r
        for r in grid.replies
        if r.metadata.reply_to_message_id in {m.metadata.message_id for m in trained}
    ]
    repo, run_id = ledger
    recorded = [(u.bytes_up, u.bytes_down) for u in repo.list_updates(run_id)]
    assert sorted(recorded) == sorted(wire_bytes(trained, replies))


def test_without_a_site_config_the_messages_are_left_as_drafted(ledger) -> None:
    grid = ScriptedGrid({1: site("a"), 2: site("b")})
    engine_for(grid, ledger, fraction_evaluate=1.0).run(
        MODEL, num_rounds=1, federated_evaluation=True
    )
    assert all(keys.RUN_CONFIG not in m.content for m in grid.pushed)
    stamped = engine_for(grid, ledger).mailbox
    drafts = grid.pushed[:2]
    assert stamped.stamp(drafts) is drafts  # the same messages, the same bytes


def test_a_broadcast_stays_one_content_once_stamped(ledger) -> None:
    grid = ScriptedGrid({1: site("a"), 2: site("b")})
    mailbox = engine_for(grid, ledger, site_config=SITE_CONFIG).mailbox
    shared = ArrayRecord({"w": Array(np.ones(3, np.float32))})
    content = RecordDict({keys.ARRAYS: shared})
    drafts = [
        Message(content, dst_node_id=node, message_type=MessageType.TRAIN, group_id="4")
        for node in (1, 2)
    ]
    first, second = mailbox.stamp(drafts)
    assert first.content is second.content  # measured once, as before
    assert first.content[keys.ARRAYS] is shared
    assert [m.metadata.dst_node_id for m in (first, second)] == [1, 2]
    assert first.metadata.group_id == "4"
    assert keys.RUN_CONFIG not in content  # the strategy's draft is not written into
