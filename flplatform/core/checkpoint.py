"""The checkpoint file: one state tree (dicts, lists, numbers, arrays, Flower records) on disk.

Every state object's ``state_dict()`` (a strategy's, the policy's, the clock's, the
engine's) returns plain data; this module writes such a tree to one file and reads it
back exactly: float64 numbers through JSON's round-trip ``repr``, arrays byte for byte in
their dtype and shape, the key order of every dict and ``ArrayRecord`` kept.

The file is a NumPy ``.npz`` (an uncompressed zip: zlib gains about 7% on float32 models
and costs far more than writing): each array is one ``.npy`` entry and the tree, with
arrays replaced by references, is the JSON entry ``__tree__``. Reading never unpickles
(``allow_pickle=False``), so a hostile file can only fail to load, with a
``CheckpointError`` that says why.

Values a tree may hold:

* ``None``, ``bool``, ``int``, ``float`` (NaN and ±inf too), ``str``, ``bytes``;
* ``list``, ``tuple``, ``set``/``frozenset`` (read back as ``set``), ``dict`` with keys of
  those scalar types (node ids are ints);
* NumPy arrays and scalars (kept as 0-d arrays of their dtype), torch tensors (read back
  on the CPU, bfloat16 included);
* Flower's ``ArrayRecord``, ``ConfigRecord``, ``MetricRecord`` and ``RecordDict`` (a
  message's content). The same array or record object reached twice (an in-flight
  message holding the model version it was drafted from) is written once.

Writing is atomic: a temporary file in the same directory is written, flushed to disk and
renamed over the target, so a crash leaves the old file or the new one, never half of
one. The file is owner-only (0600): a checkpoint holds the model, which may be private.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from flplatform.core.errors import FLPlatformError

FORMAT = "flplatform-checkpoint/1"
TREE_ENTRY = "__tree__"
_MARK = "__"  # keys starting with this are the codec's markers, not the user's


class CheckpointError(FLPlatformError):
    """A checkpoint is missing, unreadable, not one of ours, or does not fit the run."""

    exit_code = 4


# ==================================================================== encoding
class _Encoder:
    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}
        self._seen: dict[int, Any] = {}  # id(object) → its encoding (written once)
        self._alive: list[Any] = []  # keeps encoded objects alive, so ids stay unique

    def _array(self, array: np.ndarray) -> str:
        key = id(array)
        if key in self._seen:
            return self._seen[key]
        if array.dtype.hasobject:
            raise CheckpointError(f"cannot save an array of Python objects (dtype {array.dtype})")
        name = f"a{len(self.arrays)}"
        self.arrays[name] = np.ascontiguousarray(array) if array.ndim else array
        self._seen[key] = name
        self._alive.append(array)
        return name

    def encode(self, value: Any, where: str) -> Any:  # noqa: C901 - one branch per type
        if value is None or isinstance(value, bool | str):
            return value
        if isinstance(value, int):
            return value
        if isinstance(value, float):
            return value
        if isinstance(value, bytes):
            return {"__bytes__": base64.b64encode(value).decode("ascii")}
        if isinstance(value, np.ndarray):
            return {"__array__": self._array(value)}
        if isinstance(value, np.generic):
            return {"__array__": self._array(np.asarray(value))}
        if isinstance(value, list):
            return [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return {"__tuple__": [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, set | frozenset):
            items = sorted(value, key=_sort_key)
            return {"__set__": [self.encode(v, f"{where}{{}}") for v in items]}
        if isinstance(value, Mapping) and type(value).__module__.startswith("flwr"):
            return self._record(value, where)
        if isinstance(value, dict):
            return self._dict(value, where)
        torch_tensor = _torch_tensor(value)
        if torch_tensor is not None:
            return torch_tensor(self, value)
        raise CheckpointError(
            f"cannot save {where}: a {type(value).__name__} is not checkpoint data "
            f"(allowed: numbers, strings, bytes, lists, tuples, sets, dicts, arrays, "
            f"tensors, Flower records)"
        )

    def _dict(self, value: dict[Any, Any], where: str) -> Any:
        plain = all(isinstance(k, str) and not k.startswith(_MARK) for k in value)
        if plain:
            return {k: self.encode(v, f"{where}.{k}") for k, v in value.items()}
        pairs = []
        for k, v in value.items():
            if not isinstance(k, str | int | float | bool | tuple) and k is not None:
                raise CheckpointError(f"cannot save {where}: a dict key {k!r} is not a scalar")
            pairs.append([self.encode(k, f"{where} key"), self.encode(v, f"{where}[{k!r}]")])
        return {"__dict__": pairs}

    def _record(self, record: Any, where: str) -> Any:
        from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

        key = id(record)
        if key in self._seen:
            return self._seen[key]
        if isinstance(record, ArrayRecord):
            encoded: Any = {
                "__arrayrecord__": [
                    [name, self._array(array.numpy())] for name, array in record.items()
                ]
            }
        elif isinstance(record, ConfigRecord | MetricRecord):
            kind = "__config__" if isinstance(record, ConfigRecord) else "__metrics__"
            encoded = {kind: self._dict(dict(record), where)}
        elif isinstance(record, RecordDict):
            encoded = {
                "__recorddict__": [
                    [name, self._record(item, f"{where}.{name}")] for name, item in record.items()
                ]
            }
        else:
            raise CheckpointError(f"cannot save {where}: unknown Flower record {type(record)}")
        self._seen[key] = encoded
        self._alive.append(record)
        return encoded


def _torch_tensor(value: Any) -> Any:
    """The encoder of a torch tensor, or None when ``value`` is not one (torch not loaded)."""
    torch = __import__("sys").modules.get("torch")
    if torch is None or not isinstance(value, torch.Tensor):
        return None

    def encode(encoder: _Encoder, tensor: Any) -> Any:
        tensor = tensor.detach().cpu()
        dtype = str(tensor.dtype).removeprefix("torch.")
        if tensor.dtype == torch.bfloat16:  # NumPy has no bfloat16: keep its bits
            array = tensor.view(torch.int16).numpy()
        else:
            array = tensor.numpy()
        return {"__tensor__": encoder._array(array), "dtype": dtype}

    return encode


def _sort_key(value: Any) -> tuple[str, Any]:
    return (type(value).__name__, value)


# ==================================================================== decoding
class _Decoder:
    def __init__(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.arrays = arrays

    def array(self, name: Any) -> np.ndarray:
        if not isinstance(name, str) or name not in self.arrays:
            raise CheckpointError(f"the checkpoint refers to an array {name!r} it does not hold")
        return self.arrays[name]

    def decode(self, value: Any) -> Any:  # noqa: C901 - one branch per marker
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if isinstance(value, list):
            return [self.decode(v) for v in value]
        if not isinstance(value, dict):
            raise CheckpointError(f"the checkpoint holds an unexpected value {value!r:.80}")
        marks = [k for k in value if k.startswith(_MARK)]
        if not marks:
            return {k: self.decode(v) for k, v in value.items()}
        mark = marks[0]
        body = value[mark]
        if mark == "__array__":
            return self.array(body)
        if mark == "__tensor__":
            return self._tensor(self.array(body), value.get("dtype"))
        if mark == "__bytes__":
            return base64.b64decode(body)
        if mark == "__tuple__":
            return tuple(self.decode(v) for v in body)
        if mark == "__set__":
            return {self.decode(v) for v in body}
        if mark == "__dict__":
            return {_hashable(self.decode(k)): self.decode(v) for k, v in body}
        if mark in ("__arrayrecord__", "__config__", "__metrics__", "__recorddict__"):
            return self._record(mark, body)
        raise CheckpointError(f"the checkpoint holds an unknown marker {mark!r}")

    def _record(self, mark: str, body: Any) -> Any:
        from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

        if mark == "__arrayrecord__":
            record: Any = ArrayRecord(
                {name: Array(np.asarray(self.array(ref), order="C")) for name, ref in body}
            )
        elif mark == "__config__":
            record = ConfigRecord(self.decode(body))
        elif mark == "__metrics__":
            record = MetricRecord(self.decode(body))
        else:
            record = RecordDict({name: self.decode(item) for name, item in body})
        return record

    @staticmethod
    def _tensor(array: np.ndarray, dtype: Any) -> Any:
        import torch

        if dtype == "bfloat16":
            return torch.from_numpy(array.copy()).view(torch.bfloat16)
        tensor = torch.from_numpy(array.copy())
        if not isinstance(dtype, str) or str(tensor.dtype).removeprefix("torch.") != dtype:
            raise CheckpointError(f"a tensor's dtype {dtype!r} does not match its data")
        return tensor


def _hashable(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value


# ==================================================================== files
def write_state(path: str | Path, state: Mapping[str, Any]) -> int:
    """Write ``state`` to ``path`` atomically, owner-only; return the file's size in bytes.

    Raises ``CheckpointError`` for a value that is not checkpoint data, or when the file
    cannot be written (the previous file at ``path``, if any, is then left as it was).
    """
    path = Path(path)
    encoder = _Encoder()
    tree = {"format": FORMAT, "state": encoder.encode(dict(state), "state")}
    text = json.dumps(tree, allow_nan=True, separators=(",", ":"))
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as file:
            with zipfile.ZipFile(file, "w", compression=zipfile.ZIP_STORED) as archive:
                archive.writestr(TREE_ENTRY, text)
                for name, array in encoder.arrays.items():
                    with archive.open(f"{name}.npy", "w", force_zip64=True) as entry:
                        np.lib.format.write_array(entry, array, allow_pickle=False)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
        _fsync_directory(path.parent)
    except OSError as exc:
        _discard(temporary)
        raise CheckpointError(f"cannot write checkpoint {path}: {exc.strerror or exc}") from exc
    except BaseException:
        _discard(temporary)
        raise
    return path.stat().st_size


def _discard(temporary: Path) -> None:
    """Remove a temporary file, if it could be made at all (its directory may not exist)."""
    with contextlib.suppress(OSError):
        temporary.unlink(missing_ok=True)


def read_state(path: str | Path) -> dict[str, Any]:
    """The state tree written by :func:`write_state`; ``CheckpointError`` says what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist (was it moved or deleted?)")
    try:
        with zipfile.ZipFile(path) as archive:
            names = set(archive.namelist())
            if TREE_ENTRY not in names:
                raise CheckpointError(f"{path} is not a flplatform checkpoint (no {TREE_ENTRY})")
            tree = json.loads(archive.read(TREE_ENTRY))
            arrays = {}
            for name in names - {TREE_ENTRY}:
                if not name.endswith(".npy"):
                    raise CheckpointError(f"{path} holds an unexpected entry {name!r}")
                with archive.open(name) as entry:
                    data = io.BytesIO(entry.read())
                arrays[name.removesuffix(".npy")] = np.lib.format.read_array(
                    data, allow_pickle=False
                )
    except CheckpointError:
        raise
    except (OSError, zipfile.BadZipFile, ValueError, RecursionError) as exc:
        # ValueError covers JSON and .npy headers; RecursionError a tree nested too deep.
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    if not isinstance(tree, dict) or tree.get("format") != FORMAT:
        found = tree.get("format") if isinstance(tree, dict) else None
        raise CheckpointError(f"{path} is not a {FORMAT} file (format {found!r})")
    try:
        state = _Decoder(arrays).decode(tree.get("state"))
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc.reason}") from exc
    except (TypeError, ValueError, KeyError, RecursionError) as exc:
        # A marker whose body has the wrong shape (a hostile or corrupted tree), or a
        # record Flower refuses: the file can only fail to load, never load half-way.
        raise CheckpointError(f"{path} holds a malformed state: {exc}") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds no state")
    return state


