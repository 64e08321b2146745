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

Streaming sync (the server's ``fragments`` F > 1, ``strategies.fragments``): the period's
update carries only fragment (q − 1) mod F of A_{n,q} + carry (the split is computed here
from the model, as the server computes it); the other arrays' change stays in the carry
until their fragment's period. The site keeps the global model it last received, and the
server sends only the arrays changed since that version (``sync-from``); a site that no
longer holds it replies that it lost its state, without training, and is sent the whole
model next period.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MetricRecord

from flplatform.core import keys
from flplatform.core.errors import ConfigError
from strategies.codecs import make_codec
from strategies.compensation import SitePeriods
from strategies.fragments import fragment_of_round, split_fragments
from strategies.mods.codec import codec_state, compress_upload, requested_codec
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
    state_lost_reply,
)
from strategies.mods.snapshots import load_state, save_state
from strategies.sparse_sync import DENSE

CARRY = "carry"
PENDING = "pending."  # + the period: one group per kept step
MODEL = "model"  # streaming sync: the global model the site last received ...
VERSION = "version"  # ... and its version


@dataclass(frozen=True)
class DelayedSiteConfig:
    """The delayed-update part of a round's config, checked."""

    period: int
    version: int
    compensate: bool
    included: tuple[int, ...]
    fragments: int = 1  # streaming sync's F (1: the whole model every period)
    sync_from: int = DENSE  # the version whose changes the message carries (-1: all)

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
        fragments = _integer(config, keys.FRAGMENTS, default=1, low=1)
        sync_from = _integer(config, keys.SYNC_FROM, default=DENSE, low=DENSE)
        return cls(
            int(period),  # type: ignore[arg-type]
            int(version),  # type: ignore[arg-type]
            compensate,
            tuple(int(p) for p in included),
            fragments,
            sync_from,
        )


def _integer(config: ConfigRecord, key: str, *, default: int, low: int) -> int:
    """An optional integer of the round config, checked (``ConfigError`` if not)."""
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"round config '{key}' must be an integer >= {low}, got {value!r}")
    return value


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
    return periods_of(state)


def periods_of(state: ModState | None) -> SitePeriods | None:
    """The kept periods and carry in a delayed-update state; None for no state."""
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


def save_site_periods(
    context: Context,
    periods: SitePeriods,
    msg: Message | None = None,
    *,
    synced: tuple[dict[str, np.ndarray], int] | None = None,
) -> None:
    """Write the kept periods back as the site's one delayed-update record (and, with
    ``msg``, as the snapshot of its work); ``synced``: the global model the site holds and
    its version (streaming sync)."""
    groups = {f"{PENDING}{period}": update for period, update in periods.pending.items()}
    if periods.carry is not None:
        groups[CARRY] = periods.carry
    meta: dict[str, int] = {}
    if synced is not None:
        groups[MODEL], meta[VERSION] = synced
    if msg is None:
        ModState(meta, groups).save(context, keys.DELAYED_STATE)
    else:
        save_state(msg, context, keys.DELAYED_STATE, ModState(meta, groups))


def synced_model(
    msg: Message, delayed: DelayedSiteConfig, state: ModState | None
) -> dict[str, np.ndarray] | None:
    """The global model x_version, from the message and the model the site holds: the
    message's arrays are the whole model, or (``sync-from`` v) those changed since v.

    None when the site does not hold a version the changes bring up to x_version (its
    state was lost). Arrays come in the server's model's key order.
    """
    sent = sent_model(msg)
    if delayed.sync_from == DENSE:
        return sent
    held = None if state is None else state.meta.get(VERSION)
    stored = None if state is None else state.groups.get(MODEL)
    # Changes since an older version than the site holds still bring it to x_version:
    # they hold every array changed since, at its current value.
    if stored is None or held is None or not delayed.sync_from <= held <= delayed.version:
        return None
    for name, array in sent.items():
        like = stored.get(name)
        if like is None or like.shape != array.shape or like.dtype != array.dtype:
            raise ConfigError(
                f"the server's fragment download holds array '{name}', which is not an array "
                "of the model this site holds (was the model changed mid-run?)"
            )
    return {name: sent.get(name, array) for name, array in stored.items()}


def delayed_mod() -> Mod:
    """The site half of ``DelayedCompensated``: one period per training message."""

    def mod(msg: Message, context: Context, call_next: TrainFunction) -> Message:
        if not is_training(msg) or site_algorithm(msg) != keys.DELAYED:
            return call_next(msg, context)
        raw = round_config(msg)
        delayed = DelayedSiteConfig.from_record(raw)
        state = load_state(msg, context, keys.DELAYED_STATE)
        global_model = synced_model(msg, delayed, state)
        if global_model is None:
            return state_lost_reply(msg, f"the global model of version {delayed.sync_from}")
        fragment = None
        if delayed.fragments > 1:
            sizes = [(name, int(array.size)) for name, array in global_model.items()]
            fragments = split_fragments(sizes, delayed.fragments)  # ConfigError: too few arrays
            fragment = fragments[fragment_of_round(delayed.period, delayed.fragments)]

        kept = periods_of(state)
        lost = kept is None and raw.get(keys.STATE_EXPECTED) is True
        periods = kept or SitePeriods()
        periods.settle(delayed.version, delayed.included)
        # Asked again for a period it already computed: its reply never counted (lost or
        # late), so that work is carried into this update instead of overwritten.
        periods.retry(delayed.period)
        start = periods.local_model(
            global_model, compensate=delayed.compensate, partial=fragment is not None
        )
        asked = requested_codec(msg)  # a bad spec fails before the user's training
        loaded = codec_state(msg, context) if asked is not None else None

        result = call_user(msg, context, call_next, start)
        if not isinstance(result, UserResult):
            return result
        update = periods.record(
            delayed.period,
            start,
            result.trained,
            compensate=delayed.compensate,
            fragment=fragment,
        )
        metrics = MetricRecord({**result.metrics, keys.PERIOD: delayed.period})
        config: dict[str, str] = {keys.UPDATE_KIND: keys.DELTA}
        named = result.config.get(keys.CODEC)  # an inner codec_mod's
        codec = (
            make_codec(named, averaged=asked.averaged)
            if isinstance(named, str) and asked is not None
            else asked
        )
        residual_lost = False
        if codec is not None and loaded is not None:
            wire, sent, residual_lost = compress_upload(
                msg,
                context,
                update,
                codec,
                loaded,
                dense=delayed.compensate,
                partial=fragment is not None,
            )
            if sent is not None:
                # Kept as the server will decode it: the model stays the sum of what the
                # server knows, the residual travels in a later upload.
                periods.pending[delayed.period] = sent
            update, config[keys.CODEC] = wire, codec.name
        synced = (global_model, delayed.version) if delayed.fragments > 1 else None
        save_site_periods(context, periods, msg, synced=synced)
        metrics = mark_lost(metrics, lost)
        if residual_lost and not lost:
            # Its periods are intact (saved apart): said as lost, the server would drop them
            # and the site would send them again, counted twice.
            metrics = MetricRecord({**metrics, keys.RESIDUAL_LOST: 1})
        return reply_with(msg, update, metrics, config=config, extra=result.extra)

    return mod
