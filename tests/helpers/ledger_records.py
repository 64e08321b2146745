"""Small builders of ledger rows and the naive summary oracle shared by the storage tests."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from storage import (
    EvaluationInput,
    EvaluationRecord,
    EvaluationStatus,
    LedgerRepository,
    UpdateInput,
    UpdateRecord,
    UpdateStatus,
)

T0 = 1_700_000_000.25  # a fixed unix time with a fractional part


def make_run(repo: LedgerRepository, **overrides: Any) -> int:
    """Create a run with plausible defaults."""
    fields: dict[str, Any] = {
        "name": "digits-fedavg",
        "strategy": "fedavg",
        "seed": 7,
        "config": {"lr": 0.1},
        "num_rounds_planned": 5,
        "created_at": T0,
    }
    fields.update(overrides)
    return repo.create_run(**fields)


def update(
    site: str,
    status: UpdateStatus = "applied",
    *,
    staleness: int = 0,
    bytes_up: int = 100,
    bytes_down: int = 200,
    train_loss: float | None = 0.5,
    compute_seconds: float | None = 1.0,
    **overrides: Any,
) -> UpdateInput:
    """An ``UpdateInput`` with plausible defaults."""
    fields: dict[str, Any] = {
        "site": site,
        "dispatched_round": 1,
        "version_trained_on": 0,
        "staleness": staleness,
        "bytes_up": bytes_up,
        "bytes_down": bytes_down,
        "status": status,
        "dispatched_at": T0 + 1,
        "arrived_at": T0 + 2,
        "compute_seconds": compute_seconds,
        "train_loss": train_loss,
    }
    fields.update(overrides)
    return UpdateInput(**fields)


def evaluation(
    site: str,
    status: EvaluationStatus = "evaluated",
    *,
    bytes_up: int = 30,
    bytes_down: int = 300,
    **overrides: Any,
) -> EvaluationInput:
    """An ``EvaluationInput`` with plausible defaults."""
    fields: dict[str, Any] = {
        "site": site,
        "model_version": 1,
        "bytes_up": bytes_up,
        "bytes_down": bytes_down,
        "status": status,
        "dispatched_at": T0 + 3,
        "arrived_at": T0 + 4 if status == "evaluated" else None,
        "num_examples": 50 if status == "evaluated" else None,
        "loss": 0.25 if status == "evaluated" else None,
        "accuracy": 0.875 if status == "evaluated" else None,
    }
    fields.update(overrides)
    return EvaluationInput(**fields)


def record(
    repo: LedgerRepository, run_id: int, step: int, updates: Sequence[UpdateInput], **kw: Any
) -> None:
    """Record round ``step`` with plausible defaults."""
    fields: dict[str, Any] = {
        "round": step,
        "model_version": step,
        "started_at": T0 + 10 * step,
        "finished_at": T0 + 10 * step + 3.5,
        "metrics": {"accuracy": 0.5 + step / 100, "loss": 1.0 / max(step, 1)},
        "train_loss": 0.7,
        "updates": updates,
    }
    fields.update(kw)
    repo.record_round(run_id, **fields)


@dataclass(frozen=True)
class NaiveSummary:
    """What ``SiteSummary`` should say, computed with plain Python."""

    updates: int
    applied: int
    buffered: int
    cancelled: int
    dropped: int
    rejected: int
    mean_staleness: float | None
    max_staleness: int | None
    bytes_up: int
    bytes_down: int
    compute_seconds: float
    mean_train_loss: float | None
    staleness_counts: dict[int, int]
    p90_staleness: int | None
    waiting_seconds: float
    busy_seconds: float
    waiting_clock: str
    virtual_compute_seconds: float | None
    transfer_seconds: float | None
    mean_delay: float | None


def _seconds(value: datetime | float) -> float:
    return value.timestamp() if isinstance(value, datetime) else value


def naive_run_clock(rows: Iterable[UpdateRecord | UpdateInput]) -> str:
    """The clock a run's summaries use: virtual if any update has a virtual dispatch time."""
    return "virtual" if any(row.virtual_dispatched_at is not None for row in rows) else "wall"


