"""Delayed compensated updates: oracles, the invariant, pipelining, and bad input.

Everything runs through the real engine, strategy and site mod over an in-process grid
(``tests/helpers/delayed_sites.py``); the Flower simulation path is in tests/integration.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from clients.site import load_site
from flplatform.core import keys
from flplatform.core.arrays import arrays_to_record, record_to_arrays
from flplatform.core.errors import ConfigError, UpdateRejected
from flplatform.core.seeding import rng_for
from flplatform.engine import APPLIED, REJECTED, PeriodSync, RoundSummary, Synchrony
from flplatform.engine.clock import VirtualClock
from flplatform.engine.engine import RoundEngine
from flplatform.network import ComputeModel
from strategies.compensation import ServerPeriods, SitePeriods
from strategies.delayed import DelayedCompensated
from strategies.local_sgd import LocalSGDAveraging
from strategies.mods.delayed import DelayedSiteConfig, load_site_periods
from tests.helpers.delayed_sites import QuadraticSite, context, digits_site
from tests.helpers.idle_sites import network
from tests.helpers.scripted_grid import ScriptedGrid

pytestmark = pytest.mark.usefixtures("task_identity")


class Recorder:
    """Keeps every round's summary and the global model after it."""

    def __init__(self, strategy: DelayedCompensated) -> None:
        self.strategy = strategy
        self.rounds: list[RoundSummary] = []
        self.models: list[np.ndarray] = []

    def __call__(self, summary: RoundSummary) -> None:
        self.rounds.append(summary)
        record = self.strategy.state.models[summary.model_version]
        self.models.append(record_to_arrays(record)["w"].astype(np.float64))


def quadratic_run(
    delay: int,
    *,
    rounds: int = 10,
    rejected: dict[int, set[int]] | None = None,
    compensate: bool = True,
    clock: VirtualClock | None = None,
    steps: int = 3,
) -> tuple[dict[int, QuadraticSite], Recorder, RoundEngine]:
    targets = np.random.default_rng(7).normal(size=(3, 5))
    sites = {
        n: QuadraticSite(
            f"s{n}",
            targets[n - 1],
            examples=10 * n,
            rejected_in=(rejected or {}).get(n, set()),
            state=context(n),
        )
        for n in (1, 2, 3)
    }
    strategy = DelayedCompensated(delay=delay, num_rounds=rounds, compensate=compensate)
    recorder = Recorder(strategy)
    engine = RoundEngine(
        ScriptedGrid(sites),
        strategy,
        policy=PeriodSync(),
        clock=clock,
        poll_interval=0.0,
        required_sites=3,
        on_round=recorder,
    )
    x0 = np.zeros(5, dtype=np.float32)
    recorder.models.append(x0.astype(np.float64))
    engine.run(
        arrays_to_record({"w": x0}),
        num_rounds=rounds,
        train_config=ConfigRecord({keys.LOCAL_STEPS: steps}),
    )
    return sites, recorder, engine


# ============================================================ the invariant
@pytest.mark.parametrize("delay", [1, 3])
@pytest.mark.parametrize("rejected_round", [None, 4])
def test_every_replica_is_the_averaged_history_plus_its_own_last_d_periods(
    delay: int, rejected_round: int | None
) -> None:
    rounds = 10
    rejected = {2: {rejected_round}} if rejected_round else {}
    sites, recorder, _ = quadratic_run(delay, rounds=rounds, rejected=rejected)
    x = recorder.models  # x[r] = x_0 + Σ_{j ≤ r} Ā_j

    # Ā_r is the example-weighted mean of the round-r updates the server included.
    for r in range(1, rounds + 1):
        included = [n for n, s in sites.items() if r not in s.rejected_in]
        weights = {n: sites[n].examples for n in included}
        expected = sum(weights[n] * sites[n].sent[r] for n in included) / sum(weights.values())
        np.testing.assert_allclose(x[r] - x[r - 1], expected, atol=1e-6)

    # After round r (when period r + 1 starts) every site's model is
    # x_0 + Σ_{j ≤ r−D} Ā_j + Σ_{r−D < j ≤ r} A_{n,j}.
    for n, site in sites.items():
        for r in range(0, rounds):
            expected = x[max(0, r - delay)] + sum(
                (site.sent[j] for j in range(max(1, r - delay + 1), r + 1)), np.zeros(5)
            )
            if rejected_round is not None and n == 2 and r == rejected_round + delay:
                # The left-out period was settled just now: the site applied Ā − 0 and
                # keeps its own step, which its next update carries to the server.
                expected = expected + site.sent[rejected_round]
            np.testing.assert_allclose(site.starts[r + 1], expected, atol=1e-5)

    if rejected_round is not None:
        statuses = [
            u.status for summary in recorder.rounds for u in summary.updates if u.site == "s2"
        ]
        assert statuses.count(REJECTED) == 1
        # No work is lost: the next update re-sends the left-out step on top of its own.
        site, carried_in = sites[2], rejected_round + delay + 1
        own = site.sent[carried_in] - site.sent[rejected_round]
        w = site.starts[carried_in]
        for _ in range(3):
            w = w - site.lr * (w - site.target)
        np.testing.assert_allclose(own, w - site.starts[carried_in], atol=1e-5)


