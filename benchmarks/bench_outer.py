"""Outer optimizers of local-SGD averaging: heavy ball, Nesterov (DiLoCo) and delayed Nesterov.

The server step of local-SGD averaging is an optimizer on the "outer gradient" −Δ̄ (the
sites' mean change): none (FedAvg), heavy-ball momentum (FedAvgM), Nesterov momentum
(DiLoCo's outer step, Douillard et al. 2023) or, for the async modes, delayed Nesterov
(Liu et al. 2024: the momentum moves every N-th server step only; ``strategies.aggregation``).
The runs use the cross-silo demo's stragglers settings: the four world sites on digits
(Dirichlet α = 1), the small MLP, one local epoch an update, exponential compute times;
sync runs 12 rounds of 4 updates, k-async (K = 2) 24 steps of 2, the same site updates.

Per run and seed: the final accuracy (mean of the last 3 rounds: one round of digits' 360
test images moves it by up to 3 points), the simulated seconds to 90% and to the end.
Goals (issue "Frontier"): DiLoCo reaches 90% sooner than FedAvgM; k-async with delayed
Nesterov ends within 1 point of sync's accuracy and keeps its time advantage. The JSON's
``goals`` says whether each held on the mean over seeds.

Seven runs a seed, one Flower start-up each: about 5 minutes a seed on 2 cores.

    python benchmarks/bench_outer.py [--seeds 0 1 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from bench_support import emit, fresh_home

from flplatform.app.comparison import ModePlan, run_comparison
from flplatform.app.config import RunConfig
from flplatform.app.demo import COMMON
from flplatform.launch.simulation import run_simulation
from storage import LedgerRepository

TARGET = 0.9
FINAL_ROUNDS = 3
ROUNDS, K = 12, 2
STEPS = ROUNDS * 4 // K  # k-async's steps: as many site updates as sync's rounds
HEAVY = {"server-momentum": 0.9, "server-lr": 0.7}
NESTEROV = {**HEAVY, "server-nesterov": True}
# N = 4 sites / K: the momentum moves once per sync round's worth of updates; each step
# moves the model by η·Δ̄/N meanwhile. η = 1.0: HALoS's code scales DiLoCo's η by N (1.4),
# which ended 2.7 points lower here on the same seeds (0.904 against 0.932).
DELAYED = {**NESTEROV, "server-momentum-every": 2, "server-lr": 1.0}
KASYNC = {"sync": "k-async", "k": K}
PLANS = [
    ModePlan("sync fedavg", {"sync": "sync"}, ROUNDS),
    ModePlan("sync fedavgm", {"sync": "sync", **HEAVY}, ROUNDS),
    ModePlan("sync diloco", {"sync": "sync", **NESTEROV}, ROUNDS),
    ModePlan("k-async fedavg", KASYNC, STEPS),
    ModePlan("k-async fedavgm", {**KASYNC, **HEAVY}, STEPS),
    ModePlan("k-async nesterov", {**KASYNC, **NESTEROV}, STEPS),
    ModePlan("k-async delayed nesterov", {**KASYNC, **DELAYED}, STEPS),
]


def measure_seed(seed: int) -> dict[str, Any]:
    """Every plan on one seed, in a fresh home; each run's accuracy and simulated times."""
    home = fresh_home()
    base = RunConfig.from_mapping(
        {
            **COMMON,
            "network": "world",
            "model": "mlp",
            "local-epochs": 1,
            "local-steps": 0,
            "seed": seed,
            "db": f"sqlite:///{home / 'ledger.db'}",
        }
    )
    run_ids = run_comparison(base, PLANS, run=lambda config, plan: run_simulation(config))
    rows = {}
    with LedgerRepository.open(base.db) as repository:
        for plan, run_id in zip(PLANS, run_ids, strict=True):
            rounds = repository.list_rounds(run_id)
            accuracy = [float(r.metrics.get("accuracy") or 0.0) for r in rounds]
            reached = next((r for r, a in zip(rounds, accuracy, strict=True) if a >= TARGET), None)
            rows[plan.label] = {
                "final_accuracy": round(statistics.mean(accuracy[-FINAL_ROUNDS:]), 4),
                "last_accuracy": round(accuracy[-1], 4),
                "seconds_to_target": None if reached is None else reached.virtual_finished_at,
                "simulated_seconds": rounds[-1].virtual_finished_at,
            }
    return {"seed": seed, "runs": rows}


def summarise(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Each run's means over the seeds, and the goals judged on them."""

    def mean(label: str, key: str) -> float | None:
        values = [s["runs"][label][key] for s in per_seed]
        return None if None in values else statistics.mean(values)

    means = {
        plan.label: {
            "final_accuracy": mean(plan.label, "final_accuracy"),
            "seconds_to_target": mean(plan.label, "seconds_to_target"),
            "simulated_seconds": mean(plan.label, "simulated_seconds"),
        }
        for plan in PLANS
    }
    diloco, fedavgm = means["sync diloco"], means["sync fedavgm"]
    delayed, sync = means["k-async delayed nesterov"], means["sync fedavg"]
    return {
        "means": means,
        "goals": {
            "diloco_sooner_than_fedavgm": diloco["seconds_to_target"] is not None
            and (
                fedavgm["seconds_to_target"] is None
                or diloco["seconds_to_target"] < fedavgm["seconds_to_target"]
            ),
            "delayed_nesterov_within_1_point_of_sync": (delayed["final_accuracy"] or 0.0)
            >= (sync["final_accuracy"] or 0.0) - 0.01,
            "delayed_nesterov_sooner_than_sync": delayed["seconds_to_target"] is not None
            and (
                sync["seconds_to_target"] is None
                or delayed["seconds_to_target"] < sync["seconds_to_target"]
            ),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    started = time.perf_counter()
    per_seed = [measure_seed(seed) for seed in args.seeds]
    emit(
        {
            "benchmark": "outer optimizers on the demo's stragglers settings",
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "setup": {"plans": [vars(p) for p in PLANS], "target": TARGET},
            "per_seed": per_seed,
            **summarise(per_seed),
            "wall_seconds": round(time.perf_counter() - started, 1),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
