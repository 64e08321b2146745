"""text-lm's ServerApp: the transformer, central evaluation on modules no site holds, and
flplatform's local-SGD family (FedAvg, FedAvgM, DiLoCo) or delayed updates (DTS; with
fragments and an outer Nesterov step, streaming DiLoCo).
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

import flplatform
from strategies.delayed import DelayedCompensated
from strategies.local_sgd import LocalSGDAveraging
from text_lm.task import ByteTransformer, load_test_data
from text_lm.task import test as test_fn

STRATEGIES = ("local-sgd", "delayed", "dts")
DTS_CODEC = "topk:0.01"  # delayed updates with top-1% uploads (when codec is "none")

app = ServerApp()


def make_strategy(name: str, run: dict, num_rounds: int) -> LocalSGDAveraging | DelayedCompensated:
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
        )
    if name in ("delayed", "dts"):
        return DelayedCompensated(
            delay=int(run["delay"]),
            num_rounds=num_rounds,
            eta=eta,
            beta=float(run["server-momentum"]),
            nesterov=bool(run["server-nesterov"]),
            fragments=int(run["fragments"]),
            seed=seed,
            codec=DTS_CODEC if name == "dts" and codec == "none" else codec,
        )
    raise ValueError(f"unknown strategy {name!r}; this app knows {', '.join(STRATEGIES)}")


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Build the model and the strategy, then run the rounds."""
    run = dict(context.run_config)
    num_rounds = int(run["num-server-rounds"])
    name = str(run["strategy"])
    strategy = make_strategy(name, run, num_rounds)
    torch.manual_seed(int(run["seed"]))
    model = ByteTransformer(width=int(run["width"]), layers=int(run["layers"]))
    test_windows = load_test_data()

    def central_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = test_fn(model, test_windows)
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    flplatform.start(
        strategy,
        grid,
        ArrayRecord(model.state_dict()),
        num_rounds=num_rounds,
        train_config=ConfigRecord(
            {
                "lr": float(run["learning-rate"]),
                "local-steps": int(run["local-steps"]),
                "batch-size": int(run["batch-size"]),
                "seed": int(run["seed"]),
            }
        ),
        evaluate_fn=central_evaluate,
        seed=int(run["seed"]),
        ledger="default",
        name=f"text-lm-{name}",
        run_config=run,
    )
