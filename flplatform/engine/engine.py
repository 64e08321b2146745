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

import logging
import re
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
    REJECTED,
    Dispatch,
    LedgerSink,
    NullLedger,
    RoundSummary,
    SiteInfo,
    UpdateOutcome,
    mean_or_none,
)
from flplatform.engine.policy import AggregationPolicy, EngineView, SyncPolicy
from flplatform.engine.wire import content_size, message_size
from flplatform.errors import RunFailed, UpdateRejected

log = logging.getLogger("flplatform.engine")

# A message's TTL outlives the engine's own deadline by this much, so an overdue site is
# dropped by the engine with a clear reason, and Flower's expiry then frees the site.
TTL_GRACE_SECONDS = 5.0


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


@dataclass
class _RoundState:
    server_round: int
    started_at: float
    dispatched: int = 0
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
        self.sites: dict[int, SiteInfo] = {}
        self.version = 0
        self.arrays = ArrayRecord()
        self._bases: dict[int, ArrayRecord] = {}  # model versions still referenced in flight
        self._in_flight: dict[int, Dispatch] = {}  # node id → dispatch
        self._by_message: dict[str, Dispatch] = {}
        # Messages given up on (overdue, cancelled): their site stays busy until Flower
        # hands back the late reply or the TTL-expiry error, so no site ever has two.
        self._abandoned: dict[str, Dispatch] = {}

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
            summary, train_metrics = self._train_round(server_round, train_config)
            metrics: dict[str, float] = {}
            # ---- central evaluation on the server's held-out set
            if evaluate_fn is not None:
                central = evaluate_fn(server_round, self.arrays)
                if central is not None:
                    result.evaluate_metrics_serverapp[server_round] = central
                    metrics.update(_floats(central))
            # ---- federated evaluation on the sites, when asked
            if federated_evaluation:
                site_metrics = self._evaluate_round(server_round, evaluate_config)
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

        queries = [
            Message(
                RecordDict({keys.CONFIG: ConfigRecord()}),
                dst_node_id=node_id,
                message_type=MessageType.QUERY,
                ttl=self.startup_timeout,
            )
            for node_id in node_ids
        ]
        replies = self._exchange(queries, timeout=self.startup_timeout)
        taken: set[str] = set()
        infos = [_site_info(node_id, replies.get(node_id)) for node_id in node_ids]
        # Partition order (then name) keeps the ledger's site order the same across runs.
        infos.sort(key=lambda s: (s.partition_id is None, s.partition_id or 0, s.name))
        for info in infos:
            node_id = info.node_id
            if info.name in taken:  # two nodes claiming one name: keep both, distinguishably
                info = SiteInfo(
                    node_id, f"{info.name}-{node_id}", info.partition_id, info.num_examples
                )
            taken.add(info.name)
            self.sites[node_id] = info
            profile = {"device": info.device} if info.device else {}
            self.ledger.add_site(info, profile)
        log.info("sites: %s", ", ".join(s.name for s in self.sites.values()))
        return self.sites

    # ============================================================ training round
    def _train_round(
        self, server_round: int, train_config: ConfigRecord | None
    ) -> tuple[RoundSummary, MetricRecord | None]:
        state = _RoundState(server_round, self.clock.now())
        self.strategy.begin_aggregation(server_round, self.arrays)
        wait_since = time.monotonic()
        while True:
            # ---- dispatch: the policy says who may get work; the strategy samples
            targets = self.policy.dispatch_targets(self._view(state))
            if targets:
                state.dispatched += self._dispatch(server_round, targets, train_config)
            # ---- collect: whatever has arrived, in clock order; then overdue sites
            arrived = self._collect(state)
            self._expire_overdue(state)
            # ---- cancel what the policy no longer wants
            for node_id in self.policy.to_cancel(self._view(state)):
                self._cancel(node_id, state)
            if self.policy.ready_to_aggregate(self._view(state)):
                break
            if not arrived:
                if (
                    not self._in_flight
                    and not self._abandoned
                    and time.monotonic() - wait_since > self.round_timeout
                ):
                    raise RunFailed(
                        f"round {server_round}: no site could be given work within "
                        f"{self.round_timeout:.0f} s"
                    )
                time.sleep(self.poll_interval)

        # ---- aggregate into the next model version
        arrays, train_metrics = self.strategy.finish_aggregation()
        if arrays is not None:
            self.arrays = arrays
            self.version += 1
        self._prune_bases()
        losses = [u.train_loss for u in state.outcomes if u.status == APPLIED and u.train_loss]
        summary = RoundSummary(
            server_round=server_round,
            model_version=self.version,
            started_at=state.started_at,
            finished_at=self.clock.now(),
            metrics={},
            train_loss=mean_or_none([float(x) for x in losses]),
            updates=tuple(state.outcomes),
        )
        return summary, train_metrics

    def _dispatch(
        self, server_round: int, targets: Sequence[int], train_config: ConfigRecord | None
    ) -> int:
        config = ConfigRecord(dict(train_config or {}))  # the strategy may write into it
        config[keys.MODEL_VERSION] = self.version
        drafts = self.strategy.configure_train(
            server_round, self.arrays, config, SubsetGrid(self.grid, targets)
        )
        messages: list[Message] = []
        for draft in drafts:
            node_id = draft.metadata.dst_node_id
            if node_id in self._in_flight:  # never two messages to one site
                log.warning("not dispatching to busy node %s", node_id)
                continue
            messages.append(
                Message(
                    draft.content,
                    dst_node_id=node_id,
                    message_type=draft.metadata.message_type,
                    ttl=self.round_timeout + TTL_GRACE_SECONDS,
                    group_id=str(self.version),
                )
            )
        if not messages:
            return 0
        self._bases[self.version] = self.arrays
        sizes: dict[int, int] = {}  # a broadcast shares one content: measure it once
        now = self.clock.now()
        message_ids = list(self.grid.push_messages(messages))
        for msg, message_id in zip(messages, message_ids, strict=True):
            key = id(msg.content)
            if key not in sizes:
                sizes[key] = content_size(msg.content)
            dispatch = Dispatch(
                node_id=msg.metadata.dst_node_id,
                message_id=message_id,
                server_round=server_round,
                model_version=self.version,
                dispatched_at=now,
                deadline=time.monotonic() + self.round_timeout,
                bytes_down=message_size(msg, sizes[key]),
            )
            self._in_flight[dispatch.node_id] = dispatch
            self._by_message[message_id] = dispatch
        return len(messages)

    def _collect(self, state: _RoundState) -> int:
        if not self._by_message and not self._abandoned:
            return 0
        self._release_stuck()
        replies = list(self.grid.pull_messages([*self._by_message, *self._abandoned]))
        stamped: list[tuple[float, Dispatch, Message, int]] = []
        for reply in replies:
            message_id = reply.metadata.reply_to_message_id
            if self._abandoned.pop(message_id, None) is not None:
                continue  # a late reply to a message already recorded as dropped: site free
            dispatch = self._by_message.pop(message_id, None)
            if dispatch is None:
                continue
            self._in_flight.pop(dispatch.node_id, None)
            bytes_up = message_size(reply)
            arrived_at = self.clock.arrival_time(
                site=self._name(dispatch.node_id),
                dispatched_at=dispatch.dispatched_at,
                bytes_down=dispatch.bytes_down,
                bytes_up=bytes_up,
                compute_seconds=None,
            )
            stamped.append((arrived_at, dispatch, reply, bytes_up))
        for arrived_at, dispatch, reply, bytes_up in sorted(stamped, key=lambda s: s[0]):
            state.outcomes.append(self._judge(dispatch, reply, bytes_up, arrived_at, state))
        return len(stamped)

    def _judge(
        self,
        dispatch: Dispatch,
        reply: Message,
        bytes_up: int,
        arrived_at: float,
        state: _RoundState,
    ) -> UpdateOutcome:
        """Turn one reply into a ledger row, feeding it to the strategy if applied."""
        row: dict[str, Any] = dict(
            site=self._name(dispatch.node_id),
            dispatched_round=dispatch.server_round,
            version_trained_on=dispatch.model_version,
            staleness=self.version - dispatch.model_version,
            bytes_up=bytes_up,
            bytes_down=dispatch.bytes_down,
            dispatched_at=dispatch.dispatched_at,
            arrived_at=arrived_at,
        )
        if reply.has_error():
            reason = f"site error {reply.error.code}: {condense_error(reply.error.reason or '')}"
            return UpdateOutcome(status=DROPPED, reason=reason, **row)
        verdict = self.policy.judge(dispatch, self._view(state))
        row.update(_reported_metrics(reply))
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
            log.warning("rejected malformed update from %s: %r", row["site"], exc)
            return UpdateOutcome(status=REJECTED, reason=f"malformed reply: {exc!r}"[:500], **row)
        row.update(
            num_examples=contribution.num_examples,
            train_loss=contribution.train_loss,
            compute_seconds=contribution.compute_seconds,
        )
        return UpdateOutcome(status=APPLIED, **row)

    def _expire_overdue(self, state: _RoundState) -> None:
        now = time.monotonic()
        for dispatch in [d for d in self._in_flight.values() if d.deadline < now]:
            self._forget(dispatch)
            state.outcomes.append(
                self._unanswered(dispatch, DROPPED, f"no reply within {self.round_timeout:.0f} s")
            )

    def _cancel(self, node_id: int, state: _RoundState) -> None:
        dispatch = self._in_flight.get(node_id)
        if dispatch is not None:
            self._forget(dispatch)
            state.outcomes.append(self._unanswered(dispatch, CANCELLED, "cancelled by policy"))

    def _unanswered(self, dispatch: Dispatch, status: str, reason: str) -> UpdateOutcome:
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
        )

    def _forget(self, dispatch: Dispatch) -> None:
        """Stop waiting for ``dispatch``; its site stays busy until Flower answers it."""
        self._in_flight.pop(dispatch.node_id, None)
        self._by_message.pop(dispatch.message_id, None)
        self._abandoned[dispatch.message_id] = dispatch

    def _release_stuck(self) -> None:
        """Free sites whose abandoned message neither came back nor expired in time.

        Flower answers an expired message with an error reply; this is the safety net
        for a SuperLink that never does, so a site is not lost for the rest of the run.
        """
        limit = time.monotonic() - self.round_timeout
        for message_id, dispatch in list(self._abandoned.items()):
            if dispatch.deadline < limit:
                del self._abandoned[message_id]

    def _prune_bases(self) -> None:
        live = {d.model_version for d in self._in_flight.values()} | {self.version}
        self._bases = {v: a for v, a in self._bases.items() if v in live}

    # ========================================================= federated evaluation
    def _evaluate_round(
        self, server_round: int, evaluate_config: ConfigRecord | None
    ) -> MetricRecord | None:
        idle = [n for n in self.sites if self._is_idle(n)]
        config = ConfigRecord(dict(evaluate_config or {}))
        config[keys.MODEL_VERSION] = self.version
        drafts = self.strategy.configure_evaluate(
            server_round, self.arrays, config, SubsetGrid(self.grid, idle)
        )
        messages = [
            Message(
                d.content,
                dst_node_id=d.metadata.dst_node_id,
                message_type=d.metadata.message_type,
                ttl=self.round_timeout + TTL_GRACE_SECONDS,
                group_id=str(self.version),
            )
            for d in drafts
        ]
        replies = self._exchange(messages, timeout=self.round_timeout)
        return self.strategy.aggregate_evaluate(server_round, replies.values())

    def _exchange(self, messages: list[Message], *, timeout: float) -> dict[int, Message]:
        """Push messages and pull until every reply is in or the timeout passes."""
        if not messages:
            return {}
        ids = list(self.grid.push_messages(messages))
        pending = dict(zip(ids, (m.metadata.dst_node_id for m in messages), strict=True))
        replies: dict[int, Message] = {}
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            got = list(self.grid.pull_messages(list(pending)))
            for reply in got:
                node_id = pending.pop(reply.metadata.reply_to_message_id, None)
                if node_id is not None:
                    replies[node_id] = reply
            if not got:
                time.sleep(self.poll_interval)
        return replies

    # ================================================================= helpers
    def _view(self, state: _RoundState) -> EngineView:
        return EngineView(
            server_round=state.server_round,
            model_version=self.version,
            idle_nodes=tuple(n for n in self.sites if self._is_idle(n)),
            in_flight=dict(self._in_flight),
            dispatched_this_round=state.dispatched,
            arrived_this_round=len(state.outcomes),
        )

    def _is_idle(self, node_id: int) -> bool:
        return node_id not in self._in_flight and all(
            d.node_id != node_id for d in self._abandoned.values()
        )

    def _name(self, node_id: int) -> str:
        info = self.sites.get(node_id)
        return info.name if info else f"node-{node_id}"


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*")


