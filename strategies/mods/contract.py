"""The parts every mod shares: calling the user's function, checking what it returns, state.

See ``strategies.mods`` for the contract these implement. Imports no server code: a site
loads Flower's ClientApp side, our records and the pure maths, nothing else.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)

from flplatform.core import keys
from flplatform.core.arrays import arrays_to_record, record_views
from flplatform.core.errors import ConfigError, UpdateRejected
from flplatform.core.reply_checks import check_num_examples

log = logging.getLogger("flplatform.strategies.mods.contract")

# A ClientApp function and a mod, as Flower's ``make_ffn`` chains them.
TrainFunction = Callable[[Message, Context], Message]
Mod = Callable[[Message, Context, TrainFunction], Message]

# Names inside a mod's one state record: "<part>/<array name>"; numbers under "meta/".
_SEP = "/"
_META = "meta"


def reuse_freed_memory() -> bool:
    """Let this site process reuse the large blocks it frees (glibc only; once).

    glibc hands every allocation above its mmap threshold (32 MiB at most by default)
    fresh pages from the OS and returns them on free: each model-sized ``bytes`` that
    Flower's records need (every array a mod hands on or keeps) then page-faults on
    each 4 KiB it touches, which costs several times the copy itself. Raising the
    threshold and the trim threshold to 1 GiB keeps freed blocks for the next call, as
    PyTorch's CPU allocator keeps its own; the process's resident memory then stays at
    its peak instead of shrinking between calls. ``FLPLATFORM_REUSE_FREED_MEMORY=0``
    leaves malloc as it is. Returns whether the setting is in force.
    """
    return _reuse_freed_memory(os.environ.get("FLPLATFORM_REUSE_FREED_MEMORY", "1") != "0")


@functools.cache
def _reuse_freed_memory(wanted: bool) -> bool:
    if not wanted or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    # Older glibc refuses an mmap threshold above 32 MiB (HEAP_MAX_SIZE / 2): then 32 MiB.
    mmap = any(mallopt(_M_MMAP_THRESHOLD, size) for size in (_KEPT_BLOCK, _OLD_GLIBC_MAX))
    trim = bool(mallopt(_M_TRIM_THRESHOLD, _KEPT_BLOCK))
    return mmap and trim


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_KEPT_BLOCK, _OLD_GLIBC_MAX = 1 << 30, 1 << 25


def is_training(msg: Message) -> bool:
    """Whether ``msg`` asks for training (other message types pass through every mod)."""
    return msg.metadata.message_type == MessageType.TRAIN


def round_config(msg: Message) -> ConfigRecord:
    """The server's ``config`` record of a message (empty if it sent none)."""
    return msg.content.config_records.get(keys.CONFIG, ConfigRecord())


def site_algorithm(msg: Message) -> str | None:
    """The algorithm the server's round config names; None for plain Flower messages."""
    name = round_config(msg).get(keys.SITE_ALGORITHM)
    return name if isinstance(name, str) else None


def sent_model(msg: Message) -> dict[str, np.ndarray]:
    """The ``arrays`` the server sent, as read-only views of the message's bytes
    (``ConfigError`` if there are none). Handing them on re-sends the same Arrays."""
    if keys.ARRAYS not in msg.content.array_records:
        raise ConfigError(f"the server's message has no '{keys.ARRAYS}' record")
    return record_views(msg.content.array_records[keys.ARRAYS])


def int_config(config: ConfigRecord, key: str, low: int) -> int:
    """An integer the server put in the round config, checked (``ConfigError`` if not)."""
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"round config '{key}' must be an integer >= {low}, got {value!r}")
    return value


def site_identity(context: Context) -> str:
    """What names this site in its random streams: its name, partition or node id.

    Stable across runs where the deployment is (a named site, a simulated partition), so
    the same seed gives the same codec choices.
    """
    config = context.node_config
    for key in (keys.SITE_NAME, keys.PARTITION_ID):
        if key in config:
            return f"{key}={config[key]}"
    return f"node={context.node_id}"


@dataclass(frozen=True)
class UserResult:
    """What the user's train function returned, checked against the model it was given."""

    trained: dict[str, np.ndarray]  # same names, order, shapes and dtypes as the start
    metrics: MetricRecord  # the user's own, with compute-seconds added if it had none
    num_examples: int
    config: dict[str, Any]  # the reply's config record, if any (an inner mod's notes)
    extra: dict[str, Any]  # the reply's other records, carried into the mod's reply


