"""The checkpoint file: exact round trips, hostile files refused, owner-only, atomic."""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import stat
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from flplatform.core.checkpoint import (
    FORMAT,
    TREE_ENTRY,
    CheckpointError,
    StateProblems,
    read_state,
    write_state,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
DTYPES = ["float32", "float64", "float16", "int8", "int32", "int64", "uint8", "uint64", "bool"]


# ---------------------------------------------------------------------------- equality oracle
def same(a: Any, b: Any) -> bool:
    """Equal as the codec promises: same types, NaN equal to NaN, arrays bit for bit, order."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        )
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.tobytes() == b.tobytes()
        )
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(bits(a), bits(b))
        )
    if isinstance(a, ArrayRecord):
        return (
            isinstance(b, ArrayRecord)
            and list(a) == list(b)
            and all(same(a[k].numpy(), b[k].numpy()) for k in a)
        )
    if isinstance(a, ConfigRecord | MetricRecord | RecordDict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (NaN payloads and -0.0 included), to compare bit for bit."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


# ---------------------------------------------------------------------------- trees
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=8),
)
arrays = st.sampled_from(DTYPES).flatmap(
    lambda dtype: hnp.arrays(dtype, hnp.array_shapes(min_dims=0, max_dims=3, max_side=3))
)
keys = st.one_of(st.text(max_size=6), st.integers(-5, 2**64), st.just("__array__"))


def trees(depth: int = 3) -> st.SearchStrategy[Any]:
    return st.recursive(
        st.one_of(scalars, arrays),
        lambda children: st.one_of(
            st.lists(children, max_size=4),
            st.tuples(children, children),
            st.dictionaries(keys, children, max_size=4),
            st.frozensets(st.integers(0, 2**64), max_size=4).map(set),
        ),
        max_leaves=12,
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=st.dictionaries(st.text(max_size=6), trees(), max_size=5))
def test_any_tree_round_trips_exactly(tmp_path_factory: pytest.TempPathFactory, tree: Any) -> None:
    path = tmp_path_factory.mktemp("ckpt") / "state.npz"
    write_state(path, tree)
    assert same(tree, read_state(path))


@settings(max_examples=25, deadline=None)
@given(
    names=st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=5, unique=True),
    data=st.data(),
)
def test_flower_records_round_trip_in_their_key_order(
    tmp_path_factory: pytest.TempPathFactory, names: list[str], data: st.DataObject
) -> None:
    model = ArrayRecord(
        {name: Array(data.draw(arrays.filter(lambda a: a.ndim > 0))) for name in names}
    )
    config = ConfigRecord({"lr": 0.1, "steps": 5, "name": "x", "blob": b"\x00\x01", "ids": [1, 2]})
    metrics = MetricRecord({"loss": float("inf"), "n": 3, "hist": [0.5, 0.25]})
    content = RecordDict({"arrays": model, "config": config, "metrics": metrics})
    state = {"model": model, "message": content, "metrics": metrics}
    path = tmp_path_factory.mktemp("ckpt") / "state.npz"

    write_state(path, state)
    loaded = read_state(path)

    assert same(state, loaded)
    assert list(loaded["model"].keys()) == names
    assert list(loaded["message"].keys()) == ["arrays", "config", "metrics"]


def test_torch_tensors_come_back_on_the_cpu_with_their_dtype(tmp_path: Path) -> None:
    tensors = {
        "bf16": torch.tensor([1.5, -2.25, float("nan")], dtype=torch.bfloat16),
        "f32": torch.randn(2, 3),
        "i64": torch.arange(4),
        "scalar": torch.tensor(3.0, dtype=torch.float64),
    }
    write_state(tmp_path / "t.npz", tensors)
    loaded = read_state(tmp_path / "t.npz")
    assert same(tensors, loaded)
    assert all(t.device.type == "cpu" for t in loaded.values())


def test_numpy_scalars_keep_their_dtype_and_shared_arrays_are_written_once(tmp_path: Path) -> None:
    weights = np.arange(1000, dtype=np.float32)
    record = ArrayRecord({"w": Array(weights)})
    state = {"a": record, "b": record, "x": weights, "y": weights, "n": np.int16(7)}
    write_state(tmp_path / "s.npz", state)
    with zipfile.ZipFile(tmp_path / "s.npz") as archive:
        arrays = [n for n in archive.namelist() if n != TREE_ENTRY]
    assert len(arrays) == 3  # the record's array, the plain array, the scalar
    loaded = read_state(tmp_path / "s.npz")
    assert loaded["n"].dtype == np.int16 and loaded["n"].shape == () and int(loaded["n"]) == 7
    assert same(loaded["a"], loaded["b"]) and same(loaded["x"], weights)


def test_a_golden_tree_is_stored_as_readable_json(tmp_path: Path) -> None:
    write_state(tmp_path / "g.npz", {"round": 3, "ids": {2, 1}, "by_node": {7: (1.5, None)}})
    with zipfile.ZipFile(tmp_path / "g.npz") as archive:
        tree = json.loads(archive.read(TREE_ENTRY))
    assert tree == {
        "format": FORMAT,
        "state": {
            "round": 3,
            "ids": {"__set__": [1, 2]},
            "by_node": {"__dict__": [[7, {"__tuple__": [1.5, None]}]]},
        },
    }


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (object(), "a object is not checkpoint data"),
        (np.array([{}], dtype=object), "array of Python objects"),
        ({frozenset(): 1}, "is not a scalar"),
    ],
)
def test_what_is_not_checkpoint_data_is_refused_naming_where(
    tmp_path: Path, value: Any, message: str
) -> None:
    with pytest.raises(CheckpointError) as info:
        write_state(tmp_path / "x.npz", {"engine": {"deep": value}})
    assert message in info.value.reason
    assert not (tmp_path / "x.npz").exists()
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------- the file
def test_the_file_is_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        write_state(tmp_path / "private.npz", {"w": np.ones(3)})
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "private.npz").st_mode) == 0o600


def test_a_rewrite_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "s.npz"
    size = write_state(path, {"v": 1})
    assert size == path.stat().st_size
    write_state(path, {"v": 2})
    assert read_state(path) == {"v": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["s.npz"]


# A child process writes a state bigger than the file-size limit it sets on itself: the
# kernel refuses the write part-way (EFBIG), a real failure in the middle of the file.
_TOO_BIG = """
import resource, signal, sys
import numpy as np
from flplatform.core.checkpoint import CheckpointError, write_state
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
try:
    write_state(sys.argv[1], {"w": np.ones(1_000_000)})
except CheckpointError as exc:
    print("refused:", exc.reason)
"""


def test_a_write_that_fails_midway_leaves_the_previous_file_intact(tmp_path: Path) -> None:
    path = tmp_path / "round-000003.npz"
    write_state(path, {"round": 3, "w": np.arange(10.0)})
    before = path.read_bytes()

    done = subprocess.run(
        [sys.executable, "-c", _TOO_BIG, str(path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )

    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused: cannot write checkpoint"), done.stdout
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left
    assert read_state(path)["round"] == 3


def test_an_unwritable_place_is_a_checkpoint_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(CheckpointError, match="cannot write checkpoint"):
        write_state(tmp_path / "file" / "s.npz", {"v": 1})


# ---------------------------------------------------------------------------- hostile files
def zip_with(path: Path, entries: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    return path


def written(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def torch_saved(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def plain_npz() -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, w=np.ones(2))
    return buffer.getvalue()


def npy(array: np.ndarray, *, allow_pickle: bool = False) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array, allow_pickle=allow_pickle)
    return buffer.getvalue()


def tree(state: Any) -> bytes:
    return json.dumps({"format": FORMAT, "state": state}).encode()


def good_file(tmp_path: Path) -> Path:
    path = tmp_path / "good.npz"
    write_state(path, {"w": np.arange(100.0), "n": 1})
    return path


class Marker:
    """Unpickling this would run code: a hostile file must never get that far."""

    def __reduce__(self) -> Any:
        return (os.system, ("touch /tmp/flplatform-pwned",))


HOSTILE: dict[str, Any] = {
    "not a zip": lambda p: written(p, b"hello"),
    "empty file": lambda p: written(p, b""),
    "pickle": lambda p: written(p, pickle.dumps({"w": Marker()})),
    "torch.save": lambda p: written(p, torch_saved({"w": torch.ones(2)})),
    "plain npz": lambda p: written(p, plain_npz()),
    "foreign zip": lambda p: zip_with(p, {"readme.txt": b"hi"}),
    "other format": lambda p: zip_with(
        p, {TREE_ENTRY: json.dumps({"format": "x/9", "state": {}}).encode()}
    ),
    "tree not json": lambda p: zip_with(p, {TREE_ENTRY: b"{not json"}),
    "tree not a dict": lambda p: zip_with(p, {TREE_ENTRY: b"[1, 2]"}),
    "state not a dict": lambda p: zip_with(p, {TREE_ENTRY: tree([1, 2])}),
    "pickled array": lambda p: zip_with(
        p,
        {
            TREE_ENTRY: tree({"w": {"__array__": "a0"}}),
            "a0.npy": npy(np.array([Marker()]), allow_pickle=True),
        },
    ),
    "dangling array": lambda p: zip_with(p, {TREE_ENTRY: tree({"w": {"__array__": "a9"}})}),
    "unknown marker": lambda p: zip_with(p, {TREE_ENTRY: tree({"w": {"__evil__": 1}})}),
    "stray entry": lambda p: zip_with(p, {TREE_ENTRY: tree({}), "../../etc/passwd": b"x"}),
    "bad npy": lambda p: zip_with(
        p, {TREE_ENTRY: tree({"w": {"__array__": "a0"}}), "a0.npy": b"\x93NUMPY garbage"}
    ),
    "tensor dtype lies": lambda p: zip_with(
        p,
        {
            TREE_ENTRY: tree({"t": {"__tensor__": "a0", "dtype": "float64"}}),
            "a0.npy": npy(np.ones(2, dtype=np.float32)),
        },
    ),
    "bytes not base64 text": lambda p: zip_with(p, {TREE_ENTRY: tree({"b": {"__bytes__": 5}})}),
    "record body not pairs": lambda p: zip_with(
        p, {TREE_ENTRY: tree({"m": {"__arrayrecord__": 5}})}
    ),
    "unhashable set item": lambda p: zip_with(p, {TREE_ENTRY: tree({"s": {"__set__": [[{}]]}})}),
    "unhashable dict key": lambda p: zip_with(
        p, {TREE_ENTRY: tree({"d": {"__dict__": [[{"a": 1}, 2]]}})}
    ),
    "config of a model": lambda p: zip_with(
        p, {TREE_ENTRY: tree({"c": {"__config__": {"x": {"y": 1}}}})}
    ),
    "deeply nested": lambda p: zip_with(
        p, {TREE_ENTRY: b'{"format": "%s", "state": {"x": ' % FORMAT.encode() + b"[" * 100_000}
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_file_is_refused_with_a_checkpoint_error(tmp_path: Path, name: str) -> None:
    path = HOSTILE[name](tmp_path / "hostile.npz")
    with pytest.raises(CheckpointError) as info:
        read_state(path)
    assert info.value.exit_code == 4
    assert not Path("/tmp/flplatform-pwned").exists()


@pytest.mark.parametrize("keep", [0, 10, 100, 1000])
def test_a_truncated_file_is_refused(tmp_path: Path, keep: int) -> None:
    data = good_file(tmp_path).read_bytes()
    cut = tmp_path / "cut.npz"
    cut.write_bytes(data[:keep])
    with pytest.raises(CheckpointError, match="cut.npz"):
        read_state(cut)


def test_a_missing_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        read_state(tmp_path / "gone.npz")


# ---------------------------------------------------------------------------- validation
def test_state_problems_collects_every_problem_before_raising() -> None:
    problems = StateProblems("LocalSGDAveraging")
    state = {"velocity": np.zeros(3, dtype=np.float32), "step": 1.5}
    assert problems.require(state, "velocity", "step", "momentum") is False
    assert problems.array(state["velocity"], "velocity", shape=(4,)) is False
    assert problems.number(state["step"], "step", integer=True) is False
    assert problems.number(True, "flag") is False
    assert problems.array(np.zeros(3), "v", dtype=np.float32) is False
    assert problems.array(np.zeros(3, np.float32), "v", shape=(3,), dtype="float32") is True
    with pytest.raises(CheckpointError) as info:
        problems.raise_if_any()
    assert info.value.reason == (
        "cannot restore LocalSGDAveraging from the checkpoint: 'momentum' is missing; "
        "'velocity' has shape (3,), this run needs (4,); 'step' must be a whole number, "
        "got 1.5; 'flag' must be a number, got True; 'v' has dtype float64, this run needs "
        "float32"
    )
    StateProblems("x").raise_if_any()  # nothing noted: nothing raised
