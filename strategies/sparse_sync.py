"""Sparse model downloads: a site is sent only the coordinates changed since the version it holds.

Sketched strategies change k coordinates per step, so re-sending the whole model every round
would cost more than the sketches save. The server keeps which coordinates each version
changed (``ChangeLog``) and which version each site holds (``SparseModel``); a message
carries the current values at every coordinate changed since then. Measured, not assumed:
a site that missed rounds is sent the union of their changes, and a site whose holding is
unknown (first contact, a lost or failed message) is sent the whole model.

The site keeps the model it was synced to in its persistent state (the site halves in
``strategies.mods``); both sides flatten arrays in ``Layout`` order, and the model keeps
its own key order on the wire.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord

from flplatform.core.arrays import arrays_to_record, record_to_arrays
from flplatform.core.errors import ConfigError
from flplatform.core.state import MISSING, StateReader
from strategies.averaged_arrays import averaged_arrays, named_arrays
from strategies.layout import Layout
from strategies.top_k import index_dtype

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


@dataclass
class HeldVersions:
    """Which global model version each site holds, as the server knows it.

    ``synced``: node → the version it holds, confirmed by a reply. While a message carrying
    a download is out, ``sent``: node → (the version it carries, the version the site held
    before, if known). Taken, not read: until the site answers, what it holds is not known,
    so a failed or lost message is followed by the whole model.
    """

    synced: dict[int, int] = field(default_factory=dict)
    sent: dict[int, tuple[int, int | None]] = field(default_factory=dict)

    def take(self, node_id: int, version: int) -> int | None:
        """A message carrying ``version`` is drafted for ``node_id``: the version it held
        (None: unknown, the whole model is sent)."""
        held = self.synced.pop(node_id, None)
        self.sent[node_id] = (version, held)
        return held

    def confirm(self, node_id: int) -> None:
        """``node_id`` answered its message: it holds the version that message carried."""
        if node_id in self.sent:
            self.synced[node_id] = self.sent.pop(node_id)[0]

    def withdraw(self, node_id: int) -> None:
        """``node_id``'s drafted message was never sent: it still holds what it held."""
        version_and_held = self.sent.pop(node_id, None)
        if version_and_held is not None and version_and_held[1] is not None:
            self.synced[node_id] = version_and_held[1]

    def forget(self, node_id: int) -> None:
        """What ``node_id`` holds is unknown (its message failed, or it lost its state): it
        is sent the whole model next."""
        self.sent.pop(node_id, None)
        self.synced.pop(node_id, None)


