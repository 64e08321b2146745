"""Each synchrony mode's behaviour, row by row in the ledger, on the virtual clock."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)

from flplatform.core import keys
from flplatform.core.arrays import record_to_arrays
from flplatform.core.errors import ConfigError
from flplatform.engine import (
    APPLIED,
    CANCELLED,
    DROPPED,
    Contribution,
    EngineView,
    PeriodSync,
    RoundSummary,
    Synchrony,
    Update,
)
from flplatform.engine.clock import VirtualClock, WallClock
from flplatform.engine.engine import UNAVAILABLE, RoundEngine
from flplatform.engine.events import Dispatch
from flplatform.engine.guard import GuardOptions, UpdateGuard
from flplatform.engine.staleness import adasync_k, staleness_weight
from flplatform.network import ComputeModel, Network, SiteProfile
from flplatform.run.ledger import SqlLedger
from strategies.delayed import DelayedCompensated
from strategies.local_sgd import LocalSGDAveraging
from tests.helpers.delayed_sites import QuadraticSite, context
from tests.helpers.idle_sites import CountingStrategy, idle_site, network
from tests.helpers.scripted_grid import ScriptedGrid
from tests.helpers.sites import failing, site, stepping

pytestmark = pytest.mark.usefixtures("task_identity")

STEP = ConfigRecord({keys.LOCAL_STEPS: 1})


def run(
    ledger,
    mode: str,
    *,
    sites: int = 4,
    rounds: int = 6,
    compute: ComputeModel | Network | None = None,
    grid: ScriptedGrid | None = None,
    strategy=None,
    seed: int = 3,
    **options,
) -> tuple[RoundEngine, list]:
    repo, _ = ledger
    run_id = repo.create_run(name=mode, strategy="x", seed=0, config={}, num_rounds_planned=1)
    grid = grid or ScriptedGrid({n: idle_site(f"s{n}") for n in range(1, sites + 1)})
    net = compute if isinstance(compute, Network) else network(sites, compute or EXP)
    engine = RoundEngine(
        grid,
        strategy or CountingStrategy(),
        policy=Synchrony(mode, **options),
        clock=VirtualClock(net, seed=seed),
        ledger=SqlLedger(repo, run_id),
        required_sites=len(grid.behaviours),
        poll_interval=0.0,
    )
    engine.run(ArrayRecord(), num_rounds=rounds, train_config=STEP)
    return engine, repo.list_updates(run_id)


EXP = ComputeModel("exponential", mean_seconds=1.0)


# ============================================================== cancel or keep stragglers
def test_k_sync_cancels_stragglers_and_restarts_everyone_on_the_new_model(ledger) -> None:
    _, rows = run(ledger, "k-sync", k=2, rounds=5)
    for step in range(1, 6):
        this = [u for u in rows if u.round == step]
        assert Counter(u.status for u in this) == {APPLIED: 2, CANCELLED: 2}
        # Everyone worked on the step's own model: nothing stale is ever applied.
        assert {u.version_trained_on for u in this} == {step - 1}
        assert all(u.staleness == 0 for u in this if u.status == APPLIED)
        cancelled = [u for u in this if u.status == CANCELLED]
        # A cancelled site sent nothing back (in simulated time it stopped), and the
        # step closed at the second arrival, before the cancelled ones would have landed.
        assert all(u.bytes_up == 0 and u.virtual_arrived_at is None for u in cancelled)
        assert all(u.bytes_down > 0 for u in cancelled)
        applied_at = max(u.virtual_arrived_at for u in this if u.status == APPLIED)
        # Restarted at once: the next step's dispatches are at this step's close.
        nxt = [u for u in rows if u.round == step + 1]
        assert all(u.virtual_dispatched_at == pytest.approx(applied_at) for u in nxt)


def test_k_async_keeps_stragglers_and_applies_them_stale(ledger) -> None:
    engine, rows = run(ledger, "k-async", k=2, rounds=12)
    assert not [u for u in rows if u.status == CANCELLED]
    stale = [u for u in rows if u.status == APPLIED and u.staleness > 0]
    assert stale, "stragglers should arrive computed on older versions"
    for u in stale:  # staleness is measured against the version the site was sent
        assert u.round - 1 - u.version_trained_on == u.staleness
    # K different sites per step.
    for step in range(1, 13):
        applied = [u.site for u in rows if u.round == step and u.status == APPLIED]
        assert len(applied) == len(set(applied)) == 2
    assert engine.version == 12


def test_k_batch_async_counts_updates_and_a_fast_site_may_give_several(ledger) -> None:
    # One site 20× faster than the others: it supplies most updates in a step.
    profiles = network(4, EXP).profiles
    fast = SiteProfile(**{**profiles[0].__dict__, "speed": 20.0})
    net = Network(name="skewed", profiles=(fast, *profiles[1:]))
    _, rows = run(ledger, "k-batch-async", k=3, rounds=10, compute=net)
    per_step = Counter(u.round for u in rows if u.status == APPLIED)
    assert set(per_step.values()) == {3}
    by_site = Counter(u.site for u in rows if u.status == APPLIED)
    assert by_site["s1"] > sum(by_site.values()) / 2
    steps_with_repeat = [
        step
        for step in range(1, 11)
        if max(Counter(u.site for u in rows if u.round == step and u.status == APPLIED).values())
        > 1
    ]
    assert steps_with_repeat


def test_k_batch_sync_restarts_a_finished_site_on_the_same_version(ledger) -> None:
    profiles = network(3, EXP).profiles
    fast = SiteProfile(**{**profiles[0].__dict__, "speed": 50.0})
    net = Network(name="skewed", profiles=(fast, *profiles[1:]))
    _, rows = run(ledger, "k-batch-sync", k=3, rounds=4, sites=3, compute=net)
    for step in range(1, 5):
        applied = [u for u in rows if u.round == step and u.status == APPLIED]
        assert len(applied) == 3
        assert {u.version_trained_on for u in applied} == {step - 1}
    assert Counter(u.site for u in rows if u.status == APPLIED)["s1"] >= 8


def test_sync_waits_for_everyone(ledger) -> None:
    _, rows = run(ledger, "sync", rounds=3)
    for step in range(1, 4):
        this = [u for u in rows if u.round == step]
        assert Counter(u.status for u in this) == {APPLIED: 4}


# ============================================================== staleness
def test_staleness_bound_is_never_exceeded_and_the_fast_site_waits(ledger) -> None:
    profiles = network(4, EXP).profiles
    slow = SiteProfile(**{**profiles[3].__dict__, "speed": 0.05})
    net = Network(name="straggler", profiles=(*profiles[:3], slow))
    _, unbounded = run(ledger, "async", rounds=30, compute=net)
    assert max(u.staleness for u in unbounded if u.status == APPLIED) > 2
    _, rows = run(ledger, "async", rounds=30, compute=net, staleness_bound=2)
    applied = [u for u in rows if u.status == APPLIED]
    assert max(u.staleness for u in applied) <= 2
    assert any(u.site == "s4" for u in applied)  # the straggler is waited for, not dropped
    assert not [u for u in rows if u.status == DROPPED]


def test_staleness_weights_reach_the_strategy(ledger) -> None:
    strategy = CountingStrategy()
    _, rows = run(ledger, "async", rounds=20, strategy=strategy, weighting="sqrt")
    applied = [u for u in rows if u.status == APPLIED]
    weights = [w for _, w in strategy.applied]
    assert len(weights) == len(applied)
    for u, w in zip(applied, weights, strict=True):
        assert w == pytest.approx(1 / math.sqrt(1 + u.staleness))
    assert any(w < 1 for w in weights)


def test_buffered_defaults_to_fedbuff_weights_and_respects_concurrency(ledger) -> None:
    strategy = CountingStrategy()
    _, rows = run(ledger, "buffered", k=2, rounds=10, strategy=strategy, concurrency=2, sites=4)
    assert Counter(u.round for u in rows if u.status == APPLIED) == {r: 2 for r in range(1, 11)}
    # Concurrency 2: at no moment are more than two sites computing.
    spans = [(u.virtual_dispatched_at, u.virtual_arrived_at) for u in rows]
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    running = peak = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    assert peak <= 2
    assert any(w < 1 for _, w in strategy.applied)  # 1/sqrt(1 + s) by default


def test_staleness_weight_golden_values() -> None:
    assert staleness_weight("none", 5) == 1.0
    assert staleness_weight("sqrt", 3) == pytest.approx(0.5)
    assert staleness_weight("sqrt", 0) == 1.0
    # Dutta et al.: min(C / ‖x_j − x_τ‖², η_max) relative to η_max.
    assert staleness_weight("step", 2, distance_sq=lambda: 4.0, c=1.0) == pytest.approx(0.25)
    assert staleness_weight("step", 2, distance_sq=lambda: 0.5, c=1.0) == 1.0
    assert staleness_weight("step", 0, distance_sq=lambda: 1 / 0, c=1.0) == 1.0  # not called


def test_step_weighting_uses_the_distance_between_model_versions(ledger) -> None:
    # Real arrays: each site moves w to its own value, so versions differ measurably.
    grid = ScriptedGrid({n: site(f"s{n}", value=float(n)) for n in range(1, 4)})
    repo, run_id = ledger
    engine = RoundEngine(
        grid,
        LocalSGDAveraging(),
        policy=Synchrony("async", weighting="step", step_c=0.5),
        clock=VirtualClock(network(3, EXP), seed=1),
        ledger=SqlLedger(repo, run_id),
        required_sites=3,
        poll_interval=0.0,
    )
    seen: list[tuple[int, float]] = []
    judge = engine.policy.judge

    def spy(dispatch: Dispatch, view: EngineView):
        verdict = judge(dispatch, view)
        distance = view.model_distance(dispatch.model_version)
        seen.append((view.model_version - dispatch.model_version, distance))
        expected = 1.0 if distance <= 0.5 else 0.5 / distance
        assert verdict.weight_scale == pytest.approx(expected)
        return verdict

    engine.policy.judge = spy  # type: ignore[method-assign]
    engine.run(ArrayRecord({"w": Array(np.zeros(4, np.float32))}), num_rounds=8, train_config=STEP)
    assert any(s > 0 and d > 0.5 for s, d in seen)  # a stale update was discounted


def test_adasync_grows_k_as_the_loss_falls() -> None:
    assert adasync_k(2, initial_loss=2.0, loss=2.0, k_max=8) == 2
    assert adasync_k(2, initial_loss=2.0, loss=0.5, k_max=8) == 4  # 2·√4
    assert adasync_k(2, initial_loss=2.0, loss=0.001, k_max=8) == 8  # capped at P
    assert adasync_k(2, initial_loss=None, loss=0.5, k_max=8) == 2
    policy = Synchrony("k-async", k=2, adasync=True)
    policy._sites = 8
    for loss in (2.0, 1.0, 0.5, 0.9):
        policy.round_finished(loss)
    assert policy.k == 4  # grew to 2·√(2/0.5) and did not shrink when the loss rose


# ============================================================== availability
def test_unavailable_sites_sit_rounds_out_and_the_run_goes_on(ledger) -> None:
    net = network(4, EXP, availability=0.5)
    engine, rows = run(ledger, "sync", rounds=12, compute=net)
    away = [u for u in rows if u.status == DROPPED and u.reason == UNAVAILABLE]
    assert 5 < len(away) < 40
    assert all(u.bytes_down == 0 and u.bytes_up == 0 for u in away)
    # A round whose sites all sat out waits (in simulated time) for the first to return.
    assert engine.version == 12


def test_every_site_away_moves_the_clock_to_the_first_return(ledger) -> None:
    net = network(2, ComputeModel("fixed", mean_seconds=1.0), availability=0.3)
    engine, rows = run(ledger, "async", rounds=6, compute=net, sites=2)
    assert engine.version == 6
    assert [u for u in rows if u.reason == UNAVAILABLE]


# ============================================================== deferred restarts
def test_a_cancelled_site_gets_no_second_message_until_the_first_returns(ledger) -> None:
    # Replies become visible only after a few pulls: the restart must wait (the grid
    # asserts it never holds two messages for one node) yet count from the cancel time.
    grid = ScriptedGrid({n: idle_site(f"s{n}") for n in range(1, 5)}, delay_pulls=3)
    _, rows = run(ledger, "k-sync", k=1, rounds=6, grid=grid)
    assert Counter(u.status for u in rows) == {APPLIED: 6, CANCELLED: 18}
    train = [m for m in grid.pushed if m.metadata.message_type == MessageType.TRAIN]
    assert len(train) == 24


def test_k_sync_on_the_wall_clock_cancels_too(ledger) -> None:
    repo, run_id = ledger
    grid = ScriptedGrid({n: site(f"s{n}") for n in range(1, 5)}, delay_pulls=1)
    engine = RoundEngine(
        grid,
        LocalSGDAveraging(),
        policy=Synchrony("k-sync", k=2),
        clock=WallClock(),
        ledger=SqlLedger(repo, run_id),
        required_sites=4,
        poll_interval=0.0,
    )
    engine.run(ArrayRecord({"w": Array(np.zeros(4, np.float32))}), num_rounds=3, train_config=STEP)
    rows = repo.list_updates(run_id)
    for step in range(1, 4):
        assert Counter(u.status for u in rows if u.round == step and u.status == APPLIED) == {
            APPLIED: 2
        }
    assert all(u.virtual_dispatched_at is None for u in rows)
    assert engine.simulated_seconds is None


# ============================================================== settings
@pytest.mark.parametrize(
    ("mode", "options", "fragment"),
    [
        ("k-sync", {"staleness_bound": 2}, "staleness-bound applies to the async modes"),
        ("sync", {"weighting": "sqrt"}, "staleness-weighting applies"),
        ("k-batch-sync", {"concurrency": 2}, "concurrency applies"),
        ("async", {"adasync": True}, "adasync grows K"),
        ("k-async", {"k": 0}, "k must be a whole number"),
        ("k-async", {"weighting": "cubic"}, "staleness weighting 'cubic' is unknown"),
        ("eventually", {}, "sync mode 'eventually' is unknown"),
        ("async", {"step_c": 0.0}, "staleness-step-c must be > 0"),
    ],
)
def test_bad_settings_are_refused_with_what_is_allowed(mode, options, fragment) -> None:
    with pytest.raises(ConfigError, match=fragment):
        Synchrony(mode, **options)


def test_evaluation_never_goes_to_a_site_flower_still_holds_a_cancelled_message_for(
    ledger,
) -> None:
    repo, run_id = ledger

    # s1 is first on the simulated clock and answers at once; the others answer only
    # after many pulls, so their cancelled messages are still held when the round's
    # federated evaluation starts. The grid asserts a node never gets two messages.
    def slow(behave, pulls: int = 40):
        seen: Counter = Counter()

        def later(msg):
            if msg.metadata.message_type != MessageType.TRAIN:
                return behave(msg)
            seen[msg.metadata.message_id] += 1
            return behave(msg) if seen[msg.metadata.message_id] > pulls else None

        return later

    grid = ScriptedGrid({1: site("s1"), **{n: slow(site(f"s{n}")) for n in range(2, 5)}})
    profiles = network(4, ComputeModel("fixed", mean_seconds=1.0)).profiles
    fast = SiteProfile(**{**profiles[0].__dict__, "speed": 10.0})
    engine = RoundEngine(
        grid,
        LocalSGDAveraging(fraction_evaluate=1.0),
        policy=Synchrony("k-sync", k=1),
        clock=VirtualClock(Network(name="n", profiles=(fast, *profiles[1:])), seed=2),
        ledger=SqlLedger(repo, run_id),
        required_sites=4,
        poll_interval=0.0,
    )
    engine.run(
        ArrayRecord({"w": Array(np.zeros(4, np.float32))}),
        num_rounds=4,
        train_config=STEP,
        federated_evaluation=True,
    )
    rows = repo.list_updates(run_id)
    assert [u.site for u in rows if u.status == APPLIED] == ["s1"] * 4
    assert Counter(u.status for u in rows)[CANCELLED] == 12
    evaluated = repo.list_evaluations(run_id)
    assert evaluated and all(e.status == "evaluated" for e in evaluated)


# ============================================================== regressions from review
@pytest.mark.parametrize("mode", ["async", "k-batch-async", "buffered", "k-async"])
def test_staleness_bound_zero_behaves_like_sync(ledger, mode) -> None:
    # s = 0: the model may not move while any update is out, so every step waits for
    # every site and nothing stale is ever applied; the fast sites wait meanwhile.
    engine, rows = run(ledger, mode, rounds=5, k=1 if mode == "async" else 2, staleness_bound=0)
    assert engine.version == 5
    applied = [u for u in rows if u.status == APPLIED]
    assert all(u.staleness == 0 for u in applied)
    for step in range(1, 6):  # every site is in every step (a batch may hold a fast
        # site twice, while K is not yet reached)
        assert {u.site for u in applied if u.round == step} == {"s1", "s2", "s3", "s4"}


def test_ssp_makes_the_fast_sites_wait_for_the_straggler(ledger) -> None:
    profiles = network(4, ComputeModel("fixed", mean_seconds=1.0)).profiles
    slow = SiteProfile(**{**profiles[3].__dict__, "speed": 0.05})  # 20 s per update
    net = Network(name="ssp", profiles=(*profiles[:3], slow))
    _, rows = run(ledger, "async", rounds=12, compute=net, staleness_bound=2)
    applied = [u for u in rows if u.status == APPLIED]
    assert max(u.staleness for u in applied) <= 2
    # Waiting, not piling up: no step holds more than one update per site.
    for step in range(1, 13):
        sites = [u.site for u in applied if u.round == step]
        assert len(sites) == len(set(sites))


def test_a_returning_site_is_offered_work_the_moment_it_is_back(ledger) -> None:
    profiles = network(2, ComputeModel("fixed", mean_seconds=1.0), availability=0.5).profiles
    slow = SiteProfile(**{**profiles[1].__dict__, "speed": 0.1, "availability": 1.0})
    net = Network(name="away", profiles=(profiles[0], slow))
    _, rows = run(ledger, "async", rounds=8, compute=net, sites=2, seed=5)
    s1 = [u for u in rows if u.site == "s1"]
    away = [i for i, u in enumerate(s1[:-1]) if u.reason == UNAVAILABLE]
    assert away
    for i in away:  # away for one update (1 s), then offered work at once
        assert s1[i + 1].virtual_dispatched_at == pytest.approx(s1[i].virtual_dispatched_at + 1.0)


def test_k_async_with_only_one_healthy_site_still_steps(ledger) -> None:
    grid = ScriptedGrid({1: idle_site("s1"), 2: failing("s2")})
    engine, rows = run(ledger, "k-async", k=2, rounds=4, sites=2, grid=grid)
    assert engine.version == 4
    assert {u.site for u in rows if u.status == APPLIED} == {"s1"}


def test_an_erroring_site_and_an_away_site_do_not_stall_a_step(ledger) -> None:
    net = Network(
        name="n",
        profiles=(
            network(1, EXP, availability=0.5).profiles[0],
            SiteProfile(**{**network(2, EXP).profiles[1].__dict__}),
        ),
    )
    for mode in ("async", "k-async", "k-batch-async"):
        grid = ScriptedGrid({1: idle_site("s1"), 2: failing("s2")})
        engine, _ = run(ledger, mode, k=1, rounds=6, sites=2, grid=grid, compute=net)
        assert engine.version == 6, mode


def test_concurrency_lets_every_site_train(ledger) -> None:
    _, rows = run(ledger, "buffered", k=2, rounds=30, sites=6, concurrency=2)
    assert {u.site for u in rows if u.status == APPLIED} == {f"s{n}" for n in range(1, 7)}


@pytest.mark.parametrize("mode", ["k-batch-sync", "k-batch-async", "buffered"])
def test_batch_modes_count_updates_so_k_may_exceed_the_sites(ledger, mode) -> None:
    _, rows = run(ledger, mode, k=6, rounds=4, sites=4)
    assert Counter(u.round for u in rows if u.status == APPLIED) == {r: 6 for r in range(1, 5)}


def test_a_staleness_bound_of_minus_one_is_no_bound_as_the_checks_say() -> None:
    """Found by a review: -1 passed the checks ("or -1 for none") and was kept as a bound,
    so that every update, fresh ones too, was dropped as stale."""
    assert Synchrony("async", staleness_bound=-1).staleness_bound is None
    assert Synchrony("async", staleness_bound=2).staleness_bound == 2
    with pytest.raises(ConfigError, match="staleness-bound must be"):
        Synchrony("async", staleness_bound=-2)


class _NormStrategy(CountingStrategy):
    """Each reply's update is the vector (v, 0), v from its metrics."""

    def read_update(self, reply, *, base):  # noqa: ANN001, ANN201
        value = float(reply.content[keys.METRICS]["v"])
        return Update(Contribution(num_examples=1), vector=[np.array([value, 0.0])])


