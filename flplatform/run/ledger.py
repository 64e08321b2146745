"""The engine's ``LedgerSink`` backed by the SQL repository of ``storage``, with checkpoints.

The only module that imports both the engine and ``storage``. The engine's outcomes are the
ledger's rows (``flplatform.core.ledger_rows``); here they become storage's validated inputs.

A round handed in with the run's state is committed with its checkpoint: the state is
written to ``<checkpoint dir>/<ledger id>/run-<id>/round-<NNNNNN>.npz`` first
(``flplatform.core.checkpoint.write_state``: atomic, owner-only), then the round and the file's
row are committed in one transaction. A committed round therefore always has its file, and
a file without a row (the process died in between) is never taken for a resume point.
Only then are older files deleted (retention): the last checkpoint is always kept (it is
the resume point), and so is every ``checkpoint_every``-th round's, at most
``keep_checkpoints`` of them, plus the final one of a finished run (``finish``).
"""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from flplatform.core.checkpoint import CheckpointError, read_state, write_state
from flplatform.core.checks import require
from flplatform.core.errors import FLPlatformError, NotFoundError, RunFailed, StorageError
from flplatform.core.processes import pid_alive
from flplatform.engine.events import RoundSummary, SiteInfo, TrafficOutcome
from flplatform.run.options import DEFAULT_OPTIONS, option_problem
from flplatform.run.owner import owner_gone
from storage import (
    CheckpointInput,
    CheckpointRecord,
    EvaluationInput,
    LedgerRepository,
    TrafficInput,
    UpdateInput,
    flplatform_home,
)
from storage.repository import checkpointed_rounds

log = logging.getLogger("flplatform")

CHECKPOINTS_DIRNAME = "checkpoints"
# Only files named like ours are ever deleted, whatever path a ledger row names.
_CHECKPOINT_FILE = re.compile(r"round-\d{6,}\.npz")


def checkpoint_filename(server_round: int) -> str:
    """``round-000007.npz``: sorts by round in a directory listing."""
    return f"round-{server_round:06d}.npz"


def run_checkpoint_directory(
    repository: LedgerRepository, run_id: int, checkpoint_dir: str | Path | None = None
) -> Path:
    """Where a run's checkpoints go: ``<checkpoint_dir>/<ledger id>/run-<run_id>``.

    ``checkpoint_dir`` defaults to ``$FLPLATFORM_HOME/checkpoints``; the ledger id keeps two
    ledgers' run 1 apart and holds no password (``storage.ledger_id``).
    """
    root = Path(checkpoint_dir) if checkpoint_dir else flplatform_home() / CHECKPOINTS_DIRNAME
    return Path(os.path.abspath(root.expanduser())) / repository.ledger_id / f"run-{run_id}"


def process_owner() -> str:
    """``"host:pid"`` of this process: the owner a run records (``create_run(owner=...)``)."""
    return f"{socket.gethostname()}:{os.getpid()}"


def owner_alive(owner: str | None) -> bool | None:
    """Whether the process ``owner`` (``host:pid``) is alive; None when it cannot be told
    (another host, or no owner recorded)."""
    host, _, pid = (owner or "").rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return None
    return pid_alive(int(pid))


