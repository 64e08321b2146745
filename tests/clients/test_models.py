"""Tests of clients.models: shapes, parameter counts, seeded initialisation, RNG isolation."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from clients.datasets import load_dataset
from clients.models import (
    MODELS,
    build_model,
    count_parameters,
    instantiate_model_spec,
    is_model_spec,
    load_model_factory,
    model_import_dir,
)
from flplatform.core.errors import ConfigError

SHAPES = [(1, 8, 8), (1, 28, 28)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", MODELS)
def test_output_shape(name: str, shape: tuple[int, int, int]) -> None:
    model = build_model(name, input_shape=shape, num_classes=10)
    logits = model(torch.rand(5, *shape))
    assert logits.shape == (5, 10) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("shape", [(1, 1, 13), (1, 5, 5), (3, 2, 9), (1, 1, 1)])
def test_cnn_handles_small_and_odd_shapes(shape: tuple[int, int, int]) -> None:
    model = build_model("cnn", input_shape=shape, num_classes=3)
    assert model(torch.rand(2, *shape)).shape == (2, 3)


def test_parameter_counts_match_the_hand_computed_ones() -> None:
    # MLP on 8x8: (64*64 + 64) + (64*10 + 10) = 4 810.
    assert count_parameters(build_model("mlp", input_shape=(1, 8, 8), num_classes=10)) == 4810
    # CNN: conv1 1*16*9+16 = 160; conv2 16*32*9+32 = 4 640; fc2 64*10+10 = 650; fc1 takes
    # 32*7*7 = 1 568 features on 28x28 (1 568*64+64 = 100 416) and 32*2*2 = 128 on 8x8
    # (128*64+64 = 8 256).
    cnn28 = build_model("cnn", input_shape=(1, 28, 28), num_classes=10)
    cnn8 = build_model("cnn", input_shape=(1, 8, 8), num_classes=10)
    assert count_parameters(cnn28) == 160 + 4640 + 100_416 + 650 == 105_866
    assert count_parameters(cnn8) == 160 + 4640 + 8_256 + 650 == 13_706
    wide = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, hidden=100)
    assert count_parameters(wide) == 64 * 100 + 100 + 100 * 10 + 10
    wide_mlp = build_model("wide-mlp", input_shape=(1, 28, 28), num_classes=10)
    assert count_parameters(wide_mlp) == 784 * 640 + 640 + 640 * 10 + 10 == 508_810


def test_resnet_parameters_by_hand_and_its_batchnorm_buffers() -> None:
    def block(c_in: int, c_out: int) -> int:  # two 3×3 convs, two BNs, a 1×1 shortcut
        shortcut = c_in * c_out + 2 * c_out if c_in != c_out else 0
        return 9 * c_in * c_out + 9 * c_out * c_out + 4 * c_out + shortcut

    stem = 9 * 16 + 2 * 16
    stages = sum(block(a, b) + block(b, b) for a, b in [(16, 16), (16, 32), (32, 64), (64, 192)])
    fc = 192 * 10 + 10
    model = build_model("resnet", input_shape=(1, 28, 28), num_classes=10)
    assert count_parameters(model) == stem + stages + fc == 1_296_378
    state = model.state_dict()
    counters = [k for k in state if k.endswith("num_batches_tracked")]
    assert len(counters) == 1 + 2 * 4 * 2 + 3  # the stem's, two per block, one per shortcut
    assert all(state[k].dtype == torch.int64 and state[k].dim() == 0 for k in counters)
    # 28×28 is halved three times (28, 14, 7, 4) before the global average pool
    features = model[:-3](torch.rand(2, 1, 28, 28))
    assert features.shape == (2, 192, 4, 4)


@pytest.mark.parametrize("name", MODELS)
def test_same_seed_same_weights_different_seed_different_weights(name: str) -> None:
    first = build_model(name, input_shape=(1, 8, 8), num_classes=10, seed=11).state_dict()
    again = build_model(name, input_shape=(1, 8, 8), num_classes=10, seed=11).state_dict()
    other = build_model(name, input_shape=(1, 8, 8), num_classes=10, seed=12).state_dict()
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[key], again[key]) for key in first)
    # every drawn tensor differs (BatchNorm starts at constants: weight 1, bias 0, stats)
    drawn = [key for key in first if first[key].numel() > 1 and first[key].unique().numel() > 1]
    assert drawn and all(not torch.equal(first[key], other[key]) for key in drawn)


@pytest.mark.parametrize("name", MODELS)
def test_global_torch_rng_is_untouched(name: str) -> None:
    torch.manual_seed(123)
    state = torch.get_rng_state()
    expected_next = torch.rand(3)
    torch.set_rng_state(state)
    build_model(name, input_shape=(1, 28, 28), num_classes=10, seed=5)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(torch.rand(3), expected_next)


PLAIN = [name for name in MODELS if name != "resnet"]


@pytest.mark.parametrize("name", PLAIN)
def test_no_batchnorm_and_no_buffers(name: str) -> None:
    model = build_model(name, input_shape=(1, 28, 28), num_classes=10)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    # The whole state is parameters, so FedAvg over state_dict is FedAvg over the model.
    assert set(model.state_dict()) == {key for key, _ in model.named_parameters()}
    layers = ["fc1", "fc2"] if name.endswith("mlp") else ["conv1", "conv2", "fc1", "fc2"]
    assert list(model.state_dict()) == [
        f"{layer}.{p}" for layer in layers for p in ("weight", "bias")
    ]


@pytest.mark.parametrize("name", MODELS)
def test_models_learn_digits(name: str) -> None:
    # A gradient-flow sanity check: 60 full-batch Adam steps fit 128 training digits
    # (both reach 100% at this seed; a broken layer or a detached graph would not).
    data = load_dataset("digits")
    x = torch.from_numpy(data.x_train[:128].copy())
    y = torch.from_numpy(data.y_train[:128].copy())
    model = build_model(name, input_shape=data.input_shape, num_classes=data.num_classes)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(60):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    assert accuracy > 0.95


def test_unknown_model_lists_the_allowed_ones() -> None:
    with pytest.raises(ConfigError, match="allowed: mlp, cnn, wide-mlp, resnet"):
        build_model("vgg", input_shape=(1, 8, 8), num_classes=10)


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("cnn", {"input_shape": (64,)}, "input_shape must be \\(C, H, W\\)"),
        ("cnn", {"input_shape": (1, 0, 8)}, "input_shape"),
        ("mlp", {"input_shape": ()}, "input_shape"),
        ("mlp", {"input_shape": (1, -8, 8)}, "input_shape"),
        ("mlp", {"input_shape": 64}, "input_shape"),
        ("mlp", {"num_classes": 0}, "num_classes"),
        ("mlp", {"hidden": 0}, "hidden"),
        ("cnn", {"seed": -1}, "seed"),
    ],
)
def test_bad_arguments(name: str, kwargs: dict, message: str) -> None:
    arguments: dict = {"input_shape": (1, 8, 8), "num_classes": 10, **kwargs}
    with pytest.raises(ConfigError, match=message):
        build_model(name, **arguments)


# ---------------------------------------------------------------- MODULE:FACTORY specs
USER_MODELS = '''
import torch
from torch import nn


class Net(nn.Module):
    """A user's CNN with BatchNorm (running statistics and an integer counter) and dropout."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(self.drop(torch.relu(self.bn(self.conv(x))).flatten(1)))


