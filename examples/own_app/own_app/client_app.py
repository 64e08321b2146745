"""own-app's ClientApp: Flower's quickstart train/evaluate functions plus one mod.

``train`` is written exactly as for plain FedAvg: it receives ``arrays`` (the model to train
from) and ``config`` (the round's settings), trains, and replies with its ``arrays`` and
``metrics`` (``num-examples``, ``train_loss``). ``flplatform_mod()`` wraps it to speak
whichever algorithm the server's round asks for: it hands ``train`` the dense model (also
when the server sent sketches' sparse changes or delayed averages) and turns the trained
model into that algorithm's upload (a compressed delta, a count sketch, ...).
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from own_app.task import Net, load_data, site_seeds
from own_app.task import test as test_fn
from own_app.task import train as train_fn
from strategies.mods import flplatform_mod

app = ClientApp()


def _partition(context: Context) -> tuple[int, int]:
    return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])


@app.train(mods=[flplatform_mod()])
def train(msg: Message, context: Context) -> Message:
    """Train the received model on this site's data."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    config = msg.content["config"]
    run = context.run_config
    partition_id, num_partitions = _partition(context)
    # Batches and dropout (torch's global generator) seeded per (seed, round, site): a run
    # is reproducible, and one resumed after a crash repeats the uninterrupted one exactly.
    batch_seed, dropout_seed = site_seeds(
        int(config.get("seed", run["seed"])), int(config.get("server-round", 0)), partition_id
    )
    trainloader, _ = load_data(
        partition_id,
        num_partitions,
        int(config.get("batch-size", run["batch-size"])),
        seed=batch_seed,
    )
    torch.manual_seed(dropout_seed)
    train_loss = train_fn(
        model,
        trainloader,
        epochs=int(config.get("local-epochs", run["local-epochs"])),
        steps=int(config.get("local-steps", run["local-steps"])),
        lr=float(config.get("lr", run["learning-rate"])),
        momentum=float(config.get("momentum", run["momentum"])),
    )
    metrics = MetricRecord({"train_loss": train_loss, "num-examples": len(trainloader.dataset)})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received model on this site's validation data."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    _, valloader = load_data(*_partition(context), batch_size=256)
    loss, accuracy = test_fn(model, valloader)
    metrics = MetricRecord(
        {"eval_loss": loss, "eval_acc": accuracy, "num-examples": len(valloader.dataset)}
    )
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Say who this site is, so that the ledger names it (optional)."""
    partition_id, _ = _partition(context)
    info = ConfigRecord({"site-name": f"site-{partition_id}", "partition-id": partition_id})
    return Message(content=RecordDict({"site-info": info}), reply_to=msg)
