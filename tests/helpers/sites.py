"""Scripted sites for the round engine, the digits model, and a site whose SuperNode restarts.

``site`` introduces itself and replies with its model set to a value, ``stepping`` with the
model it was sent moved by a step; ``replying_site``
trains as a given ``Reply`` says (``trained``: a well-formed one), as a ClientApp would.
Messages are real Flower messages; only the transport (tests/helpers/scripted_grid.py)
is in-process.
"""

from __future__ import annotations

import itertools
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
    MetricRecord,
    RecordDict,
)

from flplatform.core import keys
from flplatform.core.arrays import record_to_arrays
from tests.helpers.scripted_grid import Behaviour
from tests.helpers.scripted_sites import scripted

MODEL = ArrayRecord({"w": Array(np.zeros(4, np.float32))})
Reply = Callable[[Message, np.ndarray], RecordDict]


# ==================================================== sites that reply with a constant model
def site(
    name: str,
    *,
    value: float = 1.0,
    examples: object = 10,
    loss: float = 0.5,
    info: dict | None = None,
    metrics: dict | None = None,
) -> Behaviour:
    """A site that introduces itself and replies with its model set to ``value``."""

    def behave(msg: Message) -> Message:
        if msg.metadata.message_type == MessageType.QUERY:
            record = ConfigRecord({keys.SITE_NAME: name, **(info or {})})
            return Message(RecordDict({keys.SITE_INFO: record}), reply_to=msg)
        if msg.metadata.message_type == MessageType.EVALUATE:
            evaluated = MetricRecord({"num-examples": 5, "eval_acc": 0.5})
            return Message(RecordDict({"metrics": evaluated}), reply_to=msg)
        sent = record_to_arrays(msg.content["arrays"])["w"]
        arrays = ArrayRecord({"w": Array(np.full_like(sent, value))})
        reported = MetricRecord({"num-examples": examples, "train_loss": loss, **(metrics or {})})
        return Message(RecordDict({"arrays": arrays, "metrics": reported}), reply_to=msg)

    return behave


def stepping(name: str, step: float) -> Behaviour:
    """A site that introduces itself and moves every weight it is sent by ``step``, its
    first weight by a millionth more each time (a site that trained twice on one model
    sends other arrays: never a replay)."""
    trained = itertools.count()

    def reply(msg: Message) -> Message:
        moved = record_to_arrays(msg.content[keys.ARRAYS])["w"] + np.float32(step)
        moved[0] += np.float32(1e-6 * next(trained))
        arrays = ArrayRecord({"w": Array(moved)})
        metrics = MetricRecord({keys.NUM_EXAMPLES: 10, keys.TRAIN_LOSS: 0.5})
        return Message(RecordDict({keys.ARRAYS: arrays, keys.METRICS: metrics}), reply_to=msg)

    return scripted(name, reply)


def failing(name: str) -> Behaviour:
    """Introduces itself, then answers every other message with an error."""
    talk = site(name)

    def behave(msg: Message) -> Message:
        if msg.metadata.message_type == MessageType.QUERY:
            return talk(msg)
        return Message(Error(code=2, reason="ValueError: out of memory"), reply_to=msg)

    return behave


# ====================================================== sites that train as a reply says
def trained(value: float, examples: int, loss: float) -> Reply:
    """A well-formed training reply: the model set to ``value``, Flower's metrics."""

    def content(msg: Message, sent: np.ndarray) -> RecordDict:
        arrays = ArrayRecord({"w": Array(np.full_like(sent, value))})
        metrics = MetricRecord({keys.NUM_EXAMPLES: examples, keys.TRAIN_LOSS: loss})
        return RecordDict({keys.ARRAYS: arrays, keys.METRICS: metrics})

    return content


def replying_site(
    name: str, reply: Reply, *, accuracy: float = 0.5, extra: bool = False
) -> Behaviour:
    """Introduces itself, evaluates (5 examples, ``accuracy``; ``extra``: a second metrics
    record) and trains as ``reply`` says."""

    def behave(msg: Message) -> Message:
        if msg.metadata.message_type == MessageType.QUERY:
            info = ConfigRecord({keys.SITE_NAME: name})
            return Message(RecordDict({keys.SITE_INFO: info}), reply_to=msg)
        if msg.metadata.message_type == MessageType.EVALUATE:
            evaluated = MetricRecord({keys.NUM_EXAMPLES: 5, keys.EVAL_ACCURACY: accuracy})
            content = RecordDict({keys.METRICS: evaluated})
            if extra:
                content["more-metrics"] = MetricRecord({"x": 1.0})
            return Message(content, reply_to=msg)
        sent = record_to_arrays(msg.content.array_records[keys.ARRAYS])["w"]
        return Message(reply(msg, sent), reply_to=msg)

    return behave


# ================================================================ real models, lost state
def digits_model(num_partitions: int = 4, model: str = "mlp") -> ArrayRecord:
    """The initial ``model`` of partition 0 of ``num_partitions`` of digits (seed 0)."""
    from clients.site import load_site

    loaded = load_site(
        {keys.PARTITION_ID: 0, keys.NUM_PARTITIONS: num_partitions},
        {"dataset": "digits", "partition": "dirichlet", "alpha": 1.0, "model": model},
    )
    return ArrayRecord(loaded.build_model(num_classes=10, seed=0).state_dict())


def restart_before_round(
    round_: int, contexts: dict[int, Context], node: int, behave: Callable[[Message], Message]
) -> Callable[[Message], Message]:
    """A site whose SuperNode restarts (empty context.state) before it handles ``round_``."""

    def restarted(msg: Message) -> Message:
        config = msg.content.config_records.get(keys.CONFIG, ConfigRecord())
        if (
            msg.metadata.message_type == MessageType.TRAIN
            and config.get(keys.SERVER_ROUND) == round_
        ):
            contexts[node].state = RecordDict()
        return behave(msg)

    return restarted
