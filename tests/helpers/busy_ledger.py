"""A ledger whose every history table has its widest realistic values.

Three runs: a long simulated one with every optional column (delays, failures with long
reasons, site evaluations, many staleness values, a warning note, checkpoints, a resume
event, late replies), a wall-clock run of a user's own app (no strategy, sync or model in
its config) and a running one. Values are as wide as real runs make them: GiB of traffic,
hours of simulated time, four-digit steps, long site names.
"""

from __future__ import annotations

import time
from pathlib import Path

from storage import (
    CheckpointInput,
    EvaluationInput,
    LedgerRepository,
    TrafficInput,
    UpdateInput,
    UpdateStatus,
)

SITES = ("california-north", "london", "ohio", "tokyo-datacenter-2")
LONG_REASON = "missing arrays: [conv1.weight], [conv1.bias], [fc.weight] " + "x" * 120
ROUNDS = 12
# The busiest run's statuses, round by round, for its four sites.
STATUSES: tuple[UpdateStatus, ...] = ("applied", "rejected", "dropped", "applied")


def write_busy_ledger(url: str, checkpoints: Path) -> None:
    """Write the three runs (ids 1, 2, 3) into the ledger at ``url``."""
    t0 = time.time() - 100_000
    with LedgerRepository.open(url) as repo:
        run_id = repo.create_run(
            name="stragglers: delayed D=12 with top-k uploads, no compensation",
            strategy="delayed",
            seed=123456,
            config={
                "strategy": "delayed",
                "sync": "k-batch-async",
                "k": 3,
                "model": "resnet18-wide",
                "codec": "topk:0.0125",
            },
            num_rounds_planned=1000,
            network="mobile-4g",
            created_at=t0,
        )
        for index, name in enumerate(SITES):
            repo.add_site(run_id, name=name, node_id=2**64 - 1 - index, num_examples=123456)
        for step in range(1, ROUNDS + 1):
            start = 1000.0 * step
            checkpoint = checkpoints / f"run-1-round-{step:04d}.pt"
            checkpoint.write_bytes(b"x")
            repo.record_round(
                run_id,
                round=step,
                model_version=9000 + step,
                started_at=t0 + 100 * step,
                finished_at=t0 + 100 * step + 1234.5,
                metrics={"accuracy": 0.123456789, "loss": 12345.678, "site_accuracy": 0.98765},
                train_loss=1234.5678,
                virtual_started_at=start,
                virtual_finished_at=start + 98765.4,
                run_warning="round 3: training diverged: [loss] 1.2345e+05" if step == 3 else None,
                checkpoint=CheckpointInput(
                    path=str(checkpoint), size_bytes=987_654_321, kept=step % 5 == 0
                ),
                updates=[
                    UpdateInput(
                        site=name,
                        dispatched_round=step,
                        version_trained_on=9000 + step - 1 - index,
                        staleness=(step * (index + 1)) % 11,
                        bytes_up=0 if status == "dropped" else 1_234_567_890,
                        bytes_down=1_234_567_890,
                        status=status,
                        reason=None if status == "applied" else LONG_REASON,
                        dispatched_at=t0 + 100 * step,
                        arrived_at=None if status == "dropped" else t0 + 100 * step + 1234.5,
                        num_examples=123456,
                        train_loss=1234.5678,
                        compute_seconds=12345.678,
                        virtual_dispatched_at=start,
                        virtual_arrived_at=start + 98765.4,
                        virtual_compute_seconds=12345.6,
                        transfer_seconds=1234.5,
                        period=step,
                        average_applied=max(0, step - 13),
                        delay=12,
                    )
                    for index, (name, status) in enumerate(zip(SITES, STATUSES, strict=True))
                ],
                evaluations=[
                    EvaluationInput(
                        site=name,
                        model_version=9000 + step,
                        bytes_up=123_456_789,
                        bytes_down=1_234_567_890,
                        status="evaluated",
                        dispatched_at=t0 + 100 * step,
                        arrived_at=t0 + 100 * step + 12,
                        num_examples=12345,
                        loss=12345.678,
                        accuracy=0.98765,
                    )
                    for name in SITES
                ],
            )
        repo.add_traffic(
            run_id,
            [
                TrafficInput(
                    site=name, kind="query", messages=1, bytes_up=123_456, bytes_down=12_345
                )
                for name in SITES
            ],
        )
        late = [
            TrafficInput(
                site=SITES[3], kind="evaluate", messages=123, bytes_up=1_234_567_890, bytes_down=0
            )
        ]
        repo.add_traffic(run_id, late, round=ROUNDS)
        repo.add_event(
            run_id,
            "resumed",
            {
                "by": "host-with-a-long-name.example.org:123456",
                "from_round": 7,
                "reason": "x" * 200,
            },
        )
        repo.finish_run(
            run_id,
            status="failed",
            error="stopped by the user (SIGINT) after the SuperLink at 10.0.0.1:9092 went away",
            final_metrics={"accuracy": 0.123456789},
            finished_at=t0 + 98765.4,
            simulated_seconds=987654.3,
        )

        own = repo.create_run(
            name="my-own-app",
            strategy="FedAvgWithAVeryLongClassName",
            seed=0,
            config={"learning-rate": 0.01},
            num_rounds_planned=3,
            created_at=t0 + 1,
        )
        repo.add_site(own, name="a", node_id=1)
        repo.record_round(
            own,
            round=1,
            model_version=1,
            started_at=t0 + 2,
            finished_at=t0 + 3,
            metrics={"accuracy": 0.5},
            train_loss=0.7,
            updates=[
                UpdateInput(
                    site="a",
                    dispatched_round=1,
                    version_trained_on=0,
                    staleness=0,
                    bytes_up=1000,
                    bytes_down=1000,
                    status="applied",
                    dispatched_at=t0 + 2,
                    arrived_at=t0 + 3,
                )
            ],
        )
        repo.finish_run(own, status="finished", finished_at=t0 + 4)

        repo.create_run(
            name="still going",
            strategy="local-sgd",
            seed=7,
            config={"strategy": "local-sgd", "sync": "sync", "k": 2, "model": "mlp"},
            num_rounds_planned=20,
            network="world",
            created_at=t0 + 5,
        )
