"""The run's log lines, on the ``flplatform`` logger: one at the start, one per round."""

from __future__ import annotations

import logging
from collections.abc import Callable

from flplatform.engine import AggregationPolicy, EngineStrategy, RoundSummary, Synchrony

log = logging.getLogger("flplatform")


def log_start(
    strategy: EngineStrategy,
    label: str,
    policy: AggregationPolicy,
    network: str | None,
    num_rounds: int,
) -> None:
    """The run's first line (strategy, rounds, policy, clock), then the strategy's summary."""
    log.info(
        "flplatform: %s, %d rounds, %s, %s",
        label,
        num_rounds,
        repr(policy) if isinstance(policy, Synchrony) else type(policy).__name__,
        f"network {network} (virtual clock)" if network else "wall clock",
    )
    strategy.summary()


def round_reporter(
    on_round: Callable[[RoundSummary], None] | None,
) -> Callable[[RoundSummary], None]:
    """Log every round, then hand it to the caller's ``on_round``."""

    def report(summary: RoundSummary) -> None:
        log_round(summary)
        if on_round is not None:
            on_round(summary)

    return report


def log_round(summary: RoundSummary) -> None:
    """One line per finished round: version, updates, bytes, simulated time, metrics; then
    the round's warning (training diverged), when it has one."""
    metrics = " ".join(f"{k}={v:.4f}" for k, v in summary.metrics.items())
    simulated = (
        f", simulated t={summary.virtual_finished_at:.2f} s"
        if summary.virtual_finished_at is not None
        else ""
    )
    log.info(
        "round %d: version %d, %d updates, %d B up, %d B down%s, %s",
        summary.server_round,
        summary.model_version,
        len(summary.updates),
        summary.bytes_up,
        summary.bytes_down,
        simulated,
        metrics,
    )
    if summary.warning:
        log.warning("%s", summary.warning)
