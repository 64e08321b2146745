"""``flplatform server`` and ``flplatform site``: a federation across machines.

The server's administrator runs ``flplatform server`` with the deployment's certificates
and every site's public key; each site runs ``flplatform site NAME`` with the CA
certificate, its own private key and its own data file. flplatform/deploy/superlink.py
and flplatform/deploy/site.py say what runs where. Everything is checked before any
process starts.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text

from clients.catalog import BUILTIN_DATASETS
from flplatform.app.config import SKETCHED, RunConfig
from flplatform.cli.errors import handles_errors, stderr
from flplatform.cli.history import resolve_run
from flplatform.cli.history import rounds as show_rounds
from flplatform.cli.history import sites as show_sites
from flplatform.cli.options import config_values, table_options
from flplatform.cli.progress import round_progress, say_run_done
from flplatform.cli.render import OutputFormat, make_console
from flplatform.cli.resume import relaunched, reopen, resumable_config, resuming_line
from flplatform.cli.run import APP_OPTIONS
from flplatform.cli.simulate import check_top_k, ledger_option, network_spec
from flplatform.cli.tracking import (
    ExperimentOption,
    MlflowOption,
    TensorboardOption,
    check_folder,
    check_stores,
    exporting,
    live_export,
)
from flplatform.core.checkpoint import CheckpointError
from flplatform.core.errors import ConfigError, RunFailed, RunStopped
from flplatform.deploy.superlink import (
    DEFAULT_ADDRESS,
    DEFAULT_WAIT_SECONDS,
    DeployedRun,
    ServerPlan,
    plan_server,
    run_deployment,
)
from flplatform.launch.app_directory import (
    AppRun,
    RunOverrides,
    parse_run_config,
    plan_run,
    read_app,
)
from flplatform.launch.flower import model_dirs, project_dir, work_home
from flplatform.launch.simulation import check_ledger
from flplatform.run.ledger import owner_alive, process_owner
from flplatform.run.run_record import DEPLOYED_EVENT, LAUNCH_KEY, refuse_deployed
from storage import LedgerRepository, RunRecord
from storage.repository import checkpointed_rounds
from storage.session import detach_password

console = make_console()
# Seconds a killed server's ServerApp has to end before --resume calls the run alive.
OWNER_EXIT_SECONDS = 15.0

INSECURE_SERVER_WARNING = (
    "--insecure: no TLS and no site authentication. Anyone who can reach {address} can "
    "join this federation under any name and send it model updates, and everything "
    "between the sites and the server (models, metrics, the run's configuration) can be "
    "read and changed on the way. Use it only for a test on a network you trust."
)
INSECURE_SITE_WARNING = (
    "--insecure: no TLS. This site cannot tell the real server from another one, and "
    "what it sends (model updates computed from its data) can be read and changed on the "
    "way. Use it only for a test on a network you trust."
)
# -c keys the server sets itself.
_SET_BY_SERVER = {"sites": "--sites", "db": "--db", "run-tag": None, "resume-run": "--resume"}


def _warn(text: str) -> None:
    stderr.print(Text.assemble(("warning:", "bold yellow"), " ", text))


def _say(line: str) -> None:
    console.print(Text(line))


@handles_errors
@table_options(optional=True)
def server(
    sites: Annotated[
        str | None,
        typer.Option(
            help="The sites' names, comma-separated; each site's public key NAME.pub is in "
            "--certs, and only these sites can join (with --resume: the run's).",
            show_default=False,
        ),
    ] = None,
    certs: Annotated[
        Path | None,
        typer.Option(
            help="The deployment's directory: ca.crt, server.crt and server.key "
            "(`flplatform certs init`) and each site's NAME.pub (`flplatform certs site`)."
        ),
    ] = None,
    address: Annotated[
        str,
        typer.Option(
            help="HOST:PORT to listen on for the sites: they dial this port, at a name or "
            "address server.crt is valid for. 0.0.0.0 listens on every interface."
        ),
    ] = DEFAULT_ADDRESS,
    app_dir: Annotated[
        Path | None,
        typer.Option(
            "--app",
            help="Run your own Flower app directory instead of the built-in task; it takes "
            f"--{', --'.join(o.replace('_', '-') for o in APP_OPTIONS)} and -c.",
        ),
    ] = None,
    run_config: Annotated[
        list[str] | None,
        typer.Option(
            "--run-config",
            "-c",
            help="key=value of the run config (repeatable): the app's own keys with --app, "
            "else the built-in task's.",
        ),
    ] = None,
    db: Annotated[str | None, typer.Option(help="SQLAlchemy URL of the ledger.")] = None,
    wait_timeout: Annotated[
        float,
        typer.Option(
            help="Seconds to wait for every site to connect, and then, once the run has "
            "started, for each registered site to answer it (a silent one is left out "
            "after that)."
        ),
    ] = DEFAULT_WAIT_SECONDS,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="No TLS and no site authentication: anyone who reaches the address can "
            "join. For tests on a trusted network only.",
        ),
    ] = False,
    mlflow: MlflowOption = None,
    tensorboard: TensorboardOption = None,
    experiment: ExperimentOption = "flplatform",
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume",
            metavar="RUN",
            help="Continue a run of this deployment that died (its id, or 'latest': the "
            "newest deployed run not finished) from its last committed round, on its own "
            "sites and with its own options.",
        ),
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="With --resume: resume although the ledger says the run's process is "
            "alive on this machine (a process that took its pid after a reboot).",
        ),
    ] = False,
    **options: Any,
) -> None:
    """Run a federation across sites on other machines, recorded in the ledger.

    A SuperLink with TLS and site authentication, registered sites, and the run, recorded
    in the ledger by the sites' registered names. Stops every process at the end or on
    Ctrl-C."""
    if insecure:
        _warn(INSECURE_SERVER_WARNING.format(address=address))
    check_folder(tensorboard)
    given = {name: value for name, value in options.items() if value is not None}
    resumed = None
    if resume is not None:
        resumed = _resumed_config(resume, sites, app_dir, run_config or (), given, db)
        site_names: Sequence[str] = (
            resumed.sites if isinstance(resumed, RunConfig) else resumed.site_names
        )
    elif sites is None:
        raise ConfigError(
            "--sites is missing: the sites' names, comma-separated (each NAME.pub in --certs)"
        )
    else:
        site_names = sites.split(",")
    plan = plan_server(
        sites=site_names,
        certs_dir=certs,
        address=address,
        wait_timeout=wait_timeout,
        insecure=insecure,
    )
    tag = uuid.uuid4().hex
    if resumed is not None:
        if mlflow is not None or tensorboard is not None:  # before the run is reopened
            check_stores(_ledger_of(resumed), mlflow, tensorboard, experiment)
        run, follow, rounds, title = _resumed_run(resumed, plan, force=force)
    elif force:
        raise ConfigError("--force goes with --resume only")
    elif app_dir is not None:
        run, follow, rounds, title = _app_run(app_dir, plan, given, run_config or (), db, tag)
    else:
        run, follow, rounds, title = _builtin_run(plan, given, run_config or (), db, tag)
    console.print(Text(title))
    try:
        with (
            live_export(follow.db, mlflow, tensorboard, experiment) as live,
            round_progress(console, rounds) as show,
        ):
            record = run_deployment(
                plan, run, follow, home=work_home(), say=_say, on_progress=exporting(show, live)
            )
    except RunFailed as exc:
        if resumed is not None and not isinstance(exc, RunStopped):
            _fail_reopened(resumed, exc.reason)
        raise
    console.print()
    _finish(record, follow.db, db)


def _builtin_run(
    plan: ServerPlan, given: Mapping[str, Any], items: Sequence[str], db: str | None, tag: str
) -> tuple[DeployedRun, RunConfig, int, str]:
    """The built-in task's run config from the options and -c, checked."""
    values = config_values(given)
    if items:
        project = read_app(project_dir())
        for key, value in parse_run_config(project, items).items():
            if key in _SET_BY_SERVER:
                option = _SET_BY_SERVER[key]
                raise ConfigError(f"-c {key}: " + (f"use {option}" if option else "it is ours"))
            if key in values:
                raise ConfigError(f"-c {key} and its option both set '{key}': give one of them")
            values[key] = value
    dataset, partition = str(values.get("dataset", "")), str(values.get("partition", ""))
    if dataset.endswith(".npz") or (partition == "files" and dataset not in BUILTIN_DATASETS):
        # The ServerApp runs in another directory.
        values["dataset"] = str(Path(dataset).expanduser().resolve())
    if "network" in values:
        values["network"] = network_spec(str(values["network"]))
    if int(values.get("local-steps", 0)) > 0:
        values["local-epochs"] = 0
    values.update(sites=plan.sites, db=ledger_option(db), **{"run-tag": tag})
    config = RunConfig.from_mapping(values)
    _check_test_set(config)
    config = replace(config, db=check_ledger(config))
    run = _deployed_builtin(config)
    title = (
        f"Federation of {config.num_sites} sites ({', '.join(config.sites)}): "
        f"{config.num_server_rounds} round{'s' if config.num_server_rounds != 1 else ''} of "
        f"{config.strategy} ({config.sync}), "
        f"model {config.model}, server evaluates on {config.dataset}"
    )
    return run, config, config.num_server_rounds, title


