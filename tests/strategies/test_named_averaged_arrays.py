"""Arrays the user names to be averaged whole (``averaged-arrays``): buffers no rule finds
by their name, such as a running class distribution. Every codec and sketch sends them
exactly and the server sets them to the sites' example-weighted mean, so a distribution
stays one. Real strategies and mods, the built-in ClientApp on digits; only the transport
is in-process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from flwr.app import ConfigRecord

from flplatform.app.config import RunConfig
from flplatform.app.federation import build_strategy
from flplatform.core import keys
from flplatform.core.arrays import record_to_arrays
from flplatform.core.errors import ConfigError, UpdateRejected
from flplatform.engine import APPLIED
from flplatform.engine.engine import RoundEngine
from flplatform.engine.strategy import EngineStrategy
from strategies.averaged_arrays import named_arrays, split_names
from strategies.codecs import TopK, make_codec
from strategies.delayed import DelayedCompensated
from strategies.fetchsgd import FetchSGD
from strategies.layout import Layout
from strategies.local_sgd import LocalSGDAveraging
from strategies.sketched_sgd import SketchedSGD
from tests.helpers.delayed_sites import digits_site
from tests.helpers.norm_model import PRIOR, PRIOR_SPEC
from tests.helpers.scripted_grid import ScriptedGrid
from tests.helpers.sites import digits_model

pytestmark = pytest.mark.usefixtures("task_identity")

ROUNDS = 3
NAMED = ("*.class_prior",)
STRATEGIES: dict[str, Callable[[Sequence[str]], EngineStrategy]] = {
    "local-sgd-topk": lambda named: LocalSGDAveraging(codec="topk:0.05", averaged_arrays=named),
    "local-sgd-int8": lambda named: LocalSGDAveraging(codec="int8", averaged_arrays=named),
    "dts": lambda named: DelayedCompensated(
        delay=1, num_rounds=ROUNDS, codec="topk:0.05", averaged_arrays=named
    ),
    "fetchsgd": lambda named: FetchSGD(k=40, sketch_cols=60, seed=1, averaged_arrays=named),
    "sketched-sgd": lambda named: SketchedSGD(k=40, sketch_cols=60, seed=1, averaged_arrays=named),
}


def run(strategy: EngineStrategy) -> tuple[list[dict[str, np.ndarray]], ScriptedGrid]:
    """ROUNDS rounds on three digits sites training ``prior_net``: the model after each."""
    grid = ScriptedGrid({n + 1: digits_site(n, 3, model=PRIOR_SPEC) for n in range(3)})
    models: list[dict[str, np.ndarray]] = []
    RoundEngine(grid, strategy, poll_interval=0.0, required_sites=3).run(  # type: ignore[arg-type]
        digits_model(num_partitions=3, model=PRIOR_SPEC),
        num_rounds=ROUNDS,
        train_config=ConfigRecord({keys.LOCAL_STEPS: 5, keys.LR: 0.1}),
        evaluate_fn=lambda _, arrays: models.append(record_to_arrays(arrays)),
    )
    return models, grid


@functools.cache
def _reference() -> np.ndarray:
    models, _ = run(LocalSGDAveraging())
    return models[1][PRIOR].astype(np.float64)


@pytest.fixture
def reference() -> np.ndarray:
    """The prior after round 1 of uncompressed local-SGD: the sites' example-weighted mean
    (every site trains round 1 from the same model, whatever the strategy). Once per
    worker: it needs the task identity of a test."""
    return _reference()


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_named_buffer_travels_exactly_and_stays_a_distribution(
    name: str, reference: np.ndarray
) -> None:
    models, grid = run(STRATEGIES[name](NAMED))
    assert len(models) == 1 + ROUNDS
    for model in models:
        prior = model[PRIOR]
        assert prior.dtype == np.float16
        assert (prior >= 0).all() and abs(float(prior.astype(np.float64).sum()) - 1) < 5e-3
    # The first step that moved it made it the mean of what the sites trained from the
    # initial model (Sketched-SGD's first step is its second round).
    moved = next(m for m in models if not np.array_equal(m[PRIOR], models[0][PRIOR]))
    np.testing.assert_allclose(moved[PRIOR].astype(np.float64), reference, rtol=0, atol=2e-4)
    # The sites were told, and did as told: the server named it in every training message.
    trained = [m for m in grid.pushed if m.metadata.message_type == "train"]
    assert trained and all(
        PRIOR in m.content[keys.CONFIG].get(keys.AVERAGED_ARRAYS, []) for m in trained
    )


def test_unnamed_under_top_k_the_buffer_is_compressed_with_the_weights(
    reference: np.ndarray,
) -> None:
    """What naming it changes: top-k leaves the prior's small changes unsent."""
    models, grid = run(STRATEGIES["local-sgd-topk"](()))
    assert not np.allclose(models[1][PRIOR].astype(np.float64), reference, rtol=0, atol=2e-4)
    trained = [m for m in grid.pushed if m.metadata.message_type == "train"]
    assert all(keys.AVERAGED_ARRAYS not in m.content[keys.CONFIG] for m in trained)