def test_a_site_keeps_at_most_d_plus_one_periods() -> None:
    sites, _, _ = quadratic_run(3, rounds=8)
    for site in sites.values():
        # After its last period it holds the periods whose averages never reached it.
        periods = load_site_periods(site.state)
        assert periods is not None and sorted(periods.pending) == [5, 6, 7, 8]
        # ... all in the mod's one state record
        assert [k for k in site.state.state if k.startswith("flplatform")] == [keys.DELAYED_STATE]


def test_without_compensation_sites_train_from_the_stale_global_model() -> None:
    delay = 2
    sites, recorder, _ = quadratic_run(delay, compensate=False)
    for site in sites.values():
        for r in range(0, 10):
            np.testing.assert_allclose(site.starts[r + 1], recorder.models[max(0, r - delay)])
        periods = load_site_periods(site.state)
        assert periods is not None and not periods.pending


def test_compensation_beats_plain_delay_on_the_quadratic() -> None:
    # The optimum of Σ n_n f_n is the example-weighted mean of the targets.
    targets = np.random.default_rng(7).normal(size=(3, 5))
    optimum = (10 * targets[0] + 20 * targets[1] + 30 * targets[2]) / 60
    gap = {}
    for compensate in (True, False):
        _, recorder, _ = quadratic_run(3, rounds=12, compensate=compensate, steps=1)
        gap[compensate] = float(np.linalg.norm(recorder.models[-1] - optimum))
    assert gap[True] < gap[False]


# ============================================================ the oracles
def digits_model() -> ArrayRecord:
    site = load_site({keys.PARTITION_ID: 0, keys.NUM_PARTITIONS: 3}, _RUN)
    model = site.build_model(num_classes=10, seed=0)
    return ArrayRecord(model.state_dict())


_RUN = {"dataset": "digits", "partition": "dirichlet", "alpha": 1.0, "model": "mlp", "seed": 0}


def digits_run(strategy, policy, train_config: dict, rounds: int = 3) -> dict[str, np.ndarray]:  # noqa: ANN001
    grid = ScriptedGrid({n + 1: digits_site(n, 3, **_RUN) for n in range(3)})
    engine = RoundEngine(grid, strategy, policy=policy, poll_interval=0.0, required_sites=3)
    result = engine.run(digits_model(), num_rounds=rounds, train_config=ConfigRecord(train_config))
    return record_to_arrays(result.arrays)


def test_zero_delay_is_local_sgd_averaging() -> None:
    config = {keys.LR: 0.1, keys.MOMENTUM: 0.9, keys.LOCAL_STEPS: 5, keys.BATCH_SIZE: 16}
    local = digits_run(LocalSGDAveraging(), Synchrony("sync"), config)
    delayed = digits_run(DelayedCompensated(delay=0, num_rounds=3), PeriodSync(), config)
    for name in local:
        np.testing.assert_allclose(delayed[name], local[name], rtol=0, atol=1e-6)
    moved = sum(
        float(np.abs(v - w).sum())
        for v, w in zip(local.values(), record_to_arrays(digits_model()).values(), strict=True)
    )
    assert moved > 1.0  # the runs trained


def test_zero_delay_with_one_step_is_synchronous_sgd() -> None:
    lr, batch, rounds = 0.5, 16, 3
    config = {keys.LR: lr, keys.MOMENTUM: 0.0, keys.LOCAL_STEPS: 1, keys.BATCH_SIZE: batch}
    delayed = digits_run(
        DelayedCompensated(delay=0, num_rounds=rounds), PeriodSync(), config, rounds
    )

    # Naive synchronous SGD: x ← x − lr · Σ n_n ∇f_n(x; batch) / Σ n_n, with each site's
    # batch drawn as the site draws it, from (seed, round, site, trainings so far).
    sites = [load_site({keys.PARTITION_ID: n, keys.NUM_PARTITIONS: 3}, _RUN) for n in range(3)]
    model = sites[0].build_model(num_classes=10, seed=0)
    model.load_state_dict(digits_model().to_torch_state_dict())
    total = sum(len(s.x_train) for s in sites)
    for r in range(1, rounds + 1):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for site in sites:
            order = rng_for(0, r, site.name, r - 1, "data-order").permutation(len(site.x_train))
            idx = order[:batch]
            model.zero_grad()
            loss = torch.nn.functional.cross_entropy(
                model(torch.tensor(site.x_train[idx], dtype=torch.float32)),
                torch.tensor(site.y_train[idx], dtype=torch.long),
            )
            loss.backward()
            for g, p in zip(grads, model.parameters(), strict=True):
                g += p.grad * (len(site.x_train) / total)
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads, strict=True):
                p -= lr * g
    for name, value in model.state_dict().items():
        np.testing.assert_allclose(delayed[name], value.numpy(), rtol=0, atol=1e-5)


