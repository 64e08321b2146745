"""The models a site trains: a small MLP, a wide MLP and a small CNN, built from a seed.

Both are plain ``nn.Sequential`` stacks with named layers (``fc1.weight``, ``conv1.bias``, ...)
so their ``state_dict`` keys read well in records and checkpoints. Neither has BatchNorm: its
running statistics are buffers that are not trained by gradients, and averaging them across
sites with different label mixes is a separate, debated design choice (FedBN and friends).
Without it, a model's whole state is its parameters and FedAvg is exactly a weighted mean.

Initialisation is drawn under ``torch.random.fork_rng`` from the given seed, so the same seed
gives the same weights on every site and building a model never disturbs the caller's global
torch RNG stream.

A user's own model joins through a ``MODULE:FACTORY`` spec (``own_app.task:Net``): a
zero-argument callable returning an ``nn.Module``, imported from the Python path or, failing
that, the current directory. It is called under the same seeded ``fork_rng``.
"""

from __future__ import annotations

import importlib
import numbers
import os
import re
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from clients.catalog import MODELS
from flplatform.core.checks import check_int, check_seed
from flplatform.core.errors import ConfigError

__all__ = [
    "MODELS",
    "build_model",
    "count_parameters",
    "instantiate_model_spec",
    "is_model_spec",
    "load_model_factory",
    "model_import_dir",
]

WIDE_HIDDEN = 640  # wide-mlp's hidden width: 509k parameters on 28×28 inputs
_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_SPEC = re.compile(rf"^({_DOTTED}):({_DOTTED})$")
SPEC_HELP = "MODULE:FACTORY (a zero-argument callable returning a torch.nn.Module)"
# Directories this process appended to sys.path to import a spec's module, by top-level name:
# a fresh process (a Flower app) needs them on its Python path too.
_ADDED_DIRS: dict[str, Path] = {}


def build_model(
    name: str,
    *,
    input_shape: Sequence[int],
    num_classes: int,
    seed: int = 0,
    hidden: int = 64,
) -> nn.Module:
    """Build model ``name`` (or a ``MODULE:FACTORY`` spec) with weights drawn from ``seed``.

    ``"mlp"``: flatten → Linear(F, hidden) → ReLU → Linear(hidden, num_classes).

    ``"wide-mlp"``: the MLP with ``max(hidden, 640)`` hidden units, 508 810 parameters on
    28×28 inputs and 10 classes: big enough that compressing its updates matters.

    ``"module:factory"``: ``factory()`` from an importable module (see
    :func:`load_model_factory`), called under the seeded RNG; it must return an
    ``nn.Module`` that maps ``(B, *input_shape)`` to ``(B, num_classes)``, which is checked
    with one forward pass in evaluation mode (BatchNorm statistics are not touched).

    ``"resnet"``: a ResNet for small images: a 3×3 stem (16 channels), then four stages
    of two basic blocks (3×3 convolutions with BatchNorm and a residual connection;
    16, 32, 64 and 192 channels, stages 2–4 halving H and W), global average pooling and
    Linear(192, num_classes): 1 296 378 parameters for one input channel and 10 classes,
    most of them in the last stage, where the image is smallest, so a step stays cheap on
    a CPU. ``hidden`` is not used.

    ``"cnn"``: two blocks of 3×3 convolution (padding 1; 16 then 32 channels), ReLU and 2×2
    max-pooling, then Linear(·, hidden) → ReLU → Linear(hidden, num_classes). A spatial axis
    shorter than 2 is not pooled, so any ``(C, H, W)`` works: 28×28 pools to 7×7 (105 866
    parameters with ``hidden=64`` and 10 classes), 8×8 pools to 2×2 (13 706 parameters).

    Parameters
    ----------
    name : str
        One of :data:`MODELS`, or a ``MODULE:FACTORY`` spec.
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
        If the name is unknown, a parameter is out of range, or a spec's factory cannot be
        imported, fails, or builds a model that does not fit the data.
    """
    if is_model_spec(name):
        return _build_from_spec(name, input_shape=input_shape, num_classes=num_classes, seed=seed)
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; allowed: {', '.join(MODELS)} or {SPEC_HELP}")
    shape = _check_shape(input_shape, needs_image=name in ("cnn", "resnet"))
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
        if name == "resnet":
            return _resnet(shape, num_classes)
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


def is_model_spec(name: str) -> bool:
    """Whether ``name`` is a ``MODULE:FACTORY`` spec rather than a built-in model's name."""
    return ":" in name


def load_model_factory(spec: str) -> Callable[[], object]:
    """Import the factory a ``MODULE:FACTORY`` spec names; raise ``ConfigError`` if it can't.

    The module is imported from the Python path; when it is not there, the current
    directory is tried (``flplatform simulate --model mymodel:Net`` next to ``mymodel.py``)
    and, if that finds it, stays on ``sys.path`` (see :func:`model_import_dir`).

    Parameters
    ----------
    spec : str
        ``module.path:attribute`` (the attribute may be dotted: ``mod:Class.factory``).

    Returns
    -------
    callable
        The attribute; it is checked to be callable, not called.
    """
    match = _SPEC.match(spec.strip())
    if match is None:
        raise ConfigError(
            f"model spec {spec!r} is not {SPEC_HELP}, e.g. own_app.task:Net; "
            f"built-in models: {', '.join(MODELS)}"
        )
    module_name, attribute = match.groups()
    obj: object = _import_module(module_name, spec)
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"model spec {spec!r}: module {module_name!r} has no {attribute!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(
            f"model spec {spec!r}: {attribute!r} is a {type(obj).__name__}, not a callable "
            "returning a torch.nn.Module"
        )
    return obj