@pytest.mark.parametrize("mode", ["k-sync", "k-async"])
def test_an_update_the_guard_held_then_rejected_is_not_one_of_the_k_sites(mode: str) -> None:
    """Found by a review: in the first round the guard holds updates until it has three
    norms; one it then rejected still counted as one of the K sites, so the step was taken
    with K − 1 updates (and k-sync cancelled the site that would have made up K)."""
    norms = {1: 1.0, 2: 1.0, 3: 1000.0, 4: 1.0}  # the third to arrive sends an outlier

    def behave(n: int):  # noqa: ANN202
        def reply(msg: Message) -> Message:
            if msg.metadata.message_type == MessageType.QUERY:
                info = ConfigRecord({keys.SITE_NAME: f"s{n}"})
                return Message(RecordDict({keys.SITE_INFO: info}), reply_to=msg)
            metrics = MetricRecord({keys.NUM_EXAMPLES: 1, "v": norms[n]})
            return Message(RecordDict({keys.METRICS: metrics}), reply_to=msg)

        return reply

    profiles = tuple(
        SiteProfile(
            name=f"s{n}",
            rtt_seconds=0.0,
            uplink_bps=float("inf"),
            downlink_bps=float("inf"),
            compute=ComputeModel("fixed", mean_seconds=1.0),
            speed=1.0 / n,  # s1 to s4 finish at 1, 2, 3 and 4 s
        )
        for n in norms
    )
    summaries = []
    engine = RoundEngine(
        ScriptedGrid({n: behave(n) for n in norms}),
        _NormStrategy(),
        policy=Synchrony(mode, k=3),
        clock=VirtualClock(Network(name="n", profiles=profiles), seed=1),
        guard=UpdateGuard(GuardOptions(norm_ratio=3.0, reject_replays=False)),
        required_sites=4,
        poll_interval=0.0,
        on_round=summaries.append,
    )
    engine.run(ArrayRecord(), num_rounds=1, train_config=ConfigRecord({keys.LOCAL_STEPS: 1}))
    statuses = {u.site: u.status for u in summaries[0].updates}
    assert statuses == {"s1": APPLIED, "s2": APPLIED, "s3": "rejected", "s4": APPLIED}


