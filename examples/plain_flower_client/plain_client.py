"""A ClientApp as Flower's PyTorch quickstart writes one: no flplatform code at all.

It receives ``arrays`` + ``config``, trains, and replies with ``arrays`` + ``metrics``
holding ``num-examples``: Flower's standard convention, which flplatform's local-SGD
averaging speaks, so this site joins an flplatform server unchanged. (It answers no
site-info query, so the ledger names it after its node id.)
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from sklearn.datasets import load_digits
from torch import nn

app = ClientApp()


class Net(nn.Sequential):
    """The same layers and parameter names as the server's ``mlp`` model on digits."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module("flatten", nn.Flatten())
        self.add_module("fc1", nn.Linear(64, 64))
        self.add_module("relu1", nn.ReLU())
        self.add_module("fc2", nn.Linear(64, 10))


def load_partition(partition_id: int, num_partitions: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(42).permutation(len(y))
    part = np.array_split(order, num_partitions)[partition_id]
    images = torch.tensor(x[part] / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    return images, torch.tensor(y[part], dtype=torch.long)


@app.train()
def train(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = load_partition(
        int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    )
    lr = float(msg.content["config"]["lr"])
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    total = 0.0
    for start in range(0, len(x), 32):
        optimizer.zero_grad()
        loss = loss_fn(model(x[start : start + 32]), y[start : start + 32])
        loss.backward()
        optimizer.step()
        total += float(loss)
    metrics = MetricRecord({"train_loss": total / max(1, len(x) // 32), "num-examples": len(x)})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = load_partition(
        int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    )
    with torch.no_grad():
        logits = model(x)
        loss = float(nn.functional.cross_entropy(logits, y))
        accuracy = float((logits.argmax(1) == y).float().mean())
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": accuracy, "num-examples": len(x)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
