"""Wire bytes equal what Flower's SuperLink counts on its Fleet API.

Three oracles: Flower's own Fleet handlers on a real SQL link state (the counting itself),
a naive reference that builds the same protobuf messages the slow way with Flower's own
functions (checked against random contents), and one case computed by hand.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

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
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from flplatform.arrays import arrays_to_record, record_to_arrays
from flplatform.engine.wire import Traffic, delivery_bytes, measure, reply_traffic

from .fleet_oracle import FleetLink, naive_delivery, naive_reply, serverapp_identity

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


@st.composite
def contents(draw: st.DrawFn) -> RecordDict:
    """Random arrays (shapes, dtypes, repeats: identical arrays travel once) and configs."""
    arrays = {}
    for index in range(draw(st.integers(0, 4))):
        dtype = draw(DTYPES)
        shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40))
        values = draw(hnp.arrays(dtype, shape, elements=hnp.from_dtype(np.dtype(dtype))))
        arrays[f"layer{index}"] = Array(values)
        if draw(st.booleans()):
            arrays[f"layer{index}.copy"] = Array(values.copy())
    config = draw(
        st.dictionaries(
            st.text(min_size=1, max_size=12),
            st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=30),
            max_size=4,
        )
    )
    records: dict[str, ArrayRecord | ConfigRecord] = {"config": ConfigRecord(config)}
    if arrays:
        records["arrays"] = ArrayRecord(arrays)
    return RecordDict(records)


@settings(max_examples=60, deadline=None)
@given(
    content=contents(),
    answer=contents(),
    node_id=st.integers(2, UINT64_MAX),
    run_id=st.integers(0, UINT64_MAX),
    group_id=st.text(max_size=8),
    kind=st.sampled_from([MessageType.TRAIN, MessageType.EVALUATE, MessageType.QUERY]),
)
def test_wire_bytes_equal_the_naive_reference(
    content: RecordDict,
    answer: RecordDict,
    node_id: int,
    run_id: int,
    group_id: str,
    kind: str,
) -> None:
    with serverapp_identity(run_id, SUPERLINK_NODE_ID, task_id=run_id // 3):
        msg = Message(content, dst_node_id=node_id, message_type=kind, group_id=group_id)
        # measured once for a broadcast, or per message: the same
        assert delivery_bytes(msg) == delivery_bytes(msg, measure(content)) == naive_delivery(msg)
        msg.metadata.__dict__["_message_id"] = msg.object_id  # as pulled from the SuperLink
        reply = Message(answer, reply_to=msg)
        assert reply_traffic(reply) == naive_reply(reply)
        failed = Message(Error(code=0, reason=group_id), reply_to=msg)
        assert reply_traffic(failed) == naive_reply(failed)


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
def test_an_array_s_chunks_are_copied_once_however_often_it_is_measured(
    task_identity: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk is deflated (copied) once, to hash it for its id, when its array is first
    measured; its length is computed after that. A broadcast or a model measured again
    (a reply judged, its fingerprint taken) costs no more copies or hashes."""
    deflated: list[ArrayChunk] = []
    deflate = ArrayChunk.deflate

    def counted(chunk: ArrayChunk) -> bytes:
        deflated.append(chunk)
        return deflate(chunk)

    monkeypatch.setattr(ArrayChunk, "deflate", counted)
    content = RecordDict({"arrays": model(3, rows=4000)})  # 1 MB, one chunk per array
    first = measure(content)
    assert len(deflated) == 2
    for node_id in (9, 10, 11):
        msg = Message(content, dst_node_id=node_id, message_type=MessageType.TRAIN)
        assert delivery_bytes(msg) == delivery_bytes(msg, first) > 4000 * 64 * 4
    reply = Message(RecordDict({"arrays": content["arrays"]}), reply_to=msg)
    reply_traffic(reply)
    assert len(deflated) == 2


def test_record_round_trip_keeps_names_order_dtypes() -> None:
    arrays = {"z": np.arange(3, dtype=np.int64), "a": np.ones((2, 2), np.float16)}
    back = record_to_arrays(arrays_to_record(arrays))
    assert list(back) == ["z", "a"]
    for key in arrays:
        assert back[key].dtype == arrays[key].dtype
        np.testing.assert_array_equal(back[key], arrays[key])
