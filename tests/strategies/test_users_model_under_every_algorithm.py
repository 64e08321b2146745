"""A Flower user's own model and training loop under every algorithm, through the mod.

Written as Flower's quickstart-pytorch writes its ClientApp: its own ``Net``, its own
data (scikit-learn's digits, the raw 0-16 pixel values) and loop, a config without
``local-steps``, ``ArrayRecord(model.state_dict())`` and ``num-examples`` out. The model
holds what users' models hold beside plain float32 weights: an ``Embedding`` (rows that a
batch does not see get no gradient), a frozen parameter (``requires_grad=False``), a
BatchNorm (running statistics and its int64 counter), a trainable float16 parameter and a
float16 buffer, a running class distribution, named in ``averaged_arrays``.

Each algorithm must finish with every update applied, leave the frozen parameter bit for
bit as it started, and keep the buffers valid: variances > 0, the distribution
non-negative and summing to 1, the counter counting the sites' steps. The real strategies,
engine and mods; only the transport is in-process.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from sklearn.datasets import load_digits
from torch import nn

from flplatform.core import keys
from flplatform.core.arrays import arrays_to_record, record_to_arrays
from flplatform.engine import APPLIED, RoundSummary, Synchrony
from flplatform.engine.engine import RoundEngine
from flplatform.engine.strategy import EngineStrategy
from strategies.delayed import DelayedCompensated
from strategies.fetchsgd import FetchSGD
from strategies.local_sgd import LocalSGDAveraging
from strategies.mods import flplatform_mod
from strategies.sketched_sgd import SketchedSGD
from tests.helpers.delayed_sites import context
from tests.helpers.scripted_grid import ScriptedGrid

pytestmark = pytest.mark.usefixtures("task_identity")

ROUNDS = 3
SITES = 3
BATCHES = 4  # the user's loop: one pass over its first BATCHES batches of 32
FROZEN = "calibration"
PRIOR = "class_prior"


class Net(nn.Module):
    """Pixel-value embeddings → Linear → BatchNorm → ReLU → Linear, scaled per class by a
    float16 temperature and a frozen calibration; keeps a running class distribution."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(17, 3)  # the digits' pixel values are 0-16
        self.hidden = nn.Linear(64 * 3, 24)
        self.norm = nn.BatchNorm1d(24)
        self.head = nn.Linear(24, 10)
        self.temperature = nn.Parameter(torch.ones(10, dtype=torch.float16))
        self.calibration = nn.Parameter(torch.linspace(0.9, 1.1, 10), requires_grad=False)
        self.register_buffer(PRIOR, torch.full((10,), 0.1, dtype=torch.float16))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.norm(self.hidden(self.embed(pixels).flatten(1))))
        logits = self.head(x) * self.temperature.float() * self.calibration
        if self.training:
            with torch.no_grad():
                mixed = 0.9 * self.class_prior.float() + 0.1 * logits.softmax(1).mean(0)
                self.class_prior.copy_(mixed / mixed.sum())
        return logits