def call_user(
    msg: Message,
    context: Context,
    call_next: TrainFunction,
    start: Mapping[str, np.ndarray],
    *,
    config_updates: Mapping[str, Any] | None = None,
) -> UserResult | Message:
    """Hand the user's function ``start`` as its ``arrays``; return its checked result.

    The message keeps its metadata and config (``config_updates`` replace entries); only
    ``arrays`` becomes the dense model to train from, in the model's own key order. The
    call is timed: user code may ignore ``local-steps``, so the virtual clock's
    ``measured`` compute model needs the seconds it really took. A reply that carries an
    error is returned as it is, for the mod to pass on; so is the refusal of a result that
    breaks Flower's convention or the model's shapes (an error reply with
    ``keys.SITE_REFUSED_CODE`` and the sentence saying what to fix).
    """
    reuse_freed_memory()
    content = RecordDict({keys.ARRAYS: arrays_to_record(dict(start))})
    config = ConfigRecord(dict(round_config(msg)))
    config.update(dict(config_updates or {}))
    content[keys.CONFIG] = config
    for name, record in msg.content.items():
        if name not in (keys.ARRAYS, keys.CONFIG):
            content[name] = record
    # A copy: the message the site received stays as it came (in-process transports share it).
    inner = copy.copy(msg)
    inner.content = content
    began = time.perf_counter()
    reply = call_next(inner, context)
    seconds = time.perf_counter() - began
    if reply.has_error():
        return reply
    try:
        trained, metrics, num_examples = _checked(reply, start)
    except UpdateRejected as exc:
        # An answer, not an exception: the server records the update rejected with this
        # sentence, and neither Flower nor Ray logs a traceback for the user's mistake.
        log.warning("this site's update is refused: %s", exc.reason)
        refused = Error(code=keys.SITE_REFUSED_CODE, reason=keys.SITE_REFUSED_PREFIX + exc.reason)
        return Message(refused, reply_to=msg)
    metrics = MetricRecord(dict(metrics))
    if keys.COMPUTE_SECONDS not in metrics:
        metrics[keys.COMPUTE_SECONDS] = seconds
    config = reply.content.config_records.get(keys.CONFIG, ConfigRecord())
    extra = {
        name: record
        for name, record in reply.content.items()
        if name not in (keys.ARRAYS, keys.METRICS, keys.CONFIG)
    }
    return UserResult(trained, metrics, num_examples, dict(config), extra)


def _checked(
    reply: Message, start: Mapping[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], MetricRecord, int]:
    """The user's trained arrays, metrics and example count, or ``UpdateRejected``."""
    trained = read_trained(reply, start)
    metrics = reply.content.metric_records.get(keys.METRICS)
    if metrics is None:
        raise UpdateRejected(
            f"your train function's reply has no '{keys.METRICS}' record; Flower's convention "
            f"is arrays + metrics with '{keys.NUM_EXAMPLES}'"
        )
    try:
        return trained, metrics, check_num_examples(metrics.get(keys.NUM_EXAMPLES))
    except UpdateRejected as exc:
        raise UpdateRejected(f"your train function's metrics: {exc.reason}") from None


