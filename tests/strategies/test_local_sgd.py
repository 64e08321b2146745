"""LocalSGDAveraging's Flower hooks on real Flower messages (no network needed)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import (
    ConfigRecord,
)

from flplatform.core import keys
from flplatform.core.arrays import record_to_arrays
from flplatform.core.errors import ConfigError, UpdateRejected
from flplatform.engine import RoundSummary
from flplatform.engine.engine import RoundEngine
from strategies.local_sgd import LocalSGDAveraging
from strategies.sampling import sample_sites
from tests.helpers.delayed_sites import digits_site
from tests.helpers.replies import record, reply
from tests.helpers.scripted_grid import ScriptedGrid
from tests.helpers.sites import digits_model

pytestmark = pytest.mark.usefixtures("task_identity")


BASE = record(w=np.zeros((2, 2), np.float32), b=np.zeros(2, np.float32))


def test_batch_hook_equals_streaming_and_hand_computed_average() -> None:
    # Models 1 (1 example) and 4 (3 examples) average to (1 + 12) / 4 = 3.25 everywhere.
    replies = [
        reply(record(w=np.ones((2, 2), np.float32), b=np.ones(2, np.float32)), 1, loss=1.0),
        reply(record(w=np.full((2, 2), 4, np.float32), b=np.full(2, 4, np.float32)), 3, loss=0.2),
    ]
    strategy = LocalSGDAveraging()
    list(strategy.configure_train(1, BASE, ConfigRecord(), _OneNodeGrid()))
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is not None and metrics is not None
    np.testing.assert_allclose(record_to_arrays(arrays)["w"], np.full((2, 2), 3.25))
    assert metrics["train_loss"] == pytest.approx((1 * 1.0 + 3 * 0.2) / 4)


def test_batch_hook_logs_what_centred_clipping_did(caplog: pytest.LogCaptureFixture) -> None:
    # Flower's own start() has no ledger: the clipped update's note goes to the log. Three
    # sites at 0.5 in all 6 coordinates, one at 40, the centre 0 (no step yet): distances
    # 0.5·√6 = 1.225 (three) and 40·√6 = 97.98; the median of the four, 1.225, is the
    # radius, so the far one counts α = 1/80 = 0.0125 of its offset (said as x0.012).
    near = record(w=np.full((2, 2), 0.5, np.float32), b=np.full(2, 0.5, np.float32))
    far = record(w=np.full((2, 2), 40, np.float32), b=np.full(2, 40, np.float32))
    replies = [reply(near, 1), reply(near, 1), reply(near, 1), reply(far, 1)]
    strategy = LocalSGDAveraging(aggregator="centered-clip")
    list(strategy.configure_train(1, BASE, ConfigRecord(), _OneNodeGrid()))
    with caplog.at_level(logging.INFO, logger="flplatform"):
        arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None
    notes = [r.getMessage() for r in caplog.records if "centered-clip" in r.getMessage()]
    assert notes == [
        "round 1, reply from node 4: centered-clip: offset 97.98 from the last step > "
        "radius 1.225: counted x0.012"
    ]
    # (3 · 0.5 + 40 / 80) / 4 = 0.5 everywhere
    np.testing.assert_allclose(record_to_arrays(arrays)["w"], np.full((2, 2), 0.5), rtol=1e-6)


def test_server_learning_rate_scales_the_step() -> None:
    strategy = LocalSGDAveraging(eta=0.5)
    strategy.begin_aggregation(1, BASE)
    strategy.accumulate(
        reply(record(w=np.full((2, 2), 2, np.float32), b=np.zeros(2, np.float32)), 5), base=BASE
    )
    arrays, _ = strategy.finish_aggregation()
    assert arrays is not None
    np.testing.assert_allclose(record_to_arrays(arrays)["w"], np.full((2, 2), 1.0))


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (lambda: reply(None, 5), "'arrays'"),
        (lambda: reply(record(w=np.zeros((2, 2), np.float32)), 5), "missing arrays: b"),
        (lambda: reply(BASE, 0), "num-examples"),
        (lambda: reply(BASE, -5), "num-examples"),
        (
            lambda: reply(
                record(w=np.zeros((2, 2), np.float32), b=np.array([np.nan, 1], np.float32)), 5
            ),
            "NaN",
        ),
    ],
)
def test_malformed_replies_are_rejected_and_leave_no_trace(message, reason: str) -> None:
    strategy = LocalSGDAveraging()
    strategy.begin_aggregation(1, BASE)
    with pytest.raises(UpdateRejected, match=reason):
        strategy.accumulate(message(), base=BASE)
    assert strategy.finish_aggregation() == (None, None)  # nothing was accumulated


def test_sampling_depends_only_on_seed_and_round() -> None:
    nodes = list(range(10, 30))
    # Positions in the grid's order count, not node ids: other ids in the same places
    # are the same sample (a new Flower start-up gives the same sites other ids).
    renamed = [7 + 1000 * n for n in reversed(nodes)]
    positions = [nodes.index(n) for n in sample_sites(1, 3, nodes, 0.5)]
    assert sample_sites(1, 3, renamed, 0.5) == [renamed[i] for i in positions]
    assert len(sample_sites(1, 3, nodes, 0.5)) == 10
    rounds = {tuple(sample_sites(1, r, nodes, 0.5)) for r in range(1, 6)}
    assert rounds != {tuple(sample_sites(1, 1, nodes, 0.5))}
    assert sample_sites(1, 1, [7], 0.01) == [7]  # at least one site
    assert sample_sites(2, 3, nodes, 0.5) != sample_sites(1, 3, nodes, 0.5)
    # the strategy trains exactly that sample
    strategy = LocalSGDAveraging(fraction_train=0.5, seed=1)
    sent = strategy.configure_train(3, BASE, ConfigRecord(), _NodesGrid(nodes))
    assert [m.metadata.dst_node_id for m in sent] == sample_sites(1, 3, nodes, 0.5)


def test_a_seeded_sample_picks_the_same_sites_whatever_node_ids_flower_gave() -> None:
    sampled = []
    for ids in ([1, 2, 3, 4], [40, 30, 20, 10]):
        grid = ScriptedGrid({node: digits_site(i, 4) for i, node in enumerate(ids)})
        summaries: list[RoundSummary] = []
        RoundEngine(
            grid,
            LocalSGDAveraging(fraction_train=0.5, seed=3),
            poll_interval=0.0,
            required_sites=4,
            on_round=summaries.append,
        ).run(
            digits_model(),
            num_rounds=4,
            train_config=ConfigRecord({keys.LOCAL_STEPS: 1, keys.LR: 0.1}),
        )
        sampled.append([sorted(u.site for u in s.updates) for s in summaries])
    assert sampled[0] == sampled[1]
    assert all(len(sites) == 2 for sites in sampled[0])
    assert len({tuple(sites) for sites in sampled[0]}) > 1  # drawn afresh each round


def test_configure_train_does_not_write_into_callers_config() -> None:
    config = ConfigRecord({"lr": 0.1})
    messages = list(LocalSGDAveraging().configure_train(2, BASE, config, _OneNodeGrid()))
    assert dict(config) == {"lr": 0.1}
    sent = messages[0].content["config"]
    assert sent["server-round"] == 2 and sent["site-algorithm"] == "local-sgd"


def test_bad_knobs_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="server momentum"):
        LocalSGDAveraging(beta=1.0)
    with pytest.raises(ConfigError, match="fraction-train"):
        LocalSGDAveraging(fraction_train=0.0)
    with pytest.raises(ConfigError, match="server-nesterov needs server-momentum > 0"):
        LocalSGDAveraging(nesterov=True)


def test_a_nesterov_round_steps_one_velocity_ahead() -> None:
    # One site moves w by +2 from 0 (b unchanged): heavy ball (β = 0.9, η = 0.5) steps by
    # 0.5·2 = 1, Nesterov by 0.5·(2 + 0.9·2) = 1.9; both keep the velocity 2.
    finals = {}
    for nesterov in (False, True):
        strategy = LocalSGDAveraging(eta=0.5, beta=0.9, nesterov=nesterov)
        base = record(w=np.zeros((2, 2), np.float32), b=np.zeros(2, np.float32))
        strategy.begin_aggregation(1, base)
        strategy.accumulate(
            reply(record(w=np.full((2, 2), 2, np.float32), b=np.zeros(2, np.float32)), 10),
            base=base,
        )
        arrays, _ = strategy.finish_aggregation()
        assert arrays is not None
        finals[nesterov] = record_to_arrays(arrays)["w"]
        np.testing.assert_allclose(strategy.state_dict()["velocity"]["w"], 2.0)
    np.testing.assert_allclose(finals[False], 1.0)
    np.testing.assert_allclose(finals[True], 1.9, rtol=1e-6)


def test_staleness_discount_shrinks_the_step_even_for_one_update() -> None:
    # One update, discounted by 1/2: Σ w·s·Δ / Σ w = Δ/2, not Δ (the discount must not
    # cancel against its own normalisation).
    strategy = LocalSGDAveraging()
    strategy.begin_aggregation(1, BASE)
    strategy.accumulate(
        reply(record(w=np.full((2, 2), 2, np.float32), b=np.zeros(2, np.float32)), 10),
        base=BASE,
        weight_scale=0.5,
    )
    arrays, _ = strategy.finish_aggregation()
    assert arrays is not None
    np.testing.assert_allclose(record_to_arrays(arrays)["w"], np.full((2, 2), 1.0))


def test_stale_update_is_measured_against_the_version_it_was_trained_on() -> None:
    # The site trained from an old model (all 1s) to all 3s: its delta is +2, applied to
    # the current model (all 10s) → 12, not 3.
    old = record(w=np.ones((2, 2), np.float32), b=np.ones(2, np.float32))
    current = record(w=np.full((2, 2), 10, np.float32), b=np.full(2, 10, np.float32))
    strategy = LocalSGDAveraging()
    strategy.begin_aggregation(5, current)
    strategy.accumulate(
        reply(record(w=np.full((2, 2), 3, np.float32), b=np.full(2, 3, np.float32)), 4), base=old
    )
    arrays, _ = strategy.finish_aggregation()
    assert arrays is not None
    np.testing.assert_allclose(record_to_arrays(arrays)["w"], np.full((2, 2), 12.0))


class _NodesGrid:
    """Only ``get_node_ids`` is used by the strategy's configure hooks."""

    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)


