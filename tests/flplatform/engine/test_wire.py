"""Wire bytes equal what Flower's SuperLink counts on its Fleet API.

Three oracles: Flower's own Fleet handlers on a real SQL link state (the counting itself),
a naive reference that builds the same protobuf messages the slow way with Flower's own
functions (checked against random contents), and one case computed by hand.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest.mock import patch

import flwr.app.message.array as flower_array
import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MessageType,
    Metadata,
    MetricRecord,
    RecordDict,
)
from flwr.app.message import make_message
from flwr.app.message.arraychunk import ArrayChunk
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.supercore.inflatable import inflatable_object
from flwr.supercore.inflatable.inflatable_object import iterate_object_tree
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from flplatform.core.arrays import arrays_to_record, record_to_arrays
from flplatform.engine import wire
from flplatform.engine.wire import Traffic, delivery_bytes, measure, reply_traffic
from tests.helpers.fleet_oracle import (
    FleetLink,
    naive_delivery,
    naive_measure,
    naive_reply,
    serverapp_identity,
)

UINT64_MAX = 2**64 - 1


def model(seed: int, rows: int = 100) -> ArrayRecord:
    rng = np.random.default_rng(seed)
    return ArrayRecord(
        {
            "fc.weight": Array(rng.normal(size=(rows, 64)).astype(np.float32)),
            "fc.bias": Array(rng.normal(size=(64,)).astype(np.float32)),
        }
    )


# ============================================================ Flower's own counting
@pytest.fixture
def link(tmp_path: Path) -> Iterator[FleetLink]:
    fleet = FleetLink(tmp_path / "link.db")
    with serverapp_identity(fleet.run_id, SUPERLINK_NODE_ID, fleet.task_id):
        yield fleet


def exchange(link: FleetLink, msg: Message, **answer: object) -> None:
    """One message and its reply through the Fleet API; wire bytes == Flower's count."""
    before = link.traffic()
    expected_down = delivery_bytes(msg)
    link.push_from_server(msg)
    received = link.pull_by_node()
    delivered = link.traffic()
    assert delivered.down - before.down == expected_down
    reply = link.push_by_node(_reply(received, **answer))
    counted = link.traffic()
    assert reply_traffic(reply) == Traffic(counted.up - before.up, counted.down - delivered.down)


def _reply(received: Message, *, content: object = None, error: object = False) -> Message:
    if error:
        return Message(Error(code=3, reason="the ClientApp raised"), reply_to=received)
    assert isinstance(content, RecordDict)
    return Message(content, reply_to=received)


def test_a_training_exchange_counts_as_flower_counts(link: FleetLink) -> None:
    content = RecordDict({"arrays": model(0), "config": ConfigRecord({"lr": 0.1, "k": 3})})
    msg = Message(content, dst_node_id=link.node_id, message_type=MessageType.TRAIN, group_id="4")
    reply = RecordDict({"arrays": model(1), "metrics": MetricRecord({"num-examples": 10})})
    exchange(link, msg, content=reply)


def test_a_query_and_an_error_reply_count_as_flower_counts(link: FleetLink) -> None:
    msg = Message(
        RecordDict({"config": ConfigRecord()}), dst_node_id=link.node_id, message_type="query"
    )
    exchange(link, msg, error=True)


def test_identical_arrays_and_chunks_count_as_flower_counts(link: FleetLink) -> None:
    zeros = np.zeros(10_000, np.float32)
    arrays = {
        "a": Array(zeros),
        "b": Array(zeros.copy()),  # the same array: one child of the record, sent once
        # 1.4 M float32 = 5.6 MB: two chunks (Flower chunks arrays at 5 MiB), the second
        # all zeros in both arrays: one object under two arrays, pulled twice
        "big": Array(np.zeros(1_400_000, np.float32)),
        "big2": Array(np.zeros((700_000, 2), np.float32)),
    }
    content = RecordDict({"arrays": ArrayRecord(arrays)})
    msg = Message(content, dst_node_id=link.node_id, message_type=MessageType.TRAIN)
    reply = RecordDict(
        {
            "arrays": ArrayRecord(
                {"a": Array(np.ones(10, np.int8)), "b": Array(np.ones(10, np.int8))}
            )
        }
    )
    exchange(link, msg, content=reply)