class _ReversedGrid(ScriptedGrid):
    """The same sites; a SuperLink that hands a pull's replies back in another order (as
    Flower's, which returns them in a set's order)."""

    def pull_messages(self, message_ids):  # noqa: ANN001, ANN201
        return list(reversed(list(super().pull_messages(message_ids))))


@pytest.mark.parametrize(("mode", "options"), [("k-sync", {"k": 1}), ("async", {})])
def test_ties_on_the_clock_do_not_depend_on_the_order_replies_are_pulled(
    mode: str, options: dict
) -> None:
    """Found by a review: arrivals at the same clock time (fixed compute times, alike
    sites) were taken in the order Flower handed them back, so a seeded run could apply
    another site when run again. Ties go to the site that joined first."""

    def rounds(grid_type: type[ScriptedGrid]) -> list[list[tuple[str, str, int]]]:
        grid = grid_type({n: idle_site(f"s{n}") for n in (1, 2, 3)})
        summaries: list = []
        engine = RoundEngine(
            grid,
            CountingStrategy(),
            policy=Synchrony(mode, **options),
            clock=VirtualClock(network(3, ComputeModel("fixed", mean_seconds=1.0)), seed=3),
            required_sites=3,
            poll_interval=0.0,
            on_round=summaries.append,
        )
        engine.run(ArrayRecord(), num_rounds=3, train_config=ConfigRecord({keys.LOCAL_STEPS: 1}))
        return [[(u.site, u.status, u.staleness) for u in s.updates] for s in summaries]

    in_order = rounds(ScriptedGrid)
    assert in_order == rounds(_ReversedGrid)
    assert in_order[0][0][:2] == ("s1", APPLIED)  # the first to join


