"""The red-team mod (clients/attacks.py): each attack rewrites what it says, only at the
chosen site and only from the chosen round. Real Flower messages and contexts; the real
simulations, one per attack, are tests/integration/test_hostile.py."""

from __future__ import annotations

import multiprocessing
import signal
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

from clients.attacks import (
    CLAIMED_EXAMPLES,
    HUGE_VALUE,
    AttackPlan,
    alie_update,
    alie_z,
    attack_mod,
    filled,
    ipm_update,
    scaled_model,
    scaled_upload,
    site_labels,
)
from flplatform.core import keys
from flplatform.core.arrays import arrays_to_record, record_to_arrays
from flplatform.core.errors import ConfigError
from strategies.codecs import make_codec
from strategies.layout import Layout
from strategies.mods import flplatform_mod
from strategies.sparse_sync import DENSE

pytestmark = pytest.mark.usefixtures("task_identity")

FLOAT32_MAX = float(np.finfo(np.float32).max)


def model() -> dict[str, np.ndarray]:
    return {
        "w": np.array([[0.5, -1.0], [2.0, 0.25]], dtype=np.float32),
        "b": np.array([1.0, -2.0], dtype=np.float16),
        "count": np.array(7, dtype=np.int64),
    }


def context(partition: int = 2, **node: Any) -> Context:
    return Context(
        run_id=1,
        node_id=partition + 1,
        node_config={keys.PARTITION_ID: partition, keys.NUM_PARTITIONS: 3, **node},
        state=RecordDict(),
        run_config={"sites": "london,ohio,california"},
    )


def train_message(server_round: int, arrays: dict[str, np.ndarray] | None = None) -> Message:
    config: dict[str, Any] = {keys.SERVER_ROUND: server_round, keys.SITE_ALGORITHM: keys.LOCAL_SGD}
    content = RecordDict(
        {keys.ARRAYS: arrays_to_record(arrays or model()), keys.CONFIG: ConfigRecord(config)}
    )
    return Message(content, dst_node_id=1, message_type=MessageType.TRAIN)


class Trainer:
    """A user's train function: every float + 0.125 times the round (times partition + 1
    with ``by_partition``); it counts its calls and keeps the contexts and configs seen."""

    def __init__(self, *, by_partition: bool = False) -> None:
        self.calls = 0
        self.by_partition = by_partition
        self.seen: list[tuple[Context, dict[str, Any]]] = []

    def __call__(self, msg: Message, ctx: Context) -> Message:
        self.calls += 1
        config = msg.content.config_records[keys.CONFIG]
        self.seen.append((ctx, dict(config)))
        server_round = config[keys.SERVER_ROUND]
        assert isinstance(server_round, int)
        step = 0.125 * server_round
        if self.by_partition:
            step *= int(ctx.node_config[keys.PARTITION_ID]) + 1  # type: ignore[call-overload]
        arrays = record_to_arrays(msg.content.array_records[keys.ARRAYS])
        trained = {
            k: (v + step).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in arrays.items()
        }
        metrics = MetricRecord({keys.NUM_EXAMPLES: 40, keys.TRAIN_LOSS: 0.5})
        content = RecordDict({keys.ARRAYS: arrays_to_record(trained), keys.METRICS: metrics})
        return Message(content, reply_to=msg)


def call(plan: AttackPlan, server_round: int, ctx: Context, user: Trainer) -> Message:
    """The mod chain a hostile site runs: the attack outside the algorithm's mod."""
    inner = flplatform_mod()
    return attack_mod(plan)(train_message(server_round), ctx, lambda m, c: inner(m, c, user))


def sent(reply: Message) -> dict[str, np.ndarray]:
    return record_to_arrays(reply.content.array_records[keys.ARRAYS])


# ------------------------------------------------------------------ the maths
def test_filled_stays_finite_in_every_float_dtype_and_leaves_integers() -> None:
    out = filled(model(), HUGE_VALUE)
    assert np.all(out["w"] == np.float32(1e30))
    assert np.all(out["b"] == np.finfo(np.float16).max)  # 1e30 would be inf in float16
    assert out["count"] == 7
    assert all(np.isfinite(v).all() for v in out.values())


