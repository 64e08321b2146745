"""The live round display that ``simulate`` and ``run`` share while they follow a run."""

from __future__ import annotations

import shlex
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from flplatform.app.config import RunConfig
from flplatform.cli.history import failure_note, shown_accuracy
from flplatform.cli.render import human_bytes
from flplatform.launch.simulation import ProgressCallback, SweepFailed, SweepProgress, run_sweep
from storage import RUN_FAILED, RoundRecord, RunRecord, UpdateRecord
from storage.session import mask_db_url, split_password, sqlite_file


class StatusColumn(ProgressColumn):
    """A task's ``status`` field, shown as given: never read as markup.

    Rich's ``TextColumn`` parses its text as markup (and emoji codes), and a status quotes
    remote errors; a ``Text`` status keeps the styles we gave it.
    """

    def render(self, task: Task) -> Text:
        status = task.fields.get("status", "")
        return status if isinstance(status, Text) else Text(str(status))


@contextmanager
def round_progress(console: Console, total: int | None) -> Iterator[ProgressCallback]:
    """A progress bar over the run's rounds (total None: unknown until the run says).

    Each finished round shows the accuracy, the bytes so far (training and federated
    evaluation) and, when the latest round dropped or rejected updates, why. A warning the
    run records while it runs (training diverged, with its likely fix) is printed above the
    bar as soon as its round is shown.
    """
    progress = Progress(
        TextColumn("[bold]rounds"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        StatusColumn(),
        console=console,
    )
    task = progress.add_task("rounds", total=total, status="starting Flower…")
    warned: set[str] = set()

    def show(
        record: RunRecord | None, done: list[RoundRecord], failures: list[UpdateRecord]
    ) -> None:
        if record is None:
            return
        # A failed run's error is its reason, which the command prints as it fails.
        if record.error and record.status != RUN_FAILED and record.error not in warned:
            warned.add(record.error)
            progress.console.print(Text(f"warning: {record.error}", style="yellow"))
        if record.num_rounds_planned:
            progress.update(task, total=record.num_rounds_planned)
        if not done:
            progress.update(task, status="sites joining…")
            return
        label, accuracy = shown_accuracy(done[-1].metrics)
        up = human_bytes(sum(r.bytes_up + r.eval_bytes_up for r in done))
        down = human_bytes(sum(r.bytes_down + r.eval_bytes_down for r in done))
        status = (f"{label} {accuracy:.4f}  " if accuracy is not None else "") + (
            f"up {up}  down {down}"
        )
        progress.update(
            task, completed=len(done), status=Text(status) + failure_suffix(done, failures)
        )

    with progress:
        yield show


def failure_suffix(done: list[RoundRecord], failures: list[UpdateRecord]) -> Text:
    """The latest round's drops and rejections with their reason, for a progress line."""
    note = failure_note(done[-1], failures)
    return Text.assemble("  ", (note, "yellow")) if note else Text()


def display_url(url: str) -> str:
    """A ledger URL as a user reads it: a SQLite file as its path, a password masked.

    The path as the user gave it: a URL percent-encodes ``[`` and ``%`` in it.
    """
    path = sqlite_file(url)
    return str(path) if path is not None else mask_db_url(url)


def db_argument(db: str | None) -> str:
    """`` --db URL`` to repeat in a suggested command (quoted for the shell), or ''.

    The URL is shown without its password: the command finds it where PostgreSQL's client
    looks (``PGPASSWORD``, ``~/.pgpass``).
    """
    return f" --db {shlex.quote(split_password(db)[0])}" if db else ""


def say_run_done(
    console: Console, record: RunRecord, url: str, db: str | None, *, wall: bool = True
) -> None:
    """The last lines of a run command: how the run ended, where it is, how to see it again.

    ``url``: the ledger's (shown masked); ``db``: the ``--db`` the user gave (repeated in the
    suggested command); ``wall``: say how long the command's run took (not for a resume,
    whose run began earlier).
    """
    took = f" in {record.wall_seconds or 0:.1f} s" if wall else ""
    simulated = (
        f" ({record.simulated_seconds:.1f} s simulated)"
        if record.simulated_seconds is not None
        else ""
    )
    console.print(
        Text.assemble(
            f"\nRun {record.id} {record.status}{took}{simulated}; ledger: ",
            (display_url(url), "bold"),
            f"\nSee it again with: flplatform history rounds {record.id}{db_argument(db)}",
        )
    )


@contextmanager
def sweep_progress(console: Console, members: Sequence[RunConfig]) -> Iterator[SweepProgress]:
    """One line per run of a sweep: its name, a bar over its rounds, its accuracy and clock.

    Every run's line is there from the start ("waiting"), so a reader sees what is to come.
    """
    width = max(len(member.run_name) for member in members)
    progress = Progress(
        TextColumn("{task.description}", style="bold", markup=False),
        BarColumn(bar_width=12),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        StatusColumn(),
        console=console,
    )
    tasks = [
        progress.add_task(
            f"{member.run_name:<{width}}",
            total=member.num_server_rounds,
            status="waiting",
            start=False,
        )
        for member in members
    ]

    def show(
        index: int, record: RunRecord | None, done: list[RoundRecord], failures: list[UpdateRecord]
    ) -> None:
        task = tasks[index]
        if record is None:
            return
        progress.start_task(task)
        if not done:
            progress.update(task, status="sites joining…")
            return
        label, accuracy = shown_accuracy(done[-1].metrics)
        simulated = done[-1].virtual_finished_at
        status = f"{label} {accuracy:.3f}" if accuracy is not None else ""
        if simulated is not None:
            status += f", {simulated:.1f} s simulated"
        if record.status not in ("running", "finished"):
            status += f"  {record.status}"
        progress.update(
            task, completed=len(done), status=Text(status) + failure_suffix(done, failures)
        )

    with progress:
        yield show


def follow_sweep(
    console: Console, members: Sequence[RunConfig]
) -> tuple[list[RunRecord | None], SweepFailed | None]:
    """Run ``members`` in one sweep with a progress line each; every run's record (None for
    one that never started) and the failure, if some run did not finish (the others did:
    show them, then raise it)."""
    with sweep_progress(console, members) as show:
        try:
            return list(run_sweep(members, on_progress=show)), None
        except SweepFailed as exc:
            return list(exc.records), exc
