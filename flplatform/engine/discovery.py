"""Site discovery: ask new nodes who they are, and add them to the run's sites."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from flplatform import keys
from flplatform.engine.clock import Clock
from flplatform.engine.events import Dispatch, LedgerSink, TrafficOutcome
from flplatform.engine.mailbox import TTL_GRACE_SECONDS, Mailbox
from flplatform.engine.replies import site_info
from flplatform.engine.sites import Sites
from flplatform.engine.wire import Traffic, reply_traffic
from flplatform.ledger_rows import TRAFFIC_QUERY

log = logging.getLogger("flplatform.engine")


def introduce(
    node_ids: Sequence[int],
    *,
    mailbox: Mailbox,
    sites: Sites,
    clock: Clock,
    ledger: LedgerSink,
    model_version: int,
    timeout: float,
    server_round: int | None = None,
) -> None:
    """Send each node a QUERY; add every one as a site, in the ledger and on the clock.

    A plain Flower ClientApp that does not answer queries still joins, named after its
    node id (and stays busy until Flower hands its query back). Sites are added in
    partition order (then name), so the ledger's site order is the same across runs; two
    nodes claiming one name are both kept, the second one's name suffixed with its id.
    Each query's bytes, and its reply's, go to the ledger as the site's ``query`` traffic
    (at ``server_round``: see ``LedgerSink.record_traffic``); a reply that comes later
    adds its own.
    """
    queries = [
        Message(
            RecordDict({keys.CONFIG: ConfigRecord()}),
            dst_node_id=node_id,
            message_type=MessageType.QUERY,
            ttl=timeout + TTL_GRACE_SECONDS,
        )
        for node_id in node_ids
    ]
    exchanged = mailbox.exchange(queries, model_version=model_version, timeout=timeout)
    replies = {d.node_id: r for d, r in exchanged}
    unanswered = {d.node_id for d, r in exchanged if d.message_id and r is None}
    taken = sites.names()
    infos = [site_info(node_id, replies.get(node_id)) for node_id in node_ids]
    infos.sort(key=lambda s: (s.partition_id is None, s.partition_id or 0, s.name))
    for info in infos:
        if info.name in taken:
            info = replace(info, name=f"{info.name[:40]}-{info.node_id}")
        taken.add(info.name)
        profile = clock.join(info.name, len(sites))
        sites.add(info)
        if info.node_id in unanswered:
            sites.give_up(info.node_id)
        said = {"device": info.device, "feature_scale": info.feature_scale}
        ledger.add_site(info, {**profile, **{k: v for k, v in said.items() if v is not None}})
    traffic = [_query_traffic(d, r, sites.name(d.node_id)) for d, r in exchanged if d.message_id]
    if traffic:  # (a query the SuperLink refused crossed no wire)
        ledger.record_traffic(traffic, server_round)
    log.info("sites: %s", ", ".join(sites.name(n) for n in node_ids))


def _query_traffic(dispatch: Dispatch, reply: Message | None, site: str) -> TrafficOutcome:
    """A pushed query's bytes, with its reply's when it came in time."""
    reply_bytes = reply_traffic(reply) if reply is not None else Traffic()
    return TrafficOutcome(
        site=site,
        kind=TRAFFIC_QUERY,
        messages=1,
        bytes_up=reply_bytes.up,
        bytes_down=dispatch.bytes_down + reply_bytes.down,
    )
