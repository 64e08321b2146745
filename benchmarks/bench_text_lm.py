"""Local steps, outer optimizers and delayed updates on a language model: examples/text_lm.

The byte-level transformer of ``examples/text_lm`` (471k parameters, 64-byte windows), 8
sites on the world network, each holding other packages of the standard library's source
(non-IID by construction), the server's loss on the top-level modules no site holds. Every
plan spends the same site steps (``--rounds`` × ``--local-steps`` per site, AdamW restarted
each round); "sync sgd" communicates after every step (one step a round, a global batch
of 8 × 32 windows; see below for what that step is):

- sync sgd: one local step a round, FedAvg's mean (the README's "every step" row);
- fedavg, fedavgm (server momentum 0.9, η = 0.7), diloco (Nesterov 0.9, η = 0.7:
  Douillard et al. 2023's outer step);
- dts: delayed updates (D = 1) with top-1% uploads, FedAvg's step.

Per run: the final loss (nats per byte, the mean of the last 3 evaluations), the simulated
seconds and the bytes (up + down, every site's) until the loss first reaches the target,
and the largest bytes of one round. The target is the loss sync sgd ends at plus 2%, unless
``--target-loss`` says otherwise. Goals (issue "Frontier"): DiLoCo reaches the target in
fewer rounds than FedAvgM, and the best plan reaches it at least 10× sooner in simulated
time than sync sgd.

One Flower start-up per run, 5 runs a seed; on a 2-core machine with the defaults
(12 rounds of 20 steps) 10 to 15 minutes a seed, half of it sync sgd's 240 rounds. The
sites' AdamW restarts every round, so sync sgd's one step is AdamW's first (about lr times
the gradient's sign per coordinate), averaged: the every-step baseline of this app, not
data-parallel AdamW with its optimizer state kept.

    python benchmarks/bench_text_lm.py [--seeds 0 1 2] [--rounds 12] [--local-steps 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from bench_support import emit, fresh_home

from flplatform.launch.app_directory import RunOverrides, plan_run, read_app
from flplatform.launch.simulation import run_app
from storage import LedgerRepository

APP = Path(__file__).resolve().parents[1] / "examples" / "text_lm"
SITES = 8
FINAL_ROUNDS = 3
TARGET_SLACK = 1.02  # the target: sync sgd's final loss plus 2%
MOMENTUM = {"server-momentum": 0.9, "server-lr": 0.7}
# label → (strategy, the app's keys, local steps a round: None for --local-steps)
PLANS: dict[str, tuple[str, dict[str, Any], int | None]] = {
    "sync sgd": ("local-sgd", {}, 1),
    "fedavg": ("local-sgd", {}, None),
    "fedavgm": ("local-sgd", MOMENTUM, None),
    "diloco": ("local-sgd", {**MOMENTUM, "server-nesterov": True}, None),
    "dts": ("dts", {}, None),
}


def run_plan(
    app_dir: Path, db: str, label: str, seed: int, rounds: int, local_steps: int
) -> dict[str, Any]:
    """One ``flplatform run`` of the app; its rounds' losses, clocks and bytes."""
    strategy, keys, steps = PLANS[label]
    steps = steps or local_steps
    total_rounds = rounds * local_steps // steps  # the same site steps in every plan
    items = [f"{key}={str(value).lower()}" for key, value in keys.items()]
    items.append(f"local-steps={steps}")
    given = RunOverrides(
        sites=tuple(f"site-{i}" for i in range(SITES)),
        rounds=total_rounds,
        network="world",
        seed=seed,
        db=db,
        strategy=strategy,
        name=f"{label} seed {seed}",
        run_config=tuple(items),
    )
    plan = plan_run(read_app(app_dir), given, tag=uuid.uuid4().hex)
    began = time.perf_counter()
    record = run_app(plan)
    wall = time.perf_counter() - began
    with LedgerRepository.open(db) as repository:
        done = repository.list_rounds(record.id)
    return {
        "rounds": len(done),
        "local_steps": steps,
        "loss": [round(float(r.metrics["loss"]), 4) for r in done],
        "simulated_seconds": [r.virtual_finished_at for r in done],
        "bytes": [r.bytes_up + r.bytes_down for r in done],
        "wall_seconds": round(wall, 1),
    }


