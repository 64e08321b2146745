"""Reading a reply leaves nothing behind that keeps it in memory."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MetricRecord,
    RecordDict,
)

from flplatform.core import keys
from flplatform.engine.engine import fingerprint
from flplatform.engine.replies import record_of, reported_losses, reported_metrics, site_info
from strategies.local_sgd import LocalSGDAveraging

pytestmark = pytest.mark.usefixtures("task_identity")


@pytest.fixture
def no_cyclic_collection() -> Iterator[None]:
    """Only reference counts free objects: what a cycle holds stays."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def a_reply() -> tuple[Message, bytes]:
    sent = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=3, message_type="train")
    data = np.arange(1000, dtype=np.float32)
    content = RecordDict(
        {
            keys.ARRAYS: ArrayRecord({"w": Array(data)}),
            keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: 5, keys.TRAIN_LOSS: 0.25}),
            keys.CONFIG: ConfigRecord({keys.SITE_NAME: "a"}),
        }
    )
    reply = Message(content, reply_to=sent)
    return reply, content[keys.ARRAYS]["w"].data


def test_a_read_reply_is_freed_by_its_reference_count(no_cyclic_collection: None) -> None:
    """Flower's typed views (``content.metric_records``) refer to themselves: a reply read
    through one would keep its model in memory until the cyclic collector ran."""
    strategy = LocalSGDAveraging()
    model = ArrayRecord({"w": Array(np.zeros(1000, np.float32))})
    strategy.begin_aggregation(1, model)
    reply, data = a_reply()
    held = sys.getrefcount(data)
    reported_metrics(reply)
    reported_losses(reply)
    site_info(3, reply)
    fingerprint(reply)
    strategy.add_update(strategy.read_update(reply, base=model), weight=1.0)
    del reply
    assert sys.getrefcount(data) == held - 1  # the record's reference went with the reply
    # the typed view does hold it: what this guards against
    reply, data = a_reply()
    _ = reply.content.metric_records
    del reply, _
    assert sys.getrefcount(data) > held - 1


def test_record_of_is_the_typed_views_lookup() -> None:
    reply, _ = a_reply()
    content = reply.content
    assert record_of(content, keys.METRICS, MetricRecord) is content.metric_records[keys.METRICS]
    assert record_of(content, keys.CONFIG, ConfigRecord) is content.config_records[keys.CONFIG]
    assert record_of(content, keys.METRICS, ConfigRecord) is None  # another kind
    assert record_of(content, "absent", MetricRecord) is None
    assert reported_metrics(reply) == {"num_examples": 5, "train_loss": 0.25}
    assert site_info(3, reply).name == "node-3"  # no site-info record: named by its node
    query = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=3, message_type="query")
    info = RecordDict({keys.SITE_INFO: ConfigRecord({keys.SITE_NAME: "oslo"})})
    assert site_info(3, Message(info, reply_to=query)).name == "oslo"
    metrics_named_info = RecordDict({keys.SITE_INFO: MetricRecord({"x": 1})})
    assert site_info(3, Message(metrics_named_info, reply_to=query)).name == "node-3"
