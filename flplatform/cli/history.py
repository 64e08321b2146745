"""``flplatform history runs|compare|rounds|sites|updates|traffic|checkpoints|events``: what
every run, round and site cost, how runs compare, which models were kept, and what happened
to a run besides its rounds.

Bytes are what Flower's SuperLink counts on the wire (messages, their replies and their
protocol envelopes): a run's totals are those ``flwr ls`` reports for it, and ``traffic``
lists what no update or evaluation holds (each site's information query, late replies).

A run that simulated a network also has times on its simulated clock (seconds since the
simulated start of the run); the tables show them next to the wall-clock ones, and JSON/CSV
carry every field of the records. Why an update was not applied (its ``reason``) is shown
per update by ``updates`` and, most common first, per round by ``rounds``. A run's note
(why it failed, or a warning such as training that diverged) is a line under ``runs`` and
``rounds``. Every table fits the console (``flplatform.cli.render.Column``).

Each view reads the ledger as it was at one moment (``read_ledger``), so a run being recorded
shows a run row and rounds that agree.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Annotated

import typer
from rich.text import Text

from flplatform.app.comparison import (
    CLOCK_SIMULATED,
    RunSummary,
    accuracy_metric,
    run_setup,
    summarize_runs,
)
from flplatform.cli.errors import handles_errors, stderr
from flplatform.cli.render import (
    Column,
    OutputFormat,
    emit,
    human_bytes,
    make_console,
    say,
    shorten,
)
from flplatform.core import keys
from flplatform.core.errors import ConfigError
from flplatform.engine.events import SITE_BACK_EVENT, SITE_LOST_EVENT, SITE_SILENT_EVENT
from storage import (
    CLOCK_WALL,
    RESUMED_EVENT,
    RUN_FAILED,
    TRAFFIC_KINDS,
    UPDATE_APPLIED,
    UPDATE_DROPPED,
    UPDATE_REJECTED,
    UPDATE_STATUSES,
    LedgerRepository,
    RoundRecord,
    RunEventRecord,
    RunRecord,
    UpdateRecord,
)

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
RunsArgument = Annotated[
    list[str], typer.Argument(metavar="RUN...", help="Run ids, or 'latest'.", show_default=False)
]
TargetOption = Annotated[
    float, typer.Option(help="The accuracy whose time and bytes to reach are reported, in (0, 1].")
]

# Distinct staleness values shown in the site table's histogram cell before it is cut short.
MAX_STALENESS_SHOWN = 8
# Characters of a failure reason shown in a table cell (JSON and CSV carry it whole).
REASON_CELL = 80
# Characters of a strategy or model name in a table (a user's own may be a long class or
# factory name).
SETUP_CELL = 14
# The header of a column of update counts: "2/0/1".
COUNTS = "applied/\ndropped/\nrejected"
# The statuses of updates that came to nothing for a reason worth showing: a site's error,
# a timeout or absence (dropped), or a reply the strategy refused (rejected).
FAILED_STATUSES = (UPDATE_DROPPED, UPDATE_REJECTED)


@contextmanager
def read_ledger(db: str | None) -> Iterator[LedgerRepository]:
    """The ledger at ``db`` as of one moment: every read of a view agrees with the others.

    Opening an older ledger upgrades its schema (a view reads every column this flplatform
    knows); it is said in one line on stderr, naming both revisions, since a flplatform older
    than this one refuses the ledger from then on, and whoever shares it should know.
    """
    with LedgerRepository.open(db, create=False) as repository:
        if repository.schema_upgrade is not None:
            old, new = repository.schema_upgrade.old, repository.schema_upgrade.new
            stderr.print(
                Text.assemble(
                    ("note:", "bold yellow"),
                    f" upgraded the schema of the ledger {repository.url} from revision {old} "
                    f"to {new}, to read it; a flplatform older than this one no longer opens it",
                )
            )
        with repository.snapshot() as ledger:
            yield ledger


def resolve_run(repository: LedgerRepository, run: str) -> int:
    """A run id from the user's RUN argument ('latest' or a number)."""
    if run == "latest":
        runs = repository.list_runs(limit=1)
        if not runs:
            raise ConfigError(
                f"no runs in {repository.url} yet; start one with flplatform simulate"
            )
        return runs[0].id
    if not (run.isascii() and run.isdigit()):  # int() also takes "1_1" (11) and "٣"
        raise ConfigError(f"RUN must be a run id (an integer) or 'latest', got '{run}'")
    return int(run)


