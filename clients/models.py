"""The models a site trains: a small MLP, a wide MLP and a small CNN, built from a seed.

Both are plain ``nn.Sequential`` stacks with named layers (``fc1.weight``, ``conv1.bias``, ...)
so their ``state_dict`` keys read well in records and checkpoints. Neither has BatchNorm: its
running statistics are buffers that are not trained by gradients, and averaging them across
sites with different label mixes is a separate, debated design choice (FedBN and friends).
Without it, a model's whole state is its parameters and FedAvg is exactly a weighted mean.

Initialisation is drawn under ``torch.random.fork_rng`` from the given seed, so the same seed
gives the same weights on every site and building a model never disturbs the caller's global
torch RNG stream.
"""

from __future__ import annotations

import numbers
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from clients._checks import check_int, check_seed
from flplatform.errors import ConfigError

__all__ = ["MODELS", "build_model", "count_parameters"]

MODELS: tuple[str, ...] = ("mlp", "cnn", "wide-mlp")
WIDE_HIDDEN = 640  # wide-mlp's hidden width: 509k parameters on 28×28 inputs


def build_model(
    name: str,
    *,
    input_shape: Sequence[int],
    num_classes: int,
    seed: int = 0,
    hidden: int = 64,
) -> nn.Module:
    """Build model ``name`` with initial weights drawn from ``seed``.

    ``"mlp"``: flatten → Linear(F, hidden) → ReLU → Linear(hidden, num_classes).

    ``"wide-mlp"``: the MLP with ``max(hidden, 640)`` hidden units, 508 810 parameters on
    28×28 inputs and 10 classes: big enough that compressing its updates matters.

    ``"cnn"``: two blocks of 3×3 convolution (padding 1; 16 then 32 channels), ReLU and 2×2
    max-pooling, then Linear(·, hidden) → ReLU → Linear(hidden, num_classes). A spatial axis
    shorter than 2 is not pooled, so any ``(C, H, W)`` works: 28×28 pools to 7×7 (105 866
    parameters with ``hidden=64`` and 10 classes), 8×8 pools to 2×2 (13 706 parameters).

    Parameters
    ----------
    name : str
        One of :data:`MODELS`.
    input_shape : sequence of int
        Shape of one example without the batch axis: ``(C, H, W)`` for the CNN; the MLP
        accepts any shape and flattens it.
    num_classes : int
        Number of outputs (logits), ``>= 1``.
    seed : int
        Seed of the initial weights.
    hidden : int
        Width of the hidden fully connected layer, ``>= 1``.

    Returns
    -------
    torch.nn.Module
        The model in training mode, ``float32`` on the CPU, mapping ``(B, *input_shape)`` to
        logits ``(B, num_classes)``.

    Raises
    ------
    ConfigError
        If the name is unknown or a parameter is out of range.
    """
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; allowed: {', '.join(MODELS)}")
    shape = _check_shape(input_shape, needs_image=name == "cnn")
    num_classes = check_int(num_classes, name="num_classes", minimum=1)
    hidden = check_int(hidden, name="hidden", minimum=1)
    seed = check_seed(seed)
    # devices=[]: only the CPU generator is forked; no accelerator state is touched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "mlp":
            return _mlp(shape, num_classes, hidden)
        if name == "wide-mlp":
            return _mlp(shape, num_classes, max(hidden, WIDE_HIDDEN))
        return _cnn(shape, num_classes, hidden)


def count_parameters(model: nn.Module) -> int:
    """Return the number of scalar parameters of ``model`` (trainable or not).

    Parameters
    ----------
    model : torch.nn.Module
        Any module.

    Returns
    -------
    int
        Sum of ``numel()`` over ``model.parameters()``.
    """
    return sum(parameter.numel() for parameter in model.parameters())


def _mlp(shape: tuple[int, ...], num_classes: int, hidden: int) -> nn.Module:
    features = 1
    for size in shape:
        features *= size
    return nn.Sequential(
        OrderedDict(
            flatten=nn.Flatten(),
            fc1=nn.Linear(features, hidden),
            relu1=nn.ReLU(),
            fc2=nn.Linear(hidden, num_classes),
        )
    )


def _cnn(shape: tuple[int, ...], num_classes: int, hidden: int) -> nn.Module:
    channels, height, width = shape
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    for block, (c_in, c_out) in enumerate([(channels, 16), (16, 32)], start=1):
        layers[f"conv{block}"] = nn.Conv2d(c_in, c_out, kernel_size=3, padding=1)  # keeps H, W
        layers[f"relu{block}"] = nn.ReLU()
        # Pool only the axes long enough: an 8×8 input keeps 2×2 after two blocks and a
        # one-row (1, F) feature image is pooled along its width only.
        kernel = (2 if height >= 2 else 1, 2 if width >= 2 else 1)
        layers[f"pool{block}"] = nn.MaxPool2d(kernel) if kernel != (1, 1) else nn.Identity()
        height, width = height // kernel[0], width // kernel[1]
    layers["flatten"] = nn.Flatten()  # (B, 32, h, w) -> (B, 32*h*w)
    layers["fc1"] = nn.Linear(32 * height * width, hidden)
    layers["relu3"] = nn.ReLU()
    layers["fc2"] = nn.Linear(hidden, num_classes)
    return nn.Sequential(layers)


def _check_shape(input_shape: Sequence[int], *, needs_image: bool) -> tuple[int, ...]:
    wanted = "(C, H, W)" if needs_image else "a tuple"
    try:
        shape = tuple(input_shape)
    except TypeError:
        shape = ()
    valid = bool(shape) and all(
        isinstance(size, numbers.Integral) and not isinstance(size, bool) and size >= 1
        for size in shape
    )
    if not valid or (needs_image and len(shape) != 3):
        raise ConfigError(f"input_shape must be {wanted} of positive integers, got {input_shape!r}")
    return tuple(int(size) for size in shape)
