"""Ledger rows: what became of each message, as ``UpdateOutcome`` and ``EvaluationOutcome``.

One function per kind of row; none decides anything. The staleness of an update is the
model version now minus the one it was trained on; simulated times are written on a
virtual clock only; the delay and fragment columns come from what the strategy declared
(``Work``). Bytes are Fleet API bytes (``flplatform.engine.wire``): a row's ``bytes_down``
is its message's delivery plus the acknowledgement of its reply's push, its ``bytes_up``
the reply (with the request that fetched the message); a row without a reply has
``bytes_up`` 0.
"""

from __future__ import annotations

import time
from typing import Any

from flwr.app import Message

from flplatform.core import keys
from flplatform.core.text import seconds_text
from flplatform.engine.events import (
    DROPPED,
    EVALUATED,
    Dispatch,
    EvaluationOutcome,
    UpdateOutcome,
)
from flplatform.engine.mailbox import Arrival
from flplatform.engine.replies import condense_error, evaluation_metrics
from flplatform.engine.wire import reply_traffic

REFUSED = "refused by the SuperLink (node not connected, or the message too large)"
UNAVAILABLE = "unavailable: sat this work out (simulated availability)"
SILENT = "not sent again after the resume: its site is silent (no answer to the site query)"
SITE_REFUSED = "refused at the site: "  # + the mod's sentence


def no_reply_within(timeout: float) -> str:
    return f"no reply within {seconds_text(timeout)} s"


def site_error(reply: Message) -> str:
    """The reason of a reply that carries a site's error."""
    reason = reply.error.reason or ""
    if refused_at_site(reply):
        said = reason.removeprefix(keys.SITE_REFUSED_PREFIX)
        return f"{SITE_REFUSED}{condense_error(said)}"
    return f"site error {reply.error.code}: {condense_error(reason)}"


def refused_at_site(reply: Message) -> bool:
    """Whether flplatform's mod refused what the site's own train function returned
    (``keys.SITE_REFUSED_CODE`` and its reason's prefix: Flower's mods use the code too)."""
    return (
        reply.has_error()
        and reply.error.code == keys.SITE_REFUSED_CODE
        and (reply.error.reason or "").startswith(keys.SITE_REFUSED_PREFIX)
    )


def period_fields(dispatch: Dispatch) -> dict[str, int]:
    """Delayed updates: the update's period, the average its site had, and the delay."""
    if dispatch.delay is None:
        return {}
    return dict(
        period=dispatch.period, average_applied=dispatch.model_version, delay=dispatch.delay
    )


def _update_row(dispatch: Dispatch, *, site: str, version: int, **fields: Any) -> dict[str, Any]:
    return dict(
        site=site,
        dispatched_round=dispatch.server_round,
        version_trained_on=dispatch.model_version,
        staleness=version - dispatch.model_version,
        dispatched_at=dispatch.dispatched_at,
        fragment=dispatch.fragment,
        **fields,
        **period_fields(dispatch),
    )


def no_update(
    dispatch: Dispatch, status: str, reason: str, *, site: str, version: int, virtual: bool
) -> UpdateOutcome:
    """The row of a message that brought no update (dropped, cancelled, refused)."""
    return UpdateOutcome(
        status=status,
        reason=reason,
        **_update_row(
            dispatch,
            site=site,
            version=version,
            bytes_up=0,
            bytes_down=dispatch.bytes_down,
            virtual_dispatched_at=dispatch.schedule.dispatched_at if virtual else None,
        ),
    )


def late(
    dispatch: Dispatch, reply: Message, given_up: str, *, site: str, version: int
) -> UpdateOutcome:
    """A reply that came after its message was given up on: only its bytes count."""
    traffic = reply_traffic(reply)
    return UpdateOutcome(
        status=DROPPED,
        reason=f"late: arrived after it was {given_up}",
        **_update_row(
            dispatch,
            site=site,
            version=version,
            bytes_up=traffic.up,
            # the message's delivery is counted with the row written when it was given up on
            bytes_down=traffic.down,
            arrived_at=time.time(),
        ),
    )


def arrived(arrival: Arrival, *, site: str, version: int, virtual: bool) -> dict[str, Any]:
    """The fields of an arrival's row known before it is judged."""
    dispatch = arrival.dispatch
    row = _update_row(
        dispatch,
        site=site,
        version=version,
        bytes_up=arrival.bytes_up,
        bytes_down=dispatch.bytes_down + arrival.ack_bytes,
        arrived_at=arrival.pulled_at,
    )
    if virtual:
        row.update(
            virtual_dispatched_at=dispatch.schedule.dispatched_at,
            virtual_arrived_at=arrival.arrived_at,
            virtual_compute_seconds=arrival.landing.compute_seconds,
            transfer_seconds=arrival.landing.transfer_seconds,
        )
    return row


def evaluation(
    dispatch: Dispatch, reply: Message | None, *, site: str, arrived_at: float, timeout: float
) -> EvaluationOutcome:
    """The row of one evaluation message and its reply (None: no reply in time)."""
    row: dict[str, Any] = dict(
        site=site,
        model_version=dispatch.model_version,
        bytes_down=dispatch.bytes_down,
        dispatched_at=dispatch.dispatched_at,
    )
    if not dispatch.message_id:
        return EvaluationOutcome(
            bytes_up=0, status=DROPPED, reason=REFUSED, **{**row, "bytes_down": 0}
        )
    if reply is None:
        return EvaluationOutcome(bytes_up=0, status=DROPPED, reason=no_reply_within(timeout), **row)
    traffic = reply_traffic(reply)
    row["bytes_down"] += traffic.down
    bytes_up = traffic.up
    if reply.has_error():
        return EvaluationOutcome(
            bytes_up=bytes_up,
            status=DROPPED,
            reason=site_error(reply),
            arrived_at=arrived_at,
            **row,
        )
    return EvaluationOutcome(
        bytes_up=bytes_up,
        status=EVALUATED,
        arrived_at=arrived_at,
        **row,
        **evaluation_metrics(reply),
    )
