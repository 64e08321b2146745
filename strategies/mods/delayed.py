"""``delayed_mod``: the site half of delayed compensated updates (strategies/delayed.py).

Per period q (ALGORITHMS.md §2; the bookkeeping is ``strategies.compensation.SitePeriods``):
settle the periods the server's message says were averaged, rebuild the local model
x_{q−1−D} + (the site's own later periods), hand it to the user's function, and reply
with the accumulated step A_{n,q} = trained − start (+ the carry of left-out periods),
tagged with its period. The kept periods are written back only once the update exists,
so a site whose training fails keeps its state as it was and simply misses the period.

With a codec (the server's ``DelayedCompensated(codec=...)``, or an inner ``codec_mod``
naming one: DTS's recipe ``mods=[delayed_mod(), codec_mod("topk:0.01")]``), A_{n,q} is
sent compressed with error feedback, and the site keeps what the server decodes, so its
model stays the sum of what the server knows; the residual follows in later uploads.

A site whose kept periods are gone while the server says it holds some (a restarted
SuperNode) trains from the global model it was sent, as plain delayed SGD would, and
says so; the server drops that site's unsettled periods.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MetricRecord

from flplatform.core import keys
from flplatform.core.errors import ConfigError
from strategies.codecs import make_codec
from strategies.compensation import SitePeriods
from strategies.mods.codec import compress_upload, requested_codec
from strategies.mods.contract import (
    Mod,
    ModState,
    TrainFunction,
    UserResult,
    call_user,
    is_training,
    mark_lost,
    reply_with,
    round_config,
    sent_model,
    site_algorithm,
)
from strategies.mods.snapshots import load_state, save_state

CARRY = "carry"
PENDING = "pending."  # + the period: one group per kept step


@dataclass(frozen=True)
class DelayedSiteConfig:
    """The delayed-update part of a round's config, checked."""

    period: int
    version: int
    compensate: bool
    included: tuple[int, ...]

    @classmethod
    def from_record(cls, config: ConfigRecord) -> DelayedSiteConfig:
        """Parse; a missing or mistyped value is a ``ConfigError`` naming it."""
        period = config.get(keys.SERVER_ROUND)
        version = config.get(keys.MODEL_VERSION)
        for name, value in ((keys.SERVER_ROUND, period), (keys.MODEL_VERSION, version)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"round config '{name}' must be an integer >= 0, got {value!r}")
        compensate = config.get(keys.COMPENSATE, True)
        if not isinstance(compensate, bool):
            raise ConfigError(f"round config '{keys.COMPENSATE}' must be true or false")
        included = config.get(keys.INCLUDED_PERIODS, [])
        if not isinstance(included, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) for p in included
        ):
            raise ConfigError(f"round config '{keys.INCLUDED_PERIODS}' must be a list of rounds")
        return cls(int(period), int(version), compensate, tuple(included))  # type: ignore[arg-type]


def load_site_periods(context: Context, msg: Message | None = None) -> SitePeriods | None:
    """The site's kept periods and carry from its persistent state; None if it has none.

    With ``msg``, the state as it was after the work before that message's
    (``strategies.mods.snapshots``).
    """
    state = (
        ModState.load(context, keys.DELAYED_STATE)
        if msg is None
        else load_state(msg, context, keys.DELAYED_STATE)
    )
    if state is None:
        return None
    periods = SitePeriods()
    for group, arrays in state.groups.items():
        # read-only views as saved: kept steps in the model's dtypes, the carry in float64
        if group == CARRY:
            periods.carry = {k: v.astype(np.float64, copy=False) for k, v in arrays.items()}
        elif group.startswith(PENDING) and group[len(PENDING) :].isdigit():
            periods.pending[int(group[len(PENDING) :])] = dict(arrays)
    return periods


def save_site_periods(context: Context, periods: SitePeriods, msg: Message | None = None) -> None:
    """Write the kept periods back as the site's one delayed-update record (and, with
    ``msg``, as the snapshot of its work)."""
    groups = {f"{PENDING}{period}": update for period, update in periods.pending.items()}
    if periods.carry is not None:
        groups[CARRY] = periods.carry
    if msg is None:
        ModState({}, groups).save(context, keys.DELAYED_STATE)
    else:
        save_state(msg, context, keys.DELAYED_STATE, ModState({}, groups))


def delayed_mod() -> Mod:
    """The site half of ``DelayedCompensated``: one period per training message."""

    def mod(msg: Message, context: Context, call_next: TrainFunction) -> Message:
        if not is_training(msg) or site_algorithm(msg) != keys.DELAYED:
            return call_next(msg, context)
        raw = round_config(msg)
        delayed = DelayedSiteConfig.from_record(raw)
        global_model = sent_model(msg)

        kept = load_site_periods(context, msg)
        lost = kept is None and raw.get(keys.STATE_EXPECTED) is True
        periods = kept or SitePeriods()
        periods.settle(delayed.version, delayed.included)
        # Asked again for a period it already computed: its reply never counted (lost or
        # late), so that work is carried into this update instead of overwritten.
        periods.retry(delayed.period)
        start = periods.local_model(global_model, compensate=delayed.compensate)
        asked = requested_codec(msg)  # a bad spec fails before the user's training

        result = call_user(msg, context, call_next, start)
        if not isinstance(result, UserResult):
            return result
        update = periods.record(
            delayed.period, start, result.trained, compensate=delayed.compensate
        )
        metrics = MetricRecord({**result.metrics, keys.PERIOD: delayed.period})
        config: dict[str, str] = {keys.UPDATE_KIND: keys.DELTA}
        named = result.config.get(keys.CODEC)  # an inner codec_mod's
        codec = (
            make_codec(named, averaged=asked.averaged)
            if isinstance(named, str) and asked is not None
            else asked
        )
        if codec is not None:
            wire, sent, lost_residual = compress_upload(
                msg, context, update, codec, dense=delayed.compensate
            )
            lost = lost or lost_residual
            if sent is not None:
                # Kept as the server will decode it: the model stays the sum of what the
                # server knows, the residual travels in a later upload.
                periods.pending[delayed.period] = sent
            update, config[keys.CODEC] = wire, codec.name
        save_site_periods(context, periods, msg)
        return reply_with(msg, update, mark_lost(metrics, lost), config=config, extra=result.extra)

    return mod
