"""FetchSGD: the server's sketch maths against a naive reference, and the full round trip."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from itertools import pairwise

import numpy as np
import pytest
import torch
from flwr.app import (
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from flplatform.app.config import RunConfig
from flplatform.core import keys
from flplatform.core.arrays import arrays_to_record, record_to_arrays
from flplatform.core.errors import ConfigError, UpdateRejected
from flplatform.engine import APPLIED, RoundSummary
from flplatform.engine.engine import RoundEngine
from strategies.averaged_arrays import averaged_arrays, pack, packed_keys, unpack
from strategies.fetchsgd import FetchSGD
from strategies.layout import Layout
from strategies.mods.contract import ModState
from strategies.mods.fetchsgd import sketched_upload, synced_model
from strategies.sketch_feedback import SketchFeedback
from strategies.sparse_sync import DENSE, ChangeLog, SparseModel
from tests.helpers import norm_model
from tests.helpers.algorithms import collision_free_sketch
from tests.helpers.delayed_sites import context, digits_site
from tests.helpers.scripted_grid import ScriptedGrid
from tests.helpers.sites import digits_model

pytestmark = pytest.mark.usefixtures("task_identity")


@pytest.mark.parametrize("removal", ["zero", "subtract"])
def test_an_exact_sketch_is_true_top_k_with_server_error_feedback(removal: str) -> None:
    d, k, rho, eta = 40, 5, 0.9, 0.5
    sketch = collision_free_sketch(d)
    feedback = SketchFeedback(sketch, k=k, rho=rho, eta=eta, removal=removal)
    u, e = np.zeros(d), np.zeros(d)  # the reference: momentum and error, coordinate-wise
    rng = np.random.default_rng(0)
    for _ in range(8):
        g = rng.normal(size=d).astype(np.float32)
        indices, values = feedback.step(sketch.sketch(torch.from_numpy(g)))
        u = rho * u + g
        e = e + eta * u
        top = np.sort(np.argsort(-np.abs(e), kind="stable")[:k])
        np.testing.assert_array_equal(indices.numpy(), top)
        np.testing.assert_allclose(values.numpy(), e[top], rtol=1e-5, atol=1e-6)
        if removal == "zero":  # no collisions: the touched buckets are these coordinates
            e[top] = 0.0
            u[top] = 0.0
        else:
            e[top] -= values.numpy()
        np.testing.assert_allclose(sketch.estimate(feedback.error).numpy(), e, atol=1e-5)


def test_the_change_log_knows_what_a_site_that_missed_rounds_needs() -> None:
    log = ChangeLog(keep=3)
    log.record(1, torch.tensor([5, 1]))
    log.record(2, torch.tensor([1, 7]))
    log.record(3, torch.tensor([2]))
    assert log.changed_since(1, 3).tolist() == [1, 2, 7]
    assert log.changed_since(3, 3).tolist() == []
    log.record(4, torch.tensor([0]))  # keep=3: version 1 is forgotten
    assert log.changed_since(0, 4) is None and log.changed_since(1, 4) is not None


def run_fetchsgd(
    rounds: int = 4,
    contexts: dict[int, Context] | None = None,
    model: str = "mlp",
    after_round: Callable[[FetchSGD], None] | None = None,
    **kwargs: object,
) -> tuple[FetchSGD, ScriptedGrid, list[RoundSummary]]:
    contexts = contexts if contexts is not None else {}
    for n in range(1, 5):
        contexts.setdefault(n, context(n))
    grid = ScriptedGrid({n: digits_site(n - 1, 4, contexts[n], model=model) for n in range(1, 5)})
    strategy = FetchSGD(**{"k": 200, "fraction_train": 0.5, "seed": 1, **kwargs})  # type: ignore[arg-type]
    summaries: list[RoundSummary] = []

    def record(summary: RoundSummary) -> None:
        summaries.append(summary)
        if after_round is not None:
            after_round(strategy)

    engine = RoundEngine(grid, strategy, poll_interval=0.0, required_sites=4, on_round=record)
    engine.run(
        digits_model(model=model),
        num_rounds=rounds,
        train_config=ConfigRecord({keys.LOCAL_STEPS: 5, keys.LR: 0.1}),
    )
    return strategy, grid, summaries


def test_running_statistics_and_counters_are_averaged_whole_not_sketched() -> None:
    """A BatchNorm's running mean, variance and counter travel whole beside the sketch and
    become the sites' example-weighted mean, as FedAvg would make them; the sketch, narrow
    enough here that most estimates are other coordinates' noise, never touches them."""
    models = [record_to_arrays(digits_model(model=norm_model.SPEC))]
    strategy, grid, summaries = run_fetchsgd(
        rounds=4,
        model=norm_model.SPEC,
        after_round=lambda s: models.append(record_to_arrays(s.model.record)),
        k=20,
        sketch_cols=60,
        fraction_train=1.0,
    )
    averaged = norm_model.AVERAGED
    assert list(strategy.model.averaged) == averaged
    layout = Layout.of(models[0])
    assert strategy.feedback is not None  # the sketch never picks their coordinates
    assert strategy.feedback.excluded == tuple(layout.span(n) for n in averaged)
    assert all(u.status == APPLIED for s in summaries for u in s.updates)
    replies = [r for r in grid.replies if keys.METRICS in r.content.metric_records]
    assert len(replies) == 4 * 4
    assert len(models) == 1 + 4
    for round_, (before, now) in enumerate(pairwise(models)):
        means = norm_model.mean_of_sent(replies[4 * round_ : 4 * round_ + 4], models[0])
        for name, mean in means.items():
            if now[name].dtype.kind == "f":
                np.testing.assert_allclose(now[name].reshape(-1), mean, rtol=1e-5, atol=1e-6)
            else:  # the counter: every site took the same steps
                assert now[name] == np.rint(mean) == before[name] + 5
        assert (now["1.running_var"] > 0).all()
        changed = sum(int((now[n] != before[n]).sum()) for n in now if n not in averaged)
        assert 0 < changed <= strategy.k
    # Up: the table, and the three arrays whole (8 + 8 floats and a counter, a few hundred bytes)
    table_bytes = strategy.rows * strategy.cols * 4
    assert all(table_bytes < u.bytes_up < table_bytes + 4096 for s in summaries for u in s.updates)