def read_trained(reply: Message, start: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The user's trained arrays, in ``start``'s order; ``UpdateRejected`` saying what differs.

    Names, shapes and dtypes must be those of the model it was given (an order of its
    own is put back into the model's); floats must be finite. The arrays are read-only
    views of the reply's bytes.
    """
    record = reply.content.array_records.get(keys.ARRAYS)
    if record is None:
        raise UpdateRejected(
            f"your train function's reply has no '{keys.ARRAYS}' record (it must return the "
            f"trained model, e.g. ArrayRecord(model.state_dict()))"
        )
    trained = record_views(record)  # read-only: a whole-model reply re-sends these Arrays
    missing = [k for k in start if k not in trained]
    extra = [k for k in trained if k not in start]
    if missing or extra:
        raise UpdateRejected(
            "your train function returned other arrays than it was given: "
            + "; ".join(
                part
                for part in (
                    f"missing {', '.join(missing[:5])}" if missing else "",
                    f"unexpected {', '.join(extra[:5])}" if extra else "",
                )
                if part
            )
        )
    for name, given in start.items():
        got = trained[name]
        if got.shape != given.shape:
            raise UpdateRejected(
                f"your train function returned '{name}' of shape {tuple(got.shape)}; the model "
                f"it was given has {tuple(given.shape)}"
            )
        if got.dtype != given.dtype:
            raise UpdateRejected(
                f"your train function returned '{name}' as {got.dtype}; the model it was "
                f"given has {given.dtype}"
            )
        if np.issubdtype(got.dtype, np.inexact) and not np.isfinite(got).all():
            raise UpdateRejected(
                f"your train function returned '{name}' with NaN or Inf (did training "
                "diverge? lower the learning rate)"
            )
    return {name: trained[name] for name in start}


def reply_with(
    msg: Message,
    arrays: Mapping[str, np.ndarray] | None,
    metrics: MetricRecord,
    *,
    config: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Message:
    """The mod's reply: its upload, the metrics, what the server must know (which mod
    answered and its protocol, ``keys.SITE_MOD`` and ``keys.SITE_MOD_PROTOCOL``, first),
    and the user's other records (``extra``), untouched."""
    content = RecordDict({keys.METRICS: metrics})
    for name, record in (extra or {}).items():
        content[name] = record
    if arrays is not None:
        content[keys.ARRAYS] = arrays_to_record(dict(arrays))
    answered_by = site_algorithm(msg) or keys.LOCAL_SGD
    said: dict[str, Any] = {keys.SITE_MOD: answered_by, keys.SITE_MOD_PROTOCOL: keys.MOD_PROTOCOL}
    content[keys.CONFIG] = ConfigRecord({**said, **(config or {})})
    return Message(content, reply_to=msg)


def with_config(msg: Message, updates: Mapping[str, Any]) -> Message:
    """A copy of ``msg`` whose round config has ``updates``; the original stays as it came."""
    content = RecordDict(dict(msg.content.items()))
    content[keys.CONFIG] = ConfigRecord({**round_config(msg), **updates})
    inner = copy.copy(msg)
    inner.content = content
    return inner


def mark_lost(metrics: MetricRecord, lost: bool) -> MetricRecord:
    """``metrics`` with ``state-lost`` set when the site found its kept state gone."""
    return MetricRecord({**metrics, keys.STATE_LOST: 1}) if lost else metrics


def state_lost_reply(msg: Message, what: str) -> Message:
    """Tell the server this site lost the state it relied on; it carries no update."""
    metrics = MetricRecord({keys.STATE_LOST: 1})
    return reply_with(msg, None, metrics, config={keys.STATE_LOST_DETAIL: what})


# ================================================================= state
@dataclass
class ModState:
    """A mod's state in one ``context.state`` record: named groups of arrays and numbers.

    Flower's ``context.state`` is empty after a SuperNode restarts; ``load`` then returns
    None, which is how a mod tells a restart from a site it has kept state for.
    """

    meta: dict[str, int]
    groups: dict[str, dict[str, np.ndarray]]

    @classmethod
    def load(cls, context: Context, key: str) -> ModState | None:
        """The state under ``key``, or None if the site holds none."""
        record = context.state.array_records.get(key)
        if record is None:
            return None
        meta: dict[str, int] = {}
        groups: dict[str, dict[str, np.ndarray]] = {}
        # read-only views: a mod computes its new state into new arrays, and state it
        # keeps unchanged is saved again without a copy (flplatform.core.arrays.encode)
        for full, array in record_views(record).items():
            group, _, name = full.partition(_SEP)
            if group == _META:
                meta[name] = int(array.reshape(-1)[0])
            else:
                groups.setdefault(group, {})[name] = array
        return cls(meta, groups)

    def save(self, context: Context, key: str) -> None:
        """Write the state under ``key``, replacing what was there."""
        arrays: dict[str, np.ndarray] = {
            f"{_META}{_SEP}{name}": np.asarray([value], dtype=np.int64)
            for name, value in self.meta.items()
        }
        for group, members in self.groups.items():
            for name, array in members.items():
                arrays[f"{group}{_SEP}{name}"] = array
        context.state[key] = ArrayRecord() if not arrays else arrays_to_record(arrays)


def new_state() -> ModState:
    """An empty state (a site's first message)."""
    return ModState({}, {})


def next_call(state: ModState) -> int:
    """Count this training call in ``state``; return how many came before it.

    A site may train twice on one round's model (the K-batch modes), so random streams
    use (seed, round, site, calls) rather than the round alone.
    """
    done = state.meta.get("calls", 0)
    state.meta["calls"] = done + 1
    return done
