"""Sketched-SGD: the two-round maths against a naive reference, and the protocol end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp.strategy import Strategy
from hypothesis import given, settings
from hypothesis import strategies as st

from flplatform.app.config import RunConfig
from flplatform.core import keys
from flplatform.core.arrays import arrays_to_record, record_to_arrays
from flplatform.core.errors import ConfigError, StepRefused, UpdateRejected
from flplatform.engine import APPLIED, RoundSummary
from flplatform.engine.engine import RoundEngine
from strategies.layout import Layout
from strategies.local_sgd import LocalSGDAveraging
from strategies.mods.contract import ModState
from strategies.mods.fetchsgd import MODEL
from strategies.mods.sketched_sgd import ACCUMULATORS, CANDIDATES, VALUES, ZERO, StepPhase
from strategies.sketch_feedback import SiteAccumulators, candidate_coordinates, exact_top_k
from strategies.sketched_sgd import SketchedSGD
from tests.helpers import norm_model
from tests.helpers.algorithms import collision_free_sketch
from tests.helpers.delayed_sites import builtin_train, context, digits_site
from tests.helpers.scripted_grid import Behaviour, FlowerGrid, ScriptedGrid
from tests.helpers.sites import digits_model

pytestmark = pytest.mark.usefixtures("task_identity")


# ================================================================ the maths
def test_exact_top_k_golden_case() -> None:
    indices = torch.tensor([2, 5, 7, 9])
    values = torch.tensor([1.0, -3.0, 3.0, 0.5])
    chosen, kept = exact_top_k(indices, values, 2)
    assert chosen.tolist() == [5, 7] and kept.tolist() == [-3.0, 3.0]
    chosen, kept = exact_top_k(indices, values, 1)  # a tie goes to the lower coordinate
    assert chosen.tolist() == [5] and kept.tolist() == [-3.0]
    chosen, kept = exact_top_k(indices, values, 9)  # k beyond the candidates: all of them
    assert chosen.tolist() == [2, 5, 7, 9]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=1, max_size=40),
    st.integers(1, 45),
)
def test_exact_top_k_keeps_the_largest_magnitudes(values: list[float], k: int) -> None:
    indices = torch.arange(0, 3 * len(values), 3)  # ascending candidates
    vals = torch.tensor(values, dtype=torch.float32)
    chosen, kept = exact_top_k(indices, vals, k)
    assert len(chosen) == min(k, len(values))
    assert torch.all(chosen[1:] > chosen[:-1])  # ascending, distinct
    np.testing.assert_array_equal(kept.numpy(), vals[chosen // 3].numpy())
    left_out = np.setdiff1d(indices.numpy(), chosen.numpy()) // 3
    if len(left_out):
        assert kept.abs().min() >= vals[left_out].abs().max()


def test_two_rounds_match_a_naive_reference_also_when_a_site_is_left_out() -> None:
    """Collision-free sketch: the candidates are the true top P·k of the weighted mean of v."""
    d, k, factor, m, eta = 40, 3, 2, 0.9, 0.5
    weights = [3.0, 1.0, 2.0]
    sketch = collision_free_sketch(d)
    sites = [SiteAccumulators.zeros(d, m) for _ in weights]
    u = np.zeros((3, d))
    v = np.zeros((3, d))
    x, x_ref = torch.zeros(d), np.zeros(d)
    rng = np.random.default_rng(0)
    for step in range(8):
        g = rng.normal(size=(3, d)).astype(np.float32)
        for n, site in enumerate(sites):
            site.add(torch.from_numpy(g[n]))
        table = sum(w * sketch.sketch(s.v) for w, s in zip(weights, sites, strict=True))
        candidates = candidate_coordinates(sketch, table / sum(weights), factor * k)
        # Site 1's values are lost in odd steps: the exact mean is over the others.
        answered = [0, 2] if step % 2 else [0, 1, 2]
        total = sum(weights[n] for n in answered)
        exact = sum(weights[n] * sites[n].v[candidates] for n in answered) / total
        applied, values = exact_top_k(candidates, exact, k)
        x[applied] += eta * values
        for n in answered:
            sites[n].zero(applied)
        # ---- the reference, coordinate by coordinate
        u = m * u + g
        v = v + u
        mean_v = np.average(v, axis=0, weights=weights)
        top = np.sort(np.argsort(-np.abs(mean_v), kind="stable")[: factor * k])
        np.testing.assert_array_equal(candidates.numpy(), top)
        exact_ref = np.average(v[answered][:, top], axis=0, weights=[weights[n] for n in answered])
        chosen = top[np.sort(np.argsort(-np.abs(exact_ref), kind="stable")[:k])]
        np.testing.assert_array_equal(applied.numpy(), chosen)
        x_ref[chosen] += eta * exact_ref[np.searchsorted(top, chosen)]
        u[np.ix_(answered, chosen)] = 0.0
        v[np.ix_(answered, chosen)] = 0.0
        np.testing.assert_allclose(x.numpy(), x_ref, rtol=1e-5, atol=1e-5)
        for n in range(3):
            np.testing.assert_allclose(sites[n].v.numpy(), v[n], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(sites[n].u.numpy(), u[n], rtol=1e-5, atol=1e-5)


# ================================================================ the protocol
def run_engine(
    strategy: SketchedSGD | LocalSGDAveraging,
    rounds: int,
    *,
    local_steps: int = 5,
    contexts: dict[int, Context] | None = None,
    behaviours: dict[int, Behaviour] | None = None,
    on_round: object = None,
    model: str = "mlp",
) -> tuple[ScriptedGrid, list[RoundSummary], ArrayRecord]:
    contexts = contexts if contexts is not None else {}
    for n in range(1, 5):
        contexts.setdefault(n, context(n))
    sites = {n: digits_site(n - 1, 4, contexts[n], model=model) for n in range(1, 5)}
    sites.update(behaviours or {})
    grid = ScriptedGrid(sites)
    summaries: list[RoundSummary] = []

    def record(summary: RoundSummary) -> None:
        summaries.append(summary)
        if callable(on_round):
            on_round(summary)

    engine = RoundEngine(grid, strategy, poll_interval=0.0, required_sites=4, on_round=record)
    result = engine.run(
        digits_model(model=model),
        num_rounds=rounds,
        train_config=ConfigRecord({keys.LOCAL_STEPS: local_steps, keys.LR: 0.1}),
    )
    return grid, summaries, result.arrays


@pytest.mark.parametrize("local_steps", [1, 5])
def test_k_equal_to_d_is_uncompressed_local_sgd(local_steps: int) -> None:
    """k = d: every coordinate a candidate and applied, u and v zeroed whole each step."""
    d = sum(a.numel() for a in digits_model().to_torch_state_dict().values())
    sketched = SketchedSGD(k=d, sketch_cols=7, momentum=0.9, seed=1)
    _, summaries, arrays = run_engine(sketched, 6, local_steps=local_steps)
    _, _, reference = run_engine(LocalSGDAveraging(seed=1), 3, local_steps=local_steps)
    assert sketched.model.version == 3 and [s.model_version for s in summaries] == [
        0,
        1,
        1,
        2,
        2,
        3,
    ]
    got, want = record_to_arrays(arrays), record_to_arrays(reference)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_running_statistics_travel_whole_with_the_values_and_are_averaged_in_the_step() -> None:
    """A BatchNorm's running statistics and counter stay out of u, v and the sketch; each
    site sends their trained values with its values, and the step sets them to the mean
    weighted as the sites' sketches were."""
    contexts: dict[int, Context] = {}
    strategy = SketchedSGD(k=20, sketch_cols=60, momentum=0.9, seed=1)
    models = [record_to_arrays(digits_model(model=norm_model.SPEC))]
    grid, summaries, _ = run_engine(
        strategy,
        6,
        contexts=contexts,
        model=norm_model.SPEC,
        on_round=lambda _: models.append(record_to_arrays(strategy.model.record)),
    )
    averaged = norm_model.AVERAGED
    assert list(strategy.model.averaged) == averaged
    assert all(u.status == APPLIED for s in summaries for u in s.updates)
    layout = Layout.of(models[0])
    values_replies = [
        r
        for r in grid.replies
        if keys.ARRAYS in r.content.array_records and VALUES in r.content[keys.ARRAYS]
    ]
    assert len(values_replies) == 3 * 4
    for step in range(3):
        replies = values_replies[4 * step : 4 * step + 4]
        before, after = models[2 * step + 1], models[2 * step + 2]  # the sketch round's, the step's
        assert all(np.array_equal(before[n], models[2 * step][n]) for n in before)
        for name, mean in norm_model.mean_of_sent(replies, models[0]).items():
            np.testing.assert_allclose(after[name].reshape(-1), mean, rtol=1e-5, atol=1e-6)
        assert (after["1.running_var"] > 0).all()
        assert after["1.num_batches_tracked"] == 5 * (step + 1)
    for ctx in contexts.values():  # u and v never hold the averaged arrays' coordinates
        uv = ModState.load(ctx, keys.SKETCHED_STATE).groups[ACCUMULATORS]
        for name in averaged:
            begin, end = layout.span(name)
            assert not uv["u"][begin:end].any() and not uv["v"][begin:end].any()


