"""The red-team mod (clients/attacks.py): each attack rewrites what it says, only at the
chosen site and only from the chosen round. Real Flower messages and contexts; the real
simulations, one per attack, are tests/integration/test_hostile.py."""

from __future__ import annotations

import multiprocessing
import signal
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict

from clients.attacks import (
    CLAIMED_EXAMPLES,
    HUGE_VALUE,
    AttackPlan,
    attack_mod,
    filled,
    negated_upload,
    sign_flipped_model,
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
    """A user's train function: every float + 0.125 times the round; it counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, msg: Message, ctx: Context) -> Message:
        self.calls += 1
        server_round = msg.content.config_records[keys.CONFIG][keys.SERVER_ROUND]
        assert isinstance(server_round, int)
        step = 0.125 * server_round
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


def test_sign_flip_keeps_the_norm_and_negates_the_update() -> None:
    base = model()
    trained = {**base, "w": base["w"] + np.float32(0.5), "b": (base["b"] - 1).astype(np.float16)}
    flipped = sign_flipped_model(base, trained)
    for name in ("w", "b"):
        np.testing.assert_array_equal(flipped[name] - base[name], -(trained[name] - base[name]))
    assert flipped["count"] == trained["count"]
    with pytest.raises(ConfigError, match="sign-flip"):
        sign_flipped_model({"other": base["w"]}, trained)


@pytest.mark.parametrize("spec", ["topk:3", "int8", "none"])
def test_a_negated_codec_upload_decodes_to_the_negated_update(spec: str) -> None:
    """The oracle is the server's own decoder: decode(negated wire) = −decode(wire)."""
    update = {
        "w": np.array([[0.5, -1.0], [2.0, 0.25]], dtype=np.float32),
        "b": np.array([0.75, -0.125], dtype=np.float32),
    }
    codec, layout = make_codec(spec), Layout.of(update)
    wire = codec.encode(update, rng=np.random.default_rng(0))
    plain, negated = codec.decode(wire, layout), codec.decode(negated_upload(wire), layout)
    for name in update:
        np.testing.assert_allclose(negated[name], -plain[name])


# ------------------------------------------------------------------ choosing the site
def test_a_site_is_named_by_partition_run_config_name_or_node_name() -> None:
    assert site_labels(context(2)) == {"2", "california"}
    assert "lab-a" in site_labels(context(0, **{keys.SITE_NAME: "lab-a"}))
    plan = AttackPlan("huge", site="california", start_round=2)
    assert plan.chooses(context(2)) and not plan.chooses(context(1))
    assert AttackPlan("huge", site="1").chooses(context(1))


def test_a_plan_is_checked_and_read_from_the_run_config() -> None:
    with pytest.raises(ConfigError, match="unknown attack kind 'melt'; allowed: huge"):
        AttackPlan("melt", site="0")
    with pytest.raises(ConfigError, match="attack round must be an integer >= 1"):
        AttackPlan("huge", site="0", start_round=0)
    with pytest.raises(ConfigError, match="attack site"):
        AttackPlan("huge")
    config = {"attack.kind": "Sign-Flip", "attack.site": "ohio", "attack.round": 3}
    assert AttackPlan.from_run_config(config) == AttackPlan("sign-flip", "ohio", 3)
    assert AttackPlan.from_run_config({}) == AttackPlan()  # honest


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
