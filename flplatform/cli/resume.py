"""``flplatform resume RUN``: continue a run that died from its last committed round.

The ledger holds everything: the run's options (its config), and with every committed round
a checkpoint of the whole run state (``flplatform.core.checkpoint``). The run is reopened (an
event in the ledger), the same federation is started again with ``resume-run`` set, and the
ServerApp continues from the round after the checkpoint. Only options that cannot change the
result may be given again (``--round-timeout``).

A run of ``flplatform simulate`` (or the demo) is started again from its recorded options; a
run of ``flplatform run APP_DIR`` from the app directory and options its launch recorded
(``launch.app_directory.launch_record``), with ``resume_run`` handed to the app's
``flplatform.start``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated

import typer
from rich.text import Text

from flplatform.app.config import RunConfig
from flplatform.cli.errors import handles_errors
from flplatform.cli.history import DbOption, RunArgument, resolve_run
from flplatform.cli.history import rounds as show_rounds
from flplatform.cli.progress import round_progress, say_run_done
from flplatform.cli.render import OutputFormat, make_console
from flplatform.cli.simulate import ledger_option
from flplatform.core.checkpoint import CheckpointError
from flplatform.core.errors import ConfigError
from flplatform.launch.app_directory import AppRun, relaunch
from flplatform.launch.simulation import resume_simulation, run_app
from flplatform.run.ledger import owner_alive, process_owner
from flplatform.run.run_record import LAUNCH_KEY, refuse_deployed, refuse_finished
from storage import CheckpointRecord, LedgerRepository, RunRecord
from storage.repository import checkpointed_rounds

console = make_console()


@handles_errors
def resume(
    run: RunArgument,
    db: DbOption = None,
    round_timeout: Annotated[
        float | None,
        typer.Option(help="Seconds a site may take per message (default: the run's)."),
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Resume although the ledger says the run's process is alive on this machine.",
        ),
    ] = False,
) -> None:
    """Continue a run that died (running or failed) from its last committed round."""
    url = ledger_option(db)
    with LedgerRepository.open(url or None, create=False) as repository:
        run_id = resolve_run(repository, run)
        record = repository.get_run(run_id)
        refuse_deployed(record, repository.list_events(run_id))
        plan: AppRun | RunConfig
        if LAUNCH_KEY in record.config:
            plan = relaunched(record, db=url or None, round_timeout=round_timeout)
        else:
            plan = resumable_config(record, db=url, round_timeout=round_timeout)
        checkpoint = reopen(repository, record, force=force)
    console.print(resuming_line(record, checkpoint))
    with round_progress(console, record.num_rounds_planned) as show:
        if isinstance(plan, AppRun):
            finished, followed = run_app(plan, on_progress=show), plan.db_url
        else:
            finished, followed = resume_simulation(plan, on_progress=show), plan.db
    console.print()
    show_rounds(str(finished.id), db=followed, fmt=OutputFormat.table)
    say_run_done(console, finished, followed, db, wall=False)


def reopen(repository: LedgerRepository, record: RunRecord, *, force: bool) -> CheckpointRecord:
    """Mark ``record`` running again, owned by this command; its latest checkpoint.

    ``CheckpointError`` if it has none, ``ConfigError`` if the process that runs it is
    alive on this machine, unless ``force``.
    """
    checkpoint = repository.latest_checkpoint(record.id)
    if checkpoint is None:  # the ServerApp would say the same (ledger.load_checkpoint)
        raise CheckpointError(f"{checkpointed_rounds(record.id, [])}; start it again")
    alive = owner_alive(record.owner) if record.status == "running" else False
    if alive and not force:
        raise ConfigError(
            f"run {record.id} is running in process {record.owner}, which is alive: stop it "
            f"first (or pass --force if that process is not this run's)"
        )
    repository.reopen_run(record.id, owner=process_owner())
    return checkpoint


def resuming_line(record: RunRecord, checkpoint: CheckpointRecord) -> Text:
    return Text.assemble(
        "Resuming run ",
        (str(record.id), "bold"),
        f" ({record.name}) from round {checkpoint.round} of {record.num_rounds_planned}",
    )


def relaunched(record: RunRecord, *, db: str | None, round_timeout: float | None) -> AppRun:
    """A run of ``flplatform run APP_DIR``, planned again to resume; ``ConfigError`` if it
    cannot be (finished, or its app directory is gone)."""
    refuse_finished(record)
    if not record.tag:
        raise ConfigError(f"run {record.id} has no tag to follow it by; it cannot be resumed")
    plan = relaunch(record.config[LAUNCH_KEY], run_id=record.id, db=db, tag=record.tag)
    if round_timeout is not None:
        if not round_timeout > 0:
            raise ConfigError(f"--round-timeout must be > 0 seconds, got {round_timeout}")
        plan = replace(plan, options={**plan.options, "timeout": round_timeout})
    return plan


def resumable_config(record: RunRecord, *, db: str, round_timeout: float | None) -> RunConfig:
    """The run's own options, set to resume it; ``ConfigError`` when it cannot be resumed."""
    refuse_finished(record)
    if not record.tag or "strategy" not in record.config or "dataset" not in record.config:
        raise ConfigError(
            f"run {record.id} was not started by `flplatform simulate`, `flplatform run` or "
            "the demo: `flplatform resume` restarts those; a ServerApp of your own resumes a "
            "run by passing resume_run=<id> to flplatform.start(...)"
        )
    values = dict(record.config)
    # the ledger it was read from ("": the default one), whatever its options say (runs of
    # the default ledger recorded before migration 0007 say "<not a database URL: removed>")
    values.update({"resume-run": record.id, "run-tag": record.tag, "db": db})
    if round_timeout is not None:
        values["round-timeout"] = round_timeout
    return RunConfig.from_mapping(values)