def site_data(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    digits = load_digits()
    pixels = torch.as_tensor(digits.data, dtype=torch.int64)[index::SITES]
    return pixels, torch.as_tensor(digits.target)[index::SITES]


def users_train(msg: Message, context: Context) -> Message:
    """The quickstart's train function: load the weights, a pass of SGD, send them back."""
    model = Net()
    model.load_state_dict(msg.content[keys.ARRAYS].to_torch_state_dict())
    pixels, labels = site_data(int(context.node_config["partition-id"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=float(msg.content["config"]["lr"]))
    model.train()
    losses = []
    for start in range(0, 32 * BATCHES, 32):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(
            model(pixels[start : start + 32]), labels[start : start + 32]
        )
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord(
                {"train_loss": float(np.mean(losses)), "num-examples": len(labels)}
            ),
        }
    )
    return Message(content, reply_to=msg)


def site(
    index: int, train: Callable[[Message, Context], Message] = users_train
) -> Callable[[Message], Message]:
    """Site ``index``: ``train`` (the quickstart's by default) behind flplatform's mod."""
    state = context(index + 1, node_config={"partition-id": index})

    def behave(msg: Message) -> Message:
        if msg.metadata.message_type == MessageType.QUERY:
            info = ConfigRecord({keys.SITE_NAME: f"site-{index}"})
            return Message(RecordDict({keys.SITE_INFO: info}), reply_to=msg)
        return flplatform_mod()(msg, state, train)

    return behave


NAMED = [PRIOR]
STRATEGIES: dict[str, Callable[[], EngineStrategy]] = {
    "local-sgd": lambda: LocalSGDAveraging(averaged_arrays=NAMED),
    "fedavgm": lambda: LocalSGDAveraging(eta=0.7, beta=0.9, averaged_arrays=NAMED),
    "top-k": lambda: LocalSGDAveraging(codec="topk:0.1", averaged_arrays=NAMED),
    "int8": lambda: LocalSGDAveraging(codec="int8", averaged_arrays=NAMED),
    "delayed": lambda: DelayedCompensated(delay=1, num_rounds=ROUNDS, averaged_arrays=NAMED),
    "dts": lambda: DelayedCompensated(
        delay=1, num_rounds=ROUNDS, codec="topk:0.1", averaged_arrays=NAMED
    ),
    "fetchsgd": lambda: FetchSGD(k=150, sketch_cols=600, seed=2, averaged_arrays=NAMED),
    "sketched-sgd": lambda: SketchedSGD(k=150, sketch_cols=600, seed=2, averaged_arrays=NAMED),
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_algorithm_keeps_frozen_weights_and_valid_buffers(name: str) -> None:
    torch.manual_seed(0)
    start = Net().state_dict()
    models = [record_to_arrays(ArrayRecord(start))]
    summaries: list[RoundSummary] = []
    grid = ScriptedGrid({n + 1: site(n) for n in range(SITES)})
    strategy = STRATEGIES[name]()
    RoundEngine(
        grid,
        strategy,
        policy=strategy.engine_policy(Synchrony("sync"), num_rounds=ROUNDS),
        poll_interval=0.0,
        required_sites=SITES,
        on_round=summaries.append,
    ).run(
        ArrayRecord(start),
        num_rounds=ROUNDS,
        train_config=ConfigRecord({"lr": 0.1}),  # no local-steps, as the quickstart's
        evaluate_fn=lambda _, arrays: models.append(record_to_arrays(arrays)),
    )
    assert len(summaries) == ROUNDS
    assert all(u.status == APPLIED for s in summaries for u in s.updates), [
        (u.status, u.reason) for s in summaries for u in s.updates if u.status != APPLIED
    ]
    assert list(models[-1]) == list(models[0])  # the key order of the user's state dict
    for model in models[1:]:
        assert model[FROZEN].tobytes() == models[0][FROZEN].tobytes()
        assert model["temperature"].dtype == np.float16 and np.isfinite(model["temperature"]).all()
        assert (model["norm.running_var"] > 0).all()
        prior = model[PRIOR]
        assert prior.dtype == np.float16 and (prior >= 0).all()
        assert abs(float(prior.astype(np.float64).sum()) - 1) < 5e-3
        assert model["norm.num_batches_tracked"].dtype == np.int64
    # Every step counted the sites' BATCHES steps once (Sketched-SGD steps every second
    # round; delayed updates apply the average one round late).
    counts = [int(m["norm.num_batches_tracked"]) for m in models]
    assert counts[0] == 0 and counts[-1] > 0 and all(c % BATCHES == 0 for c in counts)
    assert counts == sorted(counts)
    # and training moved the rest
    assert not np.array_equal(models[-1]["head.weight"], models[0]["head.weight"])


def test_server_rates_and_momentum_leave_buffers_to_the_sites_mean_change() -> None:
    """η = 3 (delayed) and β = 0.9 with η = 3 (FedAvgM) scale the learned step only: sites
    that set a running variance to 0.2 from 1.0 leave it 0.2, where 1 + 3·(0.2 − 1) = −1.4."""

    def train(msg: Message, context: Context) -> Message:
        w = msg.content["arrays"]["w"].numpy()
        arrays = {"w": w - 0.5, "bn.running_var": np.full(2, 0.2, np.float32)}
        metrics = MetricRecord({"num-examples": 4})
        content = RecordDict({"arrays": arrays_to_record(arrays), "metrics": metrics})
        return Message(content, reply_to=msg)

    start = {"w": np.zeros(2, np.float32), "bn.running_var": np.ones(2, np.float32)}
    for strategy in (
        DelayedCompensated(delay=0, num_rounds=2, eta=3.0),
        LocalSGDAveraging(eta=3.0, beta=0.9),
    ):
        models: list[dict[str, np.ndarray]] = []
        RoundEngine(
            ScriptedGrid({1: site(0, train), 2: site(1, train)}),
            strategy,
            policy=strategy.engine_policy(Synchrony("sync"), num_rounds=2),
            poll_interval=0.0,
            required_sites=2,
        ).run(
            arrays_to_record(start),
            num_rounds=2,
            evaluate_fn=lambda _, arrays, models=models: models.append(record_to_arrays(arrays)),
        )
        assert len(models) == 3, strategy
        for model in models[1:]:
            np.testing.assert_allclose(model["bn.running_var"], [0.2, 0.2], rtol=1e-6)
        np.testing.assert_allclose(models[1]["w"], [-1.5, -1.5])  # η·Δ̄ = 3·(−0.5)
