"""The built-in ClientApp after a resume: the same work gives the same training.

A resumed run is a new Flower run, so the site's ``context.state`` starts empty; the app
draws its data order from the work index our engine sends (``site-work``), and its mod
restores its state from the site's snapshots, so work n repeats exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from clients import client_app
from clients.site import load_site
from flplatform.core import keys
from flplatform.core.arrays import record_to_arrays

pytestmark = pytest.mark.usefixtures("task_identity")

RUN_CONFIG = {"dataset": "digits", "model": "mlp", "seed": 0}


def site_context(node_id: int, state_dir: Path) -> Context:
    node_config = {keys.PARTITION_ID: 0, keys.NUM_PARTITIONS: 2, keys.STATE_DIR: str(state_dir)}
    return Context(
        run_id=node_id,
        node_id=node_id,
        node_config=node_config,
        state=RecordDict(),
        run_config=dict(RUN_CONFIG),
    )


def training(n: int, algorithm: str, **extra: Any) -> Message:
    """Work n: round n, D = 1 for the delayed algorithm (the model it is sent is fixed)."""
    site = load_site({keys.PARTITION_ID: 0, keys.NUM_PARTITIONS: 2}, RUN_CONFIG)
    model = site.build_model(num_classes=10, seed=0)
    config = {
        keys.SITE_ALGORITHM: algorithm,
        keys.SERVER_ROUND: 1,  # the same round each time: only the work tells them apart
        keys.MODEL_VERSION: 0,
        keys.INCLUDED_PERIODS: [],
        keys.LOCAL_STEPS: 3,
        keys.BATCH_SIZE: 8,
        **extra,
    }
    if algorithm == keys.DELAYED:
        config[keys.SERVER_ROUND] = n
        config[keys.STATE_EXPECTED] = n > 1
    content = RecordDict(
        {keys.ARRAYS: ArrayRecord(model.state_dict()), keys.CONFIG: ConfigRecord(config)}
    )
    return Message(content, dst_node_id=1, message_type=MessageType.TRAIN)


def trained(reply: Message) -> dict[str, bytes]:
    assert not reply.has_error(), reply.error
    return {k: v.tobytes() for k, v in record_to_arrays(reply.content[keys.ARRAYS]).items()}


def ours(n: int) -> dict[str, Any]:
    return {keys.SITE_WORK: n, keys.RUN_KEY: "run-1"}


def test_the_same_work_draws_the_same_data_order_on_a_fresh_context(tmp_path: Path) -> None:
    before = site_context(1, tmp_path)
    replies = [client_app.app(training(n, keys.LOCAL_SGD, **ours(n)), before) for n in (1, 2, 3)]
    resumed = client_app.app(training(3, keys.LOCAL_SGD, **ours(3)), site_context(2, tmp_path))
    assert trained(resumed) == trained(replies[2])
    assert trained(replies[1]) != trained(replies[2])  # the work index changes the order


def test_without_site_work_the_app_counts_its_own_trainings(tmp_path: Path) -> None:
    """Another server's messages: the order follows the site's own count, as before."""
    before = site_context(1, tmp_path)
    replies = [client_app.app(training(n, keys.LOCAL_SGD), before) for n in (1, 2, 3)]
    fresh = client_app.app(training(3, keys.LOCAL_SGD), site_context(2, tmp_path))
    assert trained(fresh) == trained(replies[0])  # a fresh count starts again
    assert trained(fresh) != trained(replies[2])


def test_a_resumed_delayed_site_repeats_its_work_bit_for_bit(tmp_path: Path) -> None:
    """Data order and kept periods both come back: work 3 replies exactly as before."""
    before = site_context(1, tmp_path)
    replies = [client_app.app(training(n, keys.DELAYED, **ours(n)), before) for n in (1, 2, 3)]
    resumed = client_app.app(training(3, keys.DELAYED, **ours(3)), site_context(2, tmp_path))
    assert trained(resumed) == trained(replies[2])
    assert keys.STATE_LOST not in resumed.content[keys.METRICS]
    loss = keys.TRAIN_LOSS
    assert resumed.content[keys.METRICS][loss] == replies[2].content[keys.METRICS][loss]
