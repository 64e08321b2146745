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

The strategy keeps Flower's hooks (``configure_train``, ``configure_evaluate``,
``aggregate_evaluate``) and adds three streaming ones (``begin_aggregation``,
``accumulate``, ``finish_aggregation``); see ``EngineStrategy``.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from flplatform import keys
from flplatform.engine.clock import Clock, WallClock
from flplatform.engine.events import (
    APPLIED,
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
from flplatform.engine.policy import AggregationPolicy, EngineView, SyncPolicy
from flplatform.engine.replies import (
    condense_error,
    evaluation_metrics,
    finite,
    reported_metrics,
    site_info,
)
from flplatform.engine.wire import content_size, message_size
from flplatform.errors import RunFailed, UpdateRejected

log = logging.getLogger("flplatform.engine")

# A message's TTL outlives the engine's own deadline by this much, so an overdue site is
# dropped by the engine with a clear reason, and Flower's expiry then frees the site.
TTL_GRACE_SECONDS = 5.0
# Replies pulled per call: a SuperLink hands back every ready reply fully decoded, so
# pulling all pending ids at once would hold (sites × model) bytes in memory.
PULL_CHUNK = 16
REFUSED = "refused by the SuperLink (node not connected, or the message too large)"
# A refused site is not offered work again for this long (it may be reconnecting).
REFUSED_BACKOFF = 5.0


@dataclass(frozen=True)
class Contribution:
    """What the strategy read from an accepted reply."""

    num_examples: int
    train_loss: float | None = None
    compute_seconds: float | None = None


class EngineStrategy(Protocol):
    """The hooks the engine calls; Flower's own plus streaming aggregation."""

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

    arrived_at: float
    seq: int
    dispatch: Dispatch = field(compare=False)
    reply: Message = field(compare=False)
    bytes_up: int = field(compare=False)


@dataclass
class _RoundState:
    server_round: int
    started_at: float
    dispatched: int = 0
    applied: int = 0
    applied_nodes: set[int] = field(default_factory=set)
    outcomes: list[UpdateOutcome] = field(default_factory=list)


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
        Orders arrivals; the wall clock by default.
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
    ) -> None:
        self.grid = grid
        self.strategy = strategy
        self.policy: AggregationPolicy = policy or SyncPolicy()
        self.clock: Clock = clock or WallClock()
        self.ledger: LedgerSink = ledger or NullLedger()
        self.round_timeout = round_timeout
        self.required_sites = required_sites
        self.startup_timeout = startup_timeout
        self.poll_interval = poll_interval
        self.on_round = on_round
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
        self.discover_sites()
        if evaluate_fn is not None:
            initial = evaluate_fn(0, initial_arrays)
            if initial is not None:
                result.evaluate_metrics_serverapp[0] = initial

        for server_round in range(1, num_rounds + 1):
            self.refresh_sites()
            summary, train_metrics = self._train_round(server_round, train_config)
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
            summary = RoundSummary(
                server_round=summary.server_round,
                model_version=summary.model_version,
                started_at=summary.started_at,
                finished_at=self.clock.now(),
                metrics=metrics,
                train_loss=summary.train_loss,
                updates=summary.updates,
                evaluations=evaluations,
            )
            self.ledger.record_round(summary)
            if self.on_round is not None:
                self.on_round(summary)
        result.arrays = self.arrays
        return result

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
            self.sites[info.node_id] = info
            self.ledger.add_site(info, {"device": info.device} if info.device else {})
        self.connected.update(node_ids)
        log.info("sites: %s", ", ".join(self.sites[n].name for n in node_ids))

    # ============================================================ training round
    def _train_round(
        self, server_round: int, train_config: ConfigRecord | None
    ) -> tuple[RoundSummary, MetricRecord | None]:
        state = _RoundState(server_round, self.clock.now())
        self.strategy.begin_aggregation(server_round, self.arrays)
        waiting_since = time.monotonic()
        while True:
            # ---- dispatch: the policy says who may get work; the strategy samples
            targets = self.policy.dispatch_targets(self._view(state))
            if targets:
                state.dispatched += self._dispatch(state, targets, train_config)
            # ---- pull what has arrived, judging it in clock order; drop overdue sites
            pulled = self._pull_chunks(state)
            self._expire_overdue(state)
            self._judge_ready(state)
            # ---- cancel what the policy no longer wants
            for node_id in self.policy.to_cancel(self._view(state)):
                self._cancel(node_id, state)
            if self.policy.ready_to_aggregate(self._view(state)):
                break
            if pulled:
                waiting_since = time.monotonic()
                continue
            outstanding = self._in_flight or self._abandoned or self._arrivals
            if not outstanding and not self._view(state).idle_nodes:
                if time.monotonic() - waiting_since > self.round_timeout:
                    raise RunFailed(
                        f"round {server_round}: no site could be given work within "
                        f"{self.round_timeout:.0f} s"
                    )
                self.refresh_sites()  # waiting for sites: maybe some joined
            time.sleep(self.poll_interval)

        # ---- aggregate into the next model version
        arrays, train_metrics = self.strategy.finish_aggregation()
        if arrays is not None:
            self.arrays = arrays
            self.version += 1
        self._prune_bases()
        summary = RoundSummary(
            server_round=server_round,
            model_version=self.version,
            started_at=state.started_at,
            finished_at=self.clock.now(),
            metrics={},
            train_loss=_example_weighted_loss(state.outcomes),
            updates=tuple(state.outcomes),
        )
        return summary, train_metrics

    def _dispatch(
        self, state: _RoundState, targets: Sequence[int], train_config: ConfigRecord | None
    ) -> int:
        """Push training messages to sampled targets; return how many were attempted."""
        config = ConfigRecord(dict(train_config or {}))  # the strategy may write into it
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
        now = self.clock.now()
        for msg, message_id in zip(messages, self._push(messages), strict=True):
            key = id(msg.content)
            if key not in sizes:
                sizes[key] = content_size(msg.content)
            dispatch = Dispatch(
                node_id=msg.metadata.dst_node_id,
                message_id=message_id,
                server_round=state.server_round,
                model_version=self.version,
                dispatched_at=now,
                deadline=time.monotonic() + self.round_timeout,
                bytes_down=message_size(msg, sizes[key]),
            )
            if not message_id:  # the SuperLink took nothing: no bytes went down
                state.outcomes.append(self._unanswered(dispatch, DROPPED, REFUSED, sent=False))
                self._refused_until[dispatch.node_id] = time.monotonic() + REFUSED_BACKOFF
                continue
            self._in_flight[dispatch.node_id] = dispatch
            self._by_message[message_id] = dispatch
        return len(messages)

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
        self._release_stuck()
        waiting = [*self._by_message, *self._abandoned]
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
                if reply.has_content():  # the site did send it: account for the bytes
                    state.outcomes.append(self._late(abandoned, reply))
                continue
            dispatch = self._by_message.pop(message_id, None)
            if dispatch is None:
                continue  # not ours (or already handled)
            self._in_flight.pop(dispatch.node_id, None)
            bytes_up = message_size(reply)
            reported = reported_metrics(reply) if not reply.has_error() else {}
            arrived_at = self.clock.arrival_time(
                site=self._name(dispatch.node_id),
                dispatched_at=dispatch.dispatched_at,
                bytes_down=dispatch.bytes_down,
                bytes_up=bytes_up,
                compute_seconds=reported.get("compute_seconds"),
            )
            heapq.heappush(
                self._arrivals, _Arrival(arrived_at, next(self._seq), dispatch, reply, bytes_up)
            )
            count += 1
        return count

    def _judge_ready(self, state: _RoundState) -> None:
        """Judge queued arrivals in clock order, one at a time, until the policy is ready."""
        while self._arrivals and self.clock.releasable(
            self._arrivals[0].arrived_at, self._in_flight
        ):
            if self.policy.ready_to_aggregate(self._view(state)):
                return
            state.outcomes.append(self._judge(heapq.heappop(self._arrivals), state))

    def _late(self, dispatch: Dispatch, reply: Message) -> UpdateOutcome:
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
            arrived_at=self.clock.now(),
            reason="late: arrived after it was given up on",
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
            arrived_at=arrival.arrived_at,
        )
        if reply.has_error():
            reason = f"site error {reply.error.code}: {condense_error(reply.error.reason or '')}"
            return UpdateOutcome(status=DROPPED, reason=reason, **row)
        row.update(reported_metrics(reply))
        verdict = self.policy.judge(dispatch, self._view(state))
        if verdict.status != APPLIED:
            return UpdateOutcome(status=verdict.status, reason=verdict.reason, **row)
        try:
            contribution = self.strategy.accumulate(
                reply, base=self._bases[dispatch.model_version], weight_scale=verdict.weight_scale
            )
        except UpdateRejected as exc:
            log.warning("rejected update from %s: %s", row["site"], exc.reason)
            return UpdateOutcome(status=REJECTED, reason=exc.reason, **row)
        except Exception as exc:  # a hostile reply must never take the server down
            log.exception("rejected malformed update from %s", row["site"])
            return UpdateOutcome(status=REJECTED, reason=f"malformed reply: {exc!r}"[:300], **row)
        state.applied += 1
        state.applied_nodes.add(dispatch.node_id)
        row.update(
            num_examples=contribution.num_examples,
            train_loss=finite(contribution.train_loss),
            compute_seconds=finite(contribution.compute_seconds, minimum=0.0),
        )
        return UpdateOutcome(status=APPLIED, **row)

    def _expire_overdue(self, state: _RoundState) -> None:
        now = time.monotonic()
        for dispatch in [d for d in self._in_flight.values() if d.deadline < now]:
            self._abandon(dispatch)
            state.outcomes.append(
                self._unanswered(dispatch, DROPPED, f"no reply within {self.round_timeout:.0f} s")
            )

    def _cancel(self, node_id: int, state: _RoundState) -> None:
        dispatch = self._in_flight.get(node_id)
        if dispatch is not None:
            self._abandon(dispatch)
            state.outcomes.append(self._unanswered(dispatch, CANCELLED, "cancelled by policy"))

    def _unanswered(
        self, dispatch: Dispatch, status: str, reason: str, *, sent: bool = True
    ) -> UpdateOutcome:
        return UpdateOutcome(
            site=self._name(dispatch.node_id),
            dispatched_round=dispatch.server_round,
            version_trained_on=dispatch.model_version,
            staleness=self.version - dispatch.model_version,
            bytes_up=0,
            bytes_down=dispatch.bytes_down if sent else 0,
            status=status,
            dispatched_at=dispatch.dispatched_at,
            reason=reason,
        )

    def _abandon(self, dispatch: Dispatch) -> None:
        """Stop waiting for ``dispatch``; its site stays busy until Flower answers it."""
        self._in_flight.pop(dispatch.node_id, None)
        self._by_message.pop(dispatch.message_id, None)
        self._abandoned[dispatch.message_id] = dispatch

    def _release_stuck(self) -> None:
        """Free sites whose abandoned message neither came back nor expired in time.

        Flower answers an expired message with an error reply; this is the safety net
        for a SuperLink that never does, so a site is not lost for the rest of the run.
        """
        limit = time.monotonic() - self.round_timeout - 2 * TTL_GRACE_SECONDS
        for message_id, dispatch in list(self._abandoned.items()):
            if dispatch.deadline < limit:
                del self._abandoned[message_id]

    def _prune_bases(self) -> None:
        live = {d.model_version for d in self._in_flight.values()}
        live |= {a.dispatch.model_version for a in self._arrivals} | {self.version}
        self._bases = {v: a for v, a in self._bases.items() if v in live}

    # ========================================================= federated evaluation
    def _evaluate_round(
        self, server_round: int, evaluate_config: ConfigRecord | None
    ) -> tuple[MetricRecord | None, tuple[EvaluationOutcome, ...]]:
        """Ask idle sites to evaluate the current model; aggregate and account for it."""
        idle = list(self._idle_nodes())
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
        arrived_at = self._replied_at.pop(dispatch.message_id, self.clock.now())
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
        now, deadline = self.clock.now(), time.monotonic() + timeout
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
                        self._replied_at[message_id] = self.clock.now()
                        got += 1
            if not got:
                time.sleep(self.poll_interval)
        for dispatch in pending.values():
            self._abandoned[dispatch.message_id] = dispatch
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
            server_round=state.server_round,
            model_version=self.version,
            idle_nodes=self._idle_nodes(),
            outstanding={**self._in_flight, **queued},
            dispatched_this_round=state.dispatched,
            arrived_this_round=len(state.outcomes),
            applied_this_round=state.applied,
            applied_nodes=frozenset(state.applied_nodes),
            connected_nodes=len(self.connected),
        )

    def _busy(self) -> set[int]:
        """Nodes with a message of any kind outstanding, or refused a moment ago."""
        now = time.monotonic()
        busy = set(self._in_flight)
        busy.update(d.node_id for d in self._abandoned.values())
        busy.update(a.dispatch.node_id for a in self._arrivals)
        busy.update(n for n, until in self._refused_until.items() if until > now)
        return busy

    def _idle_nodes(self) -> tuple[int, ...]:
        """Known, connected sites with nothing outstanding, in join order."""
        busy = self._busy()
        return tuple(n for n in self.sites if n in self.connected and n not in busy)

    def _name(self, node_id: int) -> str:
        info = self.sites.get(node_id)
        return info.name if info else f"node-{node_id}"


def _example_weighted_loss(outcomes: Sequence[UpdateOutcome]) -> float | None:
    """Σ n·loss / Σ n over applied updates that reported both."""
    pairs = [
        (u.num_examples, u.train_loss)
        for u in outcomes
        if u.status == APPLIED and u.train_loss is not None and u.num_examples
    ]
    total = sum(n for n, _ in pairs)
    return sum(n * loss for n, loss in pairs) / total if total else None


def _floats(record: MetricRecord) -> dict[str, float]:
    return {k: float(v) for k, v in record.items() if isinstance(v, int | float)}