def _OneNodeGrid() -> _NodesGrid:  # noqa: N802 - reads as the grid it builds
    return _NodesGrid([4])


def test_site_config_reads_defaults_and_refuses_wrong_types() -> None:
    from clients.client_app import SiteTrainConfig

    parsed = SiteTrainConfig.from_record(ConfigRecord({"lr": 0.05, "local-steps": 7, "seed": 3}))
    assert (parsed.lr, parsed.local_steps, parsed.seed, parsed.batch_size) == (0.05, 7, 3, 32)
    assert isinstance(parsed.local_steps, int) and isinstance(parsed.lr, float)
    with pytest.raises(ConfigError, match="'lr' must be a finite number"):
        SiteTrainConfig.from_record(ConfigRecord({"lr": "fast"}))


@pytest.mark.parametrize(
    "config,message",
    [
        ({"batch-size": 0}, "'batch-size' must be an integer >= 1, got 0"),  # divided by it
        ({"batch-size": -4}, "'batch-size' must be an integer >= 1"),  # trained on n - 4
        ({"local-steps": 2.7}, "'local-steps' must be an integer >= 0, got 2.7"),  # took 2
        ({"lr": -1.0, "momentum": -0.5}, "2 problems: .*'lr'.*'momentum' must be a number in"),
        ({"lr": float("nan")}, "'lr' must be a finite number > 0"),
        ({"seed": True}, "'seed' must be an integer"),
    ],
)
def test_site_config_out_of_range_is_refused_before_training(config: dict, message: str) -> None:
    """The built-in client's round config, from a server that is not ours or not well: a
    batch size of 0 raised ZeroDivisionError, a negative lr torch's ValueError."""
    from clients.client_app import SiteTrainConfig

    with pytest.raises(ConfigError, match=message):
        SiteTrainConfig.from_record(ConfigRecord(config))
    whole = SiteTrainConfig.from_record(ConfigRecord({"local-steps": 3.0}))
    assert whole.local_steps == 3 and isinstance(whole.local_steps, int)


