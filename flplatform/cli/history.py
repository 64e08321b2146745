"""``flplatform history runs|rounds|sites``: what every run, round and site cost.

A run that simulated a network also has times on its simulated clock (seconds since the
simulated start of the run); the tables show them next to the wall-clock ones, and JSON/CSV
carry every field of the records.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

import typer

from flplatform.cli.errors import handles_errors
from flplatform.cli.render import OutputFormat, emit, human_bytes, make_console
from flplatform.errors import ConfigError
from storage import CLOCK_WALL, LedgerRepository

app = typer.Typer(help="Show what every run, round and site cost (read from the ledger).")
console = make_console()

DbOption = Annotated[
    str | None,
    typer.Option(
        "--db",
        help="SQLAlchemy URL of the ledger (default: the SQLite file in "
        "$FLPLATFORM_HOME or ./.flplatform).",
    ),
]
FormatOption = Annotated[OutputFormat, typer.Option("--format", "-f", help="Output format.")]
RunArgument = Annotated[str, typer.Argument(help="Run id, or 'latest'.")]

# Distinct staleness values shown in the site table's histogram cell before it is cut short.
MAX_STALENESS_SHOWN = 8


def resolve_run(repository: LedgerRepository, run: str) -> int:
    """A run id from the user's RUN argument ('latest' or a number)."""
    if run == "latest":
        runs = repository.list_runs(limit=1)
        if not runs:
            raise ConfigError(
                f"no runs in {repository.url} yet; start one with flplatform simulate"
            )
        return runs[0].id
    try:
        return int(run)
    except ValueError:
        raise ConfigError(f"RUN must be a run id (an integer) or 'latest', got '{run}'") from None


@app.command("runs")
@handles_errors
def runs(
    db: DbOption = None,
    fmt: FormatOption = OutputFormat.table,
    limit: Annotated[int | None, typer.Option(min=1, help="Show only the newest N runs.")] = None,
) -> None:
    """List runs, newest first."""
    with LedgerRepository.open(db) as repository:
        records = repository.list_runs(limit=limit)
        emit(
            console,
            fmt,
            title=f"Runs in {repository.url}",
            records=[r.to_dict() for r in records],
            columns=[
                "run",
                "name",
                "status",
                "rounds",
                "accuracy",
                "seed",
                "network",
                "created",
                "wall s",
                "simulated",
            ],
            rows=[
                (
                    r.id,
                    r.name,
                    r.status,
                    f"{r.rounds_completed}/{r.num_rounds_planned}",
                    (r.final_metrics or r.last_metrics or {}).get("accuracy"),
                    r.seed,
                    r.network,
                    r.created_at.strftime("%Y-%m-%d %H:%M:%S"),
                    r.wall_seconds,
                    human_seconds(r.simulated_seconds),
                )
                for r in records
            ],
        )


@app.command("rounds")
@handles_errors
def rounds(run: RunArgument, db: DbOption = None, fmt: FormatOption = OutputFormat.table) -> None:
    """One row per round: model version, global metrics, outcomes and bytes.

    A run with simulated time also shows when each round ended on the simulated clock.
    """
    with LedgerRepository.open(db) as repository:
        run_id = resolve_run(repository, run)
        record = repository.get_run(run_id)
        records = repository.list_rounds(run_id)
        # Only simulated runs get the column: on a wall-clock run it would be all dashes.
        simulated = any(r.virtual_finished_at is not None for r in records)
        sim = ["sim s"] if simulated else []
        emit(
            console,
            fmt,
            title=f"Run {run_id} ({record.name}, {record.status}): rounds",
            records=[r.to_dict() for r in records],
            columns=[
                "round",
                "version",
                "accuracy",
                "loss",
                "train loss",
                "applied",
                "dropped",
                "rejected",
                "bytes up",
                "bytes down",
                "eval up/down",
                *sim,
                "wall s",
            ],
            rows=[
                (
                    r.round,
                    r.model_version,
                    r.metrics.get("accuracy"),
                    r.metrics.get("loss"),
                    r.train_loss,
                    r.num_applied,
                    r.num_dropped,
                    r.num_rejected,
                    human_bytes(r.bytes_up),
                    human_bytes(r.bytes_down),
                    _pair(r.eval_bytes_up, r.eval_bytes_down),
                    *([_fixed(r.virtual_finished_at)] if simulated else []),
                    r.wall_seconds,
                )
                for r in records
            ],
        )


