"""The mod contract (strategies/mods): what every mod does around a user's train function.

Real Flower messages and contexts; the user's functions are plain Flower train functions.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)

from flplatform.core import keys
from flplatform.core.arrays import arrays_to_record, record_to_arrays
from flplatform.core.errors import ConfigError
from flplatform.engine import APPLIED, REJECTED, PeriodSync, RoundSummary, Synchrony
from flplatform.engine.engine import RoundEngine
from strategies.codecs import make_codec
from strategies.delayed import DelayedCompensated
from strategies.fetchsgd import FetchSGD
from strategies.layout import Layout
from strategies.local_sgd import LocalSGDAveraging
from strategies.mods import (
    codec_mod,
    delayed_mod,
    fetchsgd_mod,
    flplatform_mod,
    model_mod,
    sketched_sgd_mod,
)
from strategies.mods.contract import Mod
from strategies.mods.sketched_sgd import CANDIDATES, VALUES, StepPhase
from strategies.sketched_sgd import SketchedSGD
from strategies.sparse_sync import DENSE, SYNC_INDICES, SYNC_VALUES
from tests.helpers.algorithms import ALGORITHMS
from tests.helpers.delayed_sites import QuadraticSite, context, digits_site
from tests.helpers.scripted_grid import ScriptedGrid
from tests.helpers.sites import digits_model, restart_before_round

pytestmark = pytest.mark.usefixtures("task_identity")


def odd_model() -> dict[str, np.ndarray]:
    """A model in no sorted order, with float16 weights, an integer counter and a bool mask."""
    return {
        "z.weight": np.arange(12, dtype=np.float32).reshape(3, 4) / 10,
        "a.bias": np.array([0.5, -0.25, 1.0, 2.0], dtype=np.float16),
        "bn.num_batches_tracked": np.array(7, dtype=np.int64),
        "bn.running_mean": np.zeros(4, dtype=np.float32),
        "mask": np.array([True, False, True]),
    }


class UserTrain:
    """A plain Flower train function: floats + 0.125, the counter + 3; it records its input."""

    def __init__(self, examples: int = 20, reply: Callable[[Message], Message] | None = None):
        self.examples = examples
        self.received: list[dict[str, np.ndarray]] = []
        self.configs: list[dict[str, Any]] = []
        self.reply = reply

    def __call__(self, msg: Message, context: Context) -> Message:
        arrays = record_to_arrays(msg.content[keys.ARRAYS])
        self.received.append(arrays)
        self.configs.append(dict(msg.content[keys.CONFIG]))
        if self.reply is not None:
            return self.reply(msg)
        trained = {}
        for name, value in arrays.items():
            if value.dtype.kind == "f":
                trained[name] = (value + 0.125).astype(value.dtype)
            elif value.dtype.kind == "i":
                trained[name] = value + 3
            else:
                trained[name] = value
        metrics = MetricRecord({keys.NUM_EXAMPLES: self.examples, keys.TRAIN_LOSS: 0.5})
        content = RecordDict({keys.ARRAYS: arrays_to_record(trained), keys.METRICS: metrics})
        return Message(content, reply_to=msg)


def train_message(arrays: dict[str, np.ndarray], **config: Any) -> Message:
    content = RecordDict(
        {keys.ARRAYS: arrays_to_record(arrays), keys.CONFIG: ConfigRecord(dict(config))}
    )
    return Message(content, dst_node_id=1, message_type=MessageType.TRAIN)


SKETCH = {keys.SKETCH_SEED: 3, keys.SKETCH_ROWS: 3, keys.SKETCH_COLS: 64}
CASES: dict[str, tuple[Mod, dict[str, Any]]] = {
    "local-sgd": (flplatform_mod(), {keys.SITE_ALGORITHM: keys.LOCAL_SGD}),
    "int8": (codec_mod(), {keys.SITE_ALGORITHM: keys.LOCAL_SGD, keys.CODEC: "int8"}),
    "topk": (codec_mod("topk:3"), {keys.SITE_ALGORITHM: keys.LOCAL_SGD, keys.CODEC: "topk:3"}),
    "delayed": (
        delayed_mod(),
        {
            keys.SITE_ALGORITHM: keys.DELAYED,
            keys.SERVER_ROUND: 1,
            keys.MODEL_VERSION: 0,
            keys.INCLUDED_PERIODS: [],
        },
    ),
    "fetchsgd": (
        fetchsgd_mod(),
        {
            keys.SITE_ALGORITHM: keys.FETCHSGD,
            keys.MODEL_VERSION: 0,
            keys.SYNC_FROM: DENSE,
            **SKETCH,
        },
    ),
    "sketched-sgd": (
        sketched_sgd_mod(),
        {
            keys.SITE_ALGORITHM: keys.SKETCHED_SGD,
            keys.STEP_PHASE: "sketch",
            keys.MODEL_VERSION: 0,
            keys.SYNC_FROM: DENSE,
            keys.SERVER_ROUND: 1,
            keys.STEP_MOMENTUM: 0.0,
            keys.ZERO_STEP: 0,
            **SKETCH,
        },
    ),
}


# ============================================================== the contract
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_user_gets_the_dense_model_in_its_own_order_and_dtypes(case: str) -> None:
    mod, config = CASES[case]
    model = odd_model()
    user = UserTrain()
    reply = mod(train_message(model, **config), context(1), user)
    assert not reply.has_error()
    (given,) = user.received
    assert list(given) == list(model)  # the model's key order, not a sorted one
    for name, value in model.items():
        assert given[name].dtype == value.dtype and given[name].shape == value.shape
        np.testing.assert_array_equal(given[name], value)
    metrics = reply.content[keys.METRICS]
    assert metrics[keys.NUM_EXAMPLES] == 20 and metrics[keys.TRAIN_LOSS] == 0.5
    assert metrics[keys.COMPUTE_SECONDS] >= 0.0  # measured around the call


def test_uploads_of_non_float_arrays_are_exact_where_the_update_is_a_delta() -> None:
    model = odd_model()
    # the trained counter (a whole model) or its change (a delta): 7 + 3
    for case, counter in (("local-sgd", 10), ("delayed", 3), ("int8", 3)):
        mod, config = CASES[case]
        reply = mod(train_message(model, **config), context(1), UserTrain())
        sent = record_to_arrays(reply.content[keys.ARRAYS])
        if case == "int8":
            sent = make_codec("int8").decode(sent, Layout.of(model))  # as the server does
        assert sent["bn.num_batches_tracked"].dtype == np.int64, case
        assert int(sent["bn.num_batches_tracked"]) == counter, case
        assert sent["mask"].dtype == np.bool_, case


def test_a_user_function_returning_the_wrong_shape_is_refused_with_a_reason() -> None:
    def reshaped(msg: Message) -> Message:
        arrays = record_to_arrays(msg.content[keys.ARRAYS])
        arrays["z.weight"] = np.zeros((4, 3), np.float32)
        metrics = MetricRecord({keys.NUM_EXAMPLES: 5})
        return Message(
            RecordDict({keys.ARRAYS: arrays_to_record(arrays), keys.METRICS: metrics}),
            reply_to=msg,
        )

    for case in ("local-sgd", "delayed", "fetchsgd"):
        mod, config = CASES[case]
        reply = mod(train_message(odd_model(), **config), context(1), UserTrain(reply=reshaped))
        assert re.search(r"'z.weight' of shape \(4, 3\); the model", refusal(reply))


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (lambda a: {keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: 5})}, "no 'arrays' record"),
        (lambda a: {keys.ARRAYS: a}, "no 'metrics' record"),
        (
            lambda a: {keys.ARRAYS: a, keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: 0})},
            "num-examples must be in",
        ),
        (
            lambda a: {
                keys.ARRAYS: ArrayRecord({"z.weight": Array(np.zeros((3, 4), np.float32))}),
                keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: 5}),
            },
            "missing a.bias",
        ),
        (
            lambda a: {
                keys.ARRAYS: arrays_to_record(
                    {**record_to_arrays(a), "z.weight": np.full((3, 4), np.nan, np.float32)}
                ),
                keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: 5}),
            },
            "NaN or Inf",
        ),
    ],
)
def test_malformed_user_replies_are_refused_at_the_site(content: Any, reason: str) -> None:
    def bad(msg: Message) -> Message:
        return Message(RecordDict(content(msg.content[keys.ARRAYS])), reply_to=msg)

    mod, config = CASES["delayed"]
    state = context(1)
    reply = mod(train_message(odd_model(), **config), state, UserTrain(reply=bad))
    assert re.search(reason, refusal(reply))
    assert keys.DELAYED_STATE not in state.state  # nothing kept from a failed period


def refusal(reply: Message) -> str:
    """The reason of a mod's refusal: an error reply the server records as rejected, not an
    exception (Flower and Ray would log a traceback, the server see only their wrapper)."""
    assert reply.has_error() and reply.error.code == keys.SITE_REFUSED_CODE, reply
    assert reply.error.reason.startswith(keys.SITE_REFUSED_PREFIX)
    return reply.error.reason


def test_the_users_own_compute_seconds_are_kept() -> None:
    def timed(msg: Message) -> Message:
        metrics = MetricRecord({keys.NUM_EXAMPLES: 5, keys.COMPUTE_SECONDS: 123.0})
        return Message(
            RecordDict({keys.ARRAYS: msg.content[keys.ARRAYS], keys.METRICS: metrics}), reply_to=msg
        )

    reply = flplatform_mod()(
        train_message(odd_model(), **CASES["local-sgd"][1]), context(1), UserTrain(reply=timed)
    )
    assert reply.content[keys.METRICS][keys.COMPUTE_SECONDS] == 123.0


@pytest.mark.parametrize(
    "mod",
    [
        flplatform_mod(),
        delayed_mod(),
        fetchsgd_mod(),
        codec_mod("int8"),
        sketched_sgd_mod(),
        model_mod(),
    ],
)
def test_other_messages_pass_through_untouched(mod: Mod) -> None:
    seen: list[Message] = []

    def user(msg: Message, ctx: Context) -> Message:
        seen.append(msg)
        return Message(RecordDict({keys.METRICS: MetricRecord({"x": 1})}), reply_to=msg)

    for message_type in (MessageType.EVALUATE, MessageType.QUERY):
        msg = train_message(odd_model())
        msg.metadata.message_type = message_type
        assert mod(msg, context(1), user).content[keys.METRICS]["x"] == 1
        assert seen[-1] is msg
    # A training message of another algorithm reaches the user's function as it came.
    msg = train_message(odd_model(), **{keys.SITE_ALGORITHM: "another"})
    mod(msg, context(1), user)
    assert seen[-1] is msg


def test_the_values_round_never_calls_the_users_function() -> None:
    mod, config = CASES["sketched-sgd"]
    state, user = context(1), UserTrain()
    mod(train_message(odd_model(), **config), state, user)
    values_request = train_message(
        {CANDIDATES: np.array([0, 5, 12], np.int32)},
        **{
            keys.SITE_ALGORITHM: keys.SKETCHED_SGD,
            keys.STEP_PHASE: StepPhase.VALUES,
            keys.SKETCHED_ROUND: 1,
            keys.SERVER_ROUND: 2,
        },
    )
    reply = mod(values_request, state, user)
    assert len(user.received) == 1  # the sketch round only
    values = record_to_arrays(reply.content[keys.ARRAYS])[VALUES]
    assert values.shape == (3,) and values.dtype == np.float32
    # v = the first update: floats moved by 0.125 (coordinate 12 is in a.bias, float16)
    np.testing.assert_allclose(values, [0.125, 0.125, 0.125])
    assert reply.content[keys.METRICS][keys.NUM_EXAMPLES] == 20


def test_a_sketched_step_is_named_by_its_version_for_the_users_data_order() -> None:
    mod, config = CASES["sketched-sgd"]
    user = UserTrain()
    mod(
        train_message(odd_model(), **{**config, keys.SERVER_ROUND: 5, keys.MODEL_VERSION: 2}),
        context(1),
        user,
    )
    assert user.configs[0][keys.SERVER_ROUND] == 3  # step 3 = version 2 + 1


# ================================================================ composition
def test_dts_recipe_composes_in_either_order_and_compresses() -> None:
    """delayed_mod + codec_mod: A_{n,r} compressed with error feedback, whatever the order."""
    model = odd_model()
    config = {**CASES["delayed"][1], keys.CODEC: "topk:3"}
    replies = []
    for mods in ([delayed_mod(), codec_mod("topk:3")], [codec_mod("topk:3"), delayed_mod()]):
        state = context(1)

        def chain(msg: Message, ctx: Context, mods: list[Mod] = mods) -> Message:
            outer, inner = mods
            return outer(msg, ctx, lambda m, c: inner(m, c, UserTrain()))

        replies.append(chain(train_message(model, **config), state))
    for reply in replies:
        assert reply.content[keys.CONFIG][keys.CODEC] == "topk:3"
        assert reply.content[keys.METRICS][keys.PERIOD] == 1
    first, second = (record_to_arrays(r.content[keys.ARRAYS]) for r in replies)
    assert first.keys() == second.keys()
    for name in first:
        np.testing.assert_array_equal(first[name], second[name])


# ============================================================ bit for bit
def _user_style_train(msg: Message, ctx: Context) -> Message:
    """A user's train function for the built-in task, written against clients/ directly."""
    from clients.client_app import train

    return train(msg, ctx)


