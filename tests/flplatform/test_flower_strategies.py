"""Every Flower Message-API strategy of the installed Flower runs under ``flplatform.start``.

The sites reply as PyTorch sites do: whatever dtype the server sends, they load it into
their float32 weights and int64 counter (a BatchNorm's ``num_batches_tracked``) and send
those dtypes back. Under NumPy 2, FedAdam's and QFedAvg's steps return float64 weights and
FedAvg's weighted sum turns the counter into floats; Flower's own ``start`` sends that on,
the platform keeps the model's dtypes (``FlowerStrategyAdapter``), so no reply is refused.
The real round engine, ledger and strategies run; only the transport is in-process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import strategy as flower_strategies
from flwr.serverapp.strategy import Strategy

from flplatform.core import keys
from flplatform.core.arrays import record_to_arrays
from flplatform.engine import APPLIED
from flplatform.run.start import start
from storage import LedgerRepository
from tests.helpers.scripted_grid import Behaviour, FlowerGrid, ScriptedGrid
from tests.helpers.sites import replying_site

pytestmark = pytest.mark.usefixtures("task_identity")

SITES = 7
ROUNDS = 3
MODEL = ArrayRecord({"w": Array(np.zeros(4, np.float32)), "count": Array(np.zeros(1, np.int64))})

FLOATS = ArrayRecord({"w": Array(np.zeros(4, np.float32))})

# Each strategy as a user would build it for 7 sites; the DP wrappers around FedAvg.
FedAvg = flower_strategies.FedAvg
STRATEGIES: dict[str, Callable[[], Strategy]] = {
    "FedAvg": FedAvg,
    "FedAvgM": lambda: flower_strategies.FedAvgM(server_momentum=0.9),
    "FedProx": lambda: flower_strategies.FedProx(proximal_mu=0.1),
    "FedAdagrad": flower_strategies.FedAdagrad,
    "FedAdam": flower_strategies.FedAdam,
    "FedYogi": flower_strategies.FedYogi,
    "FedMedian": flower_strategies.FedMedian,
    "FedTrimmedAvg": flower_strategies.FedTrimmedAvg,
    "Krum": lambda: flower_strategies.Krum(num_malicious_nodes=1),
    "MultiKrum": lambda: flower_strategies.MultiKrum(num_malicious_nodes=1),
    "Bulyan": lambda: flower_strategies.Bulyan(num_malicious_nodes=1),
    "QFedAvg": lambda: flower_strategies.QFedAvg(client_learning_rate=0.1),
    "DifferentialPrivacyServerSideFixedClipping": lambda: (
        flower_strategies.DifferentialPrivacyServerSideFixedClipping(
            FedAvg(), noise_multiplier=0.1, clipping_norm=10.0, num_sampled_clients=SITES
        )
    ),
    "DifferentialPrivacyServerSideAdaptiveClipping": lambda: (
        flower_strategies.DifferentialPrivacyServerSideAdaptiveClipping(
            FedAvg(), noise_multiplier=0.1, num_sampled_clients=SITES
        )
    ),
    "DifferentialPrivacyClientSideFixedClipping": lambda: (
        flower_strategies.DifferentialPrivacyClientSideFixedClipping(
            FedAvg(), noise_multiplier=0.1, clipping_norm=10.0, num_sampled_clients=SITES
        )
    ),
    "DifferentialPrivacyClientSideAdaptiveClipping": lambda: (
        flower_strategies.DifferentialPrivacyClientSideAdaptiveClipping(
            FedAvg(), noise_multiplier=0.1, num_sampled_clients=SITES
        )
    ),
}
# Their noise comes from NumPy's unseeded generator: no second run to compare with.
NOISY = {name for name in STRATEGIES if name.startswith("DifferentialPrivacy")}
NOT_FOR_WEIGHTS = {
    # XGBoost's trees travel as bytes in one uint8 array; there are no weights to average.
    "FedXgbBagging": "aggregates serialized XGBoost trees",
    "FedXgbCyclic": "passes serialized XGBoost trees from site to site",
}


def pytorch_site(site: int) -> Behaviour:
    """Trains as a PyTorch site: its weights set to ``site``, its counter one step on,
    loaded and sent back in the model's own dtypes whatever dtypes arrived."""

    def content(msg: Message, _: np.ndarray) -> RecordDict:
        received = record_to_arrays(msg.content.array_records[keys.ARRAYS])
        # not symmetric around the median: Krum's choice has no ties
        arrays = ArrayRecord({"w": Array(np.full(4, float(site) ** 2, np.float32))})
        if "count" in received:
            # what tensor.copy_ does to a float count loaded into an int64 buffer
            arrays["count"] = Array(received["count"].astype(np.int64) + 1)
        # norm_bit: what Flower's adaptiveclipping_mod adds (clipped or not) for the
        # client-side adaptive clipping strategy; the others ignore it.
        metrics = MetricRecord(
            {keys.NUM_EXAMPLES: 10 * site, keys.TRAIN_LOSS: 0.1 * site, "norm_bit": 1.0}
        )
        return RecordDict({keys.ARRAYS: arrays, keys.METRICS: metrics})

    return replying_site(f"s{site}", content)


