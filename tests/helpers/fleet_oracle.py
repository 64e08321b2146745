"""Flower's own traffic counting, run in-process, and a naive rebuild of what it counts.

``FleetLink`` drives Flower's Fleet API handlers on a real SQL link state the way a
SuperNode does; ``naive_measure``, ``naive_delivery`` and ``naive_reply`` build the objects
and protobuf messages those handlers measure the slow way, with Flower's own functions
(every object hashed and deflated). Both are oracles for ``flplatform.engine.wire``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flwr.app import Message, RecordDict
from flwr.app.message import remove_content_from_message
from flwr.common.constant import NOOP_ACCOUNT_NAME, NOOP_FLWR_AID
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.proto.fleet_pb2 import (
    PullMessagesRequest,
    PullMessagesResponse,
    PushMessagesRequest,
    PushMessagesResponse,
    Reconnect,
)
from flwr.proto.message_pb2 import PullObjectRequest, PushObjectRequest
from flwr.proto.node_pb2 import Node
from flwr.server.superlink.linkstate import LinkState, LinkStateFactory
from flwr.server.superlink.linkstate.utils import dict_to_message, message_to_dict
from flwr.supercore.constant import NOOP_FEDERATION_ID, TaskType
from flwr.supercore.inflatable.inflatable_object import (
    get_all_nested_objects,
    get_object_tree,
    iterate_object_tree,
    no_object_id_recompute,
)
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.object_store.in_memory_object_store import InMemoryObjectStore
from flwr.supercore.primitives.asymmetric import generate_key_pairs, public_key_to_bytes
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation.noop_federation_manager import NoOpFederationManager
from flwr.superlink.servicer.fleet import fleet_handlers

from flplatform.engine.wire import ContentSize, Traffic


@contextmanager
def serverapp_identity(run_id: int, node_id: int, task_id: int) -> Iterator[None]:
    """Messages built inside are the ServerApp's (``node_id``) of run ``run_id``."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)  # type: ignore[attr-defined]
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, node_id, task_id
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved  # type: ignore[attr-defined]


class FleetLink:
    """A SuperLink's state with one node and one running run, driven through Flower's
    Fleet handlers the way a SuperNode drives them; ``traffic()`` is what it counted."""

    def __init__(self, database: Path) -> None:
        objects = ObjectStoreFactory(str(database))
        self.state: LinkState = LinkStateFactory(
            str(database), NoOpFederationManager(), objects
        ).state()
        _, public_key = generate_key_pairs()
        self.node_id = self.state.create_node(
            NOOP_FLWR_AID, NOOP_ACCOUNT_NAME, public_key_to_bytes(public_key), 30
        )
        self.state.activate_node(self.node_id, 30)
        self.run_id = self.state.create_run(
            "flplatform/test", "1.0", "0" * 64, {}, NOOP_FEDERATION_ID, None, NOOP_FLWR_AID,
            TaskType.SERVER_APP,
        )  # fmt: skip
        self.task_id = self.state.get_run_info(run_ids=[self.run_id])[0].primary_task_id
        self.state.claim_task(self.task_id)
        self.state.activate_task(self.task_id)
        self.node = Node(node_id=self.node_id)

    def traffic(self) -> Traffic:
        run = self.state.get_run_info(run_ids=[self.run_id])[0]
        return Traffic(up=run.bytes_recv, down=run.bytes_sent)

    def push_from_server(self, msg: Message) -> None:
        """What the ServerApp's grid does (its own API is not metered)."""
        with no_object_id_recompute():
            msg.metadata.__dict__["_message_id"] = msg.object_id
            proto = message_to_proto(remove_content_from_message(msg))
            objects = get_all_nested_objects(msg)
            tree = get_object_tree(msg)
        session = self.state.start_session(self.run_id)
        stored, missing = self.state.store_message_and_object_tree(
            message_from_proto(proto), tree, session
        )
        assert stored
        for object_id in missing:
            self.state.store_object(self.run_id, session, object_id, objects[object_id].deflate())

    def pull_by_node(self) -> Message:
        """What a SuperNode does to receive a message: pull it, then every object its own
        (empty) store lacks, as that store lists them: once per node of the tree."""
        response = fleet_handlers.pull_messages(
            PullMessagesRequest(node=self.node), self.state, self.state.object_store
        )
        tree = response.message_object_trees[0]
        contents: dict[str, bytes] = {}
        for object_id in InMemoryObjectStore().preregister(self.run_id, tree):
            request = PullObjectRequest(node=self.node, run_id=self.run_id, object_id=object_id)
            contents[object_id] = fleet_handlers.pull_object(request, self.state).object_content
        received = inflate_object_from_contents(tree.object_id, contents)
        assert isinstance(received, Message)
        received.metadata.__dict__["_message_id"] = tree.object_id
        return received

    def push_by_node(self, reply: Message) -> Message:
        """What a SuperNode does to send a reply; returns it as the server pulls it."""
        with no_object_id_recompute():
            reply.metadata.__dict__["_message_id"] = reply.object_id
            objects = get_all_nested_objects(reply)
            tree = get_object_tree(reply)
        response = fleet_handlers.push_messages(
            PushMessagesRequest(
                node=self.node,
                messages_list=[message_to_proto(remove_content_from_message(reply))],
                message_object_trees=[tree],
                clientapp_runtime_list=[1.25],
            ),
            self.state,
        )
        for object_id in response.objects_to_push:
            request = PushObjectRequest(
                node=self.node,
                run_id=self.run_id,
                session_id=response.session_id,
                object_id=object_id,
                object_content=objects[object_id].deflate(),
            )
            fleet_handlers.push_object(request, self.state)
        return reply


