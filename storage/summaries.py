"""Totals the ledger computes when read: a run's round count, latest metrics and bytes, a
round's evaluation traffic, and a site's totals over a run (``SiteSummary``).

Sums and counts are SQL; what SQL cannot do portably is done here in Python: the staleness
percentile, and the waiting times, which need each update's successor in dispatch order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import Select, Subquery, case, func, select, union_all
from sqlalchemy.orm import Session

from flplatform.core.ledger_rows import (
    TRAFFIC_QUERY,
    UPDATE_APPLIED,
    UPDATE_BUFFERED,
    UPDATE_CANCELLED,
    UPDATE_DROPPED,
    UPDATE_REJECTED,
)

from .mapping import to_record
from .models import Evaluation, Round, Run, Site, Traffic, Update
from .records import CLOCK_VIRTUAL, CLOCK_WALL, RoundRecord, RunRecord, SiteSummary, WaitingClock


# ---------------------------------------------------------------------------- runs, rounds
def run_record(
    run: Run,
    rounds: int | None,
    last_metrics: dict[str, Any] | None,
    bytes_up: Any = None,
    bytes_down: Any = None,
) -> RunRecord:
    """A run with its round count, the metrics of its latest round and its bytes (see
    ``runs_query``; PostgreSQL sums BIGINTs as NUMERIC, and a run without rows has NULL)."""
    return to_record(
        RunRecord,
        run,
        rounds_completed=rounds or 0,
        last_metrics=dict(last_metrics or {}),
        bytes_up=int(bytes_up or 0),
        bytes_down=int(bytes_down or 0),
    )


def runs_query() -> Select[tuple[Run, int | None, dict[str, Any] | None, Any, Any]]:
    """Runs with their round count, the metrics of their latest round and their bytes each
    way over their updates, evaluations and traffic rows."""
    per_run = (
        select(
            Round.run_id.label("run_id"),
            func.count(Round.id).label("rounds"),
            func.max(Round.round).label("last_round"),
        )
        .group_by(Round.run_id)
        .subquery()
    )
    last = (
        select(Round.run_id, Round.metrics)
        .join(per_run, (per_run.c.run_id == Round.run_id) & (per_run.c.last_round == Round.round))
        .subquery()
    )
    rows = union_all(
        *(
            select(t.c.run_id, t.c.bytes_up, t.c.bytes_down)
            for t in (Update.__table__, Evaluation.__table__, Traffic.__table__)
        )
    ).subquery()
    wire = (
        select(
            rows.c.run_id.label("run_id"),
            func.sum(rows.c.bytes_up).label("bytes_up"),
            func.sum(rows.c.bytes_down).label("bytes_down"),
        )
        .group_by(rows.c.run_id)
        .subquery()
    )
    return (
        select(Run, per_run.c.rounds, last.c.metrics, wire.c.bytes_up, wire.c.bytes_down)
        .outerjoin(per_run, per_run.c.run_id == Run.id)
        .outerjoin(last, last.c.run_id == Run.id)
        .outerjoin(wire, wire.c.run_id == Run.id)
    )


def rounds_query(run_id: int) -> Select[tuple[Round, Any, Any]]:
    """A run's rounds in order, each with the bytes of its evaluations each way.

    PostgreSQL returns SUM of BIGINT as NUMERIC (Decimal), and a round without evaluations has
    NULL sums; ``round_record`` makes both an ``int``.
    """
    traffic = _evaluation_traffic(run_id, "round")
    return (
        select(Round, traffic.c.eval_bytes_up, traffic.c.eval_bytes_down)
        .outerjoin(traffic, traffic.c.round == Round.round)
        .where(Round.run_id == run_id)
        .order_by(Round.round)
    )


def round_record(row: Round, eval_bytes_up: Any, eval_bytes_down: Any) -> RoundRecord:
    """A round with its evaluation traffic (see ``rounds_query``)."""
    return to_record(
        RoundRecord,
        row,
        eval_bytes_up=int(eval_bytes_up or 0),
        eval_bytes_down=int(eval_bytes_down or 0),
    )


# ---------------------------------------------------------------------------- sites
def nearest_rank_p90(counts: Mapping[int, int]) -> int | None:
    """Return the nearest-rank 90th percentile of a histogram of integer values.

    Parameters
    ----------
    counts : Mapping[int, int]
        Value (a staleness) to how many times it occurred; counts must be ``>= 0``.

    Returns
    -------
    int or None
        The smallest value ``v`` such that at least ``ceil(0.9 * n)`` of the ``n``
        occurrences are ``<= v`` (so always a value that occurred); ``None`` when ``n`` is 0.
    """
    total = sum(counts.values())
    if total == 0:
        return None
    rank = -(-9 * total // 10)  # ceil(0.9 * total) in integers, exact for any total
    seen = 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= rank:
            return value
    raise ValueError(f"histogram counts must be >= 0, got {dict(counts)}")


def waiting_and_busy(intervals: Iterable[tuple[float, float | None]]) -> tuple[float, float]:
    """Return how long a site waited for the server and how long it was busy, in seconds.

    Parameters
    ----------
    intervals : Iterable[tuple[float, float or None]]
        ``(dispatched, arrived)`` of each of one site's updates on one clock, in the order
        they were recorded; ``arrived`` is ``None`` when nothing came back.

    Returns
    -------
    tuple[float, float]
        ``(waiting, busy)``. The updates are put in dispatch order (ties keep recording
        order); waiting sums, for each update that arrived and is followed by another, the gap
        from its arrival to the next dispatch, a negative gap (overlapping work) counting as
        0; busy sums ``arrived - dispatched`` over the updates that arrived.
    """
    timeline = sorted(intervals, key=lambda interval: interval[0])  # stable: ties keep order
    waiting = busy = 0.0
    for index, (dispatched, arrived) in enumerate(timeline):
        if arrived is None:
            continue
        busy += arrived - dispatched
        if index + 1 < len(timeline):
            waiting += max(0.0, timeline[index + 1][0] - arrived)
    return waiting, busy


def site_summaries(session: Session, run_id: int) -> list[SiteSummary]:
    """Return per-site totals over a run's updates, evaluations and traffic (``SiteSummary``).

    Counts, sums, means and the staleness histogram are computed in SQL; the waiting and busy
    times, which depend on each update's successor in dispatch order, are computed here from
    each site's dispatch and arrival times (see ``waiting_and_busy``), and the 90th percentile
    from the histogram. Staleness and the mean delay cover applied updates only. Sites with no
    updates or evaluations are included with zero counts, in the order they were added.

    Parameters
    ----------
    session : Session
        An open session.
    run_id : int
        An existing run.

    Returns
    -------
    list[SiteSummary]
        One summary per site of the run.
    """
    histograms: dict[int, dict[int, int]] = {}
    for site_id, staleness, n in session.execute(_applied_staleness(run_id)):
        histograms.setdefault(site_id, {})[int(staleness)] = int(n)
    clock, intervals = _site_intervals(session.execute(_timeline(run_id)))
    summaries = []
    for row in session.execute(_totals_per_site(run_id)):
        site: Site = row[0]
        t = row._mapping
        by_staleness = dict(sorted(histograms.get(site.id, {}).items()))
        waiting, busy = waiting_and_busy(intervals.get(site.id, []))
        # PostgreSQL returns SUM/AVG of integers as NUMERIC (Decimal); normalise.
        summaries.append(
            SiteSummary(
                site_id=site.id,
                name=site.name,
                node_id=site.node_id,
                partition_id=site.partition_id,
                num_examples=site.num_examples,
                updates=int(t["updates"] or 0),
                applied=int(t["applied"] or 0),
                buffered=int(t["buffered"] or 0),
                cancelled=int(t["cancelled"] or 0),
                dropped=int(t["dropped"] or 0),
                rejected=int(t["rejected"] or 0),
                mean_staleness=_float_or_none(t["mean_staleness"]),
                max_staleness=None if t["max_staleness"] is None else int(t["max_staleness"]),
                bytes_up=int(t["bytes_up"] or 0),
                bytes_down=int(t["bytes_down"] or 0),
                compute_seconds=float(t["compute_seconds"] or 0.0),
                mean_train_loss=_float_or_none(t["mean_train_loss"]),
                evaluations=int(t["evaluations"] or 0),
                eval_bytes_up=int(t["eval_bytes_up"] or 0),
                eval_bytes_down=int(t["eval_bytes_down"] or 0),
                staleness_counts=by_staleness,
                p90_staleness=nearest_rank_p90(by_staleness),
                waiting_seconds=waiting,
                busy_seconds=busy,
                waiting_clock=clock,
                virtual_compute_seconds=_float_or_none(t["virtual_compute_seconds"]),
                transfer_seconds=_float_or_none(t["transfer_seconds"]),
                mean_delay=_float_or_none(t["mean_delay"]),
                queries=int(t["queries"] or 0),
                query_bytes_up=int(t["query_bytes_up"] or 0),
                query_bytes_down=int(t["query_bytes_down"] or 0),
                total_bytes_up=sum(
                    int(t[k] or 0) for k in ("bytes_up", "eval_bytes_up", "traffic_bytes_up")
                ),
                total_bytes_down=sum(
                    int(t[k] or 0) for k in ("bytes_down", "eval_bytes_down", "traffic_bytes_down")
                ),
            )
        )
    return summaries


def _totals_per_site(run_id: int) -> Select[Any]:
    """Every site of the run with its update and evaluation totals (NULL when it had none)."""
    updates = Update.__table__.c

    def count(status: str) -> Any:
        return func.sum(case((updates.status == status, 1), else_=0))

    # NULL for every other status, which AVG and MAX skip.
    applied_staleness = case((updates.status == UPDATE_APPLIED, updates.staleness))
    applied_delay = case((updates.status == UPDATE_APPLIED, updates.delay))
    updated = (
        select(
            updates.site_id.label("site_id"),
            func.count(updates.id).label("updates"),
            count(UPDATE_APPLIED).label("applied"),
            count(UPDATE_BUFFERED).label("buffered"),
            count(UPDATE_CANCELLED).label("cancelled"),
            count(UPDATE_DROPPED).label("dropped"),
            count(UPDATE_REJECTED).label("rejected"),
            func.avg(applied_staleness).label("mean_staleness"),
            func.max(applied_staleness).label("max_staleness"),
            # AVG over only NULLs is NULL: "no applied update had a delay".
            func.avg(applied_delay).label("mean_delay"),
            func.sum(updates.bytes_up).label("bytes_up"),
            func.sum(updates.bytes_down).label("bytes_down"),
            func.sum(updates.compute_seconds).label("compute_seconds"),
            func.avg(updates.train_loss).label("mean_train_loss"),
            # SUM over only NULLs is NULL: "no update had a simulated time".
            func.sum(updates.virtual_compute_seconds).label("virtual_compute_seconds"),
            func.sum(updates.transfer_seconds).label("transfer_seconds"),
        )
        .where(updates.run_id == run_id)
        .group_by(updates.site_id)
        .subquery()
    )
    evaluated = _evaluation_traffic(run_id, "site_id")
    traffic = Traffic.__table__.c

    def queried(column: Any) -> Any:
        return func.sum(case((traffic.kind == TRAFFIC_QUERY, column), else_=0))

    other = (
        select(
            traffic.site_id.label("site_id"),
            queried(traffic.messages).label("queries"),
            queried(traffic.bytes_up).label("query_bytes_up"),
            queried(traffic.bytes_down).label("query_bytes_down"),
            func.sum(traffic.bytes_up).label("traffic_bytes_up"),
            func.sum(traffic.bytes_down).label("traffic_bytes_down"),
        )
        .where(traffic.run_id == run_id)
        .group_by(traffic.site_id)
        .subquery()
    )
    return (
        select(
            Site,
            updated,
            evaluated.c.evaluations,
            evaluated.c.eval_bytes_up,
            evaluated.c.eval_bytes_down,
            other.c.queries,
            other.c.query_bytes_up,
            other.c.query_bytes_down,
            other.c.traffic_bytes_up,
            other.c.traffic_bytes_down,
        )
        .outerjoin(updated, updated.c.site_id == Site.id)
        .outerjoin(evaluated, evaluated.c.site_id == Site.id)
        .outerjoin(other, other.c.site_id == Site.id)
        .where(Site.run_id == run_id)
        .order_by(Site.id)
    )


def _evaluation_traffic(run_id: int, key: str) -> Subquery:
    """The run's evaluations per ``key`` (``"round"`` or ``"site_id"``): count, bytes each way."""
    evaluations = Evaluation.__table__.c
    return (
        select(
            evaluations[key].label(key),
            func.count(evaluations.id).label("evaluations"),
            func.sum(evaluations.bytes_up).label("eval_bytes_up"),
            func.sum(evaluations.bytes_down).label("eval_bytes_down"),
        )
        .where(evaluations.run_id == run_id)
        .group_by(evaluations[key])
        .subquery()
    )


