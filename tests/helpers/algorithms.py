"""The built-in algorithms as their tests build them: each server strategy with the mod a
user's train function takes to run under it, and a count sketch without collisions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from strategies.count_sketch import CountSketch
from strategies.delayed import DelayedCompensated
from strategies.fetchsgd import FetchSGD
from strategies.local_sgd import LocalSGDAveraging
from strategies.mods import codec_mod, delayed_mod, fetchsgd_mod, model_mod, sketched_sgd_mod
from strategies.mods.contract import Mod
from strategies.sketched_sgd import SketchedSGD

ALGORITHMS: dict[str, tuple[Callable[[], Any], Mod]] = {
    "local-sgd": (lambda: LocalSGDAveraging(seed=1), model_mod()),
    "topk": (lambda: LocalSGDAveraging(seed=1, codec="topk:0.05"), codec_mod("topk:0.05")),
    "delayed": (lambda: DelayedCompensated(delay=1, num_rounds=4), delayed_mod()),
    "fetchsgd": (lambda: FetchSGD(k=300, sketch_cols=2000, seed=1), fetchsgd_mod()),
    "sketched-sgd": (lambda: SketchedSGD(k=300, sketch_cols=2000, seed=1), sketched_sgd_mod()),
}


def collision_free_sketch(d: int, rows: int = 3) -> CountSketch:
    """A sketch so wide that no two of the d coordinates share a bucket in any row."""
    for seed in range(100):
        sketch = CountSketch.from_seed(d, rows=rows, cols=200 * d, seed=seed)
        buckets = sketch.buckets_of(torch.arange(d))
        if all(len(set(row.tolist())) == d for row in buckets):
            return sketch
    raise AssertionError("no collision-free seed found")