def test_two_rounds_per_step_with_sparse_bytes_and_zeroing() -> None:
    contexts: dict[int, Context] = {}
    strategy = SketchedSGD(k=50, candidate_factor=2, momentum=0.9, seed=1)
    models: dict[int, np.ndarray] = {}  # version → the server's flat model

    def keep(summary: RoundSummary) -> None:
        models[strategy.model.version] = strategy.model.flat.clone().numpy()

    grid, summaries, _ = run_engine(strategy, 6, contexts=contexts, on_round=keep)
    assert all(u.status == APPLIED for s in summaries for u in s.updates)
    table_bytes = strategy.rows * strategy.cols * 4
    for number, summary in enumerate(summaries, start=1):
        up = [u.bytes_up for u in summary.updates]
        down = [u.bytes_down for u in summary.updates]
        assert len(up) == 4
        if number % 2:  # sketch rounds: a table up; round 1 the model down, then k pairs
            assert all(table_bytes < b < table_bytes + 4096 for b in up)
            if number > 1:
                assert all(8 * strategy.k < b < 8 * strategy.k + 4096 for b in down)
        else:  # values rounds: P·k indices down, P·k values up, no compute
            assert all(4 * 100 < b < 4 * 100 + 4096 for b in up + down)
    train = [m for m in grid.pushed if m.metadata.message_type == MessageType.TRAIN]
    round3 = [m for m in train if m.content[keys.CONFIG][keys.SERVER_ROUND] == 3]
    # Every site's values went into step 1; its coordinates travel once, as the sync's.
    assert all(m.content[keys.CONFIG][keys.ZERO_STEP] == 1 for m in round3)
    assert all(ZERO not in m.content.array_records for m in round3)
    step2 = strategy.model.changes.changes[2].numpy()
    for node, ctx in contexts.items():
        kept = ModState.load(ctx, keys.SKETCHED_STATE)
        assert kept is not None
        stored = kept.groups[MODEL]
        flat = np.concatenate([stored[name].ravel() for name in strategy.model.layout.names])
        np.testing.assert_array_equal(flat, models[2], err_msg=f"site {node}")
        uv = kept.groups[ACCUMULATORS]
        # Zeroed at step 2's coordinates in round 5, then one update added: v = u = g.
        np.testing.assert_array_equal(uv["u"][step2], uv["v"][step2])
        assert np.any(uv["u"][step2] != 0)