def _deployed_builtin(config: RunConfig) -> DeployedRun:
    """The built-in app with ``config`` (checked, its ledger reachable), to run on the sites.

    The ledger's URL travels without its password, which reaches the ServerApp in its
    environment (storage.session.detach_password), as in `flplatform simulate`.
    """
    ledger, password_env = detach_password(config.db)
    return DeployedRun(
        app_dir=project_dir(),
        run_config={**config.to_run_config(), "db": ledger},
        tag=config.run_tag,
        extra_env=password_env,
        python_path=model_dirs(config.model),
    )


def _resumed_config(
    resume: str,
    sites: str | None,
    app_dir: Path | None,
    items: Sequence[str],
    given: Mapping[str, Any],
    db: str | None,
) -> RunConfig | AppRun:
    """The options of the deployed run ``resume`` names ('latest': the newest deployed run
    not finished), set to resume it: the built-in task's, or a run of your own app (--app)
    planned again from its recorded launch, as ``flplatform resume`` plans one; checked,
    and nothing changed yet (``ConfigError`` and ``CheckpointError`` say why it cannot be)."""
    chosen = sorted({*given, *(["app"] if app_dir else []), *(["run-config"] if items else [])})
    if set(chosen) - {"round_timeout"}:
        names = ", ".join(f"--{n.replace('_', '-')}" for n in chosen if n != "round_timeout")
        raise ConfigError(
            f"{names}: a resumed run keeps its own options; with --resume give the "
            "deployment's (--certs, --address, --wait-timeout, --insecure), --db and at "
            "most --round-timeout"
        )
    url = ledger_option(db)
    with LedgerRepository.open(url or None, create=False) as repository:
        if resume.strip().lower() == "latest":
            record = _latest_deployed(repository)
        else:
            record = repository.get_run(resolve_run(repository, resume))
        if repository.latest_checkpoint(record.id) is None:
            raise CheckpointError(f"{checkpointed_rounds(record.id, [])}; start it again")
    timeout = given.get("round_timeout")
    if LAUNCH_KEY in record.config:
        planned = relaunched(record, db=url or None, round_timeout=timeout)
        trained_on = tuple(planned.site_names)
    else:
        config = resumable_config(record, db=url, round_timeout=timeout)
        trained_on = config.sites
    if sites is not None and tuple(s.strip() for s in sites.split(",")) != trained_on:
        raise ConfigError(
            f"--sites {sites}: run {record.id} trained on {','.join(trained_on)}; give "
            "those, or leave --sites out"
        )
    if LAUNCH_KEY in record.config:
        return planned
    _check_test_set(config)  # the run's: still where it was?
    return replace(config, db=check_ledger(config))