def _run(strategy: Any, mod: Mod, rounds: int, **run_config: Any) -> tuple[dict, list]:
    contexts = {n: context(n) for n in range(1, 4)}
    builtin = {n: digits_site(n - 1, 3, contexts[n], **run_config) for n in range(1, 4)}

    def site(n: int) -> Callable[[Message], Message]:
        def behave(msg: Message) -> Message:
            if msg.metadata.message_type != MessageType.TRAIN:
                return builtin[n](msg)
            return mod(msg, contexts[n], _user_style_train)

        return behave

    grid = ScriptedGrid({n: site(n) for n in range(1, 4)})
    summaries: list[RoundSummary] = []
    policy = PeriodSync() if isinstance(strategy, DelayedCompensated) else Synchrony("sync")
    engine = RoundEngine(
        grid,
        strategy,
        policy=policy,
        poll_interval=0.0,
        required_sites=3,
        on_round=summaries.append,
    )
    from clients.site import load_site

    initial = load_site({keys.PARTITION_ID: 0, keys.NUM_PARTITIONS: 3}, {"dataset": "digits"})
    model = ArrayRecord(initial.build_model(num_classes=10, seed=0).state_dict())
    result = engine.run(
        model, num_rounds=rounds, train_config=ConfigRecord({keys.LOCAL_STEPS: 3, keys.LR: 0.1})
    )
    return record_to_arrays(result.arrays), summaries


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_the_builtin_app_and_a_mod_wrapped_train_function_agree_bit_for_bit(algorithm: str) -> None:
    make, mod = ALGORITHMS[algorithm]
    builtin, builtin_rounds = _run(make(), flplatform_mod(), 4)
    wrapped, wrapped_rounds = _run(make(), mod, 4)
    assert all(u.status == APPLIED for s in wrapped_rounds for u in s.updates)
    assert [s.bytes_up for s in builtin_rounds] == [s.bytes_up for s in wrapped_rounds]
    assert list(builtin) == list(wrapped)
    for name in builtin:
        np.testing.assert_array_equal(builtin[name], wrapped[name], err_msg=name)


