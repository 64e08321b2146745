"""Runs in a ledger as a killed command leaves them: committed rounds, each checkpointed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
from flwr.app import Array, ArrayRecord

from flplatform.app.config import RunConfig
from flplatform.engine.events import RoundSummary
from flplatform.run.ledger import SqlLedger
from storage import LedgerRepository


def simulate_config(tag: str) -> dict[str, Any]:
    return {**RunConfig(num_server_rounds=4).to_run_config(), "run-tag": tag}


def record_run(
    url: str,
    tmp_path: Path,
    *,
    config: dict[str, Any],
    tag: str | None,
    rounds: int,
    owner: str | None = None,
    status: Literal["finished", "failed"] | None = None,
) -> int:
    """A run with ``rounds`` committed rounds, each with its checkpoint."""
    t0 = time.time()
    with LedgerRepository.open(url) as repo:
        run_id = repo.create_run(
            name="r",
            strategy="local-sgd",
            seed=0,
            config=config,
            num_rounds_planned=4,
            tag=tag,
            owner=owner,
        )
        sink = SqlLedger(repo, run_id, checkpoint_dir=tmp_path / "ckpt")
        for step in range(1, rounds + 1):
            state = {
                "kind": "flplatform-run-state",
                "server_round": step,
                "model_version": step,
                "model": ArrayRecord({"w": Array(np.full(3, step, np.float32))}),
                "engine": {},
            }
            sink.record_round(RoundSummary(step, step, t0, t0 + 0.1, {}, None, ()), state)
        if status is not None:
            repo.finish_run(run_id, status=status, error="boom" if status == "failed" else None)
    return run_id
