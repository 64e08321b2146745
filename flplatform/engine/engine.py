"""The round engine: push and pull over Flower's Grid, one message in flight per site.

Flower's ``Strategy.start`` is a synchronous barrier around ``grid.send_and_receive``:
no staleness, no partial rounds, no per-site accounting. This engine instead

* pushes training messages with ``grid.push_messages`` and pulls replies with
  ``grid.pull_messages`` (which never blocks), keeping at most one message per site;
* tags every dispatch with the model version sent (also as the message's ``group_id``),
  and computes the staleness of every arrival against the current version;
* measures the serialized size of every message in both directions;
* hands each well-formed arrival to the strategy as it comes (streaming aggregation), and
  asks an ``AggregationPolicy`` when the arrivals so far become a new model version.

On a ``VirtualClock`` (simulation) arrivals are judged in simulated order: an arrival is
judged only when no outstanding message could land before it, the clock jumps to it, and
its site is given work again before the next arrival is judged. Cancelling a straggler
frees the site at once in that order; its next message is pushed when Flower hands back
the cancelled one, so a site still never holds two messages.

The strategy keeps Flower's hooks (``configure_train``, ``configure_evaluate``,
``aggregate_evaluate``) and adds three streaming ones (``begin_aggregation``,
``accumulate``, ``finish_aggregation``); see ``EngineStrategy``.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from flplatform import keys
from flplatform.arrays import record_to_arrays
from flplatform.engine.clock import Clock, Landing, Schedule, WallClock, planned_steps
from flplatform.engine.events import (
    APPLIED,
    BUFFERED,
    CANCELLED,
    DROPPED,
    EVALUATED,
    REJECTED,
    Dispatch,
    EvaluationOutcome,
    LedgerSink,
    NullLedger,
    RoundSummary,
    SiteInfo,
    UpdateOutcome,
)
from flplatform.engine.policy import AggregationPolicy, EngineView
from flplatform.engine.replies import (
    condense_error,
    evaluation_metrics,
    finite,
    reported_metrics,
    site_info,
)
from flplatform.engine.synchrony import Synchrony
from flplatform.engine.wire import content_size, message_size
from flplatform.errors import ConfigError, NoProgress, RunFailed, UpdateRejected

log = logging.getLogger("flplatform.engine")

# A message's TTL outlives the engine's own deadline by this much, so an overdue site is
# dropped by the engine with a clear reason, and Flower's expiry then frees the site.
TTL_GRACE_SECONDS = 5.0
# Replies pulled per call: a SuperLink hands back every ready reply fully decoded, so
# pulling all pending ids at once would hold (sites × model) bytes in memory.
PULL_CHUNK = 16
REFUSED = "refused by the SuperLink (node not connected, or the message too large)"
UNAVAILABLE = "unavailable: sat this work out (simulated availability)"
# A refused site is not offered work again for this long (it may be reconnecting).
REFUSED_BACKOFF = 5.0
# Rounds in a row that may fail the same way before the run stops (0: never stop).
DEFAULT_MAX_FAILED_ROUNDS = 3
# Numbers (hex addresses first) in a failure reason: replaced when reasons are compared.
_NUMBER = re.compile(r"0x[0-9a-fA-F]+|\d+")
# A failure reason is cut to this many characters in the error that stops the run.
REASON_SHOWN = 300


@dataclass(frozen=True)
class Contribution:
    """What the strategy read from an accepted reply."""

    num_examples: int
    train_loss: float | None = None
    compute_seconds: float | None = None
    # What the ledger should know about an accepted update (its row's reason), e.g. that
    # the site lost its kept state and was resynced.
    note: str | None = None


class EngineStrategy(Protocol):
    """The hooks the engine calls; Flower's own plus streaming aggregation.

    Optionally, ``message_not_sent(message)``: the engine calls it for a message from
    ``configure_train`` that it did not send (the site sits the work out, simulated
    availability), so a strategy that drafted it as sent can undo that (sparse downloads
    keep the site's synced version).

    Optionally, for ``flplatform.start`` (which builds the engine):

    * ``engine_policy(requested: Synchrony, *, num_rounds: int) -> AggregationPolicy``,
      called once before the run: the policy to run ``num_rounds`` rounds under, given the
      synchrony mode the run asked for; it raises ``ConfigError`` saying why for a mode the
      strategy cannot run. Without it, the requested mode runs as it is. (Delayed updates
      return ``PeriodSync``; the sketched strategies and Flower's wrapped ones allow
      ``sync`` only.)
    * ``ledger_name``: the strategy's name in the ledger (default: its class name).
    """

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]: ...

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]: ...

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None: ...

    def begin_aggregation(self, server_round: int, arrays: ArrayRecord) -> None: ...

    def accumulate(
        self, reply: Message, *, base: ArrayRecord, weight_scale: float = 1.0
    ) -> Contribution: ...

    def finish_aggregation(self) -> tuple[ArrayRecord | None, MetricRecord | None]: ...


class SubsetGrid(Grid):
    """A view of a Grid whose ``get_node_ids`` lists only some nodes.

    The engine hands it to ``configure_train`` so that a strategy's own sampling picks
    among the sites the policy allows (idle ones), without the strategy knowing why.
    """

    def __init__(self, grid: Grid, node_ids: Sequence[int]) -> None:
        self._grid = grid
        self._node_ids = list(node_ids)

    def set_run(self, run: Any) -> None:  # pragma: no cover - never called on a view
        self._grid.set_run(run)

    @property
    def run(self) -> Any:
        return self._grid.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self._grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._node_ids)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._grid.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self._grid.send_and_receive(messages, timeout=timeout)


@dataclass(order=True)
class _Arrival:
    """A pulled reply waiting for its turn, in clock order."""

    arrived_at: float  # clock time
    seq: int
    dispatch: Dispatch = field(compare=False)
    reply: Message = field(compare=False)
    bytes_up: int = field(compare=False)
    landing: Landing = field(compare=False)
    pulled_at: float = field(compare=False)  # wall time


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


class FailureStreak:
    """The stop rule: rounds in a row that applied nothing because every reply failed alike.

    A round *counts* when it applied no update, at least one reply came back and failed (a
    site's error, or an update the strategy rejected), and every reply that failed did so
    for the same reason. It extends the streak when its reason is the streak's; any other
    round ends the streak (a counting round with a new reason starts a new one). When
    ``limit`` rounds count in a row, ``observe`` raises ``NoProgress``.

    Reasons are compared with whitespace collapsed and every number (and hex address)
    replaced, so sites whose error differs only in a size, an index or an address (``shape
    (10, 64)`` here, ``(10, 32)`` there) fail alike; different words never do.

    Rounds that legitimately apply nothing do not count: a sketch round applies no model
    change but accepts its updates (they are APPLIED); a round in which no reply landed (a
    pipelined round whose period was done early), or only timeouts, refusals, cancelled
    stragglers, absent sites and updates the synchrony policy dropped as stale, ends the
    streak. Messages that brought no reply say nothing about the replies and are ignored
    in a round that counts.

    Parameters
    ----------
    limit : int
        Rounds in a row that trip the rule; 0 never trips.

    Raises
    ------
    ConfigError
        If ``limit`` is not an integer >= 0.
    """

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ConfigError(
                f"max-failed-rounds must be an integer >= 0 (0: never stop), got {limit!r}"
            )
        self.limit = limit
        self.rounds: list[int] = []  # the rounds of the current streak
        self._key: str | None = None  # their reason, as compared
        self._statuses: set[str] = set()

    def observe(
        self, server_round: int, *, applied: int, failed_replies: Sequence[UpdateOutcome]
    ) -> None:
        """Take one finished round into account; raise ``NoProgress`` when the rule trips.

        Parameters
        ----------
        server_round : int
            The round that just finished (and is already recorded).
        applied : int
            Updates the round accepted.
        failed_replies : Sequence[UpdateOutcome]
            The round's replies that came back and failed (each with its reason).

        Raises
        ------
        NoProgress
            When ``limit`` counting rounds in a row failed for the same reason.
        """
        keys_seen = {reason_key(u.reason) for u in failed_replies}
        if applied or len(keys_seen) != 1:
            self._reset()
            return
        (key,) = keys_seen
        if key != self._key:
            self._reset()
            self._key = key
        self.rounds.append(server_round)
        self._statuses.update(u.status for u in failed_replies)
        if self.limit and len(self.rounds) >= self.limit:
            raise NoProgress(self._describe(failed_replies[-1].reason))

    def _reset(self) -> None:
        self.rounds, self._key, self._statuses = [], None, set()

    def _describe(self, reason: str | None) -> str:
        first, last = self.rounds[0], self.rounds[-1]
        span = f"round {first}" if first == last else f"rounds {first}-{last}"
        how = " or ".join(sorted(self._statuses))
        text = " ".join((reason or "no reason given").split())
        if len(text) > REASON_SHOWN:
            text = text[: REASON_SHOWN - 1] + "…"
        return (
            f"{span} applied no update: every reply was {how}: {text} "
            f"(stopped after {self.limit} such rounds in a row; max-failed-rounds 0 never stops)"
        )


def reason_key(reason: str | None) -> str:
    """A failure reason as the stop rule compares it: whitespace collapsed, numbers as '#'.

    ``"array 'w' has shape (10, 64), expected (10, 32)"`` and the same with ``(10, 16)``
    compare equal; ``"missing arrays: w"`` and ``"unexpected arrays: v"`` do not.
    """
    return _NUMBER.sub("#", " ".join((reason or "").split()))


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
        (simulated sites start Ray actors and import torch first).
    poll_interval : float
        Seconds between pulls when nothing arrived.
    on_round : callable, optional
        Called with each ``RoundSummary`` (progress displays, logs).
    max_failed_rounds : int
        Stop the run (``NoProgress``) after this many rounds in a row that applied no
        update while every reply that failed did so for the same reason; 0 never stops.
        See ``FailureStreak`` for which rounds count.
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
        poll_interval: float = 0.05,
        on_round: Callable[[RoundSummary], None] | None = None,
        max_failed_rounds: int = DEFAULT_MAX_FAILED_ROUNDS,
    ) -> None:
        self.grid = grid
        self.strategy = strategy
        self.policy: AggregationPolicy = policy or Synchrony("sync")
        self.clock: Clock = clock or WallClock()
        self.ledger: LedgerSink = ledger or NullLedger()
        self.round_timeout = round_timeout
        self.required_sites = required_sites
        self.startup_timeout = startup_timeout
        self.poll_interval = poll_interval
        self.on_round = on_round
        self.failure_streak = FailureStreak(max_failed_rounds)
        self.sites: dict[int, SiteInfo] = {}  # every site that ever joined the run
        self.connected: set[int] = set()  # nodes the SuperLink lists now
        self.version = 0
        self.arrays = ArrayRecord()
        self._bases: dict[int, ArrayRecord] = {}  # model versions sites are working on
        self._in_flight: dict[int, Dispatch] = {}  # node id → its training message
        self._by_message: dict[str, Dispatch] = {}
        # Messages given up on (overdue, cancelled, unanswered queries): their site stays
        # busy until Flower hands back the late reply or the TTL-expiry error, so that no
        # site ever has two messages at once.
        self._abandoned: dict[str, Dispatch] = {}
        # Messages the policy cancelled: the site is free (in clock order) for new work,
        # which is pushed (from _deferred) once Flower hands the cancelled one back.
        self._cancelled: dict[str, Dispatch] = {}
        self._deferred: dict[int, Message] = {}
        self._away: dict[int, float] = {}  # node → clock time it is back (availability)
        self._distances: dict[tuple[int, int], float] = {}
        # clock time each model version was formed (pipelined messages download from then)
        self._version_at: dict[int, float] = {}
        self._sent_per_period: dict[int, int] = {}  # training messages sent, by period
        self._arrivals: list[_Arrival] = []  # pulled, not yet judged; a heap by clock
        self._refused_until: dict[int, float] = {}  # node → when to try it again
        self._replied_at: dict[str, float] = {}  # evaluation/query reply → arrival time
        self._seq = itertools.count()

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
    ) -> Result:
        """Run ``num_rounds`` server steps and return Flower's ``Result``."""
        result = Result(arrays=initial_arrays)
        self.arrays, self.version = initial_arrays, 0
        self._version_at = {0: self.clock.now()}
        self.discover_sites()
        if evaluate_fn is not None:
            initial = evaluate_fn(0, initial_arrays)
            if initial is not None:
                result.evaluate_metrics_serverapp[0] = initial

        for server_round in range(1, num_rounds + 1):
            self.refresh_sites()
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
                site_metrics, evaluations = self._evaluate_round(server_round, evaluate_config)
                if site_metrics is not None:
                    result.evaluate_metrics_clientapp[server_round] = site_metrics
                    # site_accuracy, site_loss: the sites' view beside the server's own
                    metrics.update({f"site_{k}": v for k, v in _floats(site_metrics).items()})
            if train_metrics is not None:
                result.train_metrics_clientapp[server_round] = train_metrics
            summary = replace(
                summary, finished_at=time.time(), metrics=metrics, evaluations=evaluations
            )
            self.ledger.record_round(summary)
            if self.on_round is not None:
                self.on_round(summary)
            # Only now: the round that trips the rule is in the ledger when the run stops.
            self.failure_streak.observe(
                server_round, applied=_applied(summary.updates), failed_replies=failed_replies
            )
        result.arrays = self.arrays
        return result

    @property
    def simulated_seconds(self) -> float | None:
        """Simulated time the federation has taken so far (None on the wall clock)."""
        return self.clock.now() if self.clock.virtual else None

    # ============================================================ site discovery
    def discover_sites(self) -> dict[int, SiteInfo]:
        """Wait for the required nodes, then ask each who it is (a QUERY message).

        A plain Flower ClientApp that does not answer queries still joins, named after
        its node id.
        """
        deadline = time.monotonic() + self.startup_timeout
        node_ids = sorted(self.grid.get_node_ids())
        while len(node_ids) < self.required_sites:
            if time.monotonic() > deadline:
                raise RunFailed(
                    f"only {len(node_ids)} of {self.required_sites} sites connected within "
                    f"{self.startup_timeout:.0f} s; start more SuperNodes or lower min-sites"
                )
            time.sleep(0.2)
            node_ids = sorted(self.grid.get_node_ids())
        self._introduce(node_ids, timeout=self.startup_timeout)
        return self.sites

    def refresh_sites(self) -> None:
        """Notice nodes that joined (introduce them) or left (give them no work)."""
        node_ids = set(self.grid.get_node_ids())
        new = sorted(n for n in node_ids if n not in self.sites)
        if new:
            self._introduce(new, timeout=self.round_timeout)
        self.connected = node_ids

    def _introduce(self, node_ids: Sequence[int], *, timeout: float) -> None:
        queries = [
            Message(
                RecordDict({keys.CONFIG: ConfigRecord()}),
                dst_node_id=node_id,
                message_type=MessageType.QUERY,
                ttl=timeout + TTL_GRACE_SECONDS,
            )
            for node_id in node_ids
        ]
        replies = {d.node_id: r for d, r in self._exchange(queries, timeout=timeout)}
        taken = {s.name for s in self.sites.values()}
        infos = [site_info(node_id, replies.get(node_id)) for node_id in node_ids]
        # Partition order (then name) keeps the ledger's site order the same across runs.
        infos.sort(key=lambda s: (s.partition_id is None, s.partition_id or 0, s.name))
        for info in infos:
            if info.name in taken:  # two nodes claiming one name: keep both, distinguishably
                info = SiteInfo(
                    info.node_id,
                    f"{info.name[:40]}-{info.node_id}",
                    info.partition_id,
                    info.num_examples,
                    info.device,
                )
            taken.add(info.name)
            profile = self.clock.join(info.name, len(self.sites))
            self.sites[info.node_id] = info
            self.ledger.add_site(
                info, {**profile, **({"device": info.device} if info.device else {})}
            )
        self.connected.update(node_ids)
        log.info("sites: %s", ", ".join(self.sites[n].name for n in node_ids))

    # ============================================================ training round
    def _train_round(
        self, server_round: int, train_config: ConfigRecord | None
    ) -> tuple[RoundSummary, MetricRecord | None, list[UpdateOutcome]]:
        """One server step; returns its summary, the strategy's metrics, its failed replies."""
        state = _RoundState(server_round, time.time(), self.clock.now(), train_config)
        self.strategy.begin_aggregation(server_round, self.arrays)
        waiting_since = time.monotonic()
        while True:
            # ---- dispatch: the policy says who may get work; the strategy samples
            self._dispatch_wanted(state)
            # ---- pull what has arrived, judging it in clock order; drop overdue sites
            pulled = self._pull_chunks(state)
            self._expire_overdue(state)
            self._judge_ready(state)
            # ---- cancel what the policy no longer wants
            self._cancel_unwanted(state)
            if self.policy.ready_to_aggregate(self._view(state)):
                break
            if pulled:
                waiting_since = time.monotonic()
                continue
            outstanding = self._in_flight or self._abandoned or self._cancelled or self._arrivals
            if not outstanding:
                # Nothing on its way and the step is still open: sites may join; if none
                # can be given work for a whole round timeout, the run cannot go on.
                if time.monotonic() - waiting_since > self.round_timeout:
                    raise RunFailed(
                        f"round {server_round}: no site could be given work within "
                        f"{self.round_timeout:.0f} s"
                    )
                self.refresh_sites()
            time.sleep(self.poll_interval)

        # ---- aggregate into the next model version
        arrays, train_metrics = self.strategy.finish_aggregation()
        if arrays is not None:
            self.arrays = arrays
            self.version += 1
            self._version_at[self.version] = self.clock.now()
        self._prune_bases()
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
        )
        return summary, train_metrics, state.failed_replies

    def _dispatch_wanted(self, state: _RoundState) -> None:
        targets = self.policy.dispatch_targets(self._view(state))
        if targets:
            state.dispatched += self._dispatch(state, targets)

    def _dispatch(self, state: _RoundState, targets: Sequence[int]) -> int:
        """Send training messages to sampled targets; return how many were attempted.

        A site the clock says sits this work out (availability) gets a row and no
        message, and does not count as attempted; a site whose cancelled message is
        still out gets its message when that one comes back.
        """
        config = ConfigRecord(dict(state.train_config or {}))  # the strategy may write into it
        config[keys.MODEL_VERSION] = self.version
        idle = set(self._idle_nodes())
        allowed = sorted(n for n in targets if n in idle)
        drafts = self.strategy.configure_train(
            state.server_round, self.arrays, config, SubsetGrid(self.grid, allowed)
        )
        messages = self._addressed(drafts, allowed)
        if not messages:
            return 0
        self._bases[self.version] = self.arrays
        sizes: dict[int, int] = {}  # a broadcast shares one content: measure it once
        to_push: list[tuple[Message, Dispatch]] = []
        attempted = 0
        for msg in messages:
            node_id = msg.metadata.dst_node_id
            away = self.clock.away_seconds(self._name(node_id), steps=self._steps(msg))
            if away is not None:  # not counted as dispatched: nothing was sent to wait for
                self._away[node_id] = self.clock.now() + away
                not_sent = getattr(self.strategy, "message_not_sent", None)
                if not_sent is not None:  # optional hook (see EngineStrategy)
                    not_sent(msg)
                # (A pipelined site's timeline must not book the work it skipped.)
                skipped = self._planned(msg, state, bytes_down=0, plan=not self.policy.pipelined)
                state.outcomes.append(self._row(skipped, DROPPED, UNAVAILABLE))
                continue
            attempted += 1
            key = id(msg.content)
            if key not in sizes:
                sizes[key] = content_size(msg.content)
            dispatch = self._planned(msg, state, bytes_down=message_size(msg, sizes[key]))
            self._sent_per_period[dispatch.period] = (
                self._sent_per_period.get(dispatch.period, 0) + 1
            )
            self._in_flight[node_id] = dispatch
            if any(d.node_id == node_id for d in self._cancelled.values()):
                self._deferred[node_id] = msg  # pushed when the cancelled one returns
            else:
                to_push.append((msg, dispatch))
        if to_push:
            self._push_dispatches(to_push, state)
        return attempted

    def _steps(self, msg: Message) -> int:
        """Local steps a training message asks of its site (what compute time scales with)."""
        info = self.sites.get(msg.metadata.dst_node_id)
        return planned_steps(
            msg.content.config_records.get(keys.CONFIG, ConfigRecord()),
            info.num_examples if info else None,
        )

    def _planned(
        self, msg: Message, state: _RoundState, *, bytes_down: int, plan: bool = True
    ) -> Dispatch:
        """A dispatch for ``msg`` with the clock's plan; pushed (given an id) later.

        Under a pipelined policy the strategy says in the message's config which period
        the work is for and which (possibly older) model version it sent.
        """
        node_id = msg.metadata.dst_node_id
        steps = self._steps(msg)
        period, version, ready_at = state.server_round, self.version, None
        if self.policy.pipelined:
            config = msg.content.config_records.get(keys.CONFIG, ConfigRecord())
            period = _int_within(config.get(keys.SERVER_ROUND), 1, None, state.server_round)
            version = _int_within(config.get(keys.MODEL_VERSION), 0, self.version, self.version)
            ready_at = self._version_at.get(version, self.clock.now())
        return Dispatch(
            node_id=node_id,
            message_id="",
            server_round=state.server_round,
            model_version=version,
            dispatched_at=time.time(),
            deadline=math.inf,  # set when pushed
            bytes_down=bytes_down,
            period=period,
            schedule=self.clock.schedule(
                site=self._name(node_id), bytes_down=bytes_down, steps=steps, ready_at=ready_at
            )
            if plan
            else Schedule(dispatched_at=self.clock.now()),
        )

    def _push_dispatches(self, pairs: list[tuple[Message, Dispatch]], state: _RoundState) -> None:
        """Push messages whose dispatches wait in ``_in_flight``; record refusals."""
        ids = self._push([msg for msg, _ in pairs])
        for (_, dispatch), message_id in zip(pairs, ids, strict=True):
            if not message_id:  # the SuperLink took nothing: no bytes went down
                self._in_flight.pop(dispatch.node_id, None)
                dispatch.bytes_down = 0
                state.outcomes.append(self._row(dispatch, DROPPED, REFUSED))
                state.failed_nodes.add(dispatch.node_id)
                self._refused_until[dispatch.node_id] = time.monotonic() + REFUSED_BACKOFF
                continue
            dispatch.message_id = message_id
            dispatch.dispatched_at = time.time()
            dispatch.deadline = time.monotonic() + self.round_timeout
            self._by_message[message_id] = dispatch

    def _push_deferred(self, node_id: int, state: _RoundState) -> None:
        """The site's cancelled message came back: push the one waiting for it."""
        msg = self._deferred.pop(node_id, None)
        dispatch = self._in_flight.get(node_id)
        if msg is not None and dispatch is not None:
            self._push_dispatches([(msg, dispatch)], state)

    def _push(self, messages: list[Message]) -> list[str]:
        """Push ``messages``; return each one's message id, or "" where it was refused.

        Grids report refusals differently (Flower's in-memory grid leaves refused
        messages out of the returned list, its HTTP grid puts None in their place, or
        returns [] for an oversize payload), but every grid writes the id into each
        message: a message is accepted when its own id is among those returned.
        """
        accepted = {i for i in self.grid.push_messages(messages) if i}
        return [
            m.metadata.message_id if m.metadata.message_id in accepted else "" for m in messages
        ]

    def _pull_chunks(self, state: _RoundState) -> int:
        """Pull every awaited reply, a chunk at a time, judging between chunks.

        A SuperLink hands back each ready reply fully decoded; judging (and so
        aggregating and freeing) a chunk before pulling the next keeps the server's
        memory at one chunk of replies, not one reply per site. Returns how many
        replies came back, late ones included.
        """
        self._release_stuck(state)
        waiting = [*self._by_message, *self._abandoned, *self._cancelled]
        pulled = 0
        for start in range(0, len(waiting), PULL_CHUNK):
            pulled += self._pull(waiting[start : start + PULL_CHUNK], state)
            self._judge_ready(state)
            if self.policy.ready_to_aggregate(self._view(state)):
                break
        return pulled

    def _pull(self, message_ids: list[str], state: _RoundState) -> int:
        """Pull replies to ``message_ids`` into the clock-ordered arrival queue."""
        count = 0
        for reply in self.grid.pull_messages(message_ids):
            message_id = reply.metadata.reply_to_message_id
            abandoned = self._abandoned.pop(message_id, None)
            if abandoned is not None:  # its row is written; the site is free again
                count += 1
                # A training reply the site did send: account for its bytes. (A late
                # evaluation or query reply is only let go; its row is already written.)
                if reply.has_content() and abandoned.message_type == MessageType.TRAIN:
                    state.outcomes.append(self._late(abandoned, reply, "given up on"))
                continue
            cancelled = self._cancelled.pop(message_id, None)
            if cancelled is not None:
                count += 1
                # On the wall clock the bytes really crossed; a simulated site stopped
                # when it was cancelled and sent nothing.
                if reply.has_content() and not self.clock.virtual:
                    state.outcomes.append(self._late(cancelled, reply, "cancelled"))
                self._push_deferred(cancelled.node_id, state)
                continue
            dispatch = self._by_message.pop(message_id, None)
            if dispatch is None:
                continue  # not ours (or already handled)
            self._in_flight.pop(dispatch.node_id, None)
            bytes_up = message_size(reply)
            reported = reported_metrics(reply) if not reply.has_error() else {}
            landing = self.clock.land(
                dispatch.schedule,
                site=self._name(dispatch.node_id),
                bytes_up=bytes_up,
                measured_compute=reported.get("compute_seconds"),
            )
            heapq.heappush(
                self._arrivals,
                _Arrival(
                    landing.arrived_at,
                    next(self._seq),
                    dispatch,
                    reply,
                    bytes_up,
                    landing,
                    time.time(),
                ),
            )
            count += 1
        return count

    def _judge_ready(self, state: _RoundState) -> None:
        """Take events in clock order, one at a time, until the policy is ready.

        An event is a queued arrival, or (on a virtual clock) an away site coming back.
        One is taken only when no outstanding message could land before it; the clock
        jumps to it, and the policy may then cancel and dispatch at that moment, so a
        site that just finished (or returned) gets work before any later event.
        """
        while True:
            arrival_at = self._arrivals[0].arrived_at if self._arrivals else math.inf
            returning = min(
                ((t, n) for n, t in self._away.items() if n in self.connected),
                default=(math.inf, -1),
            )
            next_at = min(arrival_at, returning[0])
            if next_at == math.inf or not self.clock.releasable(
                next_at, [d.schedule for d in self._in_flight.values()]
            ):
                return
            if self.policy.ready_to_aggregate(self._view(state)):
                return
            self.clock.advance(next_at)
            if returning[0] <= arrival_at:  # the site is back and may be offered work
                del self._away[returning[1]]
            else:
                arrival = heapq.heappop(self._arrivals)
                outcome = self._judge(arrival, state)
                state.outcomes.append(outcome)
                if outcome.status in (DROPPED, REJECTED):
                    state.failed_nodes.add(arrival.dispatch.node_id)
            self._cancel_unwanted(state)
            self._dispatch_wanted(state)

    def _late(self, dispatch: Dispatch, reply: Message, given_up: str) -> UpdateOutcome:
        """A reply that came after its message was given up on: only its bytes count."""
        return UpdateOutcome(
            site=self._name(dispatch.node_id),
            dispatched_round=dispatch.server_round,
            version_trained_on=dispatch.model_version,
            staleness=self.version - dispatch.model_version,
            bytes_up=message_size(reply),
            bytes_down=0,  # counted with the row written when it was given up on
            status=DROPPED,
            dispatched_at=dispatch.dispatched_at,
            arrived_at=time.time(),
            reason=f"late: arrived after it was {given_up}",
            **self._period_fields(dispatch),
        )

    def _judge(self, arrival: _Arrival, state: _RoundState) -> UpdateOutcome:
        """Turn one reply into a ledger row, feeding it to the strategy if applied."""
        dispatch, reply = arrival.dispatch, arrival.reply
        row: dict[str, Any] = dict(
            site=self._name(dispatch.node_id),
            dispatched_round=dispatch.server_round,
            version_trained_on=dispatch.model_version,
            staleness=self.version - dispatch.model_version,
            bytes_up=arrival.bytes_up,
            bytes_down=dispatch.bytes_down,
            dispatched_at=dispatch.dispatched_at,
            arrived_at=arrival.pulled_at,
            **self._period_fields(dispatch),
        )
        if self.clock.virtual:
            row.update(
                virtual_dispatched_at=dispatch.schedule.dispatched_at,
                virtual_arrived_at=arrival.arrived_at,
                virtual_compute_seconds=arrival.landing.compute_seconds,
                transfer_seconds=arrival.landing.transfer_seconds,
            )
        if reply.has_error():
            reason = f"site error {reply.error.code}: {condense_error(reply.error.reason or '')}"
            return self._failed_reply(state, UpdateOutcome(status=DROPPED, reason=reason, **row))
        row.update(reported_metrics(reply))
        verdict = self.policy.judge(dispatch, self._view(state))
        if verdict.status != APPLIED:
            return UpdateOutcome(status=verdict.status, reason=verdict.reason, **row)
        try:
            # A strategy that sends older versions than the current one (delayed updates)
            # keeps those itself; the engine holds the versions it handed out.
            base = self._bases.get(dispatch.model_version, self.arrays)
            contribution = self.strategy.accumulate(
                reply, base=base, weight_scale=verdict.weight_scale
            )
        except UpdateRejected as exc:
            log.warning("rejected update from %s: %s", row["site"], exc.reason)
            return self._failed_reply(
                state, UpdateOutcome(status=REJECTED, reason=exc.reason, **row)
            )
        except Exception as exc:  # a hostile reply must never take the server down
            log.exception("rejected malformed update from %s", row["site"])
            reason = f"malformed reply: {exc!r}"[:300]
            return self._failed_reply(state, UpdateOutcome(status=REJECTED, reason=reason, **row))
        state.applied += 1
        state.applied_nodes.add(dispatch.node_id)
        row.update(
            num_examples=contribution.num_examples,
            train_loss=finite(contribution.train_loss),
            compute_seconds=finite(contribution.compute_seconds, minimum=0.0),
        )
        return UpdateOutcome(status=APPLIED, reason=contribution.note, **row)

    @staticmethod
    def _failed_reply(state: _RoundState, outcome: UpdateOutcome) -> UpdateOutcome:
        """Note a reply that came back and failed (for the stop rule); return it."""
        state.failed_replies.append(outcome)
        return outcome

    def _expire_overdue(self, state: _RoundState) -> None:
        now = time.monotonic()
        for dispatch in [d for d in self._in_flight.values() if d.deadline < now]:
            self._abandon(dispatch)
            state.outcomes.append(
                self._row(dispatch, DROPPED, f"no reply within {self.round_timeout:.0f} s")
            )
            state.failed_nodes.add(dispatch.node_id)

    def _cancel_unwanted(self, state: _RoundState) -> None:
        for node_id in self.policy.to_cancel(self._view(state)):
            self._cancel(node_id, state)

    def _cancel(self, node_id: int, state: _RoundState) -> None:
        """Stop waiting for the site's update; the site is free for new work at once."""
        reason = "cancelled: the step it was computing for was decided without it"
        dispatch = self._in_flight.pop(node_id, None)
        if dispatch is not None:
            if dispatch.message_id:
                self._by_message.pop(dispatch.message_id, None)
                self._cancelled[dispatch.message_id] = dispatch
            else:  # never pushed: nothing went down
                self._deferred.pop(node_id, None)
                dispatch.bytes_down = 0
            state.outcomes.append(self._row(dispatch, CANCELLED, reason))
            return
        for i, arrival in enumerate(self._arrivals):
            if arrival.dispatch.node_id == node_id:
                # Pulled, but later on the clock than the decision. On the wall clock it
                # did arrive (its bytes count); a simulated one was still on its way.
                del self._arrivals[i]
                heapq.heapify(self._arrivals)
                row = self._row(arrival.dispatch, CANCELLED, reason)
                if not self.clock.virtual:
                    row = replace(row, bytes_up=arrival.bytes_up, arrived_at=arrival.pulled_at)
                state.outcomes.append(row)
                return

    def _row(self, dispatch: Dispatch, status: str, reason: str) -> UpdateOutcome:
        """The ledger row of a message that brought no update (dropped, cancelled, refused)."""
        return UpdateOutcome(
            site=self._name(dispatch.node_id),
            dispatched_round=dispatch.server_round,
            version_trained_on=dispatch.model_version,
            staleness=self.version - dispatch.model_version,
            bytes_up=0,
            bytes_down=dispatch.bytes_down,
            status=status,
            dispatched_at=dispatch.dispatched_at,
            reason=reason,
            virtual_dispatched_at=dispatch.schedule.dispatched_at if self.clock.virtual else None,
            **self._period_fields(dispatch),
        )

    def _period_fields(self, dispatch: Dispatch) -> dict[str, int]:
        """Under a pipelined policy: the update's period, the average its site had, the delay."""
        if not self.policy.pipelined:
            return {}
        return dict(
            period=dispatch.period,
            average_applied=dispatch.model_version,
            delay=max(0, dispatch.period - 1 - dispatch.model_version),
        )

    def _abandon(self, dispatch: Dispatch) -> None:
        """Stop waiting for ``dispatch``; its site stays busy until Flower answers it."""
        self._in_flight.pop(dispatch.node_id, None)
        self._by_message.pop(dispatch.message_id, None)
        self._abandoned[dispatch.message_id] = dispatch

    def _release_stuck(self, state: _RoundState) -> None:
        """Free sites whose given-up message neither came back nor expired in time.

        Flower answers an expired message with an error reply; this is the safety net
        for a SuperLink that never does, so a site is not lost for the rest of the run.
        """
        limit = time.monotonic() - self.round_timeout - 2 * TTL_GRACE_SECONDS
        for message_id, dispatch in list(self._abandoned.items()):
            if dispatch.deadline < limit:
                del self._abandoned[message_id]
        for message_id, dispatch in list(self._cancelled.items()):
            if dispatch.deadline < limit:
                del self._cancelled[message_id]
                self._push_deferred(dispatch.node_id, state)

    def _prune_bases(self) -> None:
        live = {d.model_version for d in self._in_flight.values()}
        live |= {a.dispatch.model_version for a in self._arrivals} | {self.version}
        self._bases = {v: a for v, a in self._bases.items() if v in live}
        self._distances.clear()

    def _model_distance(self, version: int) -> float:
        """‖x_current − x_version‖², computed once per pair of versions."""
        key = (self.version, version)
        if key not in self._distances:
            base = self._bases.get(version)
            if base is None or version == self.version:
                self._distances[key] = 0.0
            else:
                now, then = record_to_arrays(self.arrays), record_to_arrays(base)
                self._distances[key] = float(
                    sum(
                        np.sum((now[k].astype(np.float64) - then[k]) ** 2)
                        for k in now
                        if k in then and now[k].shape == then[k].shape
                    )
                )
        return self._distances[key]

    # ========================================================= federated evaluation
    def _evaluate_round(
        self, server_round: int, evaluate_config: ConfigRecord | None
    ) -> tuple[MetricRecord | None, tuple[EvaluationOutcome, ...]]:
        """Ask idle sites to evaluate the current model; aggregate and account for it."""
        # Not a site whose cancelled training message Flower still holds: an evaluation
        # message cannot wait behind it the way a deferred training message does.
        held = {d.node_id for d in self._cancelled.values()}
        idle = [n for n in self._idle_nodes() if n not in held]
        config = ConfigRecord(dict(evaluate_config or {}))
        config[keys.MODEL_VERSION] = self.version
        drafts = self.strategy.configure_evaluate(
            server_round, self.arrays, config, SubsetGrid(self.grid, idle)
        )
        exchanged = self._exchange(self._addressed(drafts, idle), timeout=self.round_timeout)
        outcomes = tuple(self._evaluation_outcome(dispatch, reply) for dispatch, reply in exchanged)
        answered = [reply for _, reply in exchanged if reply is not None]
        return self.strategy.aggregate_evaluate(server_round, answered), outcomes

    def _evaluation_outcome(self, dispatch: Dispatch, reply: Message | None) -> EvaluationOutcome:
        row: dict[str, Any] = dict(
            site=self._name(dispatch.node_id),
            model_version=dispatch.model_version,
            bytes_down=dispatch.bytes_down,
            dispatched_at=dispatch.dispatched_at,
        )
        if not dispatch.message_id:
            return EvaluationOutcome(
                bytes_up=0, status=DROPPED, reason=REFUSED, **{**row, "bytes_down": 0}
            )
        if reply is None:
            reason = f"no reply within {self.round_timeout:.0f} s"
            return EvaluationOutcome(bytes_up=0, status=DROPPED, reason=reason, **row)
        bytes_up = message_size(reply)
        arrived_at = self._replied_at.pop(dispatch.message_id, time.time())
        if reply.has_error():
            reason = f"site error {reply.error.code}: {condense_error(reply.error.reason or '')}"
            return EvaluationOutcome(
                bytes_up=bytes_up, status=DROPPED, reason=reason, arrived_at=arrived_at, **row
            )
        return EvaluationOutcome(
            bytes_up=bytes_up,
            status=EVALUATED,
            arrived_at=arrived_at,
            **row,
            **evaluation_metrics(reply),
        )

    def _exchange(
        self, messages: list[Message], *, timeout: float
    ) -> list[tuple[Dispatch, Message | None]]:
        """Push messages and pull until every reply is in or ``timeout`` passes.

        Returns each message's dispatch (with its measured size; an empty message id if
        the SuperLink refused it) and its reply, or None. Unanswered messages are
        abandoned like overdue training messages: their sites get no other message until
        Flower answers these.
        """
        if not messages:
            return []
        sizes: dict[int, int] = {}
        ids = self._push(messages)
        # Evaluation and queries are measurements beside training: wall times only, and
        # they do not move a virtual clock.
        now, deadline = time.time(), time.monotonic() + timeout
        dispatches: list[Dispatch] = []
        for msg, message_id in zip(messages, ids, strict=True):
            key = id(msg.content)
            if key not in sizes:
                sizes[key] = content_size(msg.content)
            dispatches.append(
                Dispatch(
                    node_id=msg.metadata.dst_node_id,
                    message_id=message_id,
                    server_round=0,
                    model_version=self.version,
                    dispatched_at=now,
                    deadline=deadline,
                    bytes_down=message_size(msg, sizes[key]),
                    message_type=msg.metadata.message_type,
                )
            )
        pending = {d.message_id: d for d in dispatches if d.message_id}
        replies: dict[str, Message] = {}
        while pending and time.monotonic() < deadline:
            got = 0
            waiting = list(pending)
            for start in range(0, len(waiting), PULL_CHUNK):
                for reply in self.grid.pull_messages(waiting[start : start + PULL_CHUNK]):
                    message_id = reply.metadata.reply_to_message_id
                    if pending.pop(message_id, None) is not None:
                        replies[message_id] = reply
                        self._replied_at[message_id] = time.time()
                        got += 1
            if not got:
                time.sleep(self.poll_interval)
        for dispatch in pending.values():
            self._abandoned[dispatch.message_id] = dispatch
            # busy for as long as Flower holds it: no pipelined work reaches back past it
            self.clock.rest(self._name(dispatch.node_id))
        return [(d, replies.get(d.message_id)) for d in dispatches]

    # ================================================================= helpers
    def _addressed(self, drafts: Iterable[Message], allowed: Sequence[int]) -> list[Message]:
        """The strategy's messages, re-stamped with the engine's TTL and model version.

        A message to a node outside ``allowed`` (busy, not offered), or a second one to
        the same node, is not sent: no site ever has two messages at once.
        """
        open_nodes = set(allowed)
        messages: list[Message] = []
        for draft in drafts:
            node_id = draft.metadata.dst_node_id
            if node_id not in open_nodes:
                log.warning("strategy addressed node %s, which may not get a message now", node_id)
                continue
            open_nodes.discard(node_id)
            messages.append(
                Message(
                    draft.content,
                    dst_node_id=node_id,
                    message_type=draft.metadata.message_type,
                    ttl=self.round_timeout + TTL_GRACE_SECONDS,
                    group_id=str(self.version),  # the model version the site is sent
                )
            )
        return messages

    def _view(self, state: _RoundState) -> EngineView:
        queued = {a.dispatch.node_id: a.dispatch for a in self._arrivals}
        return EngineView(
            away_nodes=frozenset(self._away),
            failed_nodes=frozenset(state.failed_nodes),
            model_distance=self._model_distance,
            server_round=state.server_round,
            model_version=self.version,
            idle_nodes=self._idle_nodes(),
            outstanding={**self._in_flight, **queued},
            dispatched_this_round=state.dispatched,
            arrived_this_round=len(state.outcomes),
            applied_this_round=state.applied,
            applied_nodes=frozenset(state.applied_nodes),
            connected_nodes=len(self.connected),
            sent_for_round=self._sent_per_period.get(state.server_round, 0),
            periods_outstanding=frozenset(
                d.period for d in (*self._in_flight.values(), *queued.values())
            ),
        )

    def _busy(self) -> set[int]:
        """Nodes with a message outstanding, refused a moment ago, or away (simulated).

        A node whose message was cancelled is not busy: its next message waits in
        ``_deferred`` for the cancelled one to come back.
        """
        now = time.monotonic()
        busy = set(self._in_flight)
        busy.update(d.node_id for d in self._abandoned.values())
        busy.update(a.dispatch.node_id for a in self._arrivals)
        busy.update(n for n, until in self._refused_until.items() if until > now)
        busy.update(self._away)  # until their return is taken in clock order
        return busy

    def _idle_nodes(self) -> tuple[int, ...]:
        """Known, connected sites with nothing outstanding, in join order."""
        busy = self._busy()
        return tuple(n for n in self.sites if n in self.connected and n not in busy)

    def _name(self, node_id: int) -> str:
        info = self.sites.get(node_id)
        return info.name if info else f"node-{node_id}"


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


def _int_within(value: object, low: int, high: int | None, default: int) -> int:
    """``value`` if it is an int in [low, high] (high None: no limit), else ``default``."""
    if isinstance(value, bool) or not isinstance(value, int):
        return default
    if value < low or (high is not None and value > high):
        return default
    return value


def _floats(record: MetricRecord) -> dict[str, float]:
    return {k: float(v) for k, v in record.items() if isinstance(v, int | float)}
