"""A small CNN with BatchNorm for 8×8 digits: running statistics and an integer counter
beside its weights (the arrays ``strategies.averaged_arrays`` keeps out of sketches)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from flwr.app import Message
from torch import nn

from flplatform.core import keys
from strategies.averaged_arrays import unpack

SPEC = "tests.helpers.norm_model:net"  # as a run config's `model` names it
# net()'s arrays sent whole beside a compressed update (strategies/averaged_arrays.py)
AVERAGED = ["1.running_mean", "1.running_var", "1.num_batches_tracked"]


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


FROZEN_SPEC = "tests.helpers.norm_model:frozen_net"
FROZEN = "0.weight"  # frozen_net()'s parameter no training changes


def frozen_net() -> nn.Module:
    """``net()`` with its convolution's weight frozen (``requires_grad=False``), as a user
    freezes a pretrained layer."""
    model = net()
    model[0].weight.requires_grad_(False)
    return model


PRIOR_SPEC = "tests.helpers.norm_model:prior_net"
PRIOR = "6.class_prior"  # prior_net()'s buffer that no rule finds by its name


class ClassPrior(nn.Module):
    """Passes the logits through; in training, keeps a running class distribution (a
    float16 buffer that must stay non-negative and sum to 1), as a user's calibration
    layer does."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.register_buffer(
            "class_prior", torch.full((classes,), 1 / classes, dtype=torch.float16)
        )

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                seen = torch.softmax(logits.float(), dim=1).mean(0)
                mixed = 0.9 * self.class_prior.float() + 0.1 * seen
                self.class_prior.copy_(mixed / mixed.sum())
        return logits


def prior_net() -> nn.Module:
    """``net()`` followed by a ``ClassPrior``."""
    return nn.Sequential(*net(), ClassPrior())


def mean_of_sent(replies: Sequence[Message], model: Mapping[str, np.ndarray]) -> dict:
    """The example-weighted mean of the ``AVERAGED`` arrays the replies carry whole (flat,
    float64), as FedAvg would average them."""
    dtypes = {n: model[n].dtype for n in AVERAGED}
    sizes = {n: int(model[n].size) for n in AVERAGED}
    weights = [float(r.content[keys.METRICS][keys.NUM_EXAMPLES]) for r in replies]
    sent = [
        unpack(
            {
                k: r.content[keys.ARRAYS][k].numpy()
                for k in ("averaged/float32", "averaged/float64")
            },
            dtypes,
            sizes,
            AVERAGED,
        )
        for r in replies
    ]
    return {
        name: sum(w * s[name] for w, s in zip(weights, sent, strict=True)) / sum(weights)
        for name in AVERAGED
    }