@contextmanager
def with_message_id(msg: Message) -> Iterator[None]:
    """``msg`` with the id Flower gives it (its object id, a SHA-256 digest) for a while."""
    saved = msg.metadata.message_id
    msg.metadata.__dict__["_message_id"] = msg.object_id
    try:
        yield
    finally:
        msg.metadata.__dict__["_message_id"] = saved


def naive_measure(content: RecordDict) -> ContentSize:
    """``wire.measure`` the slow way: Flower's own object walk, hashing every object, and
    each object deflated (copied) as Flower sends it."""
    with no_object_id_recompute():
        tree = get_object_tree(content)
        objects = get_all_nested_objects(content)
        nodes = list(iterate_object_tree(tree))
        return ContentSize(
            object_bytes=sum(len(o.deflate()) for o in objects.values()),
            node_bytes=sum(len(objects[node.object_id].deflate()) for node in nodes),
            tree=tree,
            tree_nodes=len(nodes),
        )


def naive_delivery(msg: Message) -> int:
    """Flower's pull of ``msg`` rebuilt the slow way: stored in a SQL link state (which
    keeps no content and no task ids), handed out with its object tree, then the object at
    every node of the tree (what a SuperNode's empty store lacks)."""
    with with_message_id(msg):
        stored = dict_to_message(message_to_dict(remove_content_from_message(msg)))
        tree = get_object_tree(msg)
        response = PullMessagesResponse(
            messages_list=[message_to_proto(stored)], message_object_trees=[tree]
        )
    objects = get_all_nested_objects(msg)
    return response.ByteSize() + sum(
        len(objects[node.object_id].deflate()) for node in iterate_object_tree(tree)
    )


def naive_reply(reply: Message) -> Traffic:
    """A SuperNode's push of ``reply`` rebuilt the slow way, with the pull that fetched its
    message; into an empty object store, so every tree node is an object to push."""
    node = Node(node_id=reply.metadata.src_node_id)
    tree = get_object_tree(reply)
    with with_message_id(reply):
        push = PushMessagesRequest(
            node=node,
            messages_list=[message_to_proto(remove_content_from_message(reply))],
            message_object_trees=[tree],
            clientapp_runtime_list=[time.monotonic()],
        )
        results = {reply.metadata.message_id: 0}
    objects = get_all_nested_objects(reply).values()
    acknowledgement = PushMessagesResponse(
        reconnect=Reconnect(reconnect=5),
        results=results,
        objects_to_push=[t.object_id for t in iterate_object_tree(tree)],
        session_id=str(uuid.uuid4()),
    )
    up = PullMessagesRequest(node=node).ByteSize() + push.ByteSize()
    return Traffic(up + sum(len(o.deflate()) for o in objects), acknowledgement.ByteSize())