@app.command("sites")
@handles_errors
def sites(run: RunArgument, db: DbOption = None, fmt: FormatOption = OutputFormat.table) -> None:
    """One row per site: updates and their fate, staleness, bytes, compute and waiting time.

    Staleness is over applied updates: mean/max, the 90th percentile, and how many applied
    updates had each staleness ("0:12 1:5" is twelve at 0, five at 1). Waiting is the time
    the site sat idle between an update arriving and its next dispatch, on the clock named in
    the header. A run of the delayed strategy also shows each site's mean delay: how many
    rounds old the global average its applied updates started from was.
    """
    with LedgerRepository.open(db) as repository:
        run_id = resolve_run(repository, run)
        record = repository.get_run(run_id)
        records = repository.site_summaries(run_id)
        # One clock per run, so every summary names the same one.
        clock = records[0].waiting_clock if records else CLOCK_WALL
        # Only delayed runs get the column: on any other run it would be all dashes.
        delayed = any(s.mean_delay is not None for s in records)
        emit(
            console,
            fmt,
            title=f"Run {run_id} ({record.name}, {record.status}): sites",
            records=[s.to_dict() for s in records],
            columns=[
                "site",
                "examples",
                "updates",
                "applied",
                "dropped",
                "rejected",
                "staleness mean/max",
                "p90",
                "staleness counts",
                *(["delay"] if delayed else []),
                "bytes up",
                "bytes down",
                "eval up/down",
                "compute s",
                f"waiting s ({clock})",
                "train loss",
            ],
            rows=[
                (
                    s.name,
                    s.num_examples,
                    s.updates,
                    s.applied,
                    s.dropped,
                    s.rejected,
                    "-"
                    if s.mean_staleness is None
                    else f"{s.mean_staleness:.2f}/{s.max_staleness}",
                    s.p90_staleness,
                    staleness_counts(s.staleness_counts),
                    *([_mean(s.mean_delay)] if delayed else []),
                    human_bytes(s.bytes_up),
                    human_bytes(s.bytes_down),
                    _pair(s.eval_bytes_up, s.eval_bytes_down),
                    s.compute_seconds,
                    _fixed(s.waiting_seconds),
                    s.mean_train_loss,
                )
                for s in records
            ],
        )


def _pair(up: int, down: int) -> str:
    """Federated-evaluation traffic, or '-' when there was none."""
    return "-" if not (up or down) else f"{human_bytes(up)} / {human_bytes(down)}"


def human_seconds(seconds: float | None) -> str:
    """A duration for a table: 42.5 → '42.5 s', 3723 → '1h 02m 03s', None → '-'."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def staleness_counts(counts: Mapping[int, int], *, limit: int = MAX_STALENESS_SHOWN) -> str:
    """A staleness histogram in one cell: {0: 12, 1: 5} → '0:12 1:5', {} → '-'.

    Only the ``limit`` smallest staleness values are shown, then how many more there are, so a
    long-tailed asynchronous run keeps a readable table; JSON and CSV carry the whole histogram.
    """
    if not counts:
        return "-"
    shown = sorted(counts.items())
    text = " ".join(f"{staleness}:{n}" for staleness, n in shown[:limit])
    return text if len(shown) <= limit else f"{text} (+{len(shown) - limit} more)"


def _mean(value: float | None) -> str:
    """A mean of rounds with two decimals, as the staleness mean is shown, or '-' for None."""
    return "-" if value is None else f"{value:.2f}"


def _fixed(seconds: float | None) -> str:
    """Seconds with one decimal, or '-' for None.

    The table's default of 4 significant digits would print 12345.6 s as 1.235e+04.
    """
    return "-" if seconds is None else f"{seconds:.1f}"
