"""The default demo as a user runs it, against one plain run of the same size, in one benchmark run.

Runs ``flplatform demo cross-silo`` (three panels, 13 runs, one Flower start-up) and one
``flplatform simulate`` run with as many rounds as the demo's runs together, on the same
four sites (digits, the world network, 10 local steps per round), each in a fresh
FLPLATFORM_HOME, and times both commands whole (start-up included). Then it reads each
panel's runs back from the demo's ledger and reports its verdict: which run reached the
panel's target first, its cost (simulated seconds or upload bytes) and the factor against
the panel's reference.

Goals (issue: fast simulation): the demo takes at most 1.5× the single run's wall time,
and at most 60 s on a quiet 2-core machine after set-up. The load average before and
after each command is in the report: on a shared machine both times stretch.

    python benchmarks/bench_demo.py [--seed 0] [--order demo-first|simulate-first] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_support import emit

from flplatform.app.comparison import summarize_runs
from flplatform.app.demo import build_panels, judge, sweep_members
from storage import LedgerRepository

GOAL_RATIO = 1.5
GOAL_SECONDS = 60.0
FLPLATFORM = str(Path(sys.executable).parent / "flplatform")


def timed(args: list[str]) -> dict[str, Any]:
    """Run ``flplatform ARGS`` in a fresh home; its wall seconds, load and ledger."""
    home = Path(tempfile.mkdtemp(prefix="flplatform-bench-demo-"))
    db = f"sqlite:///{home / 'ledger.db'}"
    env = {
        **os.environ,
        "FLPLATFORM_HOME": str(home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "COLUMNS": "100",
    }
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    done = subprocess.run(
        [FLPLATFORM, *args, "--db", db],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    seconds = time.perf_counter() - started
    result: dict[str, Any] = {
        "command": " ".join(["flplatform", *args]),
        "wall_seconds": round(seconds, 1),
        "load_average_before": round(load_before, 2),
        "load_average_after": round(os.getloadavg()[0], 2),
        "db": db,
        "home": str(home),
    }
    if done.returncode != 0:
        result["error"] = (done.stderr or done.stdout)[-800:]
    return result


def verdicts(db: str, seed: int) -> list[dict[str, Any]]:
    """Each panel's verdict, read from the demo's ledger (its runs by name)."""
    panels = build_panels(seed=seed)
    out = []
    with LedgerRepository.open(db) as repository:
        ids = {run.name: run.id for run in repository.list_runs()}
        for panel in panels:
            summaries = summarize_runs(
                repository, [ids[m.run_name] for m in panel.members], target=panel.target
            )
            verdict = judge(panel, summaries)
            out.append(
                {
                    "panel": panel.key,
                    "measure": f"{panel.measure} to {panel.target}",
                    "winner": None if verdict.winner is None else verdict.winner.name,
                    "winner_cost": None if verdict.winner is None else verdict.winner.cost,
                    "reference": verdict.reference.name,
                    "reference_cost": verdict.reference.cost,
                    "factor": None if verdict.factor is None else round(verdict.factor, 2),
                    "not_reached": [row.name for row in verdict.not_reached],
                    "runs": [
                        {
                            "name": row.name,
                            "cost": row.cost,
                            "versus_reference": None
                            if row.versus_reference is None
                            else round(row.versus_reference, 2),
                            "final_accuracy": row.final_accuracy,
                            "rounds": row.rounds,
                        }
                        for row in verdict.rows
                    ],
                }
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--order", choices=("demo-first", "simulate-first"), default="demo-first")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()

    members = sweep_members(build_panels(seed=args.seed))
    rounds = sum(m.num_server_rounds for m in members)
    demo_args = ["demo", "cross-silo", "--seed", str(args.seed)]
    single_args = ["simulate", "--rounds", str(rounds), "--seed", str(args.seed)]
    single_args += ["--network", "world", "--local-steps", "10", "--alpha", "1.0"]
    commands = {"demo": demo_args, "simulate": single_args}
    order = ["demo", "simulate"] if args.order == "demo-first" else ["simulate", "demo"]
    measured = {name: timed(commands[name]) for name in order}
    demo, single = measured["demo"], measured["simulate"]
    ratio = (
        None
        if "error" in demo or "error" in single
        else round(demo["wall_seconds"] / single["wall_seconds"], 3)
    )
    report = {
        "benchmark": "demo_cross_silo",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "demo_runs": len(members),
        "total_rounds": rounds,
        "sites": list(members[0].sites),
        "demo": demo,
        "single_run_of_the_same_size": single,
        "ratio": ratio,
        "goals": {
            "ratio": f"<= {GOAL_RATIO}",
            "demo_wall_seconds": f"<= {GOAL_SECONDS} on a quiet 2-core machine",
        },
        "meets_ratio": ratio is not None and ratio <= GOAL_RATIO,
        "meets_seconds": "error" not in demo and demo["wall_seconds"] <= GOAL_SECONDS,
        "panels": [] if "error" in demo else verdicts(demo["db"], args.seed),
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
