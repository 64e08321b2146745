"""The synchrony family of Dutta et al., "Slow and Stale Gradients Can Win the Race" (2018).

Every mode is one ``Synchrony`` policy of the round engine; they differ along two axes:

* **cancel or keep stragglers.** Sync modes (``sync``, ``k-sync``, ``k-batch-sync``) apply
  only updates computed on the current model: once a step is decided, the stragglers are
  cancelled (recorded as cancelled) and restart on the new model. Async modes keep them
  running; they finish on the old model and arrive stale.
* **count sites or count updates.** ``k-sync``/``k-async`` wait for K updates from K
  different sites, and a site that finished waits for the step. Batch modes
  (``k-batch-sync``, ``k-batch-async``, ``async``, ``buffered``) count any K updates, and
  a site that finished is given work again at once (on the current model).

| mode | waits for | stragglers | time per step, X ~ Exp(μ), P sites |
|---|---|---|---|
| sync | all sampled | none | H_P/μ |
| k-sync | first K sites | cancelled | (H_P − H_{P−K})/μ |
| k-batch-sync | first K updates | cancelled | K/(Pμ) |
| k-async | K different sites | kept, arrive stale | (H_P − H_{P−K})/μ |
| k-batch-async | any K updates | kept | K/(Pμ) |
| async | 1 update | kept | 1/(Pμ) |
| buffered | any K updates (FedBuff) | kept | K/(Pμ) |

Options for the async modes: a staleness bound s (stale-synchronous parallel: the model
never moves more than s versions past an update still being computed, so the fastest
site waits for the slowest), staleness weighting (``flplatform.engine.staleness``) and a
concurrency limit (FedBuff's number of sites training at once). AdaSync grows K as the
training loss falls, for any K mode.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from flplatform.core.checkpoint import StateProblems
from flplatform.core.errors import ConfigError
from flplatform.core.seeding import rng_for
from flplatform.engine.events import APPLIED, DROPPED, Dispatch
from flplatform.engine.policy import EngineView, Verdict
from flplatform.engine.staleness import WEIGHTINGS, adasync_k, staleness_weight

SYNC_MODES = ("sync", "k-sync", "k-batch-sync", "async", "k-async", "k-batch-async", "buffered")
CANCELLING_MODES = ("sync", "k-sync", "k-batch-sync")
ASYNC_MODES = ("async", "k-async", "k-batch-async", "buffered")
# Modes that count any K updates and give a finished site work again at once.
BATCH_MODES = ("k-batch-sync", "k-batch-async", "async", "buffered")
K_MODES = ("k-sync", "k-batch-sync", "k-async", "k-batch-async", "buffered")


# The K modes that wait for K different sites (the batch modes count any K updates).
SITE_COUNTING_MODES = tuple(mode for mode in K_MODES if mode not in BATCH_MODES)


def k_sites_problem(sync: str, k: int, num_sites: int) -> str | None:
    """K beyond the number of sites, in a mode that waits for K different sites.

    It could never be met: the engine would quietly wait for every site instead. The batch
    modes count any K updates, which a site may repeat, so any K works there.
    """
    if sync not in SITE_COUNTING_MODES or k <= num_sites:
        return None
    batch = ", ".join(m for m in K_MODES if m in BATCH_MODES)
    sites = f"{num_sites} site{'' if num_sites == 1 else 's'}"
    return (
        f"k {k} is more than the {sites}: sync mode {sync!r} waits for K updates "
        f"from K different sites; choose k <= {num_sites}, or a mode that counts any K "
        f"updates ({batch})"
    )


def most_updates_a_round(mode: str, *, k: int, sampled: int) -> int:
    """The most updates one step combines in ``mode``: the sites sampled (sync), K (the K
    modes, without AdaSync, which grows K), one (async)."""
    if mode == "async":
        return 1
    return k if mode in K_MODES else sampled


def synchrony_problems(
    mode: str,
    *,
    k: int,
    staleness_bound: int,
    weighting: str,
    adasync: bool,
    concurrency: int,
    step_c: float = 1.0,
) -> list[str]:
    """Every reason these settings do not make a policy (empty when they do)."""
    if mode not in SYNC_MODES:
        return [f"sync mode {mode!r} is unknown; allowed: {', '.join(SYNC_MODES)}"]
    problems = []
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        problems.append(f"k must be a whole number ≥ 1, got {k!r}")
    if weighting not in ("", *WEIGHTINGS):
        problems.append(
            f"staleness weighting {weighting!r} is unknown; allowed: {', '.join(WEIGHTINGS)}"
        )
    if mode in CANCELLING_MODES:
        # Sync modes never apply a stale update: these knobs would silently do nothing.
        for knob, is_set in (
            ("staleness-bound", staleness_bound >= 0),
            ("staleness-weighting", weighting not in ("", "none")),
            ("concurrency", concurrency > 0),
        ):
            if is_set:
                problems.append(
                    f"{knob} applies to the async modes ({', '.join(ASYNC_MODES)}), "
                    f"not to {mode!r}, which applies no stale update"
                )
    if staleness_bound < -1:
        problems.append(f"staleness-bound must be ≥ 0 (or -1 for none), got {staleness_bound}")
    if not (math.isfinite(step_c) and step_c > 0):
        problems.append(f"staleness-step-c must be > 0, got {step_c}")
    if concurrency < 0:
        problems.append(f"concurrency must be ≥ 0 (0: every site), got {concurrency}")
    if adasync and mode not in K_MODES:
        problems.append(
            f"adasync grows K, so it needs a K mode ({', '.join(K_MODES)}), not {mode!r}"
        )
    return problems


class Synchrony:
    """One synchrony mode as the engine's ``AggregationPolicy`` (see the module docstring).

    Parameters
    ----------
    mode : str
        One of ``SYNC_MODES``.
    k : int
        K of the K modes (``async`` is K = 1; ``sync`` waits for every sampled site).
    staleness_bound : int or None
        s of stale-synchronous parallel (async modes); None (or -1) for no bound.
    weighting : {"none", "sqrt", "step"} or None
        Staleness weighting; None picks ``sqrt`` for ``buffered`` (as FedBuff) and
        ``none`` otherwise.
    step_c : float
        C of the staleness-dependent step size (``weighting="step"``).
    adasync : bool
        Grow K as K₀·√(F(x₀)/F(x_t)) with the training loss F (K modes).
    concurrency : int
        Most sites training at once in the async modes (0: all of them); which idle
        sites start is drawn from (seed, step, arrivals so far).
    seed : int
        The run's seed.
    """

    pipelined = False  # one period per round: a site is given work in the round open

    def __init__(
        self,
        mode: str = "sync",
        *,
        k: int = 1,
        staleness_bound: int | None = None,
        weighting: str | None = None,
        step_c: float = 1.0,
        adasync: bool = False,
        concurrency: int = 0,
        seed: int = 0,
    ) -> None:
        problems = synchrony_problems(
            mode,
            k=k,
            staleness_bound=-1 if staleness_bound is None else staleness_bound,
            weighting=weighting or "",
            adasync=adasync,
            concurrency=concurrency,
            step_c=step_c,
        )
        if problems:
            raise ConfigError("; ".join(problems))
        self.name = mode
        self.cancels = mode in CANCELLING_MODES
        self.batch = mode in BATCH_MODES
        self.k0: int | None = None if mode == "sync" else (1 if mode == "async" else k)
        self.k = self.k0
        # -1 is "no bound" too, as synchrony_problems and the CLI say it
        self.staleness_bound = None if staleness_bound == -1 else staleness_bound
        self.weighting = weighting or ("sqrt" if mode == "buffered" else "none")
        self.step_c = step_c
        self.adasync = adasync
        self.concurrency = concurrency
        self.seed = seed
        self._offered_round = 0  # the round whose start offered work (non-batch modes)
        self._initial_loss: float | None = None
        self._sites = 1  # P, as last seen

    def sites_problem(self, num_sites: int) -> str | None:
        """K beyond the sites in a mode that waits for K different ones (``k_sites_problem``)."""
        return k_sites_problem(self.name, self.k0 or 1, num_sites)

    def __repr__(self) -> str:
        options = [f"k={self.k}"] if self.k is not None else []
        if self.staleness_bound is not None:
            options.append(f"s={self.staleness_bound}")
        if self.weighting != "none":
            options.append(f"weighting={self.weighting}")
        if self.adasync:
            options.append("adasync")
        if self.concurrency:
            options.append(f"concurrency={self.concurrency}")
        return f"Synchrony({self.name}{', ' if options else ''}{', '.join(options)})"

    # ------------------------------------------------------------ the four questions
    def dispatch_targets(self, view: EngineView) -> tuple[int, ...]:
        """Batch modes: every idle site, any time; the others: idle sites at the step's start.

        Nothing once the step is decided (new work waits for the new model), and nothing
        while the staleness bound holds the step open: then the fast sites wait for the
        slow one, as stale-synchronous parallel asks.
        """
        if self._counted_enough(view):
            return ()
        idle = self._candidates(view)
        if not self.batch:
            # Offered once, at the step's start; a site finishing later waits for the next
            # step, unless nothing at all is running (then waiting would never end).
            if self._offered_round == view.server_round and view.outstanding:
                return ()
            self._offered_round = view.server_round
        if self.concurrency and idle:
            room = max(0, self.concurrency - len(view.outstanding))
            if room < len(idle):  # FedBuff samples the sites to start uniformly
                rng = rng_for(self.seed, "concurrency", view.server_round, view.arrived_this_round)
                idle = sorted(rng.choice(idle, size=room, replace=False).tolist())
        return tuple(idle)

    def judge(self, dispatch: Dispatch, view: EngineView) -> Verdict:
        """Apply (with its staleness weight), or drop what this mode may not use."""
        staleness = view.model_version - dispatch.model_version
        if self.cancels and staleness > 0:
            return Verdict(DROPPED, reason="late: computed on an older model version")
        if self.staleness_bound is not None and staleness > self.staleness_bound:
            return Verdict(
                DROPPED,
                reason=f"stale: {staleness} versions behind, bound {self.staleness_bound}",
            )
        weight = staleness_weight(
            self.weighting,
            staleness,
            distance_sq=lambda: view.model_distance(dispatch.model_version),
            c=self.step_c,
        )
        return Verdict(APPLIED, weight_scale=weight)

    def ready_to_aggregate(self, view: EngineView) -> bool:
        """K counted (or nothing more can count), and no outstanding update left too far behind."""
        if not self._counted_enough(view):
            return False
        if self.staleness_bound is not None and view.outstanding:
            oldest = min(d.model_version for d in view.outstanding.values())
            if view.model_version + 1 - oldest > self.staleness_bound:
                return False  # SSP: the next version would leave that update too stale
        return True

    def _counted_enough(self, view: EngineView) -> bool:
        """Whether this step has its K (or all it can get)."""
        self._sites = max(1, view.connected_nodes)
        if self.k is None:  # fully sync: every message of this step is accounted for
            return view.dispatched_this_round > 0 and not any(
                d.server_round == view.server_round for d in view.outstanding.values()
            )
        counted = view.applied_this_round if self.batch else len(view.applied_nodes)
        # An update the guard holds (no norm reference yet) is not counted while more can
        # come: the guard judges the first updates together once it has enough of them, so
        # the site that answers first cannot set the step alone (an async run's round 1
        # then combines the guard's first few updates).
        judged = (
            counted - view.held_this_round
            if self.batch
            else len(view.applied_nodes - view.held_nodes)
        )
        if judged < self._k_now() and self._more_can_come(view):
            return False
        # Nothing happened yet (every site away or refused): keep waiting.
        return counted > 0 or view.dispatched_this_round > 0

    def _k_now(self) -> int:
        """K, capped at P where it counts different sites (a batch may hold more updates)."""
        k = self.k or 1
        return k if self.batch else min(k, self._sites)

    def _more_can_come(self, view: EngineView) -> bool:
        if self.cancels and not self.batch:  # k-sync: only this step's messages count
            return any(d.server_round == view.server_round for d in view.outstanding.values())
        if view.outstanding or view.away_nodes:
            return True
        return bool(self._candidates(view))

    def _candidates(self, view: EngineView) -> list[int]:
        """Idle sites that could still add to this step.

        Not one whose update failed this step; in the modes that count different sites,
        not one already counted (it could only repeat itself); in the batch modes, not
        one whose update the guard holds (a fast site must not make the guard's first
        reference alone) while another site can still add to the step: once none can,
        the held sites may add more (the batch modes count any K updates).
        """
        if not self.batch:
            skip = view.failed_nodes | view.applied_nodes
            return [n for n in view.idle_nodes if n not in skip]
        ready = [n for n in view.idle_nodes if n not in view.failed_nodes]
        others = [n for n in ready if n not in view.held_nodes]
        if others or view.outstanding or view.away_nodes:
            return others
        return ready

    def to_cancel(self, view: EngineView) -> tuple[int, ...]:
        """Sync modes: once the step is decided, every straggler (to restart on the new model)."""
        if not self.cancels or not view.outstanding or not self.ready_to_aggregate(view):
            return ()
        return tuple(view.outstanding)

    def round_finished(self, train_loss: float | None) -> None:
        """AdaSync: K for the next step from the loss of the one just closed."""
        if not self.adasync or self.k0 is None:
            return
        if self._initial_loss is None:
            self._initial_loss = train_loss
        # K counts different sites in k-sync/k-async (at most P); a batch may hold more.
        k_max = max(self._sites, self.k0) if self.batch else self._sites
        self.k = max(
            self.k or 1,  # never shrink: a noisy loss should not undo the waiting
            adasync_k(self.k0, initial_loss=self._initial_loss, loss=train_loss, k_max=k_max),
        )

    # ------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to go on exactly: K (AdaSync), F(x₀), the last P and
        the round whose start offered work. The options are not in it: a resumed run
        builds the policy from the same ones (the mode is kept, to refuse another)."""
        return {
            "mode": self.name,
            "k": self.k,
            "initial_loss": self._initial_loss,
            "sites": self._sites,
            "offered_round": self._offered_round,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()`` output (``CheckpointError`` listing every problem)."""
        problems = StateProblems(f"the {self.name} policy")
        if not problems.require(state, "mode", "k", "initial_loss", "sites", "offered_round"):
            problems.raise_if_any()
        if state["mode"] != self.name:
            problems.add(f"the checkpoint ran sync mode {state['mode']!r}, this run {self.name!r}")
        k = state["k"]
        if (k is None) != (self.k0 is None) or (
            k is not None and problems.number(k, "k", integer=True) and k < 1
        ):
            problems.add(f"'k' {k!r} does not fit mode {self.name!r}")
        loss = state["initial_loss"]
        if loss is not None:
            problems.number(loss, "initial_loss")
        problems.number(state["sites"], "sites", integer=True)
        problems.number(state["offered_round"], "offered_round", integer=True)
        problems.raise_if_any()
        self.k = k
        self._initial_loss = None if loss is None else float(loss)
        self._sites = max(1, int(state["sites"]))
        self._offered_round = int(state["offered_round"])


class PeriodSync:
    """Synchronous per round, with sites working ahead: the policy of delayed updates.

    Round r is aggregated once every message sent for period r has come back (applied,
    dropped or rejected), like ``sync``; but a site that finished its period is offered
    work at once, and the strategy decides which period it may start (delayed updates:
    at most D rounds ahead of the last average). On a virtual clock the engine then
    schedules it pipelined: its next computation starts when its last one ended and the
    (D-round-old) model it needs has arrived, so uploads and downloads overlap work.
    """

    name = "sync"
    pipelined = True

    def sites_problem(self, num_sites: int) -> str | None:
        """Every site's period makes the round: any number of sites will do."""
        return None

    def dispatch_targets(self, view: EngineView) -> tuple[int, ...]:
        """Idle sites whose work did not fail this round; the strategy picks periods.

        A site that failed (error, rejected, overdue) waits for the next round, so one
        that always fails cannot keep a round open by failing again and again; one whose
        update the guard holds (no norm reference yet) waits until it is judged, so that a
        fast site cannot send the guard's first reference alone, period after period.
        """
        skip = view.failed_nodes | view.held_nodes
        return tuple(n for n in view.idle_nodes if n not in skip)

    def judge(self, dispatch: Dispatch, view: EngineView) -> Verdict:
        """Every well-formed update joins the average of its own period."""
        return Verdict(APPLIED)

    def ready_to_aggregate(self, view: EngineView) -> bool:
        """Nothing for this round (or earlier) is out, and the round had its chance.

        It had its chance once something was sent for it, or once sites are working on
        later rounds: a site that sat this round out (simulated availability) moves on
        to the next period when it is back, so waiting for it would wait forever.

        While the guard holds an update (no norm reference for its kind yet) and work is
        still out, the round waits too: a site that worked ahead sent the first update of a
        later period's fragment (streaming sync: a kind of its own), and the others' updates
        of that period, on their way, are its reference. Closed now, the round would judge
        it against its own norm (a million-fold update was applied so; found by a review).
        Held sites get no work, so what is out ends and the wait with it.
        """
        outstanding = view.periods_outstanding
        if any(period <= view.server_round for period in outstanding):
            return False
        if view.held_nodes and outstanding:
            return False
        return view.sent_for_round > 0 or bool(outstanding)

    def to_cancel(self, view: EngineView) -> tuple[int, ...]:
        """Never: a cancelled period would cost the site its place in the swap."""
        return ()

    def round_finished(self, train_loss: float | None) -> None:
        """Nothing adapts."""

    def state_dict(self) -> dict[str, Any]:
        """No state of its own: periods live in the strategy (and the engine's counts)."""
        return {"mode": self.name, "pipelined": True}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Accept only a ``PeriodSync`` state (``CheckpointError`` otherwise)."""
        problems = StateProblems("the pipelined sync policy")
        if problems.require(state, "mode", "pipelined") and not state["pipelined"]:
            problems.add(f"the checkpoint ran sync mode {state['mode']!r}, not a pipelined one")
        problems.raise_if_any()