# ======================================================== the guard's first reference
@pytest.mark.parametrize(
    ("mode", "options"),
    [("async", {}), ("k-async", {"k": 1}), ("k-sync", {"k": 2}), ("k-batch-async", {"k": 1})],
)
def test_the_site_that_answers_first_cannot_set_the_first_step_alone(
    ledger, mode: str, options: dict
) -> None:
    """A hostile site that skips training answers first, with an update a million times an
    honest one. The guard has no norm reference before its first updates, so it holds
    them: they count toward K only once judged together (three of them, from three
    sites: a fast site is not offered work again while its update is held), so the first
    step is not that one update. Before, async's round 1 applied it whole."""
    repo, run_id = ledger
    grid = ScriptedGrid(
        {1: stepping("s1", 1e6), **{n: stepping(f"s{n}", 0.01 * n) for n in range(2, 6)}}
    )
    profiles = network(5, ComputeModel("fixed", mean_seconds=1.0)).profiles
    fast = SiteProfile(**{**profiles[0].__dict__, "speed": 10.0})  # answers ten times first
    engine = RoundEngine(
        grid,
        LocalSGDAveraging(),
        policy=Synchrony(mode, **options),
        clock=VirtualClock(Network(name="n", profiles=(fast, *profiles[1:])), seed=2),
        ledger=SqlLedger(repo, run_id),
        guard=UpdateGuard(),  # the platform's default (start()'s)
        required_sites=5,
        poll_interval=0.0,
    )
    engine.run(ArrayRecord({"w": Array(np.zeros(4, np.float32))}), num_rounds=3, train_config=STEP)
    first = repo.list_updates(run_id, round=1)
    # round 1 judged three sites' updates together: the attacker's once, and rejected
    assert sorted(u.site for u in first if u.status != CANCELLED) == ["s1", "s2", "s3"]
    assert [(u.status, "beyond 100x" in (u.reason or "")) for u in first if u.site == "s1"] == [
        ("rejected", True)
    ]
    assert np.abs(record_to_arrays(engine.arrays)["w"]).max() < 1.0  # never the attacker's


