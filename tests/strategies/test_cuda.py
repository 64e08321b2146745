"""The sketched algorithms' tensor work on a GPU: the same results as on the CPU.

The site mods sketch, and the FetchSGD and Sketched-SGD servers query their tables, on CUDA
whenever it is present (``strategies.count_sketch.sketch_device``); the sketch maths runs on
the device of its tensors. Integer-valued inputs keep every
float sum exact, so CUDA's atomic additions (whose order varies) give the CPU's tables to
the bit. These tests skip on a machine without CUDA (this project's CI); run them on a GPU
machine with ``pytest tests/strategies/test_cuda.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord

import strategies.fetchsgd
import strategies.mods.fetchsgd
from flplatform.core import keys
from flplatform.core.arrays import record_to_arrays
from flplatform.engine.engine import RoundEngine
from strategies.count_sketch import CountSketch, sketch_device, top_k_largest
from strategies.fetchsgd import FetchSGD
from strategies.mods.fetchsgd import sketch_of
from strategies.sketch_feedback import SketchFeedback
from tests.helpers.delayed_sites import context, digits_site
from tests.helpers.scripted_grid import ScriptedGrid
from tests.helpers.sites import digits_model

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


def _fetchsgd_run(monkeypatch: pytest.MonkeyPatch, server: str) -> FetchSGD:
    """Three rounds of FetchSGD on digits; the server's tables on ``server``, the sites
    sketching on the CPU in both runs (so that both servers get the same tables)."""
    monkeypatch.setattr(strategies.fetchsgd, "sketch_device", lambda: torch.device(server))
    monkeypatch.setattr(strategies.mods.fetchsgd, "sketch_device", lambda: torch.device("cpu"))
    contexts = {n: context(n) for n in range(1, 5)}
    grid = ScriptedGrid({n: digits_site(n - 1, 4, contexts[n]) for n in range(1, 5)})
    strategy = FetchSGD(k=200, fraction_train=0.5, seed=1)
    RoundEngine(grid, strategy, poll_interval=0.0, required_sites=4).run(
        digits_model(), num_rounds=3, train_config=ConfigRecord({keys.LOCAL_STEPS: 5, keys.LR: 0.1})
    )
    return strategy


@pytest.mark.usefixtures("task_identity")
def test_the_fetchsgd_server_steps_on_the_gpu_to_the_cpus_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    on_cpu = _fetchsgd_run(monkeypatch, "cpu")
    on_gpu = _fetchsgd_run(monkeypatch, "cuda")
    assert on_gpu.feedback is not None and on_gpu.feedback.error is not None
    assert on_gpu.feedback.error.device.type == "cuda"
    # η = 1 and separate multiply and add kernels: the same float32 roundings as the CPU's
    assert on_cpu.model.record is not None and on_gpu.model.record is not None
    want, got = record_to_arrays(on_cpu.model.record), record_to_arrays(on_gpu.model.record)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    saved = on_gpu.state_dict()  # a checkpoint holds host arrays
    assert isinstance(saved["error"], np.ndarray) and saved["error"].dtype == np.float32
