"""Run a simulated federation and follow it through the ledger; sweeps of runs.

``flplatform simulate`` runs exactly what ``flwr run .`` runs (``launch.flower`` starts
the processes); the ServerApp writes the ledger, and the caller follows the run's
progress by reading it, stopping every process when the run ends or the user stops it.
A sweep runs several runs in one Flower simulation (:func:`run_sweep`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from flplatform.app.config import RunConfig
from flplatform.app.sweep import check_members, sweep_run_config
from flplatform.core.errors import RunFailed, RunStopped, StorageError
from flplatform.launch.app_directory import AppRun
from flplatform.launch.flower import (
    SimulationProcess,
    model_dirs,
    project_dir,
    start_app,
    start_simulation,
    work_home,
)
from flplatform.launch.processes import ProcessTree, StopRequested, stop_reason
from storage import (
    UPDATE_DROPPED,
    UPDATE_REJECTED,
    LedgerRepository,
    RoundRecord,
    RunRecord,
    UpdateRecord,
)
from storage.session import default_db_url, detach_password, normalize_db_url

# Called at every poll with the run (None until the ServerApp records it), its rounds so
# far, and the dropped and rejected updates of the latest round (so a display can say why).
ProgressCallback = Callable[[RunRecord | None, list[RoundRecord], list[UpdateRecord]], None]


# ===================================================================== run and follow
def ledger_url(config: RunConfig) -> str:
    """The absolute URL of the ledger ``config`` names (the ServerApp runs elsewhere)."""
    return normalize_db_url(config.db) if config.db else default_db_url()


def check_ledger(config: RunConfig) -> str:
    """Open (creating if needed) the ledger ``config`` names; return its absolute URL.

    Fails fast, before any start-up cost, with a ``StorageError`` saying what is wrong:
    another application's database, or a ledger the run could not write to.
    """
    # No --db: the default ledger, whose directory (the home) is created; a user-given URL's
    # directory is not (a typo should not start an empty ledger somewhere else).
    db_url = ledger_url(config)
    with LedgerRepository.open(db_url if config.db else None) as repository:
        repository.check_writable()
    return db_url


def run_simulation(
    config: RunConfig,
    *,
    app_dir: Path | None = None,
    on_progress: ProgressCallback | None = None,
    poll_interval: float = 0.5,
) -> RunRecord:
    """Run ``config`` as a Flower simulation and follow it through the ledger.

    Returns the finished run; raises ``RunFailed`` (after recording the failure in the
    ledger) when it does not finish, ``RunStopped`` when SIGINT or SIGTERM stopped it
    (see :func:`follow_run`), and ``StorageError`` when the ledger cannot be opened.
    """
    home = work_home()
    db_url = check_ledger(config)
    tag = uuid.uuid4().hex
    config = RunConfig.from_mapping({**config.to_run_config(), "run-tag": tag, "db": db_url})

    def start(tree: ProcessTree) -> SimulationProcess:
        return start_simulation(config, home=home, log_name=tag[:12], tree=tree, app_dir=app_dir)

    return follow_run(start, config, on_progress, poll_interval)


def resume_simulation(
    config: RunConfig,
    *,
    on_progress: ProgressCallback | None = None,
    poll_interval: float = 0.5,
) -> RunRecord:
    """Resume a run of the built-in app (``flplatform resume``): ``config`` is the run's own,
    with ``resume_run`` set, its ``run_tag`` and ``db``; the run must already be reopened
    (running) so that following it does not stop at once.

    Returns the finished run; raises like :func:`run_simulation`.
    """
    home = work_home()

    def start(tree: ProcessTree) -> SimulationProcess:
        return start_simulation(config, home=home, log_name=config.run_tag[:12], tree=tree)

    return follow_run(start, config, on_progress, poll_interval)


def run_app(
    run: AppRun,
    *,
    on_progress: ProgressCallback | None = None,
    poll_interval: float = 0.5,
) -> RunRecord:
    """Run a user's Flower app directory (``flplatform run``) and follow it in the ledger.

    The run is found by ``run.tag``: flplatform's ServerApp reads it from the ``run-tag``
    key, ``flplatform.start`` from ``FLPLATFORM_OPTIONS``. Returns the finished run;
    raises ``RunFailed`` and ``RunStopped`` like :func:`run_simulation`.
    """
    home = work_home()
    started: list[SimulationProcess] = []

    def start(tree: ProcessTree) -> SimulationProcess:
        process = start_app(
            run.app.path,
            home=home,
            log_name=run.tag[:12],
            tree=tree,
            run_config=run.run_config,
            num_sites=run.num_sites,
            extra_env=run.environment(),
            python_path=run.python_path,
        )
        started.append(process)
        return process

    # What _follow reads: where the run is recorded and its tag.
    follow = replace(RunConfig(), db=run.db_url, run_tag=run.tag)
    try:
        return follow_run(start, follow, on_progress, poll_interval)
    except RunStopped:
        raise
    except RunFailed:
        if not started or started[0].poll() != 0 or _has_run(follow):
            raise
        raise RunFailed(
            f"app '{run.app.name}' recorded no run in the ledger ({started[0].last_error()}); "
            f"`flplatform run` follows ServerApps that call flplatform.start(...) or are "
            f"flplatform's own; log: {started[0].log_path}"
        ) from None


def _has_run(config: RunConfig) -> bool:
    with LedgerRepository.open(config.db) as repository:
        return repository.find_run_by_tag(config.run_tag) is not None


def follow_run(
    start: Callable[[ProcessTree], SimulationProcess],
    config: RunConfig,
    on_progress: ProgressCallback | None = None,
    poll_interval: float = 0.5,
    *,
    wind_down_seconds: float = 0.0,
) -> RunRecord:
    """Start a simulation with ``start``, follow its run to the end, stop every process.

    Whatever happens, every process ``start`` started is stopped before this returns or
    raises (``ProcessTree``). Ctrl-C (``KeyboardInterrupt``) or ``StopRequested`` (the
    CLI's SIGINT and SIGTERM, see ``processes.stop_signals``), during start-up too, stops
    them first, then marks the run failed with "stopped by the user (SIGINT)" and raises
    ``RunStopped``: nothing is left running that could write to the run afterwards.

    ``wind_down_seconds``: once the ledger says the run ended, how long Flower may take to
    end it too (``flwr run`` exits when the SuperLink has the ServerApp's exit) before
    everything is stopped. A SuperLink whose state outlives the command (a deployment's)
    otherwise keeps the run as running, until Flower gives it up as failed.
    """
    with ProcessTree() as tree:
        try:
            process = start(tree)
            run_id = _follow(process, config, on_progress, poll_interval)
            with contextlib.suppress(KeyboardInterrupt):  # the run has ended: stop now
                _wind_down(process, wind_down_seconds)
            tree.stop()  # before the status is read: nothing may write to the run later
        except KeyboardInterrupt as exc:
            tree.stop()
            raise _stopped(config, exc) from None
    return _final_record(process, config, run_id)


def _wind_down(process: SimulationProcess, seconds: float) -> None:
    """Wait up to ``seconds`` for ``flwr run`` to exit by itself (its run ended in Flower)."""
    if seconds <= 0:  # a simulation's: nothing of it outlives the command
        return
    deadline = time.monotonic() + seconds
    while process.poll() is None and not process.superlink_exited():
        process.tree.record()  # what starts meanwhile is stopped too
        if time.monotonic() >= deadline:
            return
        time.sleep(0.1)


def _stopped(config: RunConfig, exc: KeyboardInterrupt) -> RunStopped:
    """Mark the stopped run failed, if it was still running; return the error to raise."""
    reason = stop_reason(exc)
    code = exc.exit_code if isinstance(exc, StopRequested) else RunStopped.exit_code
    try:
        with LedgerRepository.open(config.db) as repository:
            record = repository.find_run_by_tag(config.run_tag)
            if record is None:
                return RunStopped(f"{reason} before the run started", exit_code=code)
            if record.status != "running":
                return RunStopped(f"{reason}; run {record.id} had {record.status}", exit_code=code)
            repository.finish_run(record.id, status="failed", error=reason)
    except StorageError as exc_storage:
        return RunStopped(
            f"{reason}; the run could not be marked failed: {exc_storage.reason}", exit_code=code
        )
    return RunStopped(
        f"run {record.id} {reason} after {record.rounds_completed} of "
        f"{record.num_rounds_planned} rounds; it is marked failed",
        exit_code=code,
    )


def _final_record(process: SimulationProcess, config: RunConfig, run_id: int) -> RunRecord:
    """The run once every process is stopped; ``RunFailed`` unless it finished."""
    record = _settled_record(process, config, run_id)
    if record.status != "finished":
        raise RunFailed(
            f"run {record.id} failed: {record.error or process.last_error()}; "
            f"log: {process.log_path}"
        )
    forget_snapshots(record)
    return record


def forget_snapshots(record: RunRecord) -> None:
    """Delete a finished run's site snapshots (only a resume needs them), where its
    simulated sites wrote them: the state root in the environment they ran with."""
    # The mods load torch: imported here, so the CLI starts without it.
    from strategies.mods.snapshots import forget_run

    # the sites' environment as flower_environment sets it: the home, the rest inherited
    forget_run(record.tag or "", environ={**os.environ, "FLPLATFORM_HOME": str(work_home())})


def _settled_record(process: SimulationProcess, config: RunConfig, run_id: int) -> RunRecord:
    """The run once every process is stopped; failed with the reason if it was left running."""
    with LedgerRepository.open(config.db) as repository:
        record = repository.get_run(run_id)
        if record.status == "running":  # the ServerApp died without a word
            reason = process.link_lost or f"simulation exited: {process.last_error()}"
            repository.finish_run(run_id, status="failed", error=reason)
            record = repository.get_run(run_id)
    return record


def _follow(
    process: SimulationProcess,
    config: RunConfig,
    on_progress: ProgressCallback | None,
    poll_interval: float,
) -> int:
    """Poll the ledger until the run leaves "running", Flower exits or the SuperLink dies.

    Returns the run id. Each poll records the process tree, so that the processes of a
    SuperLink that dies are still found and stopped.
    """
    run_id: int | None = None
    with LedgerRepository.open(config.db) as repository:
        while True:
            process.tree.record()
            # Both asked: when the SuperLink dies, `flwr run` (streaming from it) exits too.
            link_gone = process.superlink_exited()
            exited = process.poll() is not None or link_gone
            record = repository.find_run_by_tag(config.run_tag)
            if record is not None:
                run_id = record.id
                if link_gone and record.status == "running":
                    record = _fail_first(repository, record.id, process.link_lost or "")
            if on_progress is not None:
                done = repository.list_rounds(record.id) if record else []
                on_progress(record, done, _latest_failures(repository, done))
            if exited or (record is not None and record.status != "running"):
                break
            time.sleep(poll_interval)
    if run_id is None:
        reason = process.link_lost or f"flwr exited with {process.poll()}"
        raise RunFailed(
            f"the simulation stopped before the ServerApp started ({reason}): "
            f"{process.last_error()}; log: {process.log_path}"
        )
    return run_id


def _fail_first(repository: LedgerRepository, run_id: int, reason: str) -> RunRecord:
    """Mark the run failed with ``reason`` before its processes are stopped.

    Its SuperLink is gone: the ServerApp, still running until the tree is stopped, can
    then write nothing more to the run (the ledger refuses rows for a run that is not
    running), nor record some other reason of its own as it is stopped.
    """
    with contextlib.suppress(StorageError):  # it ended meanwhile, as it said itself
        repository.finish_run(run_id, status="failed", error=reason)
    return repository.get_run(run_id)


# ========================================================================== sweeps
# Called at every poll with the member's index (in the order given), then as
# ``ProgressCallback``: its run (None until recorded), its rounds so far, the latest
# round's dropped and rejected updates.
SweepProgress = Callable[[int, RunRecord | None, list[RoundRecord], list[UpdateRecord]], None]


class SweepFailed(RunFailed):
    """Runs of a sweep failed or never started; the others finished.

    ``records``: every member's run as the ledger has it, in the members' order (None for
    a member that never started).
    """

    def __init__(self, reason: str, records: Sequence[RunRecord | None]) -> None:
        super().__init__(reason)
        self.records = list(records)


def run_sweep(
    members: Sequence[RunConfig],
    *,
    on_progress: SweepProgress | None = None,
    poll_interval: float = 0.5,
) -> list[RunRecord]:
    """Run ``members`` in one Flower simulation, one after another, and follow each.

    One SuperLink and one Ray start-up; each member is a run of its own in the ledger
    (its own tag and name, and as its config its own options, so that ``flplatform
    resume`` continues it alone). They must share their sites and ledger
    (``sweep.check_members``). A member that fails is recorded failed and the next one
    runs. Ctrl-C or SIGTERM stops every process, marks the member that was running failed
    and raises ``RunStopped``; members not started get no run.

    Returns
    -------
    list of RunRecord
        Each member's finished run, in order.

    Raises
    ------
    ConfigError
        If the members cannot share one federation.
    SweepFailed
        Naming the members that failed or never started, once the others have finished
        (every recorded run is in the ledger, and in the error's ``records``).
    RunStopped, StorageError
        As :func:`run_simulation`.
    """
    check_members(members)
    home = work_home()
    db_url = check_ledger(members[0])
    tagged = [
        RunConfig.from_mapping(
            {**m.to_run_config(), "run-tag": uuid.uuid4().hex, "db": db_url, "name": m.run_name}
        )
        for m in members
    ]
    flower_config = sweep_run_config(tagged)
    log_name = tagged[0].run_tag[:12]
    run_ids: list[int | None] = [None] * len(tagged)
    current = tagged[0]
    with ProcessTree() as tree:
        try:
            ledger, password_env = detach_password(db_url)
            process = start_app(
                project_dir(),
                home=home,
                log_name=log_name,
                tree=tree,
                run_config={**flower_config, "db": ledger},
                num_sites=tagged[0].num_sites,
                extra_env=password_env,
                python_path=tuple(dict.fromkeys(d for m in tagged for d in model_dirs(m.model))),
            )
            for index, member in enumerate(tagged):
                current = member
                shown = None if on_progress is None else functools.partial(on_progress, index)
                try:
                    run_ids[index] = _follow(process, member, shown, poll_interval)
                except RunFailed:
                    break  # the simulation ended before this member started
            tree.stop()  # before the statuses are read: nothing may write to a run later
        except KeyboardInterrupt as exc:
            tree.stop()
            stopped = _stopped(current, exc)
            for member in tagged:
                if member is not current:
                    _stopped(member, exc)  # one the ServerApp began since the last poll
            raise stopped from None
    records = [
        _settled_record(process, member, run_id) if run_id is not None else None
        for member, run_id in zip(tagged, run_ids, strict=True)
    ]
    for record in records:
        if record is not None and record.status == "finished":
            forget_snapshots(record)
    troubles = [
        f"'{member.run_name}' "
        + (f"(run {record.id}) failed: {record.error}" if record else "never started")
        for member, record in zip(tagged, records, strict=True)
        if record is None or record.status != "finished"
    ]
    if troubles:
        never = "" if all(records) else f" ({process.last_error()})"
        raise SweepFailed(
            f"{len(troubles)} of {len(tagged)} runs of the sweep did not finish: "
            f"{'; '.join(troubles)}{never}; log: {process.log_path}",
            records,
        )
    return [record for record in records if record is not None]


def _latest_failures(repository: LedgerRepository, done: list[RoundRecord]) -> list[UpdateRecord]:
    """The dropped and rejected updates of the latest round; no query when it had none."""
    if not done or not (done[-1].num_dropped or done[-1].num_rejected):
        return []
    latest = done[-1]
    return repository.list_updates(
        latest.run_id, round=latest.round, status=(UPDATE_DROPPED, UPDATE_REJECTED)
    )