@pytest.mark.parametrize("factor", [-1.0, 5.0, -10.0])
def test_a_scaled_model_scales_the_update_around_the_model_sent(factor: float) -> None:
    base = model()
    trained = {**base, "w": base["w"] + np.float32(0.5), "b": (base["b"] - 1).astype(np.float16)}
    scaled = scaled_model(base, trained, factor)
    for name in ("w", "b"):
        expected = base[name].astype(np.float64) + factor * (
            trained[name].astype(np.float64) - base[name].astype(np.float64)
        )
        np.testing.assert_array_equal(scaled[name], expected.astype(base[name].dtype))
        assert scaled[name].dtype == base[name].dtype
    assert scaled["count"] == trained["count"]
    flipped = scaled_model(base, trained, -1.0)  # the sign flip: same norm, negated
    np.testing.assert_array_equal(flipped["w"] - base["w"], -(trained["w"] - base["w"]))
    with pytest.raises(ConfigError, match="whole model"):
        scaled_model({"other": base["w"]}, trained, -1.0)


@pytest.mark.parametrize("factor", [-1.0, 5.0, -10.0])
@pytest.mark.parametrize("spec", ["topk:3", "int8", "int4", "none"])
def test_a_scaled_codec_upload_decodes_to_the_scaled_update(spec: str, factor: float) -> None:
    """The oracle is the server's own decoder: decode(scaled wire) = factor·decode(wire).
    ("ln.scale": a model array whose int8 levels are named like a scale.)"""
    update = {
        "w": np.array([[0.5, -1.0], [2.0, 0.25]], dtype=np.float32),
        "b": np.array([0.75, -0.125], dtype=np.float32),
        "ln.scale": np.array([0.5, -1.0, 0.3125], dtype=np.float32),
    }
    codec, layout = make_codec(spec), Layout.of(update)
    wire = codec.encode(update, rng=np.random.default_rng(0))
    plain = codec.decode(wire, layout)
    scaled = codec.decode(scaled_upload(wire, factor), layout)
    for name in update:
        np.testing.assert_allclose(scaled[name], factor * plain[name], rtol=1e-6)


def test_alie_z_is_the_papers_z_max() -> None:
    # Hand-computed: s = ⌊n/2 + 1⌋ − f, z = Φ⁻¹((n − s)/n).
    assert alie_z(4, 1) == 0.0  # s = 2: Φ⁻¹(0.5)
    assert alie_z(10, 2) == pytest.approx(0.2533471, abs=1e-6)  # s = 4: Φ⁻¹(0.6)
    assert alie_z(50, 12) == pytest.approx(0.5828415, abs=1e-6)  # s = 14: Φ⁻¹(0.72)
    assert alie_z(3, 2) == 0.0  # s = 0: Φ⁻¹(1) is not a shift


def test_alie_and_ipm_golden() -> None:
    honest = [
        {"w": np.array([1.0, 10.0])},
        {"w": np.array([2.0, 10.0])},
        {"w": np.array([3.0, 13.0])},
    ]
    # μ = (2, 11); σ (Bessel) = (1, √3)
    np.testing.assert_allclose(alie_update(honest, 1.0)["w"], [1.0, 11 - 3**0.5])
    np.testing.assert_allclose(alie_update(honest[:1], 1.0)["w"], [1.0, 10.0])  # σ = 0
    np.testing.assert_allclose(ipm_update(honest, 0.1)["w"], [-0.2, -1.1])


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=3, max_size=3),
        min_size=1,
        max_size=6,
    ),
    st.floats(0, 3),
)
def test_alie_and_ipm_match_a_coordinate_by_coordinate_reference(
    rows: list[list[float]], z: float
) -> None:
    honest = [{"w": np.array(row)} for row in rows]
    for i in range(3):
        column = [row[i] for row in rows]
        mean = statistics.fmean(column)
        spread = statistics.stdev(column) if len(column) > 1 else 0.0
        assert alie_update(honest, z)["w"][i] == pytest.approx(mean - z * spread, abs=1e-6)
        assert ipm_update(honest, z)["w"][i] == pytest.approx(-z * mean, abs=1e-9)


# ------------------------------------------------------------------ choosing the site
def test_a_site_is_named_by_partition_run_config_name_or_node_name() -> None:
    assert site_labels(context(2)) == {"2", "california"}
    assert "lab-a" in site_labels(context(0, **{keys.SITE_NAME: "lab-a"}))
    plan = AttackPlan("huge", site="california", start_round=2)
    assert plan.chooses(context(2)) and not plan.chooses(context(1))
    assert AttackPlan("huge", site="1").chooses(context(1))
    counted = Context(
        run_id=1,
        node_id=4,
        node_config={keys.PARTITION_ID: 3},
        state=RecordDict(),
        run_config={"sites": 6},
    )  # a count names the default sites, as the server does
    assert site_labels(counted) == {"3", "tokyo"}
    # A sweep member naming its sites otherwise: its names, which its messages carry.
    renamed = {"sites": "paris,rome,oslo"}
    assert site_labels(context(2), renamed) == {"2", "oslo"}
    msg = train_message(2)
    msg.content[keys.RUN_CONFIG] = ConfigRecord({**renamed, "attack.kind": "silent"})
    ctx = context(2)
    ctx.run_config.update({"attack.kind": "huge", "attack.site": "oslo"})
    assert attack_mod()(msg, ctx, lambda m, c: Trainer()(m, c)).has_error()  # oslo: silent


