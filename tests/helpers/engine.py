"""The round engine as its tests build it: the real local-SGD strategy over a SQL ledger, and
the bytes Flower's SuperLink counts for each message and its reply."""

from __future__ import annotations

from flwr.app import Message

from flplatform.engine.engine import RoundEngine
from flplatform.run.ledger import SqlLedger
from strategies.local_sgd import LocalSGDAveraging
from tests.helpers.fleet_oracle import naive_delivery, naive_reply


def wire_bytes(pushed: list[Message], replies: list[Message]) -> list[tuple[int, int]]:
    """``(up, down)`` of each message with its reply, as Flower's SuperLink counts them."""
    reply_to = {r.metadata.reply_to_message_id: naive_reply(r) for r in replies}
    answers = [reply_to[m.metadata.message_id] for m in pushed]
    return [(a.up, naive_delivery(m) + a.down) for m, a in zip(pushed, answers, strict=True)]


def engine_for(grid, ledger, *, fraction_evaluate: float = 0.0, **kwargs) -> RoundEngine:
    """An engine over ``grid`` recording into ``ledger`` (a repository and a run id); every
    site of the grid is required unless ``required_sites`` says otherwise."""
    repo, run_id = ledger
    kwargs.setdefault("required_sites", len(grid.behaviours))
    return RoundEngine(
        grid,
        LocalSGDAveraging(fraction_evaluate=fraction_evaluate),
        ledger=SqlLedger(repo, run_id),
        poll_interval=0.0,
        **kwargs,
    )
