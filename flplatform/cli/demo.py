"""``flplatform demo cross-silo``: the platform's story in three panels and one start-up.

The panels are data (``flplatform.app.demo``); this module runs every panel's runs in one
sweep (one Flower start-up), then prints one summary table (per panel: which run reached
the target first, and by how much against the method it claims to beat) and writes one
plot per panel. Everything printed is read back from the ledger.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from flplatform.app.comparison import RunSummary, plot_runs, summarize_runs
from flplatform.app.demo import BYTES, PANEL_KEYS, Panel, Row, Verdict, build_panels, judge
from flplatform.app.demo import sweep_members as demo_members
from flplatform.cli.errors import handles_errors
from flplatform.cli.progress import db_argument, display_url, follow_sweep
from flplatform.cli.render import human_bytes, make_console
from flplatform.cli.simulate import ledger_option
from flplatform.cli.tracking import (
    MlflowOption,
    TensorboardOption,
    check_folder,
    check_stores,
    export_to,
)
from flplatform.core.errors import FLPlatformError
from flplatform.launch.flower import work_home
from flplatform.launch.simulation import check_ledger
from storage import LedgerRepository, RunRecord

console = make_console()
demo_app = typer.Typer(help="Ready-made demonstrations.")


@demo_app.command("cross-silo")
@handles_errors
def cross_silo(
    seed: Annotated[int, typer.Option(help="Seed of every random choice.")] = 0,
    panels: Annotated[
        str, typer.Option(help=f"Comma-separated panels to run: {', '.join(PANEL_KEYS)}.")
    ] = ",".join(PANEL_KEYS),
    max_rounds: Annotated[
        int | None,
        typer.Option(help="Cap every run's rounds (a quick look; targets may go unreached)."),
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Directory for the plots (default: .flplatform/demo).")
    ] = None,
    db: Annotated[str | None, typer.Option(help="SQLAlchemy URL of the ledger.")] = None,
    mlflow: MlflowOption = None,
    tensorboard: TensorboardOption = None,
) -> None:
    """Four sites on the world map, three panels: each method where it should win.

    London, Ohio, California and Tokyo, non-IID digits. The panels: straggler-tolerant
    synchrony, delayed updates and compressed uploads, each on a setting where its method
    should win; one summary table and one plot per panel; with --mlflow or --tensorboard,
    each panel's runs side by side there too."""
    check_folder(out, "--out")
    check_folder(tensorboard)
    keys = tuple(key.strip() for key in panels.split(",") if key.strip())
    chosen = build_panels(seed=seed, db=ledger_option(db), keys=keys, max_rounds=max_rounds)
    members = demo_members(chosen)
    url = check_ledger(members[0])
    if mlflow is not None or tensorboard is not None:
        # checked on the first panel's experiment: the check creates the one it names
        check_stores(url, mlflow, tensorboard, demo_experiment(chosen[0]))
    first = members[0]
    console.print(
        f"The cross-silo demo: {len(members)} runs in {len(chosen)} panels, {first.num_sites} "
        f"sites ({', '.join(first.sites)}), {first.dataset} split non-IID "
        f"(Dirichlet α={first.alpha:g}), seed {seed}, in one Flower start-up."
    )
    for panel in chosen:
        console.print(Text(f"  {panel.title}; {panel.setting}"))
    records, failed = follow_sweep(console, members)
    verdicts, summaries = _read_back(chosen, records, url)
    console.print()
    console.print(summary_table(verdicts))
    console.print()
    for verdict in verdicts:
        console.print(Text(f"{verdict.panel.key}: {headline(verdict)}"))
    out_dir = out or work_home() / "demo"
    paths = [
        plot_runs(
            summaries[verdict.panel.key],
            out_dir / f"{verdict.panel.key}.png",
            x=verdict.panel.x,
            title=f"{verdict.panel.title}\n{verdict.panel.setting}",
            target=verdict.panel.target,
        )
        for verdict in verdicts
    ]
    console.print(Text.assemble("Plots: ", Text(", ").join(Text(str(p), "bold") for p in paths)))
    ids = " ".join(str(r.id) for r in records if r is not None)
    console.print(
        Text.assemble(
            "Ledger: ",
            (display_url(url), "bold"),
            f"; side by side: flplatform history compare {ids}{db_argument(db)}",
        )
    )
    if mlflow is not None or tensorboard is not None:
        by_name = {r.name: r.id for r in records if r is not None}
        for panel in chosen:  # a panel's runs side by side: an experiment (folder) each
            run_ids = [by_name[m.run_name] for m in panel.members if m.run_name in by_name]
            board = tensorboard / panel.key if tensorboard is not None else None
            try:
                export_to(url, run_ids, mlflow, board, demo_experiment(panel), force=True)
            except FLPlatformError as exc:  # the demo's own outcome is what it says
                console.print(Text(f"warning: {panel.key}'s export failed: {exc}", style="yellow"))
    if failed is not None:
        raise failed


