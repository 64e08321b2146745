"""The model, the data and the report of times and memory: plain PyTorch and NumPy."""

from __future__ import annotations

import json
import os
import resource
import time
from functools import cache
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn


def Net(hidden: int) -> nn.Module:  # noqa: N802 - a model factory, as users name them
    """64 -> hidden -> 10: 75·hidden + 10 parameters."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


@cache
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.long)


def train(
    model: nn.Module,
    partition: int,
    partitions: int,
    *,
    steps: int,
    batch: int,
    lr: float,
    seed: int,
) -> float:
    """``steps`` SGD steps on this site's share of the digits; the mean loss."""
    x, y = digits()
    mine = np.array_split(np.arange(len(y)), partitions)[partition]
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for _ in range(steps):
        pick = torch.from_numpy(mine)[torch.randint(len(mine), (batch,), generator=generator)]
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x[pick]), y[pick])
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return float(np.mean(losses))


def report(directory: str, name: str, **values: object) -> None:
    """Append one JSON line (time, peak RSS, ``values``) to ``<directory>/<name>.jsonl``."""
    if not directory:
        return
    line = {
        "time": time.time(),
        "pid": os.getpid(),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        **values,
    }
    with (Path(directory) / f"{name}.jsonl").open("a") as out:
        out.write(json.dumps(line) + "\n")
