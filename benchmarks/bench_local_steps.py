"""Local steps, outer optimizers and delayed updates on a language model and a CNN.

Two tasks, 8 sites on the world network:

- ``text_lm`` (default): the byte-level transformer of ``examples/text_lm`` (471k
  parameters, 64-byte windows), each site holding other packages of the standard library's
  source (non-IID by construction), the server's loss on the top-level modules no site
  holds; the sites' AdamW restarts every round;
- ``cnn``: the built-in app's CNN (two 3×3 convolution blocks, 16 and 32 channels, then
  Linear(1568, 64) and Linear(64, 10): 105,866 parameters, 95% of them in the first dense
  layer) on the built-in 28×28 MNIST sample (``mnist5k``), split across the sites by a
  Dirichlet draw (α = 0.5: each site holds a few classes mostly), the server's loss on
  the held-out test split; the sites' SGD (lr 0.1, momentum 0.9: the app's defaults)
  restarts every round.

Every plan spends the same site steps (``--rounds`` × ``--local-steps`` per site); "sync
sgd" communicates after every step (one step a round, a global batch of 8 sites' batches;
see below for what that step is):

- sync sgd: one local step a round, FedAvg's mean (the README's "every step" row);
- fedavg, fedavgm (server momentum 0.9, η = 0.7), diloco (Nesterov 0.9, η = 0.7:
  Douillard et al. 2023's outer step);
- dts: delayed updates (D = 1) with top-1% uploads, FedAvg's step;
- streaming diloco (Douillard et al. 2025): delayed updates with the model in 4 fragments,
  one synced a round (each every --local-steps steps, as DiLoCo's whole model), its outer
  Nesterov step reaching the sites one round late (τ = D = 1), 4-bit uploads.

Per run: the final loss (the mean of the last 3 evaluations), the simulated seconds and
the bytes (up + down, every site's) until the loss first reaches the target, and the
largest bytes of one sync after the first (one round's updates, or a delayed plan's
period's, both ways; the first sends every site the whole model in every plan). The
target is the loss sync sgd ends at plus 2%, unless ``--target-loss`` says otherwise.
Goals (issue "Frontier"): DiLoCo reaches the target in fewer rounds than FedAvgM;
streaming DiLoCo's largest sync moves at least 4× fewer bytes than DiLoCo's while its
final loss is at most 2% above DiLoCo's; and the best plan reaches the target at least 10×
sooner in simulated time than sync sgd. Streaming's fragments are whole arrays
(``strategies.fragments``): on the CNN, whose first dense layer is one fragment of 95% of
the model, its largest sync can only shrink by what 4-bit uploads save.

One Flower start-up per run, 6 runs a seed; on a 2-core machine with the defaults
(12 rounds of 20 steps) about 15 minutes a seed for text_lm, half of it sync sgd's 240
rounds, and about 4 for the CNN. The sites' optimizer restarts every round, so sync sgd's
one step is the optimizer's first (for AdamW, about lr times the gradient's sign per
coordinate), averaged: the every-step baseline of these apps, not data-parallel training
with its optimizer state kept.

    python benchmarks/bench_local_steps.py [--task text_lm|cnn] [--seeds 0 1 2]
        [--rounds 12] [--local-steps 20] [--plans LABEL ...] [--target-loss L] [--out FILE]
    python benchmarks/bench_local_steps.py --summarise FILE   # means and goals of a saved run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from bench_support import emit, fresh_home

from flplatform.app.config import RunConfig
from flplatform.launch.app_directory import RunOverrides, plan_run, read_app
from flplatform.launch.simulation import run_app, run_simulation
from storage import LedgerRepository, RunRecord

APP = Path(__file__).resolve().parents[1] / "examples" / "text_lm"
TASKS = ("text_lm", "cnn")
# the CNN task: the built-in app's options besides the plan's
CNN = {"model": "cnn", "dataset": "mnist5k", "partition": "dirichlet", "alpha": 0.5}
SITES = 8
FINAL_ROUNDS = 3
TARGET_SLACK = 1.02  # the target: sync sgd's final loss plus 2%
MOMENTUM = {"server-momentum": 0.9, "server-lr": 0.7}
DILOCO = {**MOMENTUM, "server-nesterov": True}
FRAGMENTS = 4  # streaming DiLoCo's fragments (the paper's p)
# label → (strategy, the app's keys, rounds a period of --local-steps is split into: each
# round takes --local-steps / this many steps; None: one step a round)
PLANS: dict[str, tuple[str, dict[str, Any], int | None]] = {
    "sync sgd": ("local-sgd", {}, None),
    "fedavg": ("local-sgd", {}, 1),
    "fedavgm": ("local-sgd", MOMENTUM, 1),
    "diloco": ("local-sgd", DILOCO, 1),
    "dts": ("dts", {}, 1),
    # each fragment synced every --local-steps steps, one fragment every round
    "streaming diloco": (
        "delayed",
        {**DILOCO, "delay": 1, "fragments": FRAGMENTS, "codec": "int4"},
        FRAGMENTS,
    ),
}


def run_plan(
    app_dir: Path | None, db: str, label: str, seed: int, rounds: int, local_steps: int
) -> dict[str, Any]:
    """One run of the plan: ``flplatform run`` of text_lm's app (``app_dir``), or of the
    built-in app with the CNN (None); its rounds' losses, clocks and bytes."""
    strategy, keys, split = PLANS[label]
    steps = 1 if split is None else local_steps // split
    total_rounds = rounds * local_steps // steps  # the same site steps in every plan
    sites = tuple(f"site-{i}" for i in range(SITES))
    name = f"{label} seed {seed}"
    began = time.perf_counter()
    record: RunRecord
    if app_dir is None:
        options = {**CNN, **keys, "local-steps": steps, "strategy": strategy}
        options |= {"sites": ",".join(sites), "num-server-rounds": total_rounds}
        options |= {"network": "world", "seed": seed, "db": db, "name": name}
        record = run_simulation(RunConfig.from_mapping(options))
    else:
        items = [f"{key}={str(value).lower()}" for key, value in keys.items()]
        items.append(f"local-steps={steps}")
        given = RunOverrides(
            sites=sites,
            rounds=total_rounds,
            network="world",
            seed=seed,
            db=db,
            strategy=strategy,
            name=name,
            run_config=tuple(items),
        )
        record = run_app(plan_run(read_app(app_dir), given, tag=uuid.uuid4().hex))
    wall = time.perf_counter() - began
    with LedgerRepository.open(db) as repository:
        done = repository.list_rounds(record.id)
        # One sync's traffic: the updates of one period (delayed updates pipeline periods, so
        # a round's row may count the messages of two); local-SGD's period is its round.
        sync_bytes: dict[int, int] = {}
        for u in repository.list_updates(record.id):
            period = u.period if u.period is not None else u.dispatched_round
            sync_bytes[period] = sync_bytes.get(period, 0) + u.bytes_up + u.bytes_down
    return {
        "rounds": len(done),
        "local_steps": steps,
        "loss": [round(float(r.metrics["loss"]), 4) for r in done],
        "simulated_seconds": [r.virtual_finished_at for r in done],
        "bytes": [r.bytes_up + r.bytes_down for r in done],
        "sync_bytes": [sync_bytes[p] for p in sorted(sync_bytes)],
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
        # after the first, which sends every site the whole model in every plan
        "peak_round_bytes": max(run["sync_bytes"][1:], default=run["sync_bytes"][0]),
        "first_round_bytes": run["sync_bytes"][0],
        "wall_seconds": run["wall_seconds"],
    }


