"""Count-sketch kernel: sketch, estimate and top-k next to reference passes, as JSON.

For each d: r = 5 rows, k = d/1000, c = 5k columns. Times (median of ``--repeats``) of
sketching a d-vector, estimating all d coordinates, and selecting the top-k from the estimates;
next to reference passes measured in the same run: five ``index_add_`` passes with precomputed
random indices into the 5 × c table (the unavoidable scatter work, but with 5·d stored int64
indices) and one dense copy of the vector (memory bandwidth).

Goals (issue 5): sketching within 1.2× of the five index_add_ passes while storing no r × d
index tables (the sketch keeps two small hash tables, reported in bytes); estimation plus top-k
within 2× of sketching. Times are medians, and on a shared 2-core machine single runs vary by
about ±10%: use ``--repeats 5`` or more when a ratio is near its goal.

    python benchmarks/bench_sketch.py [--dims 1000000 10000000 50000000] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from strategies.count_sketch import CountSketch, top_k_indices

ROWS = 5
SKETCH_GOAL = 1.2
QUERY_GOAL = 2.0


def timed(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    """Median seconds of ``repeats`` calls after one warm-up call."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_one(d: int, device: torch.device, repeats: int, seed: int) -> dict[str, Any]:
    k = max(1, d // 1000)
    cols = 5 * k
    sketch = CountSketch.from_seed(d, rows=ROWS, cols=cols, seed=seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    g = torch.randn(d, generator=gen, device=device)  # (d,)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    table = sketch.sketch(g)
    est = sketch.estimate(table)
    t_sketch = timed(lambda: sketch.sketch(g), repeats, sync)
    t_estimate = timed(lambda: sketch.estimate(table), repeats, sync)
    t_topk = timed(lambda: top_k_indices(est.abs(), k), repeats, sync)
    t_topk_total = timed(lambda: sketch.top_k(table, k), repeats, sync)
    hashes = sketch._tables(table.device)
    hash_table_bytes = sum(t.numel() * t.element_size() for t in (hashes.low, hashes.high))
    sketch_peak = (
        torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    )  # bytes, CUDA only

    # reference: stored random indices, one index_add_ per row into the flat 5 × c table
    index = torch.randint(0, cols, (ROWS, d), generator=gen, device=device)  # (5, d) int64
    index += torch.arange(ROWS, device=device).view(-1, 1) * cols

    def five_index_add() -> None:
        flat = torch.zeros(ROWS * cols, device=device)
        for j in range(ROWS):
            flat.index_add_(0, index[j], g)

    t_index_add = timed(five_index_add, repeats, sync)
    out = torch.empty_like(g)
    t_copy = timed(lambda: out.copy_(g), repeats, sync)
    index_bytes = index.numel() * index.element_size()

    result: dict[str, Any] = {
        "d": d,
        "rows": ROWS,
        "cols": cols,
        "k": k,
        "seconds": {
            "sketch": t_sketch,
            "estimate_all": t_estimate,
            "topk_of_estimates": t_topk,
            "top_k_method": t_topk_total,
            "ref_five_index_add": t_index_add,
            "ref_dense_copy": t_copy,
        },
        "ratios": {
            "sketch_over_index_add": t_sketch / t_index_add,
            "estimate_plus_topk_over_sketch": (t_estimate + t_topk) / t_sketch,
            "sketch_over_dense_copy": t_sketch / t_copy,
        },
        "goals_met": {
            f"sketch_within_{SKETCH_GOAL}x_index_add": t_sketch <= SKETCH_GOAL * t_index_add,
            f"estimate_plus_topk_within_{QUERY_GOAL}x_sketch": t_estimate + t_topk
            <= QUERY_GOAL * t_sketch,
        },
        "memory_bytes": {
            "table": table.numel() * table.element_size(),
            "vector": g.numel() * g.element_size(),
            "estimates": est.numel() * est.element_size(),
            "reference_index_tables": index_bytes,
            # what the sketch keeps instead: r·(B + d/B) table entries (module docstring)
            "sketch_hash_tables": hash_table_bytes,
            "sketch_scratch_per_call": 4 * table.numel() * table.element_size(),
        },
    }
    if sketch_peak is not None:
        result["memory_bytes"]["cuda_peak_sketch_estimate_topk"] = sketch_peak
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[1_000_000, 10_000_000, 50_000_000])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-cuda", action="store_true", help="skip the CUDA section")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    report: dict[str, Any] = {
        "benchmark": "count_sketch_kernel",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "cpu": [bench_one(d, torch.device("cpu"), args.repeats, args.seed) for d in args.dims],
    }
    # ru_maxrss is KiB on Linux; covers the whole run, reference index tables included
    report["cpu_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if torch.cuda.is_available() and not args.no_cuda:
        report["cuda_device"] = torch.cuda.get_device_name()
        report["cuda"] = [
            bench_one(d, torch.device("cuda"), args.repeats, args.seed) for d in args.dims
        ]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