def condense_error(reason: str, limit: int = 300) -> str:
    """The telling part of a site's error: the last ``SomeError: message`` line.

    Error replies carry whole remote tracebacks (Ray's, with terminal colours); the
    ledger keeps one readable line.
    """
    lines = [line.strip() for line in _ANSI.sub("", reason).splitlines() if line.strip()]
    exceptions = [line for line in lines if _EXCEPTION_LINE.match(line)]
    # Wrappers (ClientAppException, RayTaskError) often end with an empty message; the
    # site's own exception is the last one that says something.
    telling = [line for line in exceptions if line.split(":", 1)[-1].strip()]
    chosen = (telling or exceptions or lines or ["no reason given"])[-1]
    return chosen[:limit]


def _site_info(node_id: int, reply: Message | None) -> SiteInfo:
    if reply is None or reply.has_error() or keys.SITE_INFO not in reply.content:
        return SiteInfo(node_id=node_id, name=f"node-{node_id}")
    info = reply.content[keys.SITE_INFO]
    name = str(info.get(keys.SITE_NAME, f"node-{node_id}"))[:64] or f"node-{node_id}"
    partition = info.get(keys.PARTITION_ID)
    examples = info.get(keys.NUM_EXAMPLES)
    device = info.get(keys.DEVICE)
    return SiteInfo(
        node_id=node_id,
        name=name,
        partition_id=int(partition) if isinstance(partition, int) else None,
        num_examples=int(examples) if isinstance(examples, int) else None,
        device=str(device) if device is not None else None,
    )


def _reported_metrics(reply: Message) -> dict[str, Any]:
    """Best-effort read of what a site reports, for replies that are not applied."""
    out: dict[str, Any] = {}
    try:
        metrics = reply.content[keys.METRICS]
    except Exception:
        return out
    examples = metrics.get(keys.NUM_EXAMPLES) if hasattr(metrics, "get") else None
    if isinstance(examples, int) and examples >= 0:
        out["num_examples"] = examples
    for key in keys.TRAIN_LOSS_ALIASES:
        value = metrics.get(key)
        if isinstance(value, int | float):
            out["train_loss"] = float(value)
            break
    seconds = metrics.get(keys.COMPUTE_SECONDS)
    if isinstance(seconds, int | float):
        out["compute_seconds"] = float(seconds)
    return out


def _floats(record: MetricRecord) -> dict[str, float]:
    return {k: float(v) for k, v in record.items() if isinstance(v, int | float)}