@app.command("runs")
@handles_errors
def runs(
    db: DbOption = None,
    fmt: FormatOption = OutputFormat.table,
    limit: Annotated[int | None, typer.Option(min=1, help="Show only the newest N runs.")] = None,
) -> None:
    """List runs, newest first.

    Strategy, sync mode and model are those of the run's recorded config ('-' where it has
    none, as a user's own app may not). Accuracy is the server's, or the sites' (federated
    evaluation) for a run without one. A run's note (why it failed, or a warning such as
    training that diverged) follows the table, cut to a line; JSON and CSV carry it whole
    as ``error``, and every byte of the run each way as ``bytes_up`` (sites to server) and
    ``bytes_down``, as Flower's SuperLink counts them (``history traffic RUN`` ends with
    them).
    """
    with read_ledger(db) as repository:
        records = repository.list_runs(limit=limit)
        setups = [run_setup(r) for r in records]
        emit(
            console,
            fmt,
            title=f"Runs in {repository.url}",
            records=[r.to_dict() for r in records],
            columns=[
                "run",
                Column("name", text=True),
                "status",
                "strategy",
                Column("sync", drop=1),
                Column("model", drop=2),
                "rounds",
                "accuracy",
                Column("seed", drop=7),
                Column("network", drop=5),
                Column("created", drop=4),
                Column("wall", drop=6),
                Column("simulated", drop=3),
            ],
            rows=[
                (
                    r.id,
                    r.name,
                    r.status,
                    shorten(setup.strategy, SETUP_CELL),
                    setup.sync,
                    shorten(setup.model, SETUP_CELL) if setup.model else None,
                    f"{r.rounds_completed}/{r.num_rounds_planned}",
                    shown_accuracy(r.final_metrics or r.last_metrics or {})[1],
                    r.seed,
                    network_cell(r.network),
                    r.created_at.strftime("%Y-%m-%d %H:%M"),
                    human_seconds(r.wall_seconds),
                    human_seconds(r.simulated_seconds),
                )
                for r, setup in zip(records, setups, strict=True)
            ],
        )
        if fmt is OutputFormat.table:
            for r in records:
                if r.error:
                    say(console, run_note(r, limit=REASON_CELL), style="yellow")


@app.command("compare")
@handles_errors
def compare(
    selected: RunsArgument,
    target: TargetOption = 0.9,
    db: DbOption = None,
    fmt: FormatOption = OutputFormat.table,
) -> None:
    """One row per run: its setup, its accuracy, and what reaching the target cost.

    Accuracy is the server's, else the sites' (federated evaluation). Time to the target is
    in seconds on the run's simulated clock (marked sim), or on the wall clock since the run
    was created for a run that simulated no network (marked wall); bytes up to the target
    are the training uploads until the first round that reached it. Bytes up and down are
    every byte of the run. JSON carries every field and each run's accuracy curve; CSV every
    field but the curve. `flplatform plot` draws the curves.
    """
    with read_ledger(db) as repository:
        run_ids = [resolve_run(repository, run) for run in selected]
        summaries = summarize_runs(repository, run_ids, target=target)
    records = [s.to_dict() for s in summaries]
    if fmt is OutputFormat.csv:
        records = [{k: v for k, v in record.items() if k != "curve"} for record in records]
    goal = f"{target:g}"
    emit(
        console,
        fmt,
        title=f"Runs compared (target accuracy {goal}; time in s on each run's simulated clock "
        "(sim) or the wall clock (wall))",
        records=records,
        columns=[
            "run",
            Column("name", text=True),
            Column("strategy", drop=1),
            Column("sync", drop=2),
            Column("K", drop=6),
            Column("model", drop=4),
            Column("codec", drop=5),
            Column("seed", drop=9),
            "final\nacc",
            Column("best\nacc", drop=3),
            f"time to\n{goal}",
            Column("rounds", drop=8),
            Column("bytes\nup", drop=7),
            Column("bytes\ndown", drop=10),
            Column(f"bytes up\nto {goal}", drop=1),
        ],
        rows=[
            (
                s.run_id,
                s.name,
                shorten(s.strategy, SETUP_CELL),
                s.sync,
                s.k,
                shorten(s.model, SETUP_CELL) if s.model else None,
                s.codec,
                s.seed,
                s.final_accuracy,
                s.best_accuracy,
                time_cell(s),
                s.rounds,
                human_bytes(s.bytes_up),
                human_bytes(s.bytes_down),
                human_bytes(s.bytes_up_to_target),
            )
            for s in summaries
        ],
    )


