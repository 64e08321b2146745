"""The sites of a run as the engine sees them: one ``SiteState`` record per site.

A site is in exactly one ``Phase``. The engine offers work only to IDLE sites, and moves a
site through the phases as its messages go out and come back::

    IDLE ──dispatch──▶ TRAINING ──reply pulled──▶ ARRIVED ──judged──▶ IDLE
      │                   │  └──cancelled──▶ IDLE (its message still out: see Mailbox)
      │                   └──overdue──▶ GIVEN_UP ──Flower hands it back──▶ IDLE
      ├──sits the work out──▶ AWAY ──back, in clock order──▶ IDLE
      └──push refused──▶ REFUSED ──after a back-off──▶ IDLE

A cancelled site is IDLE at once (in clock order) although Flower still holds its
cancelled message; the mailbox keeps that message and pushes the site's next one when it
comes back, so a site never holds two messages.

A site is *silent* when it left the engine's site query unanswered (connected, but no
ClientApp answers for it): whatever its phase, it is offered no work and not counted as
connected, so no round waits for it, until a message of its comes back answered.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from enum import Enum
from typing import Any

from flplatform.core.checkpoint import StateProblems
from flplatform.engine.events import Dispatch, SiteInfo, node_name


class Phase(Enum):
    """What a site is doing, as far as the engine's scheduling is concerned."""

    IDLE = "idle"  # may be given work
    TRAINING = "training"  # a training message is out (or queued behind a cancelled one)
    ARRIVED = "arrived"  # its reply was pulled and waits for its turn on the clock
    GIVEN_UP = "given up"  # a message given up on: busy until Flower hands it back
    AWAY = "away"  # sitting work out (simulated availability) until clock time ``until``
    REFUSED = "refused"  # its message was refused: no work before ``time.monotonic()`` ``until``


@dataclass
class SiteState:
    """One site: who it is, whether the SuperLink lists it, and its phase."""

    info: SiteInfo
    connected: bool = True
    phase: Phase = Phase.IDLE
    # TRAINING, ARRIVED: the training message it works on.
    work: Dispatch | None = None
    # AWAY: clock time it is back; REFUSED: time.monotonic() after which it is tried again.
    until: float = 0.0
    # TRAINING: when its work was planned (the policy sees outstanding work in that order).
    planned: int = 0
    # It left the site query unanswered and has answered nothing since: no work meanwhile.
    silent: bool = False


@dataclass(frozen=True)
class Census:
    """The sites by phase at one moment, as the policy's view needs them."""

    idle: tuple[int, ...]  # connected, nothing outstanding, in join order
    training: tuple[Dispatch, ...]  # training messages out, in the order they were planned
    away: frozenset[int]
    connected: int