def test_a_frozen_parameter_is_never_moved_by_sketch_recovery() -> None:
    """No site changes a frozen weight, so its sketch estimates are only the noise of the
    coordinates sharing its buckets; a sketch this narrow picks some of them every round
    unless the sites' word that the array is unchanged keeps them out."""
    models = [record_to_arrays(digits_model(model=norm_model.FROZEN_SPEC))]
    _, grid, summaries = run_fetchsgd(
        rounds=4,
        model=norm_model.FROZEN_SPEC,
        after_round=lambda s: models.append(record_to_arrays(s.model.record)),
        k=40,
        sketch_cols=40,
        fraction_train=1.0,
    )
    assert all(u.status == APPLIED for s in summaries for u in s.updates)
    trained = [r for r in grid.replies if keys.CONFIG in r.content.config_records]
    said = [r.content[keys.CONFIG].get(keys.UNCHANGED_ARRAYS) for r in trained]
    assert said.count([norm_model.FROZEN]) == 4 * 4  # every training reply says so
    for before, now in pairwise(models):
        assert np.array_equal(now[norm_model.FROZEN], models[0][norm_model.FROZEN])
        assert not np.array_equal(now["5.weight"], before["5.weight"])  # the rest trains


def test_an_array_is_kept_out_of_recovery_only_when_no_site_changed_it() -> None:
    # One site's word cannot freeze a layer for everyone: the round keeps out what every
    # accepted site left as it was (the intersection, not the first or the union).
    strategy = FetchSGD(k=3, sketch_cols=50)
    base = arrays_to_record({"a": np.zeros(5, np.float32), "b": np.zeros(5, np.float32)})
    strategy.begin_aggregation(1, base)
    for unchanged in (["a", "b"], ["b"], ["a", "b"]):
        reply = sketch_reply({"sketch": TABLE})
        reply.content[keys.CONFIG] = ConfigRecord({keys.UNCHANGED_ARRAYS: unchanged})
        strategy.accumulate(reply, base=base)
    assert strategy._unchanged == {"b"}