def _latest_deployed(repository: LedgerRepository) -> RunRecord:
    """The newest run that trained on a deployment and did not finish."""
    for record in repository.list_runs():  # newest first
        if record.status != "finished" and any(
            e.kind == DEPLOYED_EVENT for e in repository.list_events(record.id)
        ):
            return record
    raise ConfigError(
        f"no deployed run to resume in the ledger {repository.url} (every one finished, or "
        "none trained on sites): give its id, and --db if it is recorded elsewhere"
    )


def _resumed_run(
    resumed: RunConfig | AppRun, plan: ServerPlan, *, force: bool
) -> tuple[DeployedRun, RunConfig, int | None, str]:
    """Reopen the run ``resumed`` resumes, on ``plan``'s deployment (a "resumed" event
    follows from its ServerApp).

    A server killed outright leaves its ServerApp behind for a few seconds, until it sees
    its command gone and ends (``run/owner.py``): the run's recorded owner. It is given
    ``OWNER_EXIT_SECONDS`` to go before the run counts as running elsewhere.
    """
    # what can fail, before the run is reopened
    if isinstance(resumed, RunConfig):
        run, follow = _deployed_builtin(resumed), resumed
    else:
        run, follow = _deployed_app(resumed), _followed(resumed)
    run_id = _resumed_id(resumed)
    deadline = time.monotonic() + OWNER_EXIT_SECONDS
    with LedgerRepository.open(follow.db or None, create=False) as repository:
        record = repository.get_run(run_id)
        refuse_deployed(record, repository.list_events(run_id), on_deployment=plan.deployment_id)
        while (
            not force
            and record.status == "running"
            and owner_alive(record.owner)
            and time.monotonic() < deadline
        ):
            time.sleep(0.5)
            record = repository.get_run(run_id)
        if not force and record.status == "running" and owner_alive(record.owner):
            raise ConfigError(
                f"run {run_id} is still running in process {record.owner} after "
                f"{OWNER_EXIT_SECONDS:g} s: stop that server first, or, if it is not this "
                "run's (a process that took its pid after a reboot), pass --force"
            )
        checkpoint = reopen(repository, record, force=True)
    title = (
        f"{resuming_line(record, checkpoint).plain}, on its {len(plan.sites)} sites "
        f"({', '.join(plan.sites)})"
    )
    # Logs of their own: those of the start that died say why it did.
    run = replace(run, log_name=f"{run.tag[:12]}.resumed-{time.strftime('%Y%m%d-%H%M%S')}")
    return run, follow, record.num_rounds_planned, title