def time_cell(summary: RunSummary) -> str | None:
    """Time to the target with its clock: '15.9 sim', '3.2 wall'; None (shown '-') if never."""
    if summary.time_to_target is None:
        return None
    clock = "sim" if summary.clock == CLOCK_SIMULATED else "wall"
    return f"{summary.time_to_target:.1f} {clock}"


@app.command("rounds")
@handles_errors
def rounds(run: RunArgument, db: DbOption = None, fmt: FormatOption = OutputFormat.table) -> None:
    """One row per round: model version, global metrics, outcomes and bytes.

    A run with simulated time also shows when each round ended on the simulated clock; a run
    with dropped or rejected updates shows each round's most common reason for them
    (``history updates RUN --round N`` lists them all); a run with sites that did not train
    in a round for a reason the ledger holds names them and why (update dropped or
    rejected, or the site away: its SuperNode left, or did not answer the site query); a
    run whose sites evaluated, their accuracy. JSON and CSV also carry each round's sites
    that trained (``trained``) and those that did not and why (``not_trained``). The run's
    note (training diverged, why it failed) follows the table.
    """
    with read_ledger(db) as repository:
        run_id = resolve_run(repository, run)
        record = repository.get_run(run_id)
        records = repository.list_rounds(run_id)
        # Only simulated runs get the column: on a wall-clock run it would be all dashes.
        simulated = any(r.virtual_finished_at is not None for r in records)
        sim = [Column("sim s")] if simulated else []
        updates = repository.list_updates(run_id)
        failures = failures_by_round(u for u in updates if u.status in FAILED_STATUSES)
        # Only runs with failed updates get the column, for the same reason.
        why = [Column("why not applied", text=True)] if failures else []
        trained = trained_by_round(updates)
        missed = not_trained_by_round(records, updates, repository.list_events(run_id))
        named = [Column("not trained", text=True)] if any(missed.values()) else []
        # ... and only runs whose sites evaluated get theirs.
        sited = any(r.metrics.get(keys.SITE_ACCURACY) is not None for r in records)
        emit(
            console,
            fmt,
            title=f"Run {run_id} ({record.name}, {record.status}): rounds",
            records=[
                {
                    **r.to_dict(),
                    "trained": trained.get(r.round, []),
                    "not_trained": missed.get(r.round, {}),
                }
                for r in records
            ],
            columns=[
                "round",
                Column("version", drop=6),
                "accuracy",
                Column("loss", drop=4),
                *([Column("site acc", drop=1)] if sited else []),
                Column("train loss", drop=3),
                COUNTS,
                "bytes\nup",
                Column("bytes\ndown", drop=2),
                Column("eval\nup/down", drop=7),
                *sim,
                Column("wall s", drop=5),
                *named,
                *why,
            ],
            rows=[
                (
                    r.round,
                    r.model_version,
                    r.metrics.get("accuracy"),
                    r.metrics.get("loss"),
                    *([r.metrics.get(keys.SITE_ACCURACY)] if sited else []),
                    r.train_loss,
                    _counts(r.num_applied, r.num_dropped, r.num_rejected),
                    human_bytes(r.bytes_up),
                    human_bytes(r.bytes_down),
                    _pair(r.eval_bytes_up, r.eval_bytes_down),
                    *([_fixed(r.virtual_finished_at)] if simulated else []),
                    r.wall_seconds,
                    *([_not_trained_cell(missed.get(r.round, {}))] if named else []),
                    *([common_reason(failures.get(r.round, []))] if failures else []),
                )
                for r in records
            ],
        )
        if fmt is OutputFormat.table and record.error:
            say(console, run_note(record), style="yellow")