def test_several_sites_attack_together() -> None:
    plan = AttackPlan("alie", site="ohio, california", start_round=1)
    assert plan.sites == {"ohio", "california"}
    assert plan.chooses(context(1)) and plan.chooses(context(2)) and not plan.chooses(context(0))


def test_a_plan_is_checked_and_read_from_the_run_config() -> None:
    with pytest.raises(ConfigError, match="unknown attack kind 'melt'; allowed: huge"):
        AttackPlan("melt", site="0")
    with pytest.raises(ConfigError, match="attack round must be an integer >= 1"):
        AttackPlan("huge", site="0", start_round=0)
    with pytest.raises(ConfigError, match="attack site"):
        AttackPlan("huge")
    with pytest.raises(ConfigError, match="attack scale must be a number >= 0"):
        AttackPlan("scaled", site="0", scale=-2.0)
    config = {"attack.kind": "Sign-Flip", "attack.site": "ohio", "attack.round": 3}
    assert AttackPlan.from_run_config(config) == AttackPlan("sign-flip", "ohio", 3)
    scaled = AttackPlan.from_run_config({**config, "attack.scale": 10})
    assert scaled.scale == 10.0 and scaled.factor(4, 1) == 10.0
    with pytest.raises(ConfigError, match="attack.scale must be a number"):
        AttackPlan.from_run_config({**config, "attack.scale": True})
    assert AttackPlan.from_run_config({}) == AttackPlan()  # honest
    # 0: each kind's default
    assert AttackPlan("scaled", site="0").factor(4, 1) == 5.0
    assert AttackPlan("sign-flip", site="0").factor(4, 1) == 1.0
    assert AttackPlan("ipm", site="0").factor(4, 1) == 0.1
    assert AttackPlan("alie", site="0").factor(10, 2) == alie_z(10, 2)


# ------------------------------------------------------------------ the mod
def test_other_sites_and_earlier_rounds_are_honest() -> None:
    plan = AttackPlan("huge", site="california", start_round=2)
    honest = call(plan, 2, context(1), Trainer())  # ohio
    early = call(plan, 1, context(2), Trainer())  # california before its round
    np.testing.assert_array_equal(sent(honest)["w"], model()["w"] + np.float32(0.25))
    np.testing.assert_array_equal(sent(early)["w"], model()["w"] + np.float32(0.125))


@pytest.mark.parametrize(("kind", "value"), [("huge", 1e30), ("float32-max", FLOAT32_MAX)])
def test_huge_values_replace_every_float(kind: str, value: float) -> None:
    reply = call(AttackPlan(kind, site="2", start_round=2), 3, context(2), Trainer())
    arrays = sent(reply)
    assert np.all(arrays["w"] == np.float32(value))
    assert np.all(np.isfinite(arrays["b"])) and arrays["count"] == 7


def test_examples_claims_a_trillion_with_the_honest_update() -> None:
    reply = call(AttackPlan("examples", site="2", start_round=1), 1, context(2), Trainer())
    assert reply.content[keys.METRICS][keys.NUM_EXAMPLES] == CLAIMED_EXAMPLES == 10**12
    np.testing.assert_array_equal(sent(reply)["w"], model()["w"] + np.float32(0.125))


def test_sign_flip_of_a_whole_model_reply() -> None:
    reply = call(AttackPlan("sign-flip", site="2", start_round=1), 2, context(2), Trainer())
    np.testing.assert_array_equal(sent(reply)["w"], model()["w"] - np.float32(0.25))
    flip_10 = AttackPlan("sign-flip", site="2", start_round=1, scale=10)
    np.testing.assert_array_equal(
        sent(call(flip_10, 2, context(2), Trainer()))["w"], model()["w"] - np.float32(2.5)
    )
    scaled = call(AttackPlan("scaled", site="2", start_round=1), 2, context(2), Trainer())
    np.testing.assert_array_equal(sent(scaled)["w"], model()["w"] + np.float32(1.25))