def five_classes():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 5))


def flat_only():
    return nn.Linear(64, 10)  # takes (B, 64), not (B, 1, 8, 8)


def not_a_module():
    return "a string"


def needs_an_argument(width):
    return nn.Linear(64, width)


def broken():
    raise RuntimeError("out of coffee")


NOT_CALLABLE = 42
'''


@pytest.fixture
def user_models(tmp_path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A package ``usermodels_<n>.zoo`` on sys.path (a fresh name per test: no import cache)."""
    package = f"usermodels_{tmp_path.name.replace('-', '_')}"
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "zoo.py").write_text(USER_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{package}.zoo"


def test_a_factory_spec_builds_the_users_model(user_models: str) -> None:
    spec = f"{user_models}:Net"
    assert is_model_spec(spec) and not is_model_spec("cnn")
    model = build_model(spec, input_shape=(1, 8, 8), num_classes=10, seed=3)
    assert type(model).__name__ == "Net" and model.training
    assert "bn.num_batches_tracked" in model.state_dict()
    # The fit check ran in eval mode: the BatchNorm statistics are the fresh ones.
    assert int(model.state_dict()["bn.num_batches_tracked"]) == 0
    assert torch.equal(model.bn.running_mean, torch.zeros(4))
    again = build_model(spec, input_shape=(1, 8, 8), num_classes=10, seed=3).state_dict()
    other = build_model(spec, input_shape=(1, 8, 8), num_classes=10, seed=4).state_dict()
    assert torch.equal(model.state_dict()["conv.weight"], again["conv.weight"])
    assert not torch.equal(model.state_dict()["conv.weight"], other["conv.weight"])


def test_a_factory_spec_leaves_the_global_rng_alone(user_models: str) -> None:
    torch.manual_seed(9)
    state = torch.get_rng_state()
    build_model(f"{user_models}:Net", input_shape=(1, 8, 8), num_classes=10, seed=1)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize(
    ("attribute", "message"),
    [
        ("Missing", "has no 'Missing'"),
        ("NOT_CALLABLE", "'NOT_CALLABLE' is a int, not a callable"),
        ("not_a_module", "returned a str, not a torch.nn.Module"),
        ("needs_an_argument", "calling it with no arguments failed: TypeError"),
        ("broken", "calling it with no arguments failed: RuntimeError: out of coffee"),
        ("five_classes", r"maps a batch of 2 examples to \(2, 5\); .* \(2, 10\)"),
        ("flat_only", r"cannot take this dataset's examples of shape \(1, 8, 8\)"),
    ],
)
def test_a_bad_factory_is_one_clear_error(user_models: str, attribute: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_model(f"{user_models}:{attribute}", input_shape=(1, 8, 8), num_classes=10)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_xyz:Net", "no module named 'no_such_module_xyz'"),
        ("mod:", "is not MODULE:FACTORY"),
        ("a:b:c", "is not MODULE:FACTORY"),
        ("1mod:Net", "is not MODULE:FACTORY"),
    ],
)
def test_an_unimportable_spec_is_one_clear_error(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_model_factory(spec)


def test_a_spec_whose_module_fails_to_import_says_why(tmp_path, monkeypatch) -> None:
    (tmp_path / "needs_missing_dep.py").write_text("import no_such_dependency_abc\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="importing 'needs_missing_dep' failed: .*no_such_dep"):
        load_model_factory("needs_missing_dep:Net")


def test_a_spec_is_found_in_the_current_directory(tmp_path, monkeypatch) -> None:
    """`flplatform simulate --model mymodel:Net` next to mymodel.py: the cwd is tried last,
    and reported so that Flower's processes get it on their Python path."""
    name = f"cwd_model_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(USER_MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    assert model_import_dir(f"{name}:Net") is None
    model = instantiate_model_spec(f"{name}:Net")
    assert isinstance(model, nn.Module)
    assert model_import_dir(f"{name}:Net") == tmp_path.resolve()
    assert sys.path[-1] == str(tmp_path.resolve())  # appended: it shadows nothing installed
