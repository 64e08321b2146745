"""What a message costs on the wire (array <-> record conversions: ``flplatform.arrays``)."""

from __future__ import annotations

from typing import Any

from flwr.app import Message, RecordDict
from flwr.supercore.inflatable.inflatable_object import (
    get_all_nested_objects,
    no_object_id_recompute,
)


def content_size(content: RecordDict) -> int:
    """Serialized size of a RecordDict and everything under it, as Flower transfers it.

    Objects are content-addressed, so identical chunks (e.g. two all-zero arrays) travel
    once; ``get_all_nested_objects`` deduplicates them the same way.
    """
    # Within the context each object's id (a SHA-256 of its deflated bytes, which its
    # parent's bytes embed) is computed once instead of once per ancestor.
    with no_object_id_recompute():
        return sum(len(obj.deflate()) for obj in get_all_nested_objects(content).values())


def message_size(msg: Message, content_bytes: int | None = None) -> int:
    """Serialized size of ``msg`` in bytes, as Flower measures it.

    Equals ``sum(len(o.deflate()) for o in get_all_nested_objects(msg).values())``: the
    message's own object (metadata, error) plus its content tree. Pass ``content_bytes``
    when many messages share one content (a broadcast model) to measure it once.
    """
    with no_object_id_recompute():
        own = len(msg.deflate())
        if not msg.has_content():
            return own
        return own + (content_size(msg.content) if content_bytes is None else content_bytes)


def restamped_size(content: RecordDict, content_bytes: int, name: str, record: Any) -> int:
    """Size of ``content`` with its record ``name`` replaced by ``record``, from its own size.

    Only the replaced record's bytes change (the RecordDict names its children by
    fixed-length ids), so a per-site copy of a broadcast model costs one small record,
    not a model-sized measurement.
    """
    old = content.get(name)
    if old is None:
        return content_size(RecordDict({**content, name: record}))
    with no_object_id_recompute():
        return content_bytes - len(old.deflate()) + len(record.deflate())
