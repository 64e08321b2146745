"""What a message costs on the wire, counted the way Flower's SuperLink counts it.

A SuperLink meters only its Fleet API, the SuperNodes' side
(``flwr/superlink/servicer/fleet/fleet_handlers.py``), and reports each run's total as
``flwr ls --run-id N``: ``bytes_sent`` to nodes (down), ``bytes_recv`` from nodes (up).
Content travels as content-addressed objects (Message → RecordDict → records → Array →
ArrayChunk), each pushed or pulled once per message, apart from the protocol messages
that carry the metadata and the object tree:

* delivering a message (``delivery_bytes``), server → site: the ``PullMessagesResponse``
  that hands it out (the message without content, as the SuperLink stored it, and its
  object tree) and its objects, deflated, each pulled once per node of the tree (a
  chunk two arrays share is pulled twice);
* a reply (``reply_traffic``), site → server: the ``PullMessagesRequest`` that fetched the
  message it answers, the ``PushMessagesRequest`` carrying the reply without content, its
  object tree and the ClientApp's runtime, and each distinct object pushed; server → site:
  the ``PushMessagesResponse`` naming every object to push (one id per tree node) with a
  push session id.

The protocol messages are built here from the same protobuf classes, so their sizes are
Flower's own; only values that may not be known when a message is measured are stand-ins
of the same encoded length: its id (always a SHA-256 hex digest, the id of its object),
the push session's id (a UUID) and the ClientApp's runtime (a double). What is
approximate, and why (each at most a few bytes per message, or rare):

* A SuperLink with its state in memory (no ``--database``) hands a message out with the
  ServerApp's task id in its metadata (up to 11 bytes more per message); one with a
  database, as every deployment has, drops it, and so does this count.
* A reply's objects that the SuperLink already holds (the same array in two messages in
  flight at once, say a site sending back the model it was sent) are neither pushed nor
  counted by Flower; here they are.
* Requests Flower retried after a network error are counted once here, and again by
  Flower when the SuperLink processed them.
* A reply the SuperLink made itself (the message expired, its node went away) crossed no
  Fleet API and costs nothing; the message it answers is still counted as delivered, as
  is any message whose reply never came (and the few bytes of the request that fetched
  such a message are not: they are counted with a reply).
* Replies that reach the SuperLink after the ServerApp stopped pulling (the run ended
  with work still out) are in Flower's count and not in the ledger.

Measuring costs next to nothing beside the data it measures: no object is hashed and no
array data is copied. An object's deflated length follows from Flower's layout of it
(a header naming its children by id, every id 64 hex digits, then its body), so what
matters of the ids is only which objects are equal; records and arrays are compared by
what they are made of, array chunks by their bytes, sampled, then digested and compared
where they may be equal (``_Objects``). The same arithmetic in a simulation gives the
same counts, though Flower's simulation meters nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from flplatform.core.flower_internals import (
    HEAD_BODY_DIVIDER,
    HEAD_VALUE_DIVIDER,
    SUPERLINK_NODE_ID,
    ArrayChunk,
    ErrorCode,
    Node,
    ObjectTree,
    ProtoMessage,
    ProtoRecordDict,
    PullMessagesRequest,
    PullMessagesResponse,
    PushMessagesRequest,
    PushMessagesResponse,
    Reconnect,
    max_array_chunk_size,
    message_to_proto,
    metadata_to_proto,
    remove_content_from_message,
)
from flplatform.engine.digest import digest

# Stand-ins of the encoded length of values set after a message is measured.
_OBJECT_ID = "0" * 64  # a SHA-256 hex digest: message ids and object ids
_SESSION_ID = "0" * 36  # str(uuid4()), the SuperLink's object-push session
_RUNTIME = 0.0  # the ClientApp's runtime in seconds: a double, any value the same size
# What every PushMessagesResponse of flwr 1.41 carries (fleet_handlers.push_messages).
_RECONNECT = Reconnect(reconnect=5)
# The errors of the replies the SuperLink makes for messages that got none.
_UNAVAILABLE = frozenset(
    {ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE, ErrorCode.NODE_UNAVAILABLE}
)


@dataclass(frozen=True)
class Traffic:
    """Bytes on Flower's Fleet API, each way, as the SuperLink counts them.

    ``up`` is site → server (Flower's ``bytes_recv``), ``down`` server → site
    (``bytes_sent``).
    """

    up: int = 0
    down: int = 0


@dataclass(frozen=True)
class ContentSize:
    """A message content's share of its wire size, from one walk over its objects.

    Measure a content once and pass it to ``delivery_bytes`` for every message of a
    broadcast that shares it.

    Attributes
    ----------
    object_bytes : int
        Deflated bytes of its distinct objects: what a push sends.
    node_bytes : int
        Deflated bytes of the object at every node of its tree: what a pull fetches (an
        object under two parents, a chunk two arrays share, twice; identical arrays of one
        record are one child, once).
    tree : ObjectTree
        Its object tree as the Fleet API sends it (an object under two parents appears
        under both), each id stood in for by a string of its length.
    tree_nodes : int
        Nodes of that tree: a push acknowledgement names one object per node.
    """

    object_bytes: int
    node_bytes: int
    tree: ObjectTree
    tree_nodes: int


def measure(content: RecordDict) -> ContentSize:
    """``content``'s objects, by one walk over them: their deflated bytes and object tree.

    Hashes nothing and copies no array data (see ``_Objects``).
    """
    objects = _Objects()
    tree, nodes, node_bytes = _tree(objects.record_dict(content))
    return ContentSize(sum(objects.sizes.values()), node_bytes, tree, nodes)


@dataclass
class _Node:
    """One object: ``key`` is equal exactly where Flower's ids are (where the deflated
    bytes are), ``size`` is its deflated length, ``children`` its distinct children in the
    order Flower lists them (first occurrence)."""

    key: Hashable
    size: int
    children: list[_Node] = field(default_factory=list)


def _tree(node: _Node) -> tuple[ObjectTree, int, int]:
    """``node``'s object tree as the Fleet API sends it, ids stood in for by strings of
    their length; its nodes; and the bytes of the object at each node."""
    subtrees = []
    nodes, node_bytes = 1, node.size
    for child in node.children:
        subtree, count, size = _tree(child)
        subtrees.append(subtree)
        nodes += count
        node_bytes += size
    return ObjectTree(object_id=_OBJECT_ID, children=subtrees), nodes, node_bytes


class _Objects:
    """The distinct objects of one content and their deflated lengths, as Flower deflates
    them (``flwr/app/message/*.py``, ``add_header_to_object_body``), without their ids.

    Ids enter an object's bytes only in its header, which lists its distinct children's
    ids (64 hex digits each), and in a container's JSON body: lengths follow from how many
    children are distinct, and which. So each object is keyed by what its bytes are made
    of (its children by their keys): records and arrays by their names, metadata and
    children; a ConfigRecord or MetricRecord by its own bytes (Flower deflates those, they
    are small); an array chunk by its data, numbered by ``_ChunkClasses``.
    """

    def __init__(self) -> None:
        self.sizes: dict[Hashable, int] = {}  # key → deflated length: each distinct object once
        self._chunks = _ChunkClasses()
        self._arrays: dict[int, _Node] = {}  # id() → node: an Array met twice is read once

    def _add(self, node: _Node) -> _Node:
        self.sizes.setdefault(node.key, node.size)
        return node

    def record_dict(self, content: RecordDict) -> _Node:
        """A RecordDict (Flower allows only the three record types in one)."""
        return self._container(
            content,
            {
                name: self._array_record(r) if isinstance(r, ArrayRecord) else self._leaf(r)
                for name, r in content.items()
            },
        )

    def _array_record(self, record: ArrayRecord) -> _Node:
        arrays = {}
        for name, array in record.items():
            if id(array) not in self._arrays:
                self._arrays[id(array)] = self._array(array)
            arrays[name] = self._arrays[id(array)]
        return self._container(record, arrays)

    def _container(self, obj: RecordDict | ArrayRecord, named: dict[str, _Node]) -> _Node:
        """A RecordDict or ArrayRecord: its body is the JSON of {name: child id} (ASCII:
        ``json.dumps`` escapes the rest)."""
        children: dict[Hashable, _Node] = {}
        for node in named.values():
            children.setdefault(node.key, node)
        body = len(json.dumps(dict.fromkeys(named, _OBJECT_ID)))
        key = (type(obj).__qualname__, tuple((name, node.key) for name, node in named.items()))
        size = _head_bytes(type(obj).__qualname__, len(children), body) + body
        return self._add(_Node(key, size, list(children.values())))

    def _array(self, array: Array) -> _Node:
        """An Array: its distinct chunks are its children; its body is the JSON of its
        dtype, shape, stype and, for each slice of its data, which of those it is."""
        data = memoryview(array.data)
        step = max_array_chunk_size()
        children: dict[Hashable, _Node] = {}  # distinct chunks, in the order met
        place: dict[Hashable, int] = {}  # a chunk's place among them
        indices = []  # each slice's chunk, by its place
        for start in range(0, len(data), step):
            chunk = self._chunk(data[start : start + step])
            children.setdefault(chunk.key, chunk)
            indices.append(place.setdefault(chunk.key, len(place)))
        metadata = {"dtype": array.dtype, "shape": array.shape, "stype": array.stype}
        body = json.dumps({**metadata, "arraychunk_ids": indices})
        key = (type(array).__qualname__, body, tuple(children))
        size = _head_bytes(type(array).__qualname__, len(children), len(body)) + len(body)
        return self._add(_Node(key, size, list(children.values())))

    def _chunk(self, data: memoryview) -> _Node:
        size = _head_bytes(ArrayChunk.__qualname__, 0, len(data)) + len(data)
        return self._add(_Node((ArrayChunk.__qualname__, self._chunks.number(data)), size))

    def _leaf(self, record: ConfigRecord | MetricRecord) -> _Node:
        deflated = record.deflate()
        return self._add(_Node(deflated, len(deflated)))


def _head_bytes(type_name: str, children: int, body: int) -> int:
    """Length of Flower's object header ``"<type> <child ids> <body length>"`` and the
    divider after it (``add_header_to_object_body``), for ``children`` distinct children
    (ids joined by commas) and a body of ``body`` bytes."""
    ids = children * (len(_OBJECT_ID) + 1) - 1 if children else 0
    head = len(type_name.encode("utf-8")) + 2 * len(HEAD_VALUE_DIVIDER)
    return head + ids + len(str(body)) + len(HEAD_BODY_DIVIDER)


class _ChunkClasses:
    """Numbers for array chunks, equal exactly when their data are (when Flower gives them
    one id), found without hashing every chunk.

    Chunks are told apart by their length and a sample of their bytes first; only chunks
    that agree on those are digested (``digest``), and equal digests are confirmed byte
    for byte. A model's distinct chunks seldom share a sample, so they cost a few small
    slices each; equal ones (all zeros, say) cost a digest and a comparison. Chunks made
    to share a digest (it is linear: someone can build a collision) are told apart by
    SHA-256, once each: a hostile reply costs a hash per chunk, never a comparison per
    pair of chunks.
    """

    SAMPLES = 16  # 8-byte windows, spread over the chunk

    def __init__(self) -> None:
        self._met: dict[tuple[int, bytes], _Bucket] = {}  # (length, sample) → its chunks
        self._count = 0

    def number(self, data: memoryview) -> int:
        """The number of ``data``: that of an equal chunk met before, else a new one."""
        stride = max((len(data) - 8) // (self.SAMPLES - 1), 1)
        sample = b"".join(data[i : i + 8] for i in range(0, max(len(data) - 7, 1), stride))
        bucket = self._met.get((len(data), sample))
        if bucket is None:  # the usual case: the first chunk of its length and sample
            self._count += 1
            self._met[(len(data), sample)] = _Bucket(first=_Chunk(self._count, data))
            return self._count
        if bucket.first is not None:  # a second chunk alike: digest the first one now
            bucket.add(bucket.first)
            bucket.first = None
        chunk = _Chunk(0, data)
        found = bucket.find(chunk)
        if found is not None:
            return found
        self._count += 1
        chunk.number = self._count
        bucket.add(chunk)
        return self._count


@dataclass
class _Chunk:
    number: int
    data: memoryview
    weak: bytes | None = None  # its digest, once another chunk shares its sample
    strong: bytes | None = None  # its SHA-256, once another chunk shares its digest

    def digest(self) -> bytes:
        if self.weak is None:
            self.weak = digest(self.data)
        return self.weak

    def sha256(self) -> bytes:
        if self.strong is None:
            self.strong = hashlib.sha256(self.data).digest()
        return self.strong


@dataclass
class _Bucket:
    """The chunks of one length and sample: the first alone (not digested until another
    comes), then by digest."""

    first: _Chunk | None = None
    by_digest: dict[bytes, list[_Chunk]] = field(default_factory=dict)

    def add(self, chunk: _Chunk) -> None:
        self.by_digest.setdefault(chunk.digest(), []).append(chunk)

    def find(self, chunk: _Chunk) -> int | None:
        """The number of a chunk equal to ``chunk``, if one was met; None otherwise."""
        candidates = self.by_digest.get(chunk.digest(), [])
        if len(candidates) == 1 and _same_bytes(candidates[0].data, chunk.data):
            return candidates[0].number
        if not candidates:
            return None
        # A digest shared by different bytes (built to collide): SHA-256 decides.
        wanted = chunk.sha256()
        return next((c.number for c in candidates if c.sha256() == wanted), None)


def _same_bytes(a: memoryview, b: memoryview) -> bool:
    """Byte-for-byte equality (``a == b`` on memoryviews compares element by element in
    Python's slow way)."""
    return len(a) == len(b) and bool(
        np.array_equal(np.frombuffer(a, dtype=np.uint8), np.frombuffer(b, dtype=np.uint8))
    )


def own_bytes(msg: Message, without_content: Message | None = None) -> int:
    """``len(msg.deflate())``, the message's own object, without hashing its content.

    The object is its metadata and error, headed by its content's id: the same length as
    the message with an empty content (``remove_content_from_message``) has.
    """
    sent = remove_content_from_message(msg) if without_content is None else without_content
    return len(sent.deflate())


def made_by_superlink(reply: Message) -> bool:
    """Whether ``reply`` is Flower's own stand-in for a reply that never came: an error
    "from" the SuperLink's node saying the message, its reply or its node is unavailable
    (expired, or gone; ``flwr/server/superlink/linkstate/utils.py``)."""
    return (
        reply.metadata.src_node_id == SUPERLINK_NODE_ID
        and reply.has_error()
        and reply.error.code in _UNAVAILABLE
    )


def delivery_bytes(msg: Message, content: ContentSize | None = None) -> int:
    """Bytes server → site when a SuperNode pulls ``msg`` (an instruction the ServerApp
    pushed): the ``PullMessagesResponse`` and the message's objects, as pulled.

    ``content``: ``measure(msg.content)``, when a broadcast shares it.
    """
    if content is None:
        content = measure(msg.content)
    own = own_bytes(msg)
    metadata = metadata_to_proto(msg.metadata)
    # A SuperLink with a database stores no task ids; it sets the id when it is pushed.
    metadata.ClearField("src_task_id")
    metadata.ClearField("dst_task_id")
    metadata.message_id = _OBJECT_ID  # the SuperLink sets it to the object id on push
    stored = ProtoMessage(metadata=metadata, content=ProtoRecordDict())
    tree = ObjectTree(object_id=_OBJECT_ID, children=[content.tree])
    response = PullMessagesResponse(messages_list=[stored], message_object_trees=[tree])
    return response.ByteSize() + own + content.node_bytes


def reply_traffic(reply: Message) -> Traffic:
    """Bytes a site's ``reply`` costs each way (see the module's docstring).

    A reply the SuperLink (or the ServerApp's grid) made itself never crossed the Fleet
    API: ``Traffic()``.
    """
    if made_by_superlink(reply):
        return Traffic()
    node_id = reply.metadata.src_node_id
    content = measure(reply.content) if reply.has_content() else None
    sent = remove_content_from_message(reply)  # an error reply is sent as it is
    objects = own_bytes(reply, sent) + (content.object_bytes if content is not None else 0)
    proto = message_to_proto(sent)
    message_id = proto.metadata.message_id = _OBJECT_ID  # the SuperNode sets it on push
    subtrees = [content.tree] if content is not None else []
    tree_nodes = 1 + (content.tree_nodes if content is not None else 0)
    node = Node(node_id=node_id)
    push = PushMessagesRequest(
        node=node,
        messages_list=[proto],
        message_object_trees=[ObjectTree(object_id=message_id, children=subtrees)],
        clientapp_runtime_list=[_RUNTIME],
    )
    acknowledgement = PushMessagesResponse(
        reconnect=_RECONNECT,
        results={message_id: 0},
        objects_to_push=[_OBJECT_ID] * tree_nodes,
        session_id=_SESSION_ID,
    )
    pull = PullMessagesRequest(node=node)
    return Traffic(up=pull.ByteSize() + push.ByteSize() + objects, down=acknowledgement.ByteSize())