# ------------------------------------------------------------- robust aggregators
@pytest.mark.parametrize("aggregator", ["median", "trimmed-mean"])
def test_robust_aggregators_match_numpy_and_ignore_one_outlier(aggregator: str) -> None:
    values = [1.0, 2.0, 3.0, 4.0, 1e6]  # one site far out
    strategy = LocalSGDAveraging(aggregator=aggregator, trim_fraction=0.2)
    strategy.begin_aggregation(1, BASE)
    for v, examples in zip(values, (1, 1, 1, 1, 10**6), strict=True):
        strategy.accumulate(
            reply(record(w=np.full((2, 2), v, np.float32), b=np.full(2, v, np.float32)), examples),
            base=BASE,
        )
    arrays, metrics = strategy.finish_aggregation()
    assert arrays is not None and metrics is not None and metrics["num-updates"] == 5
    # Unweighted, as Flower's FedMedian / FedTrimmedAvg: median 3; trimmed (20% of 5 = 1
    # cut at each end) mean of 2, 3, 4 = 3. The weighted mean would be ≈ 1e6.
    expected = np.median(values) if aggregator == "median" else np.mean(sorted(values)[1:-1])
    np.testing.assert_allclose(record_to_arrays(arrays)["w"], np.full((2, 2), expected))