@app.command("sites")
@handles_errors
def sites(run: RunArgument, db: DbOption = None, fmt: FormatOption = OutputFormat.table) -> None:
    """One row per site: updates and their fate, staleness, bytes, compute and waiting time.

    Staleness is over applied updates: mean/max, the 90th percentile, and how many applied
    updates had each staleness ("0:12 1:5" is twelve at 0, five at 1). Waiting is the time
    the site sat idle between an update arriving and its next dispatch, on the clock named in
    the header. Compute is what the sites measured; a simulated run also shows what the
    clock booked (which the network's compute models draw, unless the run's messages
    named no work). A run of the delayed strategy also shows each site's mean delay: how many
    rounds old the global average its applied updates started from was. JSON and CSV also
    carry the bytes of the site-information query each site is sent when it joins
    (``query_bytes_up``, ``query_bytes_down``) and all of a site's bytes (``total_bytes_*``);
    ``history traffic`` lists what is neither an update nor an evaluation.
    """
    with read_ledger(db) as repository:
        run_id = resolve_run(repository, run)
        record = repository.get_run(run_id)
        records = repository.site_summaries(run_id)
        # One clock per run, so every summary names the same one.
        clock = records[0].waiting_clock if records else CLOCK_WALL
        # Only delayed runs get the column: on any other run it would be all dashes.
        delayed = any(s.mean_delay is not None for s in records)
        # A simulated run: the clock's compute beside what the sites measured.
        simulated = any(s.virtual_compute_seconds is not None for s in records)
        emit(
            console,
            fmt,
            title=f"Run {run_id} ({record.name}, {record.status}): sites",
            records=[s.to_dict() for s in records],
            columns=[
                Column("site", text=True),
                Column("examples", drop=6),
                "updates",
                COUNTS,
                Column("staleness\nmean/max", drop=1),
                Column("p90", drop=5),
                Column("staleness counts", drop=4, text=True),
                *([Column("delay", drop=1)] if delayed else []),
                "bytes\nup",
                Column("bytes\ndown", drop=2),
                Column("eval\nup/down", drop=7),
                Column("compute s", drop=6),
                *([Column("compute s\n(clock)", drop=6)] if simulated else []),
                Column(f"waiting s\n({clock})", drop=3),
                Column("train loss", drop=5),
            ],
            rows=[
                (
                    s.name,
                    s.num_examples,
                    s.updates,
                    _counts(s.applied, s.dropped, s.rejected),
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
                    *([s.virtual_compute_seconds] if simulated else []),
                    _fixed(s.waiting_seconds),
                    s.mean_train_loss,
                )
                for s in records
            ],
        )


@app.command("updates")
@handles_errors
def updates(
    run: RunArgument,
    round_: Annotated[
        int | None, typer.Option("--round", min=1, help="Only the updates of this round.")
    ] = None,
    site: Annotated[str | None, typer.Option(help="Only this site's updates.")] = None,
    status: Annotated[
        str | None,
        typer.Option(
            help=f"Only updates with this status: {', '.join(UPDATE_STATUSES)} "
            "(several: comma-separated, e.g. rejected,dropped)."
        ),
    ] = None,
    db: DbOption = None,
    fmt: FormatOption = OutputFormat.table,
) -> None:
    """One row per site update: its round, site, status and why, staleness, size and times.

    The table cuts long reasons short; JSON and CSV carry every field of every update whole.
    Times in the table are seconds: compute as the site reported it, reply from dispatch to
    arrival on the wall clock; a simulated run also shows dispatch and arrival on its
    simulated clock, a delayed run each update's delay, a streaming-sync run the model
    fragment each update carried.
    """
    statuses = parse_statuses(status)
    with read_ledger(db) as repository:
        run_id = resolve_run(repository, run)
        record = repository.get_run(run_id)
        records = repository.list_updates(run_id, round=round_, site=site, status=statuses)
        simulated = any(u.virtual_dispatched_at is not None for u in records)
        delayed = any(u.delay is not None for u in records)
        fragmented = any(u.fragment is not None for u in records)
        filters = [
            *([f"round {round_}"] if round_ is not None else []),
            *([f"site {site}"] if site is not None else []),
            *([f"status {', '.join(statuses)}"] if statuses else []),
        ]
        emit(
            console,
            fmt,
            title=f"Run {run_id} ({record.name}, {record.status}): updates"
            + (f" ({'; '.join(filters)})" if filters else ""),
            records=[u.to_dict() for u in records],
            columns=[
                "round",
                Column("site", text=True),
                "status",
                Column("sent\nin", drop=4),
                Column("version", drop=6),
                Column("staleness", drop=1),
                *([Column("delay", drop=2)] if delayed else []),
                *([Column("fragment", drop=2)] if fragmented else []),
                Column("examples", drop=7),
                Column("train\nloss", drop=5),
                "bytes\nup",
                Column("bytes\ndown", drop=3),
                Column("compute\ns", drop=6),
                Column("reply\ns", drop=4),
                *(
                    [Column("sim\nsent", drop=5), Column("sim\narrived", drop=2)]
                    if simulated
                    else []
                ),
                Column("reason", text=True),
            ],
            rows=[
                (
                    u.round,
                    u.site,
                    u.status,
                    u.dispatched_round,
                    u.version_trained_on,
                    u.staleness,
                    *([u.delay] if delayed else []),
                    *([u.fragment] if fragmented else []),
                    u.num_examples,
                    u.train_loss,
                    human_bytes(u.bytes_up),
                    human_bytes(u.bytes_down),
                    u.compute_seconds,
                    _reply_seconds(u),
                    *(
                        [_fixed(u.virtual_dispatched_at), _fixed(u.virtual_arrived_at)]
                        if simulated
                        else []
                    ),
                    shorten(u.reason, REASON_CELL) if u.reason else None,
                )
                for u in records
            ],
        )


