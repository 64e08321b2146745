"""The virtual clock: transfer and compute times, earliest arrivals, and a hand-computed run."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord

from flplatform.core import keys
from flplatform.engine import Synchrony
from flplatform.engine.clock import Schedule, VirtualClock, WallClock, planned_steps
from flplatform.engine.engine import RoundEngine
from flplatform.network import ComputeModel, Network, SiteProfile
from flplatform.run.ledger import SqlLedger
from storage import LedgerRepository
from strategies.local_sgd import LocalSGDAveraging
from tests.helpers.scripted_grid import ScriptedGrid
from tests.helpers.sites import site

MBIT = 1e6


def profile(name: str, *, rtt: float, mbps: float, compute: float) -> SiteProfile:
    return SiteProfile(
        name=name,
        rtt_seconds=rtt,
        uplink_bps=mbps * MBIT,
        downlink_bps=mbps * MBIT,
        compute=ComputeModel("fixed", mean_seconds=compute),
        speed=1.0,
    )


TWO_SITES = Network(
    name="two",
    profiles=(
        profile("a", rtt=0.100, mbps=8, compute=0.5),  # 1 MB takes 1 s each way
        profile("b", rtt=0.300, mbps=80, compute=1.0),  # 1 MB takes 0.1 s each way
    ),
)


def test_schedule_and_land_golden_values() -> None:
    clock = VirtualClock(TWO_SITES)
    clock.join("a", 0)
    schedule = clock.schedule(site="a", bytes_down=1_000_000, steps=2)
    # Down: 0.1/2 + 8·10⁶/(8·10⁶) = 1.05 s; compute 2 steps × 0.5 s; the earliest
    # arrival assumes an empty reply: + 0.05 s.
    assert schedule.download_seconds == pytest.approx(1.05)
    assert schedule.compute_seconds == pytest.approx(1.0)
    assert schedule.earliest_arrival == pytest.approx(2.1)
    landing = clock.land(schedule, site="a", bytes_up=500_000, measured_compute=99.0)
    assert landing.arrived_at == pytest.approx(1.05 + 1.0 + 0.05 + 0.5)
    assert landing.transfer_seconds == pytest.approx(1.05 + 0.55)
    assert landing.compute_seconds == pytest.approx(1.0)  # the profile's, not the measured


def test_a_message_naming_no_work_is_timed_by_the_sites_measurement() -> None:
    # A user's app that sends no local-steps: the profile cannot know its work, the site
    # measured it (compute-seconds). b's fixed 1.0 s step plays no part.
    clock = VirtualClock(TWO_SITES)
    clock.join("b", 1)
    schedule = clock.schedule(site="b", bytes_down=0, steps=None)
    assert schedule.compute_seconds is None
    assert schedule.earliest_arrival == pytest.approx(0.15 + 0.15)  # no compute known yet
    landing = clock.land(schedule, site="b", bytes_up=0, measured_compute=2.57)
    assert landing.compute_seconds == pytest.approx(2.57)
    assert landing.arrived_at == pytest.approx(0.15 + 2.57 + 0.15)
    # A reply that measured nothing (a ClientApp without flplatform's mod): one mean step.
    unmeasured = clock.schedule(site="b", bytes_down=0, steps=None)
    later = clock.land(unmeasured, site="b", bytes_up=0, measured_compute=None)
    assert later.compute_seconds == pytest.approx(1.0)


def test_a_chosen_compute_model_times_a_message_naming_no_work_as_one_step() -> None:
    clock = VirtualClock(TWO_SITES, measure_unplanned=False)
    clock.join("b", 1)
    schedule = clock.schedule(site="b", bytes_down=0, steps=None)
    assert schedule.compute_seconds == pytest.approx(1.0)
    landing = clock.land(schedule, site="b", bytes_up=0, measured_compute=2.57)
    assert landing.compute_seconds == pytest.approx(1.0)


def test_measured_compute_is_the_sites_own_time_over_its_speed() -> None:
    measured = SiteProfile(
        name="m",
        rtt_seconds=0.0,
        uplink_bps=math.inf,
        downlink_bps=math.inf,
        compute=ComputeModel("measured"),
        speed=2.0,
    )
    clock = VirtualClock(Network(name="m", profiles=(measured,)))
    schedule = clock.schedule(site="m", bytes_down=10, steps=5)
    assert schedule.compute_seconds is None and schedule.earliest_arrival == 0.0
    assert clock.land(schedule, site="m", bytes_up=10, measured_compute=3.0).arrived_at == 1.5
    assert clock.land(schedule, site="m", bytes_up=10, measured_compute=None).arrived_at == 0.0


def test_releasable_only_when_nothing_outstanding_could_land_earlier() -> None:
    clock = VirtualClock(TWO_SITES)
    later = Schedule(dispatched_at=0.0, earliest_arrival=5.0)
    assert clock.releasable(4.0, [later])
    assert clock.releasable(5.0, [later])  # a tie cannot be overtaken
    assert not clock.releasable(5.5, [later])
    assert WallClock().releasable(5.5, [later])


def test_clock_never_moves_backwards() -> None:
    clock = VirtualClock(TWO_SITES)
    clock.advance(3.0)
    clock.advance(1.0)
    assert clock.now() == 3.0


def test_compute_draws_are_a_function_of_seed_site_and_attempt() -> None:
    net = Network(
        name="r",
        profiles=(profile("a", rtt=0, mbps=10, compute=1.0),),
    )
    exponential = Network(
        name="r",
        profiles=(
            SiteProfile(**{**net.profiles[0].__dict__, "compute": ComputeModel("exponential")}),
        ),
    )

    def draws(seed: int) -> list[float | None]:
        clock = VirtualClock(exponential, seed=seed)
        return [clock.schedule(site="a", bytes_down=0, steps=1).compute_seconds for _ in range(5)]

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)
    assert len(set(draws(1))) == 5


@pytest.mark.parametrize(
    ("config", "examples", "steps"),
    [
        ({keys.LOCAL_STEPS: 7}, 100, 7),
        ({keys.LOCAL_STEPS: 0, keys.LOCAL_EPOCHS: 2, keys.BATCH_SIZE: 32}, 100, 8),
        ({keys.LOCAL_EPOCHS: 1, keys.BATCH_SIZE: 32}, None, 1),
        ({}, 100, None),  # a user's app's config: its own loop decides
        ({keys.LOCAL_STEPS: 0, keys.LOCAL_EPOCHS: 0}, 100, 0),  # no training asked
        ({keys.LOCAL_STEPS: "many"}, 100, None),
        ({keys.LOCAL_STEPS: float("inf")}, 100, None),
    ],
)
def test_planned_steps(config, examples, steps) -> None:
    assert planned_steps(config, examples) == steps


@pytest.mark.usefixtures("task_identity")
def test_a_hand_computed_run_of_two_sites(sqlite_ledger: str) -> None:
    """Two sync rounds of a 1 MB model: every time is L/2 + 8B/b each way plus compute."""
    repo = LedgerRepository.open(sqlite_ledger)
    run_id = repo.create_run(name="t", strategy="x", seed=0, config={}, num_rounds_planned=2)
    grid = ScriptedGrid({1: site("a", value=1.0), 2: site("b", value=3.0)})
    engine = RoundEngine(
        grid,
        LocalSGDAveraging(),
        policy=Synchrony("sync"),
        clock=VirtualClock(TWO_SITES),
        ledger=SqlLedger(repo, run_id),
        required_sites=2,
        poll_interval=0.0,
    )
    model = ArrayRecord({"w": Array(np.zeros(250_000, np.float32))})  # 1 000 000 bytes
    engine.run(model, num_rounds=2, train_config=ConfigRecord({keys.LOCAL_STEPS: 1}))
    rows = {(u.site, u.round): u for u in repo.list_updates(run_id)}
    links = {"a": (0.100, 8 * MBIT, 0.5), "b": (0.300, 80 * MBIT, 1.0)}
    for (name, _), u in rows.items():
        rtt, bandwidth, compute = links[name]
        # Wire sizes are the 1 MB array plus Flower's framing (well under 3 KB).
        assert 1_000_000 < u.bytes_down < 1_003_000 and 1_000_000 < u.bytes_up < 1_003_000
        transfer = rtt / 2 + 8 * u.bytes_down / bandwidth + rtt / 2 + 8 * u.bytes_up / bandwidth
        assert u.transfer_seconds == pytest.approx(transfer, rel=1e-12)
        assert u.virtual_compute_seconds == pytest.approx(compute)
        assert u.virtual_arrived_at - u.virtual_dispatched_at == pytest.approx(
            transfer + compute, rel=1e-12
        )
    # By hand: a takes 0.05 + 1.0 + 0.5 + 0.05 + 1.0 = 2.6 s, b 0.15 + 0.1 + 1.0 + 0.15
    # + 0.1 = 1.5 s; a sync round waits for a, so round 2 starts at 2.6 and ends at 5.2.
    # (Flower's framing, under 2 KB each way, adds under 2 ms each way at 8 Mbit/s.)
    assert rows[("a", 1)].virtual_arrived_at == pytest.approx(2.6, abs=4e-3)
    assert rows[("b", 1)].virtual_arrived_at == pytest.approx(1.5, abs=4e-3)
    assert rows[("b", 2)].virtual_dispatched_at == pytest.approx(2.6, abs=4e-3)
    rounds = repo.list_rounds(run_id)
    assert [r.virtual_finished_at for r in rounds] == pytest.approx([2.6, 5.2], abs=8e-3)
    assert rounds[1].virtual_started_at == rounds[0].virtual_finished_at
    assert engine.simulated_seconds == pytest.approx(5.2, abs=8e-3)
    repo.close()


def test_only_a_run_that_chose_a_compute_model_times_unplanned_work_by_the_model() -> None:
    from flplatform.run.options import PlatformOptions
    from flplatform.run.parts import make_clock

    preset = make_clock(PlatformOptions(network="world"))
    chosen = make_clock(PlatformOptions(network="world", compute_model="exponential"))
    assert isinstance(preset, VirtualClock) and isinstance(chosen, VirtualClock)
    assert preset.measure_unplanned and not chosen.measure_unplanned


@pytest.mark.usefixtures("task_identity")
def test_a_users_app_naming_no_work_is_booked_what_its_sites_measured(
    sqlite_ledger: str,
) -> None:
    """A Flower quickstart's server sends no local-steps; its sites' loops take what they
    take. flplatform's mod times the call, and the clock books that time (over the site's
    speed: 1 here), not one step of the profile's 0.5 s or 1.0 s."""
    import time

    from flwr.app import Context, Message, MessageType, MetricRecord, RecordDict

    from strategies.mods import flplatform_mod
    from tests.helpers.delayed_sites import context

    def slow_train(msg: Message, _: Context) -> Message:
        time.sleep(0.05)  # the user's own loop
        content = RecordDict(
            {
                keys.ARRAYS: msg.content[keys.ARRAYS],
                keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: 10}),
            }
        )
        return Message(content, reply_to=msg)

    def quickstart_site(name: str, node: int):
        state = context(node)

        def behave(msg: Message) -> Message:
            if msg.metadata.message_type == MessageType.QUERY:
                info = ConfigRecord({keys.SITE_NAME: name})
                return Message(RecordDict({keys.SITE_INFO: info}), reply_to=msg)
            return flplatform_mod()(msg, state, slow_train)

        return behave

    repo = LedgerRepository.open(sqlite_ledger)
    run_id = repo.create_run(name="t", strategy="x", seed=0, config={}, num_rounds_planned=2)
    engine = RoundEngine(
        ScriptedGrid({1: quickstart_site("a", 1), 2: quickstart_site("b", 2)}),
        LocalSGDAveraging(),
        policy=Synchrony("sync"),
        clock=VirtualClock(TWO_SITES),
        ledger=SqlLedger(repo, run_id),
        required_sites=2,
        poll_interval=0.0,
    )
    engine.run(ArrayRecord({"w": Array(np.zeros(4, np.float32))}), num_rounds=2)
    updates = repo.list_updates(run_id)
    repo.close()
    assert len(updates) == 4
    for u in updates:
        assert u.compute_seconds is not None and u.compute_seconds >= 0.05
        assert u.virtual_compute_seconds == pytest.approx(u.compute_seconds)