@pytest.mark.parametrize(
    "aggregator,trim_fraction,updates",
    [("median", 0.2, 2), ("median", 0.2, 1), ("trimmed-mean", 0.2, 4), ("trimmed-mean", 0.3, 3)],
)
def test_a_robust_aggregator_over_too_few_updates_to_cut_any_says_so(
    aggregator: str, trim_fraction: float, updates: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Flower's maths over such a round is the plain (unweighted) mean: one site's outlier
    moves it as far as with the mean, so an own ServerApp's user is told, once."""
    strategy = LocalSGDAveraging(aggregator=aggregator, trim_fraction=trim_fraction)
    values = [1.0, 2.0, 1e6, 4.0][:updates]
    with caplog.at_level(logging.WARNING, logger="flplatform.strategies.local_sgd"):
        for server_round in (1, 2):
            strategy.begin_aggregation(server_round, BASE)
            for v in values:
                w = np.full((2, 2), v, np.float32)
                strategy.accumulate(reply(record(w=w, b=np.zeros(2, np.float32)), 1), base=BASE)
            arrays, _ = strategy.finish_aggregation()
            assert arrays is not None
            np.testing.assert_allclose(
                record_to_arrays(arrays)["w"], np.full((2, 2), np.mean(values)), rtol=1e-6
            )
            # ... and for the run's record (the engine's), once too
            warning = strategy.take_warning()
            assert (warning is not None) == (server_round == 1), (server_round, warning)
    said = [r.getMessage() for r in caplog.records if aggregator in r.getMessage()]
    assert len(said) == 1 and ("outvoted" in said[0] or "= 0 of them" in said[0]), said


def test_a_robust_aggregator_that_cuts_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    strategy = LocalSGDAveraging(aggregator="trimmed-mean", trim_fraction=0.25)
    with caplog.at_level(logging.WARNING, logger="flplatform.strategies.local_sgd"):
        strategy.begin_aggregation(1, BASE)
        for v in (1.0, 2.0, 3.0, 1e6):
            w = np.full((2, 2), v, np.float32)
            strategy.accumulate(reply(record(w=w, b=np.zeros(2, np.float32)), 1), base=BASE)
        strategy.finish_aggregation()
    assert not caplog.records


def test_a_step_that_overflows_is_refused_and_the_velocity_kept() -> None:
    from flplatform.core.errors import StepRefused

    strategy = LocalSGDAveraging(beta=0.9)
    top = np.finfo(np.float32).max
    strategy.begin_aggregation(1, BASE)
    strategy.accumulate(
        reply(record(w=np.full((2, 2), top, np.float32), b=np.zeros(2, np.float32)), 1),
        base=BASE,
    )
    arrays, _ = strategy.finish_aggregation()  # x = max: still finite
    assert arrays is not None
    velocity = {k: v.copy() for k, v in strategy.state.optimizer.velocity.items()}
    strategy.begin_aggregation(2, arrays)
    strategy.accumulate(reply(arrays, 1), base=arrays)  # Δ = 0, but x + 0.9·v overflows
    with pytest.raises(StepRefused, match="'w' would become non-finite in float32"):
        strategy.finish_aggregation()
    for key, kept in velocity.items():
        np.testing.assert_array_equal(strategy.state.optimizer.velocity[key], kept)


def test_aggregator_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="aggregator"):
        LocalSGDAveraging(aggregator="mode")
    with pytest.raises(ConfigError, match="trim-fraction"):
        LocalSGDAveraging(aggregator="trimmed-mean", trim_fraction=0.5)