def model_import_dir(spec: str) -> Path | None:
    """The directory this process had to add to ``sys.path`` to import ``spec``'s module.

    None when the module came from the Python path as is (or was not imported yet): other
    processes find it the same way. Flower's processes need the directory otherwise.
    """
    top = spec.split(":", 1)[0].split(".", 1)[0]
    return _ADDED_DIRS.get(top)


@contextmanager
def _flower_import_lock(timeout: float = 120.0) -> Iterator[None]:
    """Hold Flower's app-import lock while importing a spec's module.

    Flower's ``load_app`` takes a module already in ``sys.modules`` as it is: a ClientApp
    module that the ServerApp's thread is still importing (``--model client_module:Net``
    in a simulation) would be loaded half-initialized. Flower's lock is not reentrant, so
    it is waited for at most ``timeout`` seconds (an import nested inside Flower's own
    then goes ahead without it).
    """
    from flplatform.core.flower_internals import import_lock

    lock = import_lock()
    acquired = lock is not None and lock.acquire(timeout=timeout)
    try:
        yield
    finally:
        if acquired and lock is not None:
            lock.release()


def _import_module(module_name: str, spec: str) -> object:
    with _flower_import_lock():
        return _import_module_unlocked(module_name, spec)


def _import_module_unlocked(module_name: str, spec: str) -> object:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if not _is_the_module(exc, module_name):
            raise ConfigError(
                f"model spec {spec!r}: importing {module_name!r} failed: {exc}"
            ) from None
    except Exception as exc:
        raise ConfigError(
            f"model spec {spec!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from None
    # Not on the Python path: try the current directory (appended, so that it shadows
    # nothing that is installed).
    cwd = Path(os.getcwd()).resolve()
    added = str(cwd) not in sys.path
    if added:
        sys.path.append(str(cwd))
    importlib.invalidate_caches()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if added:
            sys.path.remove(str(cwd))
        if _is_the_module(exc, module_name):
            raise ConfigError(
                f"model spec {spec!r}: no module named {module_name!r} on the Python path or "
                f"in the current directory ({cwd})"
            ) from None
        raise ConfigError(f"model spec {spec!r}: importing {module_name!r} failed: {exc}") from None
    except Exception as exc:
        raise ConfigError(
            f"model spec {spec!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from None
    if added:
        _ADDED_DIRS[module_name.split(".", 1)[0]] = cwd
    return module


def _is_the_module(exc: ModuleNotFoundError, module_name: str) -> bool:
    """Whether the missing module is ``module_name`` (or a parent), not one it imports."""
    missing = exc.name or ""
    return module_name == missing or module_name.startswith(missing + ".")


def instantiate_model_spec(spec: str, *, seed: int = 0) -> nn.Module:
    """Import and call a ``MODULE:FACTORY`` spec under a seeded, forked RNG.

    Raises
    ------
    ConfigError
        If the factory cannot be imported, fails when called with no arguments, or returns
        something that is not an ``nn.Module``.
    """
    factory = load_model_factory(spec)
    seed = check_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = factory()
        except Exception as exc:
            raise ConfigError(
                f"model spec {spec!r}: calling it with no arguments failed: "
                f"{type(exc).__name__}: {exc}"
            ) from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model spec {spec!r} returned a {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def _build_from_spec(
    spec: str, *, input_shape: Sequence[int], num_classes: int, seed: int
) -> nn.Module:
    shape = _check_shape(input_shape, needs_image=False)
    num_classes = check_int(num_classes, name="num_classes", minimum=1)
    model = instantiate_model_spec(spec, seed=seed)
    _check_fits(model, spec, shape, num_classes)
    return model


def _check_fits(model: nn.Module, spec: str, shape: tuple[int, ...], num_classes: int) -> None:
    """One forward pass on zeros: the model takes the data's examples and gives its logits."""
    was_training = model.training
    model.eval()  # BatchNorm uses (and keeps) its running statistics; dropout is off
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            out = model(torch.zeros(2, *shape))
    except Exception as exc:
        raise ConfigError(
            f"model spec {spec!r} cannot take this dataset's examples of shape {shape}: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(
            f"model spec {spec!r} maps a batch of 2 examples to {got}; this dataset needs "
            f"logits of shape (2, {num_classes})"
        )


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


RESNET_STAGES = (16, 32, 64, 192)  # channels of the four stages of two basic blocks


class _BasicBlock(nn.Module):
    """3×3 conv → BN → ReLU → 3×3 conv → BN, plus the input (1×1 conv + BN when the
    shape changes), then ReLU: ResNet's basic block (He et al., 2016)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def _resnet(shape: tuple[int, ...], num_classes: int) -> nn.Module:
    channels = shape[0]
    layers: OrderedDict[str, nn.Module] = OrderedDict(
        stem=nn.Conv2d(channels, RESNET_STAGES[0], 3, padding=1, bias=False),
        stem_bn=nn.BatchNorm2d(RESNET_STAGES[0]),
        stem_relu=nn.ReLU(),
    )
    c_in = RESNET_STAGES[0]
    for stage, c_out in enumerate(RESNET_STAGES, start=1):
        stride = 1 if stage == 1 else 2  # 28×28 → 28, 14, 7, 4
        layers[f"stage{stage}"] = nn.Sequential(
            _BasicBlock(c_in, c_out, stride), _BasicBlock(c_out, c_out, 1)
        )
        c_in = c_out
    layers["pool"] = nn.AdaptiveAvgPool2d(1)
    layers["flatten"] = nn.Flatten()
    layers["fc"] = nn.Linear(c_in, num_classes)
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
