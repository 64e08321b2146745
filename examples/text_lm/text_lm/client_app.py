"""text-lm's ClientApp: a plain train function plus one mod, as own-app's.

``train`` is ordinary Flower code: ``arrays`` and ``config`` in, ``arrays`` and ``metrics``
(``num-examples``, ``train_loss``) out; ``flplatform_mod()`` turns it into whichever
algorithm the server's round asks for.
"""

from __future__ import annotations

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from strategies.mods import flplatform_mod
from text_lm.task import ByteTransformer, load_data, site_name, site_seed
from text_lm.task import test as test_fn
from text_lm.task import train as train_fn

app = ClientApp()


def _partition(context: Context) -> tuple[int, int]:
    return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])


def _model(msg: Message, run: dict) -> ByteTransformer:
    model = ByteTransformer(width=int(run["width"]), layers=int(run["layers"]))
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    return model


@app.train(mods=[flplatform_mod()])
def train(msg: Message, context: Context) -> Message:
    """Train the received model on this site's packages."""
    run = context.run_config
    config = msg.content["config"]
    model = _model(msg, run)
    partition_id, num_partitions = _partition(context)
    data, _ = load_data(partition_id, num_partitions, windows_per_site=int(run["windows-per-site"]))
    # Batches drawn per (seed, round, site): a run is reproducible, and one resumed after
    # a crash repeats the uninterrupted one.
    seed = site_seed(
        int(config.get("seed", run["seed"])), int(config.get("server-round", 0)), partition_id
    )
    train_loss = train_fn(
        model,
        data,
        steps=int(config.get("local-steps", run["local-steps"])),
        batch_size=int(config.get("batch-size", run["batch-size"])),
        lr=float(config.get("lr", run["learning-rate"])),
        seed=seed,
    )
    metrics = MetricRecord({"train_loss": train_loss, "num-examples": len(data)})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received model on this site's held-out windows."""
    run = context.run_config
    model = _model(msg, run)
    _, val = load_data(*_partition(context), windows_per_site=int(run["windows-per-site"]))
    loss, accuracy = test_fn(model, val)
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": accuracy, "num-examples": len(val)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Name the site after its largest package, so that the ledger says whose code it is."""
    partition_id, num_partitions = _partition(context)
    info = ConfigRecord(
        {"site-name": site_name(partition_id, num_partitions), "partition-id": partition_id}
    )
    return Message(content=RecordDict({"site-info": info}), reply_to=msg)