class SqlLedger:
    """Write sites and rounds of one run, each round in its own transaction.

    Parameters
    ----------
    repository : LedgerRepository
        The open ledger.
    run_id : int
        The run written.
    checkpoint_dir : str, Path or None
        Root of the checkpoint files (default ``$FLPLATFORM_HOME/checkpoints``); a run's go
        in ``<root>/<ledger id>/run-<id>/``.
    checkpoint_every : int
        Every this many rounds a checkpoint is kept (``>= 0``; 0 keeps only the final one);
        the others are deleted once a later round is committed.
    keep_checkpoints : int
        At most this many kept checkpoints (``>= 1``), the newest; the last checkpoint (the
        resume point) and the final one of a finished run are kept besides.

    Raises
    ------
    ConfigError
        If ``checkpoint_every`` or ``keep_checkpoints`` is out of range.
    """

    def __init__(
        self,
        repository: LedgerRepository,
        run_id: int,
        *,
        checkpoint_dir: str | Path | None = None,
        checkpoint_every: int = DEFAULT_OPTIONS.checkpoint_every,
        keep_checkpoints: int = DEFAULT_OPTIONS.keep_checkpoints,
    ) -> None:
        # start()'s rules for the same options, said once (flplatform/run/options.py)
        require(
            option_problem("checkpoint_every", checkpoint_every, "checkpoint-every"),
            option_problem("keep_checkpoints", keep_checkpoints, "keep-checkpoints"),
        )
        self.repository = repository
        self.run_id = run_id
        self.checkpoint_every = checkpoint_every
        self.keep_checkpoints = keep_checkpoints
        self.directory = run_checkpoint_directory(repository, run_id, checkpoint_dir)

    def add_site(self, site: SiteInfo, profile: dict[str, Any]) -> None:
        """Record a site that joined the run (one back after a resume keeps its row)."""
        self.repository.add_site(
            self.run_id,
            name=site.name,
            node_id=site.node_id,
            partition_id=site.partition_id,
            num_examples=site.num_examples,
            profile=profile,
        )

    def record_traffic(
        self, traffic: Sequence[TrafficOutcome], server_round: int | None = None
    ) -> None:
        """Record bytes with sites that no update or evaluation row holds (queries, late
        replies), in their own transaction."""
        self.repository.add_traffic(
            self.run_id, [TrafficInput(**asdict(t)) for t in traffic], round=server_round
        )

    def record_event(self, kind: str, detail: dict[str, Any]) -> None:
        """Record an event of the run (a site lost or back), in its own transaction."""
        self.repository.add_event(self.run_id, kind, detail)

    def record_round(self, summary: RoundSummary, state: Mapping[str, Any] | None = None) -> None:
        """Record one finished round with all its updates and evaluations, and its checkpoint.

        Parameters
        ----------
        summary : RoundSummary
            The round.
        state : dict or None
            The run's whole state after the round (``RoundEngine.state_dict()``); written to
            the round's checkpoint file and committed with the round. ``None``: the round
            alone.

        Raises
        ------
        CheckpointError
            If the state cannot be written (nothing is recorded then).
        StorageError
            If the round cannot be recorded (its new file is deleted then).
        RunFailed
            If the command that started the run is gone (``run.owner``): a run nobody
            follows takes no more rounds.
        """
        if owner_gone():
            raise RunFailed(
                f"the command that started run {self.run_id} is gone (killed?): round "
                f"{summary.server_round} is not recorded; `flplatform resume {self.run_id}` "
                "goes on from the last one"
            )
        if state is None:
            self._record(summary, None)
            return
        step = summary.server_round
        path = self.directory / checkpoint_filename(step)
        if path.exists() and any(c.round == step for c in self._checkpoints()):
            # Never overwrite a committed resume point; the repository would refuse the
            # round anyway, after the file had been replaced.
            raise StorageError(
                f"round {step} of run {self.run_id} is already recorded with its checkpoint "
                f"{path}; each server step is recorded once"
            )
        size = write_state(path, state)
        # 0: no round's checkpoint is kept for good; the final one is (``finish``)
        kept = self.checkpoint_every > 0 and step % self.checkpoint_every == 0
        try:
            self._record(summary, CheckpointInput(path=str(path), size_bytes=size, kept=kept))
        except BaseException:
            # Not committed: the file must not outlive it (no row names it).
            path.unlink(missing_ok=True)
            raise
        self._retain(latest=step)

    def finish(self) -> CheckpointRecord | None:
        """Keep the run's last checkpoint for good (its final model); None without one.

        Call it when the run has finished, before or after ``finish_run``; retention never
        deletes a kept checkpoint, and nothing comes after the final one.
        """
        latest = self.repository.latest_checkpoint(self.run_id)
        if latest is None or latest.kept:
            return latest
        return self.repository.keep_checkpoint(self.run_id, latest.round)

    def _record(self, summary: RoundSummary, checkpoint: CheckpointInput | None) -> None:
        self.repository.record_round(
            self.run_id,
            round=summary.server_round,
            model_version=summary.model_version,
            started_at=summary.started_at,
            finished_at=summary.finished_at,
            metrics=summary.metrics,
            train_loss=summary.train_loss,
            virtual_started_at=summary.virtual_started_at,
            virtual_finished_at=summary.virtual_finished_at,
            updates=[UpdateInput(**asdict(u)) for u in summary.updates],
            evaluations=[EvaluationInput(**asdict(e)) for e in summary.evaluations],
            run_warning=summary.warning,
            checkpoint=checkpoint,
        )

    def _checkpoints(self) -> list[CheckpointRecord]:
        return self.repository.list_checkpoints(self.run_id)

    def _retain(self, *, latest: int) -> None:
        """Delete the checkpoints retention does not keep; never the latest (resume point).

        A failure here leaves a file too many, never a round without its checkpoint, so it
        is logged and the run goes on.
        """
        try:
            checkpoints = self._checkpoints()
            kept = [c for c in checkpoints if c.kept]
            surplus = kept[: max(0, len(kept) - self.keep_checkpoints)]
            doomed = [c for c in checkpoints if not c.kept] + surplus
            for checkpoint in sorted(doomed, key=lambda c: c.round):
                if checkpoint.round == latest:
                    continue
                # The row goes first: a row must never name a deleted file.
                self.repository.delete_checkpoint(self.run_id, checkpoint.round)
                path = Path(checkpoint.path)
                if _CHECKPOINT_FILE.fullmatch(path.name):
                    path.unlink(missing_ok=True)
        except (FLPlatformError, OSError) as exc:
            log.warning("could not delete old checkpoints of run %s: %s", self.run_id, exc)


def load_checkpoint(
    repository: LedgerRepository, run_id: int, server_round: int | None = None
) -> tuple[CheckpointRecord, dict[str, Any]]:
    """A run's checkpoint (its last one, or that of ``server_round``) and the state it holds.

    Raises
    ------
    NotFoundError
        If the run does not exist or has no checkpoint of that round (the message lists the
        rounds that have one).
    CheckpointError
        If the file is missing or not a readable checkpoint.
    """
    checkpoints = repository.list_checkpoints(run_id)
    if server_round is None:
        chosen = checkpoints[-1] if checkpoints else None
    else:
        chosen = next((c for c in checkpoints if c.round == server_round), None)
    if chosen is None:
        rounds = [c.round for c in checkpoints]
        if server_round is None or not rounds:
            raise NotFoundError(checkpointed_rounds(run_id, rounds))
        raise NotFoundError(
            f"run {run_id} has no checkpoint of round {server_round}; "
            f"{checkpointed_rounds(run_id, rounds)}"
        )
    try:
        return chosen, read_state(chosen.path)
    except CheckpointError as exc:
        raise CheckpointError(
            f"the checkpoint of round {chosen.round} of run {run_id}: {exc.reason}"
        ) from exc
