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

Measuring is cheap: one walk over the object tree, each object deflated at most once,
and an array's chunks (the bulk of a model) never copied: their object ids are those the
array cached when it was first hashed, and their deflated length is computed from their
header format (``chunk_bytes``). The same arithmetic in a simulation gives the same
counts, though Flower's simulation meters nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from flwr.app import Message, RecordDict
from flwr.app.message import remove_content_from_message
from flwr.app.message.arraychunk import ArrayChunk
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.common.serde import message_to_proto
from flwr.common.serde_utils import metadata_to_proto
from flwr.proto.fleet_pb2 import (
    PullMessagesRequest,
    PullMessagesResponse,
    PushMessagesRequest,
    PushMessagesResponse,
    Reconnect,
)
from flwr.proto.message_pb2 import Message as ProtoMessage
from flwr.proto.message_pb2 import ObjectTree
from flwr.proto.node_pb2 import Node
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict
from flwr.supercore.constant import HEAD_BODY_DIVIDER, HEAD_VALUE_DIVIDER
from flwr.supercore.inflatable.inflatable_object import (
    InflatableObject,
    no_object_id_recompute,
)

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
        under both).
    tree_nodes : int
        Nodes of that tree: a push acknowledgement names one object per node.
    """

    object_bytes: int
    node_bytes: int
    tree: ObjectTree
    tree_nodes: int


def measure(content: RecordDict) -> ContentSize:
    """Walk ``content``'s objects once: their deflated bytes and their object tree."""
    # Within the context an object's id is hashed once, not once per ancestor.
    with no_object_id_recompute():
        return _measured(content)


def _measured(content: RecordDict) -> ContentSize:
    lengths: dict[str, int] = {}  # object id → deflated length, each object once
    tree, nodes, node_bytes = _walk(content.object_id, content, lengths)
    return ContentSize(sum(lengths.values()), node_bytes, tree, nodes)


def _walk(
    object_id: str, obj: InflatableObject, lengths: dict[str, int]
) -> tuple[ObjectTree, int, int]:
    """The subtree of ``obj`` (whose id its parent knows), its nodes and their bytes.

    Children come from ``obj.children`` keyed by their ids, as ``get_object_tree`` builds
    them: an array's chunk ids are the ones it cached when it was first hashed.
    """
    subtrees = []
    nodes = 1
    if object_id not in lengths:
        lengths[object_id] = deflated_length(obj)
    node_bytes = lengths[object_id]
    for child_id, child in (obj.children or {}).items():
        subtree, count, size = _walk(child_id, child, lengths)
        subtrees.append(subtree)
        nodes += count
        node_bytes += size
    return ObjectTree(object_id=object_id, children=subtrees), nodes, node_bytes


def deflated_length(obj: InflatableObject) -> int:
    """``len(obj.deflate())``, without copying an array chunk's data to find it."""
    if isinstance(obj, ArrayChunk):
        return chunk_bytes(obj)
    return len(obj.deflate())


def chunk_bytes(chunk: ArrayChunk) -> int:
    """A chunk's deflated length: Flower's object header, then the data.

    The header is ``"<type> <child ids> <body length>"`` and a divider
    (``add_header_to_object_body``); a chunk has no children.
    """
    head = f"{type(chunk).__qualname__}{HEAD_VALUE_DIVIDER}{HEAD_VALUE_DIVIDER}{len(chunk.data)}"
    return len(head.encode("utf-8")) + len(HEAD_BODY_DIVIDER) + chunk.data.nbytes


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
    with no_object_id_recompute():  # the message's own object names its content's id
        if content is None:
            content = _measured(msg.content)
        own = len(msg.deflate())
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
    with no_object_id_recompute():
        content = _measured(reply.content) if reply.has_content() else None
        objects = len(reply.deflate()) + (content.object_bytes if content is not None else 0)
    sent = remove_content_from_message(reply)  # an error reply is sent as it is
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
