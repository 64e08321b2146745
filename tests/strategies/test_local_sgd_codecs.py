"""Local-SGD averaging with compressed uploads: the server decodes, the site keeps its error."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from flplatform.app.config import RunConfig
from flplatform.core import keys
from flplatform.core.arrays import arrays_to_record, record_to_arrays
from flplatform.core.errors import ConfigError, UpdateRejected
from flplatform.engine import APPLIED, RoundSummary
from flplatform.engine.engine import RoundEngine
from strategies.codecs import TopK
from strategies.layout import Layout
from strategies.local_sgd import LocalSGDAveraging
from tests.helpers import norm_model
from tests.helpers.delayed_sites import digits_site
from tests.helpers.scripted_grid import ScriptedGrid
from tests.helpers.sites import digits_model

pytestmark = pytest.mark.usefixtures("task_identity")

BASE = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(2, np.float32)}


def compressed_reply(wire: dict, codec: str, examples: int = 4) -> Message:
    instruction = Message(
        RecordDict({keys.CONFIG: ConfigRecord()}), dst_node_id=4, message_type=MessageType.TRAIN
    )
    content = RecordDict(
        {
            keys.ARRAYS: arrays_to_record(wire),
            keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: examples}),
            keys.CONFIG: ConfigRecord({keys.CODEC: codec}),
        }
    )
    return Message(content, reply_to=instruction)


def test_the_server_averages_the_decoded_updates() -> None:
    # Two sites send the top-2 of their deltas; hand-computed: site 1 (1 example) keeps
    # w[0,0] = 3 and b[1] = −2, site 2 (3 examples) keeps w[1,2] = 4 and w[0,0] = 1.
    codec = TopK(k=2)
    strategy = LocalSGDAveraging(codec=codec.name)
    base = arrays_to_record(BASE)
    strategy.begin_aggregation(1, base)
    d1 = {"w": np.array([[3, 0.1, 0], [0, 0, 0]], np.float32), "b": np.array([0, -2], np.float32)}
    d2 = {"w": np.array([[1, 0, 0], [0, 0, 4]], np.float32), "b": np.array([0.5, 0], np.float32)}
    rng = np.random.default_rng(0)
    strategy.accumulate(compressed_reply(codec.encode(d1, rng=rng), codec.name, 1), base=base)
    strategy.accumulate(compressed_reply(codec.encode(d2, rng=rng), codec.name, 3), base=base)
    arrays, _ = strategy.finish_aggregation()
    new = record_to_arrays(arrays)
    np.testing.assert_allclose(new["w"], [[(3 + 3 * 1) / 4, 0, 0], [0, 0, 3 * 4 / 4]])
    np.testing.assert_allclose(new["b"], [0, -2 / 4])


def test_a_whole_model_from_a_plain_flower_client_is_still_averaged() -> None:
    strategy = LocalSGDAveraging(codec="int8")
    base = arrays_to_record(BASE)
    strategy.begin_aggregation(1, base)
    instruction = Message(
        RecordDict({keys.CONFIG: ConfigRecord()}), dst_node_id=4, message_type=MessageType.TRAIN
    )
    model = {"w": np.ones((2, 3), np.float32), "b": np.ones(2, np.float32)}
    content = RecordDict(
        {
            keys.ARRAYS: arrays_to_record(model),
            keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: 2}),
        }
    )
    strategy.accumulate(Message(content, reply_to=instruction), base=base)
    arrays, _ = strategy.finish_aggregation()
    np.testing.assert_allclose(record_to_arrays(arrays)["w"], 1.0)


@pytest.mark.parametrize(
    ("wire", "codec", "reason"),
    [
        ({"topk.indices": np.array([0, 1], np.int32)}, "topk:2", "topk.values"),
        (
            {
                "topk.indices": np.array([0, 99], np.int32),
                "topk.values": np.ones(2, np.float32),
            },
            "topk:2",
            "range",
        ),
        (
            {
                "topk.indices": np.array([0, 1], np.int32),
                "topk.values": np.ones(2, np.float32),
            },
            "int8",
            "asked for 'topk:2'",
        ),
    ],
)
def test_malformed_compressed_updates_are_rejected(wire: dict, codec: str, reason: str) -> None:
    strategy = LocalSGDAveraging(codec="topk:2")
    base = arrays_to_record(BASE)
    strategy.begin_aggregation(1, base)
    with pytest.raises(UpdateRejected, match=reason):
        strategy.accumulate(compressed_reply(wire, codec), base=base)


def test_sites_upload_compressed_updates_and_keep_their_residual() -> None:
    rounds: dict[str, list[RoundSummary]] = {}
    grids = {}
    for codec in ("none", "topk:0.05", "int8", "int4"):
        grid = ScriptedGrid({n + 1: digits_site(n, 3) for n in range(3)})
        grids[codec] = grid
        engine = RoundEngine(
            grid,
            LocalSGDAveraging(codec=codec),
            poll_interval=0.0,
            required_sites=3,
            on_round=lambda s, c=codec: rounds.setdefault(c, []).append(s),
        )
        model = record_to_arrays(digits_model(num_partitions=3))
        engine.run(
            arrays_to_record(model),
            num_rounds=2,
            train_config=ConfigRecord({keys.LOCAL_STEPS: 5, keys.LR: 0.1}),
        )
    up = {c: sum(s.bytes_up for s in summaries) for c, summaries in rounds.items()}
    assert all(u.status == APPLIED for s in rounds["topk:0.05"] for u in s.updates)
    # 5% of the values with int32 indices is a tenth of the dense payload, int8 a
    # quarter; each message also carries metrics and a header per array (int8 sends two
    # arrays per model array), which weigh a lot beside this 5k-parameter model.
    assert 0.08 * up["none"] < up["topk:0.05"] < 0.2 * up["none"]
    assert 0.25 * up["none"] < up["int8"] < 0.5 * up["none"]
    # int4: 4.5 bits an element with a scale per 64 against int8's 8 (the same headers
    # and metrics weigh on both: 52 against 65 kB measured)
    assert 0.14 * up["none"] < up["int4"] < 0.85 * up["int8"]
    for codec in ("int8", "int4"):
        assert all(u.status == APPLIED for s in rounds[codec] for u in s.updates)


def test_running_statistics_and_counters_travel_exactly_beside_compressed_weights() -> None:
    """Top-k and int8 compress the weights only: a BatchNorm's running statistics and
    counter arrive exactly, so they are what uncompressed local-SGD makes of them (the
    sites' example-weighted mean) and a running variance stays positive. FedAvgM's
    momentum and server rate ("fedavgm") move the weights only, likewise."""
    models: dict[str, list[dict[str, np.ndarray]]] = {}
    start = digits_model(num_partitions=3, model=norm_model.SPEC)
    strategies = {
        "none": lambda: LocalSGDAveraging(),
        "topk:0.05": lambda: LocalSGDAveraging(codec="topk:0.05"),
        "int8": lambda: LocalSGDAveraging(codec="int8"),
        "fedavgm": lambda: LocalSGDAveraging(eta=0.5, beta=0.9),
    }
    for codec, make in strategies.items():
        grid = ScriptedGrid({n + 1: digits_site(n, 3, model=norm_model.SPEC) for n in range(3)})
        seen = models.setdefault(codec, [])
        RoundEngine(grid, make(), poll_interval=0.0, required_sites=3).run(
            start,
            num_rounds=3,
            train_config=ConfigRecord({keys.LOCAL_STEPS: 5, keys.LR: 0.1}),
            evaluate_fn=lambda _, arrays, seen=seen: seen.append(record_to_arrays(arrays)),
        )
    statistics = ["1.running_mean", "1.running_var"]
    for codec in ("topk:0.05", "int8", "fedavgm"):
        assert len(models[codec]) == 4  # the initial model and three rounds
        # Round 1 trains every site from the same model: the same statistics, whatever
        # the weights' codec.
        for name in statistics:
            np.testing.assert_allclose(models[codec][1][name], models["none"][1][name], rtol=1e-6)
        for round_, model in enumerate(models[codec]):
            assert (model["1.running_var"] > 0).all()
            assert model["1.num_batches_tracked"] == 5 * round_
        # and the weights were compressed: round 1's differ from the uncompressed run's
        assert not np.array_equal(models[codec][1]["0.weight"], models["none"][1]["0.weight"])


def test_a_bad_codec_is_refused_where_it_is_configured() -> None:
    with pytest.raises(ConfigError, match="unknown codec 'zip'"):
        RunConfig.from_mapping({"codec": "zip"})
    with pytest.raises(ConfigError, match="leave codec 'none'"):
        RunConfig.from_mapping({"strategy": "fetchsgd", "codec": "int8", "k": 10})
    # delayed updates upload a delta too (DTS's recipe: delayed + top-k)
    assert RunConfig.from_mapping({"strategy": "delayed", "codec": "int8"}).codec == "int8"
    with pytest.raises(ConfigError, match="unknown codec"):
        LocalSGDAveraging(codec="gzip")
    assert RunConfig.from_mapping({"codec": "topk:0.01"}).codec == "topk:0.01"
    assert Layout.of(BASE).size == 8
