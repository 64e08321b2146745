"""Site discovery: ask new nodes who they are, and add them to the run's sites."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from flplatform.core import keys
from flplatform.core.ledger_rows import TRAFFIC_QUERY
from flplatform.core.site_registry import SiteRegistry
from flplatform.engine.clock import Clock
from flplatform.engine.events import Dispatch, LedgerSink, SiteInfo, TrafficOutcome, node_name
from flplatform.engine.mailbox import TTL_GRACE_SECONDS, Mailbox
from flplatform.engine.replies import site_info
from flplatform.engine.sites import Sites
from flplatform.engine.wire import Traffic, made_by_superlink, reply_traffic

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
    held: Collection[str] = (),
) -> tuple[list[int], dict[int, SiteInfo]]:
    """Send each node a QUERY; add every one as a site, in the ledger and on the clock.
    Returns the nodes that did not answer within ``timeout`` (those whose query is still
    out, given up on: busy until Flower hands it back, and those Flower answered for: the
    query expired, the node unavailable), and the nodes that named a ``held`` site (node →
    what it said).

    ``held``: the names of the run's sites. A new node that answers with one of them is
    taken for that site's SuperNode started again (a crash, a reboot: an unauthenticated
    SuperNode gets a new node id, and Flower lists the dead one for a while yet): it is
    not added, but returned, for the engine to hand it the site's place once the old node
    has left and its work has ended (``RoundEngine``'s take-over).

    A plain Flower ClientApp that does not answer queries still joins, named after its
    node id (and stays busy until Flower hands its query back). Sites are added in
    partition order (then name), so the ledger's site order is the same across runs; two
    new nodes claiming one name are both kept, the second one's name suffixed with its id.
    In a deployment with registered sites (``FLPLATFORM_SITE_REGISTRY``) a node is named
    by its registration, whatever it claims; a different claim is logged and kept in its
    ledger profile as ``claimed_name``.
    Each query's bytes, and its reply's, go to the ledger as the site's ``query`` traffic
    (at ``server_round``: see ``LedgerSink.record_traffic``); a reply that comes later
    adds its own.
    """
    queries = [site_query(node_id, timeout) for node_id in node_ids]
    exchanged = mailbox.exchange(queries, model_version=model_version, timeout=timeout)
    replies = {d.node_id: r for d, r in exchanged}
    refused = sorted(n for n, r in replies.items() if r is not None and r.has_error())
    if refused:
        log.info(
            "%d of %d sites answered the site query with an error (an app without an "
            "@app.query() function, say): named by their node ids",
            len(refused),
            len(node_ids),
        )
    unanswered = {d.node_id for d, r in exchanged if d.message_id and r is None}
    # Flower answered for the node (the query expired, the node went unavailable): the
    # node holds no message now, but its SuperNode said nothing either
    unheard = unanswered | {
        d.node_id for d, r in exchanged if r is not None and made_by_superlink(r)
    }
    taken = sites.names()
    registry = SiteRegistry.from_environment()
    named = [registered(site_info(n, replies.get(n)), registry) for n in node_ids]
    claims = {info.node_id: claim for info, claim in named if claim is not None}
    infos = [info for info, _ in named]
    infos.sort(key=lambda s: (s.partition_id is None, s.partition_id or 0, s.name))
    restarted: dict[int, SiteInfo] = {}
    for info in infos:
        if info.name in held and info.node_id not in unheard:
            restarted[info.node_id] = info
            continue
        if info.name in taken:
            info = replace(info, name=f"{info.name[:40]}-{info.node_id}")
        taken.add(info.name)
        profile = clock.join(info.name, len(sites))
        sites.add(info)
        if info.node_id in unanswered:
            sites.give_up(info.node_id)
        ledger.add_site(info, ledger_profile(info, profile, claims.get(info.node_id)))
    names = {n: info.name for n, info in restarted.items()}
    traffic = [
        query_traffic(d, r, names.get(d.node_id) or sites.name(d.node_id))
        for d, r in exchanged
        if d.message_id
    ]
    if traffic:  # (a query the SuperLink refused crossed no wire)
        ledger.record_traffic(traffic, server_round)
    log.info("sites: %s", ", ".join(names.get(n) or sites.name(n) for n in node_ids))
    return sorted(unheard, key=sites.position), restarted


def ledger_profile(
    info: SiteInfo, profile: Mapping[str, Any], claimed_name: str | None = None
) -> dict[str, Any]:
    """A site's profile for the ledger: the clock's, and what the site said of itself."""
    said = {
        "device": info.device,
        "feature_scale": info.feature_scale,
        "claimed_name": claimed_name,
    }
    return {**profile, **{k: v for k, v in said.items() if v is not None}}


def site_query(node_id: int, timeout: float) -> Message:
    """The QUERY that asks a node who it is (answered by the ClientApp's query function),
    expiring at the SuperLink a little after the ``timeout`` it is awaited for."""
    return Message(
        RecordDict({keys.CONFIG: ConfigRecord()}),
        dst_node_id=node_id,
        message_type=MessageType.QUERY,
        ttl=timeout + TTL_GRACE_SECONDS,
    )


def registered(info: SiteInfo, registry: SiteRegistry | None) -> tuple[SiteInfo, str | None]:
    """``info`` named as ``registry`` has its node; and the name it claimed, if different."""
    if registry is None:
        return info, None
    name = registry.name_of(info.node_id)
    if name is None:  # cannot join an authenticating SuperLink; a stale registry file
        log.warning(
            "node %d is not in the site registry; named as it says: %s", info.node_id, info.name
        )
        return info, None
    claimed = None if info.name in (name, node_name(info.node_id)) else info.name
    if claimed is not None:
        log.warning(
            "node %d, registered as %s, calls itself %s: recorded as %s",
            info.node_id,
            name,
            claimed,
            name,
        )
    return replace(info, name=name), claimed


def query_traffic(dispatch: Dispatch, reply: Message | None, site: str) -> TrafficOutcome:
    """A pushed query's bytes, with its reply's when it came in time."""
    reply_bytes = reply_traffic(reply) if reply is not None else Traffic()
    return TrafficOutcome(
        site=site,
        kind=TRAFFIC_QUERY,
        messages=1,
        bytes_up=reply_bytes.up,
        bytes_down=dispatch.bytes_down + reply_bytes.down,
    )
