"""Count-sketch kernel: sketch, estimate and top-k next to reference passes, as JSON.

For each d: r = 5 rows, k = d/1000, c = 5k columns. Times (median of ``--repeats`` rounds) of
sketching a d-vector, estimating all d coordinates, and selecting the top-k from the estimates;
next to reference passes measured in the same run: five ``index_add_`` passes with precomputed
random indices into the 5 × c table (the unavoidable scatter work, but with 5·d stored int64
indices) and one dense copy of the vector (memory bandwidth).

Goals (issue 5): sketching within 1.2× of the five index_add_ passes while storing no r × d
index tables (the sketch keeps two small hash tables, reported in bytes); estimation plus top-k
within 2× of sketching. Within a round the calls take turns, and each ratio is the median
over rounds of that round's ratio, so a slow spell of a shared machine hits a call and its
reference alike (timed one after the other, whole runs at d = 50M ranged from 0.85× to
1.46×); in its turn a call repeats for at least 0.2 s, so short calls are measured warm.
On this project's 2-core machine, five runs gave sketch / index_add_ ratios of 0.94–1.04 at
1M, 1.02–1.09 at 10M and 1.07–1.17 at 50M, and (estimate + top-k) / sketch ratios of
0.95–1.24, 1.09–1.32 and 1.51–1.95: every goal held on every run. At 50M the estimate's
gathers miss the 1 MB L2 (650 ms, where the same index_select calls take 240 ms from a
cached window). Before estimation reused one votes buffer per call and computed the median
in it, estimation at 1M was bimodal, 10 ms or 35 ms from one process to the next: its
fresh temporaries cost about 13 000 page faults per call whenever the allocator had handed
them back to the OS. Raise ``--repeats`` (default 5) when a ratio is near its goal.

Server state against the number of sites (goal: independent of it): the real round engine
drives FetchSGD at the first d over a replay grid whose sites answer with sketches, for 2,
8, 32 and 128 sites; what the strategy holds is measured each round once every table is
summed, and after the rounds. At d = 1M: 12.2 MB at most (round 1, where x is held three
times: the flat copy, the record sent to sites, and Flower's serialized chunks of the
initial record; the running float64 table is 0.2 MB) and 8.2 MB after the rounds. From 2
to 128 sites it grows by 3.5 KB, a version number per site, where keeping one table per
site would add 100 KB per site.

    python benchmarks/bench_sketch.py [--dims 1000000 10000000 50000000] [--threads N]
        [--sites 2 8 32 128]
"""

from __future__ import annotations

import argparse
import array
import collections
import json
import math
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from bench_round import ReplayGrid
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from flplatform.core import keys
from flplatform.core.arrays import arrays_to_record
from flplatform.engine import RoundSummary, Synchrony
from flplatform.engine.engine import RoundEngine
from strategies.count_sketch import CountSketch, top_k_largest
from strategies.fetchsgd import FetchSGD
from strategies.sketched_common import SKETCH

ROWS = 5
SKETCH_GOAL = 1.2
QUERY_GOAL = 2.0
MIN_TURN_SECONDS = 0.2  # a call's turn in a round: enough calls to measure it warm


def interleaved(
    calls: dict[str, Callable[[], object]], repeats: int, sync: Callable[[], None]
) -> dict[str, list[float]]:
    """Seconds per call of each call in each of ``repeats`` rounds.

    The calls take turns within a round, so a slow spell of a shared machine hits a call
    and its reference alike; ratios are then taken round by round (``paired_ratio``). In
    its turn a call runs back to back for at least ``MIN_TURN_SECONDS`` (the time per call
    is the turn's mean), so short calls are measured warm, as a loop would measure them,
    rather than after another call has evicted their tables from the cache.
    """
    calls_per_turn = {}
    for name, fn in calls.items():
        fn()  # warm-up
        sync()
        start = time.perf_counter()
        fn()
        sync()
        once = time.perf_counter() - start
        calls_per_turn[name] = max(1, math.ceil(MIN_TURN_SECONDS / max(once, 1e-9)))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            n = calls_per_turn[name]
            start = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            times[name].append((time.perf_counter() - start) / n)
    return times


