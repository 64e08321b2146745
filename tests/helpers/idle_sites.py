"""Sites that train nothing, and a strategy that aggregates nothing: scheduling only.

The runtime oracle drives the real engine, policies and virtual clock through thousands
of server steps; with real training (or even real model arrays) that would take minutes.
These sites answer every training message at once with a metrics record, and the
strategy counts what it is given, so all the time measured is the clock's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from flplatform.core import keys
from flplatform.engine import Contribution, EngineStrategy, Update
from flplatform.network import ComputeModel, Network, SiteProfile
from tests.helpers.scripted_grid import Behaviour


def idle_site(name: str) -> Behaviour:
    """Introduces itself, then answers each training message with one example, no arrays."""

    def behave(msg: Message) -> Message:
        if msg.metadata.message_type == MessageType.QUERY:
            return Message(
                RecordDict({keys.SITE_INFO: ConfigRecord({keys.SITE_NAME: name})}), reply_to=msg
            )
        return Message(
            RecordDict({keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: 1})}), reply_to=msg
        )

    return behave


class CountingStrategy(EngineStrategy):
    """An ``EngineStrategy`` whose model is a step counter; it records what it applied."""

    def __init__(self) -> None:
        self.applied: list[tuple[int, float]] = []  # (server round, weight scale)
        self._round = 0
        self._count = 0

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        content = RecordDict({keys.CONFIG: ConfigRecord(dict(config))})
        return [
            Message(content, dst_node_id=node, message_type=MessageType.TRAIN)
            for node in grid.get_node_ids()
        ]

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return []

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return None

    def begin_aggregation(self, server_round: int, arrays: ArrayRecord) -> None:
        self._round, self._count = server_round, 0

    def read_update(self, reply: Message, *, base: ArrayRecord) -> Update:
        return Update(Contribution(num_examples=1), vector=[])

    def add_update(self, update: Update, *, weight: float, scale: float = 1.0) -> None:
        self.applied.append((self._round, scale))
        self._count += 1

    def finish_aggregation(self) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return (ArrayRecord() if self._count else None), None


def network(
    sites: int,
    compute: ComputeModel,
    *,
    rtt_seconds: float = 0.0,
    bandwidth_bps: float = math.inf,
    availability: float = 1.0,
) -> Network:
    """``sites`` identical sites named s1, s2, ... on one link and one compute model."""
    return Network(
        name="test",
        profiles=tuple(
            SiteProfile(
                name=f"s{i}",
                rtt_seconds=rtt_seconds,
                uplink_bps=bandwidth_bps,
                downlink_bps=bandwidth_bps,
                compute=compute,
                speed=1.0,
                availability=availability,
            )
            for i in range(1, sites + 1)
        ),
    )
