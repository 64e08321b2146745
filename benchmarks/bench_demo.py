"""The default demo, as a user runs it: wall time (start-up included) and final accuracy.

Runs ``flplatform demo cross-silo`` in a fresh FLPLATFORM_HOME for each seed and reads the
result from the ledger. Targets (issue: foundation): at least 93% test accuracy and at
most 120 s on a 2-core machine.

    python benchmarks/bench_demo.py [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from storage import LedgerRepository

TARGET_ACCURACY = 0.93
TARGET_SECONDS = 120.0


def run_demo(seed: int) -> dict:
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "FLPLATFORM_HOME": home}
        started = time.perf_counter()
        done = subprocess.run(
            [
                str(Path(sys.executable).parent / "flplatform"),
                "demo",
                "cross-silo",
                "--seed",
                str(seed),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        seconds = time.perf_counter() - started
        if done.returncode != 0:
            return {"seed": seed, "error": (done.stderr or done.stdout)[-500:]}
        with LedgerRepository.open(f"sqlite:///{home}/ledger.db") as repo:
            (run,) = repo.list_runs()
            rounds = repo.list_rounds(run.id)
        accuracy = (run.final_metrics or {}).get("accuracy")
        return {
            "seed": seed,
            "wall_seconds_with_startup": round(seconds, 1),
            "run_wall_seconds": round(run.wall_seconds or 0.0, 1),
            "final_accuracy": accuracy,
            "rounds": len(rounds),
            "bytes_up": sum(r.bytes_up for r in rounds),
            "bytes_down": sum(r.bytes_down for r in rounds),
            "meets_targets": bool(
                accuracy is not None and accuracy >= TARGET_ACCURACY and seconds <= TARGET_SECONDS
            ),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = parser.parse_args()
    results = [run_demo(seed) for seed in args.seeds]
    print(
        json.dumps(
            {
                "benchmark": "demo_cross_silo",
                "cpus": os.cpu_count(),
                "targets": {"accuracy": TARGET_ACCURACY, "seconds": TARGET_SECONDS},
                "results": results,
                "all_meet_targets": all(r.get("meets_targets") for r in results),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