@app.command("traffic")
@handles_errors
def traffic(
    run: RunArgument,
    site: Annotated[str | None, typer.Option(help="Only this site's traffic.")] = None,
    kind: Annotated[
        str | None,
        typer.Option(help=f"Only traffic of this kind: {', '.join(TRAFFIC_KINDS)}."),
    ] = None,
    db: DbOption = None,
    fmt: FormatOption = OutputFormat.table,
) -> None:
    """One row per batch of bytes that no update or evaluation holds, then the run's totals.

    ``query``: the site-information query a site is sent when it joins (at the round
    during which it joined; "join" before the first round), and its reply. ``train`` or
    ``evaluate``: a reply that came after the server stopped waiting for it (its message
    is counted in its own row). Bytes are Flower's count of what crossed the wire.
    """
    if kind is not None and kind not in TRAFFIC_KINDS:
        raise ConfigError(f"--kind must be one of {', '.join(TRAFFIC_KINDS)}, got '{kind}'")
    with read_ledger(db) as repository:
        run_id = resolve_run(repository, run)
        record = repository.get_run(run_id)
        records = repository.list_traffic(run_id, site=site, kind=kind)
        emit(
            console,
            fmt,
            title=f"Run {run_id} ({record.name}, {record.status}): traffic",
            records=[t.to_dict() for t in records],
            columns=[
                "round",
                Column("site", text=True),
                "kind",
                "messages",
                "bytes up",
                "bytes down",
            ],
            rows=[
                (
                    "join" if t.round is None else t.round,
                    t.site,
                    t.kind,
                    t.messages,
                    human_bytes(t.bytes_up),
                    human_bytes(t.bytes_down),
                )
                for t in records
            ],
        )
        if fmt is OutputFormat.table:
            say(
                console,
                f"Run {run_id} in all (its updates, evaluations and traffic): "
                f"{human_bytes(record.bytes_up)} up, {human_bytes(record.bytes_down)} down",
            )


@app.command("checkpoints")
@handles_errors
def checkpoints(
    run: RunArgument, db: DbOption = None, fmt: FormatOption = OutputFormat.table
) -> None:
    """One row per checkpoint of a run: its round, model version, size and file.

    The last one is where `flplatform resume` continues from; kept ones (every few rounds,
    and the final model) stay when later rounds are recorded. Any of them can be written out
    with `flplatform export RUN --round N`. A file no longer on disk is marked missing.
    """
    with read_ledger(db) as repository:
        run_id = resolve_run(repository, run)
        record = repository.get_run(run_id)
        records = repository.list_checkpoints(run_id)
        present = [os.path.isfile(c.path) for c in records]
        # One directory (the usual case) goes in the title, so the cells stay short.
        folders = {os.path.dirname(c.path) for c in records}
        folder = folders.pop() if len(folders) == 1 else None
        emit(
            console,
            fmt,
            title=f"Run {run_id} ({record.name}, {record.status}): checkpoints"
            + (f" in {folder}" if folder else ""),
            records=[
                {**c.to_dict(), "file_present": p} for c, p in zip(records, present, strict=True)
            ],
            columns=["round", "version", "kept", "size", "created", Column("file", text=True)],
            rows=[
                (
                    c.round,
                    c.model_version,
                    "last" if c is records[-1] and not c.kept else ("yes" if c.kept else "no"),
                    human_bytes(c.size_bytes),
                    c.created_at.strftime("%Y-%m-%d %H:%M:%S"),
                    (os.path.basename(c.path) if folder else c.path) + ("" if p else " (missing)"),
                )
                for c, p in zip(records, present, strict=True)
            ],
        )
        if fmt is OutputFormat.table and not records:
            say(console, f"Run {run_id} has no checkpoints.", style="yellow")