class SparseModel:
    """The server's model x, its versions, and what each site holds of it.

    ``named``: the arrays (names or patterns) the user named to be averaged whole, beside
    those ``strategies.averaged_arrays``' rule finds; each must match the model.
    """

    def __init__(self, named: Sequence[str] = ()) -> None:
        self.named = tuple(named)
        self.layout: Layout | None = None
        self.order: list[str] = []  # the model's key order
        self.flat = torch.empty(0)  # x, flattened in the layout's order (float32)
        self.record: ArrayRecord | None = None  # x as sent to sites
        self.version = 0
        self.changes = ChangeLog()
        self.held = HeldVersions()  # what each site holds of it

    @property
    def averaged(self) -> tuple[str, ...]:
        """Its arrays sent whole, never sketched (``strategies.averaged_arrays``), in the
        model's order; none before ``adopt``."""
        if self.layout is None:
            return ()
        dtypes = {name: self.layout.dtype_of(name) for name in self.order}
        return averaged_arrays(dtypes, self.layout.named_averaged)

    def averaged_spans(self) -> tuple[tuple[int, int], ...]:
        """The ``averaged`` arrays' coordinate ranges ``[start, stop)`` in ``flat``."""
        assert self.layout is not None
        return tuple(self.layout.span(name) for name in self.averaged)

    def span(self, name: str) -> slice:
        """Array ``name``'s coordinates in ``flat``."""
        assert self.layout is not None
        return slice(*self.layout.span(name))

    @property
    def size(self) -> int:
        """d, the number of model coordinates (0 before ``adopt``)."""
        return 0 if self.layout is None else self.layout.size

    def adopt(self, arrays: ArrayRecord) -> bool:
        """Take ``arrays`` as x the first time (the engine's initial model); True then."""
        if self.layout is not None:
            return False
        model = record_to_arrays(arrays)
        self.layout = Layout.of(model, averaged=named_arrays(self.named, model))  # ConfigError
        self.order = list(model)
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
        held = self.held.take(node_id, self.version)
        changed = None if held is None else self.changes.changed_since(held, self.version)
        if held is None or changed is None or len(changed) > DENSE_ABOVE * self.layout.size:
            return self.record, DENSE
        indices = changed.numpy().astype(index_dtype(self.layout.size))
        values = self.flat[changed].numpy()
        return arrays_to_record({SYNC_INDICES: indices, SYNC_VALUES: values}), held

    def confirm(self, node_id: int) -> None:
        """``node_id`` answered its message: it holds the version that message carried."""
        self.held.confirm(node_id)

    def withdraw(self, node_id: int) -> None:
        """``node_id``'s drafted message was never sent: it still holds what it held."""
        self.held.withdraw(node_id)

    def forget(self, node_id: int) -> None:
        """What ``node_id`` holds is unknown: its next download is the whole model."""
        self.held.forget(node_id)

    def state_dict(self) -> dict[str, Any]:
        """x, its version and change log, and what each site holds (node ids as they are).

        ``flat`` is saved beside ``record``: x accumulates in float32 where the model's
        own dtype may round (an integer buffer), so neither is rebuilt from the other.
        """
        return {
            "record": self.record,  # None before adopt
            "flat": self.flat.numpy().copy(),
            "order": list(self.order),
            "version": self.version,
            "changes": {v: i.numpy().copy() for v, i in self.changes.changes.items()},
            "synced": dict(self.held.synced),
            "sent": {node: tuple(pair) for node, pair in self.held.sent.items()},
        }

    @classmethod
    def read(
        cls, reader: StateReader, state: Any, where: str, named: Sequence[str] = ()
    ) -> SparseModel | None:
        """The model ``state_dict()`` wrote, ``named`` as the constructor's; problems go to
        ``reader``."""
        fields = reader.fields(
            state, where, "record", "flat", "order", "version", "changes", "synced", "sent"
        )
        if fields is None:
            return None
        model = cls(named)
        record = fields["record"]
        if record is not None and record is not MISSING:
            if not isinstance(record, ArrayRecord):
                reader.add(f"'{where}.record' must be an ArrayRecord, got {type(record).__name__}")
                return None
            try:
                arrays = record_to_arrays(record)
                model.layout = Layout.of(arrays, averaged=named_arrays(named, arrays))
            except ConfigError as exc:  # the run's averaged-arrays, not the saved model
                reader.add(f"'{where}.record': {exc.reason}")
                return None
            except Exception as exc:  # not .npy bytes, a dtype no layout takes
                reader.add(f"'{where}.record' is not a usable model: {exc}")
                return None
            model.record, model.order = record, list(arrays)
            if fields["order"] != model.order:
                reader.add(f"'{where}.order' is not the saved model's key order")
        flat = reader.array(
            fields["flat"], f"{where}.flat", shape=(model.size,), dtype=np.float32, finite=True
        )
        version = reader.integer(fields["version"], f"{where}.version", minimum=0)
        changes = reader.keyed(
            fields["changes"],
            f"{where}.changes",
            lambda v, at: reader.indices(v, at, d=model.size),
        )
        synced = reader.keyed(fields["synced"], f"{where}.synced", reader.integer, by_node=True)
        sent = reader.keyed(
            fields["sent"], f"{where}.sent", lambda v, at: sent_pair(reader, v, at), by_node=True
        )
        if flat is None or version is None or changes is None or synced is None or sent is None:
            return None
        model.flat = torch.from_numpy(flat)
        model.version = version
        model.changes.changes = {v: torch.from_numpy(i) for v, i in changes.items()}
        model.held = HeldVersions(synced, sent)
        return model

    def apply(
        self,
        indices: torch.Tensor,
        values: torch.Tensor,
        assign: Mapping[str, np.ndarray] | None = None,
    ) -> ArrayRecord:
        """x[indices] += values, and each array named in ``assign`` set to its value, as the
        next version; return the new x as a record.

        ``ValueError`` (x unchanged) when a value does not fit its array's dtype."""
        if self.layout is None:
            raise RuntimeError("SparseModel.adopt runs before the first step")
        layout = self.layout
        spans = {name: layout.span(name) for name in assign or {}}
        exact = {}  # checked before anything changes
        for name, value in (assign or {}).items():
            with np.errstate(over="ignore"):  # an overflow is found just below
                cast = layout._cast(name, np.asarray(value, dtype=np.float64).reshape(-1))
            if cast.dtype.kind == "f" and not np.isfinite(cast).all():
                raise ValueError(f"array '{name}' overflows its dtype {cast.dtype}")
            exact[name] = torch.from_numpy(cast.astype(np.float32))
        # Only the touched coordinates are kept aside: x is model-sized, a copy per step
        # would cost as much as the step.
        before = self.flat[indices].clone()
        kept = {name: self.flat[a:b].clone() for name, (a, b) in spans.items()}
        self.flat[indices] += values.to(self.flat.dtype)
        for name, (a, b) in spans.items():
            self.flat[a:b] = exact[name]
        try:
            arrays = layout.unflatten(self.flat.numpy())
        except ValueError:
            for name, (a, b) in spans.items():
                self.flat[a:b] = kept[name]
            self.flat[indices] = before
            raise
        self.version += 1
        changed = [indices.to(torch.int64), *(torch.arange(a, b) for a, b in spans.values())]
        self.changes.record(self.version, torch.unique(torch.cat(changed)) if spans else indices)
        # The model's own key order, not the layout's sorted one: users load by position.
        self.record = arrays_to_record({name: arrays[name] for name in self.order})
        return self.record


def sent_pair(reader: StateReader, value: Any, where: str) -> tuple[int, int | None] | None:
    """(version the outstanding message carries, version the site held before or None)."""
    if not isinstance(value, tuple | list) or len(value) != 2:
        reader.add(f"'{where}' must be a pair (sent version, held version), got {value!r:.60}")
        return None
    sent = reader.integer(value[0], f"{where}[0]", minimum=0)
    held = None if value[1] is None else reader.integer(value[1], f"{where}[1]", minimum=0)
    if sent is None or (value[1] is not None and held is None):
        return None
    return sent, held


# =============================================================== both sides
def valid_indices(indices: np.ndarray | None, d: int) -> bool:
    """Whether ``indices`` is a 1-D integer array of coordinates in [0, d)."""
    return (
        indices is not None
        and indices.ndim == 1
        and bool(np.issubdtype(indices.dtype, np.integer))
        and (len(indices) == 0 or (indices.min() >= 0 and indices.max() < d))
    )