def test_named_arrays_match_names_and_patterns_in_the_model_order() -> None:
    names = ["a.weight", "a.class_prior", "b.class_prior", "counts"]
    assert named_arrays(["counts", "*.class_prior"], names) == (
        "a.class_prior",
        "b.class_prior",
        "counts",
    )
    assert named_arrays([], names) == ()
    # an exact name is itself, also where it reads as a pattern ("[0]": a character class)
    assert named_arrays(["heads[0].prior"], ["heads[0].prior", "w"]) == ("heads[0].prior",)
    with pytest.raises(ConfigError, match=r"averaged-arrays 'prior', 'x\*' matches no array"):
        named_arrays(["prior", "x*", "counts"], names)
    assert split_names(" *.class_prior, counts ,,") == ("*.class_prior", "counts")


def test_top_k_never_picks_a_named_array_and_sends_it_exactly() -> None:
    update = {
        "w": np.array([0.5, -0.25, 0.125], np.float32),
        "prior": np.array([-9.0, 7.0], np.float16),  # the largest values of all
    }
    codec = make_codec("topk:1", averaged=["prior"])
    wire = codec.encode(update, rng=np.random.default_rng(0))
    # Layout order: prior (coordinates 0, 1), then w (2, 3, 4): top-1 is w[0]
    assert wire["topk.indices"].tolist() == [2] and wire["topk.values"].tolist() == [0.5]
    assert wire["averaged/float32"].tolist() == [-9.0, 7.0]
    decoded = codec.decode(wire, Layout.of(update))
    np.testing.assert_array_equal(decoded["prior"], update["prior"])
    np.testing.assert_array_equal(decoded["w"], [0.5, 0, 0])
    # A server that was not told decodes nothing: halves that disagree are refused.
    with pytest.raises(UpdateRejected):
        TopK(k=1).decode(wire, Layout.of(update))


def test_a_pattern_that_matches_no_array_stops_the_run_before_round_one() -> None:
    strategy = LocalSGDAveraging(codec="int8", averaged_arrays=["class_priors"])
    grid = ScriptedGrid({n + 1: digits_site(n, 3, model=PRIOR_SPEC) for n in range(3)})
    with pytest.raises(ConfigError, match="averaged-arrays 'class_priors' matches no array"):
        RoundEngine(grid, strategy, poll_interval=0.0, required_sites=3).run(
            digits_model(num_partitions=3, model=PRIOR_SPEC), num_rounds=1
        )
    assert not [m for m in grid.pushed if m.metadata.message_type == "train"]


def test_the_option_reaches_every_strategy_and_bad_values_are_refused() -> None:
    for strategy, extra in (
        ("local-sgd", {"codec": "int8"}),
        ("delayed", {"codec": "topk:0.01"}),
        ("fetchsgd", {"k": 10}),
        ("sketched-sgd", {"k": 10}),
    ):
        config = RunConfig.from_mapping(
            {"strategy": strategy, "averaged-arrays": "*.class_prior, counts", **extra}
        )
        built = build_strategy(config)
        assert built.averaged_arrays == ("*.class_prior", "counts"), strategy
    with pytest.raises(ConfigError, match="averaged-arrays must be a list of array names"):
        LocalSGDAveraging(averaged_arrays="class_prior")  # type: ignore[arg-type]
    for bad in (["a,b"], [" prior"], [""]):
        with pytest.raises(ConfigError, match="non-empty names without commas"):
            FetchSGD(k=10, averaged_arrays=bad)


def test_every_update_is_applied_with_a_named_buffer() -> None:
    # (the strategies above apply every reply: nothing is refused for the names)
    strategy = STRATEGIES["fetchsgd"](NAMED)
    grid = ScriptedGrid({n + 1: digits_site(n, 3, model=PRIOR_SPEC) for n in range(3)})
    summaries = []
    RoundEngine(grid, strategy, poll_interval=0.0, required_sites=3, on_round=summaries.append).run(
        digits_model(num_partitions=3, model=PRIOR_SPEC), num_rounds=2
    )
    assert summaries and all(u.status == APPLIED for s in summaries for u in s.updates)


@pytest.mark.parametrize("make", [FetchSGD, SketchedSGD])
def test_a_sketched_run_resumes_with_its_named_arrays_and_refuses_names_it_lacks(
    make: Callable[..., EngineStrategy],
) -> None:
    from flplatform.core.arrays import arrays_to_record
    from flplatform.core.checkpoint import CheckpointError
    from tests.helpers.scripted_grid import ScriptedGrid

    model = arrays_to_record({"w": np.zeros(6, np.float32), "prior": np.full(3, 1 / 3, np.float16)})
    original = make(k=2, sketch_cols=20, averaged_arrays=["pri*"])
    original.configure_train(1, model, ConfigRecord(), ScriptedGrid({}))
    assert original.model.averaged == ("prior",)
    restored = make(k=2, sketch_cols=20, averaged_arrays=["pri*"])
    restored.load_state_dict(original.state_dict())
    assert restored.model.averaged == ("prior",)
    assert restored.model.layout == original.model.layout
    with pytest.raises(CheckpointError, match="averaged-arrays 'counts' matches no array"):
        make(k=2, sketch_cols=20, averaged_arrays=["counts"]).load_state_dict(original.state_dict())