def naive_waiting_and_busy(
    rows: Sequence[UpdateRecord | UpdateInput], clock: str
) -> tuple[float, float]:
    """``(waiting, busy)`` of one site's updates (in recording order), straight from the
    definition: each arrival's gap to the dispatch of the update that follows it in
    (dispatch time, recording order), clamped at 0; busy is arrival minus dispatch."""
    if clock == "virtual":
        times = [
            (row.virtual_dispatched_at, row.virtual_arrived_at)
            for row in rows
            if row.virtual_dispatched_at is not None
        ]
    else:
        times = [
            (
                _seconds(row.dispatched_at),
                None if row.arrived_at is None else _seconds(row.arrived_at),
            )
            for row in rows
        ]
    waiting = busy = 0.0
    for index, (dispatched, arrived) in enumerate(times):
        if arrived is None:
            continue
        busy += arrived - dispatched
        later = [(d, j) for j, (d, _) in enumerate(times) if (d, j) > (dispatched, index)]
        if later:
            waiting += max(0.0, min(later)[0] - arrived)
    return waiting, busy


def naive_p90(values: Sequence[int]) -> int | None:
    """The smallest value that at least 90 % of ``values`` do not exceed."""
    ordered = sorted(values)
    return next((v for v in ordered if 10 * sum(x <= v for x in ordered) >= 9 * len(ordered)), None)


def naive_summary(
    rows: Iterable[UpdateRecord | UpdateInput], *, clock: str = "wall"
) -> NaiveSummary:
    """Aggregate one site's updates (in recording order) the slow, obvious way.

    ``clock`` is the run's (see ``naive_run_clock``): it depends on every site's updates.
    """
    rows = list(rows)
    staleness = [row.staleness for row in rows if row.status == "applied"]
    losses = [
        row.train_loss
        for row in rows
        if row.train_loss is not None and math.isfinite(row.train_loss)
    ]

    compute = [r.virtual_compute_seconds for r in rows if r.virtual_compute_seconds is not None]
    transfer = [r.transfer_seconds for r in rows if r.transfer_seconds is not None]
    delays = [r.delay for r in rows if r.status == "applied" and r.delay is not None]
    waiting, busy = naive_waiting_and_busy(rows, clock)

    def count(status: str) -> int:
        return sum(1 for row in rows if row.status == status)

    return NaiveSummary(
        updates=len(rows),
        applied=count("applied"),
        buffered=count("buffered"),
        cancelled=count("cancelled"),
        dropped=count("dropped"),
        rejected=count("rejected"),
        mean_staleness=statistics.fmean(staleness) if staleness else None,
        max_staleness=max(staleness) if staleness else None,
        bytes_up=sum(row.bytes_up for row in rows),
        bytes_down=sum(row.bytes_down for row in rows),
        compute_seconds=sum(row.compute_seconds or 0.0 for row in rows),
        mean_train_loss=statistics.fmean(losses) if losses else None,
        staleness_counts=dict(sorted(Counter(staleness).items())),
        p90_staleness=naive_p90(staleness),
        waiting_seconds=waiting,
        busy_seconds=busy,
        waiting_clock=clock,
        virtual_compute_seconds=None if not compute else sum(compute),
        transfer_seconds=None if not transfer else sum(transfer),
        mean_delay=statistics.fmean(delays) if delays else None,
    )


def naive_eval_traffic(
    rows: Iterable[EvaluationRecord | EvaluationInput],
) -> tuple[int, int, int]:
    """``(count, bytes_up, bytes_down)`` of some evaluations, the obvious way."""
    rows = list(rows)
    return len(rows), sum(row.bytes_up for row in rows), sum(row.bytes_down for row in rows)


def assert_summary_matches(actual: Any, expected: NaiveSummary) -> None:
    """Compare a ``SiteSummary`` with the oracle; floats to a tight tolerance."""
    for name in (
        "updates",
        "applied",
        "buffered",
        "cancelled",
        "dropped",
        "rejected",
        "max_staleness",
        "bytes_up",
        "bytes_down",
        "staleness_counts",
        "p90_staleness",
        "waiting_clock",
    ):
        assert getattr(actual, name) == getattr(expected, name), name
    for name in (
        "mean_staleness",
        "compute_seconds",
        "mean_train_loss",
        "waiting_seconds",
        "busy_seconds",
        "virtual_compute_seconds",
        "transfer_seconds",
        "mean_delay",
    ):
        want, got = getattr(expected, name), getattr(actual, name)
        if want is None:
            assert got is None, name
        else:
            assert got is not None, name
            assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9), (name, got, want)
