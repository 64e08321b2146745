"""What the engine reports about sites, messages and rounds, and the ledger it writes to.

A training message's fate is an ``UpdateOutcome``, an evaluation's an ``EvaluationOutcome``,
and the bytes of any other message (a site's query, a reply that came too late) a
``TrafficOutcome``: the ledger's own rows (``flplatform.core.ledger_rows``), so their columns
are declared once for the engine and the ledger alike. The engine writes through
``LedgerSink``, an interface it is given, and never imports ``storage``;
``flplatform.run.ledger.SqlLedger`` is the sink backed by the SQL repository.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from flplatform.core.ledger_rows import (
    EVALUATION_EVALUATED,
    UPDATE_APPLIED,
    UPDATE_BUFFERED,
    UPDATE_CANCELLED,
    UPDATE_DROPPED,
    UPDATE_REJECTED,
    EvaluationRow,
    TrafficRow,
    UpdateRow,
)
from flplatform.engine.clock import Schedule

# The statuses of ledger rows; DROPPED is also an evaluation's when no usable reply came.
APPLIED = UPDATE_APPLIED
BUFFERED = UPDATE_BUFFERED
CANCELLED = UPDATE_CANCELLED
DROPPED = UPDATE_DROPPED
REJECTED = UPDATE_REJECTED
EVALUATED = EVALUATION_EVALUATED  # an evaluation message answered with metrics

# What became of one dispatched training message: one ledger row (see ``UpdateColumns``).
UpdateOutcome = UpdateRow
# One federated-evaluation message and its reply: one ledger row (see ``EvaluationColumns``).
EvaluationOutcome = EvaluationRow
# Bytes with one site that no update or evaluation row holds (see ``TrafficColumns``).
TrafficOutcome = TrafficRow


def node_name(node_id: int) -> str:
    """The name of a site that did not say its own: its Flower node id, new at every
    start-up (so a run of such sites cannot be resumed)."""
    return f"node-{node_id}"


@dataclass(frozen=True)
class SiteInfo:
    """A connected site as it introduced itself (or as much as the server could learn)."""

    node_id: int
    name: str
    partition_id: int | None = None
    num_examples: int | None = None
    device: str | None = None
    # how far its features are from unit scale (largest per-feature RMS), if it said
    feature_scale: float | None = None


@dataclass
class Dispatch:
    """One training message in flight to one site."""

    node_id: int
    message_id: str  # "" while its push waits for the site's cancelled message to return
    server_round: int  # server step at dispatch
    model_version: int  # version of the global model the site was sent
    dispatched_at: float  # wall time (Unix) of the push
    deadline: float  # time.monotonic() after which the site is overdue
    bytes_down: int  # what delivering the message costs (``wire.delivery_bytes``)
    message_type: str = "train"  # Flower's MessageType: train, evaluate or query
    # the round whose aggregate this update is for: the round open at dispatch, except
    # under a pipelined policy (delayed updates), where a site may work ahead
    period: int = 0
    # declared by the strategy with the period (``Work.delay``): the ledger's delay columns
    delay: int | None = None
    # declared by the strategy too (``Work.fragment``): the model fragment the message
    # carries under streaming sync, the ledger's ``fragment``; None: the whole model
    fragment: int | None = None
    # the clock's plan for this message: clock time of dispatch, earliest arrival, ...
    schedule: Schedule = field(default_factory=lambda: Schedule(dispatched_at=math.nan))


@dataclass(frozen=True)
class RoundSummary:
    """One server step, as the engine reports it to the ledger and to progress displays."""

    server_round: int
    model_version: int
    started_at: float
    finished_at: float
    metrics: dict[str, float]
    train_loss: float | None
    updates: tuple[UpdateOutcome, ...]
    evaluations: tuple[EvaluationOutcome, ...] = ()
    # Simulated times of the step; None on the wall clock.
    virtual_started_at: float | None = None
    virtual_finished_at: float | None = None
    # What this round revealed about the whole run (training diverged; the strategy's
    # ``take_warning``), each said once per run.
    warning: str | None = None

    @property
    def bytes_up(self) -> int:
        """Bytes sites sent for training this round (Fleet API bytes, ``engine.wire``)."""
        return sum(u.bytes_up for u in self.updates)

    @property
    def bytes_down(self) -> int:
        """Bytes sent to sites for training this round."""
        return sum(u.bytes_down for u in self.updates)


# Events the engine records besides rounds (``LedgerSink.record_event``): a site whose
# SuperNode the SuperLink stopped listing (it gets no work meanwhile), and one listed again.
SITE_LOST_EVENT = "site-lost"
SITE_BACK_EVENT = "site-back"  # (detail ``restarted``: back as a new node, its SuperNode restarted)
# A listed site that left the site query unanswered (detail: site, round, waited seconds,
# connected, sites): it gets no work, so no round waits for it, until it answers (then a
# SITE_BACK_EVENT).
SITE_SILENT_EVENT = "site-silent"
# The events that say who can train: said live by the engine and `flplatform server`.
PRESENCE_EVENTS = (SITE_LOST_EVENT, SITE_SILENT_EVENT, SITE_BACK_EVENT)
# A run ended before its planned rounds because the ServerApp's ``should_stop`` said so
# (detail: round, planned).
STOPPED_EARLY_EVENT = "stopped-early"


def presence_sentence(kind: str, detail: Mapping[str, Any]) -> str:
    """What a site-lost, site-silent or site-back event says (its detail: site, round,
    connected, sites; waited for site-silent, and start_wait when the start waits for it),
    for the server's log and for ``flplatform server``'s console alike."""
    if kind == SITE_LOST_EVENT:
        what = (
            "left: the SuperLink no longer lists its SuperNode, and it gets no work until it "
            "is back"
        )
    elif kind == SITE_SILENT_EVENT:
        what = (
            f"is silent: its SuperNode is connected but did not answer the site query within "
            f"{float(detail.get('waited', 0)):g} s (no ClientApp answered for it)"
        )
        if detail.get("start_wait"):
            what += (
                f"; the first round waits for it up to {float(detail['start_wait']):g} s more "
                "(a SuperNode started again after a crash joins once Flower stops counting the "
                "dead one)"
            )
        what += ", and it gets no work until it answers"
    elif detail.get("restarted"):
        what = "is back: its SuperNode started again, under a new node id, and takes up its place"
    else:
        what = "is back"
    server_round = detail.get("round")
    return (
        f"{f'round {server_round}' if server_round else 'at start-up'}: "
        f"site {detail.get('site')} {what} "
        f"({detail.get('connected')} of {detail.get('sites')} sites connected)"
    )


class LedgerSink(Protocol):
    """Where the engine writes sites and finished rounds (committed round by round)."""

    def add_site(self, site: SiteInfo, profile: dict[str, Any]) -> None:
        """Record a site that joined the run."""
        ...

    def record_round(self, summary: RoundSummary, state: Mapping[str, Any] | None = None) -> None:
        """Record one finished round and all its updates, atomically.

        ``state``: the engine's whole state after the round (``RoundEngine.state_dict``),
        when the run keeps checkpoints; committed with the round, so that a committed
        round always has its checkpoint. The engine passes it only then (a sink that
        keeps none may take ``summary`` alone).
        """
        ...

    def record_traffic(
        self, traffic: Sequence[TrafficOutcome], server_round: int | None = None
    ) -> None:
        """Record bytes with sites that no update or evaluation row holds, committed now.

        ``server_round``: the step during which they crossed; None before the first step
        this process took (sites joining the run, or rejoining it after a resume).
        """
        ...

    def record_event(self, kind: str, detail: dict[str, Any]) -> None:
        """Record something that happened to the run besides its rounds (a site lost or
        back: ``SITE_LOST_EVENT``, ``SITE_BACK_EVENT``; ``STOPPED_EARLY_EVENT``), committed
        now."""
        ...


class NullLedger:
    """A sink that records nothing (for ``strategy.start`` without a database)."""

    def add_site(self, site: SiteInfo, profile: dict[str, Any]) -> None:
        """Ignore the site."""

    def record_round(self, summary: RoundSummary, state: Mapping[str, Any] | None = None) -> None:
        """Ignore the round (and its state)."""

    def record_traffic(
        self, traffic: Sequence[TrafficOutcome], server_round: int | None = None
    ) -> None:
        """Ignore the traffic."""

    def record_event(self, kind: str, detail: dict[str, Any]) -> None:
        """Ignore the event."""
