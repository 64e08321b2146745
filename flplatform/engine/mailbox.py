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
judges them. The mailbox measures every message's size; it decides nothing.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from flwr.app import Message
from flwr.serverapp import Grid

from flplatform.engine.clock import Clock, Landing
from flplatform.engine.events import Dispatch
from flplatform.engine.replies import reported_metrics
from flplatform.engine.wire import content_size, message_size

log = logging.getLogger("flplatform.engine")

# A message's TTL outlives the engine's own deadline by this much, so an overdue site is
# dropped by the engine with a clear reason, and Flower's expiry then frees the site.
TTL_GRACE_SECONDS = 5.0
# Replies pulled per call: a SuperLink hands back every ready reply fully decoded, so
# pulling all pending ids at once would hold (sites × model) bytes in memory.
PULL_CHUNK = 16


@dataclass(order=True)
class Arrival:
    """A pulled reply waiting for its turn, in clock order."""

    arrived_at: float  # clock time
    seq: int
    dispatch: Dispatch = field(compare=False)
    reply: Message = field(compare=False)
    bytes_up: int = field(compare=False)
    landing: Landing = field(compare=False)
    pulled_at: float = field(compare=False)  # wall time


@dataclass(frozen=True)
class Late:
    """A reply to a message the engine no longer waited for (given up on, or cancelled)."""

    dispatch: Dispatch
    reply: Message
    cancelled: bool  # cancelled by the policy (else given up on)


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
    poll_interval : float
        Seconds between pulls while ``exchange`` waits.
    """

    def __init__(
        self, grid: Grid, clock: Clock, name: Callable[[int], str], poll_interval: float
    ) -> None:
        self.grid = grid
        self.clock = clock
        self.name = name
        self.poll_interval = poll_interval
        self.awaited: dict[str, Dispatch] = {}
        self.given_up: dict[str, Dispatch] = {}
        self.cancelled: dict[str, Dispatch] = {}
        self.deferred: dict[int, tuple[Message, Dispatch]] = {}  # node → its next push
        self.arrivals: list[Arrival] = []  # a heap by clock time
        self.replied_at: dict[str, float] = {}  # evaluation/query reply → its wall time
        self._seq = itertools.count()

    # ------------------------------------------------------------------ state
    def empty(self) -> bool:
        """Nothing out and nothing waiting to be judged."""
        return not (self.awaited or self.given_up or self.cancelled or self.arrivals)

    def holds_cancelled(self, node_id: int) -> bool:
        """Whether Flower still holds a cancelled training message of ``node_id``."""
        return any(d.node_id == node_id for d in self.cancelled.values())

    def queued(self) -> dict[int, Dispatch]:
        """Node → the training message whose reply waits to be judged (heap order)."""
        return {a.dispatch.node_id: a.dispatch for a in self.arrivals}

    # ------------------------------------------------------------------- push
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
        for (_, dispatch), message_id in zip(pairs, ids, strict=True):
            if not message_id:
                dispatch.bytes_down = 0
                refused.append(dispatch)
                continue
            dispatch.message_id = message_id
            dispatch.dispatched_at = time.time()
            dispatch.deadline = time.monotonic() + timeout
            self.awaited[message_id] = dispatch
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
                returned.append(dispatch.node_id)
        return freed, returned

    # ------------------------------------------------------------------- pull
    def waiting_ids(self) -> list[str]:
        """Every message id a reply may come for: awaited, given up on, cancelled."""
        return [*self.awaited, *self.given_up, *self.cancelled]

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
        bytes_up = message_size(reply)
        reported = reported_metrics(reply) if not reply.has_error() else {}
        landing = self.clock.land(
            dispatch.schedule,
            site=self.name(dispatch.node_id),
            bytes_up=bytes_up,
            measured_compute=reported.get("compute_seconds"),
        )
        heapq.heappush(
            self.arrivals,
            Arrival(
                landing.arrived_at,
                next(self._seq),
                dispatch,
                reply,
                bytes_up,
                landing,
                time.time(),
            ),
        )

    def next_arrival_at(self) -> float | None:
        return self.arrivals[0].arrived_at if self.arrivals else None

    def pop_arrival(self) -> Arrival:
        return heapq.heappop(self.arrivals)

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
        if not messages:
            return []
        sizes: dict[int, int] = {}
        ids = self.push(messages)
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
                    model_version=model_version,
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
                        self.replied_at[message_id] = time.time()
                        got += 1
            if not got:
                time.sleep(self.poll_interval)
        for dispatch in pending.values():
            self.given_up[dispatch.message_id] = dispatch
            # busy for as long as Flower holds it: no pipelined work reaches back past it
            self.clock.rest(self.name(dispatch.node_id))
        return [(d, replies.get(d.message_id)) for d in dispatches]


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
