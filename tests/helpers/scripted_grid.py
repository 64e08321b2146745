"""An in-process Grid whose sites follow a script, for testing the engine's scheduling.

It stands in for the network only: messages are real Flower messages, replies are built
the way a ClientApp builds them, and it refuses a second message to a busy node exactly
as the engine promises never to send one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import count

from flwr.app import Message
from flwr.serverapp import Grid

# A site's behaviour: the reply to a message, or None for "never answers".
Behaviour = Callable[[Message], Message | None]


class ScriptedGrid(Grid):
    def __init__(
        self,
        behaviours: dict[int, Behaviour],
        *,
        refuse: set[int] | None = None,
        refusal: str = "inmemory",
        delay_pulls: int = 0,
    ) -> None:
        self.behaviours = behaviours
        self.refuse = refuse or set()
        # How refusals are reported, as Flower's grids do: "inmemory" leaves refused
        # messages out of the returned ids, "http" puts None in their place, "oversize"
        # returns no ids at all. Every message gets an id written into it regardless.
        self.refusal = refusal
        self.delay_pulls = delay_pulls  # pulls before a reply becomes visible
        self.pushed: list[Message] = []
        self.replies: list[Message] = []
        self._pending: dict[str, tuple[Message, int]] = {}
        self._busy: dict[int, str] = {}
        self._ids = count(1)

    def set_run(self, run) -> None:  # noqa: ANN001
        pass

    @property
    def run(self):  # noqa: ANN201
        raise AttributeError("no run")

    def create_message(self, *args, **kwargs) -> Message:  # noqa: ANN002, ANN003
        raise AssertionError("the engine builds its own messages")

    def get_node_ids(self) -> Iterable[int]:
        return list(self.behaviours)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids: list[str | None] = []
        messages = list(messages)
        for msg in messages:
            message_id = f"m{next(self._ids)}"
            msg.metadata.__dict__["_message_id"] = message_id
            node = msg.metadata.dst_node_id
            if node in self.refuse:
                if self.refusal == "http":
                    ids.append(None)
                continue
            assert node not in self._busy, f"second message to busy node {node}"
            self.pushed.append(msg)
            self._pending[message_id] = (msg, self.delay_pulls)
            self._busy[node] = message_id
            ids.append(message_id)
        if self.refusal == "oversize" and any(
            m.metadata.dst_node_id in self.refuse for m in messages
        ):
            for msg in messages:  # the SuperLink took none of them
                self._pending.pop(msg.metadata.message_id, None)
                self._busy.pop(msg.metadata.dst_node_id, None)
                if msg in self.pushed:
                    self.pushed.remove(msg)
            return []
        return ids  # type: ignore[return-value]

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        out = []
        for message_id in message_ids:
            if message_id not in self._pending:
                continue
            msg, wait = self._pending[message_id]
            if wait > 0:
                self._pending[message_id] = (msg, wait - 1)
                continue
            reply = self.behaviours[msg.metadata.dst_node_id](msg)
            if reply is None:
                continue  # this site never answers
            del self._pending[message_id]
            del self._busy[msg.metadata.dst_node_id]
            self.replies.append(reply)
            out.append(reply)
        return out

    def send_and_receive(self, messages, *, timeout=None):  # noqa: ANN001, ANN201
        raise AssertionError("the engine never uses send_and_receive")


class FlowerGrid(ScriptedGrid):
    """The scripted sites behind Flower's own blocking ``send_and_receive``, for running a
    strategy's own ``start`` beside ``flplatform.start`` on the same sites."""

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        ids = [i for i in self.push_messages(list(messages)) if i]
        return list(self.pull_messages(ids))
