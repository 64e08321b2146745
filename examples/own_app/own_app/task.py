"""The model, the data and the training loop: plain PyTorch, no federated code at all."""

from __future__ import annotations

from functools import cache

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

TEST_EXAMPLES = 360  # held out for the server's central evaluation


class Net(nn.Module):
    """A small CNN for 8×8 digits: convolutions with BatchNorm, then dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.pool = nn.MaxPool2d(2)
        self.dropout = nn.Dropout(0.25)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.bn1(self.conv1(x))))  # 8×8 → 4×4
        x = self.pool(F.relu(self.bn2(self.conv2(x))))  # 4×4 → 2×2
        x = self.dropout(torch.flatten(x, 1))
        return self.fc2(F.relu(self.fc1(x)))


@cache
def _digits() -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """All 1 797 digits as (N, 1, 8, 8) floats in [0, 1], labels, and a fixed shuffle."""
    x, y = load_digits(return_X_y=True)
    images = torch.tensor(x / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    order = np.random.default_rng(42).permutation(len(y))
    return images, torch.tensor(y, dtype=torch.long), order


def site_seeds(seed: int, server_round: int, partition_id: int) -> tuple[int, int]:
    """Two seeds (batch order, dropout) of this run, round and site: every triple its own
    (a sum like seed + round would give seed 1's round 1 the batches of seed 0's round 2)."""
    batches, dropout = np.random.SeedSequence([seed, server_round, partition_id]).generate_state(2)
    return int(batches), int(dropout)


def load_data(
    partition_id: int, num_partitions: int, batch_size: int, seed: int = 0
) -> tuple[DataLoader, DataLoader]:
    """This site's share of the digits: 80% to train on, 20% to validate on."""
    images, labels, order = _digits()
    part = np.array_split(order[TEST_EXAMPLES:], num_partitions)[partition_id]
    n_val = len(part) // 5
    train, val = part[n_val:], part[:n_val]
    generator = torch.Generator().manual_seed(seed)  # the training batches' order
    trainloader = DataLoader(
        TensorDataset(images[train], labels[train]),
        batch_size=batch_size,
        shuffle=True,
        generator=generator,
    )
    valloader = DataLoader(TensorDataset(images[val], labels[val]), batch_size=256)
    return trainloader, valloader


def load_test_data() -> DataLoader:
    """The server's held-out test set."""
    images, labels, order = _digits()
    test = order[:TEST_EXAMPLES]
    return DataLoader(TensorDataset(images[test], labels[test]), batch_size=256)


def train(
    net: nn.Module,
    trainloader: DataLoader,
    *,
    epochs: int,
    steps: int,
    lr: float,
    momentum: float,
) -> float:
    """SGD for ``steps`` mini-batches (if > 0) or ``epochs`` epochs; the mean loss."""
    net.train()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    criterion = nn.CrossEntropyLoss()
    total, done = 0.0, 0
    wanted = steps if steps > 0 else epochs * len(trainloader)
    while done < wanted:
        for images, labels in trainloader:
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            total += loss.item()
            done += 1
            if done == wanted:
                break
    return total / max(1, done)


def test(net: nn.Module, loader: DataLoader) -> tuple[float, float]:
    """Mean loss and accuracy of ``net`` on ``loader``."""
    net.eval()
    criterion = nn.CrossEntropyLoss(reduction="sum")
    loss, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for images, labels in loader:
            logits = net(images)
            loss += criterion(logits, labels).item()
            correct += int((logits.argmax(1) == labels).sum())
            count += len(labels)
    return loss / count, correct / count
