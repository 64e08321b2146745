"""End to end at 10M parameters: a user's Flower app under plain Flower and under flplatform.

The same Flower app (``benchmarks/apps/big_app``: its own 64 → 133 000 → 10 MLP on
scikit-learn's digits, 9 975 010 parameters, 4 sites, 10 local SGD steps of 32 per round,
its ClientApp wrapped in ``flplatform_mod()``) is run, interleaved, by:

- plain ``flwr run APP local`` on a simulation SuperLink, with Flower's own ``FedAvg``;
- ``flplatform run APP`` with local-SGD averaging, DTS (delayed updates, D = 1, with
  top-1% uploads and error feedback) and FetchSGD (k = 1% of the model, a 5 × 200 000
  sketch), each with the platform's ledger, guard and engine.

Both ServerApps time their rounds the same way (the central ``evaluate_fn`` both call
after each step writes a timestamp); a round's wall time is the time between two of
them, and ``steady_round_seconds`` is the median over the rounds after the first two.
Peak resident memory of the ServerApp process and of each site's process (the
simulation's actors) come from the same reports. Each configuration runs ``--repeats``
times, in turns (plain, local-SGD, DTS, FetchSGD, plain, ...), so that a slow spell of
the machine hits them alike; the ratio to plain Flower is taken on the medians.

Goal (issue "Scale"): steady-round wall time at most 1.15× plain Flower for local-SGD and
at most 1.3× for DTS and FetchSGD.

    python benchmarks/bench_end_to_end.py [--rounds 10] [--repeats 2] [--out report.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_support import emit

from flplatform.launch.flower import federation_options, flower_environment, start_superlink
from flplatform.launch.processes import ProcessTree

APP = Path(__file__).resolve().parent / "apps" / "big_app"
SITES = 4
GOALS = {"local-sgd": 1.15, "dts": 1.3, "fetchsgd": 1.3}
PLAIN = "plain flwr run + FedAvg"
BIN = Path(sys.executable).parent


def read_reports(directory: Path) -> dict[str, list[dict[str, Any]]]:
    """Every ``<name>.jsonl`` the app wrote: name → its lines."""
    return {
        path.stem: [json.loads(line) for line in path.read_text().splitlines() if line]
        for path in sorted(directory.glob("*.jsonl"))
    }


def summarize(directory: Path, wall: float) -> dict[str, Any]:
    """Round times from the server's reports, peak memory from every process's."""
    reports = read_reports(directory)
    server = sorted(reports.get("server", []), key=lambda r: r["time"])
    times = [r["time"] for r in server]
    rounds = [b - a for a, b in zip(times, times[1:], strict=False)]
    sites = {k: v for k, v in reports.items() if k.startswith("site-")}
    return {
        "round_seconds": [round(s, 3) for s in rounds],
        "steady_round_seconds": statistics.median(rounds[2:]) if len(rounds) > 2 else None,
        "server_peak_rss_mib": max((r["peak_rss_mib"] for r in server), default=None),
        "site_peak_rss_mib": max(
            (r["peak_rss_mib"] for lines in sites.values() for r in lines), default=None
        ),
        "wall_seconds": round(wall, 1),
    }


def run_plain(home: Path, rounds: int, directory: Path) -> float:
    """``flwr run APP local`` with Flower's FedAvg on a SuperLink of its own."""
    env = flower_environment(home)
    tree = ProcessTree()
    try:
        start_superlink(env, home=home, log_name="plain", tree=tree)
        started = time.perf_counter()
        overrides = f'server="flower" num-server-rounds={rounds} timing-dir="{directory}"'
        result = subprocess.run(
            [str(BIN / "flwr"), "run", str(APP), "local", "--stream", "--federation-config",
             federation_options(SITES), "--run-config", overrides],
            env=env, cwd=str(home), capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"flwr run failed: {result.stdout[-1500:]}{result.stderr[-1500:]}")
        return time.perf_counter() - started
    finally:
        tree.stop()


def run_ours(home: Path, rounds: int, directory: Path, strategy: str) -> float:
    """``flplatform run APP`` with one of the platform's strategies."""
    env = {**os.environ, "FLPLATFORM_HOME": str(home), "FLWR_HOME": str(home / "flwr")}
    started = time.perf_counter()
    result = subprocess.run(
        [str(BIN / "flplatform"), "run", str(APP), "--sites", str(SITES), "--rounds", str(rounds),
         "-c", "server=flplatform", "-c", f"strategy={strategy}", "-c", f"timing-dir={directory}",
         "--db", f"sqlite:///{home / 'ledger.db'}", "--name", f"e2e-{strategy}"],
        env=env, cwd=str(home), capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"flplatform run failed: {result.stdout[-1500:]}{result.stderr[-1500:]}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", nargs="+", choices=sorted(GOALS), default=sorted(GOALS))
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()

    runs: dict[str, list[dict[str, Any]]] = {PLAIN: [], **{s: [] for s in args.only}}
    with tempfile.TemporaryDirectory(prefix="flplatform-e2e-") as tmp:
        root = Path(tmp)
        for repeat in range(args.repeats):
            for name in runs:
                home = root / f"{repeat}-{name.split()[0]}"
                directory = home / "reports"
                directory.mkdir(parents=True)
                if name == PLAIN:
                    wall = run_plain(home, args.rounds, directory)
                else:
                    wall = run_ours(home, args.rounds, directory, name)
                runs[name].append(summarize(directory, wall))
                print(name, json.dumps(runs[name][-1]), file=sys.stderr)

    def median_of(name: str, key: str) -> float | None:
        values = [r[key] for r in runs[name] if r[key] is not None]
        return statistics.median(values) if values else None

    plain = median_of(PLAIN, "steady_round_seconds")
    results = {}
    for name in runs:
        steady = median_of(name, "steady_round_seconds")
        results[name] = {
            "steady_round_seconds": steady,
            "ratio_to_plain": round(steady / plain, 3) if steady and plain else None,
            "goal_ratio": GOALS.get(name),
            "server_peak_rss_mib": median_of(name, "server_peak_rss_mib"),
            "site_peak_rss_mib": median_of(name, "site_peak_rss_mib"),
            "runs": runs[name],
        }
    report = {
        "benchmark": "end-to-end steady round, 10M-parameter app, 4 sites, 10 local steps",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "rounds": args.rounds,
        "repeats": args.repeats,
        "results": results,
        "goal_met": all(
            r["ratio_to_plain"] is not None and r["ratio_to_plain"] <= r["goal_ratio"]
            for name, r in results.items()
            if name != PLAIN
        ),
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