def to_target(run: dict[str, Any], target: float) -> dict[str, Any]:
    """Where ``run`` first reached ``target``: its round, simulated seconds and bytes so far."""
    final = statistics.mean(run["loss"][-FINAL_ROUNDS:])
    reached = next((i for i, loss in enumerate(run["loss"]) if loss <= target), None)
    return {
        "final_loss": round(final, 4),
        "round_to_target": None if reached is None else reached + 1,
        "seconds_to_target": None if reached is None else run["simulated_seconds"][reached],
        "bytes_to_target": None if reached is None else sum(run["bytes"][: reached + 1]),
        "simulated_seconds": run["simulated_seconds"][-1],
        "bytes_total": sum(run["bytes"]),
        "peak_round_bytes": max(run["bytes"]),
        "wall_seconds": run["wall_seconds"],
    }


def measure_seed(seed: int, rounds: int, local_steps: int, target: float | None) -> dict[str, Any]:
    """Every plan on one seed, in a fresh home."""
    home = fresh_home()
    app_dir = home / "text_lm"  # Flower builds its FAB from the directory: a clean copy
    shutil.copytree(APP, app_dir, ignore=shutil.ignore_patterns("__pycache__"))
    db = f"sqlite:///{home / 'ledger.db'}"
    runs = {label: run_plan(app_dir, db, label, seed, rounds, local_steps) for label in PLANS}
    if target is None:
        target = statistics.mean(runs["sync sgd"]["loss"][-FINAL_ROUNDS:]) * TARGET_SLACK
    return {
        "seed": seed,
        "target_loss": round(target, 4),
        "runs": {label: to_target(run, target) for label, run in runs.items()},
        "curves": {label: run["loss"] for label, run in runs.items() if label != "sync sgd"},
    }


def summarise(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Each plan's means over the seeds (None where a seed missed the target), and the goals."""

    def mean(label: str, key: str) -> float | None:
        values = [s["runs"][label][key] for s in per_seed]
        return None if None in values else round(statistics.mean(values), 4)

    keys = ("final_loss", "round_to_target", "seconds_to_target", "bytes_to_target")
    means = {label: {key: mean(label, key) for key in keys} for label in PLANS}
    diloco, fedavgm, sync = means["diloco"], means["fedavgm"], means["sync sgd"]
    local = [m["seconds_to_target"] for label, m in means.items() if label != "sync sgd"]
    best = min((s for s in local if s is not None), default=None)
    return {
        "means": means,
        "goals": {
            "diloco_fewer_rounds_than_fedavgm": diloco["round_to_target"] is not None
            and (
                fedavgm["round_to_target"] is None
                or diloco["round_to_target"] < fedavgm["round_to_target"]
            ),
            "best_10x_sooner_than_sync_sgd": best is not None
            and sync["seconds_to_target"] is not None
            and sync["seconds_to_target"] >= 10 * best,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=12, help="rounds of the local-step plans")
    parser.add_argument("--local-steps", type=int, default=20)
    parser.add_argument("--target-loss", type=float, default=None)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    started = time.perf_counter()
    per_seed = [
        measure_seed(seed, args.rounds, args.local_steps, args.target_loss) for seed in args.seeds
    ]
    emit(
        {
            "benchmark": "local steps, outer optimizers and delayed updates on text_lm",
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "setup": {
                "sites": SITES,
                "network": "world",
                "rounds": args.rounds,
                "local_steps": args.local_steps,
                "plans": {label: [s, k, n] for label, (s, k, n) in PLANS.items()},
            },
            "per_seed": per_seed,
            **summarise(per_seed),
            "wall_seconds": round(time.perf_counter() - started, 1),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
