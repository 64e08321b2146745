"""The live round display that ``simulate`` and ``run`` share while they follow a run."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from flplatform.cli.history import failure_note, shown_accuracy
from flplatform.cli.render import human_bytes
from flplatform.simulation import ProgressCallback
from storage import RUN_FAILED, RoundRecord, RunRecord, UpdateRecord


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
        TextColumn("{task.fields[status]}"),
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
        progress.update(task, completed=len(done), status=status + failure_suffix(done, failures))

    with progress:
        yield show


def failure_suffix(done: list[RoundRecord], failures: list[UpdateRecord]) -> str:
    """The latest round's drops and rejections with their reason, for a progress line.

    Escaped: reasons quote remote errors, whose brackets rich would read as markup.
    """
    note = failure_note(done[-1], failures)
    return f"  [yellow]{escape(note)}[/]" if note else ""


def display_url(url: str) -> str:
    """A ledger URL as a user reads it: a SQLite file as its path."""
    return url.removeprefix("sqlite:///")