@app.command("events")
@handles_errors
def events(run: RunArgument, db: DbOption = None, fmt: FormatOption = OutputFormat.table) -> None:
    """One row per event of a run besides its rounds (a resume: who resumed it, from what)."""
    with read_ledger(db) as repository:
        run_id = resolve_run(repository, run)
        record = repository.get_run(run_id)
        records = repository.list_events(run_id)
        emit(
            console,
            fmt,
            title=f"Run {run_id} ({record.name}, {record.status}): events",
            records=[e.to_dict() for e in records],
            columns=["at", "event", Column("detail", text=True)],
            rows=[
                (
                    e.at.strftime("%Y-%m-%d %H:%M:%S"),
                    e.kind,
                    shorten(json.dumps(e.detail, default=str), 2 * REASON_CELL),
                )
                for e in records
            ],
        )


def shown_accuracy(metrics: Mapping[str, float | None]) -> tuple[str, float | None]:
    """The accuracy to show for a round or run, and its label: the server's, else the sites'
    (``flplatform.app.comparison.accuracy_metric``)."""
    if accuracy_metric([metrics]) == keys.SITE_ACCURACY:
        return "site accuracy", metrics[keys.SITE_ACCURACY]
    return "accuracy", metrics.get(keys.ACCURACY)


def run_note(record: RunRecord, *, limit: int | None = None) -> str:
    """A run's note as one line: why it failed, or its warning (cut to ``limit``)."""
    label = "failed" if record.status == RUN_FAILED else "warning"
    error = record.error if limit is None else shorten(record.error, limit)
    return f"Run {record.id} {label}: {error}"


def network_cell(network: str | None) -> str | None:
    """A run's network for a table: a preset's name, a profile file's name after '…/'."""
    if network is None or "/" not in network:
        return network
    return "…/" + network.rsplit("/", 1)[1]


def parse_statuses(text: str | None) -> tuple[str, ...] | None:
    """The statuses ``--status`` names (comma-separated), each one the ledger uses.

    Raises
    ------
    ConfigError
        If the option is empty or names a status the ledger does not use.
    """
    if text is None:
        return None
    names = tuple(name.strip().lower() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in UPDATE_STATUSES]
    if unknown or not names:
        raise ConfigError(
            f"--status must be one of {', '.join(UPDATE_STATUSES)} (several: comma-separated), "
            f"got '{text}'"
        )
    return names


def failures_by_round(records: Iterable[UpdateRecord]) -> dict[int, list[UpdateRecord]]:
    """Updates grouped by the round that handled them, in recording order."""
    grouped: dict[int, list[UpdateRecord]] = {}
    for record in records:
        grouped.setdefault(record.round, []).append(record)
    return grouped


def trained_by_round(updates: Iterable[UpdateRecord]) -> dict[int, list[str]]:
    """The sites whose update each round applied, in recording order."""
    trained: dict[int, list[str]] = {}
    for update in updates:
        if update.status == UPDATE_APPLIED:
            sites = trained.setdefault(update.round, [])
            if update.site not in sites:
                sites.append(update.site)
    return trained


# A presence event that takes a site away, and the word that says how.
_AWAY = {SITE_LOST_EVENT: "left", SITE_SILENT_EVENT: "silent"}


