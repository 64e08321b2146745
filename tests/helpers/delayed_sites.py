"""Sites for engine-level tests, without Ray: real Flower contexts, mods and train functions.

Each site keeps a real Flower ``Context`` between messages and answers through the real
site half (``strategies.mods``) around a train function; only the transport is the
in-process ScriptedGrid.
``quadratic_site`` replaces the training step by p exact gradient steps on
f_n(x) = ½‖x − c_n‖², so the invariant of ALGORITHMS.md §2 can be checked to float
precision; ``digits_site`` trains the real model on a real digits partition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)

from clients import client_app
from clients.site import load_site
from flplatform.core import keys
from strategies.mods import delayed_mod, flplatform_mod
from tests.helpers.scripted_grid import Behaviour


def _introduce(msg: Message, name: str, examples: int) -> Message:
    record = ConfigRecord({keys.SITE_NAME: name, keys.NUM_EXAMPLES: examples})
    return Message(RecordDict({keys.SITE_INFO: record}), reply_to=msg)


def context(
    node_id: int,
    node_config: dict[str, Any] | None = None,
    run_config: dict[str, Any] | None = None,
) -> Context:
    return Context(
        run_id=1,
        node_id=node_id,
        node_config=dict(node_config or {}),
        state=RecordDict(),
        run_config=dict(run_config or {}),
    )


def builtin_train(msg: Message, state: Context) -> Message:
    """The built-in ClientApp's training, as Flower runs it: its train function in its mod."""
    return flplatform_mod()(msg, state, client_app.train)


@dataclass
class QuadraticSite:
    """f(x) = ½‖x − target‖² on one array "w"; records what it started from and sent."""

    name: str
    target: np.ndarray
    examples: int = 10
    lr: float = 0.3
    # rounds in which it reports num-examples 0, so the server rejects its update
    rejected_in: set[int] = field(default_factory=set)
    starts: dict[int, np.ndarray] = field(default_factory=dict)  # period → start model
    sent: dict[int, np.ndarray] = field(default_factory=dict)  # period → A as sent
    state: Context = field(default_factory=lambda: context(0))

    def __call__(self, msg: Message) -> Message:
        if msg.metadata.message_type == MessageType.QUERY:
            return _introduce(msg, self.name, self.examples)
        period = int(msg.content[keys.CONFIG][keys.SERVER_ROUND])
        reply = delayed_mod()(msg, self.state, self.train)
        if period in self.rejected_in:
            # The mod itself refuses a reply without examples: claim none after it, so
            # that the server is the one to reject the step.
            reply.content.metric_records[keys.METRICS][keys.NUM_EXAMPLES] = 0
        self.sent[period] = reply.content[keys.ARRAYS]["w"].numpy().astype(np.float64)
        return reply

    def train(self, msg: Message, state: Context) -> Message:
        """A plain Flower train function: p exact gradient steps on f from the given model."""
        config = msg.content[keys.CONFIG]
        period = int(config[keys.SERVER_ROUND])
        start = msg.content[keys.ARRAYS]["w"].numpy()
        self.starts[period] = start.astype(np.float64)
        w = start.astype(np.float64)
        for _ in range(max(1, int(config.get(keys.LOCAL_STEPS, 0)))):
            w = w - self.lr * (w - self.target)
        # The loss it reports is its period, so a round's loss says which periods it mixed.
        metrics = MetricRecord({keys.NUM_EXAMPLES: self.examples, keys.TRAIN_LOSS: float(period)})
        arrays = ArrayRecord({"w": Array(w.astype(start.dtype))})
        return Message(RecordDict({keys.ARRAYS: arrays, keys.METRICS: metrics}), reply_to=msg)


def digits_site(
    index: int, num_partitions: int, state: Context | None = None, **run_config: object
) -> Behaviour:
    """A site on a digits partition: the built-in ClientApp, following the server's algorithm.

    ``state``: its persistent Flower context (a fresh one by default); it is given the
    site's node and run config.
    """
    settings = {
        "dataset": "digits",
        "partition": "dirichlet",
        "alpha": 1.0,
        "model": "mlp",
        "seed": 0,
        **run_config,
    }
    node_config = {keys.PARTITION_ID: index, keys.NUM_PARTITIONS: num_partitions}
    site = load_site(node_config, settings)
    state = state if state is not None else context(index + 1)
    state.node_config = node_config
    state.run_config = settings

    def behave(msg: Message) -> Message:
        if msg.metadata.message_type == MessageType.QUERY:
            return _introduce(msg, site.name, len(site.x_train))
        return builtin_train(msg, state)

    return behave