def test_a_spent_update_s_memory_holds_the_next_and_the_sum_is_the_oracle_s() -> None:
    """The server writes each Δ_n into the memory of the one it added before (fresh pages
    cost more than the subtraction); the weighted sum is still Σ n_n Δ_n / Σ n_n exactly,
    and an update not yet added is never overwritten."""
    rng = np.random.default_rng(0)
    base = {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": np.zeros(4, np.float32)}
    models = [
        {k: rng.normal(size=v.shape).astype(np.float32) for k, v in base.items()} for _ in range(4)
    ]
    weights = [3, 1, 4, 1]
    strategy = LocalSGDAveraging()
    base_record = record(**base)
    strategy.begin_aggregation(1, base_record)
    first = strategy.read_update(reply(record(**models[0]), weights[0]), base=base_record)
    second = strategy.read_update(reply(record(**models[1]), weights[1]), base=base_record)
    assert not np.shares_memory(first.payload["w"], second.payload["w"])
    strategy.add_update(first, weight=weights[0])
    strategy.add_update(second, weight=weights[1])
    third = strategy.read_update(reply(record(**models[2]), weights[2]), base=base_record)
    assert np.shares_memory(third.payload["w"], second.payload["w"])  # reused
    strategy.add_update(third, weight=weights[2])
    strategy.add_update(
        strategy.read_update(reply(record(**models[3]), weights[3]), base=base_record),
        weight=weights[3],
    )
    arrays, _ = strategy.finish_aggregation()
    assert arrays is not None
    expected = {
        k: sum(
            w * (m[k].astype(np.float64) - base[k]) for m, w in zip(models, weights, strict=True)
        )
        / 9
        + base[k]
        for k in base
    }
    for key, value in record_to_arrays(arrays).items():
        np.testing.assert_allclose(value, expected[key].astype(np.float32), rtol=0, atol=1e-6)


def test_rounds_on_reused_memory_give_the_plain_numpy_models_bit_for_bit() -> None:
    """Three rounds through one strategy (each Δ, sum and float64 model written into the
    memory of the last) give exactly what the plain expressions give, round after round."""
    rng = np.random.default_rng(7)
    shapes = {"w": (30, 20), "b": (20,), "n": ()}
    model = {k: np.asarray(rng.normal(size=s)).astype(np.float32) for k, s in shapes.items()}
    strategy = LocalSGDAveraging()
    for server_round in (1, 2, 3):
        sites = [
            ({k: np.asarray(v + rng.normal(size=v.shape), np.float32) for k, v in model.items()}, n)
            for n in (3, 1, 4, 1, 5)
        ]
        current = record(**model)
        strategy.begin_aggregation(server_round, current)
        for site_model, examples in sites:
            update = strategy.read_update(reply(record(**site_model), examples), base=current)
            strategy.add_update(update, weight=examples)
        arrays, _ = strategy.finish_aggregation()
        assert arrays is not None
        # the expressions of the plain implementation, in its order
        sums: dict[str, np.ndarray] = {}
        for site_model, examples in sites:
            for k in model:
                delta = site_model[k].astype(np.float64) - model[k]
                if k in sums:
                    sums[k] += np.multiply(delta, examples, dtype=np.float64)
                else:
                    sums[k] = np.asarray(delta, dtype=np.float64) * examples
        total = float(sum(n for _, n in sites))
        model = {
            k: np.asarray(np.asarray(model[k], dtype=np.float64) + 1.0 * (sums[k] / total)).astype(
                np.float32
            )
            for k in model
        }
        got = record_to_arrays(arrays)
        for k in model:
            assert got[k].tobytes() == model[k].tobytes(), (server_round, k)


def test_the_guard_judges_the_weights_apart_from_the_running_statistics() -> None:
    """What a site's training did to BatchNorm's running statistics is not in the vector
    whose norm and direction the guard judges (it swamped the weights': the update guard's
    tests), but beside it; its counter's change (the steps it took) in neither."""
    base = {
        "conv.weight": np.zeros((2, 2), np.float32),
        "bn.running_mean": np.zeros(2, np.float32),
        "bn.num_batches_tracked": np.array(0, np.int64),
    }
    trained = {
        "conv.weight": np.full((2, 2), 0.5, np.float32),
        "bn.running_mean": np.array([3.0, 4.0], np.float32),
        "bn.num_batches_tracked": np.array(20, np.int64),
    }
    for strategy in (LocalSGDAveraging(), LocalSGDAveraging(aggregator="mean")):
        strategy.begin_aggregation(1, record(**base))
        update = strategy.read_update(reply(record(**trained), 10), base=record(**base))
        assert [v.tolist() for v in update.vector] == [[[0.5, 0.5], [0.5, 0.5]]]
        assert [v.tolist() for v in update.averaged] == [[3.0, 4.0]]