def sites() -> dict[int, Behaviour]:
    return {node: pytorch_site(node) for node in range(1, SITES + 1)}


def test_the_table_names_every_strategy_of_the_installed_flower() -> None:
    # A Flower release that adds a strategy fails here until it is added to the table.
    installed = {
        name
        for name, value in vars(flower_strategies).items()
        if isinstance(value, type) and issubclass(value, Strategy) and value is not Strategy
    }
    assert installed == set(STRATEGIES) | set(NOT_FOR_WEIGHTS)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_each_flower_strategy_runs_in_the_models_dtypes(
    name: str, sqlite_ledger: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="flplatform.run.flower_adapter"):
        result = start(
            STRATEGIES[name](),
            ScriptedGrid(sites()),
            MODEL,
            num_rounds=ROUNDS,
            ledger=sqlite_ledger,
            reject_replays=False,  # the sites send the same weights every round
        )
    arrays = record_to_arrays(result.arrays)
    assert {k: v.dtype for k, v in arrays.items()} == {"w": np.float32, "count": np.int64}
    assert np.isfinite(arrays["w"]).all()
    with LedgerRepository.open(sqlite_ledger) as repo:
        (run,) = repo.list_runs()
        assert run.status == "finished", run.error
        statuses = [u.status for u in repo.list_updates(run.id)]
    assert statuses == [APPLIED] * SITES * ROUNDS  # no reply refused for its dtypes
    # Said once, however many rounds had to be cast back.
    cast = [r for r in caplog.records if "cast back to the model's dtypes" in r.message]
    assert len(cast) <= 1


@pytest.mark.parametrize("name", sorted(set(STRATEGIES) - NOISY))
def test_each_flower_strategy_steps_as_under_flowers_own_start(name: str) -> None:
    # Float weights only: Flower's own QFedAvg and server-side DP wrappers fail on an
    # integer array (in-place float arithmetic), which the adapter hands them as float64.
    ours = start(
        STRATEGIES[name](), ScriptedGrid(sites()), FLOATS, num_rounds=ROUNDS, reject_replays=False
    )
    theirs = STRATEGIES[name]().start(FlowerGrid(sites()), FLOATS, num_rounds=ROUNDS)
    ours_w, theirs_w = ours.arrays["w"].numpy(), theirs.arrays["w"].numpy()
    assert ours_w.dtype == np.float32  # Flower's own FedAdam and QFedAvg end in float64
    np.testing.assert_allclose(ours_w, theirs_w, rtol=1e-5)


def test_fedadam_says_once_that_its_float64_weights_are_cast_back(
    sqlite_ledger: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="flplatform.run.flower_adapter"):
        start(
            flower_strategies.FedAdam(),
            ScriptedGrid(sites()),
            MODEL,
            num_rounds=ROUNDS,
            ledger=sqlite_ledger,
            reject_replays=False,
        )
    (said,) = [r.message for r in caplog.records if "cast back" in r.message]
    assert "Flower's FedAdam returned 'w' float64 (the model's float32)" in said


def test_fedavg_keeps_an_integer_counter_exact() -> None:
    # Each round every site counts one step: the weighted mean is the count plus one, but
    # as FedAvg's float64 sum (0.9999999999999999, say). Rounded back to int64 it stays
    # exact, where a PyTorch site loading Flower's float into its int64 buffer truncates.
    result = start(FedAvg(), ScriptedGrid(sites()), MODEL, num_rounds=ROUNDS, reject_replays=False)
    assert record_to_arrays(result.arrays)["count"].tolist() == [ROUNDS]