# ============================================================ the virtual clock
@pytest.mark.parametrize(("delay", "expected"), [(0, 5 * 1.4), (1, 5 + 0.4), (3, 5 + 0.4)])
def test_round_trips_leave_the_critical_path_once_the_delay_covers_them(
    delay: int, expected: float
) -> None:
    # Fixed 1.0 s per period (5 steps × 0.2 s), 0.4 s round trip, free bandwidth.
    # D = 0 (local SGD): each round is 0.2 + 1.0 + 0.2. D ≥ 1: period q's download of
    # x_{q−1−D} happens while period q − 1 computes, its upload while q + 1 computes;
    # period q computes over [0.2 + (q−1), 0.2 + q] and round 5 closes at 5.4.
    net = network(3, ComputeModel("fixed", mean_seconds=0.2), rtt_seconds=0.4)
    _, recorder, engine = quadratic_run(delay, rounds=5, clock=VirtualClock(net, seed=0), steps=5)
    assert engine.simulated_seconds == pytest.approx(expected, abs=1e-6)
    ends = [r.virtual_finished_at for r in recorder.rounds]
    step = 1.4 if delay == 0 else 1.0
    assert ends == pytest.approx([ends[0] + step * i for i in range(5)], abs=1e-6)
    for summary in recorder.rounds:
        for u in summary.updates:
            assert u.status == APPLIED
            assert u.virtual_compute_seconds == pytest.approx(1.0)
            assert u.transfer_seconds == pytest.approx(0.4, abs=1e-6)
            assert u.delay == min(delay, u.period - 1)
            assert u.average_applied == max(0, u.period - 1 - delay)


def test_ledger_rows_say_which_average_each_update_applied() -> None:
    _, recorder, _ = quadratic_run(2, rounds=6)
    rows = [u for summary in recorder.rounds for u in summary.updates]
    assert len(rows) == 18
    assert sorted({(u.period, u.average_applied, u.delay) for u in rows}) == [
        (1, 0, 0),
        (2, 0, 1),
        (3, 0, 2),
        (4, 1, 2),
        (5, 2, 2),
        (6, 3, 2),
    ]
    # Other strategies leave the delay columns empty.
    assert all(u.period is None for u in _local_sgd_rows())


def _local_sgd_rows() -> list:
    rows: list = []
    strategy = LocalSGDAveraging()
    grid = ScriptedGrid({n: QuadraticSite(f"s{n}", np.zeros(5), state=context(n)) for n in (1, 2)})
    RoundEngine(
        grid,
        strategy,
        poll_interval=0.0,
        required_sites=2,
        on_round=lambda s: rows.extend(s.updates),
    ).run(arrays_to_record({"w": np.zeros(5, np.float32)}), num_rounds=1)
    return rows


# ============================================================ bad input
def reply_from(node: int, metrics: dict, arrays: ArrayRecord | None = None) -> Message:
    content = RecordDict({keys.METRICS: MetricRecord(metrics)})
    content[keys.ARRAYS] = arrays or arrays_to_record({"w": np.zeros(5, np.float32)})
    msg = Message(content, dst_node_id=0, message_type="train")
    msg.metadata.__dict__["_src_node_id"] = node
    return msg


def started_strategy() -> DelayedCompensated:
    strategy = DelayedCompensated(delay=1, num_rounds=3)
    base = arrays_to_record({"w": np.zeros(5, np.float32)})
    strategy.begin_aggregation(1, base)

    class Grid:
        def get_node_ids(self) -> list[int]:
            return [7]

    strategy.configure_train(1, base, ConfigRecord(), Grid())  # type: ignore[arg-type]
    return strategy