def test_alie_is_computed_from_the_honest_sites_updates_of_the_round() -> None:
    # Partition p's update is 0.125·round·(p + 1); california (2) attacks in round 2, given
    # london's (0.25) and ohio's (0.5): μ = 0.375, σ = 0.25/√2, z = 1.
    def sent_as_work_four() -> Message:
        msg = train_message(2)
        msg.content[keys.CONFIG] = ConfigRecord(
            {**msg.content[keys.CONFIG], keys.SITE_WORK: 4, keys.RUN_KEY: "run-a"}
        )
        return msg

    user, ctx, inner = Trainer(by_partition=True), context(2), flplatform_mod()
    plan = AttackPlan("alie", site="california", start_round=1, scale=1.0)
    reply = attack_mod(plan)(sent_as_work_four(), ctx, lambda m, c: inner(m, c, user))
    expected = model()["w"].astype(np.float64) + 0.375 - 0.25 / 2**0.5
    np.testing.assert_allclose(sent(reply)["w"], expected.astype(np.float32))
    assert sent(reply)["count"] == 7  # integers as the attacker trained them
    assert reply.content[keys.METRICS][keys.NUM_EXAMPLES] == 40  # its own metrics
    # Its own training, then each honest site's, as that site, with the message as sent
    # (the work number orders a site's batches), in a context of its own.
    assert [c.node_config[keys.PARTITION_ID] for c, _ in user.seen] == [2, 0, 1]
    assert all(config[keys.SITE_WORK] == 4 for _, config in user.seen)
    assert all(c is not ctx and not c.state.array_records for c, _ in user.seen[1:])
    # Nothing of theirs is left: their snapshots went to a scratch directory, now gone,
    # and the attacker's own state is what an honest call of its own leaves.
    scratch = [Path(str(c.node_config[keys.STATE_DIR])) for c, _ in user.seen[1:]]
    assert scratch and not any(path.exists() for path in scratch)
    alone = context(2)
    attack_mod(AttackPlan())(sent_as_work_four(), alone, lambda m, c: inner(m, c, Trainer()))
    own = {k for k in ctx.state if not k.startswith(keys.ATTACK_STATE)}
    assert own == set(alone.state.keys())


def test_ipm_sends_minus_epsilon_times_the_honest_mean() -> None:
    user = Trainer(by_partition=True)
    plan = AttackPlan("ipm", site="2", start_round=1)  # ε = 0.1
    reply = call(plan, 2, context(2), user)
    expected = model()["w"].astype(np.float64) - 0.1 * 0.375
    np.testing.assert_allclose(sent(reply)["w"], expected.astype(np.float32))


def test_colluding_attackers_leave_out_each_other() -> None:
    # ohio and california attack: the honest sites are london alone (σ = 0: ALIE sends μ).
    user = Trainer(by_partition=True)
    plan = AttackPlan("alie", site="ohio,california", start_round=1, scale=2.0)
    reply = call(plan, 2, context(1), user)
    np.testing.assert_allclose(sent(reply)["w"], model()["w"] + np.float32(0.25))
    assert [c.node_config[keys.PARTITION_ID] for c, _ in user.seen] == [1, 0]


def test_alie_and_ipm_refuse_what_they_cannot_compute() -> None:
    deployed = Context(
        run_id=1,
        node_id=9,
        node_config={keys.SITE_NAME: "lab-a"},
        state=RecordDict(),
        run_config={},
    )
    with pytest.raises(ConfigError, match="needs a simulation"):
        call(AttackPlan("alie", site="lab-a", start_round=1), 1, deployed, Trainer())
    msg = train_message(1)
    msg.content[keys.CONFIG] = ConfigRecord({**msg.content[keys.CONFIG], keys.CODEC: "topk:2"})
    inner = flplatform_mod()
    with pytest.raises(ConfigError, match="whole model or an uncompressed delta"):
        attack_mod(AttackPlan("ipm", site="2", start_round=1))(
            msg, context(2), lambda m, c: inner(m, c, Trainer())
        )


def test_replay_resends_the_first_reply_without_training() -> None:
    ctx, user = context(2), Trainer()
    plan = AttackPlan("replay", site="2", start_round=2)
    first = call(plan, 1, ctx, user)
    later = [call(plan, r, ctx, user) for r in (2, 3)]
    assert user.calls == 1  # a replayer does not train
    for reply in later:
        for name, array in sent(first).items():
            np.testing.assert_array_equal(sent(reply)[name], array)
        assert dict(reply.content[keys.METRICS]) == dict(first.content[keys.METRICS])