def test_the_site_leaves_averaged_arrays_out_of_its_sketch() -> None:
    start = {"w": np.zeros(3, np.float32), "bn.running_var": np.ones(2, np.float32)}
    trained = {"w": np.array([1, 2, 3], np.float32), "bn.running_var": np.full(2, 4, np.float32)}
    upload, unchanged = sketched_upload(
        Layout.of(start), trained, start, ["bn.running_var"], lambda delta: delta.copy()
    )
    # Layout order: bn.running_var (coordinates 0, 1) before w (2, 3, 4)
    np.testing.assert_array_equal(upload["sketch"], [0, 0, 1, 2, 3])
    np.testing.assert_array_equal(upload["averaged/float32"], [4, 4])
    assert list(upload) == ["sketch", "averaged/float32"]
    assert unchanged == []


def test_the_site_names_the_arrays_its_training_left_as_they_were() -> None:
    start = {"w": np.zeros(3, np.float32), "frozen": np.full(2, 0.5, np.float32)}
    trained = {"w": np.array([0, 2, 0], np.float32), "frozen": np.full(2, 0.5, np.float32)}
    _, unchanged = sketched_upload(Layout.of(start), trained, start, [], lambda d: d.copy())
    assert unchanged == ["frozen"]


def test_averaged_arrays_travel_in_one_vector_per_carrier_and_come_back_hand_computed() -> None:
    arrays = {
        "a.running_mean": np.array([1.5, -2], np.float32),
        "a.num_batches_tracked": np.array(2**40 + 3, np.int64),  # exact in float64
        "b.running_var": np.array([[0.25]], np.float16),
        "mask": np.array([True, False]),
    }
    names = list(arrays)
    packed = pack(arrays, names)
    assert {k: (v.dtype.name, v.tolist()) for k, v in packed.items()} == {
        "averaged/float32": ("float32", [1.5, -2.0, 0.25]),
        "averaged/float64": ("float64", [2.0**40 + 3, 1.0, 0.0]),
    }
    dtypes = {n: v.dtype for n, v in arrays.items()}
    sizes = {n: v.size for n, v in arrays.items()}
    assert packed_keys(dtypes, sizes, names) == {"averaged/float32": 3, "averaged/float64": 3}
    pieces = unpack(packed, dtypes, sizes, names)
    for name, value in arrays.items():
        np.testing.assert_array_equal(pieces[name], value.reshape(-1).astype(np.float64))


def test_averaged_arrays_are_the_integer_ones_and_running_statistics() -> None:
    dtypes = {
        "conv.weight": np.dtype(np.float32),
        "bn.weight": np.dtype(np.float32),
        "bn.running_mean": np.dtype(np.float32),
        "bn.running_var": np.dtype(np.float16),
        "bn.num_batches_tracked": np.dtype(np.int64),
        "mask": np.dtype(np.bool_),
        "running_var_scale": np.dtype(np.float32),  # not a norm layer's statistic
    }
    assert averaged_arrays(dtypes) == (
        "bn.running_mean",
        "bn.running_var",
        "bn.num_batches_tracked",
        "mask",
    )


def test_a_step_that_adds_and_assigns_is_one_version_hand_computed() -> None:
    model = SparseModel()
    model.adopt(arrays_to_record({"a": np.zeros(3, np.float32), "n": np.array(2, np.int64)}))
    record = model.apply(torch.tensor([1]), torch.tensor([0.5]), {"n": np.array(3.6)})
    arrays = record_to_arrays(record)
    np.testing.assert_array_equal(arrays["a"], [0, 0.5, 0])
    assert arrays["n"] == 4 and arrays["n"].dtype == np.int64
    assert model.version == 1 and model.changes.changed_since(0, 1).tolist() == [1, 3]
    # A value its dtype cannot hold: refused, x and its version as they were.
    with pytest.raises(ValueError):
        model.apply(torch.tensor([0]), torch.tensor([1.0]), {"n": np.array(1e30)})
    assert model.version == 1 and model.flat.tolist() == [0, 0.5, 0, 4]


