"""Site codecs: encode / decode times and bytes on the wire, as JSON.

For each d the update is ``--arrays`` float32 arrays of about d/arrays elements (a model's
layers), drawn from N(0, 1). Times (median of ``--repeats`` after one warm-up) of encode,
decode and one ``ErrorFeedback.compress`` (u + e, encode, local decode, new residual) for
TopK(fraction=0.01), StochasticInt8 and StochasticInt4, next to a reference pass measured
in the same run: one dense copy of the flat float32 update (memory bandwidth). Bytes: the payload
(``wire_nbytes``), the same arrays serialized as .npy (what a Flower ArrayRecord carries,
headers included) and the dense float32 update; compression = dense / payload.

    python benchmarks/bench_codecs.py [--dims 1000000 10000000] [--arrays 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from strategies.codecs import (
    Codec,
    ErrorFeedback,
    StochasticInt4,
    StochasticInt8,
    TopK,
    wire_nbytes,
)
from strategies.layout import Layout


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def npy_nbytes(wire: dict[str, np.ndarray]) -> int:
    """Bytes of the wire arrays saved one by one in .npy format (data plus headers)."""
    total = 0
    for value in wire.values():
        buffer = io.BytesIO()
        np.save(buffer, value, allow_pickle=False)
        total += buffer.getbuffer().nbytes
    return total


def make_update(d: int, arrays: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``arrays`` float32 arrays of N(0, 1) values, d elements in all."""
    sizes = [d // arrays + (1 if j < d % arrays else 0) for j in range(arrays)]
    return {
        f"layer{j:02d}.weight": rng.standard_normal(n, dtype=np.float32)
        for j, n in enumerate(sizes)
    }


def bench_codec(
    codec: Codec, update: dict[str, np.ndarray], repeats: int, seed: int
) -> dict[str, Any]:
    layout = Layout.of(update)
    rng = np.random.default_rng(seed)
    wire = codec.encode(update, rng=rng)
    t_encode = timed(lambda: codec.encode(update, rng=rng), repeats)
    t_decode = timed(lambda: codec.decode(wire, layout), repeats)
    feedback = ErrorFeedback()
    t_feedback = timed(lambda: feedback.compress(update, codec, rng=rng), repeats)
    dense_bytes = sum(a.nbytes for a in update.values())
    payload = wire_nbytes(wire)
    return {
        "codec": codec.name,
        "seconds": {"encode": t_encode, "decode": t_decode, "error_feedback_compress": t_feedback},
        "bytes": {"wire_payload": payload, "wire_npy": npy_nbytes(wire), "dense": dense_bytes},
        "compression": dense_bytes / payload,
    }


def bench_one(d: int, arrays: int, repeats: int, seed: int) -> dict[str, Any]:
    update = make_update(d, arrays, np.random.default_rng(seed))
    flat = np.concatenate(list(update.values()))  # (d,) float32
    out = np.empty_like(flat)
    t_copy = timed(lambda: np.copyto(out, flat), repeats)
    codecs: list[Codec] = [TopK(fraction=0.01), StochasticInt8(), StochasticInt4()]
    results = [bench_codec(codec, update, repeats, seed) for codec in codecs]
    for result in results:
        seconds = result["seconds"]
        result["over_dense_copy"] = {
            "encode": seconds["encode"] / t_copy,
            "decode": seconds["decode"] / t_copy,
        }
    return {"d": d, "arrays": arrays, "ref_dense_copy_seconds": t_copy, "codecs": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--arrays", type=int, default=8, help="arrays the update is split into")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    started = time.perf_counter()
    report: dict[str, Any] = {
        "benchmark": "site_codecs",
        "numpy": np.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "repeats": args.repeats,
        "cpu": [bench_one(d, args.arrays, args.repeats, args.seed) for d in args.dims],
    }
    # ru_maxrss is KiB on Linux; covers the whole run
    report["cpu_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report["wall_seconds"] = time.perf_counter() - started
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
