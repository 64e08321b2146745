"""The built-in task's SGD: torch.optim.SGD's update bit for bit, without torch._dynamo."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from clients.training import SGD, pick_device, train_local


def _steps(
    optimiser_for: type, seed: int, steps: int, device: torch.device, **knobs: float
) -> list[torch.Tensor]:
    """A small model trained ``steps`` steps on seeded data by the optimiser; its weights."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3)).to(device)
    model[2].bias.requires_grad_(False)  # a parameter without a gradient is left alone
    x = torch.randn(16, 5, device=device)
    y = torch.randint(0, 3, (16,), device=device)
    params = list(model.parameters())
    optimiser = optimiser_for(params, **knobs)
    for _ in range(steps):
        optimiser.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimiser.step()
    return [p.detach().cpu().clone() for p in params]


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    steps=st.integers(1, 6),
    lr=st.floats(1e-4, 1.0),
    momentum=st.sampled_from([0.0, 0.5, 0.9]),
    weight_decay=st.sampled_from([0.0, 1e-4, 0.05]),
)
def test_the_step_is_torch_sgds_bit_for_bit(
    seed: int, steps: int, lr: float, momentum: float, weight_decay: float
) -> None:
    knobs = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
    cpu = torch.device("cpu")
    ours = _steps(SGD, seed, steps, cpu, **knobs)
    reference = _steps(torch.optim.SGD, seed, steps, cpu, **knobs)
    for mine, theirs in zip(ours, reference, strict=True):
        assert torch.equal(mine, theirs)


def test_golden_momentum_and_weight_decay_by_hand() -> None:
    """w = 1, loss = 3·w (gradient 3), lr 0.1, momentum 0.5, weight decay 0.2:
    step 1: g = 3 + 0.2·1 = 3.2, v = 3.2, w = 1 − 0.32 = 0.68;
    step 2: g = 3 + 0.2·0.68 = 3.136, v = 0.5·3.2 + 3.136 = 4.736, w = 0.68 − 0.4736 = 0.2064."""
    w = nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    optimiser = SGD([w], lr=0.1, momentum=0.5, weight_decay=0.2)
    for _ in range(2):
        optimiser.zero_grad()
        (3 * w).sum().backward()
        optimiser.step()
    assert w.item() == pytest.approx(0.2064, abs=1e-12)


def test_training_a_site_imports_no_torch_dynamo() -> None:
    """What the replacement is for: a fresh process that trains (a deployed site's ClientApp
    for each message) does not pay torch._dynamo's import (about 1.4 s of CPU)."""
    code = (
        "import sys, numpy as np, torch\n"
        "from clients.training import train_local\n"
        "model = torch.nn.Linear(4, 3)\n"
        "x = np.random.default_rng(0).normal(size=(32, 4)).astype('float32')\n"
        "y = np.arange(32) % 3\n"
        "train_local(model, x, y, lr=0.1, momentum=0.9, batch_size=8, local_steps=3,\n"
        "            local_epochs=0, rng=np.random.default_rng(1),\n"
        "            device=torch.device('cpu'), weight_decay=1e-4)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_step_is_torch_sgds_foreach_update_bit_for_bit() -> None:
    """On CUDA torch.optim.SGD runs its foreach update by default."""
    device = pick_device()
    knobs = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}
    ours = _steps(SGD, 3, 5, device, **knobs)
    reference = _steps(torch.optim.SGD, 3, 5, device, **knobs)
    for mine, theirs in zip(ours, reference, strict=True):
        assert torch.equal(mine, theirs)


def test_train_local_still_learns() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    model = nn.Linear(6, 2)
    first = train_local(
        model, x, y, lr=0.5, momentum=0.9, batch_size=32, local_steps=1, local_epochs=0,
        rng=np.random.default_rng(1), device=torch.device("cpu"),
    )  # fmt: skip
    later = train_local(
        model, x, y, lr=0.5, momentum=0.9, batch_size=32, local_steps=40, local_epochs=0,
        rng=np.random.default_rng(2), device=torch.device("cpu"),
    )  # fmt: skip
    assert later.loss < first.first_loss / 3
