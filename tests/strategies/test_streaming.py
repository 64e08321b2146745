"""Streaming sync (delayed updates with fragments): a naive reference of streaming DiLoCo,
the downloads that carry only what changed, a site that lost its state, and the codec's
error feedback across fragments.

Everything runs through the real engine, strategy and site mod over an in-process grid;
the Flower simulation path is in tests/integration/test_resume.py (its streaming case).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

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
from flplatform.engine import APPLIED, REJECTED, PeriodSync, RoundSummary
from flplatform.engine.clock import VirtualClock
from flplatform.engine.engine import RoundEngine
from flplatform.engine.guard import UpdateGuard
from flplatform.network import ComputeModel, Network
from strategies.codecs import make_codec
from strategies.delayed import DelayedCompensated
from strategies.fragments import split_fragments
from strategies.mods.codec import codec_state, compress_upload
from strategies.mods.delayed import delayed_mod
from tests.helpers.delayed_sites import context
from tests.helpers.idle_sites import network
from tests.helpers.scripted_grid import ScriptedGrid

pytestmark = pytest.mark.usefixtures("task_identity")

SHAPES = {"a": (6,), "b": (3, 2), "c": (4,), "d": (2,)}  # 6, 6, 4, 2 values
LR, STEPS = 0.3, 2


def x0() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {k: rng.normal(size=shape).astype(np.float32) for k, shape in SHAPES.items()}


def train(model: dict[str, np.ndarray], target: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """STEPS exact gradient steps on ½‖x − target‖², in float64."""
    w = {k: np.asarray(v, np.float64) for k, v in model.items()}
    for _ in range(STEPS):
        w = {k: w[k] - LR * (w[k] - target[k]) for k in w}
    return w


@dataclass
class QuadraticSite:
    """A multi-array quadratic site behind the real delayed mod; records what it was sent."""

    name: str
    target: dict[str, np.ndarray]
    examples: int
    state: Context
    received: list[tuple[int, list[str]]] = field(default_factory=list)  # (sync-from, arrays)
    starts: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)

    def __call__(self, msg: Message) -> Message:
        if msg.metadata.message_type == MessageType.QUERY:
            info = ConfigRecord({keys.SITE_NAME: self.name, keys.NUM_EXAMPLES: self.examples})
            return Message(RecordDict({keys.SITE_INFO: info}), reply_to=msg)
        config = msg.content[keys.CONFIG]
        self.received.append(
            (int(config.get(keys.SYNC_FROM, -1)), list(msg.content[keys.ARRAYS].keys()))
        )
        return delayed_mod()(msg, self.state, self.train)

    def train(self, msg: Message, state: Context) -> Message:
        period = int(msg.content[keys.CONFIG][keys.SERVER_ROUND])
        start = record_to_arrays(msg.content[keys.ARRAYS])
        self.starts[period] = {k: v.astype(np.float64) for k, v in start.items()}
        trained = train(start, self.target)
        arrays = ArrayRecord({k: Array(v.astype(np.float32)) for k, v in trained.items()})
        metrics = MetricRecord({keys.NUM_EXAMPLES: self.examples, keys.TRAIN_LOSS: 0.0})
        return Message(RecordDict({keys.ARRAYS: arrays, keys.METRICS: metrics}), reply_to=msg)


def sites(count: int = 3) -> dict[int, QuadraticSite]:
    rng = np.random.default_rng(11)
    return {
        n: QuadraticSite(
            f"s{n}",
            {k: rng.normal(size=shape) for k, shape in SHAPES.items()},
            examples=10 * n,
            state=context(n),
        )
        for n in range(1, count + 1)
    }


def run(
    strategy: DelayedCompensated,
    behaviours: dict[int, QuadraticSite],
    rounds: int,
    *,
    on_round=None,  # noqa: ANN001
) -> dict[str, np.ndarray]:
    engine = RoundEngine(
        ScriptedGrid(behaviours),  # type: ignore[arg-type]
        strategy,
        policy=PeriodSync(),
        poll_interval=0.0,
        required_sites=len(behaviours),
        on_round=on_round,
    )
    final = engine.run(
        arrays_to_record(x0()),
        num_rounds=rounds,
        train_config=ConfigRecord({keys.LOCAL_STEPS: STEPS}),
    )
    return record_to_arrays(final.arrays)


def streaming_diloco(
    targets: list[dict[str, np.ndarray]],
    weights: list[float],
    *,
    fragments: int,
    delay: int,
    rounds: int,
    eta: float,
    beta: float,
) -> dict[str, np.ndarray]:
    """Streaming DiLoCo written out naively (requires fragments > delay): every site keeps
    its own model; round q syncs fragment (q − 1) mod F with a Nesterov outer step; the
    outer step of round j reaches the sites at the start of period j + 1 + D, where each
    replaces its own change of that fragment up to round j by the global value and keeps
    its progress since."""
    split = split_fragments([(k, int(np.prod(s))) for k, s in SHAPES.items()], fragments)
    x = {k: v.astype(np.float64) for k, v in x0().items()}
    versions = [dict(x)]  # x after round j
    velocity: dict[str, np.ndarray] = {}
    local = [dict(x) for _ in targets]
    sent_at: list[dict[int, dict[str, np.ndarray]]] = [{} for _ in targets]
    for q in range(1, rounds + 1):
        j = q - 1 - delay
        for n, model in enumerate(local):
            if j >= 1:  # round j's outer step arrives: swap
                for k in split[(j - 1) % fragments]:
                    model[k] = versions[j][k] + (model[k] - sent_at[n][j][k])
            local[n] = train(model, targets[n])
            sent_at[n][q] = dict(local[n])
        base = versions[max(0, j)]
        names = split[(q - 1) % fragments]
        total = sum(weights)
        x = dict(x)
        for k in names:
            mean = sum(w * (m[k] - base[k]) for w, m in zip(weights, local, strict=True)) / total
            velocity[k] = mean if k not in velocity else beta * velocity[k] + mean
            x[k] = x[k] + eta * (mean + beta * velocity[k])
        versions.append(x)
    return x


@pytest.mark.parametrize(("fragments", "delay"), [(2, 0), (3, 1), (4, 1), (4, 2)])
def test_streaming_sync_is_streaming_diloco_written_out(fragments: int, delay: int) -> None:
    rounds = 9
    behaviours = sites()
    strategy = DelayedCompensated(
        delay=delay, num_rounds=rounds, eta=0.7, beta=0.9, nesterov=True, fragments=fragments
    )
    got = run(strategy, behaviours, rounds)
    want = streaming_diloco(
        [s.target for s in behaviours.values()],
        [float(s.examples) for s in behaviours.values()],
        fragments=fragments,
        delay=delay,
        rounds=rounds,
        eta=0.7,
        beta=0.9,
    )
    for k in SHAPES:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5)


def test_one_site_streaming_loses_and_doubles_nothing() -> None:
    """With one site, η = 1 and no momentum, the average is the site's own step: whatever
    fragments and delay do, its model is plain local training, period after period."""
    rounds = 10
    site = sites(1)
    strategy = DelayedCompensated(delay=1, num_rounds=rounds, fragments=3)
    run(strategy, site, rounds)
    model = {k: v.astype(np.float64) for k, v in x0().items()}
    for period in range(1, rounds + 1):
        for k in SHAPES:
            np.testing.assert_allclose(site[1].starts[period][k], model[k], atol=1e-5)
        model = train(model, site[1].target)


def test_downloads_carry_only_the_fragments_changed_since_the_sites_version() -> None:
    rounds = 8
    behaviours = sites(2)
    strategy = DelayedCompensated(delay=1, num_rounds=rounds, fragments=4)
    run(strategy, behaviours, rounds)
    split = split_fragments([(k, int(np.prod(s))) for k, s in SHAPES.items()], 4)
    assert split == (("a",), ("b",), ("c",), ("d",))
    received = behaviours[1].received
    assert received[0] == (-1, list(SHAPES))  # first contact: the whole model
    # period q is sent version q − 2; the site holds version q − 3: round q − 2's fragment
    assert received[1] == (0, [])  # period 2: version 0 again, nothing changed
    for q in range(3, rounds + 1):
        assert received[q - 1] == (q - 3, list(split[(q - 3) % 4])), q


def test_a_site_that_lost_its_model_says_so_and_is_sent_the_whole_model() -> None:
    rounds = 8
    behaviours = sites(2)
    summaries: list[RoundSummary] = []

    def forget(summary: RoundSummary) -> None:
        summaries.append(summary)
        if summary.server_round == 3:
            behaviours[2].state.state = RecordDict()  # a restarted SuperNode

    strategy = DelayedCompensated(delay=0, num_rounds=rounds, fragments=2)
    final = run(strategy, behaviours, rounds, on_round=forget)
    rows = [(s.server_round, u.site, u.status, u.reason) for s in summaries for u in s.updates]
    lost = [r for r in rows if r[1] == "s2" and r[2] == REJECTED]
    assert len(lost) == 1 and lost[0][0] == 4
    assert (
        "lost its state" in lost[0][3] and "global model of version 2" in lost[0][3]
    )  # what the changes apply to
    # then the whole model, and every later update of both sites applied
    assert behaviours[2].received[4] == (-1, list(SHAPES))
    assert all(status == APPLIED for r, _, status, _ in rows if r > 4)
    assert all(np.isfinite(v).all() for v in final.values())


def test_the_codec_residual_of_each_fragment_waits_for_its_next_upload() -> None:
    """Error feedback across fragments: uploads plus the residual equal the true updates,
    array by array, although each upload carries only some arrays."""
    codec = make_codec("int4")
    site = context(1)
    rng = np.random.default_rng(5)
    true_sum: dict[str, np.ndarray] = {k: np.zeros(s) for k, s in SHAPES.items()}
    sent_sum: dict[str, np.ndarray] = {k: np.zeros(s) for k, s in SHAPES.items()}
    split = (("a", "b"), ("c", "d"))
    for work in range(1, 7):
        names = split[(work - 1) % 2]
        update = {k: rng.normal(size=SHAPES[k]).astype(np.float32) for k in names}
        config = ConfigRecord({keys.SERVER_ROUND: work, keys.SITE_WORK: work})
        msg = Message(
            RecordDict({keys.CONFIG: config}), dst_node_id=1, message_type=MessageType.TRAIN
        )
        loaded = codec_state(msg, site)
        _, sent, lost = compress_upload(msg, site, update, codec, loaded, dense=True, partial=True)
        assert not lost and sent is not None and list(sent) == list(names)
        for k in names:
            true_sum[k] += update[k]
            sent_sum[k] += sent[k]
    residual = compress_residual(site)
    assert sorted(residual) == sorted(SHAPES)  # every fragment's residual kept
    for k in SHAPES:
        np.testing.assert_allclose(sent_sum[k] + residual[k], true_sum[k], atol=1e-5)


def compress_residual(site: Context) -> dict[str, np.ndarray]:
    from strategies.mods.contract import ModState

    state = ModState.load(site, keys.CODEC_STATE)
    assert state is not None
    return {k: np.asarray(v, np.float64) for k, v in state.groups["residual"].items()}


def test_bad_fragment_knobs_are_refused_with_what_is_allowed() -> None:
    with pytest.raises(ConfigError, match="fragments must be >= 1"):
        DelayedCompensated(delay=1, num_rounds=5, fragments=0)
    with pytest.raises(ConfigError, match="fragments > 1 needs compensation"):
        DelayedCompensated(delay=1, num_rounds=5, fragments=2, compensate=False)
    with pytest.raises(ConfigError, match="server-nesterov needs server-momentum > 0"):
        DelayedCompensated(delay=1, num_rounds=5, nesterov=True)
    strategy = DelayedCompensated(delay=1, num_rounds=5, fragments=5)
    with pytest.raises(ConfigError, match="fragments = 5, but the model has 4 arrays"):
        run(strategy, sites(1), 5)


def test_streaming_state_round_trips_and_bad_state_is_refused() -> None:
    from flplatform.core.checkpoint import CheckpointError
    from flplatform.engine import Work

    def fresh() -> DelayedCompensated:
        return DelayedCompensated(delay=1, num_rounds=6, beta=0.9, fragments=2)

    strategy = fresh()
    run(strategy, sites(2), 4)
    strategy.state.drafted[1] = Work(5, 3, delay=1, fragment=0)  # work in flight
    saved = strategy.state_dict()
    # the next period's messages are out: what each site held is noted with them
    assert saved["syncing"] and sorted(saved["velocity"]) == sorted(SHAPES)
    restored = fresh()
    restored.load_state_dict(saved)
    assert restored.state.drafted == {1: Work(5, 3, delay=1, fragment=0)}
    assert restored.state.held.sent == strategy.state.held.sent
    for k, v in strategy.state.optimizer.velocity.items():
        np.testing.assert_array_equal(restored.state.optimizer.velocity[k], v)

    # written before outer momentum and fragments: none of their fields
    old = {k: v for k, v in saved.items() if k not in ("velocity", "synced", "syncing")}
    old["drafted"] = {1: {"period": 5, "model_version": 3, "delay": 1}}
    plain = DelayedCompensated(delay=1, num_rounds=6)
    plain.load_state_dict(old)
    assert plain.state.drafted == {1: Work(5, 3, delay=1)} and plain.state.held.synced == {}

    a_b = {"a": np.zeros(6), "b": np.zeros((3, 2))}  # fragment 0 of 2: arrays a and b
    for bad, says in (
        ({**saved, "synced": {1: -1}}, r"'synced\[1\]' must be >= 0, got -1"),
        (
            {**saved, "open": {5: {"sums": {"a": np.zeros(6)}, "total_weight": 1.0, "count": 1}}},
            r"'open\[5\]' holds arrays \['a'\], but period 5 sums \['a', 'b'\]",
        ),
    ):
        with pytest.raises(CheckpointError, match=says):
            fresh().load_state_dict(bad)
    good = fresh()
    good.load_state_dict({**saved, "open": {5: {"sums": a_b, "total_weight": 1.0, "count": 1}}})
    assert sorted(good.state.open[5].sums) == ["a", "b"]


def test_a_message_not_sent_leaves_the_site_holding_what_it_held() -> None:
    rounds = 6
    behaviours = sites(2)
    strategy = DelayedCompensated(delay=0, num_rounds=rounds, fragments=2)
    run(strategy, behaviours, 3)
    held = dict(strategy.state.held.synced)
    assert held  # both sites answered: their versions are known
    grid = ScriptedGrid(behaviours)  # type: ignore[arg-type]
    [message, *_] = strategy.configure_train(
        4, strategy.state.models[strategy.state.version], ConfigRecord(), grid
    )
    node = message.metadata.dst_node_id
    assert node not in strategy.state.held.synced  # taken while the message is out
    strategy.message_not_sent(message)
    assert strategy.state.held.synced[node] == held[node]


@pytest.mark.parametrize("fragments", [1, 3])
def test_a_site_that_lost_only_its_codec_residual_keeps_its_periods(fragments: int) -> None:
    """Found by a review: the residual and the periods are saved apart, so one can be
    gone while the other is there. Said as a lost state, the server dropped the site's
    periods and the site, still holding them, sent them again: counted twice. For each
    site, what the server counted, what the site still holds unsent (its periods not yet
    counted, the carry, the residual) and the residual that was lost add up to what its
    training did."""
    from strategies.mods.contract import ModState
    from strategies.mods.delayed import periods_of

    rounds, wipe_at = 10, 6
    behaviours = sites(3)
    trained = {n: {k: np.zeros(shape) for k, shape in SHAPES.items()} for n in behaviours}
    wiped: dict[str, np.ndarray] = {}
    for n, site in behaviours.items():

        def step(msg: Message, state: Context, site: QuadraticSite = site, n: int = n) -> Message:
            period = int(msg.content[keys.CONFIG][keys.SERVER_ROUND])
            reply = QuadraticSite.train(site, msg, state)
            out = record_to_arrays(reply.content[keys.ARRAYS])
            for k in SHAPES:
                trained[n][k] += out[k].astype(np.float64) - site.starts[period][k]
            return reply

        site.train = step  # type: ignore[method-assign]

    def wiping(msg: Message) -> Message:
        config = msg.content.config_records.get(keys.CONFIG)
        if config is not None and config.get(keys.SERVER_ROUND) == wipe_at:
            state = behaviours[1].state  # the codec's snapshot alone is gone
            wiped.update(compress_residual(state))
            del state.state[keys.CODEC_STATE]
        return behaviours[1](msg)

    strategy = DelayedCompensated(delay=1, num_rounds=rounds, fragments=fragments, codec="int8")
    counted = {n: {k: np.zeros(shape) for k, shape in SHAPES.items()} for n in behaviours}
    add = strategy.add_update

    def counting(update, *, weight: float, scale: float = 1.0):  # noqa: ANN001, ANN202
        node, _, arrays = update.payload
        for k, v in arrays.items():
            counted[node][k] += np.asarray(v, np.float64) * scale
        return add(update, weight=weight, scale=scale)

    strategy.add_update = counting  # type: ignore[method-assign]
    summaries: list[RoundSummary] = []
    run(strategy, {**behaviours, 1: wiping}, rounds, on_round=summaries.append)  # type: ignore[dict-item]
    notes = [u.reason or "" for s in summaries for u in s.updates if u.site == "s1"]
    assert sum("lost its error-feedback residual" in note for note in notes) == 1
    assert not any("unsettled periods were dropped" in note for note in notes)
    for n, site in behaviours.items():
        periods = periods_of(ModState.load(site.state, keys.DELAYED_STATE))
        assert periods is not None
        included = strategy.state.periods.included.get(n, set())
        unsent = {k: np.zeros(shape) for k, shape in SHAPES.items()}
        for period, step_arrays in periods.pending.items():
            if period not in included:
                for k, v in step_arrays.items():
                    unsent[k] += v
        for k, v in (periods.carry or {}).items():
            unsent[k] += v
        residual = compress_residual(site.state)
        for k in SHAPES:
            lost = wiped.get(k, 0.0) if n == 1 else 0.0
            np.testing.assert_allclose(
                counted[n][k] + unsent[k] + residual.get(k, 0.0) + lost, trained[n][k], atol=1e-5
            )


@dataclass
class ScaledSecondSite(QuadraticSite):
    """Honest in its first update; its second multiplied by a million."""

    trained: int = 0

    def __call__(self, msg: Message) -> Message:
        reply = super().__call__(msg)
        if msg.metadata.message_type == MessageType.TRAIN:
            self.trained += 1
            if self.trained == 2:
                sent = reply.content[keys.ARRAYS]
                scaled = {k: Array(v.numpy() * np.float32(1e6)) for k, v in sent.items()}
                reply.content[keys.ARRAYS] = ArrayRecord(scaled)
        return reply


def test_a_fast_site_cannot_be_the_only_reference_of_a_fragment_it_reaches_first() -> None:
    """Each fragment's updates are judged apart (a kind of their own). A site ten times
    faster sent period 2 (fragment 1's first update) while a slow site still trained
    period 1: round 1 closed with it held and judged it against its own norm, and a
    million-fold update was applied (found by a review). The round now waits while the
    others' period-2 updates are out, and they are its reference."""
    honest = sites(5)
    first = honest[1]
    honest[1] = ScaledSecondSite(first.name, first.target, first.examples, first.state)
    profiles = list(network(5, ComputeModel("fixed", mean_seconds=1.0)).profiles)
    profiles[0] = replace(profiles[0], speed=10.0)  # s1
    profiles[4] = replace(profiles[4], speed=0.6)  # s5: round 1 still open when s1 sends
    strategy = DelayedCompensated(delay=1, num_rounds=3, fragments=2)
    seen: list[RoundSummary] = []
    RoundEngine(
        ScriptedGrid(honest),  # type: ignore[arg-type]
        strategy,
        policy=PeriodSync(),
        clock=VirtualClock(Network(name="n", profiles=tuple(profiles)), seed=2),
        guard=UpdateGuard(),
        required_sites=5,
        poll_interval=0.0,
        on_round=seen.append,
    ).run(
        arrays_to_record(x0()), num_rounds=3, train_config=ConfigRecord({keys.LOCAL_STEPS: STEPS})
    )
    sent_ahead = [u for u in seen[0].updates if (u.site, u.period) == ("s1", 2)]
    assert [(u.status, "beyond 100x" in (u.reason or "")) for u in sent_ahead] == [(REJECTED, True)]
    # its reference: the other sites' period-2 updates, judged in the same round
    assert {u.site for u in seen[0].updates if u.period == 2} > {"s1"}
    for summary in seen:
        model = strategy.state.models[summary.model_version]
        assert max(float(np.abs(v.numpy()).max()) for v in model.values()) < 10.0
