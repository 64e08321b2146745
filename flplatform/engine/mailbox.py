"""The messages in flight: push, pull, give up, cancel, and pushes deferred behind a cancel.

Every pushed message whose reply Flower may still hand back is in exactly one of three
trays, by message id:

* ``awaited``: training messages whose reply the engine waits for;
* ``given_up``: messages the engine stopped waiting for (overdue training, unanswered
  evaluation or query); their site stays busy until Flower hands back the late reply or
  the TTL-expiry error, so that no site ever has two messages at once;
* ``cancelled``: training messages the policy cancelled; their site is free at once (in
  clock order), and its next message waits in ``deferred`` until the cancelled one is back.

Pulled training replies wait in ``arrivals``, a heap in clock order, until the engine
judges them. The mailbox measures what every message and reply costs on the wire
(``flplatform.engine.wire``); it decides nothing.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ConfigRecord, Error, Message, MessageType, Metadata, RecordDict
from flwr.serverapp import Grid

from flplatform.core import keys
from flplatform.core.checkpoint import StateProblems
from flplatform.engine.clock import Clock, Landing, Schedule
from flplatform.engine.events import Dispatch
from flplatform.engine.replies import reported_metrics
from flplatform.engine.wire import ContentSize, delivery_bytes, measure, reply_traffic

log = logging.getLogger("flplatform.engine")

# A message's TTL outlives the engine's own deadline by this much, so an overdue site is
# dropped by the engine with a clear reason, and Flower's expiry then frees the site.
TTL_GRACE_SECONDS = 5.0
# Replies pulled per call: a SuperLink hands back every ready reply fully decoded, so
# pulling all pending ids at once would hold (sites × model) bytes in memory.
PULL_CHUNK = 16
# The longest sleep between two pulls that found nothing (s). Every pull is a request the
# SuperLink answers from its database: at the shortest interval a deployed round, which
# waits seconds for Flower's SuperNodes, asked it twenty times a second.
LONGEST_POLL_SECONDS = 0.5


def poll_wait(waited: float, shortest: float) -> float:
    """Seconds to sleep before pulling again, nothing having arrived for ``waited`` s:
    a tenth of that, at least ``shortest`` and at most ``LONGEST_POLL_SECONDS``.

    A reply is then taken at most a tenth of its wait (or ``shortest``, or half a second)
    after it arrived; a wait of T seconds costs ``10`` pulls for its first ``10 shortest``
    seconds, then about ``log(T / 10 shortest) / log 1.1`` (and two a second past five
    seconds), not ``T / shortest``. On the wall clock a reply lands when it is pulled, so
    replies pulled together are in the SuperLink's order: half a second of a wait of
    seconds, where Flower's SuperNodes themselves poll every few seconds.
    """
    return min(max(shortest, waited / 10), max(shortest, LONGEST_POLL_SECONDS))


@dataclass(order=True)
class Arrival:
    """A pulled reply waiting for its turn, in clock order."""

    arrived_at: float  # clock time
    # ties on the clock go to the site that joined first (as ``Sites.next_back``), not to
    # the order of pulling: Flower hands a pull's replies back in a set's order
    place: int
    seq: int
    dispatch: Dispatch = field(compare=False)
    reply: Message = field(compare=False)
    bytes_up: int = field(compare=False)  # the reply's bytes site → server
    landing: Landing = field(compare=False)
    pulled_at: float = field(compare=False)  # wall time
    # the reply's bytes server → site: Flower's acknowledgement of its push
    ack_bytes: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Late:
    """A reply to a message the engine no longer waited for (given up on, or cancelled)."""

    dispatch: Dispatch
    reply: Message
    cancelled: bool  # cancelled by the policy (else given up on)


@dataclass(frozen=True)
class SavedWork:
    """A training message in flight at a checkpoint, to be sent again on resume."""

    tray: str  # "awaited", "cancelled" or "deferred" (see ``Mailbox.state_dict``)
    dispatch: Dispatch  # node id already this run's
    content: RecordDict

    def message(self, *, ttl: float) -> Message:
        """The same message to the site's node of this run."""
        return Message(
            self.content,
            dst_node_id=self.dispatch.node_id,
            message_type=self.dispatch.message_type,
            ttl=ttl,
            group_id=str(self.dispatch.model_version),
        )


