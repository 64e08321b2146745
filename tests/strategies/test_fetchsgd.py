"""FetchSGD: the server's sketch maths against a naive reference, and the full round trip."""

from __future__ import annotations

from collections import Counter

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

from flplatform.app.config import RunConfig
from flplatform.core import keys
from flplatform.core.arrays import arrays_to_record, record_to_arrays
from flplatform.core.errors import ConfigError, UpdateRejected
from flplatform.engine import APPLIED, RoundSummary
from flplatform.engine.engine import RoundEngine
from strategies.codecs import Layout
from strategies.fetchsgd import FetchSGD
from strategies.mods.contract import ModState
from strategies.mods.fetchsgd import synced_model
from strategies.sketch_feedback import SketchFeedback
from strategies.sparse_sync import DENSE, ChangeLog, SparseModel
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
    rounds: int = 4, contexts: dict[int, Context] | None = None, **kwargs: object
) -> tuple[FetchSGD, ScriptedGrid, list[RoundSummary]]:
    contexts = contexts if contexts is not None else {}
    for n in range(1, 5):
        contexts.setdefault(n, context(n))
    grid = ScriptedGrid({n: digits_site(n - 1, 4, contexts[n]) for n in range(1, 5)})
    strategy = FetchSGD(k=200, fraction_train=0.5, seed=1, **kwargs)  # type: ignore[arg-type]
    summaries: list[RoundSummary] = []
    engine = RoundEngine(
        grid, strategy, poll_interval=0.0, required_sites=4, on_round=summaries.append
    )
    engine.run(
        digits_model(),
        num_rounds=rounds,
        train_config=ConfigRecord({keys.LOCAL_STEPS: 5, keys.LR: 0.1}),
    )
    return strategy, grid, summaries


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
    strategy.model.synced[3] = 0  # as if the site had replied, but it lost its state
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