def _applied_staleness(run_id: int) -> Select[Any]:
    """``(site_id, staleness, count)`` over the run's applied updates."""
    updates = Update.__table__.c
    return (
        select(updates.site_id, updates.staleness, func.count(updates.id))
        .where(updates.run_id == run_id, updates.status == UPDATE_APPLIED)
        .group_by(updates.site_id, updates.staleness)
    )


def _timeline(run_id: int) -> Select[Any]:
    """Each update's site and times on both clocks, in the order they were recorded."""
    updates = Update.__table__.c
    return (
        select(
            updates.site_id,
            updates.dispatched_at,
            updates.arrived_at,
            updates.virtual_dispatched_at,
            updates.virtual_arrived_at,
        )
        .where(updates.run_id == run_id)
        .order_by(updates.id)
    )


def _float_or_none(value: Any) -> float | None:
    """An aggregate as a ``float`` (PostgreSQL gives ``Decimal`` for integer columns)."""
    return None if value is None else float(value)


def _site_intervals(
    rows: Iterable[tuple[int, datetime, datetime | None, float | None, float | None]],
) -> tuple[WaitingClock, dict[int, list[tuple[float, float | None]]]]:
    """Pick a run's clock and return each site's ``(dispatched, arrived)`` seconds on it.

    The virtual clock is used as soon as any update of the run has a virtual dispatch time:
    in a simulated run the wall times only measure how fast the simulator ran. Updates without
    a virtual dispatch time cannot be placed on that clock and are left out. On the wall clock
    the datetimes become seconds relative to the run's first dispatch, so differences keep
    microsecond precision instead of being taken between two ~1.7e9 floats.

    Parameters
    ----------
    rows : Iterable[tuple]
        ``(site_id, dispatched_at, arrived_at, virtual_dispatched_at, virtual_arrived_at)``
        of every update of the run, in the order they were recorded.

    Returns
    -------
    tuple[WaitingClock, dict[int, list[tuple[float, float or None]]]]
        The clock, and per site id the intervals in recording order.
    """
    rows = list(rows)
    per_site: dict[int, list[tuple[float, float | None]]] = {}
    if any(row[3] is not None for row in rows):
        for site_id, _, _, sent, came in rows:
            if sent is not None:
                per_site.setdefault(site_id, []).append((sent, came))
        return CLOCK_VIRTUAL, per_site
    if rows:
        origin = min(row[1] for row in rows)
        for site_id, sent_at, came_at, _, _ in rows:
            arrived = None if came_at is None else (came_at - origin).total_seconds()
            per_site.setdefault(site_id, []).append(((sent_at - origin).total_seconds(), arrived))
    return CLOCK_WALL, per_site
