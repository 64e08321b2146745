"""Every Flower Message-API strategy of the installed Flower runs under ``flplatform.start``.

The sites reply as PyTorch sites do: whatever dtype the server sends, they load it into
their float32 weights and int64 counter (a BatchNorm's ``num_batches_tracked``) and send
those dtypes back. Under NumPy 2, FedAdam's and QFedAvg's steps return float64 weights and
FedAvg's weighted sum turns the counter into floats; Flower's own ``start`` sends that on,
the platform keeps the model's dtypes (``FlowerStrategyAdapter``), so no reply is refused.
The real round engine, ledger and strategies run; only the transport is in-process.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterable
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import strategy as flower_strategies
from flwr.serverapp.strategy import Strategy

from flplatform.core import keys
from flplatform.core.arrays import record_to_arrays
from flplatform.core.errors import StepRefused
from flplatform.engine import APPLIED
from flplatform.run.flower_adapter import FlowerStrategyAdapter
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
# Their steps come back in float64 under NumPy 2 (a float64 scalar times float32).
FLOAT64_STEPS = {"FedAdam", "QFedAvg"}
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
            # what tensor.copy_ does to a float count loaded into an int64 buffer; the
            # sites take 1-3 steps a round
            arrays["count"] = Array(received["count"].astype(np.int64) + steps(site))
        # norm_bit: what Flower's adaptiveclipping_mod adds (clipped or not) for the
        # client-side adaptive clipping strategy; the others ignore it.
        metrics = MetricRecord(
            {keys.NUM_EXAMPLES: 10 * site, keys.TRAIN_LOSS: 0.1 * site, "norm_bit": 1.0}
        )
        return RecordDict({keys.ARRAYS: arrays, keys.METRICS: metrics})

    return replying_site(f"s{site}", content)


def steps(site: int) -> int:
    return site % 3 + 1


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
    # Said once, however many rounds had to be cast back; by the strategies whose NumPy
    # arithmetic returns float64 weights only.
    cast = [r for r in caplog.records if "cast back to the model's dtypes" in r.message]
    assert len(cast) == (name in FLOAT64_STEPS), [r.message for r in cast]


@pytest.mark.parametrize("name", sorted(set(STRATEGIES) - NOISY))
def test_each_flower_strategy_steps_as_under_flowers_own_start(name: str) -> None:
    # Float weights only: Flower's own QFedAvg and server-side DP wrappers fail on an
    # integer array (in-place float arithmetic), which the adapter hands them as float64.
    # The strategies' steps compared: the update guard off (Flower's start has none; these
    # sites' updates are 1 to 49 apart, which the default norm bound would clip).
    ours = start(
        STRATEGIES[name](),
        ScriptedGrid(sites()),
        FLOATS,
        num_rounds=ROUNDS,
        reject_replays=False,
        update_norm_ratio=0,
    )
    # Flower's own start converts replies with a full gc.collect() each (QFedAvg, Bulyan):
    # with the worker's heap frozen, as the adapter freezes it for ours, those collections
    # walk only the round's objects, not a thousand tests' (67 s of the suite).
    gc.freeze()
    try:
        theirs = STRATEGIES[name]().start(FlowerGrid(sites()), FLOATS, num_rounds=ROUNDS)
    finally:
        gc.unfreeze()
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


class _HeapWatchingFedAvg(FedAvg):
    """FedAvg that notes, each round, how many objects the garbage collector cannot see."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen_while_aggregating: list[int] = []

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> Any:
        self.frozen_while_aggregating.append(gc.get_freeze_count())
        return super().aggregate_train(server_round, replies)


def test_aggregation_runs_with_the_heap_hidden_from_flowers_collections() -> None:
    # Flower's QFedAvg and Bulyan run a full gc.collect() for each reply they convert: with
    # the process's objects frozen, each walks only what the aggregation made. After it,
    # the collector sees everything again; a heap the user froze stays frozen.
    gc.collect()
    assert gc.get_freeze_count() == 0
    strategy = _HeapWatchingFedAvg()
    start(strategy, ScriptedGrid(sites()), FLOATS, num_rounds=ROUNDS, reject_replays=False)
    assert len(strategy.frozen_while_aggregating) == ROUNDS
    assert all(count > 1000 for count in strategy.frozen_while_aggregating)
    assert gc.get_freeze_count() == 0

    gc.freeze()
    try:
        users = gc.get_freeze_count()
        strategy = _HeapWatchingFedAvg()
        start(strategy, ScriptedGrid(sites()), FLOATS, num_rounds=1, reject_replays=False)
        # nothing added (frozen objects that died since are gone from the count)
        assert len(strategy.frozen_while_aggregating) == 1
        assert 0 < strategy.frozen_while_aggregating[0] <= users
        assert gc.get_freeze_count() > 0  # not unfrozen
    finally:
        gc.unfreeze()


def test_an_integer_counter_is_the_sites_weighted_mean_rounded_to_the_nearest() -> None:
    # The naive reference, in exact fractions: each round the mean of the sites' counts
    # weighted by their examples (10·site), to the nearest integer (half to even, as
    # NumPy rounds). Truncated, as a PyTorch site loading a float into its int64 buffer
    # does, the count would fall behind by a step a round here (54/28 = 1.93 steps).
    count = 0
    for _ in range(ROUNDS):
        weighted = sum(Fraction(10 * n * (count + steps(n))) for n in range(1, SITES + 1))
        count = round(weighted / sum(10 * n for n in range(1, SITES + 1)))
    for name in ("FedAvg", "FedMedian", "Krum", "DifferentialPrivacyServerSideFixedClipping"):
        result = start(
            STRATEGIES[name](),
            ScriptedGrid(sites()),
            MODEL,
            num_rounds=ROUNDS,
            reject_replays=False,
        )
        assert record_to_arrays(result.arrays)["count"].tolist() == [count] == [6], name


def test_integer_arrays_stay_out_of_a_clipping_norm() -> None:
    # The server-side DP wrapper clips each site's update to norm 10 (w moves by up to
    # 49 here). The counter is no part of the update it clips: the weights end as they do
    # on a model without it (no noise, so the two runs compare exactly).
    def clipping() -> Strategy:
        return flower_strategies.DifferentialPrivacyServerSideFixedClipping(
            FedAvg(), noise_multiplier=0.0, clipping_norm=10.0, num_sampled_clients=SITES
        )

    runs = [  # the wrapper's clipping alone: the update guard's norm bound off
        start(
            clipping(),
            ScriptedGrid(sites()),
            model,
            num_rounds=2,
            reject_replays=False,
            update_norm_ratio=0,
        )
        for model in (MODEL, FLOATS)
    ]
    with_counter, without = runs
    np.testing.assert_allclose(
        with_counter.arrays["w"].numpy(), without.arrays["w"].numpy(), rtol=1e-7
    )


@pytest.mark.parametrize("value", [np.nan, np.inf, 1e30, -1.0])
def test_an_integer_array_outside_its_dtype_is_a_refused_step_not_a_wrapped_value(
    value: float,
) -> None:
    adapter = FlowerStrategyAdapter(FedAvg())
    adapter.begin_aggregation(1, ArrayRecord({"count": Array(np.zeros(2, np.uint8))}))
    with pytest.raises(StepRefused, match="'count' \\(uint8\\) would hold values outside"):
        adapter._in_model_dtypes({"count": np.array([1.0, value])})