@pytest.mark.parametrize(
    ("metrics", "arrays", "reason"),
    [
        ({keys.NUM_EXAMPLES: 5}, None, r"delayed_mod\(\)"),
        ({keys.NUM_EXAMPLES: 5, keys.PERIOD: 2}, None, "asked for period 1"),
        ({keys.NUM_EXAMPLES: 0, keys.PERIOD: 1}, None, "num-examples"),
        (
            {keys.NUM_EXAMPLES: 5, keys.PERIOD: 1},
            arrays_to_record({"w": np.full(5, np.nan, np.float32)}),
            "NaN",
        ),
        (
            {keys.NUM_EXAMPLES: 5, keys.PERIOD: 1},
            arrays_to_record({"w": np.zeros(4, np.float32)}),
            "shape",
        ),
    ],
)
def test_malformed_updates_are_rejected_with_the_reason(metrics, arrays, reason) -> None:  # noqa: ANN001
    strategy = started_strategy()
    base = strategy.state.models[0]
    with pytest.raises(UpdateRejected, match=reason):
        strategy.accumulate(reply_from(7, metrics, arrays), base=base)
    assert strategy.state.open == {}


def test_an_update_is_counted_once() -> None:
    strategy = started_strategy()
    base = strategy.state.models[0]
    good = {keys.NUM_EXAMPLES: 5, keys.PERIOD: 1}
    strategy.accumulate(reply_from(7, good), base=base)
    with pytest.raises(UpdateRejected, match="duplicate reply"):
        strategy.accumulate(reply_from(7, good), base=base)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="delay"):
        DelayedCompensated(delay=-1, num_rounds=3)
    with pytest.raises(ConfigError, match="num-rounds"):
        DelayedCompensated(delay=1, num_rounds=0)
    with pytest.raises(ConfigError, match="server learning rate"):
        DelayedCompensated(delay=1, num_rounds=3, eta=math.nan)
    with pytest.raises(ConfigError, match="included-periods"):
        DelayedSiteConfig.from_record(
            ConfigRecord({keys.SERVER_ROUND: 1, keys.MODEL_VERSION: 0, keys.INCLUDED_PERIODS: "x"})
        )
    with pytest.raises(ConfigError, match="model-version"):
        DelayedSiteConfig.from_record(ConfigRecord({keys.SERVER_ROUND: 1}))


def test_kept_updates_that_do_not_fit_the_model_are_a_clear_error() -> None:
    periods = SitePeriods(pending={3: {"w": np.zeros(4)}})
    with pytest.raises(ConfigError, match="restart the site"):
        periods.local_model({"w": np.zeros(5)}, compensate=True)


def test_server_ledger_lets_sites_run_at_most_d_rounds_ahead() -> None:
    periods = ServerPeriods(delay=2)
    for period in (1, 2, 3):
        assert periods.period_for(1, open_round=1, last_round=10) == period
        periods.sent(1, period)
        assert periods.answered(1) == period
    assert periods.period_for(1, open_round=1, last_round=10) is None  # needs x_1
    assert periods.period_for(1, open_round=2, last_round=10) == 4
    assert periods.version_for(4) == 1
    # A site that joins late starts at the open round; none beyond the last round.
    assert periods.period_for(2, open_round=5, last_round=10) == 5
    assert periods.period_for(2, open_round=5, last_round=4) is None


def test_a_period_the_site_never_answered_is_offered_again_while_open() -> None:
    periods = ServerPeriods(delay=1)
    periods.sent(1, 1)  # the site sat it out, failed, or the message was lost
    assert periods.period_for(1, open_round=1, last_round=10) == 1
    periods.sent(1, 1)
    # Once its round is averaged, the site moves on to the open one.
    assert periods.period_for(1, open_round=3, last_round=10) == 3


def test_flowers_batch_hooks_give_the_example_weighted_average() -> None:
    strategy = DelayedCompensated(delay=0, num_rounds=2)
    base = arrays_to_record({"w": np.zeros(5, np.float32)})

    class Grid:
        def get_node_ids(self) -> list[int]:
            return [1, 2]

    sites = {
        n: QuadraticSite(f"s{n}", np.full(5, float(n)), examples=10 * n, state=context(n))
        for n in (1, 2)
    }
    config = ConfigRecord({keys.LOCAL_STEPS: 1})
    messages = strategy.configure_train(1, base, config, Grid())  # type: ignore[arg-type]
    replies = [sites[m.metadata.dst_node_id](m) for m in messages]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert arrays is not None and metrics is not None and metrics["num-updates"] == 2
    # One step of lr 0.3 towards targets 1 and 2 from 0, weighted 10 : 20.
    expected = (10 * 0.3 * 1 + 20 * 0.3 * 2) / 30
    np.testing.assert_allclose(record_to_arrays(arrays)["w"], np.full(5, expected), rtol=1e-6)