def test_dts_recipe_matches_the_servers_codec_bit_for_bit_and_sends_fewer_bytes() -> None:
    def dts(msg: Message, ctx: Context, call_next: Any) -> Message:
        return delayed_mod()(msg, ctx, lambda m, c: codec_mod("topk:0.05")(m, c, call_next))

    compressed, compressed_rounds = _run(
        DelayedCompensated(delay=1, num_rounds=4, codec="topk:0.05"), dts, 4
    )
    followed, _ = _run(
        DelayedCompensated(delay=1, num_rounds=4, codec="topk:0.05"), flplatform_mod(), 4
    )
    _, dense_rounds = _run(DelayedCompensated(delay=1, num_rounds=4), delayed_mod(), 4)
    for name in compressed:
        np.testing.assert_array_equal(compressed[name], followed[name])
    assert all(u.status == APPLIED for s in compressed_rounds for u in s.updates)
    up = sum(s.bytes_up for s in compressed_rounds)
    assert up < 0.2 * sum(s.bytes_up for s in dense_rounds)


# ============================================================== state loss
def test_fetchsgd_resyncs_a_site_that_lost_its_model() -> None:
    contexts = {n: context(n) for n in range(1, 4)}
    sites = {n: digits_site(n - 1, 3, contexts[n]) for n in range(1, 4)}
    sites[2] = restart_before_round(3, contexts, 2, sites[2])
    grid = ScriptedGrid(sites)
    summaries: list[RoundSummary] = []
    strategy = FetchSGD(k=300, sketch_cols=2000, seed=1)
    engine = RoundEngine(
        grid, strategy, poll_interval=0.0, required_sites=3, on_round=summaries.append
    )
    engine.run(digits_model(), num_rounds=4, train_config=ConfigRecord({keys.LOCAL_STEPS: 2}))
    lost = [u for u in summaries[2].updates if u.status == REJECTED]
    assert len(lost) == 1 and "lost its state" in (lost[0].reason or "")
    assert "whole model next time" in (lost[0].reason or "")
    round4 = [
        m
        for m in grid.pushed
        if m.content.config_records.get(keys.CONFIG, ConfigRecord()).get(keys.SERVER_ROUND) == 4
        and m.metadata.dst_node_id == 2
    ]
    assert round4[0].content[keys.CONFIG][keys.SYNC_FROM] == DENSE
    assert all(u.status == APPLIED for u in summaries[3].updates)


