"""Sites scripted reply by reply for the round engine's tests: a good update, a model of
another architecture, a ClientApp that raises, a result the mod refuses; and one engine run
of local-SGD over them into a SQL ledger."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MessageType,
    Metadata,
    MetricRecord,
    RecordDict,
)
from flwr.app.message import make_message
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode

from flplatform.core import keys
from flplatform.engine.engine import RoundEngine
from flplatform.run.ledger import SqlLedger
from storage import LedgerRepository
from strategies.local_sgd import LocalSGDAveraging
from strategies.mods import flplatform_mod
from tests.helpers.delayed_sites import context
from tests.helpers.scripted_grid import Behaviour, ScriptedGrid

MODEL = ArrayRecord({"w": Array(np.zeros(4, np.float32))})
# What local-SGD says of a reply whose model has other keys than the server's.
WRONG_KEYS = "missing arrays: w"

Reply = Callable[[Message], Message]


def good(msg: Message) -> Message:
    """A well-formed update: the model with every weight set to 1."""
    arrays = ArrayRecord({"w": Array(np.ones(4, np.float32))})
    metrics = MetricRecord({keys.NUM_EXAMPLES: 10})
    return Message(RecordDict({keys.ARRAYS: arrays, keys.METRICS: metrics}), reply_to=msg)


def wrong_keys(msg: Message) -> Message:
    """A user's ClientApp sending a model of another architecture: the strategy rejects it."""
    arrays = ArrayRecord({"conv1.weight": Array(np.ones(4, np.float32))})
    metrics = MetricRecord({keys.NUM_EXAMPLES: 10})
    return Message(RecordDict({keys.ARRAYS: arrays, keys.METRICS: metrics}), reply_to=msg)


def expired(msg: Message) -> Message:
    """What the SuperLink hands back for a message whose TTL ran out unanswered."""
    metadata = Metadata(
        run_id=msg.metadata.run_id,
        message_id="",
        src_node_id=SUPERLINK_NODE_ID,
        dst_node_id=SUPERLINK_NODE_ID,
        reply_to_message_id=msg.metadata.message_id,
        group_id=msg.metadata.group_id,
        created_at=msg.metadata.created_at,
        ttl=0.0,
        message_type=msg.metadata.message_type,
    )
    return make_message(
        metadata=metadata, error=Error(code=ErrorCode.MESSAGE_UNAVAILABLE, reason="expired")
    )


def crashes(reason: str) -> Reply:
    """A ClientApp that raises: its error reply is dropped with ``reason``."""
    return lambda msg: Message(Error(code=0, reason=reason), reply_to=msg)


def through_the_mod(msg: Message) -> Message:
    """A user's train function that forgets ``num-examples``, behind flplatform's mod."""

    def train(msg: Message, _: Context) -> Message:
        metrics = MetricRecord({keys.TRAIN_LOSS: 0.1})
        return Message(
            RecordDict({keys.ARRAYS: msg.content[keys.ARRAYS], keys.METRICS: metrics}),
            reply_to=msg,
        )

    return flplatform_mod()(msg, context(msg.metadata.dst_node_id), train)


def scripted(name: str, *replies: Reply) -> Behaviour:
    """A site that introduces itself, then answers its n-th training message with the n-th
    of ``replies`` (the last one from then on)."""
    sent = 0

    def behave(msg: Message) -> Message:
        nonlocal sent
        if msg.metadata.message_type == MessageType.QUERY:
            info = ConfigRecord({keys.SITE_NAME: name})
            return Message(RecordDict({keys.SITE_INFO: info}), reply_to=msg)
        reply = replies[min(sent, len(replies) - 1)]
        sent += 1
        return reply(msg)

    return behave


def run(
    repository: LedgerRepository, sites: dict[int, Behaviour], *, rounds: int, **kwargs: object
) -> int:
    """Run the engine for ``rounds`` rounds into a new run of ``repository``; its id."""
    run_id = repository.create_run(
        name="t", strategy="local-sgd", seed=0, config={}, num_rounds_planned=rounds
    )
    engine = RoundEngine(
        ScriptedGrid(sites),
        LocalSGDAveraging(),
        ledger=SqlLedger(repository, run_id),
        required_sites=len(sites),
        poll_interval=0.0,
        **kwargs,  # type: ignore[arg-type]
    )
    engine.run(MODEL, num_rounds=rounds)
    return run_id


def latest_run(repository: LedgerRepository) -> int:
    return repository.list_runs(limit=1)[0].id
