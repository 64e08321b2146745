"""The server's peak memory with many sites and a large model: 100 sites × 10M parameters.

Drives the real ``RoundEngine`` (the platform's default update guard on, ``LocalSGDAveraging``,
the SQLite ledger) over ``bench_round``'s replay Grid: every training message is answered
at once with a fresh 10M-parameter model (each reply owns its 40 MB, as one decoded off the
network does), so the server alone is measured, with every site's reply ready as soon as
it is asked for. Modes: ``k-async`` with K of the sites per round (every idle site is
given work at once: all 100 are in flight, each on the version it was sent), and
``sync`` with all of them. Peak memory is Python's own (``tracemalloc``: NumPy's arrays
and Flower's bytes) over the whole run, the first round included (it allocates the
server's model-sized state, and is where the guard used to hold every update until the
round closed), and the process's peak resident set.

What the server may hold, in units of the model's float32 size M: its model-sized state
(the model as float64 and its record, the float64 sums and the spent step: about 7 M,
see ``strategies.local_sgd``), the older model versions that outstanding messages were
trained on (k-async: the versions still in flight), one pull chunk of replies
(``PULL_CHUNK`` = 16 M) and the guard's held updates: at most ``min_reference`` − 1 of
them (two) in the first round, since the guard judges them as soon as it has a reference
(it held every first-round update until the round closed before).

Goal (issue "Scale"): peak memory below ``(BOUND_STATE + PULL_CHUNK + versions) · M``,
independent of the number of sites, with ``versions`` the model versions in flight (the
largest staleness seen + 1, reported). ``--sites 10 100`` shows it does not grow with the
sites.

Measured on this project's 2-core machine (10M parameters, M = 38 MiB; peak in M):

    mode      sites  rounds   before   after   versions   bound
    sync        10      3       24      18        1         25
    sync       100      3      204      24        1         25
    k-async     10      4       --      18        1         25
    k-async    100      4       44      --        4         28
    k-async    100      8       --      28.5      8         32
    k-async    100     20       --      32.5     10         34

"Before": the guard held every first-round update until the round closed (sync, 100
sites: 7.6 GiB), and in the K modes the engine pulled a chunk of replies before judging
the ones a round had left queued, so each round of K = 10 left 6 more replies in memory
(44 M after 4 rounds and growing towards one reply per site in flight). Now the guard
judges as soon as it has a reference, and the engine judges what it holds before it
pulls more. What still grows in k-async is the versions in flight: with 100 sites and
K = 10 a message waits about ten rounds, so about ten versions are kept (a staleness
bound caps them).

    python benchmarks/bench_server_memory.py [--sites 10 100] [--params 10000000]
        [--mode k-async] [--k 10] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
from bench_round import ReplayGrid, model_shapes
from flwr.app import Array, ArrayRecord
from flwr.supercore.task_identity import TaskIdentity

from flplatform.engine import RoundSummary, Synchrony
from flplatform.engine.engine import PULL_CHUNK, RoundEngine
from flplatform.engine.guard import GuardOptions, UpdateGuard
from flplatform.run.ledger import SqlLedger
from storage import LedgerRepository
from strategies.local_sgd import LocalSGDAveraging

BOUND_STATE = 8  # model-sized state, in M (float32 model sizes), with a little slack


def run(sites: int, params: int, mode: str, k: int, rounds: int, workdir: Path) -> dict[str, Any]:
    """One federation of ``sites`` replay sites: its peak memory, the versions in flight."""
    shapes = model_shapes(params)
    grid = ReplayGrid(sites, shapes)
    repo = LedgerRepository.open(f"sqlite:///{workdir / f'memory-{sites}-{time.time_ns()}.db'}")
    run_id = repo.create_run(
        name="bench", strategy="local-sgd", seed=0, config={}, num_rounds_planned=rounds
    )
    engine = RoundEngine(
        grid,
        LocalSGDAveraging(),
        policy=Synchrony(mode, k=k) if mode != "sync" else Synchrony("sync"),
        ledger=SqlLedger(repo, run_id),
        required_sites=sites,
        poll_interval=0.0,
        guard=UpdateGuard(GuardOptions()),
    )
    rng = np.random.default_rng(1)
    initial = ArrayRecord(
        {name: Array(rng.normal(size=s).astype(np.float32)) for name, s in shapes.items()}
    )
    engine.discover_sites()
    engine.discover_sites = lambda: engine.sites  # type: ignore[method-assign]
    peaks: list[float] = []
    stale: list[int] = []
    started = time.perf_counter()

    def finished(summary: RoundSummary) -> None:
        peaks.append(tracemalloc.get_traced_memory()[1])  # the peak so far, round 1 included
        stale.extend(u.staleness for u in summary.updates if u.staleness is not None)

    engine.on_round = finished
    tracemalloc.start()
    try:
        engine.run(initial, num_rounds=rounds)
    finally:
        tracemalloc.stop()
        repo.close()
    model_bytes = 4 * sum(int(np.prod(s)) for s in shapes.values())
    peak = max(peaks)
    versions = max(stale, default=0) + 1
    bound = (BOUND_STATE + PULL_CHUNK + versions) * model_bytes
    return {
        "sites": sites,
        "peak_traced_mib": round(peak / 2**20, 1),
        "peak_in_models": round(peak / model_bytes, 2),
        "max_staleness": versions - 1,
        "bound_in_models": BOUND_STATE + PULL_CHUNK + versions,
        "within_bound": peak <= bound,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--params", type=int, default=10_000_000)
    parser.add_argument("--mode", default="k-async", help="sync or a K mode (k-async, k-sync)")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        results = [
            run(n, args.params, args.mode, args.k, args.rounds, Path(tmp)) for n in args.sites
        ]
    model_mib = 4 * args.params / 2**20
    print(
        json.dumps(
            {
                "benchmark": "server_peak_memory",
                "model_parameters": args.params,
                "model_mib": round(model_mib, 1),
                "mode": args.mode,
                "k": args.k if args.mode != "sync" else None,
                "guard": "platform default",
                "pull_chunk": PULL_CHUNK,
                "results": results,
                "process_peak_rss_mib": round(
                    resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1
                ),
                "goal": "peak below (BOUND_STATE + PULL_CHUNK + model versions in flight) "
                f"model sizes, BOUND_STATE = {BOUND_STATE}, whatever the number of sites",
                "goal_met": all(r["within_bound"] for r in results),
                "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