def not_trained_by_round(
    rounds: Sequence[RoundRecord],
    updates: Sequence[UpdateRecord],
    events: Sequence[RunEventRecord],
) -> dict[int, dict[str, str]]:
    """Per round, each site (by name) with no applied update in it for a reason the ledger
    holds, and that reason: its update dropped or rejected (``"dropped: no reply within
    600 s"``), or the site away (``"away: left in round 3"``) from the round its site-lost
    or site-silent event names (an event recorded between rounds, at a start or a resume:
    the next round) through the round of its site-back event (one recorded between
    rounds: the round before), or until the run was resumed (which asks every site
    again), or to the run's last round.

    Sites that were simply not asked (a sample, async modes' K of N, a site still training
    an earlier version) are not listed: the ledger does not say they were missed.
    """
    applied = {(u.round, u.site) for u in updates if u.status == UPDATE_APPLIED}
    missed: dict[int, dict[str, str]] = {r.round: {} for r in rounds}
    for update in updates:
        key = (update.round, update.site)
        if update.status in FAILED_STATUSES and key not in applied and update.round in missed:
            why = " ".join((update.reason or "").split())
            missed[update.round].setdefault(
                update.site, f"{update.status}: {why}" if why else update.status
            )
    last = max(missed, default=0)

    def committed_by(event: RunEventRecord) -> int:
        """The last round committed when ``event`` was recorded."""
        return max((r.round for r in rounds if r.finished_at <= event.at), default=0)

    away: dict[str, tuple[str, int, str]] = {}  # site → (how it went, from round, said as)
    spans: list[tuple[str, str, int, int, str]] = []
    for event in events:
        if event.kind == RESUMED_EVENT:  # every site is asked again: new events say who is away
            upto = committed_by(event)
            spans += [(site, how, since, upto, said) for site, (how, since, said) in away.items()]
            away.clear()
            continue
        site, at = str(event.detail.get("site")), event.detail.get("round")
        if event.kind in _AWAY and site not in away:
            if at:
                away[site] = (_AWAY[event.kind], int(at), f"in round {at}")
            else:  # between rounds: a start (or resume) of the run
                since = committed_by(event) + 1
                away[site] = (_AWAY[event.kind], since, "at start-up" if since == 1 else "")
        elif event.kind == SITE_BACK_EVENT and site in away:
            how, since, said = away.pop(site)
            # back between rounds (the start waited for it): away through the last
            # round committed then, none at a start
            spans.append((site, how, since, int(at) if at else committed_by(event), said))
    spans += [(site, how, since, last, said) for site, (how, since, said) in away.items()]
    for site, how, since, until, said in spans:
        said = said or f"before round {since}"
        for server_round in range(max(since, 1), until + 1):
            if server_round in missed and (server_round, site) not in applied:
                missed[server_round].setdefault(site, f"away: {how} {said}")
    return {n: dict(sorted(sites.items())) for n, sites in missed.items()}


def _not_trained_cell(missed: Mapping[str, str]) -> str:
    """``"london rejected, tokyo away (left in round 3)"``: each site and what kept it
    out, without the reasons' text (the column beside it, and ``history updates``, have
    it); '-' when every site asked trained."""
    if not missed:
        return "-"
    short = []
    for site, why in missed.items():
        kind, _, rest = why.partition(": ")
        short.append(f"{site} {kind}" + (f" ({rest})" if kind == "away" else ""))
    return ", ".join(short)


def common_reason(failures: Sequence[UpdateRecord], *, limit: int = REASON_CELL) -> str:
    """The most common reason among ``failures``, shortened; '-' when there is none.

    ``"missing arrays: w (+1 other)"`` says one more distinct reason was recorded; ties go
    to the reason recorded first.
    """
    counts = Counter(" ".join(f.reason.split()) for f in failures if f.reason)
    if not counts:
        return "-"
    (reason, _), others = counts.most_common(1)[0], len(counts) - 1
    more = f" (+{others} other{'s' if others > 1 else ''})" if others else ""
    return shorten(reason, max(1, limit - len(more))) + more


def failure_note(latest: RoundRecord, failures: Sequence[UpdateRecord], *, limit: int = 60) -> str:
    """What went wrong in a round, for a progress line; '' when nothing was dropped or rejected.

    ``"round 3: 4 rejected — missing arrays: conv1.weight…"``: the counts come from the round
    record, the reason is the most common one among ``failures`` (its dropped and rejected
    updates), cut to ``limit`` characters.
    """
    counts = [
        f"{n} {status}"
        for n, status in (
            (latest.num_rejected, UPDATE_REJECTED),
            (latest.num_dropped, UPDATE_DROPPED),
        )
        if n
    ]
    if not counts:
        return ""
    reason = common_reason(failures, limit=limit)
    return f"round {latest.round}: {', '.join(counts)}" + ("" if reason == "-" else f" — {reason}")


def _reply_seconds(update: UpdateRecord) -> str:
    """Wall seconds from dispatch to arrival with one decimal, or '-' when nothing arrived."""
    if update.arrived_at is None:
        return "-"
    return _fixed((update.arrived_at - update.dispatched_at).total_seconds())


def _counts(applied: int, dropped: int, rejected: int) -> str:
    """Update counts in one cell, in ``COUNTS``' order: 2/0/1."""
    return f"{applied}/{dropped}/{rejected}"


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
