"""``flplatform plot RUN ...``: the accuracy curves of any runs in one PNG, read from the ledger."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from flplatform.app.comparison import RunSummary, plot_runs, summarize_runs
from flplatform.cli.errors import handles_errors
from flplatform.cli.history import DbOption, RunsArgument, read_ledger, resolve_run
from flplatform.cli.render import make_console

console = make_console()


class XAxis(StrEnum):
    """``--x`` choices: ``flplatform.app.comparison.X_AXES``."""

    simulated_time = "simulated-time"
    rounds = "rounds"
    bytes = "bytes"


AXIS_TITLES = {
    XAxis.simulated_time: "time",
    XAxis.rounds: "round",
    XAxis.bytes: "bytes uploaded",
}


@handles_errors
def plot(
    selected: RunsArgument,
    out: Annotated[Path, typer.Option("--out", "-o", help="The PNG file to write.")],
    x: Annotated[
        XAxis,
        typer.Option(
            "--x",
            help="Accuracy against: simulated-time (seconds; the wall clock's when no run "
            "simulated a network), rounds (server steps) or bytes (training bytes up, MiB).",
        ),
    ] = XAxis.simulated_time,
    target: Annotated[
        float | None,
        typer.Option(help="Draw this accuracy, in (0, 1], as a dashed line."),
    ] = None,
    title: Annotated[
        str | None, typer.Option(help="The plot's title (default: names the runs).")
    ] = None,
    db: DbOption = None,
) -> None:
    """Plot the accuracy of each run (the server's, else the sites') in one PNG.

    Each run gets its own colour, line style and marker, and the legend sits beside the
    axes. `flplatform history compare` gives the same runs' numbers.
    """
    with read_ledger(db) as repository:
        run_ids = [resolve_run(repository, run) for run in selected]
        # The target only draws a line here; 1.0 is a valid one when none is given.
        summaries = summarize_runs(repository, run_ids, target=1.0 if target is None else target)
    path = plot_runs(
        summaries, out, x=x.value, title=title or default_title(summaries, x), target=target
    )
    console.print(Text.assemble("Plot: ", (str(path), "bold")))


def default_title(summaries: list[RunSummary], x: XAxis) -> str:
    """'Accuracy by round: runs 3, 4, 5'."""
    runs = ", ".join(str(s.run_id) for s in summaries)
    return f"Accuracy by {AXIS_TITLES[x]}: run{'s' if len(summaries) > 1 else ''} {runs}"