def measure_seed(
    task: str, seed: int, rounds: int, local_steps: int, target: float | None, plans: list[str]
) -> dict[str, Any]:
    """The plans on one seed, in a fresh home."""
    home = fresh_home()
    app_dir = None
    if task == "text_lm":
        app_dir = home / "text_lm"  # Flower builds its FAB from the directory: a clean copy
        shutil.copytree(APP, app_dir, ignore=shutil.ignore_patterns("__pycache__"))
    db = f"sqlite:///{home / 'ledger.db'}"
    runs = {label: run_plan(app_dir, db, label, seed, rounds, local_steps) for label in plans}
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
        values = [s["runs"][label][key] for s in per_seed if label in s["runs"]]
        return None if None in values or not values else round(statistics.mean(values), 4)

    keys = (
        *("final_loss", "round_to_target", "seconds_to_target", "bytes_to_target"),
        "peak_round_bytes",
    )
    means = {label: {key: mean(label, key) for key in keys} for label in PLANS}
    diloco, fedavgm, sync = means["diloco"], means["fedavgm"], means["sync sgd"]
    streaming = means["streaming diloco"]
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
            "streaming_4x_lower_peak_at_diloco_loss": streaming["peak_round_bytes"] is not None
            and diloco["peak_round_bytes"] is not None
            and diloco["peak_round_bytes"] >= 4 * streaming["peak_round_bytes"]
            and streaming["final_loss"] is not None
            and diloco["final_loss"] is not None
            and streaming["final_loss"] <= TARGET_SLACK * diloco["final_loss"],
            "best_10x_sooner_than_sync_sgd": best is not None
            and sync["seconds_to_target"] is not None
            and sync["seconds_to_target"] >= 10 * best,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=TASKS, default="text_lm")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=12, help="rounds of the local-step plans")
    parser.add_argument("--local-steps", type=int, default=20)
    parser.add_argument("--target-loss", type=float, default=None)
    parser.add_argument(
        "--plans",
        nargs="+",
        choices=list(PLANS),
        default=list(PLANS),
        help="run only these (without 'sync sgd', give --target-loss)",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument(
        "--summarise",
        type=Path,
        default=None,
        metavar="JSON",
        help="recompute the means and goals of a run's JSON (--out) instead of running",
    )
    args = parser.parse_args()
    if args.summarise is not None:
        saved = json.loads(args.summarise.read_text())
        emit({**saved, **summarise(saved["per_seed"])}, args.out)
        return
    if "sync sgd" not in args.plans and args.target_loss is None:
        parser.error("without the 'sync sgd' plan, give --target-loss")
    if args.local_steps % FRAGMENTS:
        parser.error(f"--local-steps must be a multiple of {FRAGMENTS} (streaming's rounds)")
    started = time.perf_counter()
    per_seed = [
        measure_seed(args.task, seed, args.rounds, args.local_steps, args.target_loss, args.plans)
        for seed in args.seeds
    ]
    emit(
        {
            "benchmark": f"local steps, outer optimizers and delayed updates on {args.task}",
            "task": args.task,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "setup": {
                "sites": SITES,
                "network": "world",
                "rounds": args.rounds,
                "local_steps": args.local_steps,
                "plans": {label: list(PLANS[label]) for label in args.plans},
            },
            "per_seed": per_seed,
            **summarise(per_seed),
            "wall_seconds": round(time.perf_counter() - started, 1),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