def test_a_site_whose_values_are_lost_keeps_them_for_a_later_step() -> None:
    contexts = {n: context(n) for n in range(1, 5)}
    real = digits_site(3, 4, contexts[4])

    def loses_values_in_round_2(msg: Message) -> Message:
        config = msg.content.config_records.get(keys.CONFIG, ConfigRecord())
        if config.get(keys.STEP_PHASE) == StepPhase.VALUES and config[keys.SERVER_ROUND] == 2:
            return Message(Error(code=2, reason="connection reset"), reply_to=msg)
        return real(msg)

    strategy = SketchedSGD(k=50, seed=1)
    seen: dict[int, dict[str, np.ndarray]] = {}

    def keep(summary: RoundSummary) -> None:
        kept = ModState.load(contexts[4], keys.SKETCHED_STATE)
        assert kept is not None
        seen[summary.server_round] = kept.groups[ACCUMULATORS]

    grid, summaries, _ = run_engine(
        strategy, 5, contexts=contexts, behaviours={4: loses_values_in_round_2}, on_round=keep
    )
    assert [u.status for u in summaries[1].updates].count(APPLIED) == 3
    # Its failed reply benched it for round 3 (flplatform/engine/bench.py); the next
    # sketch round it takes part in tells it to keep its values (zero step 0).
    back = {
        config[keys.SERVER_ROUND]: config.get(keys.ZERO_STEP)
        for m in grid.pushed
        if m.metadata.dst_node_id == 4
        and (config := m.content[keys.CONFIG]).get(keys.SERVER_ROUND, 0) > 2
    }
    first = min(back)
    assert first > 3 and back[first] == 0
    step1 = strategy.model.changes.changes[1].numpy()
    before, after = seen[2], seen[first]
    # Not zeroed: v gained this round's u on top of what it had.
    np.testing.assert_allclose(after["v"][step1], before["v"][step1] + after["u"][step1], atol=1e-6)
    assert np.any(before["v"][step1] != 0)