def _resumed_id(resumed: RunConfig | AppRun) -> int:
    """The id of the run a resume continues."""
    if isinstance(resumed, RunConfig):
        return int(resumed.resume_run or 0)
    return int(resumed.options["resume_run"])


def _ledger_of(resumed: RunConfig | AppRun) -> str:
    """The ledger URL of the run a resume continues."""
    return resumed.db if isinstance(resumed, RunConfig) else resumed.db_url


def _fail_reopened(resumed: RunConfig | AppRun, reason: str) -> None:
    """Mark the run a resume reopened failed, if it is still this command's: the resume
    stopped before its ServerApp could (sites that never came, a SuperLink that would
    not start)."""
    with LedgerRepository.open(_ledger_of(resumed) or None, create=False) as repository:
        record = repository.get_run(_resumed_id(resumed))
        if record.status == "running" and record.owner == process_owner():
            repository.finish_run(record.id, status="failed", error=reason)


def _check_test_set(config: RunConfig) -> None:
    """The server's held-out test set, loaded once now: a bad path is one line, not a
    failed run after the sites joined."""
    from clients.site import load_test_set

    test = load_test_set(dataset=config.dataset, partition=config.partition, seed=config.seed)
    if config.strategy in SKETCHED:
        check_top_k(config, input_shape=test.input_shape, num_classes=test.num_classes)