def paired_ratio(numerators: list[float], denominators: list[float]) -> float:
    """Median over rounds of the round's ratio (each pair measured back to back)."""
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))


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
    est_abs = est.abs()
    hashes = sketch._tables(table.device)
    hash_table_bytes = sum(
        t.numel() * t.element_size() for t in (hashes.low, hashes.low64, hashes.high)
    )
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

    def five_scatter_add() -> None:  # the kernel the CPU sketch uses, on stored indices
        flat = torch.zeros(ROWS * cols, device=device)
        for j in range(ROWS):
            flat.scatter_add_(0, index[j], g)

    out = torch.empty_like(g)
    times = interleaved(
        {
            "sketch": lambda: sketch.sketch(g),
            "ref_five_index_add": five_index_add,
            "ref_five_scatter_add": five_scatter_add,
            "estimate_all": lambda: sketch.estimate(table),
            "topk_of_estimates": lambda: top_k_largest(est_abs, k),
            "top_k_method": lambda: sketch.top_k(table, k),
            "ref_dense_copy": lambda: out.copy_(g),
        },
        repeats,
        sync,
    )
    median = {name: statistics.median(seconds) for name, seconds in times.items()}
    query = [e + t for e, t in zip(times["estimate_all"], times["topk_of_estimates"], strict=True)]
    sketch_over_index_add = paired_ratio(times["sketch"], times["ref_five_index_add"])
    query_over_sketch = paired_ratio(query, times["sketch"])
    index_bytes = index.numel() * index.element_size()

    result: dict[str, Any] = {
        "d": d,
        "rows": ROWS,
        "cols": cols,
        "k": k,
        "seconds": median,
        "ratios": {
            "sketch_over_index_add": sketch_over_index_add,
            "sketch_over_scatter_add": paired_ratio(times["sketch"], times["ref_five_scatter_add"]),
            "estimate_plus_topk_over_sketch": query_over_sketch,
            "sketch_over_dense_copy": paired_ratio(times["sketch"], times["ref_dense_copy"]),
        },
        "goals_met": {
            f"sketch_within_{SKETCH_GOAL}x_index_add": sketch_over_index_add <= SKETCH_GOAL,
            f"estimate_plus_topk_within_{QUERY_GOAL}x_sketch": query_over_sketch <= QUERY_GOAL,
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


# ------------------------------------------------------------ server state against sites
class SketchReplayGrid(ReplayGrid):
    """Answers FetchSGD's training messages with the count sketch of a seeded random delta.

    The sketch is built with the seed and shape the message's config names, as a site's
    FetchSGD part builds it; no training and no network.
    """

    def __init__(self, num_nodes: int, d: int) -> None:
        super().__init__(num_nodes, {"w": (1,)})
        self.d = d
        self.tables: dict[tuple[int, int, int], list[np.ndarray]] = {}

    def _reply(self, msg: Message, message_id: str) -> Message:
        if msg.metadata.message_type == "query":
            return super()._reply(msg, message_id)
        msg.metadata.__dict__["_message_id"] = message_id
        config = msg.content.config_records[keys.CONFIG]
        shape = (
            int(config[keys.SKETCH_SEED]),
            int(config[keys.SKETCH_ROWS]),
            int(config[keys.SKETCH_COLS]),
        )
        if shape not in self.tables:
            sketch = CountSketch.from_seed(self.d, rows=shape[1], cols=shape[2], seed=shape[0])
            gen = torch.Generator().manual_seed(0)
            self.tables[shape] = [
                sketch.sketch(torch.randn(self.d, generator=gen)).numpy() for _ in range(8)
            ]
        node = msg.metadata.dst_node_id
        table = self.tables[shape][node % 8]  # serialized into the reply
        metrics = MetricRecord({keys.NUM_EXAMPLES: 100 + node, keys.TRAIN_LOSS: 0.5})
        content = RecordDict(
            {keys.ARRAYS: arrays_to_record({SKETCH: table}), keys.METRICS: metrics}
        )
        return Message(content, reply_to=msg)


def held_bytes(obj: object, seen: set[int] | None = None, storages: set[int] | None = None) -> int:
    """Bytes reachable from ``obj``'s attributes: buffers, plus Python scalars' sizes.

    Tensors count their storage (once, however many tensors share it), arrays and other
    buffers (bytes, bytearray, memoryview, array.array) their bytes, ints, floats and
    strings ``sys.getsizeof``; containers and objects are walked, not counted. So a table,
    a model, a reply or even a version number kept per site shows as growth.
    """
    seen = set() if seen is None else seen
    storages = set() if storages is None else storages
    if id(obj) in seen or obj is None:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        if storage.data_ptr() in storages:
            return 0
        storages.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(obj, np.ndarray):
        return obj.nbytes if obj.base is None else held_bytes(obj.base, seen, storages)
    if isinstance(obj, bytes | bytearray | memoryview | array.array):
        return memoryview(obj).nbytes
    if isinstance(obj, int | float | str):
        return sys.getsizeof(obj)
    if isinstance(obj, dict):
        return sum(
            held_bytes(k, seen, storages) + held_bytes(v, seen, storages) for k, v in obj.items()
        )
    if isinstance(obj, list | tuple | set | frozenset | collections.deque):
        return sum(held_bytes(v, seen, storages) for v in obj)
    total = held_bytes(vars(obj), seen, storages) if hasattr(obj, "__dict__") else 0
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            total += held_bytes(getattr(obj, name, None), seen, storages)
    return total


class MeasuredFetchSGD(FetchSGD):
    """FetchSGD noting the most bytes it held when a round's tables were all summed."""

    max_held_before_step = 0

    def finish_aggregation(self) -> tuple[ArrayRecord | None, MetricRecord | None]:
        self.max_held_before_step = max(self.max_held_before_step, held_bytes(self))
        return super().finish_aggregation()


def server_state_by_sites(d: int, site_counts: list[int], rounds: int) -> dict[str, Any]:
    """FetchSGD's server state, in bytes, for each number of sites.

    The real ``RoundEngine`` drives ``FetchSGD`` for ``rounds`` rounds over a replay grid;
    what the strategy holds (``held_bytes``) is measured each round when every table has
    been summed, before the step (its temporaries inside ``SketchFeedback.step`` are not
    seen), and once after the last round. Goal: the most held grows by less than one
    sketch table from the fewest sites to the most, so no table is kept per site.
    """
    k = max(1, d // 1000)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
    rows = []
    for sites in site_counts:
        strategy = MeasuredFetchSGD(k=k, sketch_rows=ROWS, sketch_cols=5 * k, seed=0)
        summaries: list[RoundSummary] = []
        engine = RoundEngine(
            SketchReplayGrid(sites, d),
            strategy,
            policy=Synchrony("sync"),
            required_sites=sites,
            poll_interval=0.0,
            on_round=summaries.append,
        )
        initial = ArrayRecord({"w": Array(np.zeros(d, dtype=np.float32))})
        engine.run(initial, num_rounds=rounds)
        applied = sum(u.status == "applied" for s in summaries for u in s.updates)
        if applied != sites * rounds:
            raise RuntimeError(f"{sites} sites: {applied} of {sites * rounds} updates applied")
        rows.append(
            {
                "sites": sites,
                "max_held_before_step_bytes": strategy.max_held_before_step,
                "after_rounds_bytes": held_bytes(strategy),
                "bytes_up_per_site_per_round": summaries[-1].bytes_up // sites,
            }
        )
    held = [r["max_held_before_step_bytes"] for r in rows]
    table_bytes = ROWS * 5 * k * 4
    return {
        "d": d,
        "k": k,
        "rows": ROWS,
        "cols": 5 * k,
        "rounds": rounds,
        "by_sites": rows,
        "table_bytes": table_bytes,
        "growth_bytes_fewest_to_most_sites": held[-1] - held[0],
        "goals_met": {"server_state_independent_of_sites": max(held) - min(held) < table_bytes},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[1_000_000, 10_000_000, 50_000_000])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-cuda", action="store_true", help="skip the CUDA section")
    parser.add_argument(
        "--sites",
        type=int,
        nargs="+",
        default=[2, 8, 32, 128],
        help="numbers of sites for the server-state section (FetchSGD at the first d)",
    )
    args = parser.parse_args()
    if len(set(args.sites)) < 2:
        parser.error("--sites needs at least two different numbers of sites to compare")
    args.sites = sorted(set(args.sites))
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
    report["server_state"] = server_state_by_sites(args.dims[0], args.sites, rounds=3)
    if torch.cuda.is_available() and not args.no_cuda:
        report["cuda_device"] = torch.cuda.get_device_name()
        report["cuda"] = [
            bench_one(d, torch.device("cuda"), args.repeats, args.seed) for d in args.dims
        ]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