def _fsync_directory(directory: Path) -> None:
    """Make a rename durable (POSIX); a platform without directory handles skips it."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


# ============================================================ validating loads
class StateProblems:
    """Collects every problem of a state being loaded, then raises them together (Opacus).

    ``load_state_dict`` implementations use it to check types and shapes::

        problems = StateProblems("LocalSGDAveraging")
        velocity = problems.array(state, "velocity", shape=(10,))
        problems.raise_if_any()
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.problems: list[str] = []

    def add(self, problem: str) -> None:
        self.problems.append(problem)

    def require(self, state: Mapping[str, Any], *names: str) -> bool:
        """Whether ``state`` is a mapping holding ``names`` (a problem noted for each missing)."""
        if not isinstance(state, Mapping):
            self.add(f"expected a mapping, got {type(state).__name__}")
            return False
        missing = [n for n in names if n not in state]
        for name in missing:
            self.add(f"'{name}' is missing")
        return not missing

    def number(self, value: Any, name: str, *, integer: bool = False) -> bool:
        allowed = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, allowed):
            kind = "a whole number" if integer else "a number"
            self.add(f"'{name}' must be {kind}, got {value!r:.60}")
            return False
        return True

    def array(
        self, value: Any, name: str, *, shape: tuple[int, ...] | None = None, dtype: Any = None
    ) -> bool:
        if not isinstance(value, np.ndarray):
            self.add(f"'{name}' must be an array, got {type(value).__name__}")
            return False
        if shape is not None and tuple(value.shape) != tuple(shape):
            self.add(f"'{name}' has shape {tuple(value.shape)}, this run needs {tuple(shape)}")
            return False
        if dtype is not None and value.dtype != np.dtype(dtype):
            self.add(f"'{name}' has dtype {value.dtype}, this run needs {np.dtype(dtype)}")
            return False
        return True

    def raise_if_any(self) -> None:
        if self.problems:
            raise CheckpointError(
                f"cannot restore {self.owner} from the checkpoint: " + "; ".join(self.problems)
            )
