"""A small CNN with BatchNorm for 8×8 digits: running statistics and an integer counter
beside its weights (the arrays ``strategies.averaged_arrays`` keeps out of sketches)."""

from __future__ import annotations

from torch import nn

SPEC = "tests.helpers.norm_model:net"  # as a run config's `model` names it


def net() -> nn.Module:
    """Conv(1→8) → BatchNorm → ReLU → 2×2 max-pool → Linear(128 → 10)."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 10),
    )