@pytest.mark.parametrize("delay", [1, 3])
def test_sites_that_sit_work_out_restart_their_pipeline_in_clock_order(delay: int) -> None:
    # With availability 0.6 sites keep sitting periods out; a site back from being away
    # must not reach back in time: every update lands while the round judging it is open.
    net = network(
        3, ComputeModel("exponential", mean_seconds=0.1), rtt_seconds=0.3, availability=0.6
    )
    _, recorder, engine = quadratic_run(delay, rounds=12, clock=VirtualClock(net, seed=3))
    rows = [(s, u) for s in recorder.rounds for u in s.updates]
    assert any(u.reason and "unavailable" in u.reason for _, u in rows)
    finished = [s.virtual_finished_at for s in recorder.rounds]
    assert finished == sorted(finished)
    for summary, u in rows:
        if u.status == APPLIED:
            assert u.virtual_arrived_at >= summary.virtual_started_at - 1e-9
            assert u.virtual_arrived_at >= u.virtual_dispatched_at
    assert engine.simulated_seconds == pytest.approx(finished[-1])


def test_a_rounds_training_loss_is_its_own_periods() -> None:
    net = network(3, ComputeModel("exponential", mean_seconds=0.1), rtt_seconds=0.3)
    _, recorder, _ = quadratic_run(2, rounds=6, clock=VirtualClock(net, seed=1))
    assert any(u.period != s.server_round for s in recorder.rounds for u in s.updates)
    assert [s.train_loss for s in recorder.rounds] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


@pytest.mark.parametrize("how", ["error", "plain-flower"])
def test_a_site_that_always_fails_cannot_hold_the_run_up(how: str) -> None:
    def broken(msg: Message) -> Message:
        if msg.metadata.message_type == "query":
            record = ConfigRecord({keys.SITE_NAME: "broken"})
            return Message(RecordDict({keys.SITE_INFO: record}), reply_to=msg)
        if how == "error":
            from flwr.app import Error

            return Message(Error(code=2, reason="RuntimeError: out of memory"), reply_to=msg)
        model = msg.content[keys.ARRAYS]  # a plain ClientApp: its model, no period
        metrics = MetricRecord({keys.NUM_EXAMPLES: 3})
        return Message(RecordDict({keys.ARRAYS: model, keys.METRICS: metrics}), reply_to=msg)

    good = QuadraticSite("good", np.ones(5), state=context(1))
    strategy = DelayedCompensated(delay=1, num_rounds=5)
    rounds: list[RoundSummary] = []
    engine = RoundEngine(
        ScriptedGrid({1: good, 2: broken}),
        strategy,
        policy=PeriodSync(),
        poll_interval=0.0,
        required_sites=2,
        on_round=rounds.append,
    )
    engine.run(arrays_to_record({"w": np.zeros(5, np.float32)}), num_rounds=5)
    assert len(rounds) == 5
    failures = [u for s in rounds for u in s.updates if u.site == "broken"]
    assert failures and all(u.status != APPLIED for u in failures)
    assert len(failures) <= 2 * 5  # at most once per round and period offered
    assert all(u.status == APPLIED for s in rounds for u in s.updates if u.site == "good")


def test_a_period_asked_again_carries_the_work_its_lost_reply_held() -> None:
    periods = SitePeriods()
    start = {"w": np.zeros(2)}
    first = periods.record(3, start, {"w": np.array([1.0, 2.0])}, compensate=True)
    periods.retry(3)  # the reply for period 3 was lost; the server asks for it again
    again = periods.record(3, start, {"w": np.array([0.5, 0.0])}, compensate=True)
    np.testing.assert_allclose(again["w"], first["w"] + [0.5, 0.0])
    np.testing.assert_allclose(periods.pending[3]["w"], [1.5, 2.0])


def test_a_site_given_up_on_restarts_its_pipeline_from_now() -> None:
    net = network(1, ComputeModel("fixed", mean_seconds=1.0), rtt_seconds=0.2)
    clock = VirtualClock(net, seed=0)
    clock.join("s1", 0)
    first = clock.schedule(site="s1", bytes_down=0, steps=1, ready_at=0.0)
    clock.land(first, site="s1", bytes_up=0, measured_compute=None)  # computed 0.1..1.1
    clock.advance(5.0)
    clock.rest("s1")  # e.g. an evaluation message it never answered
    second = clock.schedule(site="s1", bytes_down=0, steps=1, ready_at=0.0)
    assert second.compute_started_at == pytest.approx(5.1)
    assert second.earliest_arrival == pytest.approx(6.2)