def steps_of_two_sites(ledger, policy: Synchrony, rounds: int) -> list[int]:
    """The updates each step applied, two stepping sites under the default guard."""
    repo, run_id = ledger
    grid = ScriptedGrid({1: stepping("s1", 0.1), 2: stepping("s2", 0.2)})
    RoundEngine(
        grid,
        LocalSGDAveraging(),
        policy=policy,
        clock=VirtualClock(network(2, ComputeModel("fixed", mean_seconds=1.0)), seed=2),
        ledger=SqlLedger(repo, run_id),
        guard=UpdateGuard(),
        required_sites=2,
        poll_interval=0.0,
    ).run(ArrayRecord({"w": Array(np.zeros(4, np.float32))}), num_rounds=rounds, train_config=STEP)
    return [r.num_applied for r in repo.list_rounds(run_id)]


@pytest.mark.parametrize(
    ("policy", "first"), [(Synchrony("k-async", k=1), 2), (Synchrony("async"), 3)]
)
def test_with_fewer_sites_than_the_reference_needs_the_first_round_still_closes(
    ledger, policy: Synchrony, first: int
) -> None:
    """Two sites: the guard's three norms never come from three sites. k-async counts
    different sites, so its round 1 closes once nothing more can come, its two updates
    judged against each other (as a sync round of two is); async (a batch mode: any K
    updates count) then offers the held sites more work, and round 1 takes three. The
    next rounds take one update each."""
    assert steps_of_two_sites(ledger, policy, 4) == [first, 1, 1, 1]


