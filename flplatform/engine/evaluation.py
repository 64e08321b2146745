"""Federated evaluation: idle sites evaluate the current model between training rounds."""

from __future__ import annotations

import time

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid

from flplatform.core import keys
from flplatform.engine import rows
from flplatform.engine.events import EvaluationOutcome
from flplatform.engine.mailbox import TTL_GRACE_SECONDS, Mailbox, address
from flplatform.engine.sites import Sites
from flplatform.engine.strategy import EngineStrategy, SubsetGrid


def evaluate_round(
    strategy: EngineStrategy,
    grid: Grid,
    mailbox: Mailbox,
    sites: Sites,
    *,
    server_round: int,
    arrays: ArrayRecord,
    model_version: int,
    evaluate_config: ConfigRecord | None,
    timeout: float,
) -> tuple[MetricRecord | None, tuple[EvaluationOutcome, ...]]:
    """Ask idle sites to evaluate ``arrays``; return the strategy's aggregate and the rows.

    Not a site whose cancelled training message Flower still holds: an evaluation message
    cannot wait behind it the way a deferred training message does. A site that does not
    answer within ``timeout`` stays busy until Flower hands its message back.
    """
    held = {d.node_id for d in mailbox.cancelled.values()}
    idle = sites.by_name(n for n in sites.idle() if n not in held)
    config = ConfigRecord(dict(evaluate_config or {}))
    config[keys.MODEL_VERSION] = model_version
    drafts = strategy.configure_evaluate(server_round, arrays, config, SubsetGrid(grid, idle))
    messages = address(drafts, idle, ttl=timeout + TTL_GRACE_SECONDS, model_version=model_version)
    messages.sort(key=lambda m: sites.position(m.metadata.dst_node_id))  # rows in join order
    exchanged = mailbox.exchange(messages, model_version=model_version, timeout=timeout)
    outcomes = []
    for dispatch, reply in exchanged:
        if dispatch.message_id and reply is None:
            sites.give_up(dispatch.node_id)
        arrived_at = mailbox.replied_at.pop(dispatch.message_id, time.time())
        outcomes.append(
            rows.evaluation(
                dispatch,
                reply,
                site=sites.name(dispatch.node_id),
                arrived_at=arrived_at,
                timeout=timeout,
            )
        )
    answered = [reply for _, reply in exchanged if reply is not None]
    return strategy.aggregate_evaluate(server_round, answered), tuple(outcomes)
