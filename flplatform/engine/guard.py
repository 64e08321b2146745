"""The update guard: what the server checks of every update before it counts.

Pure NumPy; imports no Flower. One guard serves every strategy: the strategy reads a reply
into an ``Update`` (its vector, the examples it claims), the guard decides how much of it
counts, and the strategy adds it with the weight and scale the guard allows. Four checks,
each with its reason for the ledger:

* **Replay.** A reply whose arrays are identical to one the same site sent before (same
  content-addressed ids) is rejected: an honest site that trained sends new arrays.
* **Weight.** A site's weight is at most the example count it declared when it joined,
  and at most ``max_share`` of the federation's examples (the others' declared counts, or
  their last accepted weight where they declared none):
  ``w ≤ s/(1−s) · Σ_{m≠n} w_m``. A claim of 10¹² examples cannot own the average.
* **Norm.** ‖u‖ is compared with the reference: the median of the norms accepted in the
  last ``window_rounds`` rounds and in this one so far, for updates of the same kind, and
  of the newest before them while those hold fewer than ``min_reference`` (a round of the
  async modes applies one update: ``trim_window``). What an update adds to the arrays
  averaged as they are (running statistics) is not in that norm: it is judged against its
  own median (``AVERAGED_KIND``).
  One beyond ``norm_ratio`` × reference is clipped to the reference (scale = ref/‖u‖) or
  rejected; one beyond ``REJECT_BEYOND`` (100) × reference, or ``norm_ratio``² × if that
  is more, is rejected either way: no honest update is a hundred medians long, and
  clipping it would still apply its direction (measured: a float32-max update clipped
  once cost FedAvgM two points of accuracy). The default ratio is 3, not 10: a site that
  scales its update past 3× the median counts no more than an honest update of median
  norm (the README's guard table gives ``benchmarks/bench_hostile.py``'s figures). A
  flipped update, clipped so, still points against the others: that needs the direction
  check.
  Until ``min_reference`` norms are known (the first round) updates wait, and
  are judged together once ``min_reference`` of them are there (``ready``) or when the
  round closes (``settle``): a huge update that arrives first cannot become the
  reference, and a round never holds more than ``min_reference`` − 1 updates. The
  policies count a held update toward K only once it is judged, and offer its site no
  more work meanwhile (``EngineView.held_nodes``): in the modes that step on fewer than
  ``min_reference`` updates, the first step waits for them, from as many sites (a site
  that hangs then holds the first step until its round timeout, as in a sync round).
* **Direction** (off by default). A site whose updates point against the federation's
  recent direction (same kind) is rejected: a sign-flipped update points against what the
  other sites agree on. The direction is a moving average of the rounds' accepted means,
  d ← ½·d + ū_r, so that in an asynchronous mode (one update per round) it is not one
  other site's update. What is judged is the site's mean cosine over its recent judged
  updates, this one counted: an exponential average with memory λ = ``DIRECTION_MEMORY``
  that starts from the site's first cosine, c̄₁ = cos₁, c̄ₙ = λ·c̄ₙ₋₁ + (1 − λ)·cosₙ. An
  update is rejected when c̄ₙ is below ``min_cosine``, or when its own cosine is more
  than ``CLEARLY_AWAY`` below it (a site cannot bank credit for updates that plainly
  point away). The first cosine weighs like a history on purpose: a flipping site's
  clearest evidence comes first. On digits with Dirichlet α = 0.1 the flip's cosine was
  −0.70 in round 2 and within ±0.1 from round 4 (its data is unlike the others', so its
  update is nearly orthogonal to theirs); with the first cosine counted as one update of
  ten (a bias-corrected average), the flip got in at round 20 and cost 4 points, and as
  a history it stayed out for all 30 rounds. The price: an honest site whose first
  cosine is negative waits for its mean to recover (−0.13, then +0.18 each: 6 rounds).
  Near a stationary point of non-IID training the honest sites' updates cancel out, so
  each round's cosine is mostly noise: measured on digits (3 sites, Dirichlet α = 0.5),
  from round 14 an honest site's cosine fell to −0.13 in one round and a flipped update's
  rose to +0.04, and the first flip admitted on one round's cosine cost the run all its
  accuracy (0.91 → 0.10: its direction then turned the honest sites away). Their means
  kept apart: honest ≥ 0.18, flipped ≤ −0.20, every round. Off by default because no
  direction is safe in general: a site whose data the direction rarely holds (in k-sync,
  the slowest site) may point away for long. Limits: a site with a high mean gets a few
  updates that point slightly away admitted before its mean falls (≈ 6 at cosine −0.1
  after a mean of +0.1), and a check on cosines cannot see an attacker that stays within
  them.
  Judged after the norm: an update that waits for the round's end is judged on its
  direction when it is settled.

The median, not the mean: one huge norm moves a mean without bound. Not the lower median:
honest sites' norms differ by two orders of magnitude on non-IID splits (measured: 146×
between two digits sites with server momentum), and with two sites the lower median is
the smaller one, which rejected an honest site. With two sites neither the median nor
anything else can tell who is honest; with three or more, one attacker is outvoted.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import numpy as np

from flplatform.core.checkpoint import StateProblems
from flplatform.core.checks import Problem, holds, is_number, number, one_of, require

CLIP = "clip"
REJECT = "reject"
NORM_ACTIONS = (CLIP, REJECT)
# λ of a site's mean cosine: about its last ten judged updates. Shorter memories let one
# round's noise decide (λ = 0.5 kept a flipped site only 0.02 below 0 on the digits run
# in the module's notes); longer ones keep a site that once pointed away rejected for
# longer after it stopped.
DIRECTION_MEMORY = 0.9
# An update whose own cosine is this far below the bound is rejected whatever its site's
# mean. The flips' first cosines were −0.70 and −0.45 (two seeds of the notes' run), its
# honest sites' no lower than −0.13; but a slow site in k-sync, whose data the direction
# rarely holds, reached −0.50 (its mean had rejected it already). A margin, not a rule
# that honest updates never cross: an honest site with credit loses one update to it.
CLEARLY_AWAY = 0.5
# Beyond this many reference norms an update is rejected even where clipping is the action.
REJECT_BEYOND = 100.0
# Replies of one site whose fingerprints are kept for the replay check, newest: kept all, a
# run of 100 sites and thousands of rounds grew every checkpoint without bound. A reply
# older than this many of its site's is not known as a replay (its norm and direction are
# still judged).
REPLAY_MEMORY = 256
# The kind (suffix) of what updates add to the arrays a round averages as they are (running
# statistics; ``strategies.averaged_arrays``; their integer counters, which count the steps
# a site took, are judged by nothing: ``judged_changes``). Judged apart: in one norm with
# the learned arrays they swamped it (a ResNet after 20 local steps: counters 89.4 and
# running statistics 29.1 of an update's norm 94.1, its weights 1.9, so that an update with
# its weights scaled ×100 stayed inside the norm bound), and their direction says nothing
# of training's. Not clipped (they are averaged, not stepped): an update whose running
# statistics move more than REJECT_BEYOND times the median of theirs is rejected.
AVERAGED_KIND = "/averaged"


@dataclass(frozen=True)
class GuardOptions:
    """How strictly updates are checked (``flplatform.start``'s guard options).

    Parameters
    ----------
    norm_ratio : float
        An update whose norm exceeds this many times the reference is clipped or rejected;
        0 turns the norm check off.
    norm_action : {"clip", "reject"}
        What happens to such an update: scaled down to the reference norm, or rejected.
    max_share : float
        Largest share of the federation's examples one site's weight may claim, in (0, 1];
        1 caps nothing (the declared-examples cap still applies).
    reject_replays : bool
        Reject a reply identical to one the site sent before.
    min_cosine : float
        Reject an update when its site's mean cosine over its recent updates (this one
        counted) with the federation's recent direction is below this, or its own cosine
        is more than ``CLEARLY_AWAY`` below it; in [−1, 1], −1 turns the direction check
        off.
    cap_declared : bool
        Cap a site's weight at the examples it declared when it joined.
    window_rounds : int
        Rounds of accepted norms the reference is taken over (the current one too), and
        earlier ones' newest norms while these hold fewer than ``min_reference``.
    min_reference : int
        Norms needed before an update is judged on arrival; before that it waits for the
        round's end.
    """

    norm_ratio: float = 3.0
    norm_action: str = CLIP
    max_share: float = 1.0
    reject_replays: bool = True
    min_cosine: float = -1.0
    cap_declared: bool = True
    window_rounds: int = 3
    min_reference: int = 3

    def __post_init__(self) -> None:
        require(self.problems())

    @classmethod
    def off(cls) -> GuardOptions:
        """Options that check nothing: every update counts as its site claims."""
        return cls(norm_ratio=0.0, reject_replays=False, min_cosine=-1.0, cap_declared=False)

    def problems(self) -> list[Problem]:
        """Every problem with these options (the names are the CLI's)."""
        return guard_problems(
            update_norm_ratio=self.norm_ratio,
            update_norm_action=self.norm_action,
            max_site_share=self.max_share,
            reject_replays=self.reject_replays,
            update_min_cosine=self.min_cosine,
        ) + [
            number(self.window_rounds, "window_rounds", at_least=1),
            number(self.min_reference, "min_reference", at_least=1),
        ]


def _norm_ratio_problem(ratio: object, name: str) -> Problem:
    says = "a number >= 1, or 0 (no norm check)"
    return number(ratio, name, at_least=0.0, says=says) or holds(
        ratio == 0 or float(ratio) >= 1,  # type: ignore[arg-type]
        ratio,
        name,
        says=says,
    )


# Each guard option's rule, by its ``flplatform.start`` name: rule(value, run-option name).
_RULES: dict[str, Callable[[object, str], Problem]] = {
    "update_norm_ratio": _norm_ratio_problem,
    "update_norm_action": lambda v, n: one_of(v, n, NORM_ACTIONS),
    "max_site_share": lambda v, n: number(
        v, n, above=0.0, at_most=1.0, says="in (0, 1] (1: no cap)"
    ),
    "reject_replays": lambda v, n: holds(isinstance(v, bool), v, n, says="true or false"),
    "update_min_cosine": lambda v, n: number(
        v, n, at_least=-1.0, at_most=1.0, says="in [-1, 1] (-1: no direction check)"
    ),
}


# The guard's options as ``flplatform.start`` (and the run config, kebab-cased) names them.
GUARD_OPTIONS = tuple(_RULES)


def guard_problems(**options: object) -> list[Problem]:
    """Every problem with the guard options given, by their ``flplatform.start`` names
    (``update_norm_ratio=...``); each is reported under its run-option name."""
    return [_RULES[name](value, name.replace("_", "-")) for name, value in options.items()]


class Ruling(Enum):
    """What the guard made of an update."""

    ADMIT = "admit"
    REJECT = "reject"
    WAIT = "wait"  # judged when the round closes (no reference yet)


@dataclass(frozen=True)
class Decision:
    """The guard's decision on one update.

    ``weight`` and ``scale`` are what the strategy adds the update with (Σ w·s·u / Σ w);
    ``reason`` is the ledger's (None: nothing to say).
    """

    ruling: Ruling
    weight: float = 0.0
    scale: float = 1.0
    reason: str | None = None


@dataclass
class _Waiting:
    """An update held until the round closes, and what is known of it already."""

    ticket: int
    site: int
    kind: str
    norm: float
    claimed: int  # its weight is set when it is judged, with the others held beside it
    vector: Sequence[np.ndarray]
    averaged: float | None = None  # the norm of its averaged arrays, if it has any


@dataclass
class _Kind:
    """Norms and direction of the accepted updates of one kind (model deltas, sketches)."""

    name: str
    rounds: deque[list[float]]
    current: list[float] = field(default_factory=list)
    # Σ w·s·u and Σ w of this round's accepted updates; the direction d ← ½·d + ū_r.
    direction_sum: list[np.ndarray] | None = None
    direction_weight: float = 0.0
    direction: list[np.ndarray] | None = None
    direction_norm: float = 0.0  # ‖d‖, computed once per round rather than per update
    # site → (its mean cosine with the direction, how many updates it has been judged on)
    cosines: dict[int, tuple[float, int]] = field(default_factory=dict)

    def norms(self) -> list[float]:
        return [n for past in self.rounds for n in past] + self.current


def trim_window(rounds: deque[list[float]], *, keep: int, at_least: int) -> None:
    """Drop the oldest rounds of ``rounds`` beyond the newest ``keep``, but keep the newest
    of their values that the rest lacks to hold ``at_least`` (merged into the oldest round
    kept). A window of rounds alone holds too few values where a round applies one update
    (async, K = 1): an update then waits and is judged against a median that counts it,
    and a site sending every other round could triple its norm each time, unclipped."""
    while len(rounds) > keep:
        oldest = rounds.popleft()
        missing = at_least - sum(len(values) for values in rounds)
        if missing > 0 and oldest:
            if not rounds:  # keep = 0: the values needed stand as one round
                rounds.append(oldest[-missing:])
                return
            rounds[0] = oldest[-missing:] + rounds[0]


def _mapping(problems: StateProblems, value: Any, name: str) -> Mapping[Any, Any]:
    if isinstance(value, Mapping):
        return value
    problems.add(f"'{name}' must be a mapping")
    return {}


def _mean_cosine_ok(problems: StateProblems, judged: Any, kind: str, site: Any) -> bool:
    """Whether a saved (mean cosine, updates judged) pair is usable; a problem if not."""
    if (
        isinstance(judged, (list, tuple))
        and len(judged) == 2
        and is_number(judged[0])
        and -1.0 - 1e-9 <= float(judged[0]) <= 1.0 + 1e-9
        and isinstance(judged[1], int)
        and not isinstance(judged[1], bool)
        and judged[1] >= 1
    ):
        return True
    problems.add(
        f"the mean cosine of site {site!r} ({kind!r}) must be [a number in [-1, 1], "
        f"a count >= 1], got {judged!r}"
    )
    return False


def _node_mapper(problems: StateProblems, nodes: Mapping[int, int] | None) -> Callable[[Any], int]:
    """old node id → this run's (unchanged without ``nodes``; an unknown one is a problem)."""

    def node(old: Any) -> int:
        if nodes is None:
            return int(old)
        if old not in nodes:
            problems.add(f"node {old!r} is not among the sites of this run")
            return -1
        return nodes[old]

    return node


def median(values: Iterable[float]) -> float:
    """The median (the mean of the middle two for an even count)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """a·b accumulated in float64, without a float64 copy of either (einsum casts in small
    buffers; ``astype`` would cost a fresh model-sized array per update)."""
    x, y = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is the answer (inf)
        return float(np.einsum("i,i->", x, y, dtype=np.float64))


def vector_norm(parts: Sequence[np.ndarray]) -> float:
    """‖u‖₂ over all parts, in float64 (finite float32 parts cannot overflow it)."""
    return math.sqrt(sum(_dot(part, part) for part in parts))


def cosine(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float | None:
    """cos(a, b) over all parts; None when either is zero."""
    return _cosine_given_norms(a, vector_norm(a), b, vector_norm(b))


def _cosine_given_norms(
    a: Sequence[np.ndarray], na: float, b: Sequence[np.ndarray], nb: float
) -> float | None:
    """cos(a, b) when ‖a‖ and ‖b‖ are known already (one pass over the parts, not three)."""
    if na == 0 or nb == 0 or not math.isfinite(na * nb):
        return None
    dot = sum(_dot(x, y) for x, y in zip(a, b, strict=True))
    return dot / (na * nb) if math.isfinite(dot) else None


class UpdateGuard:
    """Decides, update by update, how much each one counts (see the module).

    The engine calls ``consider`` for each update the strategy read, ``ready`` after one
    that waited, ``settle`` before the strategy finishes the round (for updates still
    waiting), and ``round_finished`` after.
    """

    def __init__(self, options: GuardOptions | None = None) -> None:
        self.options = options or GuardOptions()
        self._kinds: dict[str, _Kind] = {}
        self._seen: dict[int, dict[tuple[str, ...], int]] = {}  # site → fingerprint → round
        self._last_weight: dict[int, float] = {}
        self._declared: dict[int, int] = {}
        self._waiting: list[_Waiting] = []
        self._round = 0
        self._kept_rounds = self.options.window_rounds - 1  # past rounds in a norm window

    # ------------------------------------------------------------------ sites
    def declare(self, site: int, num_examples: int | None) -> None:
        """The example count ``site`` declared when it joined (None: it declared none)."""
        if num_examples is not None and num_examples > 0:
            self._declared[site] = num_examples

    def take_over(self, old: int, new: int) -> None:
        """Site ``old`` is node ``new`` now (its SuperNode started again): what the guard
        knows of it (replies seen, weights, mean cosines) is the new node's."""

        def moved(by_site: dict[int, Any]) -> dict[int, Any]:
            return {(new if site == old else site): value for site, value in by_site.items()}

        self._seen = moved(self._seen)
        self._last_weight = moved(self._last_weight)
        self._declared = moved(self._declared)
        for kind in self._kinds.values():
            kind.cosines = moved(kind.cosines)
        self._waiting = [replace(w, site=new) if w.site == old else w for w in self._waiting]

    def begin_round(self, server_round: int) -> None:
        """The engine opens ``server_round``."""
        self._round = server_round

    # --------------------------------------------------------------- judging
    def consider(
        self,
        ticket: int,
        *,
        site: int,
        kind: str,
        claimed: int,
        vector: Sequence[np.ndarray],
        averaged: Sequence[np.ndarray] = (),
        fingerprint: tuple[str, ...] | None = None,
    ) -> Decision:
        """Judge one update: admit it (with its weight and scale), reject it, or hold it.

        Parameters
        ----------
        ticket : int
            The caller's id for the update (``settle`` hands it back).
        site : int
            The site (node id) that sent it.
        kind : str
            Updates are compared only with updates of the same kind.
        claimed : int
            The examples the site says it trained on.
        vector : sequence of arrays
            What the update adds (its norm and direction are judged).
        averaged : sequence of arrays
            What it adds to the float arrays the round averages as they are (running
            statistics): judged apart, see ``AVERAGED_KIND``.
        fingerprint : tuple of str, optional
            Content ids of the reply's arrays (a replay has the same).
        """
        options = self.options
        if fingerprint is not None and options.reject_replays:
            seen = self._seen.setdefault(site, {})
            first = seen.get(fingerprint)
            if first is not None:
                return Decision(
                    Ruling.REJECT,
                    reason=f"identical to its reply of round {first}: a replayed update",
                )
            seen[fingerprint] = self._round
            if len(seen) > REPLAY_MEMORY:
                del seen[next(iter(seen))]  # the oldest (dicts keep their insertion order)
        norm = vector_norm(vector)
        extra = vector_norm(averaged) if len(averaged) else None
        if not math.isfinite(norm) or (extra is not None and not math.isfinite(extra)):
            return Decision(Ruling.REJECT, reason="its norm overflows: not a usable update")
        if extra is not None and options.norm_ratio != 0:
            known_extra = self._kind(kind + AVERAGED_KIND).norms()
            if len(known_extra) >= options.min_reference:
                beyond = self._averaged_beyond(extra, median(known_extra))
                if beyond is not None:
                    return beyond
        weight, notes = self._weight(site, claimed)
        state = self._kind(kind)
        known = state.norms()
        if options.norm_ratio == 0:
            decision = Decision(Ruling.ADMIT, weight=weight, reason="; ".join(notes) or None)
        elif len(known) >= options.min_reference:
            decision = self._judge_norm(weight, norm, notes, median(known))
        else:  # no reference yet: judged with the round's norms when it closes
            decision = Decision(Ruling.WAIT, weight=weight)
        if decision.ruling is Ruling.REJECT:  # the norm is the more telling reason
            return decision
        if decision.ruling is Ruling.WAIT:  # its direction is judged after its norm
            self._waiting.append(
                _Waiting(ticket, site, kind, norm, claimed, vector, averaged=extra)
            )
            return decision
        pointing_away = self._direction_problem(vector, norm, state, site)
        if pointing_away is not None:
            return pointing_away
        return self._admit(decision, state, site, norm, vector, averaged=extra)

    def settle(self) -> dict[int, Decision]:
        """Judge the updates that waited, against the round's norms; ticket → decision."""
        waiting, self._waiting = self._waiting, []
        return self._judge_waiting(waiting)

    def ready(self) -> dict[int, Decision]:
        """Judge the waiting updates of every kind that now has ``min_reference`` norms,
        known or waiting; ticket → decision (the others keep waiting).

        Called after each update that waited, it bounds what a round holds to fewer than
        ``min_reference`` updates per kind: the first round of a hundred sites is judged
        against the median of its first norms, not held whole until it closes.
        """
        counts: dict[str, int] = {}
        for item in self._waiting:
            counts[item.kind] = counts.get(item.kind, 0) + 1
        full = {
            kind
            for kind, count in counts.items()
            if count + len(self._kind(kind).norms()) >= self.options.min_reference
        }
        if not full:
            return {}
        judged = [item for item in self._waiting if item.kind in full]
        self._waiting = [item for item in self._waiting if item.kind not in full]
        return self._judge_waiting(judged)

    def _judge_waiting(self, waiting: list[_Waiting]) -> dict[int, Decision]:
        """Judge held updates, each kind against the median of its norms and theirs."""
        decisions: dict[int, Decision] = {}
        by_kind: dict[str, list[_Waiting]] = {}
        for item in waiting:
            by_kind.setdefault(item.kind, []).append(item)
        held = {item.site: float(item.claimed) for item in waiting}  # for the share cap
        for kind, items in by_kind.items():
            state = self._kind(kind)
            reference = median(state.norms() + [item.norm for item in items])
            extras = [item.averaged for item in items if item.averaged is not None]
            extra_reference = (
                median(self._kind(kind + AVERAGED_KIND).norms() + extras) if extras else 0.0
            )
            for item in items:
                beyond = (
                    None
                    if item.averaged is None
                    else self._averaged_beyond(item.averaged, extra_reference)
                )
                weight, notes = self._weight(item.site, item.claimed, held=held)
                decision = beyond or self._judge_norm(weight, item.norm, notes, reference)
                if decision.ruling is Ruling.ADMIT:
                    pointing_away = self._direction_problem(
                        item.vector, item.norm, state, item.site
                    )
                    decision = pointing_away or self._admit(
                        decision, state, item.site, item.norm, item.vector, averaged=item.averaged
                    )
                decisions[item.ticket] = decision
        return decisions

    def _averaged_beyond(self, norm: float, reference: float) -> Decision | None:
        """A rejection when an update's averaged arrays move ``REJECT_BEYOND`` (or the
        norm ratio squared) times more than the median of their kind's; else None."""
        beyond = max(REJECT_BEYOND, self.options.norm_ratio**2)
        if reference > 0 and norm > beyond * reference:
            return Decision(
                Ruling.REJECT,
                reason=(
                    f"running statistics: norm {norm:.3g} is "
                    f"{norm / reference:.3g}x the recent median {reference:.3g} "
                    f"(beyond {beyond:g}x)"
                ),
            )
        return None

    def round_finished(self, *, stepped: bool = True) -> None:
        """The round closed: its norms join the window, its mean the direction; not when
        the strategy refused the step (``stepped`` false): its updates then counted for
        nothing, and must not move the reference either."""
        for state in self._kinds.values():
            if not stepped:
                state.current = []
                state.direction_sum, state.direction_weight = None, 0.0
                continue
            state.rounds.append(state.current)
            trim_window(state.rounds, keep=self._kept_rounds, at_least=self.options.min_reference)
            state.current = []
            if state.direction_sum is not None and state.direction_weight > 0:
                mean = [part / state.direction_weight for part in state.direction_sum]
                if state.direction is None:
                    state.direction = mean
                else:  # d ← ½·d + ū_r
                    for kept, new in zip(state.direction, mean, strict=True):
                        kept *= 0.5
                        kept += new
                state.direction_norm = vector_norm(state.direction)
            state.direction_sum, state.direction_weight = None, 0.0

    # ------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """What the guard remembers across rounds: norm windows and directions by kind,
        replay fingerprints, last and declared weights by node. Taken between rounds,
        when no update waits. The options are not in it (a resumed run passes the same).
        """
        return {
            "round": self._round,
            "kinds": {
                name: {
                    "rounds": [list(norms) for norms in kind.rounds],
                    # copies: the direction is updated in place after each round
                    "direction": None
                    if kind.direction is None
                    else [part.copy() for part in kind.direction],
                    "cosines": {site: list(judged) for site, judged in kind.cosines.items()},
                }
                for name, kind in self._kinds.items()
            },
            "seen": {site: dict(prints) for site, prints in self._seen.items()},
            "last_weight": dict(self._last_weight),
            "declared": dict(self._declared),
        }

    def load_state_dict(
        self, state: Mapping[str, Any], *, nodes: Mapping[int, int] | None = None
    ) -> None:
        """Restore ``state_dict()`` output, node ids mapped through ``nodes`` (old → new).

        Raises ``CheckpointError`` listing every problem; the guard is then unchanged.
        """
        problems = StateProblems("the update guard")
        if not problems.require(state, "round", "kinds", "seen", "last_weight", "declared"):
            problems.raise_if_any()
        problems.number(state["round"], "round", integer=True)
        kinds: dict[str, _Kind] = {}
        node = _node_mapper(problems, nodes)
        for name, saved in _mapping(problems, state["kinds"], "kinds").items():
            if not problems.require(saved, "rounds", "direction"):
                continue
            rounds = saved["rounds"]
            if not isinstance(rounds, list) or not all(
                isinstance(norms, list) and all(problems.number(n, "norm") for n in norms)
                for norms in rounds
            ):
                problems.add(f"the norms of kind {name!r} must be lists of numbers")
                continue
            direction = saved["direction"]
            if direction is not None and not (
                isinstance(direction, list)
                and all(problems.array(part, f"direction of {name!r}") for part in direction)
            ):
                continue
            # absent from the checkpoints of versions before it was kept: nothing known yet
            cosines = {
                node(site): (float(judged[0]), int(judged[1]))
                for site, judged in _mapping(
                    problems, saved.get("cosines", {}), f"cosines of {name!r}"
                ).items()
                if _mean_cosine_ok(problems, judged, name, site)
            }
            window = deque([float(n) for n in norms] for norms in rounds)
            trim_window(window, keep=self._kept_rounds, at_least=self.options.min_reference)
            kinds[name] = _Kind(
                name,
                rounds=window,
                direction=None if direction is None else [np.array(p) for p in direction],
                direction_norm=0.0 if direction is None else vector_norm(direction),
                cosines=cosines,
            )
        seen = {
            node(site): {tuple(fp): int(r) for fp, r in list(prints.items())[-REPLAY_MEMORY:]}
            for site, prints in _mapping(problems, state["seen"], "seen").items()
            if isinstance(prints, Mapping)
        }
        last_weight = {
            node(site): float(w)
            for site, w in _mapping(problems, state["last_weight"], "last_weight").items()
            if problems.number(w, "last_weight")
        }
        declared = {
            node(site): int(n)
            for site, n in _mapping(problems, state["declared"], "declared").items()
            if problems.number(n, "declared", integer=True)
        }
        problems.raise_if_any()
        self._round = int(state["round"])
        self._kinds, self._seen = kinds, seen
        self._last_weight, self._declared = last_weight, declared
        self._waiting = []

    # --------------------------------------------------------------- helpers
    def _kind(self, kind: str) -> _Kind:
        state = self._kinds.get(kind)
        if state is None:
            state = self._kinds[kind] = _Kind(kind, rounds=deque())
        return state

    def _weight(
        self, site: int, claimed: int, *, held: Mapping[int, float] | None = None
    ) -> tuple[float, list[str]]:
        """The weight the site's update gets, and notes on any cap. ``held``: the claims of
        the updates judged with it (the first round's, which waited), which count among
        the others' weights where nothing else is known of their sites: with no example
        counts declared, nothing else is, and a claim of 10¹² owned the first round."""
        weight, notes = float(claimed), []
        declared = self._declared.get(site) if self.options.cap_declared else None
        if declared is not None and claimed > declared:
            weight = float(declared)
            notes.append(
                f"claimed {claimed} examples but declared {declared} when it joined: "
                f"weighted as {declared}"
            )
        share = self.options.max_share
        if share < 1.0:
            # fsum: exact whatever the order of the set (node ids change on resume)
            known = set(self._declared) | set(self._last_weight)
            unknown = {o: w for o, w in (held or {}).items() if o != site and o not in known}
            others = math.fsum(
                [
                    *(
                        self._declared.get(other, self._last_weight.get(other, 0.0))
                        for other in known
                        if other != site
                    ),
                    *unknown.values(),
                ]
            )
            cap = share / (1.0 - share) * others
            if others > 0 and weight > cap:
                weight = cap
                notes.append(
                    f"weight capped at {cap:.6g} examples, max-site-share {share:g} of the "
                    "federation's"
                )
        return weight, notes

    def _judge_norm(
        self, weight: float, norm: float, notes: list[str], reference: float
    ) -> Decision:
        """The norm check's decision against ``reference`` (``_admit`` then counts it)."""
        ratio = self.options.norm_ratio
        if reference > 0 and norm > ratio * reference:
            said = (
                f"norm {norm:.3g} is {norm / reference:.3g}x the recent median {reference:.3g} "
                f"(update-norm-ratio {ratio:g})"
            )
            if self.options.norm_action == REJECT:
                return Decision(Ruling.REJECT, reason=said)
            beyond = max(REJECT_BEYOND, ratio * ratio)
            if norm > beyond * reference:
                return Decision(Ruling.REJECT, reason=f"{said}: beyond {beyond:g}x, not clipped")
            notes = [*notes, f"clipped: {said}; scaled to the median"]
            return Decision(
                Ruling.ADMIT, weight=weight, scale=reference / norm, reason="; ".join(notes)
            )
        return Decision(Ruling.ADMIT, weight=weight, reason="; ".join(notes) or None)

    def _direction_problem(
        self, vector: Sequence[np.ndarray], norm: float, state: _Kind, site: int
    ) -> Decision | None:
        """A rejection when the site's mean cosine with the recent direction, this update
        counted, is below the bound, or this update's is far below it; else None. Every
        judged update moves the site's mean, admitted or not: a site that stopped pointing
        away is admitted again once its mean has recovered. (Reasons fit the 80 columns
        ``history updates`` shows, the deciding number first.)"""
        bound = self.options.min_cosine
        if bound <= -1.0 or state.direction is None:
            return None
        cos = _cosine_given_norms(vector, norm, state.direction, state.direction_norm)
        if cos is None:
            return None
        known = state.cosines.get(site)
        mean, judged = (
            (cos, 1)
            if known is None
            else (DIRECTION_MEMORY * known[0] + (1 - DIRECTION_MEMORY) * cos, known[1] + 1)
        )
        state.cosines[site] = (mean, judged)
        this = f"cosine {cos:.2f} with the recent updates"
        if cos < bound - CLEARLY_AWAY:
            said = f"{this} < update-min-cosine {bound:g} - {CLEARLY_AWAY:g}"
        elif mean >= bound:
            return None
        elif judged == 1:
            said = f"{this} < update-min-cosine {bound:g}"
        else:
            said = (
                f"its recent mean cosine {mean:.2f} < update-min-cosine {bound:g} "
                f"(this one: {cos:.2f})"
            )
        return Decision(Ruling.REJECT, reason=f"direction: {said}")

    def _admit(
        self,
        decision: Decision,
        state: _Kind,
        site: int,
        norm: float,
        vector: Sequence[np.ndarray],
        *,
        averaged: float | None = None,
    ) -> Decision:
        """Count an admitted update: its norm (after clipping) in the window, its weight,
        and its direction; its averaged arrays' norm in their kind's own window."""
        state.current.append(norm * decision.scale)
        if averaged is not None:
            self._kind(state.name + AVERAGED_KIND).current.append(averaged * decision.scale)
        self._last_weight[site] = decision.weight
        if self.options.min_cosine > -1.0:
            factor = decision.weight * decision.scale
            if state.direction_sum is None:
                # np.array, not asarray · factor: a 0-d part times a number is a NumPy scalar,
                # which the in-place sum below would rebind rather than add to
                state.direction_sum = [np.array(p, np.float64) for p in vector]
                for acc in state.direction_sum:
                    acc *= factor
            else:
                for acc, part in zip(state.direction_sum, vector, strict=True):
                    acc += np.multiply(part, factor, dtype=np.float64)
            state.direction_weight += decision.weight
        return decision