def test_records_of_every_kind_count_as_flower_counts(link: FleetLink) -> None:
    """Unicode names, empty records, metrics, one record under two names, and two array
    records with the same names but different arrays, in chunks of 64 bytes."""
    zeros = np.zeros(100, np.float32)
    shared = ConfigRecord({"clé": "välue", "bytes": b"\x00\xff", "flag": True})
    content = RecordDict(
        {
            "modèle": ArrayRecord({"poids": Array(zeros), "биас": Array(np.ones(3, np.int64))}),
            "другая": ArrayRecord({"poids": Array(np.arange(100, dtype=np.float32))}),
            "vide": ArrayRecord(),
            "config": shared,
            "config ": shared,
            "": ConfigRecord(),
            "metrics": MetricRecord({"ü": 1.5, "n": 2**62, "series": [1, 2, 3]}),
        }
    )
    msg = Message(content, dst_node_id=link.node_id, message_type=MessageType.TRAIN)
    # No chunk the message has (the SuperLink would hold it already, see wire.py): another
    # dtype and shapes, so that the .npy headers differ too. The two arrays share every
    # chunk after their headers.
    twos = np.full(98, 2.0, np.float64)
    arrays = ArrayRecord({"w": Array(twos), "w2": Array(twos.reshape(7, 14))})
    reply = RecordDict({"arrays": arrays, "m": MetricRecord()})
    with chunked(64):
        exchange(link, msg, content=reply)


def test_a_reply_the_superlink_made_crossed_no_wire() -> None:
    expired = make_message(
        metadata=Metadata(
            run_id=7,
            message_id="e" * 64,
            src_node_id=SUPERLINK_NODE_ID,
            dst_node_id=SUPERLINK_NODE_ID,
            reply_to_message_id="f" * 64,
            group_id="1",
            created_at=1.0,
            ttl=0.0,
            message_type=MessageType.TRAIN,
        ),
        error=Error(code=ErrorCode.REPLY_MESSAGE_UNAVAILABLE, reason="message expired"),
    )
    assert reply_traffic(expired) == Traffic()
    # A site's own error comes over the wire, whatever its node id.
    failed = make_message(metadata=expired.metadata, error=Error(code=2, reason="raised"))
    assert reply_traffic(failed).up > 0


# ============================================================ a naive reference
DTYPES = st.sampled_from([np.float32, np.float16, np.float64, np.int8, np.int64, np.bool_])


NAMES = st.text(max_size=8)  # record and array names: any unicode, empty included
NUMBERS = st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False)
# Flower slices arrays into chunks of 5 MiB; tiny chunks make repeated and near-equal
# chunks (zeros, one changed element) common in small arrays.
CHUNK_SIZES = st.sampled_from([16, 40, 128, flower_array.FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE])


@contextmanager
def chunked(size: int) -> Iterator[None]:
    """Flower (and the meter) slice arrays into chunks of ``size`` bytes for a while."""
    with patch.object(flower_array, "FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE", size):
        yield


