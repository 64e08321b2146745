"""Reading what sites say about themselves, defensively.

Anything a site reports (its name, example counts, losses, compute time, error text)
is untrusted: out-of-range or malformed values are dropped here, so that they can never
make a ledger write fail and end the run.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any, TypeVar

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from flplatform.core import keys
from flplatform.core.text import printable
from flplatform.engine.events import SiteInfo, node_name

MAX_COUNT = 2**62  # fits the ledger's signed 64-bit columns with room to sum
MAX_INT32 = 2**31 - 1
_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9_.\-]+")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# A traceback's exception line: a class name, a colon, at the line's start (not Ray's
# ``ray::Actor.run()`` header, nor an indented source line). Named like an exception or
# with its module first; any other CamelCase word (a "Note:" or "Hint:" after the
# exception) only when no line is.
_EXCEPTION_LINE = re.compile(
    r"^(?:(?:[A-Za-z_]\w*\.)+[A-Z]\w*|[A-Z]\w*(?:Error|Exception|Warning|Exit|Interrupt))"
    r":(?:\s|$)"
)
_CAMEL_CASE_LINE = re.compile(r"^[A-Z]\w*:(?:\s|$)")


def condense_error(reason: str, limit: int = 300) -> str:
    """The telling part of a site's error: the last ``SomeError: message`` line.

    Error replies carry whole remote tracebacks (Ray's, with terminal colours); the
    ledger keeps one readable line. Any exception class counts, not only ``...Error``:
    a user's ``SiteMisconfigured: ...`` is the line that explains it.
    """
    raw = [line.rstrip() for line in _ANSI.sub("", reason).splitlines() if line.strip()]
    lines = [line.strip() for line in raw]
    exceptions = [line for line in raw if _EXCEPTION_LINE.match(line)] or [
        line for line in raw if _CAMEL_CASE_LINE.match(line)
    ]
    # Wrappers (ClientAppException, RayTaskError) often end with an empty message; the
    # site's own exception is the last one that says something.
    telling = [line for line in exceptions if line.split(":", 1)[-1].strip()]
    chosen = (telling or exceptions or lines or ["no reason given"])[-1]
    return printable(chosen.replace("\x00", ""))[:limit]


def count(value: Any, *, maximum: int = MAX_COUNT) -> int | None:
    """A non-negative integer no larger than ``maximum``, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        return None
    number = int(value)
    return number if 0 <= number <= maximum else None


def finite(value: Any, *, minimum: float = -math.inf) -> float | None:
    """A finite float no smaller than ``minimum``, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) and number >= minimum else None


Record = TypeVar("Record", ArrayRecord, ConfigRecord, MetricRecord)


def record_of(content: RecordDict, name: str, kind: type[Record]) -> Record | None:
    """``content``'s record ``name`` when it is a ``kind``, else None.

    What ``content.metric_records.get(name)`` (and the like) gives, without Flower's typed
    view: the view refers to itself, so a reply read through one stays in memory, model
    and all, until Python's cyclic garbage collector happens to run.
    """
    record = content.get(name)
    return record if isinstance(record, kind) else None


def halves_disagree(site_mod: str | None, reply: Message, site: str, server: str) -> str | None:
    """Why ``reply`` cannot be used by a strategy whose site half is ``site_mod``, naming
    both halves and the fix; None when the halves agree.

    ``site_mod`` None (local-SGD, Flower's strategies) takes any whole-model reply, or one
    from flplatform's local-SGD mod; otherwise the reply must come from that mod. A reply
    from any of flplatform's mods must speak this server's ``keys.MOD_PROTOCOL``.
    """
    config = record_of(reply.content, keys.CONFIG, ConfigRecord)
    said = config.get(keys.SITE_MOD) if config is not None else None
    answered_by = said if isinstance(said, str) else None
    protocol = config.get(keys.SITE_MOD_PROTOCOL) if config is not None else None
    if answered_by is not None and protocol != keys.MOD_PROTOCOL:
        theirs = f"protocol {protocol}" if isinstance(protocol, int) else "an older protocol"
        return (
            f"site {site} answered with flplatform's {answered_by} mod speaking {theirs}, "
            f"but the server speaks mod protocol {keys.MOD_PROTOCOL}: install the same "
            "flplatform release at the sites and the server"
        )
    if answered_by == site_mod or (site_mod is None and answered_by in (None, keys.LOCAL_SGD)):
        return None
    fix = "add flplatform_mod() to the site's @app.train(mods=[...]) (it follows the server)"
    if answered_by is None:
        return (
            f"site {site} replied without flplatform's {site_mod} mod (a whole model, as a "
            f"plain Flower ClientApp sends), but the server runs {server}, whose site half is "
            f"that mod: {fix}, or run the server with a strategy for plain ClientApps "
            "(local-sgd, or Flower's own)"
        )
    return (
        f"site {site} answered with flplatform's {answered_by} mod, but the server runs "
        f"{server}: {fix}, or run the server with strategy {answered_by}"
    )


def site_info(node_id: int, reply: Message | None) -> SiteInfo:
    """What a site's answer to the QUERY says; its node id names it if it said nothing."""
    fallback = node_name(node_id)
    info = None
    if reply is not None and not reply.has_error():
        info = record_of(reply.content, keys.SITE_INFO, ConfigRecord)
    if info is None:
        return SiteInfo(node_id=node_id, name=fallback)
    raw_name = info.get(keys.SITE_NAME)
    name = _UNSAFE_NAME.sub("_", raw_name).strip("_.-")[:64] if isinstance(raw_name, str) else ""
    device = info.get(keys.DEVICE)
    return SiteInfo(
        node_id=node_id,
        name=name or fallback,
        partition_id=count(info.get(keys.PARTITION_ID), maximum=MAX_INT32),
        num_examples=count(info.get(keys.NUM_EXAMPLES)),
        device=_UNSAFE_NAME.sub("_", device)[:64] if isinstance(device, str) else None,
        feature_scale=finite(info.get(keys.FEATURE_SCALE), minimum=0.0),
    )


def _metrics_and_examples(reply: Message) -> tuple[MetricRecord | None, dict[str, Any]]:
    """The reply's metrics record (None without one) and its example count where valid."""
    metrics = record_of(reply.content, keys.METRICS, MetricRecord) if reply.has_content() else None
    if metrics is None:
        return None, {}
    examples = count(metrics.get(keys.NUM_EXAMPLES))
    return metrics, ({} if examples is None else {"num_examples": examples})


def reported_metrics(reply: Message) -> dict[str, Any]:
    """Example count, train loss and compute seconds a reply reports, where valid."""
    metrics, out = _metrics_and_examples(reply)
    if metrics is None:
        return out
    for key in keys.TRAIN_LOSS_ALIASES:
        loss = finite(metrics.get(key))
        if loss is not None:
            out["train_loss"] = loss
            break
    seconds = finite(metrics.get(keys.COMPUTE_SECONDS), minimum=0.0)
    if seconds is not None:
        out["compute_seconds"] = seconds
    return out


def reported_losses(reply: Message) -> tuple[float | None, float | None]:
    """The train loss and first-batch loss a reply reports, non-finite ones kept.

    Unlike :func:`reported_metrics`, which keeps only what a ledger row may hold, a NaN or
    infinite loss is returned as it came: it is the news that training diverged. None: not
    reported (or not a number).
    """
    metrics, _ = _metrics_and_examples(reply)
    if metrics is None:
        return None, None
    numbers = (_number(metrics.get(key)) for key in keys.TRAIN_LOSS_ALIASES)
    train = next((n for n in numbers if n is not None), None)
    return train, _number(metrics.get(keys.FIRST_BATCH_LOSS))


def _number(value: Any) -> float | None:
    """A number as a float (NaN and infinities included), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:  # an integer beyond any float: as far from finite as inf
        return math.inf if value > 0 else -math.inf


def evaluation_metrics(reply: Message) -> dict[str, Any]:
    """Example count, loss and accuracy of an evaluation reply, where valid.

    Flower's quickstarts report ``eval_loss`` / ``eval_acc``; ``loss`` / ``accuracy`` are
    read too.
    """
    metrics, out = _metrics_and_examples(reply)
    if metrics is None:
        return out
    for field, names in (
        ("loss", (keys.EVAL_LOSS, keys.LOSS)),
        ("accuracy", (keys.EVAL_ACCURACY, keys.ACCURACY)),
    ):
        for name in names:
            value = finite(metrics.get(name), minimum=0.0)
            if value is not None:
                out[field] = value
                break
    return out


def first_number(metrics: MetricRecord, names: Iterable[str]) -> float | None:
    """The first of ``names`` that ``metrics`` holds as a finite number, else None."""
    for name in names:
        value = metrics.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    return None
