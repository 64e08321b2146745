"""The ServerApp's body for a sweep: each member a run of its own on one Grid, a failing one
recorded and passed over, and what one member left in flight drained before the next.

In process, over the scripted Grid of the engine's tests (real Flower messages, sites that
follow a script); tests/integration/test_sweep.py runs a sweep in a real simulation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MessageType, MetricRecord, RecordDict

from flplatform.app.config import RunConfig
from flplatform.app.federation import (
    SITE_KEYS,
    InFlightGrid,
    member_site_config,
    run_members,
    site_config_of,
)
from flplatform.core import keys
from flplatform.engine import Synchrony
from flplatform.engine.engine import RoundEngine
from storage import LedgerRepository
from strategies.local_sgd import LocalSGDAveraging
from tests.helpers.scripted_grid import ScriptedGrid
from tests.helpers.sites import site

pytestmark = pytest.mark.usefixtures("task_identity")

MODEL = ArrayRecord({"w": Array(np.zeros(4, np.float32))})


# ======================================================================= members
def echoing(name: str) -> callable:
    """Introduces itself; trains by sending back the model it got (any shapes)."""
    talk = site(name)

    def behave(msg: Message) -> Message:
        if msg.metadata.message_type != MessageType.TRAIN:
            return talk(msg)
        metrics = MetricRecord({keys.NUM_EXAMPLES: 10, keys.TRAIN_LOSS: 0.5})
        content = RecordDict({keys.ARRAYS: msg.content[keys.ARRAYS], keys.METRICS: metrics})
        return Message(content, reply_to=msg)

    return behave


def test_each_member_is_its_own_run_and_a_failing_one_is_passed_over(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    base = {"sites": "a,b", "num-server-rounds": 1, "local-steps": 1, "db": db}
    missing = str(tmp_path / "nowhere.npz")
    members = [
        RunConfig.from_mapping({**base, "seed": 1, "name": "one", "run-tag": "t1"}),
        RunConfig.from_mapping({**base, "dataset": missing, "name": "two", "run-tag": "t2"}),
        RunConfig.from_mapping({**base, "seed": 3, "name": "three", "run-tag": "t3"}),
    ]
    grid = ScriptedGrid({1: echoing("a"), 2: echoing("b")})
    run_members(grid, members)

    with LedgerRepository.open(db) as repository:
        runs = {run.tag: run for run in repository.list_runs()}
    assert [(runs[t].name, runs[t].status) for t in ("t1", "t2", "t3")] == [
        ("one", "finished"),
        ("two", "failed"),
        ("three", "finished"),
    ]
    assert "nowhere.npz" in (runs["t2"].error or "")
    # Each run recorded with its own options, and each told its sites its own data keys.
    assert runs["t1"].config["seed"] == 1 and runs["t3"].config["seed"] == 3
    told = [m.content[keys.RUN_CONFIG]["seed"] for m in grid.pushed]
    assert told[0] == 1 and told[-1] == 3 and sorted(set(told)) == [1, 3]


def test_a_sites_data_keys_are_the_ones_the_site_reads() -> None:
    config = RunConfig.from_mapping({"sites": "x,y", "seed": 4, "dataset": "mnist5k"})
    sent = site_config_of(config)
    assert tuple(sent) == SITE_KEYS
    assert sent["seed"] == 4 and sent["dataset"] == "mnist5k" and sent["sites"] == "x,y"
    assert set(SITE_KEYS) == {
        "dataset",
        "partition",
        "alpha",
        "model",
        "seed",
        "sites",
        "standardize-features",
    }


def test_a_member_tells_its_sites_only_what_their_run_config_does_not_say() -> None:
    base = {"sites": "x,y", "seed": 4, "alpha": 0.5, "attack.kind": "none"}
    held = {**base, "num-server-rounds": 3}  # the sites' run config: the first member's
    same = RunConfig.from_mapping({**base, "strategy": "fetchsgd", "k": 10}, allow_unknown=True)
    # Another strategy on the same data and model: the sites know all they need.
    assert member_site_config(same, {}, held) is None
    assert member_site_config(same, {"attack.kind": "none"}, held) is None
    # Another seed, or its own value of an app key: its data keys and app keys go.
    reseeded = RunConfig.from_mapping({**base, "seed": 5}, allow_unknown=True)
    assert member_site_config(reseeded, {}, held) == site_config_of(reseeded)
    attacked = member_site_config(same, {"attack.kind": "huge"}, held)
    assert attacked == {**site_config_of(same), "attack.kind": "huge"}
    # Not knowing the sites' run config, everything goes; nor where it cannot be read (a
    # value every member overrides), nor for an app key equal only in value (1 and True).
    assert member_site_config(same, {}, None) == site_config_of(same)
    assert member_site_config(same, {}, {**held, "seed": "x"}) == site_config_of(same)
    assert member_site_config(same, {"mine": True}, {**held, "mine": 1}) == {
        **site_config_of(same),
        "mine": True,
    }


def test_a_sweep_on_the_sites_own_data_sends_no_data_keys(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    base = {"sites": "a,b", "num-server-rounds": 1, "local-steps": 1, "db": db}
    members = [
        RunConfig.from_mapping({**base, "seed": 1, "name": "one", "run-tag": "t1"}),
        RunConfig.from_mapping({**base, "seed": 1, "lr": 0.5, "name": "two", "run-tag": "t2"}),
        RunConfig.from_mapping({**base, "seed": 2, "name": "three", "run-tag": "t3"}),
    ]
    grid = ScriptedGrid({1: echoing("a"), 2: echoing("b")})
    held = members[0].to_run_config()
    run_members(grid, members, app_keys=[{}, {}, {"mine": 1}], sites_run_config=held)

    told = [m.content.config_records.get(keys.RUN_CONFIG) for m in grid.pushed]
    lrs = [m.content.config_records[keys.CONFIG].get(keys.LR) for m in grid.pushed]
    # The first two members (the second's messages are those with its lr) train on the
    # sites' own data; every message of the third says its seed and its app key.
    third = max(i for i, lr in enumerate(lrs) if lr == 0.5) + 1
    assert 0 < lrs.index(0.5) < third < len(told)
    assert told[:third] == [None] * third
    assert all(t is not None and (t["seed"], t["mine"]) == (2, 1) for t in told[third:])


def test_ctrl_c_in_a_member_stops_the_sweep(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    base = {"sites": "a,b", "num-server-rounds": 1, "local-steps": 1, "db": db}
    members = [
        RunConfig.from_mapping({**base, "seed": s, "name": f"m{s}", "run-tag": f"t{s}"})
        for s in (1, 2)
    ]

    def interrupted(msg: Message) -> Message:
        if msg.metadata.message_type == MessageType.TRAIN:
            raise KeyboardInterrupt
        return site("a")(msg)

    with pytest.raises(KeyboardInterrupt):
        run_members(ScriptedGrid({1: interrupted, 2: echoing("b")}), members)
    with LedgerRepository.open(db) as repository:
        runs = repository.list_runs()
    assert [(r.tag, r.status) for r in runs] == [("t1", "failed")]  # the second never began


# ======================================================================= draining
def slow(name: str, *, pulls: int) -> callable:
    """Answers its queries at once and each training message only after ``pulls`` pulls."""
    talk = site(name)
    waited: dict[str, int] = {}

    def behave(msg: Message) -> Message | None:
        if msg.metadata.message_type != MessageType.TRAIN:
            return talk(msg)
        waited[msg.metadata.message_id] = waited.get(msg.metadata.message_id, 0) + 1
        return talk(msg) if waited[msg.metadata.message_id] > pulls else None

    return behave


def _async_run(grid: InFlightGrid) -> None:
    """Two steps in async mode: the fast site's; the slow one is still training after."""
    engine = RoundEngine(
        grid, LocalSGDAveraging(), policy=Synchrony("async"), required_sites=2, poll_interval=0
    )
    engine.run(MODEL, num_rounds=2)


def test_a_sweep_drains_what_the_last_run_left_in_flight_before_the_next_one() -> None:
    scripted = ScriptedGrid({1: site("fast"), 2: slow("slow", pulls=200)})
    grid = InFlightGrid(scripted)
    _async_run(grid)  # async: two steps of the fast site, the slow one still training
    assert len(grid.unanswered) == 1
    assert grid.drain(timeout=30.0, poll_interval=0.0) == 0
    assert grid.unanswered == set()
    late = scripted.replies[-1]
    assert late.metadata.reply_to_message_id in {m.metadata.message_id for m in scripted.pushed}
    _async_run(grid)  # the next run finds every site free (the grid refuses a busy one)

    undrained = InFlightGrid(ScriptedGrid({1: site("fast"), 2: slow("slow", pulls=200)}))
    _async_run(undrained)
    with pytest.raises(AssertionError, match="second message to busy node 2"):
        _async_run(undrained)


def test_a_reply_that_never_comes_is_given_up_after_the_timeout() -> None:
    grid = InFlightGrid(ScriptedGrid({1: site("fast"), 2: slow("slow", pulls=10**9)}))
    _async_run(grid)
    assert grid.drain(timeout=0.05, poll_interval=0.01) == 1
    assert grid.unanswered == set()
