"""The site's training and evaluation steps, and the choice of device.

Plain PyTorch; no Flower. Data order is a function of (seed, round, site) so a run is
reproducible and a restarted site continues the same sequence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from flplatform.core.errors import ConfigError


def pick_device() -> torch.device:
    """CUDA when available, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class TrainStats:
    """What one local training call did."""

    loss: float  # mean training loss over the steps taken
    # the received model's loss on the first mini-batch, before any step: the server
    # compares later losses with it to notice training that diverges
    first_loss: float
    steps: int
    examples_seen: int
    seconds: float


class SGD:
    """``torch.optim.SGD(params, lr, momentum, weight_decay)``'s ``step`` and ``zero_grad``,
    bit for bit (its per-tensor update, which it runs on the CPU; tests/clients/
    test_training.py checks both against it, and on CUDA its foreach update too).

    Why not torch.optim's: building any torch optimiser imports ``torch._dynamo``
    (``Optimizer.add_param_group`` is wrapped in ``torch._disable_dynamo``), about 1.4 s of
    CPU in every process that trains, and a deployed site runs a new ClientApp process for
    every message (Flower's SuperNode), so each round of each site paid it.
    """

    def __init__(
        self, params: list[nn.Parameter], *, lr: float, momentum: float, weight_decay: float
    ) -> None:
        self.params = params
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buffers: list[torch.Tensor | None] = [None] * len(params)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        for i, param in enumerate(self.params):
            if param.grad is None:
                continue
            grad = param.grad
            if self.weight_decay != 0:
                grad = grad.add(param, alpha=self.weight_decay)
            if self.momentum != 0:
                buffer = self.buffers[i]
                if buffer is None:
                    buffer = self.buffers[i] = grad.detach().clone()
                else:
                    buffer.mul_(self.momentum).add_(grad)
                grad = buffer
            param.add_(grad, alpha=-self.lr)


def train_local(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    lr: float,
    momentum: float,
    batch_size: int,
    local_steps: int,
    local_epochs: int,
    rng: np.random.Generator,
    device: torch.device,
    weight_decay: float = 0.0,
) -> TrainStats:
    """Run H local SGD steps (``local_steps`` > 0) or E epochs (``local_epochs``) in place.

    A fresh optimiser is built per call, so site momentum restarts at every sync: the
    velocity belonged to a model the server has since replaced. (Our models have no
    BatchNorm; a user model's running statistics travel as arrays and are averaged.)
    """
    if len(x) == 0:
        raise ConfigError("this site has no training examples")
    if local_steps <= 0 and local_epochs <= 0:
        raise ConfigError("set local-steps (H > 0) or local-epochs (E > 0)")
    started = time.perf_counter()
    model.to(device).train()
    optimiser = SGD(list(model.parameters()), lr=lr, momentum=momentum, weight_decay=weight_decay)
    loss_fn = nn.CrossEntropyLoss()
    # torch.tensor copies: datasets are cached read-only and shared by the sites of a process.
    xt = torch.tensor(x, dtype=torch.float32, device=device)
    yt = torch.tensor(y, dtype=torch.long, device=device)
    n = len(xt)
    batch_size = min(batch_size, n)
    steps_per_epoch = max(1, n // batch_size)  # drop the ragged last batch: equal-size steps
    total_steps = local_steps if local_steps > 0 else local_epochs * steps_per_epoch

    losses = torch.zeros((), device=device)
    first_loss = torch.zeros((), device=device)
    steps = 0
    while steps < total_steps:
        order = torch.as_tensor(rng.permutation(n), device=device)
        for b in range(steps_per_epoch):
            if steps == total_steps:
                break
            idx = order[b * batch_size : (b + 1) * batch_size]
            optimiser.zero_grad(set_to_none=True)
            loss = loss_fn(model(xt[idx]), yt[idx])
            loss.backward()
            optimiser.step()
            losses += loss.detach()
            if steps == 0:
                first_loss = loss.detach()
            steps += 1
    mean_loss = float(losses.item()) / steps
    return TrainStats(
        loss=mean_loss,
        first_loss=float(first_loss.item()),
        steps=steps,
        examples_seen=steps * batch_size,
        seconds=time.perf_counter() - started,
    )


@torch.no_grad()
def evaluate(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    device: torch.device,
    batch_size: int = 1024,
) -> tuple[float, float]:
    """Return (mean cross-entropy loss, accuracy) of ``model`` on (x, y)."""
    if len(x) == 0:
        raise ConfigError("no examples to evaluate on")
    model.to(device).eval()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    total_loss, correct = 0.0, 0
    for start in range(0, len(x), batch_size):
        xb = torch.tensor(x[start : start + batch_size], dtype=torch.float32, device=device)
        yb = torch.tensor(y[start : start + batch_size], dtype=torch.long, device=device)
        logits = model(xb)
        total_loss += float(loss_fn(logits, yb).item())
        correct += int((logits.argmax(dim=1) == yb).sum().item())
    return total_loss / len(x), correct / len(x)
