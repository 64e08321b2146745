"""``flplatform simulate`` and ``flplatform demo cross-silo``: run a simulated federation.

Parse and validate everything first (a bad value costs no start-up), open the ledger,
start Flower's simulation, and follow the run through the ledger the ServerApp writes.
Comma-separated values of the sweepable options (``flplatform.sweep.SWEEPABLE``) run a
sweep: every combination a run of its own, all in one Flower start-up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from clients.catalog import BUILTIN_DATASETS, MODELS
from flplatform.cli.errors import handles_errors
from flplatform.cli.history import rounds as show_rounds
from flplatform.cli.history import shown_accuracy
from flplatform.cli.history import sites as show_sites
from flplatform.cli.options import config_values, table_options
from flplatform.cli.progress import (
    StatusColumn,
    db_argument,
    display_url,
    failure_suffix,
    round_progress,
    say_run_done,
)
from flplatform.cli.render import Column, OutputFormat, emit, human_bytes, make_console
from flplatform.comparison import (
    DEMO_MODES,
    ModePlan,
    RunSummary,
    plan_config,
    plan_modes,
    plot_runs,
    run_comparison,
    summarize_runs,
)
from flplatform.config import DEFAULT_SITES, SKETCHED, RunConfig
from flplatform.errors import ConfigError
from flplatform.simulation import (
    SweepFailed,
    check_ledger,
    ledger_url,
    run_simulation,
    run_sweep,
    work_home,
)
from flplatform.sweep import SWEEPABLE, Sweep, expand_values
from storage import LedgerRepository, RoundRecord, RunRecord, UpdateRecord
from storage.session import normalize_db_url

console = make_console()


def site_names(sites: str) -> tuple[str, ...]:
    """``--sites 4`` (the first 4 default names, then site-5, ...) or ``--sites a,b,c``."""
    text = sites.strip()
    if text.isdigit():
        count = int(text)
        if count <= 0:
            raise ConfigError(f"--sites must be a positive count or a list of names, got {sites}")
        return tuple(
            DEFAULT_SITES[i] if i < len(DEFAULT_SITES) else f"site-{i + 1}" for i in range(count)
        )
    if text.lstrip("-").isdigit():
        raise ConfigError(f"--sites must be a positive count or a list of names, got {sites}")
    return tuple(name.strip() for name in text.split(",") if name.strip())


def run_and_follow(config: RunConfig) -> RunRecord:
    """Run with a live progress display, then print the round and site tables."""
    sync = config.sync if config.sync in ("sync", "async") else f"{config.sync}, K={config.k}"
    if config.strategy == "delayed":
        sync = f"D={config.delay}{'' if config.compensation else ', no compensation'}"
    network = f" on the {config.network} network" if config.network else ""
    console.print(
        f"Simulating {config.num_sites} sites ({', '.join(config.sites)}){network}, "
        f"{config.num_server_rounds} rounds of {config.strategy} ({sync}) on {config.dataset} "
        f"({config.partition}{f' α={config.alpha}' if config.partition == 'dirichlet' else ''}, "
        f"{config.model})"
    )
    with round_progress(console, config.num_server_rounds) as show:
        record = run_simulation(config, on_progress=show)
    db = config.db or None
    console.print()
    url = ledger_url(config)
    show_rounds(str(record.id), db=url, fmt=OutputFormat.table)
    show_sites(str(record.id), db=url, fmt=OutputFormat.table)
    say_run_done(console, record, url, db)
    return record


def ledger_option(db: str | None) -> str:
    """``--db`` as RunConfig's ``db``: '' (the default ledger) only when it was not given.

    An empty ``--db`` (an unset shell variable, say) is refused here in one line rather
    than taken for the default ledger.
    """
    if db is None:
        return ""
    normalize_db_url(db)  # raises StorageError for an empty or malformed URL
    return db


# ================================================================ commands
Sites = Annotated[
    str | None,
    typer.Option(help="Number of sites, or comma-separated names (default 4, or the split's)."),
]


@handles_errors
@table_options(listed=SWEEPABLE)
def simulate(
    sites: Sites = None,
    db: Annotated[str | None, typer.Option(help="SQLAlchemy URL of the ledger.")] = None,
    **options: Any,
) -> None:
    """Run a simulated federation and record every round in the ledger; with lists, a
    sweep of runs in one start-up."""
    values = config_values(options)
    lists = {key: listed_values(key, values[key]) for key in SWEEPABLE}
    values.update({key: items[0] for key, items in lists.items() if len(items) == 1})
    dataset, partition = values["dataset"], values["partition"]
    if dataset.endswith(".npz") or (partition == "files" and dataset not in BUILTIN_DATASETS):
        values["dataset"] = str(
            Path(dataset).expanduser().resolve()
        )  # the ServerApp runs elsewhere
    values["network"] = network_spec(values["network"])
    if values["local-steps"] > 0:
        values["local-epochs"] = 0
    values["sites"] = site_names(sites) if sites else _default_sites(partition, dataset)
    values["db"] = ledger_option(db)
    swept = {key: items for key, items in lists.items() if len(items) > 1}
    if not swept:
        config = RunConfig.from_mapping(values)
        _check_dataset(config)
        check_ledger(config)
        run_and_follow(config)
        return
    sweep = expand_values(values, swept)
    checked: set[tuple[Any, ...]] = set()
    for member in sweep.members:  # each distinct data and model, once
        what = (member.dataset, member.partition, member.seed, member.model, member.strategy)
        if what not in checked or member.strategy in SKETCHED:
            checked.add(what)
            _check_dataset(member)
    check_ledger(sweep.members[0])
    run_sweep_and_follow(sweep, db)


def listed_values(key: str, value: Any) -> list[str]:
    """The comma-separated values of a sweepable option, each stripped; none empty."""
    items = [item.strip() for item in str(value).split(",")]
    if not all(items):
        raise ConfigError(
            f"--{key} {value!r} lists an empty value; give one value or several, "
            "comma-separated (e.g. --seed 0,1,2)"
        )
    return items


def run_sweep_and_follow(sweep: Sweep, db: str | None) -> list[RunRecord]:
    """Say what runs and what cannot, run the sweep with a line per run, then the table."""
    members = sweep.members
    first = members[0]
    network = f" on the {first.network} network" if first.network else ""
    console.print(
        f"Sweep of {len(members)} runs on {first.num_sites} sites "
        f"({', '.join(first.sites)}){network}, in one Flower start-up:"
    )
    for index, member in enumerate(members, start=1):
        console.print(Text(f"  {index}. {member.run_name}"))
    if sweep.skipped:
        console.print(f"Skipped {len(sweep.skipped)} combinations that cannot run:")
        for chosen, reason in sweep.skipped:
            said = " ".join(f"{key}={value}" for key, value in chosen.items())
            console.print(Text(f"  {said}: {reason}"))
    width = max(len(member.run_name) for member in members)
    progress = Progress(
        TextColumn("{task.description}", style="bold", markup=False),
        BarColumn(),
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
        status = f"{label} {accuracy:.4f}" if accuracy is not None else ""
        if simulated is not None:
            status += f"  simulated {simulated:.1f} s"
        if record.status != "running":
            status += f"  {record.status}"
        progress.update(
            task, completed=len(done), status=Text(status) + failure_suffix(done, failures)
        )

    failed: SweepFailed | None = None
    with progress:
        try:
            records: list[RunRecord | None] = list(run_sweep(members, on_progress=show))
        except SweepFailed as exc:
            failed, records = exc, exc.records
    show_sweep(members, records, db)
    if failed is not None:
        raise failed
    return [record for record in records if record is not None]


def show_sweep(
    members: Sequence[RunConfig], records: Sequence[RunRecord | None], db: str | None
) -> None:
    """One row per run of a sweep, and how to compare them."""
    rows: list[list[Any]] = []
    for member, record in zip(members, records, strict=True):
        if record is None:
            rows.append(["-", member.run_name, "not started", None, None, 0])
            continue
        _, accuracy = shown_accuracy(record.final_metrics or record.last_metrics)
        rows.append(
            [
                record.id,
                record.name,
                record.status,
                accuracy,
                record.simulated_seconds,
                record.rounds_completed,
            ]
        )
    console.print()
    emit(
        console,
        OutputFormat.table,
        title="Sweep",
        records=[],
        columns=[
            "run",
            Column("name", text=True),
            "status",
            "final acc",
            "sim s",
            "rounds",
        ],
        rows=rows,
    )
    ids = " ".join(str(record.id) for record in records if record is not None)
    if ids:
        console.print(Text(f"Compare them with: flplatform history compare {ids}{db_argument(db)}"))


def network_spec(network: str) -> str:
    """A preset name as is; a profile file as an absolute path (the ServerApp runs elsewhere)."""
    text = network.strip()
    if text.endswith(".toml") or "/" in text or Path(text).is_file():
        return str(Path(text).expanduser().resolve())
    return text


def _default_sites(partition: str, dataset: str) -> tuple[str, ...]:
    if partition == "files" and dataset not in BUILTIN_DATASETS:
        from clients.site_files import read_manifest

        return tuple(s.name for s in read_manifest(dataset).sites)
    return DEFAULT_SITES


def _check_dataset(config: RunConfig) -> None:
    """Load the data here once, so a missing or malformed file is one clear line now."""
    from clients.datasets import load_dataset  # imports numpy only when needed
    from clients.site_files import read_manifest

    if config.partition == "files":
        manifest = read_manifest(config.dataset)
        names = {s.name for s in manifest.sites}
        missing = [s for s in config.sites if s not in names]
        if missing:
            raise ConfigError(
                f"no file for site(s) {', '.join(missing)} in {config.dataset}; "
                f"it holds: {', '.join(sorted(names))}"
            )
        input_shape, num_classes = tuple(manifest.input_shape), manifest.num_classes
    else:
        dataset = load_dataset(config.dataset, seed=config.seed)
        if len(dataset.y_train) < config.num_sites:
            raise ConfigError(
                f"{config.dataset} has {len(dataset.y_train)} training examples, fewer than "
                f"the {config.num_sites} sites"
            )
        input_shape, num_classes = tuple(dataset.input_shape), dataset.num_classes
    if config.strategy in SKETCHED:
        check_top_k(config, input_shape=input_shape, num_classes=num_classes)


def check_top_k(config: RunConfig, *, input_shape: tuple[int, ...], num_classes: int) -> None:
    """A sketched strategy's k against the model's size, now rather than in the ServerApp."""
    from clients.models import build_model, count_parameters

    def size_of(name: str) -> int:
        return count_parameters(
            build_model(name, input_shape=input_shape, num_classes=num_classes, seed=0)
        )

    size = size_of(config.model)
    if config.k <= size:
        return
    larger = [name for name in MODELS if name != config.model and size_of(name) >= config.k]
    hint = f" or a model with at least k parameters ({', '.join(larger)})" if larger else ""
    raise ConfigError(
        f"--k {config.k} exceeds the {size} parameters of model '{config.model}' on "
        f"{config.dataset}; choose k <= {size}{hint}"
    )


demo_app = typer.Typer(help="Ready-made demonstrations.")


@demo_app.command("cross-silo")
@handles_errors
def cross_silo(
    rounds: Annotated[
        int, typer.Option(help="Fully-sync rounds; every mode gets as many site updates.")
    ] = 15,
    k: Annotated[int, typer.Option("--k", help="K of the K modes.")] = 2,
    modes: Annotated[
        str,
        typer.Option(
            help="Comma-separated rows: sync modes, delayed, and the optional topk, int8, "
            "fetchsgd, sketched-sgd (compressed uploads)."
        ),
    ] = ",".join(DEMO_MODES),
    delay: Annotated[int, typer.Option(help="D of the delayed-updates row.")] = 2,
    network: Annotated[str, typer.Option(help="Network preset or .toml profile.")] = "world",
    target: Annotated[
        float, typer.Option(help="Accuracy whose simulated time-to-reach is reported.")
    ] = 0.9,
    seed: Annotated[int, typer.Option(help="Seed of every random choice.")] = 0,
    out: Annotated[
        Path | None, typer.Option(help="Directory for the plots (default: .flplatform/demo).")
    ] = None,
    db: Annotated[str | None, typer.Option(help="SQLAlchemy URL of the ledger.")] = None,
) -> None:
    """Four sites on the world map (London, Ohio, California, Tokyo), non-IID digits:
    local-SGD averaging, delayed updates and the synchrony modes side by side in
    simulated time, with two plots."""
    if not 0.0 < target <= 1.0:
        raise ConfigError(f"--target is an accuracy in (0, 1], got {target}")
    base = RunConfig.from_mapping(
        _DEMO | {"seed": seed, "db": ledger_option(db), "network": network_spec(network)}
    )
    names = tuple(m.strip() for m in modes.split(",") if m.strip())
    plans = plan_modes(names, sites=base.num_sites, rounds=rounds, k=k, delay=delay)
    for plan in plans:  # every mode's configuration, before the first one runs for minutes
        plan_config(base, plan)
    check_ledger(base)
    console.print(
        f"Comparing {len(plans)} modes: {base.num_sites} sites "
        f"({', '.join(base.sites)}) on the {network} network, {base.dataset} "
        f"(dirichlet α={base.alpha}, {base.model}), {rounds * base.num_sites} site updates each"
    )
    run_ids = run_comparison(base, plans, run=_follow_mode)
    url = ledger_url(base)
    with LedgerRepository.open(url) as repository:
        summaries = summarize_runs(repository, run_ids, target=target)
    # The runs share one name: each is shown by its mode.
    results = [replace(s, name=p.label) for s, p in zip(summaries, plans, strict=True)]
    show_comparison(results, target=target)
    out_dir = out or work_home() / "demo"
    paths = [
        plot_runs(
            results,
            out_dir / f"accuracy_vs_{file_name}.png",
            x=x,
            title=f"{base.num_sites} sites, {network} network",
            target=target,
        )
        for x, file_name in (("simulated-time", "simulated_time"), ("rounds", "server_steps"))
    ]
    console.print(Text.assemble("Plots: ", Text(", ").join(Text(str(p), "bold") for p in paths)))
    console.print(
        Text.assemble(
            "Ledger: ",
            (display_url(url), "bold"),
            "; per site: flplatform history sites RUN" + db_argument(db),
        )
    )


def _follow_mode(config: RunConfig, plan: ModePlan) -> RunRecord:
    """Run one mode with a one-line progress bar."""
    progress = Progress(
        TextColumn(f"{plan.label:<24}", style="bold", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        StatusColumn(),
        console=console,
    )
    task = progress.add_task(plan.label, total=config.num_server_rounds, status="starting…")

    def show(
        record: RunRecord | None, done: list[RoundRecord], failures: list[UpdateRecord]
    ) -> None:
        if record is None or not done:
            return
        accuracy = done[-1].metrics.get("accuracy")
        simulated = done[-1].virtual_finished_at
        status = f"accuracy {accuracy:.4f}" if isinstance(accuracy, float) else ""
        if simulated is not None:
            status += f"  simulated {simulated:.1f} s"
        progress.update(
            task, completed=len(done), status=Text(status) + failure_suffix(done, failures)
        )

    with progress:
        return run_simulation(config, on_progress=show)


def show_comparison(results: list[RunSummary], *, target: float) -> None:
    """The comparison table: one row per mode."""
    table = Table(title=f"Modes (time to accuracy {target:g} in simulated seconds)")
    for column in (
        "mode",
        "final acc",
        "best acc",
        f"time to {target:g}",
        "simulated s",
        "steps",
        "bytes up",
        "bytes down",
        "bytes total",
        "mean staleness per site",
        "run",
    ):
        table.add_column(column)
    for r in results:
        table.add_row(
            r.name,
            _fmt(r.final_accuracy, "{:.4f}"),
            _fmt(r.best_accuracy, "{:.4f}"),
            _fmt(r.time_to_target, "{:.1f}") if r.time_to_target is not None else "not reached",
            _fmt(r.simulated_seconds, "{:.1f}"),
            str(r.rounds),
            human_bytes(r.bytes_up),
            human_bytes(r.bytes_down),
            human_bytes(r.bytes_up + r.bytes_down),
            " ".join(f"{site} {_fmt(value, '{:.2f}')}" for site, value in r.mean_staleness.items()),
            str(r.run_id),
        )
    console.print(table)


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


_DEMO: dict[str, Any] = {
    "strategy": "local-sgd",
    "sites": DEFAULT_SITES,
    "dataset": "digits",
    "partition": "dirichlet",
    "alpha": 0.5,
    "model": "mlp",
    "local-epochs": 2,
    "batch-size": 32,
    "lr": 0.1,
    "momentum": 0.9,
}