# ================================================================ bad input
def _values_reply(node: int, arrays: dict, examples: object = 10) -> Message:
    reply = Message(
        RecordDict(
            {
                keys.ARRAYS: arrays_to_record(arrays),
                keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: examples}),
            }
        ),
        dst_node_id=node,
        message_type=MessageType.TRAIN,
    )
    reply.metadata.__dict__["_src_node_id"] = node
    return reply


@pytest.mark.parametrize(
    ("node", "arrays", "reason"),
    [
        (1, {VALUES: np.zeros(5, np.float32)}, "float32 of shape"),
        (1, {VALUES: np.zeros(6, np.float64)}, "float32 of shape"),
        (1, {VALUES: np.full(6, np.nan, np.float32)}, "NaN"),
        (1, {"w": np.zeros(6, np.float32)}, "one 'values' array"),
        (9, {VALUES: np.zeros(6, np.float32)}, "not asked"),
    ],
)
def test_malformed_values_are_rejected(node: int, arrays: dict, reason: str) -> None:
    strategy = SketchedSGD(k=3, sketch_cols=50)
    base = arrays_to_record({"w": np.zeros(10, np.float32)})
    strategy._use(base)
    strategy.state.phase, strategy.state.candidates = StepPhase.VALUES, torch.arange(6)
    strategy.state.contributors = {1: 10}
    strategy.begin_aggregation(2, base)
    strategy._asked = {1}
    with pytest.raises(UpdateRejected, match=reason):
        strategy.accumulate(_values_reply(node, arrays), base=base)


def test_a_site_refuses_values_for_a_sketch_it_did_not_send() -> None:
    site = context(1, {keys.PARTITION_ID: 0, keys.NUM_PARTITIONS: 4}, {"dataset": "digits"})
    config = ConfigRecord(
        {
            keys.SITE_ALGORITHM: "sketched-sgd",
            keys.STEP_PHASE: StepPhase.VALUES,
            keys.SKETCHED_ROUND: 3,
            keys.SERVER_ROUND: 4,
        }
    )
    msg = Message(
        RecordDict(
            {
                keys.ARRAYS: arrays_to_record({CANDIDATES: np.arange(4, dtype=np.int32)}),
                keys.CONFIG: config,
            }
        ),
        dst_node_id=1,
        message_type=MessageType.TRAIN,
    )
    # A site with no accumulators at all lost them (a restart): it says so, with no values.
    reply = builtin_train(msg, site)
    assert keys.ARRAYS not in reply.content
    assert reply.content[keys.METRICS][keys.STATE_LOST] == 1
    # One whose last sketch is another round's refuses.
    zeros = np.zeros(4, dtype=np.float32)
    ModState({"sketched-round": 1}, {ACCUMULATORS: {"u": zeros, "v": zeros}}).save(
        site, keys.SKETCHED_STATE
    )
    with pytest.raises(ConfigError, match="sketch of round 3; this site's last sketch is of"):
        builtin_train(msg, site)
    config[keys.STEP_PHASE] = "guess"
    with pytest.raises(ConfigError, match="'sketch-phase' must be 'sketch' or 'values'"):
        builtin_train(msg, site)


def test_sketched_sgd_settings_are_checked() -> None:
    config = RunConfig.from_mapping(
        {"strategy": "sketched-sgd", "k": 500, "candidate-factor": 3, "step-momentum": 0.9}
    )
    assert (config.k, config.candidate_factor, config.step_momentum) == (500, 3, 0.9)
    with pytest.raises(ConfigError, match="candidate-factor P must be >= 1"):
        RunConfig.from_mapping({"strategy": "sketched-sgd", "candidate-factor": 0})
    with pytest.raises(ConfigError, match="'sketched-sgd' runs with sync mode 'sync' only"):
        RunConfig.from_mapping({"strategy": "sketched-sgd", "sync": "async"})
    with pytest.raises(ConfigError, match="momentum must be in"):
        SketchedSGD(k=3, momentum=1.0)
    strategy = SketchedSGD(k=11)
    with pytest.raises(ConfigError, match="k must be at most the model's 10 parameters"):
        strategy._use(arrays_to_record({"w": np.zeros(10, np.float32)}))