def demo_experiment(panel: Panel) -> str:
    """The MLflow experiment a panel's runs go to."""
    return f"cross-silo demo: {panel.key}"


def _read_back(
    panels: Sequence[Panel], records: Sequence[RunRecord | None], url: str
) -> tuple[list[Verdict], dict[str, list[RunSummary]]]:
    """Each panel's runs summarised at its target, and its verdict, from the ledger."""
    ids = {r.name: r.id for r in records if r is not None}
    verdicts = []
    summaries: dict[str, list[RunSummary]] = {}
    with LedgerRepository.open(url) as repository:
        for panel in panels:
            run_ids = [ids[m.run_name] for m in panel.members if m.run_name in ids]
            if panel.reference not in ids:
                console.print(Text(f"{panel.key}: its reference run did not start; no verdict"))
                continue
            read = summarize_runs(repository, run_ids, target=panel.target)
            summaries[panel.key] = read
            verdicts.append(judge(panel, read))
    return verdicts, summaries


# ================================================================ the summary
def summary_table(verdicts: Sequence[Verdict]) -> Table:
    """One table, a section per panel: each run's cost to the target, its ratio to the
    panel's reference, and what it spent in all; the winner in bold."""
    out = Table(
        title=Text("The demo's runs: what each took to reach its panel's target", "table.title"),
        title_justify="left",
        header_style="bold",
    )
    out.add_column("run")
    for column in ("to target", "vs reference", "in all", "final acc", "id"):
        out.add_column(column, justify="right")
    for verdict in verdicts:
        panel = verdict.panel
        what = "bytes up" if panel.measure == BYTES else "simulated s"
        out.add_section()
        out.add_row(Text(f"{panel.key}: {what} to {panel.target:.0%}", style="bold underline"))
        for row in verdict.rows:
            style = "bold" if row is verdict.winner else ""
            cells = (
                _label(row),
                _cost(panel, row.cost) if row.cost is not None else "not reached",
                _versus(panel, row, verdict),
                _cost(panel, row.budget),
                "-" if row.final_accuracy is None else f"{row.final_accuracy:.3f}",
                str(row.run_id),
            )
            out.add_row(*(Text(cell, style=style) for cell in cells))
    return out


def headline(verdict: Verdict) -> str:
    """What the panel shows in one sentence, with its numbers."""
    panel, winner, reference = verdict.panel, verdict.winner, verdict.reference
    target = f"{panel.target:.0%}"
    if winner is None:
        return f"no run reached {target}; see the plot."
    said = f"{_label(winner)} reached {target} first ({_cost(panel, winner.cost)})"
    if winner is reference:
        said += ": no other method beat it here"
    elif verdict.factor is not None:
        better = "fewer bytes" if panel.measure == BYTES else "sooner"
        said += (
            f", {verdict.factor:.1f}× {better} than {_label(reference)} "
            f"({_cost(panel, reference.cost)})"
        )
    else:
        said += f"; {_label(reference)} did not reach it ({_cost(panel, reference.budget)} in all)"
    others = [r for r in verdict.not_reached if r is not reference]
    if others:
        said += "; not reached: " + ", ".join(
            f"{_label(r)} ({_cost(panel, r.budget)} in all)" for r in others
        )
    return said + f". {panel.note}."


def _label(row: Row) -> str:
    """A run's name without its panel's prefix (the table's section says the panel)."""
    prefix = f"{row.panel}: "
    return row.name[len(prefix) :] if row.name.startswith(prefix) else row.name


def _cost(panel: Panel, value: float | None) -> str:
    if value is None:
        return "-"
    return human_bytes(value) if panel.measure == BYTES else f"{value:.1f} s"


def _versus(panel: Panel, row: Row, verdict: Verdict) -> str:
    if row is verdict.reference:
        return "reference"
    if row.versus_reference is None:
        return "-"
    return f"{row.versus_reference:.1f}× " + ("fewer" if panel.measure == BYTES else "sooner")