def test_sketched_sgd_restarts_the_accumulators_of_a_site_that_lost_them() -> None:
    contexts = {n: context(n) for n in range(1, 4)}
    sites = {n: digits_site(n - 1, 3, contexts[n]) for n in range(1, 4)}
    # Round 3 is a sketch round with a sparse sync: the site cannot even rebuild x.
    sites[1] = restart_before_round(3, contexts, 1, sites[1])
    grid = ScriptedGrid(sites)
    summaries: list[RoundSummary] = []
    strategy = SketchedSGD(k=300, sketch_cols=2000, seed=1)
    engine = RoundEngine(
        grid, strategy, poll_interval=0.0, required_sites=3, on_round=summaries.append
    )
    engine.run(digits_model(), num_rounds=6, train_config=ConfigRecord({keys.LOCAL_STEPS: 2}))
    (lost,) = [u for u in summaries[2].updates if u.status == REJECTED]
    assert "lost its state" in (lost.reason or "") and "u = v = 0" in (lost.reason or "")
    # Round 5: the whole model, state expected no longer; the site sketches again.
    assert all(u.status == APPLIED for s in summaries[3:] for u in s.updates)
    assert 1 not in strategy.state.pending_zero or strategy.state.pending_zero[1] > 1


def test_delayed_drops_the_unsettled_periods_of_a_site_that_lost_them() -> None:
    target = np.array([1.0, -2.0, 3.0])
    sites = {n: QuadraticSite(f"q{n}", target * n) for n in range(1, 4)}
    for n, site in sites.items():
        site.state = context(n)

    def behave(n: int) -> Callable[[Message], Message]:
        def call(msg: Message) -> Message:
            config = msg.content.config_records.get(keys.CONFIG, ConfigRecord())
            if (
                n == 2
                and msg.metadata.message_type == MessageType.TRAIN
                and config.get(keys.SERVER_ROUND) == 4
            ):
                sites[n].state.state = RecordDict()
                assert config[keys.STATE_EXPECTED] is True
            return sites[n](msg)

        return call

    grid = ScriptedGrid({n: behave(n) for n in sites})
    summaries: list[RoundSummary] = []
    strategy = DelayedCompensated(delay=2, num_rounds=6)
    engine = RoundEngine(
        grid,
        strategy,
        policy=PeriodSync(),
        poll_interval=0.0,
        required_sites=3,
        on_round=summaries.append,
    )
    engine.run(
        arrays_to_record({"w": np.zeros(3)}),
        num_rounds=6,
        train_config=ConfigRecord({keys.LOCAL_STEPS: 2}),
    )
    notes = [u.reason for s in summaries for u in s.updates if u.reason]
    assert any("lost its state" in n and "unsettled periods were dropped" in n for n in notes)
    assert all(u.status == APPLIED for s in summaries for u in s.updates)
    # The restarted site trained period 4 from the global model it was sent, alone.
    (sent,) = [
        m
        for m in grid.pushed
        if m.metadata.dst_node_id == 2
        and m.content.config_records.get(keys.CONFIG, ConfigRecord()).get(keys.SERVER_ROUND) == 4
    ]
    np.testing.assert_array_equal(sites[2].starts[4], sent.content[keys.ARRAYS]["w"].numpy())


