"""Clocks the engine reads time from: the wall clock, or a virtual clock over a network.

In deployment the wall clock orders arrivals: a reply has arrived when it is pulled. In
simulation a ``VirtualClock`` driven by site profiles (latency, bandwidth, compute model,
availability) decides when each message *would* have arrived, and the engine judges
arrivals in that order, so a 2-core machine reproduces a federation spanning continents.

A training message on the virtual clock, dispatched at t₀ with B↓ bytes down and B↑ up::

    arrives at  t₀ + (L/2 + 8·B↓/b↓) + compute + (L/2 + 8·B↑/b↑)

with the site's round-trip latency L and link bandwidths b; compute is drawn from the
site's compute model at dispatch (seeded by (seed, site, attempt)), so every message has
a known earliest arrival (B↑ ≥ 0) before its reply exists. The engine may judge a queued
arrival only when no outstanding message could still land before it.

A *pipelined* message (delayed updates) overlaps communication with computation: its
content existed at the server since ``ready_at``, so its download starts then; the site
computes it once that download is in and its previous computation has ended; its upload
starts when it is computed. A link transmits one message at a time (8·B/b each) while
latency overlaps, so downloads and uploads of one site queue on its links. Round trips
then leave the critical path whenever the model a site needs was formed early enough.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from flplatform.core import keys
from flplatform.core.checkpoint import CheckpointError, StateProblems
from flplatform.core.checks import positive_count
from flplatform.core.seeding import rng_for
from flplatform.network import Network, SiteProfile, compute_seconds

log = logging.getLogger("flplatform.engine.clock")


@dataclass(frozen=True)
class Schedule:
    """What the clock fixed about one message when it was dispatched.

    On the wall clock nothing is known ahead and ``earliest_arrival`` is -inf.
    """

    dispatched_at: float  # clock time of dispatch
    download_seconds: float | None = None
    compute_seconds: float | None = None  # None: known only from the site's report
    earliest_arrival: float = -math.inf
    # pipelined messages only: when the site starts computing (None: at download's end)
    compute_started_at: float | None = None


@dataclass(frozen=True)
class Landing:
    """When a reply counts as arrived on the clock, and what the time was spent on."""

    arrived_at: float  # clock time
    compute_seconds: float | None = None  # simulated compute (None on the wall clock)
    transfer_seconds: float | None = None  # simulated download + upload


class Clock(Protocol):
    """What the engine needs from a clock."""

    virtual: bool  # whether times are simulated (and written to the ledger's virtual columns)

    def now(self) -> float:
        """Current time in seconds (virtual, or Unix time)."""
        ...

    def advance(self, to: float) -> None:
        """Move the clock forward to ``to`` (never backwards); a no-op on the wall clock."""
        ...

    def join(self, site: str, index: int) -> dict[str, Any]:
        """Register a site (``index``: its position in the federation); return its profile."""
        ...

    def away_seconds(self, site: str, *, steps: int | None) -> float | None:
        """For how long the site sits out work of ``steps`` local steps; None: it takes part."""
        ...

    def schedule(
        self, *, site: str, bytes_down: int, steps: int | None, ready_at: float | None = None
    ) -> Schedule:
        """Fix what is known of a message dispatched to ``site`` now.

        ``steps``: the local steps it asks for (``planned_steps``; None when it names no
        work, as a user's app that runs its own loop). ``ready_at`` (pipelined messages):
        the clock time since when the message's content existed; the download may have
        started then.
        """
        ...

    def land(
        self,
        schedule: Schedule,
        *,
        site: str,
        bytes_up: int,
        measured_compute: float | None,
        ack_bytes: int = 0,
    ) -> Landing:
        """When the reply to a message with ``schedule`` arrives on this clock.

        ``bytes_up``: what the reply sends; ``ack_bytes``: what comes back down while it is
        sent (Flower acknowledges a reply's push before its objects go up).
        """
        ...

    def rest(self, site: str) -> None:
        """The site is busy with something the clock does not see (a message given up on):
        its next pipelined work starts afresh, not where its last one ended."""
        ...

    def releasable(self, arrived_at: float, outstanding: Iterable[Schedule]) -> bool:
        """Whether an arrival at ``arrived_at`` may be judged while ``outstanding`` run.

        A virtual clock says no while an outstanding message could still land earlier;
        the wall clock always says yes: what has been pulled has arrived.
        """
        ...

    def state_dict(self) -> dict[str, Any]:
        """The clock's state at a round boundary (checkpoint data, keyed by site name)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()`` output (``CheckpointError`` listing every problem)."""
        ...


class WallClock:
    """Real time: a reply has arrived when the server pulls it."""

    virtual = False

    def now(self) -> float:
        """Seconds since the epoch."""
        return time.time()

    def advance(self, to: float) -> None:
        """Real time moves by itself."""

    def join(self, site: str, index: int) -> dict[str, Any]:
        """Real sites have no simulated profile."""
        return {}

    def away_seconds(self, site: str, *, steps: int | None) -> float | None:
        """A real site's availability shows in its replies, not here."""
        return None

    def schedule(
        self, *, site: str, bytes_down: int, steps: int | None, ready_at: float | None = None
    ) -> Schedule:
        """Only the dispatch time is known; a real site computes after it downloads."""
        return Schedule(dispatched_at=time.time())

    def land(
        self,
        schedule: Schedule,
        *,
        site: str,
        bytes_up: int,
        measured_compute: float | None,
        ack_bytes: int = 0,
    ) -> Landing:
        """The moment the reply was pulled."""
        return Landing(arrived_at=time.time())

    def rest(self, site: str) -> None:
        """Nothing is planned ahead on the wall clock."""

    def releasable(self, arrived_at: float, outstanding: Iterable[Schedule]) -> bool:
        """Always: on the wall clock, whatever has been pulled has arrived."""
        return True

    def state_dict(self) -> dict[str, Any]:
        """Nothing: real time is not saved."""
        return {"kind": "wall"}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Accept only a wall clock's state: a simulated run cannot go on in real time."""
        _check_kind(state, "wall")


class VirtualClock:
    """Simulated time over a ``Network`` of site profiles; starts at 0.

    Parameters
    ----------
    network : Network
        Site profiles by name (or by position for sites the network does not name).
    seed : int
        Compute times and availability are drawn from (seed, site, attempt), attempt
        counting the messages offered to that site, so a run is reproducible (except for
        messages that name no work, booked as measured: see ``measure_unplanned``).
    measure_unplanned : bool
        How long a message that names no work (no ``local-steps``, no ``local-epochs``: a
        user's app whose own loop decides) computes: True, the time the site measured
        (``compute-seconds``, which flplatform's mods add) over its speed, as the
        ``measured`` model does, or the profile's mean step when the reply measured
        nothing; False (the run chose a compute model), one step of the profile's model.
        Measured times differ from run to run: such a run (and its resume) is not
        repeated bit for bit, which the log says once.
    """

    virtual = True

    def __init__(self, network: Network, *, seed: int = 0, measure_unplanned: bool = True) -> None:
        self.network = network
        self.seed = seed
        self.measure_unplanned = measure_unplanned
        self._said_measured = False
        self._now = 0.0
        self._profiles: dict[str, SiteProfile] = {}
        self._attempts: dict[str, int] = {}
        # per site, when its links and its processor are free again (pipelined messages)
        self._downlink_free: dict[str, float] = {}
        self._uplink_free: dict[str, float] = {}
        # site → when its last pipelined message was sent, computed and landed: how far
        # its next one may reach back
        self._pipeline_from: dict[str, tuple[float, float, float]] = {}
        self._joined: dict[str, int] = {}  # site → the index it joined with (its profile)

    def now(self) -> float:
        """Simulated seconds since the run started."""
        return self._now

    def advance(self, to: float) -> None:
        """Jump to ``to`` if it is later (arrivals are judged in order, so it always is)."""
        self._now = max(self._now, to)

    def join(self, site: str, index: int) -> dict[str, Any]:
        """Give ``site`` its profile (by name, else by position) and return it for the ledger."""
        profile = self.network.profile_for(site, index)
        self._profiles[site] = profile
        self._joined[site] = index
        return profile.to_dict()

    def profile(self, site: str) -> SiteProfile:
        """The profile of a site that joined (a site unknown so far joins at the end)."""
        if site not in self._profiles:
            self.join(site, len(self._profiles))
        return self._profiles[site]

    def _attempt(self, site: str) -> int:
        attempt = self._attempts.get(site, 0)
        self._attempts[site] = attempt + 1
        return attempt

    def away_seconds(self, site: str, *, steps: int | None) -> float | None:
        """With probability 1 − availability the site sits this work out.

        It is then away for as long as this update would have taken it (a fresh draw of
        its compute time for ``steps`` local steps), after which it can be offered work
        again.
        """
        profile = self.profile(site)
        if profile.availability >= 1.0:
            return None
        attempt = self._attempt(site)
        rng = rng_for(self.seed, "availability", site, attempt)
        if rng.random() < profile.availability:
            return None
        self._pipeline_from.pop(site, None)  # it sits out: its next work starts afresh
        steps = max(1, steps or 0)
        away = compute_seconds(
            profile.compute, steps=steps, speed=_speed(profile), rng=rng, measured=None
        )
        if away is None or not away > 0:  # the "measured" model: nothing drawn
            away = steps * profile.compute.mean_seconds / _speed(profile)
        return away

    def schedule(
        self, *, site: str, bytes_down: int, steps: int | None, ready_at: float | None = None
    ) -> Schedule:
        """Draw the compute time now, so the earliest possible arrival is known.

        Without ``ready_at`` the message leaves now and the site starts on it once it is
        downloaded. With it (pipelined), see the module docstring.
        """
        profile = self.profile(site)
        rng = rng_for(self.seed, "compute", site, self._attempt(site))
        if steps is None and self.measure_unplanned and not self._said_measured:
            self._said_measured = True
            log.info(
                "the training messages name no work (no local-steps or local-epochs): the "
                "clock books what the sites measure, so this run's simulated times are not "
                "repeated by another run; name the work, or choose --compute-model, for that"
            )
        compute = (
            None  # known once the reply says what it measured
            if steps is None and self.measure_unplanned
            else compute_seconds(
                profile.compute,
                steps=1 if steps is None else steps,
                speed=_speed(profile),
                rng=rng,
                measured=None,
            )
        )
        down = profile.download_seconds(bytes_down)
        if ready_at is None:
            # An empty reply still pays half the round trip on the way back.
            earliest = self._now + down + (compute or 0.0) + profile.upload_seconds(0)
            return Schedule(
                dispatched_at=self._now,
                download_seconds=down,
                compute_seconds=compute,
                earliest_arrival=earliest,
            )
        # A site busy without a break since its last message may have received this one
        # while computing that one; otherwise (first message, back from being away, a
        # message lost or refused) nothing of it happened before now.
        # It reaches back only when it is given this message the moment its last one
        # landed; a site kept waiting (its work failed, it was refused) starts afresh.
        sent_before, computed_before, landed = self._pipeline_from.pop(
            site, (self._now, self._now, self._now)
        )
        if landed != self._now:
            sent_before = computed_before = self._now
        sent = max(ready_at, self._downlink_free.get(site, -math.inf), sent_before)
        self._downlink_free[site] = sent + down - profile.download_seconds(0)  # transmitted
        started = max(sent + down, computed_before)
        # Safety net: nothing may land before what has already been judged.
        started = max(started, self._now - profile.upload_seconds(0) - (compute or 0.0))
        upload_from = max(started + (compute or 0.0), self._uplink_free.get(site, -math.inf))
        return Schedule(
            dispatched_at=sent,
            download_seconds=down,
            compute_seconds=compute,
            earliest_arrival=upload_from + profile.upload_seconds(0),
            compute_started_at=started,
        )

    def land(
        self,
        schedule: Schedule,
        *,
        site: str,
        bytes_up: int,
        measured_compute: float | None,
        ack_bytes: int = 0,
    ) -> Landing:
        """Dispatch + download + compute + upload of the measured reply.

        The upload includes sending its acknowledgement's bytes down (no latency more: it
        answers a request the upload is making), so a reply's transfer covers all it costs.
        """
        profile = self.profile(site)
        compute = schedule.compute_seconds
        if compute is None:  # measured: the site's own time, scaled by speed
            measured = measured_compute if measured_compute is not None else math.nan
            if math.isfinite(measured):
                compute = max(0.0, measured) / _speed(profile)
            elif profile.compute.kind == "measured":
                compute = 0.0
            else:  # a message naming no work, whose reply measured nothing: one mean step
                compute = profile.compute.mean_seconds / _speed(profile)
        acknowledged = profile.download_seconds(ack_bytes) - profile.download_seconds(0)
        up = profile.upload_seconds(bytes_up) + acknowledged
        transfer = (schedule.download_seconds or 0.0) + up
        if schedule.compute_started_at is None:
            return Landing(
                arrived_at=schedule.dispatched_at + transfer + compute,
                compute_seconds=compute,
                transfer_seconds=transfer,
            )
        # Pipelined: replies of one site land in order (it answers one message at a
        # time), so its uplink is known free up to here.
        computed = schedule.compute_started_at + compute
        sending = max(computed, self._uplink_free.get(site, -math.inf))
        self._uplink_free[site] = sending + up - profile.upload_seconds(0)  # transmitted
        arrived = sending + up
        self._pipeline_from[site] = (schedule.dispatched_at, computed, arrived)
        return Landing(arrived_at=arrived, compute_seconds=compute, transfer_seconds=transfer)

    def rest(self, site: str) -> None:
        """Break the site's pipeline: its next message starts from the time it is sent."""
        self._pipeline_from.pop(site, None)

    def releasable(self, arrived_at: float, outstanding: Iterable[Schedule]) -> bool:
        """Only if no outstanding message could land before ``arrived_at``."""
        return all(arrived_at <= s.earliest_arrival for s in outstanding)

    # ------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Simulated time and every site's timeline, by site name (node ids change on resume).

        Profiles are not saved: they follow from the network and the index each site
        joined with, so a resumed run with the same network gets the same ones.
        """
        return {
            "kind": "virtual",
            "seed": self.seed,
            "now": self._now,
            "joined": dict(self._joined),
            "attempts": dict(self._attempts),
            "downlink_free": dict(self._downlink_free),
            "uplink_free": dict(self._uplink_free),
            "pipeline_from": {site: list(times) for site, times in self._pipeline_from.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()`` output; the clock is unchanged if it does not fit."""
        _check_kind(state, "virtual")
        problems = StateProblems("the virtual clock")
        names = ("seed", "now", "joined", "attempts", "downlink_free", "uplink_free")
        if not problems.require(state, *names, "pipeline_from"):
            problems.raise_if_any()
        if state["seed"] != self.seed:
            problems.add(f"it ran with seed {state['seed']!r}, this run has seed {self.seed}")
        problems.number(state["now"], "now")
        joined = _site_numbers(problems, state["joined"], "joined", integer=True)
        attempts = _site_numbers(problems, state["attempts"], "attempts", integer=True)
        downlink = _site_numbers(problems, state["downlink_free"], "downlink_free")
        uplink = _site_numbers(problems, state["uplink_free"], "uplink_free")
        pipeline: dict[str, tuple[float, float, float]] = {}
        raw = state["pipeline_from"]
        if not isinstance(raw, Mapping):
            problems.add("'pipeline_from' must be a mapping")
        else:
            for site, times in raw.items():
                if (
                    isinstance(site, str)
                    and isinstance(times, list | tuple)
                    and len(times) == 3
                    and all(problems.number(t, f"pipeline_from[{site}]") for t in times)
                ):
                    pipeline[site] = (float(times[0]), float(times[1]), float(times[2]))
                else:
                    problems.add(f"'pipeline_from' of {site!r} must be three times")
        problems.raise_if_any()
        self._now = float(state["now"])
        self._joined = {site: int(index) for site, index in joined.items()}
        self._profiles = {
            site: self.network.profile_for(site, index) for site, index in self._joined.items()
        }
        self._attempts = {site: int(n) for site, n in attempts.items()}
        self._downlink_free = {site: float(t) for site, t in downlink.items()}
        self._uplink_free = {site: float(t) for site, t in uplink.items()}
        self._pipeline_from = pipeline


def _check_kind(state: Mapping[str, Any], kind: str) -> None:
    found = state.get("kind") if isinstance(state, Mapping) else None
    if found != kind:
        raise CheckpointError(
            f"the checkpoint's clock is {found!r}, this run's is {kind!r}: a run resumes "
            "on the clock it started with"
        )


def _site_numbers(
    problems: StateProblems, value: Any, name: str, *, integer: bool = False
) -> dict[str, float]:
    """``value`` as a site name → number mapping (problems noted, bad entries left out)."""
    if not isinstance(value, Mapping):
        problems.add(f"'{name}' must be a mapping of site names")
        return {}
    return {
        site: number
        for site, number in value.items()
        if isinstance(site, str) and problems.number(number, f"{name}[{site}]", integer=integer)
    }


def _speed(profile: SiteProfile) -> float:
    # Network.profile_for resolves seeded random speeds; 1.0 guards a hand-built profile.
    return profile.speed if profile.speed is not None else 1.0


def planned_steps(config: Mapping[str, Any], num_examples: int | None) -> int | None:
    """Local optimiser steps a training message asks for: what its compute time scales with.

    ``local-steps`` when positive, else ``local-epochs`` passes over the site's examples
    in batches of ``batch-size`` (1 when the batches are unknown); 0 when both are set to 0
    (a message that asks for no training, such as Sketched-SGD's request for values); None
    when the config names neither (a user's app whose own loop decides: the clock then
    uses what the site measured, ``VirtualClock``).
    """
    if config.get(keys.LOCAL_STEPS) == 0 and config.get(keys.LOCAL_EPOCHS) == 0:
        return 0
    steps = positive_count(config.get(keys.LOCAL_STEPS))
    if steps:
        return steps
    epochs = positive_count(config.get(keys.LOCAL_EPOCHS))
    if not epochs:
        return None
    batch = positive_count(config.get(keys.BATCH_SIZE))
    if batch and num_examples:
        return epochs * max(1, math.ceil(num_examples / batch))
    return 1
