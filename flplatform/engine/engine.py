"""The round engine: push and pull over Flower's Grid, one message in flight per site.

Flower's ``Strategy.start`` is a synchronous barrier around ``grid.send_and_receive``:
no staleness, no partial rounds, no per-site accounting. This engine instead

* pushes training messages with ``grid.push_messages`` and pulls replies with
  ``grid.pull_messages`` (which never blocks), keeping at most one message per site;
* tags every dispatch with the model version sent (also as the message's ``group_id``),
  and computes the staleness of every arrival against the current version;
* measures every message and reply in both directions as Flower's SuperLink counts its
  traffic (``wire``), so that the ledger's bytes are the wire's;
* hands each well-formed arrival to the strategy as it comes (streaming aggregation), after
  the ``UpdateGuard`` has said how much of it counts (replays, weight caps, norm clipping),
  and asks an ``AggregationPolicy`` when the arrivals so far become a new model version;
* never takes a step that would make the model non-finite (``StepRefused``).

On a ``VirtualClock`` (simulation) arrivals are judged in simulated order: an arrival is
judged only when no outstanding message could land before it, the clock jumps to it, and
its site is given work again before the next arrival is judged. Cancelling a straggler
frees the site at once in that order; its next message is pushed when Flower hands back
the cancelled one, so a site still never holds two messages.

The parts, one job each: ``sites`` (one state per site), ``mailbox`` (messages in flight),
``discovery`` (new sites), ``rows`` (ledger rows), ``evaluation`` (federated evaluation),
``versions`` (model versions in use), ``stop_rule`` (when a failing run stops),
``divergence`` (when training diverges, reported once with its likely fix). What the
engine asks of a strategy is ``strategy.EngineStrategy``; of a policy,
``policy.AggregationPolicy``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from flplatform.core import keys
from flplatform.core.checkpoint import CheckpointError, StateProblems
from flplatform.core.errors import (
    ConfigError,
    FLPlatformError,
    HalvesDisagree,
    NoProgress,
    RunFailed,
    StepRefused,
    UpdateRejected,
)
from flplatform.core.text import seconds_text
from flplatform.engine import rows
from flplatform.engine.bench import SiteBench
from flplatform.engine.clock import Clock, Schedule, WallClock, planned_steps
from flplatform.engine.digest import arrays_digest
from flplatform.engine.discovery import introduce, ledger_profile, query_traffic, site_query
from flplatform.engine.divergence import DivergenceWatch, ReportedLoss
from flplatform.engine.evaluation import evaluate_round
from flplatform.engine.events import (
    APPLIED,
    BUFFERED,
    CANCELLED,
    DROPPED,
    REJECTED,
    SITE_BACK_EVENT,
    SITE_LOST_EVENT,
    SITE_SILENT_EVENT,
    STOPPED_EARLY_EVENT,
    Dispatch,
    EvaluationOutcome,
    LedgerSink,
    NullLedger,
    RoundSummary,
    SiteInfo,
    TrafficOutcome,
    UpdateOutcome,
    node_name,
    presence_sentence,
)
from flplatform.engine.guard import Decision, GuardOptions, Ruling, UpdateGuard
from flplatform.engine.mailbox import (
    PULL_CHUNK,
    TTL_GRACE_SECONDS,
    Arrival,
    Mailbox,
    SavedWork,
    address,
    poll_wait,
)
from flplatform.engine.policy import AggregationPolicy, EngineView
from flplatform.engine.replies import (
    finite,
    halves_disagree,
    record_of,
    reported_losses,
    reported_metrics,
    site_info,
)
from flplatform.engine.rows import (
    REFUSED,
    SILENT,
    UNAVAILABLE,
    no_reply_within,
    refused_at_site,
    site_error,
)
from flplatform.engine.sites import Phase, Sites
from flplatform.engine.stop_rule import DEFAULT_MAX_FAILED_ROUNDS, FailureStreak
from flplatform.engine.strategy import EngineStrategy, SubsetGrid, Update, Work
from flplatform.engine.synchrony import Synchrony
from flplatform.engine.versions import ModelVersions
from flplatform.engine.wire import (
    ContentSize,
    delivery_bytes,
    made_by_superlink,
    measure,
    reply_traffic,
)

log = logging.getLogger("flplatform.engine")
# While work is out, how often the engine asks the SuperLink which sites it still lists (s).
PRESENCE_CHECK_SECONDS = 5.0
# While it waits for its sites to connect, how often the engine asks the SuperLink at
# first (s); less often as the wait goes on (``mailbox.poll_wait``).
STARTUP_POLL_SECONDS = 0.2

# A refused site is not offered work again for this long (it may be reconnecting).
REFUSED_BACKOFF = 5.0
# A new node that names a site whose SuperNode is still listed is a restart while Flower
# still lists the dead node (dropped when its heartbeat lapses: about a minute) or, once
# it has waited this long, a second SuperNode given the same site name: said in the run.
CLAIM_WARNING_SECONDS = 180.0
CANCELLED_REASON = "cancelled: the step it was computing for was decided without it"
# The ``kind`` of a run's state tree (a checkpoint): what ``resume_from`` accepts.
STATE_KIND = "flplatform-run-state"


@dataclass
class _RoundState:
    server_round: int
    started_at: float  # wall
    clock_started_at: float
    train_config: ConfigRecord | None = None
    dispatched: int = 0
    applied: int = 0
    applied_nodes: set[int] = field(default_factory=set)
    failed_nodes: set[int] = field(default_factory=set)
    outcomes: list[UpdateOutcome] = field(default_factory=list)
    # replies that came back and failed: a site's error, or rejected by the strategy
    failed_replies: list[UpdateOutcome] = field(default_factory=list)
    # updates the guard holds until the round closes: ticket → (its row, the update, scale,
    # its node)
    waiting: dict[int, tuple[UpdateOutcome, Update, float, int]] = field(default_factory=dict)
    # every reply's losses as sent, non-finite ones too (the rows keep finite ones only),
    # and where each row's are (an update the guard held is refused only when it settles)
    losses: list[ReportedLoss] = field(default_factory=list)
    losses_of: dict[int, int] = field(default_factory=dict)  # id(row) → index in losses
    # replies carrying a site's error (its process died, its code raised)
    site_failures: list[UpdateOutcome] = field(default_factory=list)
    # the benched sites are offered this round after all: nothing could go without them
    bench_lifted: bool = False


class RoundEngine:
    """Drive a strategy over a Grid, round by round, writing each round to a ledger.

    Parameters
    ----------
    grid : Grid
        Flower's Grid of the running ServerApp.
    strategy : EngineStrategy
        The algorithm (e.g. ``strategies.local_sgd.LocalSGDAveraging``).
    policy : AggregationPolicy, optional
        When arrivals are aggregated; fully synchronous by default.
    clock : Clock, optional
        Orders arrivals; the wall clock by default, a ``VirtualClock`` in simulation.
    ledger : LedgerSink, optional
        Receives sites and finished rounds.
    round_timeout : float
        Seconds a site may take to answer one message. Messages' TTL is this plus
        ``TTL_GRACE_SECONDS``, so an abandoned message also expires at the SuperLink.
    required_sites : int
        Nodes that must be connected before the first round.
    startup_timeout : float
        Seconds to wait for the required nodes to connect and introduce themselves
        (simulated sites start Ray actors and import torch first), registered sites that
        stayed silent included (a deployment's: its ``--wait-timeout``).
    query_timeout : float, optional
        Seconds a connected node has to answer the site query (the first message it gets
        from the run), when shorter than the wait above. A node that does not answer is
        *silent*: named at once (a warning and a ``site-silent`` ledger event), given no
        work, so that no round waits for it, and asked again each round while Flower
        holds no message of it, until it answers (``site-back``). None: the startup
        timeout at the start, the round timeout for nodes that join later.
    poll_interval : float
        Seconds between pulls when nothing arrived, at first; longer as the wait goes
        on (``mailbox.poll_wait``: a tenth of the wait, up to half a second; 0 sets no
        shortest sleep, not a busy loop).
    on_round : callable, optional
        Called with each ``RoundSummary`` (progress displays, logs).
    max_failed_rounds : int
        Stop the run (``NoProgress``) after this many rounds in a row that applied no
        update although replies came back and failed; 0 never stops.
        See ``FailureStreak`` for which rounds count.
    guard : UpdateGuard, optional
        Checks every update before it counts. None: a guard that checks nothing (every
        update counts as its site claims); ``flplatform.start`` gives one that does.
    checkpoints : bool
        Build the engine's whole state after each round (``state_dict``) and hand it to
        the ledger with the round: ``ledger.record_round(summary, state)``.
    run_key : str
        A stable id of the run (the same after a resume). When given, every training
        message's ``config`` carries it (``run-key``) and the message's 1-based index
        among those sent to its site (``site-work``), so that a site can restore the
        state it had before that work (see ``flplatform.core.keys``).
    site_config : ConfigRecord, optional
        Sent with every message under ``keys.RUN_CONFIG`` (see ``Mailbox.stamp``).
    """

    def __init__(
        self,
        grid: Grid,
        strategy: EngineStrategy,
        *,
        policy: AggregationPolicy | None = None,
        clock: Clock | None = None,
        ledger: LedgerSink | None = None,
        round_timeout: float = 600.0,
        required_sites: int = 1,
        startup_timeout: float = 300.0,
        query_timeout: float | None = None,
        poll_interval: float = 0.05,
        on_round: Callable[[RoundSummary], None] | None = None,
        max_failed_rounds: int = DEFAULT_MAX_FAILED_ROUNDS,
        guard: UpdateGuard | None = None,
        checkpoints: bool = False,
        run_key: str = "",
        site_config: ConfigRecord | None = None,
    ) -> None:
        self.grid = grid
        self.strategy = strategy
        self.policy: AggregationPolicy = policy or Synchrony("sync")
        self.clock: Clock = clock or WallClock()
        self.ledger: LedgerSink = ledger or NullLedger()
        self.round_timeout = round_timeout
        self.required_sites = required_sites
        self.startup_timeout = startup_timeout
        self.query_timeout = query_timeout
        self.poll_interval = poll_interval
        self.on_round = on_round
        self.failure_streak = FailureStreak(max_failed_rounds)
        self.bench = SiteBench()  # sites sitting out rounds after failed replies
        # this round's replies from sites without the strategy's mod, why (engine.replies)
        self._disagreements: list[str] = []
        self.guard = guard or UpdateGuard(GuardOptions.off())
        self._tickets = 0
        self.divergence = DivergenceWatch()
        self.sites = Sites()  # every site that ever joined the run, and its state
        self.mailbox = Mailbox(
            grid,
            self.clock,
            self.sites.name,
            poll_interval,
            site_config=site_config,
            position=self.sites.position,
        )
        self.versions = ModelVersions()
        self.version = 0
        self.arrays = ArrayRecord()
        self._sent_per_period: dict[int, int] = {}  # training messages sent, by period
        self.checkpoints = checkpoints
        self.run_key = run_key
        self._site_work: dict[int, int] = {}  # node → training messages sent to it
        # New nodes that named a site of the run (its SuperNode started again), in the
        # order they came, until one takes the site's place (``_take_over_restarted``).
        self._restarted: dict[int, SiteInfo] = {}
        # those waiting beside their site's connected SuperNode: since when (monotonic,
        # from the first round start that saw it), and those said in the run's warnings
        self._claimed_since: dict[int, float] = {}
        self._claims_said: set[int] = set()
        self._unnamed_said = False  # sites named by their node ids: said once per run
        self._warning: str | None = None  # for the next round's summary
        self._finished_round = 0  # the last round recorded
        self._server_round: int | None = None  # the round in progress (None: none yet)
        self._result = Result()
        self._resend: list[SavedWork] = []  # a resumed run's work in flight, sent first

    # ======================================================================= run
    def run(
        self,
        initial_arrays: ArrayRecord,
        *,
        num_rounds: int,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        federated_evaluation: bool = False,
        resume: Mapping[str, Any] | None = None,
        should_stop: Callable[[int, Result], bool] | None = None,
    ) -> Result:
        """Run server steps up to round ``num_rounds`` and return Flower's ``Result``.

        ``resume``: a state tree from ``state_dict()`` (a checkpoint). The run then goes
        on from the round after the one it was taken at, with everything restored and
        the work that was in flight sent again (see ``resume_from``); ``initial_arrays``
        is ignored and the initial evaluation is not repeated.

        ``should_stop``: asked after each recorded round but the last, with the round and
        the result so far (``result.arrays`` is that round's model); True ends the run
        there, with a ``STOPPED_EARLY_EVENT``. The stop rules (``NoProgress``, halves that
        disagree) are applied first: a failing run fails. A resumed run asks it first
        about the round it resumes after (once its sites are back), so that a run stopped
        just before its process died stops again.
        """
        result = self._result = Result(arrays=initial_arrays)
        if resume is None:
            self.arrays, self.version = initial_arrays, 0
            self.versions.start(self.clock.now())
            self.discover_sites()
            if evaluate_fn is not None:
                initial = evaluate_fn(0, initial_arrays)
                if initial is not None:
                    result.evaluate_metrics_serverapp[0] = initial
        else:
            self.resume_from(resume)
            if self._asked_to_stop(should_stop, self._finished_round, num_rounds):
                return result

        for server_round in range(self._finished_round + 1, num_rounds + 1):
            self._server_round = server_round
            self.refresh_sites()
            self._take_over_restarted()
            summary, train_metrics, failed_replies = self._train_round(server_round, train_config)
            metrics: dict[str, float] = {}
            # ---- central evaluation on the server's held-out set
            if evaluate_fn is not None:
                central = evaluate_fn(server_round, self.arrays)
                if central is not None:
                    result.evaluate_metrics_serverapp[server_round] = central
                    metrics.update(_floats(central))
            # ---- federated evaluation on the sites, when asked
            evaluations: tuple[EvaluationOutcome, ...] = ()
            if federated_evaluation:
                site_metrics, evaluations = evaluate_round(
                    self.strategy,
                    self.grid,
                    self.mailbox,
                    self.sites,
                    server_round=server_round,
                    arrays=self.arrays,
                    model_version=self.version,
                    evaluate_config=evaluate_config,
                    timeout=self.round_timeout,
                )
                if site_metrics is not None:
                    result.evaluate_metrics_clientapp[server_round] = site_metrics
                    # site_accuracy, site_loss: the sites' view beside the server's own
                    metrics.update({f"site_{k}": v for k, v in _floats(site_metrics).items()})
            if train_metrics is not None:
                result.train_metrics_clientapp[server_round] = train_metrics
            # ---- record the round, then apply the stop rule
            summary = replace(
                summary, finished_at=time.time(), metrics=metrics, evaluations=evaluations
            )
            stop: NoProgress | None = None
            try:  # observed before the checkpoint, so that it holds this round too
                self.failure_streak.observe(
                    server_round, applied=_applied(summary.updates), failed_replies=failed_replies
                )
            except NoProgress as exc:
                stop = exc
            self._finished_round = server_round
            if self.checkpoints:
                self.ledger.record_round(summary, self.state_dict())
            else:
                self.ledger.record_round(summary)
            if self.on_round is not None:
                self.on_round(summary)
            # Only now: the round that trips the rule is in the ledger when the run stops.
            # No site has the strategy's mod: the halves disagree, and no round will apply
            # anything; one site without it (misconfigured, outdated, hostile) is only
            # rejected, as any bad reply is.
            disagreements, self._disagreements = self._disagreements, []
            if (
                disagreements
                and len(disagreements) == len(failed_replies)
                and not _applied(summary.updates)
                and self.failure_streak.limit
            ):
                raise HalvesDisagree(disagreements[0])
            if stop is not None:
                raise stop
            if self._asked_to_stop(should_stop, server_round, num_rounds):
                break
        result.arrays = self.arrays
        return result

    def _asked_to_stop(
        self, should_stop: Callable[[int, Result], bool] | None, server_round: int, planned: int
    ) -> bool:
        """Whether ``should_stop`` ends the run after ``server_round`` (recorded if so)."""
        if should_stop is None or server_round < 1 or server_round >= planned:
            return False
        self._result.arrays = self.arrays
        if not should_stop(server_round, self._result):
            return False
        log.info("should_stop: the run ends after round %d of %d", server_round, planned)
        self.ledger.record_event(STOPPED_EARLY_EVENT, {"round": server_round, "planned": planned})
        return True

    # ============================================================ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The whole run at the last round boundary, as checkpoint data.

        ``{"kind", "server_round", "model_version", "model", "engine"}``: ``model`` is the
        global model (all ``flplatform export`` reads); ``engine`` everything else the
        run needs to go on exactly: the strategy's and the policy's state, the clock,
        the sites (by node id, with their names), the work in flight with its content,
        the replies not yet judged, the model versions that work was sent, the guard,
        the divergence watch, the stop rule, counters and the ``Result`` history.
        """
        result = self._result
        return {
            "kind": STATE_KIND,
            "server_round": self._finished_round,
            "model_version": self.version,
            "model": self.arrays,
            "engine": {
                "run_key": self.run_key,
                "strategy_name": self.strategy.ledger_name,
                "strategy": self.strategy.state_dict(),
                "policy": self.policy.state_dict(),
                "clock": self.clock.state_dict(),
                "sites": self.sites.state_dict(),
                "site_work": dict(self._site_work),
                "mailbox": self.mailbox.state_dict(),
                # the sites' work in the order it was planned (the order the policy sees)
                "planned": [d.node_id for d in self.sites.training()],
                "versions": self.versions.state_dict(),
                "guard": self.guard.state_dict(),
                "divergence": self.divergence.state_dict(),
                "failure_streak": self.failure_streak.state_dict(),
                "bench": self.bench.state_dict(),
                "sent_per_period": dict(self._sent_per_period),
                "tickets": self._tickets,
                "history": {
                    "train_metrics_clientapp": dict(result.train_metrics_clientapp),
                    "evaluate_metrics_clientapp": dict(result.evaluate_metrics_clientapp),
                    "evaluate_metrics_serverapp": dict(result.evaluate_metrics_serverapp),
                },
            },
        }

    def resume_from(self, state: Mapping[str, Any]) -> dict[int, int]:
        """Restore the engine from ``state_dict()`` output; return old → new node ids.

        Waits (``startup_timeout``) for every site the state names to connect and
        introduce itself (a registered one that stays silent, to answer), and matches them
        by site name (a resumed simulation's nodes have new ids). The work that was in
        flight is sent again, unchanged, when the next round opens. Raises
        ``CheckpointError`` for a state that is not a run state or does not fit this run,
        ``RunFailed`` when a site does not come back.
        """
        problems = StateProblems("the run")
        kind = state.get("kind") if isinstance(state, Mapping) else None
        if kind != STATE_KIND:
            raise CheckpointError(f"not a run state (kind {kind!r}, expected {STATE_KIND!r})")
        names = ("server_round", "model_version", "model", "engine")
        if not problems.require(state, *names):
            problems.raise_if_any()
        engine = state["engine"]
        parts = (
            *("run_key", "strategy_name", "strategy", "policy", "clock", "sites", "site_work"),
            *("mailbox", "planned", "versions", "guard", "divergence", "failure_streak"),
            *("sent_per_period", "tickets", "history"),
        )
        if not problems.require(engine, *parts):
            problems.raise_if_any()
        problems.number(state["server_round"], "server_round", integer=True)
        problems.number(state["model_version"], "model_version", integer=True)
        if not isinstance(state["model"], ArrayRecord):
            problems.add("'model' must be an ArrayRecord")
        if engine["strategy_name"] != self.strategy.ledger_name:
            problems.add(
                f"it ran strategy {engine['strategy_name']!r}, this run "
                f"{self.strategy.ledger_name!r}"
            )
        if not isinstance(engine["planned"], list):
            problems.add("'planned' must list node ids")
        saved_sites = engine["sites"]
        if not isinstance(saved_sites, list) or not all(
            isinstance(s, Mapping) and isinstance(s.get("name"), str) for s in saved_sites
        ):
            problems.add("'sites' must list the run's sites by name")
        problems.raise_if_any()

        # ---- the same sites, with this run's node ids
        nodes = self._rediscover(
            [s["name"] for s in saved_sites],
            by_node_id={s["name"] for s in saved_sites if s["name"] == node_name(s["node_id"])},
        )
        by_name = {info.name: node_id for node_id, info in self.sites.infos().items()}
        mapping = {s["node_id"]: by_name[s["name"]] for s in saved_sites}
        joined_since = [n for n in nodes if n not in mapping.values()]

        # ---- every part, each validating its own state
        self.arrays, self.version = state["model"], int(state["model_version"])
        self.clock.load_state_dict(engine["clock"])
        self.sites.load_state_dict(saved_sites, nodes=mapping)
        self.versions.load_state_dict(engine["versions"], current=(self.version, self.arrays))
        self.guard.load_state_dict(engine["guard"], nodes=mapping)
        for node_id in joined_since:
            info = self.sites.info(node_id)
            self.guard.declare(node_id, info.num_examples if info else None)
        self.divergence.load_state_dict(engine["divergence"])
        self.failure_streak.load_state_dict(engine["failure_streak"])
        self.bench.load_state_dict(engine.get("bench"))  # (none before 2026-11-29)
        self.policy.load_state_dict(engine["policy"])
        self.strategy.load_state_dict(engine["strategy"], nodes=mapping)
        work = self.mailbox.load_state_dict(engine["mailbox"], nodes=mapping)
        self._restore_counters(engine, mapping)
        self._load_history(engine["history"])

        # ---- the sites take up their work again: replies not yet judged, then work out
        for arrival in self.mailbox.arrivals:
            self.sites.train(arrival.dispatch)
            self.sites.arrive(arrival.dispatch.node_id)
        planned = {mapping.get(n, n): i for i, n in enumerate(engine["planned"])}
        working = [w for w in work if w.tray != "cancelled"]  # a cancelled site is free
        for saved in sorted(working, key=lambda w: planned.get(w.dispatch.node_id, len(planned))):
            if not self.sites.is_silent(saved.dispatch.node_id):  # else: dropped, not sent
                self.sites.train(saved.dispatch)
        self._resend = work
        self._finished_round = int(state["server_round"])
        log.info(
            "resumed after round %s (model version %s): %s message(s) sent again, "
            "%s reply(ies) waiting to be judged",
            self._finished_round,
            self.version,
            len(work),
            len(self.mailbox.arrivals),
        )
        return mapping

    def _rediscover(self, names: Sequence[str], *, by_node_id: set[str]) -> list[int]:
        """Introduce nodes until every site in ``names`` is among them, then wait for the
        registered ones that stayed silent (``_await_registered_silent``); the node ids
        listed then.

        ``by_node_id``: the names that are node ids (``node-<id>``). Once as many sites
        are here as the checkpoint had and only such names are missing, they will not
        come (a simulation's node ids are new at every start-up): refused then, not after
        the start-up timeout.
        """
        started = time.monotonic()
        deadline = started + self.startup_timeout
        while True:
            node_ids = sorted(self.grid.get_node_ids())
            new = [n for n in node_ids if n not in self.sites and n not in self._restarted]
            if new:
                self._introduce(new, timeout=self.startup_timeout, start_deadline=deadline)
            present = {info.name for info in self.sites.infos().values()}
            missing = [name for name in names if name not in present]
            if not missing:
                self._await_registered_silent(deadline)
                return sorted(self.grid.get_node_ids())
            if len(self.sites) >= len(names) and set(missing) <= by_node_id:
                raise CheckpointError(f"cannot resume: {unnamed_sites(len(missing))}")
            if time.monotonic() > deadline:
                raise RunFailed(
                    f"cannot resume: site(s) {', '.join(missing)} of the checkpoint did not "
                    f"connect within {seconds_text(self.startup_timeout)} s (connected: "
                    f"{', '.join(sorted(present)) or 'none'}); a run resumes with all its "
                    "sites, under the same names"
                )
            time.sleep(poll_wait(time.monotonic() - started, STARTUP_POLL_SECONDS))

    def _restore_counters(self, engine: Mapping[str, Any], nodes: Mapping[int, int]) -> None:
        problems = StateProblems("the engine's counters")
        site_work, sent = engine["site_work"], engine["sent_per_period"]
        if not isinstance(engine["run_key"], str):
            problems.add("'run_key' must be text")
        problems.number(engine["tickets"], "tickets", integer=True)
        for name, counts in (("site_work", site_work), ("sent_per_period", sent)):
            if not isinstance(counts, Mapping) or not all(
                isinstance(k, int) and problems.number(v, name, integer=True)
                for k, v in counts.items()
            ):
                problems.add(f"'{name}' must map whole numbers to counts")
        if isinstance(site_work, Mapping):
            unknown = [n for n in site_work if n not in nodes]
            if unknown:
                problems.add(f"'site_work' names nodes {unknown} that are not sites of the run")
        problems.raise_if_any()
        if self.run_key and engine["run_key"] != self.run_key:
            log.info("resuming run key %r (this run was given %r)", engine["run_key"], self.run_key)
        self.run_key = engine["run_key"]
        self._site_work = {nodes[n]: int(v) for n, v in site_work.items()}
        self._sent_per_period = {int(p): int(v) for p, v in sent.items()}
        self._tickets = int(engine["tickets"])

    def _load_history(self, history: Any) -> None:
        problems = StateProblems("the run's metric history")
        fields = (
            "train_metrics_clientapp",
            "evaluate_metrics_clientapp",
            "evaluate_metrics_serverapp",
        )
        if problems.require(history, *fields):
            for name in fields:
                records = history[name]
                if not isinstance(records, Mapping) or not all(
                    isinstance(r, int) and isinstance(m, MetricRecord) for r, m in records.items()
                ):
                    problems.add(f"'{name}' must map rounds to metric records")
        problems.raise_if_any()
        for name in fields:
            setattr(self._result, name, dict(history[name]))

    def _resend_saved(self, state: _RoundState) -> None:
        """A resumed run: send the work that was in flight at the checkpoint, unchanged."""
        work, self._resend = self._resend, []
        # A silent site's query of this start-up is still out: it gets none of its work
        # (a site never holds two messages), and what it was training is dropped.
        for saved in [w for w in work if self.sites.is_silent(w.dispatch.node_id)]:
            if saved.tray != "cancelled":
                node_id = saved.dispatch.node_id
                self._site_work[node_id] = self._site_work.get(node_id, 1) - 1
                state.outcomes.append(self._no_update(saved.dispatch, DROPPED, SILENT))
        work = [w for w in work if not self.sites.is_silent(w.dispatch.node_id)]
        for saved in self.mailbox.resend(work, self.round_timeout):
            node_id = saved.dispatch.node_id
            if saved.tray == "cancelled":  # its deferred work need not wait for it
                self._push_deferred(node_id, state)
                continue
            self._site_work[node_id] = self._site_work.get(node_id, 1) - 1
            state.outcomes.append(self._no_update(saved.dispatch, DROPPED, REFUSED))
            state.failed_nodes.add(node_id)
            self.sites.refuse(node_id, time.monotonic() + REFUSED_BACKOFF)

    @property
    def finished_round(self) -> int:
        """The last round recorded (0 before the first)."""
        return self._finished_round

    @property
    def simulated_seconds(self) -> float | None:
        """Simulated time the federation has taken so far (None on the wall clock)."""
        return self.clock.now() if self.clock.virtual else None

    # ============================================================ site discovery
    def discover_sites(self) -> dict[int, SiteInfo]:
        """Wait for the required nodes, then ask each who it is (a QUERY message), refuse
        a K they cannot reach, and wait for every registered site to answer
        (``_await_registered_silent``).

        A plain Flower ClientApp that does not answer queries still joins, named after
        its node id.
        """
        started = time.monotonic()
        deadline = started + self.startup_timeout
        node_ids = sorted(self.grid.get_node_ids())
        while len(node_ids) < self.required_sites or self._short_of_k(len(node_ids)):
            if time.monotonic() > deadline:
                if len(node_ids) >= self.required_sites:
                    break  # too few for K: run() refuses it, saying so
                raise RunFailed(
                    f"only {len(node_ids)} of {self.required_sites} sites connected within "
                    f"{seconds_text(self.startup_timeout)} s; start more SuperNodes or lower "
                    "min-sites"
                )
            time.sleep(poll_wait(time.monotonic() - started, STARTUP_POLL_SECONDS))
            node_ids = sorted(self.grid.get_node_ids())
        self._introduce(node_ids, timeout=self.startup_timeout, start_deadline=deadline)
        # Options set in a ServerApp's own code meet the sites only now (a CLI checks its
        # own before anything starts): a K no step could ever reach is refused before the
        # first round, not waited out (discovery waited for K sites when the caller gave
        # no number to expect; silent sites count).
        problem = self.policy.sites_problem(len(self.sites))
        if problem:
            raise ConfigError(
                f"{problem} (the sites that joined before the first round; "
                "required_sites=N waits for N)"
            )
        self._await_registered_silent(deadline)
        return self.sites.infos()

    def _await_registered_silent(self, deadline: float) -> None:
        """Start-up: wait until ``deadline`` for each silent site with a registered name
        (a deployment's) to answer, so that a run starts with every site that is alive.

        After a crash, a site's SuperNode started again joins only once Flower stops
        counting the dead one (its heartbeat lapses), and the query sent to the dead one
        goes unanswered meanwhile: such a site is asked again whenever Flower holds no
        message of it (``refresh_sites``; a SuperNode that got a new node id takes its
        site's place, ``_take_over_restarted``) until it answers. A SuperNode that takes
        messages and never answers is waited for as long, then the run starts without
        it, named silent. Sites named by their node ids (no registry) cannot be told
        from a dead node Flower still lists: not waited for.
        """
        waiting = self._registered_silent()
        started = time.monotonic()
        # no round yet: only the sites' queries are out, and their replies are late ones
        state = _RoundState(0, time.time(), self.clock.now())
        while waiting and time.monotonic() < deadline:
            time.sleep(poll_wait(time.monotonic() - started, STARTUP_POLL_SECONDS))
            self.refresh_sites(start_deadline=deadline)
            self._take_over_restarted()
            pending = self.mailbox.waiting_ids()
            for start in range(0, len(pending), PULL_CHUNK):
                self._pull(pending[start : start + PULL_CHUNK], state)
            waiting = self._registered_silent()
        if waiting:
            log.warning(
                "starting without %s: silent since the start-up (no answer to the site "
                "query); each trains once its SuperNode answers",
                ", ".join(waiting),
            )

    def _registered_silent(self) -> list[str]:
        """The silent sites named by a registry (not by their node ids)."""
        return sorted(self.sites.name(n) for n in self.sites.silent() if self._registered(n))

    def _registered(self, node_id: int) -> bool:
        """Whether a silent site has a name of its own: a registry's (it said none)."""
        return self.sites.name(node_id) != node_name(node_id)

    def _short_of_k(self, joined: int) -> bool:
        """Whether to wait for more sites for K: only when the caller did not say how many
        to expect (``required_sites`` 0), since more may still be starting; with a number
        given, the K check after discovery refuses at once."""
        return not self.required_sites and self.policy.sites_problem(joined) is not None

    def refresh_sites(self, *, start_deadline: float | None = None) -> None:
        """Notice nodes that joined (introduce them), left (give them no work, and say so
        at once: a warning and a ledger event) or came back (say so too).
        ``start_deadline``: at start-up, the end of the wait for silent sites (a new
        node's query waits no longer)."""
        node_ids = set(self.grid.get_node_ids())
        self._mark_listed(node_ids)  # first: a site that left may be back as a new node
        self._restarted = {n: r for n, r in self._restarted.items() if n in node_ids}
        new = sorted(n for n in node_ids if n not in self.sites and n not in self._restarted)
        if new:
            timeout = self.round_timeout
            if start_deadline is not None:
                timeout = min(timeout, max(0.0, start_deadline - time.monotonic()))
            self._introduce(new, timeout=timeout, start_deadline=start_deadline)
        self._ask_silent()

    def _mark_listed(self, node_ids: set[int]) -> None:
        """The sites the SuperLink lists now: the others get no work; each that left or
        came back since the last look gets a warning and a ledger event."""
        left, back = self.sites.set_connected(node_ids)
        back = [n for n in back if not self.sites.is_silent(n)]  # back when it answers
        for kind, nodes in ((SITE_LOST_EVENT, left), (SITE_BACK_EVENT, back)):
            for node_id in nodes:
                self._say_presence(kind, node_id)

    def _say_presence(self, kind: str, node_id: int, **more: float) -> None:
        """A warning and a ledger event: a site left, fell silent or is back."""
        detail = {
            "site": self.sites.name(node_id),
            "round": self._server_round,
            "connected": self.sites.census().connected,
            "sites": len(self.sites),
            **more,
        }
        log.warning("%s", presence_sentence(kind, detail))
        try:
            self.ledger.record_event(kind, detail)
        except FLPlatformError as exc:  # the warning is said; the run goes on
            log.warning("could not record %s of site %s: %s", kind, detail["site"], exc)

    def _heard_from(self, node_id: int, reply: Message) -> None:
        """A silent site's SuperNode answered at last: it gets work again (said as back
        when the SuperLink lists it; else when it is listed again). It keeps the name it
        was given when it fell silent (on a deployment, its registered one); the examples
        its answer declares cap its updates' claims, as if it had answered in time."""
        self.sites.set_silent(node_id, False)
        info = site_info(node_id, reply)
        if info.num_examples is not None:
            self.guard.declare(node_id, info.num_examples)
        if self.sites.is_connected(node_id):
            self._say_presence(SITE_BACK_EVENT, node_id)

    def _ask_silent(self) -> None:
        """Ask each silent site that Flower holds no message of who it is, again, without
        waiting: its answer, when Flower hands it back, makes it a site again
        (:meth:`_pull`); Flower's error (expired, node unavailable) leaves it silent, to
        be asked again. No round waits for these queries."""
        # (a site never holds two messages: a resumed run's silent site may be idle while
        # the query of its start-up is still out)
        nodes = [n for n in self.sites.silent_idle() if not self.mailbox.holds(n)]
        if not nodes:
            return
        timeout = self.query_timeout if self.query_timeout is not None else self.round_timeout
        queries = [site_query(node_id, timeout) for node_id in nodes]
        sent = self.mailbox.post(queries, model_version=self.version, timeout=timeout)
        for dispatch in sent:
            if dispatch.message_id:  # refused: asked again next time
                self.sites.give_up(dispatch.node_id)
        traffic = [query_traffic(d, None, self.sites.name(d.node_id)) for d in sent if d.message_id]
        if traffic:
            self.ledger.record_traffic(traffic, self._server_round)

    def _introduce(
        self,
        node_ids: Sequence[int],
        *,
        timeout: float,
        take_over: bool = True,
        start_deadline: float | None = None,
    ) -> None:
        """Ask new nodes who they are and add them as sites; with ``take_over``, a node that
        names a site of the run waits to take its place instead (a restarted SuperNode).
        ``start_deadline``: at start-up, until when a registered site that stays silent
        is waited for (said with its ``site-silent`` event)."""
        if self.query_timeout is not None:
            timeout = min(timeout, self.query_timeout)
        held = self.sites.names() if take_over else set()
        unanswered, restarted = introduce(
            node_ids,
            mailbox=self.mailbox,
            sites=self.sites,
            clock=self.clock,
            ledger=self.ledger,
            model_version=self.version,
            timeout=timeout,
            server_round=self._server_round,
            held=held,
        )
        holders = self.sites.holders()
        for new, claim in restarted.items():
            if self.sites.is_connected(holders[claim.name]):
                log.warning(
                    "node %s says it is site %s, whose SuperNode is connected: it gets no "
                    "work, and takes the site's place if that one leaves (a restart)",
                    new,
                    claim.name,
                )
        self._restarted.update(restarted)
        unnamed = [n for n in node_ids if n in self.sites and self.sites.name(n) == node_name(n)]
        if unnamed and not self._unnamed_said:
            self._unnamed_said = True
            self._warning = _joined(self._warning, unnamed_sites(len(unnamed)))
        for node_id in unanswered:
            if self.sites.set_silent(node_id, True):
                more = {}
                if start_deadline is not None and self._registered(node_id):
                    more["start_wait"] = float(
                        math.ceil(max(0.0, start_deadline - time.monotonic()))
                    )
                self._say_presence(SITE_SILENT_EVENT, node_id, waited=timeout, **more)
        # The examples a site declares when it joins cap what its updates may claim.
        for node_id in node_ids:
            info = self.sites.info(node_id)
            if info is not None:
                self.guard.declare(node_id, info.num_examples)

    def _take_warning(self) -> str | None:
        """The engine's own warning for the round being summarised, once."""
        warning, self._warning = self._warning, None
        return warning

    def _take_over_restarted(self) -> None:
        """Between rounds (and while the start waits for silent sites): each site whose
        SuperNode started again (a crash, a reboot) takes up its place under its new node
        id, once Flower no longer lists the old node and nothing of it is out (a resumed
        run's saved work included). Of several new nodes that named the site, the latest
        takes it (an earlier one is a restart that died too); the others keep waiting,
        with no work, while they are listed.

        Its name, place, guard record, work count and the strategy's state for it (a
        delayed site's stale contribution, say) move to the new node, so the ledger keeps
        one site and a later resume finds it by name; the site's own state is in its
        snapshots on its disk (``strategies/mods/snapshots.py``). The strategy's part
        goes through its checkpoint state with the node renamed, as a resume does; under
        a strategy that cannot restore its state, the new node joins as a site of its
        own, named apart.
        """
        holders = self.sites.holders()
        self._say_long_claims(holders)
        latest = {info.name: node for node, info in self._restarted.items()}
        for name, new in latest.items():
            old = holders[name]
            if (
                self.sites.is_connected(old)
                or self.sites.phase(old) in (Phase.TRAINING, Phase.ARRIVED)
                or self.mailbox.holds_work(old)
                or old in self.mailbox.queued()
            ):
                continue  # not yet: Flower still lists the old node, or its work is out
            info = self._restarted.pop(new)
            nodes = {n: n for n in self.sites.infos()} | {old: new}
            try:
                self.strategy.load_state_dict(self.strategy.state_dict(), nodes=nodes)
            except (CheckpointError, NotImplementedError) as exc:
                log.warning(
                    "site %s restarted as node %s, but the strategy cannot hand it the "
                    "site's state (%s): it joins as a new site",
                    name,
                    new,
                    exc,
                )
                self._introduce([new], timeout=self.round_timeout, take_over=False)
                continue
            self.sites.take_over(old, info)
            self.guard.take_over(old, new)
            self.guard.declare(new, info.num_examples)
            if old in self._site_work:
                self._site_work[new] = self._site_work.pop(old)
            profile = self.clock.join(name, self.sites.position(new))
            self.ledger.add_site(info, ledger_profile(info, profile))
            self._say_presence(SITE_BACK_EVENT, new, restarted=1)

    def _say_long_claims(self, holders: Mapping[str, int]) -> None:
        """Once, in the run's warnings: each waiting node whose site's SuperNode has been
        connected at every look for ``CLAIM_WARNING_SECONDS`` (two SuperNodes
        started with one name: one of them idles, which only the log said)."""
        now = time.monotonic()
        waiting = {
            new: info.name
            for new, info in self._restarted.items()
            if self.sites.is_connected(holders[info.name])
        }  # the others wait for a SuperNode that left: a restart, taking over soon
        self._claimed_since = {new: self._claimed_since.get(new, now) for new in waiting}
        self._claims_said &= set(self._restarted)
        for new, since in self._claimed_since.items():
            if now - since < CLAIM_WARNING_SECONDS or new in self._claims_said:
                continue
            self._claims_said.add(new)
            name = waiting[new]
            self._warning = _joined(
                self._warning,
                f"node {new} says it is site {name}, but {name}'s SuperNode has stayed "
                f"connected for {seconds_text(now - since)} s: the node gets no work while "
                f"that one is there (two SuperNodes started with one site name?)",
            )

    # ============================================================ training round
    def _train_round(
        self, server_round: int, train_config: ConfigRecord | None
    ) -> tuple[RoundSummary, MetricRecord | None, list[UpdateOutcome]]:
        """One server step; returns its summary, the strategy's metrics, its failed replies."""
        state = _RoundState(server_round, time.time(), self.clock.now(), train_config)
        self.strategy.begin_aggregation(server_round, self.arrays)
        self.guard.begin_round(server_round)
        if self._resend:
            self._resend_saved(state)
        waiting_since = presence_checked = quiet_since = time.monotonic()
        while True:
            # ---- dispatch: the policy says who may get work; the strategy samples
            sent = state.dispatched
            self._dispatch_wanted(state)
            if state.dispatched > sent:  # new work out: its reply is looked for soon
                quiet_since = time.monotonic()
            # ---- pull what has arrived, judging it in clock order; drop overdue sites
            pulled = self._pull_chunks(state)
            self._expire_overdue(state)
            self._judge_ready(state)
            # ---- cancel what the policy no longer wants
            self._cancel_unwanted(state)
            if self.policy.ready_to_aggregate(self._view(state)):
                break
            # ---- wait: for replies, or for sites to join when nothing is on its way
            if pulled:
                waiting_since = quiet_since = time.monotonic()
                continue
            if self.mailbox.empty(besides=self.sites.silent()):
                # The step is still open: sites may join; if none can be given work for
                # a whole round timeout, the run cannot go on.
                if time.monotonic() - waiting_since > self.round_timeout:
                    raise RunFailed(
                        f"round {server_round}: no site could be given work within "
                        f"{seconds_text(self.round_timeout)} s"
                    )
                self.refresh_sites()
            elif time.monotonic() - presence_checked >= PRESENCE_CHECK_SECONDS:
                # A site that dies holding work is said now, not when its work times out
                # (new nodes are introduced when the mailbox is empty: that waits).
                presence_checked = time.monotonic()
                self._mark_listed(set(self.grid.get_node_ids()))
            time.sleep(poll_wait(time.monotonic() - quiet_since, self.poll_interval))

        # ---- aggregate into the next model version
        self._settle(state)
        stepped = True
        try:
            arrays, train_metrics = self.strategy.finish_aggregation()
        except StepRefused as exc:
            arrays, train_metrics = self._step_refused(state, exc)
            stepped = False
        self.guard.round_finished(stepped=stepped)
        if arrays is not None:
            self.arrays = arrays
            self.version += 1
            self.versions.formed(self.version, self.clock.now())
        self._forget_unused_versions()
        self._bench_failed_sites(state)
        train_loss = _example_weighted_loss(state.outcomes)
        if self.policy.pipelined and train_metrics is not None:
            # Updates of later periods land in this round too: the strategy's loss is
            # the one of this round's period.
            period_loss = train_metrics.get(keys.TRAIN_LOSS)
            train_loss = float(period_loss) if isinstance(period_loss, float) else None
        self.policy.round_finished(train_loss)
        summary = RoundSummary(
            server_round=server_round,
            model_version=self.version,
            started_at=state.started_at,
            finished_at=time.time(),
            metrics={},
            train_loss=train_loss,
            updates=tuple(state.outcomes),
            virtual_started_at=state.clock_started_at if self.clock.virtual else None,
            virtual_finished_at=self.clock.now() if self.clock.virtual else None,
            warning=_joined(
                self._take_warning(),
                self._diverged(server_round, train_loss, state.losses),
                self.strategy.take_warning(),
            ),
        )
        return summary, train_metrics, state.failed_replies

    def _diverged(
        self, server_round: int, train_loss: float | None, losses: Sequence[ReportedLoss]
    ) -> str | None:
        """The report of training that diverged this round (once per run), else None."""
        found = self.divergence.observe(server_round, train_loss=train_loss, reported=losses)
        if found is None:
            return None
        return found.describe({i.name: i.feature_scale for i in self.sites.infos().values()})

    # ================================================================== dispatch
    def _dispatch_wanted(self, state: _RoundState) -> None:
        targets = self.policy.dispatch_targets(self._view(state))
        if targets:
            state.dispatched += self._dispatch(state, targets)
        if (
            not state.dispatched
            and not state.bench_lifted
            and self.mailbox.empty()
            and len(self._unbenched(self.sites.idle(), state)) < len(self.sites.idle())
        ):
            # Nothing went out without the benched sites (a strategy that needs more
            # sites than are left, the others gone): this round offers them work too.
            state.bench_lifted = True
            self._dispatch_wanted(state)

    def _dispatch(self, state: _RoundState, targets: Sequence[int]) -> int:
        """Send training messages to sampled targets; return how many were attempted.

        A site the clock says sits this work out (availability) gets a row and no
        message, and does not count as attempted; a site whose cancelled message is
        still out gets its message when that one comes back.
        """
        config = ConfigRecord(dict(state.train_config or {}))  # the strategy may write into it
        config[keys.MODEL_VERSION] = self.version
        idle = set(self._unbenched(self.sites.idle(), state))
        allowed = self.sites.by_name(n for n in targets if n in idle)
        drafts = self.strategy.configure_train(
            state.server_round, self.arrays, config, SubsetGrid(self.grid, allowed)
        )
        messages = address(
            drafts,
            allowed,
            ttl=self.round_timeout + TTL_GRACE_SECONDS,
            model_version=self.version,
        )
        if not messages:
            return 0
        messages = self.mailbox.stamp(messages)  # before anything measures them
        # In join order, not the strategy's (often node-id) order: a resumed run's nodes
        # have new ids, and the order of sending is the order of planning and of rows.
        messages.sort(key=lambda m: self.sites.position(m.metadata.dst_node_id))
        self.versions.hand_out(self.version, self.arrays)
        sizes: dict[int, ContentSize] = {}  # a broadcast shares one content: measure it once
        to_push: list[tuple[Message, Dispatch]] = []
        attempted = 0
        for msg in messages:
            node_id = msg.metadata.dst_node_id
            work = self.strategy.work_for(
                msg, server_round=state.server_round, model_version=self.version
            )
            away = self.clock.away_seconds(self.sites.name(node_id), steps=self._steps(msg))
            if away is not None:  # not counted as dispatched: nothing was sent to wait for
                self.sites.send_away(node_id, self.clock.now() + away)
                self.strategy.message_not_sent(msg)
                # (A pipelined site's timeline must not book the work it skipped.)
                skipped = self._planned(
                    msg, work, state, bytes_down=0, plan=not self.policy.pipelined
                )
                state.outcomes.append(self._no_update(skipped, DROPPED, UNAVAILABLE))
                continue
            attempted += 1
            if self.run_key:
                # Its own config record, measured again per copy: sampling only, nothing
                # is hashed, so measuring each copy costs little.
                msg = self._stamp(msg)
                size = measure(msg.content)
            else:
                key = id(msg.content)
                if key not in sizes:
                    sizes[key] = measure(msg.content)
                size = sizes[key]
            dispatch = self._planned(msg, work, state, bytes_down=delivery_bytes(msg, size))
            self._sent_per_period[dispatch.period] = (
                self._sent_per_period.get(dispatch.period, 0) + 1
            )
            self.sites.train(dispatch)
            if self.mailbox.holds_cancelled(node_id):
                self.mailbox.defer(msg, dispatch)  # pushed when the cancelled one returns
            else:
                to_push.append((msg, dispatch))
        if to_push:
            self._push(to_push, state)
        return attempted

    def _stamp(self, msg: Message) -> Message:
        """``msg`` with the run key and its site-work index in its config.

        The strategy's content may be shared by every message of a broadcast: each site
        gets its own copy of the records (the arrays stay shared).
        """
        node_id = msg.metadata.dst_node_id
        work = self._site_work[node_id] = self._site_work.get(node_id, 0) + 1
        content = msg.content
        config = ConfigRecord(
            {
                **(record_of(content, keys.CONFIG, ConfigRecord) or ConfigRecord()),
                keys.SITE_WORK: work,
                keys.RUN_KEY: self.run_key,
            }
        )
        return Message(
            RecordDict({**content, keys.CONFIG: config}),
            dst_node_id=node_id,
            message_type=msg.metadata.message_type,
            ttl=msg.metadata.ttl,
            group_id=msg.metadata.group_id,
        )

    def _unsent(self, dispatch: Dispatch) -> None:
        """A training message never reached its site: its site-work index is used again."""
        if self.run_key and self._site_work.get(dispatch.node_id, 0) > 0:
            self._site_work[dispatch.node_id] -= 1

    def _steps(self, msg: Message) -> int | None:
        """Local steps a training message asks of its site (what compute time scales with)."""
        info = self.sites.info(msg.metadata.dst_node_id)
        return planned_steps(
            record_of(msg.content, keys.CONFIG, ConfigRecord) or ConfigRecord(),
            info.num_examples if info else None,
        )

    def _planned(
        self, msg: Message, work: Work, state: _RoundState, *, bytes_down: int, plan: bool = True
    ) -> Dispatch:
        """A dispatch for ``msg`` doing ``work``, with the clock's plan; pushed later.

        Under a pipelined policy the site may start once the (possibly older) model
        version it is sent was formed.
        """
        node_id = msg.metadata.dst_node_id
        steps = self._steps(msg)
        ready_at = None
        if self.policy.pipelined:
            ready_at = self.versions.formed_at(work.model_version, self.clock.now())
        return Dispatch(
            node_id=node_id,
            message_id="",
            server_round=state.server_round,
            model_version=work.model_version,
            dispatched_at=time.time(),
            deadline=math.inf,  # set when pushed
            bytes_down=bytes_down,
            period=work.period,
            delay=work.delay,
            fragment=work.fragment,
            schedule=self.clock.schedule(
                site=self.sites.name(node_id),
                bytes_down=bytes_down,
                steps=steps,
                ready_at=ready_at,
            )
            if plan
            else Schedule(dispatched_at=self.clock.now()),
        )

    def _push(self, pairs: list[tuple[Message, Dispatch]], state: _RoundState) -> None:
        """Push training messages whose sites are TRAINING; record refusals."""
        for dispatch in self.mailbox.push_training(pairs, self.round_timeout):
            # the SuperLink took nothing: no bytes went down
            self._unsent(dispatch)
            state.outcomes.append(self._no_update(dispatch, DROPPED, REFUSED))
            state.failed_nodes.add(dispatch.node_id)
            self.sites.refuse(dispatch.node_id, time.monotonic() + REFUSED_BACKOFF)

    def _push_deferred(self, node_id: int, state: _RoundState) -> None:
        """The site's cancelled message came back: push the one waiting for it."""
        deferred = self.mailbox.take_deferred(node_id)
        if deferred is not None:
            self._push([deferred], state)

    # ====================================================================== pull
    def _pull_chunks(self, state: _RoundState) -> int:
        """Pull the awaited replies a chunk at a time, judging before each chunk, until the
        policy is ready.

        A SuperLink hands back each ready reply fully decoded; judging (and so
        aggregating and freeing) what was pulled before pulling more keeps the server's
        memory at about one chunk of replies, not one reply per site. Returns how many
        replies came back, late ones included.
        """
        self._release_stuck(state)
        waiting = self.mailbox.waiting_ids()
        pulled = 0
        left: list[str] = []
        for start in range(0, len(waiting), PULL_CHUNK):
            # What is pulled already is judged first (a K mode's round leaves the arrivals
            # beyond its K queued): another chunk only while the policy still wants
            # replies, or queued replies would pile up by a chunk a round, towards one
            # per site in flight.
            self._judge_ready(state)
            if self.policy.ready_to_aggregate(self._view(state)):
                left = waiting[start:]
                break
            pulled += self._pull(waiting[start : start + PULL_CHUNK], state)
        # Replies no step waits for (given up on, cancelled) are pulled whatever the policy
        # says: they never make it ready, and they free their sites (a silent site's answer
        # brings it back) and carry bytes. Behind the awaited ones, they were never pulled
        # once more than a chunk of messages was out: a silent site was never heard again.
        done_with = [i for i in left if i not in self.mailbox.awaited]
        for start in range(0, len(done_with), PULL_CHUNK):
            pulled += self._pull(done_with[start : start + PULL_CHUNK], state)
        self._judge_ready(state)
        return pulled

    def _pull(self, message_ids: list[str], state: _RoundState) -> int:
        """Pull replies to ``message_ids``: arrivals queue in clock order, late ones free sites."""
        count, arrived, late = self.mailbox.pull(message_ids)
        for dispatch in arrived:
            self.sites.arrive(dispatch.node_id)
        traffic: list[TrafficOutcome] = []  # late replies no row of their own holds
        for reply in late:
            dispatch = reply.dispatch
            if not reply.cancelled:  # its row is written; the site is free again
                self.sites.release(dispatch.node_id)
                if self.sites.is_silent(dispatch.node_id):
                    if made_by_superlink(reply.reply):
                        # Flower's stand-in (its query expired, its node is gone): still
                        # silent, asked again; no progress for the round's wait either
                        count -= 1
                    else:
                        self._heard_from(dispatch.node_id, reply.reply)
                # A training update the site did send: a row for its bytes. The reply to
                # an evaluation or a query, or a site's error, only adds its bytes.
                if reply.reply.has_content() and dispatch.message_type == MessageType.TRAIN:
                    state.outcomes.append(self._late(dispatch, reply.reply, "given up on"))
                else:
                    traffic.extend(self._late_traffic(dispatch, reply.reply))
                continue
            # On the wall clock the bytes really crossed; a simulated site stopped when
            # it was cancelled and sent nothing.
            if not self.clock.virtual:
                if reply.reply.has_content():
                    state.outcomes.append(self._late(dispatch, reply.reply, "cancelled"))
                else:
                    traffic.extend(self._late_traffic(dispatch, reply.reply))
            self._push_deferred(dispatch.node_id, state)
        if traffic:  # (the round in progress: none at start-up)
            self.ledger.record_traffic(traffic, self._server_round)
        return count

    def _late_traffic(self, dispatch: Dispatch, reply: Message) -> list[TrafficOutcome]:
        """The bytes of a late reply that gets no row: one traffic row, or none when it
        crossed no wire (the SuperLink's own reply to an expired message)."""
        bytes_ = reply_traffic(reply)
        if not (bytes_.up or bytes_.down):
            return []
        return [
            TrafficOutcome(
                site=self.sites.name(dispatch.node_id),
                kind=dispatch.message_type,
                messages=0,  # its message is counted in its own row
                bytes_up=bytes_.up,
                bytes_down=bytes_.down,
            )
        ]

    def _release_stuck(self, state: _RoundState) -> None:
        """Free sites whose given-up message neither came back nor expired in time.

        Flower answers an expired message with an error reply; this is the safety net
        for a SuperLink that never does, so a site is not lost for the rest of the run.
        """
        limit = time.monotonic() - self.round_timeout - 2 * TTL_GRACE_SECONDS
        given_up, cancelled = self.mailbox.release_stuck(limit)
        for node_id in given_up:
            self.sites.release(node_id)
        for node_id in cancelled:
            self._push_deferred(node_id, state)

    def _expire_overdue(self, state: _RoundState) -> None:
        now = time.monotonic()
        # One last look before giving up: with many messages out, a reply that came in time
        # may still wait at the SuperLink behind the chunks pulled so far.
        overdue = [d.message_id for d in self.sites.training() if d.deadline < now and d.message_id]
        for start in range(0, len(overdue), PULL_CHUNK):
            self._pull(overdue[start : start + PULL_CHUNK], state)
        for dispatch in [d for d in self.sites.training() if d.deadline < now]:
            # Its site stays busy until Flower answers the message.
            self.sites.give_up(dispatch.node_id)
            self.mailbox.give_up(dispatch)
            state.outcomes.append(
                self._no_update(dispatch, DROPPED, no_reply_within(self.round_timeout))
            )
            state.failed_nodes.add(dispatch.node_id)

    # ===================================================================== judge
    def _judge_ready(self, state: _RoundState) -> None:
        """Take events in clock order, one at a time, until the policy is ready.

        An event is a queued arrival, or (on a virtual clock) an away site coming back.
        One is taken only when no outstanding message could land before it; the clock
        jumps to it, and the policy may then cancel and dispatch at that moment, so a
        site that just finished (or returned) gets work before any later event.
        """
        while True:
            arrival_at = self.mailbox.next_arrival_at()
            arrival_at = math.inf if arrival_at is None else arrival_at
            back_at, returning = self.sites.next_back() or (math.inf, -1)
            next_at = min(arrival_at, back_at)
            if next_at == math.inf or not self.clock.releasable(
                next_at, [d.schedule for d in self.sites.training()]
            ):
                return
            if self.policy.ready_to_aggregate(self._view(state)):
                return
            self.clock.advance(next_at)
            if back_at <= arrival_at:  # the site is back and may be offered work
                self.sites.free(returning)
            else:
                arrival = self.mailbox.pop_arrival()
                self.sites.free(arrival.dispatch.node_id)
                outcome = self._judge(arrival, state)
                state.outcomes.append(outcome)
                state.losses_of[id(outcome)] = len(state.losses)
                state.losses.append(_reported_loss(outcome, arrival.reply))
                if outcome.status in (DROPPED, REJECTED):
                    state.failed_nodes.add(arrival.dispatch.node_id)
            self._cancel_unwanted(state)
            self._dispatch_wanted(state)

    def _judge(self, arrival: Arrival, state: _RoundState) -> UpdateOutcome:
        """Turn one reply into a ledger row, feeding it to the strategy if applied."""
        dispatch, reply = arrival.dispatch, arrival.reply
        site = self.sites.name(dispatch.node_id)
        row = rows.arrived(arrival, site=site, version=self.version, virtual=self.clock.virtual)
        if reply.has_error():
            status = REJECTED if refused_at_site(reply) else DROPPED
            outcome = UpdateOutcome(status=status, reason=site_error(reply), **row)
            if status == DROPPED and not made_by_superlink(reply):
                state.site_failures.append(outcome)  # benched at the round's close
            return self._failed_reply(state, outcome)
        row.update(reported_metrics(reply))
        disagreement = halves_disagree(
            self.strategy.site_mod, reply, site, self.strategy.ledger_name
        )
        if disagreement is not None:  # rejected; the run stops if no site has the mod
            self._disagreements.append(disagreement)
            return self._failed_reply(
                state, UpdateOutcome(status=REJECTED, reason=disagreement, **row)
            )
        verdict = self.policy.judge(dispatch, self._view(state))
        if verdict.status != APPLIED:
            return UpdateOutcome(status=verdict.status, reason=verdict.reason, **row)
        try:
            update = self.strategy.read_update(
                reply, base=self.versions.base(dispatch.model_version, self.arrays)
            )
            ticket = self._tickets = self._tickets + 1
            decision = self.guard.consider(
                ticket,
                site=dispatch.node_id,
                kind=update.kind,
                claimed=update.contribution.num_examples,
                vector=update.vector,
                averaged=update.averaged,
                fingerprint=fingerprint(reply) if self.guard.options.reject_replays else None,
            )
            if decision.ruling is Ruling.REJECT:
                raise UpdateRejected(decision.reason or "rejected by the update guard")
            added = None
            if decision.ruling is Ruling.ADMIT:
                added = self._add(update, decision, verdict.weight_scale)
        except UpdateRejected as exc:
            log.warning("rejected update from %s: %s", site, exc.reason)
            return self._failed_reply(
                state, UpdateOutcome(status=REJECTED, reason=exc.reason, **row)
            )
        except Exception as exc:  # a hostile reply must never take the server down
            log.exception("rejected malformed update from %s", site)
            reason = f"malformed reply: {exc!r}"[:300]
            return self._failed_reply(state, UpdateOutcome(status=REJECTED, reason=reason, **row))
        state.applied += 1
        state.applied_nodes.add(dispatch.node_id)
        contribution = update.contribution
        row.update(
            num_examples=contribution.num_examples,
            train_loss=finite(contribution.train_loss),
            compute_seconds=finite(contribution.compute_seconds, minimum=0.0),
        )
        outcome = UpdateOutcome(
            status=APPLIED, reason=_joined(contribution.note, decision.reason, added), **row
        )
        if decision.ruling is Ruling.WAIT:  # its row is final once the guard judges it
            state.waiting[ticket] = (outcome, update, verdict.weight_scale, dispatch.node_id)
            outcome = self._settle(state, self.guard.ready()).get(ticket, outcome)
        return outcome

    def _add(self, update: Update, decision: Decision, weight_scale: float) -> str | None:
        """Add an admitted update with the guard's weight and scale (and the policy's); the
        strategy's note on how it counted."""
        scale = decision.scale * weight_scale
        return self.strategy.add_update(update, weight=decision.weight, scale=scale)

    def _settle(
        self, state: _RoundState, decisions: dict[int, Decision] | None = None
    ) -> dict[int, UpdateOutcome]:
        """Judge the updates the guard held (all, at the round's close; or the guard's
        ``ready`` ``decisions``), add those admitted, and make their rows final: ticket →
        final row."""
        if decisions is None:
            decisions = self.guard.settle()
        finals: dict[int, UpdateOutcome] = {}
        for ticket in list(decisions):
            if ticket not in state.waiting:
                continue
            outcome, update, weight_scale, node_id = state.waiting.pop(ticket)
            decision = decisions[ticket]
            final = outcome
            if decision.ruling is Ruling.ADMIT:
                try:
                    added = self._add(update, decision, weight_scale)
                    final = replace(outcome, reason=_joined(outcome.reason, decision.reason, added))
                except UpdateRejected as exc:
                    decision = Decision(Ruling.REJECT, reason=exc.reason)
            if decision.ruling is Ruling.REJECT:
                final = replace(outcome, status=REJECTED, reason=decision.reason)
                at = state.losses_of.get(id(outcome))
                if at is not None:  # its losses are a refused reply's (the divergence watch)
                    state.losses[at] = replace(state.losses[at], refused=decision.reason)
                state.applied -= 1
                # no longer one of the round's K sites, unless another of its updates is
                if not any(
                    o is not outcome and o.status == APPLIED and o.site == outcome.site
                    for o in state.outcomes
                ):
                    state.applied_nodes.discard(node_id)
                state.failed_nodes.add(node_id)
                state.failed_replies.append(final)
                log.warning("rejected update from %s: %s", outcome.site, decision.reason)
            state.outcomes = [final if o is outcome else o for o in state.outcomes]
            finals[ticket] = final
        return finals

    def _step_refused(
        self, state: _RoundState, exc: StepRefused
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The strategy refused its step: keep the model; the round's updates did not count."""
        log.warning("round %s: step not applied: %s", state.server_round, exc.reason)
        reason = (
            f"the round's step was not applied: {exc.reason}; the global model stays "
            f"version {self.version}"
        )
        state.outcomes = [
            replace(o, status=REJECTED, reason=reason) if o.status == APPLIED else o
            for o in state.outcomes
        ]
        state.failed_replies.extend(o for o in state.outcomes if o.reason == reason)
        arrays = exc.arrays if isinstance(exc.arrays, ArrayRecord) else None
        return arrays, MetricRecord({"step-refused": 1})

    @staticmethod
    def _failed_reply(state: _RoundState, outcome: UpdateOutcome) -> UpdateOutcome:
        """Note a reply that came back and failed (for the stop rule); return it."""
        state.failed_replies.append(outcome)
        return outcome

    # ==================================================================== cancel
    def _cancel_unwanted(self, state: _RoundState) -> None:
        for node_id in self.policy.to_cancel(self._view(state)):
            self._cancel(node_id, state)

    def _cancel(self, node_id: int, state: _RoundState) -> None:
        """Stop waiting for the site's update; the site is free for new work at once."""
        dispatch = self.sites.work(node_id)
        if self.sites.phase(node_id) is Phase.TRAINING and dispatch is not None:
            if not dispatch.message_id:  # deferred: it never went
                self._unsent(dispatch)
            self.mailbox.cancel(dispatch)
            self.sites.free(node_id)
            state.outcomes.append(self._no_update(dispatch, CANCELLED, CANCELLED_REASON))
            return
        arrival = self.mailbox.unqueue(node_id)
        if arrival is not None:
            # Pulled, but later on the clock than the decision. On the wall clock it
            # did arrive (its bytes count); a simulated one was still on its way.
            self.sites.free(node_id)
            row = self._no_update(arrival.dispatch, CANCELLED, CANCELLED_REASON)
            if not self.clock.virtual:
                row = replace(
                    row,
                    bytes_up=arrival.bytes_up,
                    bytes_down=row.bytes_down + arrival.ack_bytes,
                    arrived_at=arrival.pulled_at,
                )
            state.outcomes.append(row)

    # ================================================================== helpers
    def _no_update(self, dispatch: Dispatch, status: str, reason: str) -> UpdateOutcome:
        return rows.no_update(
            dispatch,
            status,
            reason,
            site=self.sites.name(dispatch.node_id),
            version=self.version,
            virtual=self.clock.virtual,
        )

    def _late(self, dispatch: Dispatch, reply: Message, given_up: str) -> UpdateOutcome:
        return rows.late(
            dispatch, reply, given_up, site=self.sites.name(dispatch.node_id), version=self.version
        )

    def _view(self, state: _RoundState) -> EngineView:
        census = self.sites.census()
        training = {d.node_id: d for d in census.training}
        queued = self.mailbox.queued()
        return EngineView(
            away_nodes=census.away,
            failed_nodes=frozenset(state.failed_nodes),
            model_distance=self._model_distance,
            server_round=state.server_round,
            model_version=self.version,
            idle_nodes=self._unbenched(census.idle, state),
            outstanding={**training, **queued},
            dispatched_this_round=state.dispatched,
            arrived_this_round=len(state.outcomes),
            applied_this_round=state.applied,
            applied_nodes=frozenset(state.applied_nodes),
            connected_nodes=census.connected,
            sent_for_round=self._sent_per_period.get(state.server_round, 0),
            periods_outstanding=frozenset(d.period for d in (*training.values(), *queued.values())),
            held_this_round=len(state.waiting),
            held_nodes=frozenset(node for *_, node in state.waiting.values()),
        )

    def _bench_failed_sites(self, state: _RoundState) -> None:
        """From the round's final rows: a site with an applied update ends its streak; in
        a round that applied updates, a site whose reply carried its error (and that had
        none applied) is benched (``bench``), its row saying so. A round that applied none
        is the stop rule's to judge."""
        applied = {o.site for o in state.outcomes if o.status == APPLIED}
        for site in applied:
            self.bench.succeeded(site)
        if not applied or not state.site_failures:
            return
        census = self.sites.census()
        others = [self.sites.name(n) for n in census.idle] + [
            self.sites.name(d.node_id) for d in census.training
        ]
        renamed: dict[int, UpdateOutcome] = {}
        for outcome in state.site_failures:
            if outcome.site in applied:
                continue
            rounds = self.bench.failed(outcome.site, state.server_round, others=others)
            if rounds:
                note = f"benched for the next {rounds} round{'s' * (rounds > 1)}"
                renamed[id(outcome)] = replace(outcome, reason=_joined(outcome.reason, note))
        state.outcomes = [renamed.get(id(o), o) for o in state.outcomes]

    def _unbenched(self, nodes: Sequence[int], state: _RoundState) -> tuple[int, ...]:
        """``nodes`` without the sites that sit out this round (``bench``)."""
        if state.bench_lifted:
            return tuple(nodes)
        benched = self.bench.benched
        return tuple(n for n in nodes if not benched(self.sites.name(n), state.server_round))

    def _model_distance(self, version: int) -> float:
        return self.versions.distance(version, current=self.arrays, current_version=self.version)

    def _forget_unused_versions(self) -> None:
        live = {d.model_version for d in self.sites.training()}
        live |= {a.dispatch.model_version for a in self.mailbox.arrivals} | {self.version}
        self.versions.prune(live)


def _applied(outcomes: Sequence[UpdateOutcome]) -> int:
    """How many updates a round accepted (applied, or buffered for a later aggregate)."""
    return sum(1 for u in outcomes if u.status in (APPLIED, BUFFERED))


def _example_weighted_loss(outcomes: Sequence[UpdateOutcome]) -> float | None:
    """Σ n·loss / Σ n over applied updates that reported both."""
    pairs = [
        (u.num_examples, u.train_loss)
        for u in outcomes
        if u.status == APPLIED and u.train_loss is not None and u.num_examples
    ]
    total = sum(n for n, _ in pairs)
    return sum(n * loss for n, loss in pairs) / total if total else None


def unnamed_sites(count: int) -> str:
    """Why a run whose sites are named by their node ids cannot be resumed."""
    return (
        f"{count} site(s) are named by their Flower node ids: they did not say their names "
        "(a ClientApp without an @app.query() function answering with 'site-name', as "
        "examples/own_app's has, or a SuperNode that never answered). Node ids change at "
        "every start-up, so this run cannot be resumed"
    )


def _joined(*notes: str | None) -> str | None:
    """Notes for one ledger reason, in order (None when there are none)."""
    said = [note for note in notes if note]
    return "; ".join(said) if said else None


def fingerprint(reply: Message) -> tuple[str, ...]:
    """A digest of each of a reply's array records: equal for identical arrays (a replay).

    Not Flower's object ids: those would hash the whole reply again (``engine.digest``).
    """
    records = reply.content.values()  # not ``array_records``: see replies.record_of
    return tuple(arrays_digest(r) for r in records if isinstance(r, ArrayRecord))


def _reported_loss(outcome: UpdateOutcome, reply: Message) -> ReportedLoss:
    """The losses a reply reported as sent (its row keeps finite ones only), and why it
    was refused if it was."""
    refused = outcome.reason if outcome.status in (DROPPED, REJECTED) else None
    return ReportedLoss(outcome.site, outcome.num_examples, *reported_losses(reply), refused)


def _floats(record: MetricRecord) -> dict[str, float]:
    return {k: float(v) for k, v in record.items() if isinstance(v, int | float)}