def test_a_codec_site_that_lost_its_residual_says_so_and_is_recorded() -> None:
    contexts = {n: context(n) for n in range(1, 4)}
    sites = {n: digits_site(n - 1, 3, contexts[n]) for n in range(1, 4)}
    sites[3] = restart_before_round(3, contexts, 3, sites[3])
    grid = ScriptedGrid(sites)
    summaries: list[RoundSummary] = []
    strategy = LocalSGDAveraging(seed=1, codec="topk:0.05")
    engine = RoundEngine(
        grid, strategy, poll_interval=0.0, required_sites=3, on_round=summaries.append
    )
    engine.run(digits_model(), num_rounds=3, train_config=ConfigRecord({keys.LOCAL_STEPS: 2}))
    assert all(u.status == APPLIED for s in summaries for u in s.updates)
    notes = [u.reason for u in summaries[2].updates if u.reason]
    assert notes == [
        "site lost its state (a restarted SuperNode?): "
        "its error-feedback residual restarted at zero"
    ]


# ============================================================ review cases
def test_compute_seconds_are_measured_around_the_users_call() -> None:
    import time

    def slow(msg: Message) -> Message:
        time.sleep(0.05)
        metrics = MetricRecord({keys.NUM_EXAMPLES: 5})
        content = RecordDict({keys.ARRAYS: msg.content[keys.ARRAYS], keys.METRICS: metrics})
        return Message(content, reply_to=msg)

    mod, config = CASES["delayed"]
    reply = mod(train_message(odd_model(), **config), context(1), UserTrain(reply=slow))
    assert reply.content[keys.METRICS][keys.COMPUTE_SECONDS] >= 0.05


