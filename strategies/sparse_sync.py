"""Sparse model downloads: a site is sent only the coordinates changed since the version it holds.

Sketched strategies change k coordinates per step, so re-sending the whole model every round
would cost more than the sketches save. The server keeps which coordinates each version
changed (``ChangeLog``) and which version each site holds (``SparseModel``); a message
carries the current values at every coordinate changed since then. Measured, not assumed:
a site that missed rounds is sent the union of their changes, and a site whose holding is
unknown (first contact, a lost or failed message) is sent the whole model.

The site keeps the model it was synced to in its persistent state (``synced_model`` and
``remember_model``); both sides flatten arrays in ``Layout`` order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message

from flplatform import keys
from flplatform.engine.wire import arrays_to_record, record_to_arrays
from flplatform.errors import ConfigError
from strategies.codecs import Layout

SYNC_INDICES, SYNC_VALUES = "sync.indices", "sync.values"  # a sparse download
DENSE = -1  # sync-from of a message carrying the whole model
# More changed coordinates than this fraction of d travel as the whole model.
DENSE_ABOVE = 0.5


@dataclass
class ChangeLog:
    """Which coordinates each model version changed: what a site that missed rounds needs.

    A site holding version v is sent x at every coordinate changed in versions v+1..now.
    Versions older than ``keep`` rounds are forgotten; a site that far behind gets the
    whole model.
    """

    keep: int = 64
    changes: dict[int, torch.Tensor] = field(default_factory=dict)  # version → indices

    def record(self, version: int, indices: torch.Tensor) -> None:
        """Version ``version`` changed ``indices``."""
        self.changes[version] = indices.to(torch.int64).cpu()
        for old in [v for v in self.changes if v <= version - self.keep]:
            del self.changes[old]

    def changed_since(self, version: int, current: int) -> torch.Tensor | None:
        """Sorted coordinates changed after ``version`` up to ``current``; None if unknown."""
        needed = range(version + 1, current + 1)
        if any(v not in self.changes for v in needed):
            return None
        if not needed:
            return torch.empty(0, dtype=torch.int64)
        return torch.unique(torch.cat([self.changes[v] for v in needed]))


def index_dtype(d: int) -> type[np.integer]:
    """The integer type of coordinate indices into a model of d coordinates on the wire."""
    return np.int32 if d < 2**31 else np.int64


class SparseModel:
    """The server's model x, its versions, and what each site holds of it."""

    def __init__(self) -> None:
        self.layout: Layout | None = None
        self.flat = torch.empty(0)  # x, flattened in the layout's order (float32)
        self.record: ArrayRecord | None = None  # x as sent to sites
        self.version = 0
        self.changes = ChangeLog()
        self.synced: dict[int, int] = {}  # node → version it holds (confirmed by a reply)
        # node → (version its outstanding message carries, version it held before, if known)
        self._sent: dict[int, tuple[int, int | None]] = {}

    @property
    def size(self) -> int:
        """d, the number of model coordinates (0 before ``adopt``)."""
        return 0 if self.layout is None else self.layout.size

    def adopt(self, arrays: ArrayRecord) -> bool:
        """Take ``arrays`` as x the first time (the engine's initial model); True then."""
        if self.layout is not None:
            return False
        model = record_to_arrays(arrays)
        self.layout = Layout.of(model)
        self.flat = torch.from_numpy(self.layout.flatten(model).astype(np.float32))
        self.record = arrays
        return True

    def download(self, node_id: int) -> tuple[ArrayRecord, int]:
        """What ``node_id`` needs to hold x: (record, version it must hold first or DENSE).

        Call once per message drafted; ``confirm`` when the site answers it, ``withdraw``
        if the message is not sent after all.
        """
        if self.layout is None or self.record is None:
            raise RuntimeError("SparseModel.adopt runs before the first download")
        # Taken, not read: until the site replies to this message, what it holds is not
        # known (a failed or lost message is followed by the whole model).
        held = self.synced.pop(node_id, None)
        self._sent[node_id] = (self.version, held)
        changed = None if held is None else self.changes.changed_since(held, self.version)
        if held is None or changed is None or len(changed) > DENSE_ABOVE * self.layout.size:
            return self.record, DENSE
        indices = changed.numpy().astype(index_dtype(self.layout.size))
        values = self.flat[changed].numpy()
        return arrays_to_record({SYNC_INDICES: indices, SYNC_VALUES: values}), held

    def confirm(self, node_id: int) -> None:
        """``node_id`` answered its message: it holds the version that message carried."""
        if node_id in self._sent:
            self.synced[node_id] = self._sent.pop(node_id)[0]

    def withdraw(self, node_id: int) -> None:
        """``node_id``'s drafted message was never sent: it still holds what it held."""
        version_and_held = self._sent.pop(node_id, None)
        if version_and_held is not None and version_and_held[1] is not None:
            self.synced[node_id] = version_and_held[1]

    def apply(self, indices: torch.Tensor, values: torch.Tensor) -> ArrayRecord:
        """x[indices] += values as the next version; return the new x as a record."""
        if self.layout is None:
            raise RuntimeError("SparseModel.adopt runs before the first step")
        self.flat[indices] += values.to(self.flat.dtype)
        self.version += 1
        self.changes.record(self.version, indices)
        self.record = arrays_to_record(self.layout.unflatten(self.flat.numpy()))
        return self.record