class Sites:
    """Every site that ever joined the run, in join order, with its state."""

    def __init__(self) -> None:
        self._states: dict[int, SiteState] = {}
        self._planned = itertools.count()
        # The last census, while no site changed since (the policy asks again and again).
        self._census: Census | None = None
        self._positions: dict[int, int] | None = None  # node → its place in join order
        self._replaced: dict[int, str] = {}  # node → the site whose place a new node took

    # ------------------------------------------------------------ membership
    def add(self, info: SiteInfo) -> None:
        """A site that introduced itself (connected, idle)."""
        self._states[info.node_id] = SiteState(info)
        self._census = self._positions = None

    def take_over(self, old: int, info: SiteInfo) -> None:
        """Site ``old``'s SuperNode started again as node ``info.node_id``: the site, its
        place in the join order included, is that node's now (listed, idle)."""
        self._states = {
            (info.node_id if node_id == old else node_id): (
                SiteState(info) if node_id == old else state
            )
            for node_id, state in self._states.items()
        }
        self._replaced[old] = info.name  # a message given up on may still come back
        self._census = self._positions = None

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def infos(self) -> dict[int, SiteInfo]:
        """Node id → site, in join order."""
        return {n: s.info for n, s in self._states.items()}

    def position(self, node_id: int) -> int:
        """The site's place in join order: the order the engine sends in, whatever the
        node ids (a resumed run's sites have new ones); unknown nodes come last."""
        if self._positions is None:
            self._positions = {n: i for i, n in enumerate(self._states)}
        return self._positions.get(node_id, len(self._positions))

    def info(self, node_id: int) -> SiteInfo | None:
        state = self._states.get(node_id)
        return state.info if state else None

    def name(self, node_id: int) -> str:
        """The site's name (``node-<id>`` for a node that has not introduced itself; the
        site's, for a node whose place a restarted one took)."""
        state = self._states.get(node_id)
        if state is not None:
            return state.info.name
        return self._replaced.get(node_id, node_name(node_id))

    def by_name(self, node_ids: Iterable[int]) -> list[int]:
        """``node_ids`` ordered by site name (then node id): the order strategies sample
        in, the same in every invocation of a run whatever node ids Flower gave."""
        return sorted(node_ids, key=lambda n: (self.name(n), n))

    def names(self) -> set[str]:
        return {s.info.name for s in self._states.values()}

    def holders(self) -> dict[str, int]:
        """Site name → the node that has it now."""
        return {s.info.name: node_id for node_id, s in self._states.items()}

    def set_connected(self, node_ids: set[int]) -> tuple[list[int], list[int]]:
        """The nodes the SuperLink lists now; the others get no work.

        Returns the sites that left since the last call (listed then, not now) and those
        back (not listed then, listed now), each in join order.
        """
        left: list[int] = []
        back: list[int] = []
        for node_id, state in self._states.items():
            connected = node_id in node_ids
            if state.connected != connected:
                (back if connected else left).append(node_id)
            state.connected = connected
        self._census = None
        return left, back

    def set_silent(self, node_id: int, silent: bool) -> bool:
        """Mark the site silent (its site query went unanswered) or heard from again;
        whether that changed anything."""
        state = self._states.get(node_id)
        if state is None or state.silent == silent:
            return False
        state.silent = silent
        self._census = None
        return True

    def is_silent(self, node_id: int) -> bool:
        state = self._states.get(node_id)
        return state is not None and state.silent

    def silent(self) -> set[int]:
        """The silent sites."""
        return {n for n, s in self._states.items() if s.silent}

    def is_connected(self, node_id: int) -> bool:
        state = self._states.get(node_id)
        return state is not None and state.connected

    def silent_idle(self) -> list[int]:
        """Silent sites that are connected and hold no message: to be asked again."""
        return [
            n for n, s in self._states.items() if s.silent and s.connected and s.phase is Phase.IDLE
        ]

    # ---------------------------------------------------------------- phases
    def idle(self) -> tuple[int, ...]:
        """Connected sites with nothing outstanding, in join order."""
        return self.census().idle

    def phase(self, node_id: int) -> Phase | None:
        state = self._states.get(node_id)
        return state.phase if state else None

    def work(self, node_id: int) -> Dispatch | None:
        """The training message the site works on (TRAINING, ARRIVED)."""
        state = self._states.get(node_id)
        return state.work if state else None

    def training(self) -> tuple[Dispatch, ...]:
        """The training messages out (pushed or queued), in the order they were planned."""
        return self.census().training

    def census(self) -> Census:
        """The idle sites, the training messages out, the AWAY sites, the connected count."""
        if self._census is not None:
            return self._census
        now = time.monotonic()
        idle, working, away, connected = [], [], [], 0
        backing_off = False
        for node_id, state in self._states.items():
            phase = state.phase
            if state.connected and not state.silent:
                connected += 1
                if phase is Phase.IDLE or (phase is Phase.REFUSED and state.until <= now):
                    idle.append(node_id)
            if phase is Phase.REFUSED and state.until > now:
                backing_off = True  # idle later without any change: not cached
            if phase is Phase.TRAINING:
                working.append(state)
            elif phase is Phase.AWAY:
                away.append(node_id)
        working.sort(key=lambda s: s.planned)
        training = tuple(s.work for s in working if s.work is not None)
        census = Census(tuple(idle), training, frozenset(away), connected)
        if not backing_off:
            self._census = census
        return census

    def next_back(self) -> tuple[float, int] | None:
        """(clock time, node) of the first connected AWAY site to come back, if any."""
        # Ties go to the site that joined first (not the lower node id: ids change on resume).
        first = min(
            (
                (s.until, i, n)
                for i, (n, s) in enumerate(self._states.items())
                if s.phase is Phase.AWAY and s.connected
            ),
            default=None,
        )
        return None if first is None else (first[0], first[2])

    def train(self, dispatch: Dispatch) -> None:
        """The site was given ``dispatch`` (pushed now, or queued behind a cancelled one)."""
        self._move(dispatch.node_id, Phase.TRAINING, work=dispatch, planned=next(self._planned))

    def arrive(self, node_id: int) -> None:
        """The site's reply was pulled; it waits for its turn."""
        self._move(node_id, Phase.ARRIVED, work=self._states[node_id].work)

    def give_up(self, node_id: int) -> None:
        """The engine stopped waiting for the site's message; Flower still holds it."""
        self._move(node_id, Phase.GIVEN_UP)

    def send_away(self, node_id: int, until: float) -> None:
        """The site sits the work out until clock time ``until``."""
        self._move(node_id, Phase.AWAY, until=until)

    def refuse(self, node_id: int, until: float) -> None:
        """The SuperLink refused the site's message; try it again after ``until``."""
        self._move(node_id, Phase.REFUSED, until=until)

    def free(self, node_id: int) -> None:
        """The site may be given work again."""
        self._move(node_id, Phase.IDLE)

    def release(self, node_id: int) -> None:
        """Flower handed back (or expired) the message given up on: a GIVEN_UP site is free."""
        if self.phase(node_id) is Phase.GIVEN_UP:
            self._move(node_id, Phase.IDLE)

    # ------------------------------------------------------------ checkpointing
    def state_dict(self) -> list[dict[str, Any]]:
        """Every site in join order: who it is and what it does, at a round boundary.

        A site with training work out is ``working`` (the mailbox saves the work); a site
        given up on or refused is ``idle`` (its message ends with this run); an away site
        keeps the clock time it is back.
        """
        saved = []
        for node_id, state in self._states.items():
            phase = state.phase
            if phase in (Phase.TRAINING, Phase.ARRIVED):
                said, until = "working", 0.0
            elif phase is Phase.AWAY:
                said, until = "away", state.until
            else:
                said, until = "idle", 0.0
            saved.append({**asdict(state.info), "node_id": node_id, "phase": said, "until": until})
        return saved

    def load_state_dict(self, state: Any, *, nodes: Mapping[int, int] | None = None) -> None:
        """Restore ``state_dict()`` output, node ids mapped through ``nodes`` (old → new).

        Sites keep their saved names and what they declared. A saved ``working`` site is
        idle until the engine hands it its saved work again. Sites of this run that the
        state does not name (they joined since) follow, idle.
        """
        problems = StateProblems("the sites")
        fields = ("node_id", "name", "phase", "until")
        restored: dict[int, SiteState] = {}
        if not isinstance(state, list):
            problems.add("expected a list of sites")
            state = []
        for saved in state:
            if not problems.require(saved, *fields):
                continue
            old = saved["node_id"]
            new = old if nodes is None else nodes.get(old)
            if new is None:
                problems.add(f"site {saved['name']!r} (node {old}) is not in this run")
                continue
            if saved["phase"] not in ("idle", "working", "away"):
                problems.add(f"site {saved['name']!r} has an unknown phase {saved['phase']!r}")
                continue
            if not problems.number(saved["until"], "until"):
                continue
            try:
                info = SiteInfo(**{**_info_fields(saved), "node_id": new})
            except TypeError as exc:
                problems.add(f"site {saved['name']!r}: {exc}")
                continue
            away = saved["phase"] == "away"
            now = self._states.get(new)
            restored[new] = SiteState(
                info,
                connected=now.connected if now is not None else True,
                silent=now.silent if now is not None else False,
                phase=Phase.AWAY if away else Phase.IDLE,
                until=float(saved["until"]) if away else 0.0,
            )
        problems.raise_if_any()
        for node_id, current in self._states.items():
            restored.setdefault(node_id, current)
        self._states = restored
        self._census = self._positions = None

    def _move(
        self, node_id: int, phase: Phase, *, work: Dispatch | None = None, **fields: float
    ) -> None:
        state = self._states.get(node_id)
        if state is None:  # a node that never introduced itself: nothing to track
            return
        state.phase, state.work = phase, work
        self._census = None
        state.until = fields.get("until", 0.0)
        state.planned = int(fields.get("planned", 0))


def _info_fields(saved: Mapping[str, Any]) -> dict[str, Any]:
    """The ``SiteInfo`` fields of a saved site."""
    return {f.name: saved[f.name] for f in fields(SiteInfo) if f.name in saved}
