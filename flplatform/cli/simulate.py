"""``flplatform simulate``: run a simulated federation, or a sweep of them.

Parse and validate everything first (a bad value costs no start-up), open the ledger,
start Flower's simulation, and follow the run through the ledger the ServerApp writes.
Comma-separated values of the sweepable options (``flplatform.app.sweep.SWEEPABLE``) run a
sweep: every combination a run of its own, all in one Flower start-up.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, NamedTuple

import typer
from rich.text import Text

from clients.catalog import BUILTIN_DATASETS, MODELS
from flplatform.app.config import DEFAULT_SITES, SKETCHED, RunConfig, as_site_names
from flplatform.app.sweep import SWEEPABLE, Sweep, expand_values
from flplatform.cli.errors import handles_errors
from flplatform.cli.history import rounds as show_rounds
from flplatform.cli.history import shown_accuracy
from flplatform.cli.history import sites as show_sites
from flplatform.cli.options import config_values, table_options
from flplatform.cli.progress import (
    db_argument,
    follow_sweep,
    round_progress,
    say_run_done,
)
from flplatform.cli.render import Column, OutputFormat, emit, make_console
from flplatform.cli.tracking import (
    ExperimentOption,
    MlflowOption,
    TensorboardOption,
    check_folder,
    check_stores,
    export_to,
    exporting,
    live_export,
)
from flplatform.core.errors import ConfigError, FLPlatformError
from flplatform.launch.simulation import check_ledger, ledger_url, run_simulation
from storage import RunRecord
from storage.session import normalize_db_url

console = make_console()


def site_names(sites: str) -> tuple[str, ...]:
    """``--sites 4`` (the first 4 default names, then site-5, ...) or ``--sites a,b,c``."""
    return as_site_names("--sites", sites)


def run_and_follow(config: RunConfig, tracking: Tracking | None = None) -> RunRecord:
    """Run with a live progress display (and live export to ``tracking``'s stores), then
    print the round and site tables."""
    sync = config.sync if config.sync in ("sync", "async") else f"{config.sync}, K={config.sync_k}"
    if config.strategy == "delayed":
        sync = f"D={config.delay}{'' if config.compensation else ', no compensation'}"
    network = f" on the {config.network} network" if config.network else ""
    console.print(
        f"Simulating {config.num_sites} sites ({', '.join(config.sites)}){network}, "
        f"{config.num_server_rounds} rounds of {config.strategy} ({sync}) on {config.dataset} "
        f"({config.partition}{f' α={config.alpha}' if config.partition == 'dirichlet' else ''}, "
        f"{config.model})"
    )
    url = ledger_url(config)
    with (
        live_export(url, *(tracking or Tracking())) as live,
        round_progress(console, config.num_server_rounds) as show,
    ):
        record = run_simulation(config, on_progress=exporting(show, live))
    db = config.db or None
    console.print()
    show_rounds(str(record.id), db=url, fmt=OutputFormat.table)
    show_sites(str(record.id), db=url, fmt=OutputFormat.table)
    say_run_done(console, record, url, db)
    return record


class Tracking(NamedTuple):
    """Where a run is logged as it trains: ``--mlflow``, ``--tensorboard``, ``--experiment``."""

    mlflow: str | None = None
    tensorboard: Path | None = None
    experiment: str = "flplatform"


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
    mlflow: MlflowOption = None,
    tensorboard: TensorboardOption = None,
    experiment: ExperimentOption = "flplatform",
    **options: Any,
) -> None:
    """Run a simulated federation and record every round in the ledger; with lists, a
    sweep of runs in one start-up."""
    tracking = Tracking(mlflow, tensorboard, experiment)
    check_folder(tensorboard)
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
        run_and_follow(config, tracking)
        return
    sweep = expand_values(values, swept)
    checked: set[tuple[Any, ...]] = set()
    for member in sweep.members:  # each distinct data and model, once
        what = (member.dataset, member.partition, member.seed, member.model, member.strategy)
        if what not in checked or member.strategy in SKETCHED:
            checked.add(what)
            _check_dataset(member)
    check_ledger(sweep.members[0])
    run_sweep_and_follow(sweep, db, tracking)


def listed_values(key: str, value: Any) -> list[str]:
    """The comma-separated values of a sweepable option, each stripped; none empty."""
    items = [item.strip() for item in str(value).split(",")]
    if not all(items):
        raise ConfigError(
            f"--{key} {value!r} lists an empty value; give one value or several, "
            "comma-separated (e.g. --seed 0,1,2)"
        )
    return items


def run_sweep_and_follow(
    sweep: Sweep, db: str | None, tracking: Tracking | None = None
) -> list[RunRecord]:
    """Say what runs and what cannot, run the sweep with a line per run, then the table;
    then write its runs to ``tracking``'s stores (after the sweep: its runs follow each
    other in one start-up)."""
    members = sweep.members
    if tracking is not None and (tracking.mlflow or tracking.tensorboard):
        check_stores(ledger_url(members[0]), *tracking)
    else:
        tracking = None
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
    records, failed = follow_sweep(console, members)
    show_sweep(members, records, db)
    if tracking is not None:
        ended = [record.id for record in records if record is not None]
        try:
            export_to(ledger_url(members[0]), ended, *tracking)
        except FLPlatformError as exc:  # the sweep's own outcome is what the command says
            console.print(
                Text(
                    f"warning: the export to MLflow/TensorBoard failed: {exc}; write the runs "
                    "afterwards with flplatform history export",
                    style="yellow",
                )
            )
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