def test_the_users_other_records_reach_the_server() -> None:
    def chatty(msg: Message) -> Message:
        content = RecordDict(
            {
                keys.ARRAYS: msg.content[keys.ARRAYS],
                keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: 5}),
                "diagnostics": MetricRecord({"grad-norm": 2.5}),
            }
        )
        return Message(content, reply_to=msg)

    for case in ("local-sgd", "int8", "delayed", "fetchsgd"):
        mod, config = CASES[case]
        reply = mod(train_message(odd_model(), **config), context(1), UserTrain(reply=chatty))
        assert reply.content["diagnostics"]["grad-norm"] == 2.5, case


def test_a_plain_flower_message_without_arrays_passes_through() -> None:
    seen: list[Message] = []

    def user(msg: Message, ctx: Context) -> Message:
        seen.append(msg)
        return Message(RecordDict({keys.METRICS: MetricRecord({"x": 1})}), reply_to=msg)

    msg = Message(
        RecordDict({keys.CONFIG: ConfigRecord({"codec": "gzip, whatever it means here"})}),
        dst_node_id=1,
        message_type=MessageType.TRAIN,
    )
    flplatform_mod()(msg, context(1), user)
    assert seen == [msg]


def test_a_site_codec_differing_from_the_servers_is_sent_in_either_mod_order() -> None:
    """The server asks int8, the site's codec_mod says top-k: top-k goes up in both orders."""
    config = {**CASES["delayed"][1], keys.CODEC: "int8"}
    for outer, inner in (
        (delayed_mod(), codec_mod("topk:3")),
        (codec_mod("topk:3"), delayed_mod()),
    ):
        reply = outer(
            train_message(odd_model(), **config),
            context(1),
            lambda m, c, inner=inner: inner(m, c, UserTrain()),
        )
        assert reply.content[keys.CONFIG][keys.CODEC] == "topk:3"


