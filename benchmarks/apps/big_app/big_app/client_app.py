"""The sites: Flower's quickstart train function, plus flplatform's mod (a pass-through
for Flower's own FedAvg, whose messages name no algorithm)."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from big_app.task import Net, report
from big_app.task import train as train_fn
from strategies.mods import flplatform_mod

app = ClientApp()
torch.set_num_threads(1)  # one core per simulated site


@app.train(mods=[flplatform_mod()])
def train(msg: Message, context: Context) -> Message:
    run = context.run_config
    model = Net(int(run["hidden"]))
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    partition = int(context.node_config["partition-id"])
    server_round = int(msg.content["config"].get("server-round", 0))
    loss = train_fn(
        model,
        partition,
        int(context.node_config["num-partitions"]),
        steps=int(run["local-steps"]),
        batch=int(run["batch-size"]),
        lr=float(run["learning-rate"]),
        seed=int(run["seed"]) * 1000 + partition * 100 + server_round,
    )
    report(str(run["timing-dir"]), f"site-{partition}", round=server_round)
    metrics = MetricRecord({"train_loss": loss, "num-examples": 32 * int(run["local-steps"])})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)