@given(
    st.integers(0, 2**31),
    st.lists(st.tuples(st.integers(0, 39), st.integers(1, 8)), max_size=3),
    st.integers(1, 10),
)
@settings(max_examples=30, deadline=None)
def test_excluded_coordinates_are_never_picked(
    seed: int, ranges: list[tuple[int, int]], k: int
) -> None:
    d = 40
    excluded = tuple((start, min(d, start + n)) for start, n in ranges)
    vector = np.random.default_rng(seed).normal(size=d).astype(np.float32)
    sketch = collision_free_sketch(d)
    indices, values = sketch.top_k(sketch.sketch(torch.from_numpy(vector)), k, excluded=excluded)
    masked = vector.copy()
    for start, stop in excluded:
        masked[start:stop] = 0.0
    allowed = int((masked != 0).sum())
    expected = np.argsort(-np.abs(masked), kind="stable")[: min(k, allowed)]
    assert sorted(indices.tolist()[: min(k, allowed)]) == sorted(expected.tolist())
    assert not any(start <= i < stop for i in indices.tolist() for start, stop in excluded)
    picked = indices.numpy()[: len(expected)]
    np.testing.assert_allclose(values.numpy()[: len(expected)], masked[picked], atol=1e-6)


def test_sites_that_missed_rounds_receive_every_coordinate_changed_since() -> None:
    strategy, grid, summaries = run_fetchsgd(rounds=5)
    assert all(u.status == APPLIED for s in summaries for u in s.updates)
    train = [m for m in grid.pushed if m.metadata.message_type == MessageType.TRAIN]
    sparse = [m for m in train if m.content[keys.CONFIG][keys.SYNC_FROM] >= 0]
    assert sparse, "half the sites per round: some come back after missing rounds"
    assert any(
        m.content[keys.CONFIG][keys.MODEL_VERSION] - m.content[keys.CONFIG][keys.SYNC_FROM] > 1
        for m in sparse
    ), "some site missed a round"
    for msg in sparse:
        config = msg.content[keys.CONFIG]
        since, version = config[keys.SYNC_FROM], config[keys.MODEL_VERSION]
        sent = record_to_arrays(msg.content[keys.ARRAYS])["sync.indices"]
        expected = strategy.model.changes.changed_since(since, version)
        np.testing.assert_array_equal(sent, expected.numpy())
        assert len(sent) <= strategy.k * (version - since)
    # Up: one r × c float32 table per update; down: sparse syncs cost less than the model.
    rows = [u for s in summaries for u in s.updates]
    table_bytes = strategy.rows * strategy.cols * 4
    assert all(table_bytes < u.bytes_up < table_bytes + 4096 for u in rows)
    assert min(u.bytes_down for u in rows) < max(u.bytes_down for u in rows) / 2


def test_every_site_rebuilds_exactly_the_servers_model() -> None:
    contexts: dict[int, Context] = {}
    strategy, _, _ = run_fetchsgd(rounds=4, contexts=contexts)

    class Grid:
        def get_node_ids(self) -> list[int]:
            return [1, 2, 3, 4]

    # Offer every site the next round: from its stored copy and what it is sent (dense
    # or the changes since the version it holds) it must rebuild x bit for bit.
    strategy.fraction_train = 1.0
    messages = list(strategy.configure_train(5, strategy.model.record, ConfigRecord(), Grid()))  # type: ignore[arg-type]
    assert any(m.content[keys.CONFIG][keys.SYNC_FROM] >= 0 for m in messages)
    server = record_to_arrays(strategy.model.record)
    # The model keeps its own key order through sparse steps (fc1.weight before fc1.bias).
    assert list(server) == list(digits_model().keys()) != sorted(server)
    for msg in messages:
        held = ModState.load(contexts[msg.metadata.dst_node_id], keys.FETCHSGD_STATE)
        rebuilt = synced_model(msg, held)
        assert rebuilt is not None
        # the server's model, bit for bit and in its own key order
        assert list(rebuilt) == list(server)
        for name in server:
            np.testing.assert_array_equal(rebuilt[name], server[name])


