"""Training replies as a strategy's ``aggregate_train`` receives them, built by hand."""

from __future__ import annotations

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)


def record(**arrays: np.ndarray) -> ArrayRecord:
    """An ArrayRecord of the named arrays."""
    return ArrayRecord({k: Array(v) for k, v in arrays.items()})


def reply(arrays: ArrayRecord | None, examples: object, loss: float = 0.5) -> Message:
    """A reply from node 4 to a training message: ``arrays`` (none: a metrics-only reply),
    ``num-examples`` and ``train_loss``."""
    instruction = Message(
        RecordDict({"config": ConfigRecord()}), dst_node_id=4, message_type=MessageType.TRAIN
    )
    content = RecordDict({"metrics": MetricRecord({"num-examples": examples, "train_loss": loss})})
    if arrays is not None:
        content["arrays"] = arrays
    return Message(content, reply_to=instruction)