@st.composite
def array_values(draw: st.DrawFn, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Random arrays, or zeros with at most one element changed (their chunks are equal,
    or agree everywhere but in one place)."""
    if draw(st.booleans()):
        return draw(hnp.arrays(dtype, shape, elements=hnp.from_dtype(dtype)))
    values = np.zeros(shape, dtype)
    if values.size and draw(st.booleans()):
        values.reshape(-1)[draw(st.integers(0, values.size - 1))] = 1
    return values


@st.composite
def contents(draw: st.DrawFn) -> RecordDict:
    """Random records of every kind, empty ones included, under any names; arrays and
    records repeated (identical objects travel once)."""
    records: dict[str, ArrayRecord | ConfigRecord | MetricRecord] = {}
    for _ in range(draw(st.integers(0, 5))):
        kind = draw(st.sampled_from(["arrays", "arrays", "config", "metrics", "again"]))
        if kind == "arrays":
            # one layout for the whole record: arrays that differ only in their data
            dtype = np.dtype(draw(DTYPES))
            shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=12))
            names = draw(st.lists(NAMES, max_size=4, unique=True))
            # the names of a record met before: records that differ only in their arrays
            array_records = [r for r in records.values() if isinstance(r, ArrayRecord)]
            if array_records and draw(st.booleans()):
                names = list(draw(st.sampled_from(array_records)))
            arrays = {}
            for name in names:
                values = draw(array_values(dtype, shape))
                arrays[name] = Array(values)
                if draw(st.booleans()):
                    arrays[name + ".copy"] = Array(values.copy())
            record: ArrayRecord | ConfigRecord | MetricRecord = ArrayRecord(arrays)
        elif kind == "config":
            values = NUMBERS | st.booleans() | st.text(max_size=30) | st.binary(max_size=30)
            record = ConfigRecord(draw(st.dictionaries(NAMES, values, max_size=4)))
        elif kind == "metrics":
            record = MetricRecord(draw(st.dictionaries(NAMES, NUMBERS, max_size=4)))
        elif records:  # the same record under a second name: one object, listed twice
            record = records[draw(st.sampled_from(sorted(records)))]
        else:
            continue
        records[draw(NAMES)] = record
    return RecordDict(records)


@settings(max_examples=150, deadline=None)
@given(content=contents(), chunk_size=CHUNK_SIZES)
def test_measure_equals_flowers_own_walk(content: RecordDict, chunk_size: int) -> None:
    with chunked(chunk_size):
        measured, reference = measure(content), naive_measure(content)
    assert measured.object_bytes == reference.object_bytes
    assert measured.node_bytes == reference.node_bytes
    assert measured.tree_nodes == reference.tree_nodes
    # the same shape of tree, ids aside (stand-ins of their length)
    assert measured.tree.ByteSize() == reference.tree.ByteSize()
    assert [len(t.children) for t in iterate_object_tree(measured.tree)] == [
        len(t.children) for t in iterate_object_tree(reference.tree)
    ]


@settings(max_examples=60, deadline=None)
@given(
    content=contents(),
    answer=contents(),
    chunk_size=CHUNK_SIZES,
    node_id=st.integers(2, UINT64_MAX),
    run_id=st.integers(0, UINT64_MAX),
    group_id=st.text(max_size=8),
    kind=st.sampled_from([MessageType.TRAIN, MessageType.EVALUATE, MessageType.QUERY]),
)
def test_wire_bytes_equal_the_naive_reference(
    content: RecordDict,
    answer: RecordDict,
    chunk_size: int,
    node_id: int,
    run_id: int,
    group_id: str,
    kind: str,
) -> None:
    with serverapp_identity(run_id, SUPERLINK_NODE_ID, task_id=run_id // 3), chunked(chunk_size):
        msg = Message(content, dst_node_id=node_id, message_type=kind, group_id=group_id)
        # measured once for a broadcast, or per message: the same
        assert delivery_bytes(msg) == delivery_bytes(msg, measure(content)) == naive_delivery(msg)
        msg.metadata.__dict__["_message_id"] = msg.object_id  # as pulled from the SuperLink
        reply = Message(answer, reply_to=msg)
        assert reply_traffic(reply) == naive_reply(reply)
        failed = Message(Error(code=0, reason=group_id), reply_to=msg)
        assert reply_traffic(failed) == naive_reply(failed)


def test_chunks_that_agree_on_every_sampled_byte_are_still_told_apart() -> None:
    """Chunks of one length that differ only between the sampled windows are distinct
    objects; equal ones (in other buffers) are one."""
    size = 1 << 16
    base = np.zeros(size, np.uint8)
    changed = base.copy()
    changed[size // 2 + 3000] = 1  # between two of the 16 windows
    content = RecordDict(
        {"arrays": ArrayRecord({"a": Array(base), "b": Array(changed), "c": Array(base.copy())})}
    )
    with chunked(4096):  # 16 chunks per array: 15 all zeros, and one of b's is not
        measured, reference = measure(content), naive_measure(content)
        # were every digest the same, the chunks would still be told apart by their bytes
        with patch.object(wire, "digest", lambda data: b"collision"):
            colliding = measure(content)
    for size in (measured, colliding):
        assert (size.object_bytes, size.node_bytes, size.tree_nodes) == (
            reference.object_bytes,
            reference.node_bytes,
            reference.tree_nodes,
        )
    assert measured.object_bytes < measured.node_bytes  # shared objects were found


# ============================================================ by hand
def test_golden_error_reply_computed_by_hand() -> None:
    reply = make_message(
        metadata=Metadata(
            run_id=7,
            message_id="a" * 64,
            src_node_id=5,
            dst_node_id=SUPERLINK_NODE_ID,
            reply_to_message_id="b" * 64,
            group_id="",
            created_at=1.0,
            ttl=10.0,
            message_type=MessageType.QUERY,
        ),
        error=Error(code=3, reason="boom"),
    )
    # Metadata: run_id 2 + message_id 66 + src 2 + dst 2 + reply_to 66 + ttl 9
    # + message_type "query" 7 + created_at 9 = 163; Error: code 2 + reason "boom" 6 = 8.
    message = (1 + 2 + 163) + (1 + 1 + 8)  # 176: metadata needs a 2-byte length
    # The message's object: "Message  109\0" (13 bytes), then the same proto without its
    # message id (metadata 163 - 66 = 97, so 1 + 1 + 97 + 10 = 109 bytes).
    own_object = 13 + 109
    tree = 1 + 1 + 64  # its object tree: the message's id alone
    push = (1 + 1 + 2) + (1 + 2 + message) + (1 + 1 + tree) + (1 + 1 + 8)  # node, ..., runtime
    pull = 1 + 1 + 2  # PullMessagesRequest(node=Node(node_id=5))
    # Reconnect(5) 4 + results {id: 0} 70 + one object to push 66 + session id 38.
    acknowledgement = (1 + 1 + 2) + (1 + 1 + (66 + 2)) + (1 + 1 + 64) + (1 + 1 + 36)
    assert reply_traffic(reply) == Traffic(up=pull + push + own_object, down=acknowledgement)
    assert reply_traffic(reply) == Traffic(up=387, down=178)


# ============================================================ cost
def test_measuring_hashes_and_copies_no_array_data(
    task_identity: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sizes follow from lengths: no array chunk is deflated (copied) or hashed, and
    distinct chunks are not even digested. What is hashed at all is a few small objects
    (an empty record's id)."""
    hashed: list[int] = []
    deflated: list[ArrayChunk] = []
    digested: list[int] = []
    get_object_id, deflate, digest = (
        inflatable_object.get_object_id,
        ArrayChunk.deflate,
        wire.digest,
    )
    monkeypatch.setattr(
        inflatable_object, "get_object_id", lambda c: hashed.append(len(c)) or get_object_id(c)
    )
    monkeypatch.setattr(ArrayChunk, "deflate", lambda c: deflated.append(c) or deflate(c))
    monkeypatch.setattr(wire, "digest", lambda d: digested.append(len(d)) or digest(d))
    content = RecordDict({"arrays": model(3, rows=4000)})  # 1 MB, one chunk per array
    first = measure(content)
    for node_id in (9, 10, 11):
        msg = Message(content, dst_node_id=node_id, message_type=MessageType.TRAIN)
        assert delivery_bytes(msg) == delivery_bytes(msg, first) > 4000 * 64 * 4
    reply_traffic(Message(RecordDict({"arrays": model(4, rows=4000)}), reply_to=msg))
    assert deflated == [] and digested == []
    assert max(hashed, default=0) < 1000


def test_record_round_trip_keeps_names_order_dtypes() -> None:
    arrays = {"z": np.arange(3, dtype=np.int64), "a": np.ones((2, 2), np.float16)}
    back = record_to_arrays(arrays_to_record(arrays))
    assert list(back) == ["z", "a"]
    for key in arrays:
        assert back[key].dtype == arrays[key].dtype
        np.testing.assert_array_equal(back[key], arrays[key])
