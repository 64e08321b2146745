"""The sketched algorithms' tensor work on a GPU: the same results as on the CPU.

The site mods sketch on CUDA whenever it is present (``strategies.mods.fetchsgd.sketch_device``)
and the sketch maths runs on the device of its tensors. Integer-valued inputs keep every
float sum exact, so CUDA's atomic additions (whose order varies) give the CPU's tables to
the bit. These tests skip on a machine without CUDA (this project's CI); run them on a GPU
machine with ``pytest tests/strategies/test_cuda.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strategies.count_sketch import CountSketch, top_k_largest
from strategies.mods.fetchsgd import sketch_device, sketch_of
from strategies.sketch_feedback import SketchFeedback

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (a GPU machine); CI has none"
)
CUDA = torch.device("cuda")


def integer_vector(d: int, seed: int) -> torch.Tensor:
    return torch.randint(-20, 21, (d,), generator=torch.Generator().manual_seed(seed)).float()


def test_the_mods_sketch_on_the_gpu_and_give_the_cpus_table() -> None:
    assert sketch_device() == CUDA
    delta = integer_vector(200_003, 1).numpy()
    on_gpu = sketch_of(delta, 5, 1_000, 7, CUDA)
    on_cpu = sketch_of(delta, 5, 1_000, 7, torch.device("cpu"))
    assert isinstance(on_gpu, np.ndarray) and on_gpu.dtype == np.float32
    np.testing.assert_array_equal(on_gpu, on_cpu)


def test_top_k_largest_on_the_gpu_picks_what_the_cpu_picks() -> None:
    values = torch.randperm(300_000, generator=torch.Generator().manual_seed(3)).float()
    for k in (1, 100, 5_000, 80_000):  # the sampled path and torch.topk's
        cpu = top_k_largest(values, k)
        gpu = top_k_largest(values.to(CUDA), k)
        assert gpu.device.type == "cuda"
        assert torch.equal(gpu.cpu(), cpu)


def test_fetchsgd_server_steps_on_the_gpu_as_on_the_cpu() -> None:
    d, k = 50_000, 500
    sketch = CountSketch.from_seed(d, rows=5, cols=20_000, seed=4)
    cpu = SketchFeedback(sketch, k=k, rho=0.9, eta=1.0, removal="zero")
    gpu = SketchFeedback(sketch, k=k, rho=0.9, eta=1.0, removal="zero")
    for seed in range(3):
        # k planted coordinates far above the rest (small integers): no ties at the k-th
        generator = torch.Generator().manual_seed(seed)
        vector = torch.randint(-3, 4, (d,), generator=generator).float()
        planted = torch.randperm(d, generator=generator)[:k]
        vector[planted] = 1_000.0 + 10.0 * torch.arange(k, dtype=torch.float32)
        table = sketch.sketch(vector)
        want_indices, want_values = cpu.step(table)
        got_indices, got_values = gpu.step(table.to(CUDA))
        assert got_indices.device.type == "cuda"
        assert torch.equal(got_indices.cpu(), want_indices)
        torch.testing.assert_close(got_values.cpu(), want_values)
    assert gpu.error is not None and gpu.error.device.type == "cuda"