class Mailbox:
    """The engine's messages in flight over one Grid.

    Parameters
    ----------
    grid : Grid
        Where messages are pushed and replies pulled.
    clock : Clock
        Lands each pulled training reply (its place in clock order).
    name : callable
        Node id → site name (for the clock).
    position : callable, optional
        Node id → the site's place in join order (ties on the clock; None: the order of
        pulling).
    poll_interval : float
        Seconds between pulls while ``exchange`` waits, at first (``poll_wait``; 0 sets
        no shortest sleep).
    site_config : ConfigRecord, optional
        Added to every message sent (``stamp``); None adds nothing.
    """

    def __init__(
        self,
        grid: Grid,
        clock: Clock,
        name: Callable[[int], str],
        poll_interval: float,
        *,
        site_config: ConfigRecord | None = None,
        position: Callable[[int], int] | None = None,
    ) -> None:
        self.grid = grid
        self.site_config = site_config
        self.clock = clock
        self.name = name
        self.position = position or (lambda node_id: 0)
        self.poll_interval = poll_interval
        self.awaited: dict[str, Dispatch] = {}
        self.given_up: dict[str, Dispatch] = {}
        self.cancelled: dict[str, Dispatch] = {}
        self.deferred: dict[int, tuple[Message, Dispatch]] = {}  # node → its next push
        self.arrivals: list[Arrival] = []  # a heap by clock time
        self.replied_at: dict[str, float] = {}  # evaluation/query reply → its wall time
        # awaited and cancelled training messages: message id → content (a resumed run
        # sends the same work again)
        self.contents: dict[str, RecordDict] = {}
        self._seq = 0  # arrivals' order of pulling (ties on the clock)

    # ------------------------------------------------------------------ state
    def empty(self, *, besides: Collection[int] = ()) -> bool:
        """Nothing out and nothing waiting to be judged, besides given-up messages of the
        nodes ``besides`` (silent sites' queries: no work can come of them)."""
        return not (
            self.awaited
            or self.cancelled
            or self.arrivals
            or any(d.node_id not in besides for d in self.given_up.values())
        )

    def holds(self, node_id: int) -> bool:
        """Whether Flower holds a message of ``node_id`` (awaited, given up on, cancelled)
        or one waits to be pushed to it."""
        return node_id in self.deferred or any(
            d.node_id == node_id
            for tray in (self.awaited, self.given_up, self.cancelled)
            for d in tray.values()
        )

    def holds_work(self, node_id: int) -> bool:
        """Whether a message of ``node_id`` is still work: awaited, cancelled but held by
        Flower (its site still does it), or waiting to be pushed; not one given up on."""
        return node_id in self.deferred or any(
            d.node_id == node_id for tray in (self.awaited, self.cancelled) for d in tray.values()
        )

    def holds_cancelled(self, node_id: int) -> bool:
        """Whether Flower still holds a cancelled training message of ``node_id``."""
        return any(d.node_id == node_id for d in self.cancelled.values())

    def queued(self) -> dict[int, Dispatch]:
        """Node → the training message whose reply waits to be judged (heap order)."""
        return {a.dispatch.node_id: a.dispatch for a in self.arrivals}

    # ------------------------------------------------------------------- push
    def stamp(self, messages: list[Message]) -> list[Message]:
        """``messages`` carrying the site config under ``keys.RUN_CONFIG``, if there is one.

        Called on every message before it is measured, so that the ledger's bytes are the
        stamped message's. Messages that share a content (a broadcast) share the stamped
        one; without a site config the messages are returned as they are.
        """
        if self.site_config is None:
            return messages
        stamped: dict[int, RecordDict] = {}
        out = []
        for msg in messages:
            key = id(msg.content)
            if key not in stamped:
                stamped[key] = RecordDict({**msg.content, keys.RUN_CONFIG: self.site_config})
            out.append(
                Message(
                    stamped[key],
                    dst_node_id=msg.metadata.dst_node_id,
                    message_type=msg.metadata.message_type,
                    ttl=msg.metadata.ttl,
                    group_id=msg.metadata.group_id,
                )
            )
        return out

    def push(self, messages: list[Message]) -> list[str]:
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

    def push_training(
        self, pairs: list[tuple[Message, Dispatch]], timeout: float
    ) -> list[Dispatch]:
        """Push training messages and await them; return the dispatches that were refused.

        A refused dispatch has no bytes down (nothing went); an accepted one gets its id,
        its wall time of dispatch and its deadline.
        """
        ids = self.push([msg for msg, _ in pairs])
        refused = []
        for (msg, dispatch), message_id in zip(pairs, ids, strict=True):
            if not message_id:
                dispatch.bytes_down = 0
                refused.append(dispatch)
                continue
            dispatch.message_id = message_id
            dispatch.dispatched_at = time.time()
            dispatch.deadline = time.monotonic() + timeout
            self.awaited[message_id] = dispatch
            self.contents[message_id] = msg.content
        return refused

    def defer(self, msg: Message, dispatch: Dispatch) -> None:
        """Push ``msg`` once the site's cancelled message comes back."""
        self.deferred[dispatch.node_id] = (msg, dispatch)

    def take_deferred(self, node_id: int) -> tuple[Message, Dispatch] | None:
        """The site's cancelled message is back: its deferred push, if it has one."""
        return self.deferred.pop(node_id, None)

    # --------------------------------------------------------- give up, cancel
    def give_up(self, dispatch: Dispatch) -> None:
        """Stop waiting for ``dispatch``; its site stays busy until Flower answers it."""
        self.awaited.pop(dispatch.message_id, None)
        self.contents.pop(dispatch.message_id, None)
        self.given_up[dispatch.message_id] = dispatch

    def cancel(self, dispatch: Dispatch) -> None:
        """Stop waiting for an awaited ``dispatch``, or drop it if it was never pushed."""
        if dispatch.message_id:
            self.awaited.pop(dispatch.message_id, None)
            self.cancelled[dispatch.message_id] = dispatch
        else:  # deferred: nothing went down
            self.deferred.pop(dispatch.node_id, None)
            dispatch.bytes_down = 0

    def unqueue(self, node_id: int) -> Arrival | None:
        """Take the site's pulled reply out of the clock order (its work was cancelled)."""
        for i, arrival in enumerate(self.arrivals):
            if arrival.dispatch.node_id == node_id:
                del self.arrivals[i]
                heapq.heapify(self.arrivals)
                return arrival
        return None

    def release_stuck(self, older_than: float) -> tuple[list[int], list[int]]:
        """Forget given-up and cancelled messages whose deadline passed before ``older_than``.

        Flower answers an expired message with an error reply; this is the safety net for
        a SuperLink that never does. Returns the nodes of the given-up messages and of the
        cancelled ones, in that order.
        """
        freed = []
        for message_id, dispatch in list(self.given_up.items()):
            if dispatch.deadline < older_than:
                del self.given_up[message_id]
                freed.append(dispatch.node_id)
        returned = []
        for message_id, dispatch in list(self.cancelled.items()):
            if dispatch.deadline < older_than:
                del self.cancelled[message_id]
                self.contents.pop(message_id, None)
                returned.append(dispatch.node_id)
        return freed, returned

    # ------------------------------------------------------------------- pull
    def waiting_ids(self) -> list[str]:
        """Every message id a reply may come for: awaited (those that can land first on
        the clock first), given up on, cancelled.

        Pulled in this order, a chunk's arrivals can be judged before the next is pulled
        (no outstanding message lands earlier), so the replies a simulated round holds
        stay about one chunk however many sites are in flight. On the wall clock every
        earliest arrival is −inf and the order is the dispatch order.
        """
        awaited = sorted(self.awaited, key=lambda i: self.awaited[i].schedule.earliest_arrival)
        return [*awaited, *self.given_up, *self.cancelled]

    def pull(self, message_ids: list[str]) -> tuple[int, list[Dispatch], list[Late]]:
        """Pull replies to ``message_ids``: awaited ones join the arrivals in clock order.

        Returns how many replies came, the awaited dispatches whose reply arrived, and the
        replies to messages no longer awaited, in the order pulled.
        """
        count = 0
        arrived: list[Dispatch] = []
        late: list[Late] = []
        for reply in self.grid.pull_messages(message_ids):
            message_id = reply.metadata.reply_to_message_id
            self.contents.pop(message_id, None)
            given_up = self.given_up.pop(message_id, None)
            if given_up is not None:
                count += 1
                late.append(Late(given_up, reply, cancelled=False))
                continue
            cancelled = self.cancelled.pop(message_id, None)
            if cancelled is not None:
                count += 1
                late.append(Late(cancelled, reply, cancelled=True))
                continue
            dispatch = self.awaited.pop(message_id, None)
            if dispatch is None:
                continue  # not ours (or already handled)
            self._queue(dispatch, reply)
            arrived.append(dispatch)
            count += 1
        return count, arrived, late

    def _queue(self, dispatch: Dispatch, reply: Message) -> None:
        traffic = reply_traffic(reply)
        bytes_up = traffic.up
        reported = reported_metrics(reply) if not reply.has_error() else {}
        landing = self.clock.land(
            dispatch.schedule,
            site=self.name(dispatch.node_id),
            bytes_up=bytes_up,
            measured_compute=reported.get("compute_seconds"),
            ack_bytes=traffic.down,
        )
        self._seq += 1
        heapq.heappush(
            self.arrivals,
            Arrival(
                landing.arrived_at,
                self.position(dispatch.node_id),
                self._seq,
                dispatch,
                reply,
                bytes_up,
                landing,
                time.time(),
                ack_bytes=traffic.down,
            ),
        )

    def next_arrival_at(self) -> float | None:
        return self.arrivals[0].arrived_at if self.arrivals else None

    def pop_arrival(self) -> Arrival:
        return heapq.heappop(self.arrivals)

    # ------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The training work in flight at a round boundary, and the replies not yet judged.

        ``work``: every training message the engine waits for (``awaited``, in the order
        pushed), waiting behind a cancelled one (``deferred``) or cancelled but still
        held by Flower (``cancelled``: its site still does it), with its content, so that
        a resumed run sends the same work again. ``arrivals``: replies pulled but later
        on the clock than the round's decision, with their landing, in the heap's own
        order. Messages given up on are left out: they end with this run.
        """
        work = [("awaited", d, self.contents[i]) for i, d in self.awaited.items()]
        work += [("deferred", d, m.content) for m, d in self.deferred.values()]
        work += [("cancelled", d, self.contents[i]) for i, d in self.cancelled.items()]
        return {
            "work": [
                {"tray": tray, "content": content, **dispatch_state(dispatch)}
                for tray, dispatch, content in work
            ],
            "arrivals": [arrival_state(a) for a in self.arrivals],
            "seq": self._seq,
        }

    def load_state_dict(
        self, state: Mapping[str, Any], *, nodes: Mapping[int, int] | None = None
    ) -> list[SavedWork]:
        """Restore the arrivals of ``state_dict()`` output; return its work to send again.

        The mailbox must be empty (a fresh run). The work is returned, not sent: the
        engine hands it to its sites first (``RoundEngine`` sends it with ``resend``).
        Raises ``CheckpointError`` listing every problem, the mailbox unchanged.
        """
        problems = StateProblems("the messages in flight")
        if not problems.require(state, "work", "arrivals", "seq"):
            problems.raise_if_any()
        problems.number(state["seq"], "seq", integer=True)
        work: list[SavedWork] = []
        for saved in _list(problems, state["work"], "work"):
            dispatch = dispatch_from_state(problems, saved, nodes)
            tray = saved.get("tray") if isinstance(saved, Mapping) else None
            content = saved.get("content") if isinstance(saved, Mapping) else None
            if tray not in ("awaited", "cancelled", "deferred"):
                problems.add(f"work in an unknown tray {tray!r}")
            elif not isinstance(content, RecordDict):
                problems.add("a message in flight has no content")
            elif dispatch is not None:
                work.append(SavedWork(tray, dispatch, content))
        arrivals = []
        for saved in _list(problems, state["arrivals"], "arrivals"):
            arrival = arrival_from_state(problems, saved, nodes)
            if arrival is not None:
                arrivals.append(arrival)
        problems.raise_if_any()
        for arrival in arrivals:  # this run's places (its node ids are new)
            arrival.place = self.position(arrival.dispatch.node_id)
        heapq.heapify(arrivals)
        self.arrivals = arrivals
        self._seq = int(state["seq"])
        return work

    def resend(self, work: Sequence[SavedWork], timeout: float) -> list[SavedWork]:
        """Send saved work again, each message into its tray; return the refused ones.

        Deferred work waits, as before, for its site's cancelled message.
        """
        pushed = [w for w in work if w.tray != "deferred"]
        messages = [w.message(ttl=timeout + TTL_GRACE_SECONDS) for w in work]
        for w, msg in zip(work, messages, strict=True):
            if w.tray == "deferred":
                self.defer(msg, w.dispatch)
        sent = [msg for w, msg in zip(work, messages, strict=True) if w.tray != "deferred"]
        refused = []
        for w, message_id in zip(pushed, self.push(sent), strict=True):
            if not message_id:
                w.dispatch.bytes_down = 0 if w.tray == "awaited" else w.dispatch.bytes_down
                refused.append(w)
                continue
            w.dispatch.message_id = message_id
            w.dispatch.deadline = time.monotonic() + timeout
            (self.awaited if w.tray == "awaited" else self.cancelled)[message_id] = w.dispatch
            self.contents[message_id] = w.content
        return refused

    # --------------------------------------------------------------- exchange
    def exchange(
        self, messages: list[Message], *, model_version: int, timeout: float
    ) -> list[tuple[Dispatch, Message | None]]:
        """Push messages and pull until every reply is in or ``timeout`` passes.

        Returns each message's dispatch (with its measured size; an empty message id if
        the SuperLink refused it) and its reply, or None. Unanswered messages are given up
        on like overdue training messages: the caller keeps their sites busy until Flower
        answers these. Evaluation and queries are measurements beside training: wall times
        only, and they do not move a virtual clock.
        """
        dispatches = self._send(messages, model_version=model_version, timeout=timeout)
        pending = {d.message_id: d for d in dispatches if d.message_id}
        replies: dict[str, Message] = {}
        deadline = dispatches[0].deadline if dispatches else 0.0
        last_reply = time.monotonic()
        while pending:
            looked_at = time.monotonic()  # a reply in before this is taken by this pull
            got = 0
            waiting = list(pending)
            for start in range(0, len(waiting), PULL_CHUNK):
                for reply in self.grid.pull_messages(waiting[start : start + PULL_CHUNK]):
                    message_id = reply.metadata.reply_to_message_id
                    if pending.pop(message_id, None) is not None:
                        replies[message_id] = reply
                        self.replied_at[message_id] = time.time()
                        got += 1
            if looked_at >= deadline:
                break  # that was the last look
            if got:
                last_reply = time.monotonic()
            else:  # the next look at the deadline at the latest
                wait = poll_wait(time.monotonic() - last_reply, self.poll_interval)
                time.sleep(max(0.0, min(wait, deadline - time.monotonic())))
        self._give_up_unanswered(pending.values())
        return [(d, replies.get(d.message_id)) for d in dispatches]

    def post(
        self, messages: list[Message], *, model_version: int, timeout: float
    ) -> list[Dispatch]:
        """Push messages nobody waits for: each is given up on at once, its site busy
        until Flower hands back the reply (or its TTL's error), which :meth:`pull` returns
        as late. Returns each message's dispatch (an empty message id if refused)."""
        dispatches = self._send(messages, model_version=model_version, timeout=timeout)
        self._give_up_unanswered(d for d in dispatches if d.message_id)
        return dispatches

    def _send(
        self, messages: list[Message], *, model_version: int, timeout: float
    ) -> list[Dispatch]:
        """Stamp, push and measure messages beside training; their dispatches."""
        if not messages:
            return []
        messages = self.stamp(messages)
        sizes: dict[int, ContentSize] = {}  # a broadcast shares one content: measure it once
        ids = self.push(messages)
        now, deadline = time.time(), time.monotonic() + timeout
        dispatches: list[Dispatch] = []
        for msg, message_id in zip(messages, ids, strict=True):
            key = id(msg.content)
            if key not in sizes:
                sizes[key] = measure(msg.content)
            dispatches.append(
                Dispatch(
                    node_id=msg.metadata.dst_node_id,
                    message_id=message_id,
                    server_round=0,
                    model_version=model_version,
                    dispatched_at=now,
                    deadline=deadline,
                    bytes_down=delivery_bytes(msg, sizes[key]) if message_id else 0,
                    message_type=msg.metadata.message_type,
                )
            )
        return dispatches

    def _give_up_unanswered(self, dispatches: Iterable[Dispatch]) -> None:
        for dispatch in dispatches:
            self.given_up[dispatch.message_id] = dispatch
            # busy for as long as Flower holds it: no pipelined work reaches back past it
            self.clock.rest(self.name(dispatch.node_id))


def address(
    drafts: Iterable[Message], allowed: Sequence[int], *, ttl: float, model_version: int
) -> list[Message]:
    """The strategy's messages, re-stamped with the engine's TTL and model version.

    A message to a node outside ``allowed`` (busy, not offered), or a second one to the
    same node, is not sent: no site ever has two messages at once. The model version the
    site is sent is also the message's ``group_id``.
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
                ttl=ttl,
                group_id=str(model_version),
            )
        )
    return messages


# ================================================================ checkpoint data
_SCHEDULE = (
    "dispatched_at",
    "download_seconds",
    "compute_seconds",
    "earliest_arrival",
    "compute_started_at",
)
_DISPATCH = (
    "node_id",
    "server_round",
    "model_version",
    "dispatched_at",
    "bytes_down",
    "message_type",
    "period",
    "delay",
)
# Saved since streaming sync; a checkpoint written before has none (the whole model).
_OPTIONAL_DISPATCH = ("fragment",)


def dispatch_state(dispatch: Dispatch) -> dict[str, Any]:
    """A dispatch as checkpoint data (its message id and deadline end with the run)."""
    schedule = dispatch.schedule
    return {
        **{name: getattr(dispatch, name) for name in (*_DISPATCH, *_OPTIONAL_DISPATCH)},
        "schedule": [getattr(schedule, name) for name in _SCHEDULE],
    }


def dispatch_from_state(
    problems: StateProblems, saved: Any, nodes: Mapping[int, int] | None
) -> Dispatch | None:
    """The dispatch ``dispatch_state`` saved, with this run's node id (None: a problem)."""
    if not problems.require(saved, *_DISPATCH, "schedule"):
        return None
    ok = all(
        problems.number(saved[name], name, integer=True)
        for name in ("node_id", "server_round", "model_version", "bytes_down", "period")
    )
    ok &= problems.number(saved["dispatched_at"], "dispatched_at")
    if saved["delay"] is not None:
        ok &= problems.number(saved["delay"], "delay", integer=True)
    fragment = saved.get("fragment")
    if fragment is not None:
        ok &= problems.number(fragment, "fragment", integer=True)
    if saved["message_type"] != MessageType.TRAIN:
        problems.add(f"only training work is saved, not {saved['message_type']!r}")
        ok = False
    times = saved["schedule"]
    if not (
        isinstance(times, list | tuple)
        and len(times) == len(_SCHEDULE)
        and all(t is None or problems.number(t, "schedule") for t in times)
        and times[0] is not None
    ):
        problems.add(f"a schedule must be {len(_SCHEDULE)} times, got {times!r:.80}")
        ok = False
    node_id = saved["node_id"]
    if nodes is not None and ok:
        if node_id not in nodes:
            problems.add(f"work for node {node_id}, which is not a site of this run")
            return None
        node_id = nodes[node_id]
    if not ok:
        return None
    schedule = dict(zip(_SCHEDULE, times, strict=True))
    if schedule["earliest_arrival"] is None:
        schedule["earliest_arrival"] = -math.inf
    return Dispatch(
        node_id=node_id,
        message_id="",
        server_round=saved["server_round"],
        model_version=saved["model_version"],
        dispatched_at=float(saved["dispatched_at"]),
        deadline=math.inf,
        bytes_down=saved["bytes_down"],
        message_type=saved["message_type"],
        period=saved["period"],
        delay=saved["delay"],
        fragment=fragment,
        schedule=Schedule(**schedule),
    )


def arrival_state(arrival: Arrival) -> dict[str, Any]:
    """A pulled reply not yet judged, as checkpoint data: its dispatch, landing and reply."""
    reply = arrival.reply
    landing = arrival.landing
    return {
        **dispatch_state(arrival.dispatch),
        "arrived_at": arrival.arrived_at,
        "seq": arrival.seq,
        "bytes_up": arrival.bytes_up,
        "ack_bytes": arrival.ack_bytes,
        "landing": [landing.arrived_at, landing.compute_seconds, landing.transfer_seconds],
        "pulled_at": arrival.pulled_at,
        "reply": reply.content if reply.has_content() else None,
        "error": [reply.error.code, reply.error.reason] if reply.has_error() else None,
    }


def arrival_from_state(
    problems: StateProblems, saved: Any, nodes: Mapping[int, int] | None
) -> Arrival | None:
    """The arrival ``arrival_state`` saved, its reply from this run's node (None: a problem)."""
    dispatch = dispatch_from_state(problems, saved, nodes)
    names = ("arrived_at", "seq", "bytes_up", "landing", "pulled_at", "reply", "error")
    if dispatch is None or not problems.require(saved, *names):
        return None
    ok = problems.number(saved["arrived_at"], "arrived_at")
    ok &= problems.number(saved["seq"], "seq", integer=True)
    ok &= problems.number(saved["bytes_up"], "bytes_up", integer=True)
    # Checkpoints older than wire bytes have no acknowledgement bytes: none were counted.
    ack_bytes = saved.get("ack_bytes", 0)
    ok &= problems.number(ack_bytes, "ack_bytes", integer=True)
    ok &= problems.number(saved["pulled_at"], "pulled_at")
    landing = saved["landing"]
    if not (
        isinstance(landing, list | tuple)
        and len(landing) == 3
        and all(t is None or problems.number(t, "landing") for t in landing)
    ):
        problems.add("a landing must be three times")
        ok = False
    content, error = saved["reply"], saved["error"]
    if (content is None) == (error is None) or (
        content is not None and not isinstance(content, RecordDict)
    ):
        problems.add("an arrival must hold a reply's content or its error")
        ok = False
    if error is not None and not (
        isinstance(error, list | tuple) and len(error) == 2 and isinstance(error[0], int)
    ):
        problems.add("an arrival's error must be its code and reason")
        ok = False
    if not ok:
        return None
    metadata = Metadata(
        run_id=0,
        message_id="",
        src_node_id=dispatch.node_id,
        dst_node_id=0,
        reply_to_message_id="",
        group_id=str(dispatch.model_version),
        created_at=float(saved["pulled_at"]),
        ttl=math.inf,
        message_type=dispatch.message_type,
    )
    # The reply as the site sent it, from this run's node: Flower's own way of building a
    # message from stored metadata (its serde does the same), not in its typed overloads.
    if content is not None:
        reply = Message(metadata=metadata, content=content)  # type: ignore[call-overload]
    else:
        error_record = Error(code=error[0], reason=error[1])
        reply = Message(metadata=metadata, error=error_record)  # type: ignore[call-overload]
    return Arrival(
        float(saved["arrived_at"]),
        0,  # its place: set by the mailbox that restores it
        saved["seq"],
        dispatch,
        reply,
        saved["bytes_up"],
        Landing(*landing),
        float(saved["pulled_at"]),
        ack_bytes=ack_bytes,
    )


def _list(problems: StateProblems, value: Any, name: str) -> list[Any]:
    if isinstance(value, list):
        return value
    problems.add(f"'{name}' must be a list")
    return []
