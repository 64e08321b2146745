"""Sites that speak the delayed-update protocol for engine-level tests, without Ray.

Each site keeps a real Flower ``Context`` between messages and answers through the real
site part (``strategies.delayed``); only the transport is the in-process ScriptedGrid.
``quadratic_site`` replaces the training step by p exact gradient steps on
f_n(x) = ½‖x − c_n‖², so the invariant of ALGORITHMS.md §2 can be checked to float
precision; ``digits_site`` trains the real model on a real digits partition.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

from clients.site import load_site
from flplatform import keys
from strategies.delayed import run_period
from strategies.local_sgd import SiteTrainConfig
from strategies.site_parts import site_part
from tests.flplatform.engine.scripted_grid import Behaviour


def _introduce(msg: Message, name: str, examples: int) -> Message:
    record = ConfigRecord({keys.SITE_NAME: name, keys.NUM_EXAMPLES: examples})
    return Message(RecordDict({keys.SITE_INFO: record}), reply_to=msg)


def context(node_id: int) -> Context:
    return Context(run_id=1, node_id=node_id, node_config={}, state=RecordDict(), run_config={})


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

        def train(start: dict[str, np.ndarray], config: SiteTrainConfig) -> tuple[dict, dict]:
            self.starts[period] = start["w"].astype(np.float64)
            w = start["w"].astype(np.float64)
            for _ in range(max(1, config.local_steps)):
                w = w - self.lr * (w - self.target)
            examples = 0 if period in self.rejected_in else self.examples
            # The loss it reports is its period, so a round's loss says which periods it mixed.
            reported = {keys.NUM_EXAMPLES: examples, keys.TRAIN_LOSS: float(period)}
            return {"w": w.astype(start["w"].dtype)}, reported

        reply = run_period(msg, self.state, train)
        self.sent[period] = reply.content[keys.ARRAYS]["w"].numpy().astype(np.float64)
        return reply


def digits_site(
    index: int, num_partitions: int, state: Context | None = None, **run_config: object
) -> Behaviour:
    """A site on a digits partition running whichever site part the server names.

    ``state``: its persistent Flower context (a fresh one by default).
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

    def behave(msg: Message) -> Message:
        if msg.metadata.message_type == MessageType.QUERY:
            return _introduce(msg, site.name, len(site.x_train))
        name = str(msg.content[keys.CONFIG].get(keys.SITE_ALGORITHM, "local-sgd"))
        return site_part(name)(msg, state, site)

    return behave