# =============================================================== site side
def int_config(config: ConfigRecord, key: str, low: int) -> int:
    """An integer the server put in the round config, checked (``ConfigError`` if not)."""
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"round config '{key}' must be an integer >= {low}, got {value!r}")
    return value


def valid_indices(indices: np.ndarray | None, d: int) -> bool:
    """Whether ``indices`` is a 1-D integer array of coordinates in [0, d)."""
    return (
        indices is not None
        and indices.ndim == 1
        and bool(np.issubdtype(indices.dtype, np.integer))
        and (len(indices) == 0 or (indices.min() >= 0 and indices.max() < d))
    )


def synced_model(
    msg: Message, context: Context, *, state_key: str, model_key: str
) -> dict[str, np.ndarray]:
    """The model the server holds, from the message and the site's stored copy.

    ``state_key``/``model_key`` name where ``remember_model`` stored the site's copy.
    """
    config = msg.content.config_records.get(keys.CONFIG, ConfigRecord())
    sync_from = int_config(config, keys.SYNC_FROM, DENSE)
    if keys.ARRAYS not in msg.content.array_records:
        raise ConfigError(f"the server's message has no '{keys.ARRAYS}' record")
    sent = record_to_arrays(msg.content.array_records[keys.ARRAYS])
    if sync_from == DENSE:
        return sent
    state = context.state.config_records.get(state_key, ConfigRecord())
    stored = context.state.array_records.get(model_key)
    held = state.get("version")
    # Changes since an older version than the site holds still bring it to the server's
    # model: they cover every coordinate changed since, with its current value.
    if stored is None or not isinstance(held, int) or held < sync_from:
        raise ConfigError(
            f"this site holds model version {held!r}, but the server sent the changes since "
            f"version {sync_from}; it will send the whole model next time"
        )
    model = record_to_arrays(stored)
    layout = Layout.of(model)
    indices, values = sent.get(SYNC_INDICES), sent.get(SYNC_VALUES)
    if (
        indices is None
        or values is None
        or not valid_indices(indices, layout.size)
        or indices.shape != values.shape
    ):
        raise ConfigError("the server's sparse model update is malformed")
    flat = layout.flatten(model)
    flat[indices] = values
    return layout.unflatten(flat)


def remember_model(
    context: Context,
    model: dict[str, np.ndarray],
    version: int,
    *,
    state_key: str,
    model_key: str,
) -> None:
    """Store the synced ``model`` (server version ``version``) in the site's state."""
    context.state[model_key] = arrays_to_record(model)
    context.state[state_key] = ConfigRecord({"version": version})
