"""Which sites a round asks, and the sites' evaluation: plain functions every strategy uses.

A round's sample depends only on (seed, round) and the sites the grid lists, in its
order: the engine's grids list them by site name, so a seeded run samples the same sites
in every invocation, whatever node ids Flower gave them this time. Evaluation asks a
seeded sample of sites to score the global model on their own data and averages what
they report, weighted by their examples.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from flplatform.core import keys
from flplatform.core.errors import UpdateRejected
from flplatform.core.reply_checks import check_num_examples
from flplatform.core.seeding import rng_for
from strategies.knobs import sample_size

# The sites report Flower's own metric names; the ledger keeps the platform's.
_EVAL_NAMES = {keys.EVAL_ACCURACY: keys.ACCURACY, keys.EVAL_LOSS: keys.LOSS}


def sample_sites(
    seed: int, server_round: int, node_ids: Iterable[int], fraction: float
) -> list[int]:
    """Seeded sample of ``fraction`` of ``node_ids`` (at least one), by (seed, round) and
    their positions in ``node_ids``; in that order."""
    nodes = list(node_ids)
    if not nodes:
        return []
    size = sample_size(fraction, len(nodes))
    if size >= len(nodes):
        return nodes
    picked = rng_for(seed, server_round, "sample").choice(len(nodes), size, replace=False)
    return [nodes[i] for i in sorted(picked)]


def evaluation_messages(
    seed: int,
    server_round: int,
    arrays: ArrayRecord,
    config: ConfigRecord,
    node_ids: Iterable[int],
    fraction: float,
) -> list[Message]:
    """Ask a seeded sample of ``fraction`` of the sites to evaluate ``arrays`` (0: none).

    The sample is drawn for round −r, so it does not repeat round r's training sample.
    """
    if fraction == 0.0:
        return []
    config = ConfigRecord(dict(config))  # never write into the caller's record
    config[keys.SERVER_ROUND] = server_round
    content = RecordDict({keys.ARRAYS: arrays, keys.CONFIG: config})
    nodes = sample_sites(seed, -server_round, node_ids, fraction)
    return [Message(content, dst_node_id=n, message_type=MessageType.EVALUATE) for n in nodes]


def mean_evaluation(replies: Iterable[Message]) -> MetricRecord | None:
    """Example-weighted mean of the sites' finite evaluation metrics; None if none counts."""
    sums: dict[str, float] = {}
    total = 0
    for reply in replies:
        if reply.has_error() or keys.METRICS not in reply.content:
            continue
        metrics = reply.content[keys.METRICS]
        try:
            weight = check_num_examples(metrics.get(keys.NUM_EXAMPLES))
        except UpdateRejected:
            continue
        values = {
            _EVAL_NAMES.get(k, k): float(v)
            for k, v in metrics.items()
            if k != keys.NUM_EXAMPLES and isinstance(v, int | float) and math.isfinite(v)
        }
        for key, value in values.items():
            sums[key] = sums.get(key, 0.0) + weight * value
        total += weight
    if total == 0:
        return None
    return MetricRecord({k: v / total for k, v in sums.items()})
