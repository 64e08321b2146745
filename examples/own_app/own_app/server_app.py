"""own-app's ServerApp: its own model and central evaluation, flplatform's algorithms.

Where a Flower ServerApp calls ``strategy.start(grid, arrays, ...)``, this one calls
``flplatform.start(strategy, grid, arrays, ...)``: the same rounds, plus synchrony modes,
simulated networks and the ledger. ``flplatform run`` overrides start()'s options
(``--sync``, ``--network``, ``--rounds``, ...) from the command line.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

import flplatform
from own_app.task import Net, load_test_data
from own_app.task import test as test_fn
from strategies.delayed import DelayedCompensated
from strategies.fetchsgd import FetchSGD
from strategies.local_sgd import LocalSGDAveraging
from strategies.sketched_sgd import SketchedSGD

STRATEGIES = ("local-sgd", "delayed", "dts", "fetchsgd", "sketched-sgd")
DTS_CODEC = "topk:0.01"  # delayed updates with top-1% uploads (when codec is "none")

app = ServerApp()


def make_strategy(
    name: str, run: dict, num_rounds: int
) -> LocalSGDAveraging | DelayedCompensated | FetchSGD | SketchedSGD:
    """The strategy the ``strategy`` key names, with this app's knobs."""
    eta, seed, codec = float(run["server-lr"]), int(run["seed"]), str(run["codec"])
    if name == "local-sgd":
        return LocalSGDAveraging(
            eta=eta,
            beta=float(run["server-momentum"]),
            nesterov=bool(run["server-nesterov"]),
            momentum_every=int(run["server-momentum-every"]),
            seed=seed,
            codec=codec,
            aggregator=str(run["aggregator"]),
        )
    if name in ("delayed", "dts"):
        if name == "dts" and codec == "none":
            codec = DTS_CODEC
        return DelayedCompensated(
            delay=int(run["delay"]),
            num_rounds=num_rounds,
            eta=eta,
            beta=float(run["server-momentum"]),
            nesterov=bool(run["server-nesterov"]),
            fragments=int(run["fragments"]),
            seed=seed,
            codec=codec,
        )
    k, rows, cols = int(run["top-k"]), int(run["sketch-rows"]), int(run["sketch-cols"])
    if name == "fetchsgd":
        return FetchSGD(k=k, sketch_rows=rows, sketch_cols=cols, eta=eta, seed=seed)
    if name == "sketched-sgd":
        return SketchedSGD(k=k, sketch_rows=rows, sketch_cols=cols, eta=eta, seed=seed)
    raise ValueError(f"unknown strategy {name!r}; this app knows {', '.join(STRATEGIES)}")


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Build the model and the strategy, then run the rounds."""
    run = dict(context.run_config)
    num_rounds = int(run["num-server-rounds"])
    name = str(run["strategy"])
    strategy = make_strategy(name, run, num_rounds)
    torch.manual_seed(int(run["seed"]))
    initial = ArrayRecord(Net().state_dict())
    testloader = load_test_data()

    def central_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = Net()
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = test_fn(model, testloader)
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    flplatform.start(
        strategy,
        grid,
        initial,
        num_rounds=num_rounds,
        train_config=ConfigRecord(
            {
                "lr": float(run["learning-rate"]),
                "momentum": float(run["momentum"]),
                "local-epochs": int(run["local-epochs"]),
                "local-steps": int(run["local-steps"]),
                "batch-size": int(run["batch-size"]),
                "seed": int(run["seed"]),
            }
        ),
        evaluate_fn=central_evaluate,
        seed=int(run["seed"]),
        ledger="default",
        name=f"own-app-{name}",
        run_config=run,
    )
