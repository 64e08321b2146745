"""A ClientApp whose sites misbehave by partition, to test rejection through real Flower.

partition 0: an honest site (flplatform's own ClientApp code)
partition 1: replies with NaN weights
partition 2: replies with a wrongly shaped array
partition 3: raises inside the ClientApp (Flower turns it into an error reply)
partition 4: replies without an ``arrays`` record, and claims -5 examples
partition 5: takes far longer than the round timeout in round 1 (a dead site, then back)
"""

from __future__ import annotations

import time

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients import client_app as honest

SLOW_SITE_SECONDS = 40.0

app = ClientApp()


def _partition(context: Context) -> int:
    return int(context.node_config["partition-id"])


@app.query()
def query(msg: Message, context: Context) -> Message:
    return honest.query(msg, context)


@app.train()
def train(msg: Message, context: Context) -> Message:
    partition = _partition(context)
    if partition == 0:
        return honest.train(msg, context)
    arrays = msg.content["arrays"]
    metrics = MetricRecord({"num-examples": 100, "train_loss": 0.5})
    if partition == 1:
        poisoned = ArrayRecord(
            {
                k: Array(np.full(v.shape, np.nan, dtype=v.dtype))
                for k, v in ((k, a.numpy()) for k, a in arrays.items())
            }
        )
        return Message(RecordDict({"arrays": poisoned, "metrics": metrics}), reply_to=msg)
    if partition == 2:
        reshaped = ArrayRecord({k: Array(np.zeros((3, 3), np.float32)) for k in arrays})
        return Message(RecordDict({"arrays": reshaped, "metrics": metrics}), reply_to=msg)
    if partition == 3:
        raise RuntimeError("disk on fire at this site")
    if partition == 5:
        if int(msg.content["config"]["server-round"]) == 1:
            time.sleep(SLOW_SITE_SECONDS)
        return honest.train(msg, context)
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": -5})}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return honest.evaluate(msg, context)
