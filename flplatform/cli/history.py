"""``flplatform history runs|rounds|sites``: what every run, round and site cost."""

from __future__ import annotations

from typing import Annotated

import typer

from flplatform.cli.errors import handles_errors
from flplatform.cli.render import OutputFormat, emit, human_bytes, make_console
from flplatform.errors import ConfigError
from storage import LedgerRepository

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
            columns=["run", "name", "status", "rounds", "accuracy", "seed", "created", "wall s"],
            rows=[
                (
                    r.id,
                    r.name,
                    r.status,
                    f"{r.rounds_completed}/{r.num_rounds_planned}",
                    (r.final_metrics or r.last_metrics or {}).get("accuracy"),
                    r.seed,
                    r.created_at.strftime("%Y-%m-%d %H:%M:%S"),
                    r.wall_seconds,
                )
                for r in records
            ],
        )


@app.command("rounds")
@handles_errors
def rounds(run: RunArgument, db: DbOption = None, fmt: FormatOption = OutputFormat.table) -> None:
    """One row per round: model version, global metrics, outcomes and bytes."""
    with LedgerRepository.open(db) as repository:
        run_id = resolve_run(repository, run)
        record = repository.get_run(run_id)
        records = repository.list_rounds(run_id)
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
                    r.wall_seconds,
                )
                for r in records
            ],
        )


@app.command("sites")
@handles_errors
def sites(run: RunArgument, db: DbOption = None, fmt: FormatOption = OutputFormat.table) -> None:
    """One row per site: updates and their fate, staleness, bytes and compute time."""
    with LedgerRepository.open(db) as repository:
        run_id = resolve_run(repository, run)
        record = repository.get_run(run_id)
        records = repository.site_summaries(run_id)
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
                "bytes up",
                "bytes down",
                "eval up/down",
                "compute s",
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
                    human_bytes(s.bytes_up),
                    human_bytes(s.bytes_down),
                    _pair(s.eval_bytes_up, s.eval_bytes_down),
                    s.compute_seconds,
                    s.mean_train_loss,
                )
                for s in records
            ],
        )


def _pair(up: int, down: int) -> str:
    """Federated-evaluation traffic, or '-' when there was none."""
    return "-" if not (up or down) else f"{human_bytes(up)} / {human_bytes(down)}"