# ================================================================ failures, from review
def test_a_values_round_asks_again_when_its_sites_were_away() -> None:
    """Availability draws sites as away: an unanswered contributor is asked again later."""
    from flplatform.engine.clock import VirtualClock
    from flplatform.network import ComputeModel
    from tests.helpers.idle_sites import network

    compute = ComputeModel("fixed", mean_seconds=1.0)
    clock = VirtualClock(network(4, compute, availability=0.6), seed=2)
    strategy = SketchedSGD(k=50, seed=1)
    grid = ScriptedGrid({n: digits_site(n - 1, 4, context(n)) for n in range(1, 5)})
    engine = RoundEngine(grid, strategy, clock=clock, poll_interval=0.0, required_sites=4)
    engine.round_timeout = 3.0  # a stuck round fails fast instead of after 600 s
    engine.run(
        digits_model(),
        num_rounds=16,
        train_config=ConfigRecord({keys.LOCAL_STEPS: 1, keys.LR: 0.1}),
    )
    assert strategy.model.version >= 4


def test_huge_finite_values_do_not_overflow_the_model() -> None:
    strategy = SketchedSGD(k=3, sketch_cols=50)
    base = arrays_to_record({"w": np.zeros(10, np.float32)})
    strategy._use(base)
    strategy.state.phase, strategy.state.candidates = StepPhase.VALUES, torch.arange(6)
    strategy.state.contributors = {1: 1000, 2: 1000}
    for step in (1, 2):
        strategy.state.phase = StepPhase.VALUES
        strategy.begin_aggregation(2 * step, base)
        strategy._asked = {1, 2}
        for node in (1, 2):  # w·v overflows float32: the sums are float64
            huge = np.full(6, 3e38, np.float32)
            strategy.accumulate(_values_reply(node, {VALUES: huge}), base=base)
        if step == 1:  # a finite mean and a finite x + Δ: applied
            applied, _ = strategy.finish_aggregation()
            assert applied is not None and strategy.model.version == 1
            assert torch.isfinite(strategy.model.flat).all()
            strategy.state.pending_zero.clear()
        else:  # x + Δ = 6e38 overflows: refused, and no site is told to zero
            with pytest.raises(StepRefused, match="non-finite"):
                strategy.finish_aggregation()
            assert strategy.model.version == 1
            assert torch.isfinite(strategy.model.flat).all()
            assert strategy.state.pending_zero == {}


def test_a_diverging_local_training_leaves_the_sites_accumulators_as_they_were() -> None:
    contexts = {n: context(n) for n in range(1, 5)}
    strategy = SketchedSGD(k=50, seed=1)
    run_engine(strategy, 2, contexts=contexts)
    before = ModState.load(contexts[1], keys.SKETCHED_STATE).groups[ACCUMULATORS]
    strategy.begin_aggregation(3, strategy.model.record)
    (msg,) = [m for m in strategy.configure_train(3, strategy.model.record, _lr(1e30), _Nodes())]
    reply = builtin_train(msg, contexts[1])  # the site's mod refuses its NaN model
    assert reply.has_error() and reply.error.code == keys.SITE_REFUSED_CODE
    assert "diverge" in reply.error.reason
    after = ModState.load(contexts[1], keys.SKETCHED_STATE).groups[ACCUMULATORS]
    for name in ("u", "v"):
        np.testing.assert_array_equal(after[name], before[name])


def _lr(lr: float) -> ConfigRecord:
    return ConfigRecord({keys.LOCAL_STEPS: 5, keys.LR: lr})


class _Nodes:
    def get_node_ids(self) -> list[int]:
        return [1]


def test_flowers_own_loop_takes_a_step_every_two_rounds() -> None:
    """Found by a review: under Flower's own loop (``Strategy.start``: configure_train,
    then the batch aggregate_train, which begins the round's aggregation only then), the
    round's phase was set after its messages were drafted: every round asked for sketches,
    every values reply was refused, and the model never moved."""
    sites = {n: digits_site(n - 1, 2, context(n)) for n in (1, 2)}
    strategy = SketchedSGD(k=50, seed=1)
    grid = FlowerGrid(sites)
    first = digits_model()
    result = Strategy.start(
        strategy,
        grid,  # type: ignore[arg-type]
        first,
        num_rounds=4,
        train_config=ConfigRecord({keys.LOCAL_STEPS: 2, keys.LR: 0.1}),
    )
    phases = [
        m.content[keys.CONFIG][keys.STEP_PHASE]
        for m in grid.pushed
        if m.metadata.message_type == MessageType.TRAIN
    ]
    assert phases == ["sketch"] * 2 + ["values"] * 2 + ["sketch"] * 2 + ["values"] * 2
    assert strategy.model.version == 2  # a step each values round
    moved = record_to_arrays(result.arrays)
    assert any(not np.array_equal(moved[k], v) for k, v in record_to_arrays(first).items())