def test_a_site_out_of_sync_fails_once_then_gets_the_whole_model() -> None:
    strategy = FetchSGD(k=3, sketch_cols=50)
    base = arrays_to_record({"w": np.zeros(10, np.float32)})
    strategy.begin_aggregation(1, base)

    class Grid:
        def get_node_ids(self) -> list[int]:
            return [3]

    (msg,) = strategy.configure_train(1, base, ConfigRecord(), Grid())  # type: ignore[arg-type]
    assert msg.content[keys.CONFIG][keys.SYNC_FROM] == -1  # first contact: dense
    strategy.model.held.synced[3] = 0  # as if the site had replied, but it lost its state
    (sparse,) = strategy.configure_train(1, base, ConfigRecord(), Grid())  # type: ignore[arg-type]
    assert sparse.content[keys.CONFIG][keys.SYNC_FROM] == 0
    # A site holding nothing cannot apply changes: it lost its state.
    assert synced_model(sparse, ModState.load(context(3), keys.FETCHSGD_STATE)) is None
    # No reply came: the next message is the whole model again.
    (again,) = strategy.configure_train(1, base, ConfigRecord(), Grid())  # type: ignore[arg-type]
    assert again.content[keys.CONFIG][keys.SYNC_FROM] == -1


def test_a_withdrawn_download_leaves_the_sites_version_known() -> None:
    model = SparseModel()
    model.adopt(arrays_to_record({"w": np.zeros(10, np.float32)}))
    _, first = model.download(7)
    assert first == DENSE
    model.withdraw(7)  # never sent: still nothing known about the site
    _, again = model.download(7)
    assert again == DENSE
    model.confirm(7)
    model.apply(torch.tensor([2]), torch.tensor([1.0]))
    _, sync_from = model.download(7)
    assert sync_from == 0
    model.withdraw(7)  # the site sat this one out: it still holds version 0
    record, sync_from = model.download(7)
    assert sync_from == 0
    assert record_to_arrays(record)["sync.indices"].tolist() == [2]


def test_a_forgotten_site_is_sent_the_whole_model_whether_or_not_a_download_was_out() -> None:
    """A site that lost its state between messages (Sketched-SGD's values round sends no
    download) or while one was out: its next download is the whole model."""
    model = SparseModel()
    model.adopt(arrays_to_record({"w": np.zeros(10, np.float32)}))
    model.download(7)
    model.confirm(7)  # it holds version 0
    model.apply(torch.tensor([2]), torch.tensor([1.0]))
    model.forget(7)  # no download out
    assert model.download(7)[1] == DENSE
    model.confirm(7)
    model.apply(torch.tensor([3]), torch.tensor([1.0]))
    assert model.download(7)[1] == 1  # sparse, and out
    model.forget(7)
    model.withdraw(7)  # nothing to give back: what it holds stays unknown
    assert model.download(7)[1] == DENSE