def test_a_batch_mode_with_k_beyond_its_sites_steps_on_k_updates_from_round_one(ledger) -> None:
    """The batch modes count any K updates, a site's again and again: with K = 5 and two
    sites, round 1 holds both sites' first updates for the guard and, nothing else being
    able to come, offers the held sites more work, as every later round does (it stepped on
    2 when held sites got no work at all; found by a review)."""
    assert steps_of_two_sites(ledger, Synchrony("k-batch-async", k=5), 3) == [5, 5, 5]


class ScaledSite(QuadraticSite):
    """A delayed-updates site that multiplies what it sends by a million."""

    def __call__(self, msg: Message) -> Message:
        reply = super().__call__(msg)
        if msg.metadata.message_type == MessageType.TRAIN:
            scaled = reply.content[keys.ARRAYS]["w"].numpy() * np.float32(1e6)
            reply.content[keys.ARRAYS] = ArrayRecord({"w": Array(scaled)})
        return reply


def test_delayed_updates_do_not_let_a_fast_site_make_the_first_reference_alone() -> None:
    """Delayed updates let a site work ahead: a site ten times faster sent periods 1 to 3
    before anyone's period 1, the guard held all three and judged them against the
    median of their own norms, and round 1 took its million-fold update whole (found by a
    review). A held site now waits for its update to be judged."""
    targets = np.random.default_rng(7).normal(size=(5, 5))
    sites = {
        n: (ScaledSite if n == 1 else QuadraticSite)(f"s{n}", targets[n - 1], state=context(n))
        for n in range(1, 6)
    }
    profiles = network(5, ComputeModel("fixed", mean_seconds=1.0)).profiles
    fast = SiteProfile(**{**profiles[0].__dict__, "speed": 10.0})
    strategy = DelayedCompensated(delay=2, num_rounds=3)
    seen: list[RoundSummary] = []
    RoundEngine(
        ScriptedGrid(sites),
        strategy,
        policy=PeriodSync(),
        clock=VirtualClock(Network(name="n", profiles=(fast, *profiles[1:])), seed=2),
        guard=UpdateGuard(),
        required_sites=5,
        poll_interval=0.0,
        on_round=seen.append,
    ).run(
        ArrayRecord({"w": Array(np.zeros(5, np.float32))}),
        num_rounds=3,
        train_config=ConfigRecord({keys.LOCAL_STEPS: 3}),
    )
    first = [(u.site, u.period, u.status) for u in seen[0].updates]
    assert ("s1", 1, "rejected") in first and ("s1", 2, "applied") not in first
    for summary in seen:
        model = strategy.state.models[summary.model_version]["w"].numpy()
        assert np.abs(model).max() < 10.0, summary.server_round
