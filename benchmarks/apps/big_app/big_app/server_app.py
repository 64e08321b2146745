"""The server: Flower's own FedAvg (server = "flower"), or flplatform.start with one of the
platform's strategies (server = "flplatform"), timing each round the same way."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

import flplatform
from big_app.task import Net, report
from strategies.delayed import DelayedCompensated
from strategies.fetchsgd import FetchSGD
from strategies.local_sgd import LocalSGDAveraging

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run = dict(context.run_config)
    rounds, directory = int(run["num-server-rounds"]), str(run["timing-dir"])
    torch.manual_seed(int(run["seed"]))
    initial = ArrayRecord(Net(int(run["hidden"])).state_dict())

    def timed(server_round: int, arrays: ArrayRecord) -> None:
        report(directory, "server", round=server_round)  # after each round's step
        return None

    if run["server"] == "flower":
        FedAvg(fraction_evaluate=0.0).start(
            grid=grid, initial_arrays=initial, num_rounds=rounds, evaluate_fn=timed
        )
        return
    name = str(run["strategy"])
    strategy: LocalSGDAveraging | DelayedCompensated | FetchSGD
    if name == "local-sgd":
        strategy = LocalSGDAveraging()
    elif name == "dts":
        strategy = DelayedCompensated(delay=1, num_rounds=rounds, codec="topk:0.01")
    elif name == "fetchsgd":
        strategy = FetchSGD(
            k=int(run["top-k"]),
            sketch_rows=int(run["sketch-rows"]),
            sketch_cols=int(run["sketch-cols"]),
        )
    else:
        raise ValueError(f"unknown strategy {name!r}: local-sgd, dts or fetchsgd")
    flplatform.start(
        strategy,
        grid,
        initial,
        num_rounds=rounds,
        evaluate_fn=timed,
        ledger="default",
        name=f"big-app-{name}",
        run_config=run,
    )
