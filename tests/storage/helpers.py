"""Small builders and the naive oracle shared by the storage tests."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
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


def naive_summary(rows: Iterable[UpdateRecord | UpdateInput]) -> NaiveSummary:
    """Aggregate one site's updates the slow, obvious way."""
    rows = list(rows)
    staleness = [row.staleness for row in rows]
    losses = [
        row.train_loss
        for row in rows
        if row.train_loss is not None and math.isfinite(row.train_loss)
    ]

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
    ):
        assert getattr(actual, name) == getattr(expected, name), name
    for name in ("mean_staleness", "compute_seconds", "mean_train_loss"):
        want, got = getattr(expected, name), getattr(actual, name)
        if want is None:
            assert got is None, name
        else:
            assert got is not None, name
            assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9), (name, got, want)