def test_sites_drawn_as_away_keep_their_sparse_downloads() -> None:
    """Simulated availability: a site's drafted message is not sent, and it is not re-sent
    the whole model next time (one dense download per site, at first contact)."""
    from flplatform.engine.clock import VirtualClock
    from flplatform.network import ComputeModel
    from tests.helpers.idle_sites import network

    clock = VirtualClock(network(4, ComputeModel("fixed", mean_seconds=1.0), availability=0.6))
    grid = ScriptedGrid({n: digits_site(n - 1, 4, context(n)) for n in range(1, 5)})
    strategy = FetchSGD(k=200, fraction_train=1.0, seed=1)
    summaries: list[RoundSummary] = []
    engine = RoundEngine(
        grid, strategy, clock=clock, poll_interval=0.0, required_sites=4, on_round=summaries.append
    )
    engine.run(
        digits_model(),
        num_rounds=8,
        train_config=ConfigRecord({keys.LOCAL_STEPS: 1, keys.LR: 0.1}),
    )
    away = [u for s in summaries for u in s.updates if u.status != APPLIED]
    assert away, "availability 0.6 draws some sites as away"
    train = [m for m in grid.pushed if m.metadata.message_type == MessageType.TRAIN]
    dense_per_site = Counter(
        m.metadata.dst_node_id for m in train if m.content[keys.CONFIG][keys.SYNC_FROM] == DENSE
    )
    assert dense_per_site == Counter({n: 1 for n in dense_per_site})
    assert sum(m.content[keys.CONFIG][keys.SYNC_FROM] >= 0 for m in train) > 0


def sketch_reply(arrays: dict, examples: object = 4) -> Message:
    instruction = Message(
        RecordDict({keys.CONFIG: ConfigRecord()}), dst_node_id=4, message_type=MessageType.TRAIN
    )
    content = RecordDict(
        {
            keys.ARRAYS: arrays_to_record(arrays),
            keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: examples}),
        }
    )
    return Message(content, reply_to=instruction)


@pytest.mark.parametrize(
    ("arrays", "reason"),
    [
        ({"w": np.zeros(10, np.float32)}, r"fetchsgd_mod\(\)"),
        ({"sketch": np.zeros((5, 49), np.float32)}, "shape"),
        ({"sketch": np.zeros((5, 50), np.float64)}, "float32"),
        ({"sketch": np.full((5, 50), np.nan, np.float32)}, "NaN"),
    ],
)
def test_malformed_sketches_are_rejected(arrays: dict, reason: str) -> None:
    strategy = FetchSGD(k=3, sketch_cols=50)
    base = arrays_to_record({"w": np.zeros(10, np.float32)})
    strategy.begin_aggregation(1, base)
    with pytest.raises(UpdateRejected, match=reason):
        strategy.accumulate(sketch_reply(arrays), base=base)
    assert strategy.finish_aggregation() == (None, None)


NORM_MODEL = {"w": np.zeros(10, np.float32), "bn.running_var": np.ones(2, np.float16)}
TABLE = np.zeros((5, 50), np.float32)


@pytest.mark.parametrize("names", [["v"], ["bn.running_var"], "w", [3]])
def test_unchanged_arrays_that_are_no_sketched_arrays_of_the_model_are_rejected(
    names: object,
) -> None:
    strategy = FetchSGD(k=3, sketch_cols=50)
    base = arrays_to_record(NORM_MODEL)
    strategy.begin_aggregation(1, base)
    reply = sketch_reply({"sketch": TABLE, "averaged/float32": np.ones(2, np.float32)})
    reply.content[keys.CONFIG] = ConfigRecord({keys.UNCHANGED_ARRAYS: names})  # type: ignore[dict-item]
    with pytest.raises(UpdateRejected, match="'unchanged-arrays' must list sketched arrays"):
        strategy.accumulate(reply, base=base)


@pytest.mark.parametrize(
    ("arrays", "reason"),
    [
        ({"sketch": TABLE}, "'averaged/float32' is missing"),
        ({"sketch": TABLE, "averaged/float32": np.ones(3, np.float32)}, "shape"),
        ({"sketch": TABLE, "averaged/float32": np.ones(2, np.float64)}, "float32"),
        ({"sketch": TABLE, "averaged/float32": np.array([1, np.inf], np.float32)}, "Inf"),
        (
            {"sketch": TABLE, "averaged/float32": np.ones(2, np.float32), "averaged/x": TABLE},
            "unexpected",
        ),
        ({"sketch": TABLE, "w": np.ones(2, np.float32)}, r"fetchsgd_mod\(\)"),
        # a value no float16 can hold
        ({"sketch": TABLE, "averaged/float32": np.array([1, 1e30], np.float32)}, "overflows"),
    ],
)
def test_malformed_averaged_arrays_are_rejected(arrays: dict, reason: str) -> None:
    strategy = FetchSGD(k=3, sketch_cols=50)
    base = arrays_to_record(NORM_MODEL)
    strategy.begin_aggregation(1, base)
    with pytest.raises(UpdateRejected, match=reason):
        strategy.accumulate(sketch_reply(arrays), base=base)
    assert strategy.finish_aggregation() == (None, None)