def test_a_reoffered_period_that_never_reached_the_site_expects_no_state() -> None:
    """A drafted message that was never answered leaves nothing at the site to lose."""
    strategy = DelayedCompensated(delay=1, num_rounds=3)
    base = arrays_to_record({"w": np.zeros(3)})
    strategy.begin_aggregation(1, base)

    class Grid:
        def get_node_ids(self) -> list[int]:
            return [5]

    (first,) = strategy.configure_train(1, base, ConfigRecord(), Grid())  # type: ignore[arg-type]
    assert first.content[keys.CONFIG][keys.STATE_EXPECTED] is False
    # No reply came; the period is offered again: still nothing expected, nothing lost.
    (again,) = strategy.configure_train(1, base, ConfigRecord(), Grid())  # type: ignore[arg-type]
    assert again.content[keys.CONFIG][keys.STATE_EXPECTED] is False
    site = QuadraticSite("q", np.ones(3))
    site.state = context(5)
    reply = site(again)
    assert keys.STATE_LOST not in reply.content[keys.METRICS]
    strategy.accumulate(reply, base=base)
    (next_period,) = strategy.configure_train(1, base, ConfigRecord(), Grid())  # type: ignore[arg-type]
    assert next_period.content[keys.CONFIG][keys.STATE_EXPECTED] is True


def test_sketched_sgd_with_an_integer_momentum_trains() -> None:
    """``SketchedSGD(momentum=0)`` passes the server's check; the sites got the integer 0
    and refused every sketch round of the run ("must be in [0, 1)")."""
    strategy = SketchedSGD(k=4, sketch_rows=3, sketch_cols=64, momentum=0)
    (request,) = [
        m
        for m in strategy.configure_train(
            1, arrays_to_record(odd_model()), ConfigRecord(), ScriptedGrid([1])
        )
    ]
    sent = request.content[keys.CONFIG][keys.STEP_MOMENTUM]
    assert sent == 0.0 and isinstance(sent, float)
    mod, config = CASES["sketched-sgd"]
    for momentum in (0, 0.0):  # what an older server sent, and what it sends now
        message = train_message(odd_model(), **{**config, keys.STEP_MOMENTUM: momentum})
        reply = mod(message, context(1), UserTrain())
        assert not reply.has_error(), reply.error


def test_a_late_fetchsgd_sync_older_than_the_sites_model_is_not_applied() -> None:
    """Changes from version 0 to 1 applied to the site's version 2 gave a model that is
    neither (coordinate 0 back to version 1's, coordinate 1 still version 2's), and the site
    then said it held version 1; it now asks for the whole model, as the delayed mod does."""
    mod, config = CASES["fetchsgd"]
    state, user = context(1), UserTrain()
    start = {"w": np.zeros(6, np.float32)}
    mod(train_message(start, **config), state, user)  # version 0, whole

    def sync(version: int, indices: list[int], values: list[float]) -> Message:
        changes = {
            SYNC_INDICES: np.array(indices, np.int64),
            SYNC_VALUES: np.array(values, np.float32),
        }
        return train_message(changes, **{**config, keys.MODEL_VERSION: version, keys.SYNC_FROM: 0})

    assert not mod(sync(2, [0, 1], [5.0, 2.0]), state, user).has_error()
    late = mod(sync(1, [0], [1.0]), state, user)
    assert late.content[keys.METRICS][keys.STATE_LOST] == 1
    assert len(user.received) == 2  # the user never trained on the mixed model
    np.testing.assert_array_equal(user.received[-1]["w"], [5, 2, 0, 0, 0, 0])


@pytest.mark.parametrize("case", ["fetchsgd", "sketched-sgd"])
@pytest.mark.parametrize(
    "rows,cols", [(4, 64), (3, 2**30), (10**12, 64)], ids=["even-rows", "huge-cols", "huge-rows"]
)
def test_a_malformed_sketch_is_refused_before_the_users_training(
    case: str, rows: int, cols: int
) -> None:
    """A server's sketch size is checked before the user trains (the training was wasted,
    then the message failed), and 10^12 rows are refused at once (their hashes were drawn
    one by one: the site hung)."""
    mod, config = CASES[case]
    user = UserTrain()
    sized = {**config, keys.SKETCH_ROWS: rows, keys.SKETCH_COLS: cols}
    with pytest.raises(ConfigError, match="count sketch"):
        mod(train_message(odd_model(), **sized), context(1), user)
    assert user.received == []