def _app_run(
    app_dir: Path,
    plan: ServerPlan,
    given: Mapping[str, Any],
    items: Sequence[str],
    db: str | None,
    tag: str,
) -> tuple[DeployedRun, RunConfig, int | None, str]:
    """A user's app, planned as ``flplatform run`` plans it, on the registered sites."""
    builtin_only = sorted(set(given) - set(APP_OPTIONS))
    if builtin_only:
        names = ", ".join(f"--{name.replace('_', '-')}" for name in builtin_only)
        raise ConfigError(
            f"{names}: options of the built-in task; with --app, set your app's own keys "
            "with -c key=value"
        )
    app = read_app(app_dir)
    planned = plan_run(
        app, RunOverrides(sites=plan.sites, db=db, run_config=tuple(items), **given), tag=tag
    )
    title = (
        f"Federation of {len(plan.sites)} sites ({', '.join(plan.sites)}): "
        f"app {app.name} ({app.path})"
    )
    return _deployed_app(planned), _followed(planned), planned.num_rounds, title


def _deployed_app(planned: AppRun) -> DeployedRun:
    """A user's app, planned as ``flplatform run`` plans it, to run on the sites."""
    return DeployedRun(
        app_dir=planned.app.path,
        run_config=planned.run_config,
        tag=planned.tag,
        extra_env=planned.environment(),
        python_path=planned.python_path,
    )


def _followed(planned: AppRun) -> RunConfig:
    """What finds an app's run in the ledger: its ledger and its tag."""
    return replace(RunConfig(), db=planned.db_url, run_tag=planned.tag)


def _finish(record: RunRecord, url: str, db: str | None) -> None:
    show_rounds(str(record.id), db=url, fmt=OutputFormat.table)
    show_sites(str(record.id), db=url, fmt=OutputFormat.table)
    say_run_done(console, record, url, db)


@handles_errors
def site(
    name: Annotated[
        str,
        typer.Argument(help="This site's name, as in the server's --sites.", show_default=False),
    ],
    server: Annotated[
        str,
        typer.Option(
            help="HOST:PORT of the server, as its administrator gives it (the host must be "
            "one its certificate is valid for).",
            show_default=False,
        ),
    ],
    data: Annotated[
        Path,
        typer.Option(
            help="This site's own data file (.npz with arrays x and y, e.g. from "
            "`flplatform data split`); the only data this site reads.",
            show_default=False,
        ),
    ],
    certs: Annotated[
        Path | None,
        typer.Option(
            help="Directory with the server's ca.crt and this site's NAME.key "
            "(`flplatform certs site NAME --out DIR`)."
        ),
    ] = None,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            help="No TLS and no key, for a server started with --insecure (tests only).",
        ),
    ] = False,
) -> None:
    """Connect this site to a federation's server and train for every run it starts,
    until stopped (Ctrl-C).

    The site's SuperNode dials the server with TLS, trusting only the deployment's CA, and
    proves who it is with its private key, which never leaves this machine. The built-in
    task trains on a CUDA GPU when PyTorch sees one (else on the CPU); the server's ledger
    records each site's device.
    """
    from flplatform.deploy.site import plan_site, probe_server, run_site

    if insecure:
        _warn(INSECURE_SITE_WARNING)
    plan = plan_site(name, server=server, certs_dir=certs, data=data, insecure=insecure)
    note = probe_server(plan)
    if note:
        _say(f"{note}; the SuperNode keeps trying")
    _say(f"site {plan.name}: SuperNode for {plan.server}, data {plan.data} (Ctrl-C stops it)")
    run_site(plan, home=work_home(), say=_say)