def test_a_counter_beyond_its_dtype_is_rejected_and_the_round_goes_on() -> None:
    model = {**NORM_MODEL, "bn.num_batches_tracked": np.array(3, np.int64)}
    strategy = FetchSGD(k=3, sketch_cols=50)
    base = arrays_to_record(model)
    strategy.begin_aggregation(1, base)
    honest = {"sketch": TABLE, "averaged/float32": np.ones(2, np.float32)}
    hostile = {**honest, "averaged/float64": np.array([1e300])}
    with pytest.raises(UpdateRejected, match="outside the range of int64"):
        strategy.accumulate(sketch_reply(hostile), base=base)
    strategy.accumulate(sketch_reply({**honest, "averaged/float64": np.array([8.0])}), base=base)
    arrays, _ = strategy.finish_aggregation()
    assert record_to_arrays(arrays)["bn.num_batches_tracked"] == 8


def test_the_guard_sees_what_training_did_to_the_averaged_arrays() -> None:
    strategy = FetchSGD(k=3, sketch_cols=50)
    base = arrays_to_record(NORM_MODEL)
    strategy.begin_aggregation(1, base)
    trained = np.array([3, 0.5], np.float32)
    reply = sketch_reply({"sketch": TABLE, "averaged/float32": trained})
    update = strategy.read_update(reply, base=base)
    # the sketch is judged as the update's norm and direction, the averaged arrays apart
    assert len(update.vector) == 1 and len(update.averaged) == 1
    np.testing.assert_array_equal(update.vector[0], TABLE)
    np.testing.assert_array_equal(update.averaged[0], [2, -0.5])  # value − x


def test_fetchsgd_settings_are_checked() -> None:
    config = RunConfig.from_mapping({"strategy": "fetchsgd", "k": 500, "sketch-cols": 2500})
    assert (config.k, config.sketch_rows, config.sketch_cols) == (500, 5, 2500)
    with pytest.raises(ConfigError, match="sketch-rows must be odd"):
        RunConfig.from_mapping({"strategy": "fetchsgd", "sketch-rows": 4})
    with pytest.raises(ConfigError, match="sync mode 'sync' only"):
        RunConfig.from_mapping({"strategy": "fetchsgd", "sync": "k-async"})
    with pytest.raises(ConfigError, match="sketch-cols shapes the sketches of strategy 'fetchsgd'"):
        RunConfig.from_mapping({"sketch-cols": 100})
    with pytest.raises(
        ConfigError,
        match="sketch-removal shapes the sketches of strategy 'fetchsgd', not 'sketched-sgd'",
    ):
        RunConfig.from_mapping({"strategy": "sketched-sgd", "sketch-removal": "subtract"})
    with pytest.raises(
        ConfigError, match="candidate-factor shapes .* 'sketched-sgd', not 'fetchsgd'"
    ):
        RunConfig.from_mapping({"strategy": "fetchsgd", "candidate-factor": 3})
    with pytest.raises(ConfigError, match="sketch-removal"):
        RunConfig.from_mapping({"strategy": "fetchsgd", "sketch-removal": "halve"})
    with pytest.raises(ConfigError, match="k must be"):
        FetchSGD(k=0)


def test_layout_order_is_shared_by_site_and_server() -> None:
    model = record_to_arrays(digits_model())
    assert Layout.of(model).names == Layout.of(dict(reversed(model.items()))).names