def test_a_replay_in_the_next_run_of_a_sweep_replays_that_runs_first_reply() -> None:
    # The runs of a sweep share the site's context, each starting again at round 1.
    ctx, user = context(2), Trainer()
    plan = AttackPlan("replay", site="2", start_round=1)
    call(plan, 1, ctx, user)
    call(plan, 2, ctx, user)
    again = call(plan, 1, ctx, user)  # the next run: trained, not the last run's reply
    replayed = call(plan, 2, ctx, user)
    assert user.calls == 2
    np.testing.assert_array_equal(sent(again)["w"], model()["w"] + np.float32(0.125))
    np.testing.assert_array_equal(sent(replayed)["w"], sent(again)["w"])


def test_a_second_message_of_the_first_round_replays_its_first_reply() -> None:
    # Sketched-SGD's values request, or k-async's next work, in the round of the first reply.
    ctx, user = context(2), Trainer()
    plan = AttackPlan("replay", site="2", start_round=1)
    first, second = call(plan, 1, ctx, user), call(plan, 1, ctx, user)
    assert user.calls == 1
    np.testing.assert_array_equal(sent(second)["w"], sent(first)["w"])


def test_without_a_plan_each_message_names_its_runs_attack() -> None:
    # A sweep's member sends its own attack.* keys with its messages (the sites' run
    # config is the Flower run's): the mod reads them from there.
    ctx = context(2)
    ctx.run_config.update({"attack.kind": "silent", "attack.site": "california"})
    silent = attack_mod()(train_message(2), ctx, lambda m, c: Trainer()(m, c))
    assert silent.has_error()
    msg = train_message(2)
    msg.content[keys.RUN_CONFIG] = ConfigRecord({"attack.kind": "huge"})
    huge = attack_mod()(msg, ctx, lambda m, c: Trainer()(m, c))
    assert not huge.has_error()
    np.testing.assert_array_equal(sent(huge)["w"], np.float32(HUGE_VALUE))


def test_silent_replies_with_an_error_and_trains_nothing() -> None:
    user = Trainer()
    reply = call(AttackPlan("silent", site="2", start_round=2), 2, context(2), user)
    assert reply.has_error() and "silent attacker" in (reply.error.reason or "")
    assert user.calls == 0


def test_sketch_needs_a_sketch_reply() -> None:
    with pytest.raises(ConfigError, match="needs a count-sketch reply"):
        call(AttackPlan("sketch", site="2", start_round=1), 1, context(2), Trainer())


def test_sketch_and_sign_flip_of_a_fetchsgd_reply() -> None:
    config: dict[str, Any] = {
        keys.SERVER_ROUND: 1,
        keys.SITE_ALGORITHM: keys.FETCHSGD,
        keys.MODEL_VERSION: 0,
        keys.SKETCH_SEED: 3,
        keys.SKETCH_ROWS: 3,
        keys.SKETCH_COLS: 16,
        keys.SYNC_FROM: DENSE,
    }
    content = RecordDict(
        {keys.ARRAYS: arrays_to_record(model()), keys.CONFIG: ConfigRecord(config)}
    )
    inner = flplatform_mod()
    tables = {}
    for kind in ("none", "sketch", "sign-flip"):
        msg = Message(content, dst_node_id=1, message_type=MessageType.TRAIN)
        plan = AttackPlan(kind, site="2", start_round=1)
        reply = attack_mod(plan)(msg, context(2), lambda m, c: inner(m, c, Trainer()))
        tables[kind] = sent(reply)["sketch"]
    assert np.all(tables["sketch"] == np.float32(1e30))
    np.testing.assert_array_equal(tables["sign-flip"], -tables["none"])


def test_queries_and_evaluations_pass_through() -> None:
    msg = Message(RecordDict(), dst_node_id=1, message_type=MessageType.EVALUATE)
    seen: list[Message] = []

    def evaluate(m: Message, c: Context) -> Message:
        seen.append(m)
        return Message(RecordDict(), reply_to=m)

    attack_mod(AttackPlan("silent", site="2", start_round=1))(msg, context(2), evaluate)
    assert seen == [msg]


def _die_at_round_two() -> None:
    plan = AttackPlan("suicide", site="2", start_round=2)
    for server_round in (1, 2, 3):
        call(plan, server_round, context(2), Trainer())


def test_suicide_kills_its_own_process() -> None:
    """In a child process: the mod kills the process it runs in (SIGKILL, no clean-up)."""
    child = multiprocessing.get_context("fork").Process(target=_die_at_round_two)
    child.start()
    child.join(30)
    assert child.exitcode == -signal.SIGKILL
