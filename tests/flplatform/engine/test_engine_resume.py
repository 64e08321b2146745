"""Resuming the round engine from a checkpoint: the same run, bit for bit, on the virtual clock.

A run is cut after round k (its ``on_round`` raises, as a SIGKILL right after the commit
would leave it), its last state goes through ``flplatform.core.checkpoint`` to disk and back,
and a fresh engine, strategy, policy, guard and clock, over sites that come back with NEW
node ids, resumes from it. The oracle is the same seeded run uninterrupted: the final
model must be bit-identical and every ledger row equal but for wall times.

The sites are deterministic functions of the message they get and of their own state,
which they keep on a "disk" (a dict shared by the cut run and the resumed one, as a site's
own disk outlives the server) keyed by (run key, site, site-work), as the platform's sites
do: a site given work n restores the state it had after work n − 1. Sites differ in
speed, so the async modes have stale work in flight (and replies pulled but not yet
judged) at the cut.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from itertools import count
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)

from flplatform.core import keys
from flplatform.core.arrays import record_to_arrays
from flplatform.core.checkpoint import CheckpointError, read_state, write_state
from flplatform.core.errors import RunFailed
from flplatform.core.site_registry import REGISTRY_ENV, RegisteredSite, SiteRegistry
from flplatform.engine import RoundSummary, SiteInfo, Synchrony
from flplatform.engine.clock import VirtualClock, WallClock
from flplatform.engine.engine import RoundEngine
from flplatform.engine.events import SITE_BACK_EVENT, SITE_SILENT_EVENT
from flplatform.engine.guard import GuardOptions, UpdateGuard
from flplatform.engine.rows import SILENT
from flplatform.network import ComputeModel, Network, SiteProfile
from strategies.local_sgd import LocalSGDAveraging
from tests.helpers.fleet_oracle import naive_delivery, naive_reply
from tests.helpers.idle_sites import network
from tests.helpers.scripted_grid import ScriptedGrid

pytestmark = pytest.mark.usefixtures("task_identity")

NAMES = ("s1", "s2", "s3", "s4")
# The resumed run's nodes: new ids, in another order than the sites' (as Flower draws them).
# Of the same encoded length (< 128): a message's size counts its node ids, and Flower's
# random 64-bit ids almost always have the same length too.
FIRST_NODES = {"s1": 1, "s2": 2, "s3": 3, "s4": 4}
RESUMED_NODES = {"s1": 97, "s2": 55, "s3": 30, "s4": 12}
ROUNDS = 8
CUTS = (2, 3, 5, 7)  # the rounds after which the server dies
RUN_KEY = "run-7f3a"
SPEEDS = (1.0, 0.45, 0.2, 2.5)  # s3 is five times slower than s1: stale work in flight
AVAILABILITY = (1.0, 0.6, 1.0, 1.0)  # s2 sits some work out: away at some cuts
MODES = {
    "sync": {},
    "k-async": {"k": 2},
    "async": {"weighting": "sqrt"},
}


def model() -> ArrayRecord:
    return ArrayRecord(
        {
            "w": Array(np.linspace(-1.0, 1.0, 6, dtype=np.float32).reshape(2, 3)),
            "b": Array(np.zeros(2, np.float32)),
        }
    )


def skewed_network() -> Network:
    profiles = network(4, ComputeModel("exponential", mean_seconds=1.0)).profiles
    return Network(
        name="skewed",
        profiles=tuple(
            SiteProfile(**{**p.__dict__, "speed": speed, "availability": available})
            for p, speed, available in zip(profiles, SPEEDS, AVAILABILITY, strict=True)
        ),
    )


Disk = dict[tuple[str, str, int], float]


def stateful_site(name: str, partition: int, disk: Disk) -> Any:
    """A site whose reply is a function of the message and of its state after work n − 1."""

    def behave(msg: Message) -> Message:
        if msg.metadata.message_type == MessageType.QUERY:
            info = {
                keys.SITE_NAME: name,
                keys.PARTITION_ID: partition,
                keys.NUM_EXAMPLES: 10 * (partition + 1),
            }
            return Message(RecordDict({keys.SITE_INFO: ConfigRecord(info)}), reply_to=msg)
        config = msg.content[keys.CONFIG]
        work, run_key = int(config[keys.SITE_WORK]), str(config[keys.RUN_KEY])
        # KeyError here: the site was asked to go on from a state it never had.
        before = disk[(run_key, name, work - 1)] if work > 1 else 0.0
        received = record_to_arrays(msg.content[keys.ARRAYS])
        rng = np.random.default_rng([partition, work])
        after = 0.5 * before + float(np.mean(received["w"])) + float(rng.normal())
        disk[(run_key, name, work)] = after
        trained = {
            k: (
                v + np.float32(0.1) * (np.float32(after) - v) + rng.normal(0, 0.01, v.shape)
            ).astype(np.float32)
            for k, v in received.items()
        }
        metrics = MetricRecord(
            {keys.NUM_EXAMPLES: 10 * (partition + 1), keys.TRAIN_LOSS: abs(after) + 0.1}
        )
        content = RecordDict(
            {
                keys.ARRAYS: ArrayRecord({k: Array(v) for k, v in trained.items()}),
                keys.METRICS: metrics,
            }
        )
        return Message(content, reply_to=msg)

    return behave


class MomentumLocalSGD(LocalSGDAveraging):
    """FedAvgM, saved and restored by LocalSGDAveraging's own state_dict/load_state_dict."""


@dataclass
class MemoryLedger:
    """A ledger sink that keeps rows in memory and writes each round's state to disk."""

    directory: Path
    sites: list[tuple[SiteInfo, dict]] = field(default_factory=list)
    rounds: list[RoundSummary] = field(default_factory=list)
    states: dict[int, Path] = field(default_factory=dict)
    traffic: list[tuple[int | None, Any]] = field(default_factory=list)
    events: list[tuple[str, dict]] = field(default_factory=list)

    def add_site(self, site: SiteInfo, profile: dict) -> None:
        self.sites.append((site, profile))

    def record_traffic(self, traffic: Any, server_round: int | None = None) -> None:
        self.traffic.extend((server_round, t) for t in traffic)

    def record_event(self, kind: str, detail: dict) -> None:
        self.events.append((kind, detail))

    def record_round(self, summary: RoundSummary, state: Any = None) -> None:
        if state is not None:
            path = self.directory / f"round-{summary.server_round:06d}.npz"
            write_state(path, state)
            self.states[summary.server_round] = path
        self.rounds.append(summary)


class Cut(Exception):
    """The server dies right after a round is committed."""


def engine(
    mode: str,
    nodes: dict[str, int],
    disk: Disk,
    ledger: MemoryLedger,
    *,
    cut_after: int | None = None,
    clock: Any = None,
    **kwargs: Any,
) -> RoundEngine:
    # Replies show up three pulls late, so some work is still out (not yet pulled) at a cut.
    grid = ScriptedGrid(
        {nodes[n]: stateful_site(n, i, disk) for i, n in enumerate(NAMES) if n in nodes},
        delay_pulls=3,
    )
    # Message ids of one length (a reply's size counts the id it answers; Flower's are
    # fixed-length hashes), whichever run counts from where.
    grid._ids = count(10**6)

    def on_round(summary: RoundSummary) -> None:
        if summary.server_round == cut_after:
            raise Cut

    kwargs.setdefault("required_sites", len(grid.behaviours))
    return RoundEngine(
        grid,
        MomentumLocalSGD(beta=0.9, eta=1.0),
        policy=Synchrony(mode, **MODES[mode]),
        clock=clock or VirtualClock(skewed_network(), seed=11),
        ledger=ledger,
        guard=UpdateGuard(GuardOptions(window_rounds=3, min_reference=3, min_cosine=-0.9)),
        poll_interval=0.0,
        on_round=on_round,
        checkpoints=True,
        run_key=RUN_KEY,
        **kwargs,
    )


def without_wall_times(summary: RoundSummary) -> RoundSummary:
    updates = tuple(
        replace(u, dispatched_at=0.0, arrived_at=None if u.arrived_at is None else 0.0)
        for u in summary.updates
    )
    return replace(summary, started_at=0.0, finished_at=0.0, updates=updates)


def uninterrupted(mode: str, tmp_path: Path) -> tuple[Any, MemoryLedger]:
    ledger = MemoryLedger(tmp_path / f"{mode}-whole")
    result = engine(mode, FIRST_NODES, {}, ledger).run(
        model(), num_rounds=ROUNDS, train_config=ConfigRecord({keys.LOCAL_STEPS: 2})
    )
    return result, ledger


_WHOLE: dict[str, tuple[Any, MemoryLedger]] = {}


@pytest.fixture
def whole_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, MemoryLedger]]:
    """The uninterrupted run of each mode (run once per session: the oracle is costly)."""
    for mode in MODES:
        if mode not in _WHOLE:
            _WHOLE[mode] = uninterrupted(mode, tmp_path_factory.mktemp("whole"))
    return _WHOLE


# ============================================================== the run, resumed
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("cut_after", CUTS)
def test_a_resumed_run_is_the_uninterrupted_run_bit_for_bit(
    whole_runs, tmp_path: Path, mode: str, cut_after: int
) -> None:
    whole, whole_ledger = whole_runs[mode]
    disk: Disk = {}  # the sites' own disks: they outlive the server
    train_config = ConfigRecord({keys.LOCAL_STEPS: 2})

    # ---- the run dies right after round ``cut_after`` is committed
    first = MemoryLedger(tmp_path / "first")
    with pytest.raises(Cut):
        engine(mode, FIRST_NODES, disk, first, cut_after=cut_after).run(
            model(), num_rounds=ROUNDS, train_config=train_config
        )
    state = read_state(first.states[cut_after])
    assert state["kind"] == "flplatform-run-state"
    assert state["server_round"] == cut_after

    # ---- a fresh server, and the same sites with new node ids
    second = MemoryLedger(tmp_path / "second")
    resumed_engine = engine(mode, RESUMED_NODES, disk, second)
    resumed = resumed_engine.run(
        model(), num_rounds=ROUNDS, train_config=train_config, resume=state
    )

    # The model, bit for bit, and every row but wall times, round by round.
    got, want = record_to_arrays(resumed.arrays), record_to_arrays(whole.arrays)
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype
        assert got[name].tobytes() == want[name].tobytes(), name
    rounds = [without_wall_times(s) for s in first.rounds + second.rounds]
    assert [s.server_round for s in rounds] == list(range(1, ROUNDS + 1))
    assert rounds == [without_wall_times(s) for s in whole_ledger.rounds]
    assert resumed.train_metrics_clientapp == whole.train_metrics_clientapp
    # The states after the last round agree too (the one a second resume would use).
    last_resumed = read_state(second.states[ROUNDS])
    last_whole = read_state(whole_ledger.states[ROUNDS])
    assert last_resumed["engine"]["clock"] == last_whole["engine"]["clock"]
    assert last_resumed["engine"]["policy"] == last_whole["engine"]["policy"]


@pytest.mark.parametrize("mode", ["k-async", "async"])
def test_async_cuts_leave_stale_work_in_flight(whole_runs, mode: str) -> None:
    # What the resume test relies on: its cut points hit work still out, computed on an
    # older version than the model, and replies pulled but not yet judged.
    _, ledger = whole_runs[mode]
    states = [read_state(ledger.states[k]) for k in CUTS]
    work = [(s, w) for s in states for w in s["engine"]["mailbox"]["work"]]
    arrivals = [(s, a) for s in states for a in s["engine"]["mailbox"]["arrivals"]]
    assert arrivals
    assert work or mode == "k-async"  # k-async gives work at a step's start only
    in_flight = work + arrivals
    assert any(item["model_version"] < s["model_version"] for s, item in in_flight)
    stale = [u for s in ledger.rounds for u in s.updates if u.status == "applied" and u.staleness]
    assert stale


def test_the_cuts_catch_sites_sitting_work_out(whole_runs) -> None:
    # A site away until a simulated time at the cut must come back at that time.
    away = [
        (mode, k)
        for mode, (_, ledger) in whole_runs.items()
        for k in CUTS
        if any(s["phase"] == "away" for s in read_state(ledger.states[k])["engine"]["sites"])
    ]
    assert away


def test_every_training_message_carries_its_site_work_and_the_run_key(tmp_path: Path) -> None:
    ledger = MemoryLedger(tmp_path)
    run = engine("async", FIRST_NODES, {}, ledger)
    run.run(model(), num_rounds=5, train_config=ConfigRecord({keys.LOCAL_STEPS: 2}))
    grid = run.grid
    assert isinstance(grid, ScriptedGrid)
    train = [m for m in grid.pushed if m.metadata.message_type == MessageType.TRAIN]
    by_node: dict[int, list[int]] = {}
    for msg in train:
        config = msg.content[keys.CONFIG]
        assert config[keys.RUN_KEY] == RUN_KEY
        by_node.setdefault(msg.metadata.dst_node_id, []).append(int(config[keys.SITE_WORK]))
    for works in by_node.values():  # 1, 2, 3, ... per site, in the order sent
        assert works == list(range(1, len(works) + 1))
    # Each site got its own config, and its bytes are still what Flower's SuperLink counts:
    # the message's delivery, with its reply's acknowledgement when one came. (Messages
    # still out when the run ends have no row.)
    replies = {r.metadata.reply_to_message_id: naive_reply(r) for r in grid.replies}
    sizes: Counter[int] = Counter()
    for msg in train:
        delivery, reply = naive_delivery(msg), replies.get(msg.metadata.message_id)
        sizes[delivery if reply is None else delivery + reply.down] += 1
    recorded = Counter(
        u.bytes_down for s in ledger.rounds for u in s.updates if u.bytes_down and u.arrived_at
    )
    assert recorded and recorded <= sizes


# ============================================================== what resume refuses
def test_a_site_that_does_not_come_back_fails_the_resume_clearly(tmp_path: Path) -> None:
    first = MemoryLedger(tmp_path / "first")
    with pytest.raises(Cut):
        engine("async", FIRST_NODES, {}, first, cut_after=2).run(
            model(), num_rounds=ROUNDS, train_config=ConfigRecord({keys.LOCAL_STEPS: 2})
        )
    state = read_state(first.states[2])
    three = {name: node for name, node in RESUMED_NODES.items() if name != "s3"}
    resumed = engine(
        "async",
        three,
        {},
        MemoryLedger(tmp_path / "second"),
        required_sites=3,
        startup_timeout=0.3,
    )
    with pytest.raises(RunFailed, match=r"site\(s\) s3 of the checkpoint did not connect"):
        resumed.run(model(), num_rounds=ROUNDS, resume=state)


# The async run cut on a deployment: after round CUT of ROUNDS_CUT, s4's work is out and
# s3's reply pulled but not judged.
CUT, ROUNDS_CUT = 24, 30
CUT_TRAIN = ConfigRecord({keys.LOCAL_STEPS: 2})


def cut_on_a_deployment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Disk]:
    """The async run's state at CUT and its sites' disk, with a deployment's site registry
    naming the resumed run's nodes (``REGISTRY_ENV``)."""
    disk: Disk = {}
    first = MemoryLedger(tmp_path / "first")
    with pytest.raises(Cut):
        engine("async", FIRST_NODES, disk, first, cut_after=CUT).run(
            model(), num_rounds=ROUNDS_CUT, train_config=CUT_TRAIN
        )
    state = read_state(first.states[CUT])
    mailbox = state["engine"]["mailbox"]
    assert [w["node_id"] for w in mailbox["work"]] == [FIRST_NODES["s4"]]
    assert FIRST_NODES["s3"] in [a["node_id"] for a in mailbox["arrivals"]]
    registry = SiteRegistry(
        tuple(RegisteredSite(n, RESUMED_NODES[n], f"SHA256:{n}") for n in NAMES)
    )
    registry.write(tmp_path / "registry.json")
    monkeypatch.setenv(REGISTRY_ENV, str(tmp_path / "registry.json"))
    return state, disk


def test_sites_silent_at_the_resume_get_none_of_their_saved_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resumed on a deployment (a site registry names the nodes) while the SuperNodes of
    s3 and s4 answer nothing: both are silent; s4's work in flight at the cut is dropped,
    not sent again, s3's reply pulled before the cut is judged (on the virtual clock it
    lands rounds later: s3 is the slowest site), neither is sent anything but its one
    query (a site never holds two messages: the scripted grid refuses a second), and s1
    and s2 finish the run."""
    state, disk = cut_on_a_deployment(tmp_path, monkeypatch)
    second = MemoryLedger(tmp_path / "second")
    # (registered sites silent at the start are waited for until the start-up timeout)
    resumed = engine("async", RESUMED_NODES, disk, second, query_timeout=0.2, startup_timeout=1.0)
    grid = resumed.grid
    assert isinstance(grid, ScriptedGrid)
    silent = {RESUMED_NODES["s3"], RESUMED_NODES["s4"]}
    for node in silent:
        grid.behaviours[node] = lambda msg: None
    resumed.run(model(), num_rounds=ROUNDS_CUT, resume=state, train_config=CUT_TRAIN)

    assert sorted((kind, d["site"], d["round"]) for kind, d in second.events) == [
        (SITE_SILENT_EVENT, "s3", None),
        (SITE_SILENT_EVENT, "s4", None),
    ]
    for node in silent:
        sent = [m.metadata.message_type for m in grid.pushed if m.metadata.dst_node_id == node]
        assert sent == [MessageType.QUERY]
    updates = [u for summary in second.rounds for u in summary.updates]
    assert [(u.site, u.status, u.reason) for u in updates if u.site == "s4"] == [
        ("s4", "dropped", SILENT)
    ]
    assert [u.site for u in updates if u.site == "s3"] == ["s3"]  # its pulled reply, judged
    assert [s.server_round for s in second.rounds] == list(range(CUT + 1, ROUNDS_CUT + 1))


def test_a_site_silent_at_the_resume_that_answers_within_the_wait_gets_its_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same cut, resumed on a deployment while s4's SuperNode answers nothing for a
    second (started again after a crash, it joins once Flower stops counting the dead
    one): the resume waits for it, and its work in flight at the cut is sent again,
    not dropped."""
    state, disk = cut_on_a_deployment(tmp_path, monkeypatch)
    second = MemoryLedger(tmp_path / "second")
    resumed = engine("async", RESUMED_NODES, disk, second, query_timeout=0.2, startup_timeout=30)
    grid = resumed.grid
    assert isinstance(grid, ScriptedGrid)
    s4 = RESUMED_NODES["s4"]
    behaviour, asked = grid.behaviours[s4], time.monotonic()
    grid.behaviours[s4] = lambda msg: behaviour(msg) if time.monotonic() - asked > 1.0 else None
    resumed.run(model(), num_rounds=ROUNDS_CUT, resume=state, train_config=CUT_TRAIN)

    assert [(kind, d["site"], d["round"]) for kind, d in second.events] == [
        (SITE_SILENT_EVENT, "s4", None),
        (SITE_BACK_EVENT, "s4", None),
    ]
    sent = [m.metadata.message_type for m in grid.pushed if m.metadata.dst_node_id == s4]
    assert sent[:2] == [MessageType.QUERY, MessageType.TRAIN]  # its saved work, sent again
    updates = [u for summary in second.rounds for u in summary.updates]
    assert not [u for u in updates if u.status == "dropped"]
    assert any(u.site == "s4" and u.status == "applied" for u in updates)
    assert [s.server_round for s in second.rounds] == list(range(CUT + 1, ROUNDS_CUT + 1))


def test_a_state_of_another_kind_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.npz"
    write_state(path, {"kind": "something-else", "model": model()})
    fresh = engine("sync", RESUMED_NODES, {}, MemoryLedger(tmp_path))
    with pytest.raises(CheckpointError, match="not a run state"):
        fresh.run(model(), num_rounds=ROUNDS, resume=read_state(path))


def test_a_simulated_run_does_not_resume_on_the_wall_clock(tmp_path: Path) -> None:
    first = MemoryLedger(tmp_path / "first")
    with pytest.raises(Cut):
        engine("sync", FIRST_NODES, {}, first, cut_after=1).run(
            model(), num_rounds=3, train_config=ConfigRecord({keys.LOCAL_STEPS: 2})
        )
    fresh = engine("sync", RESUMED_NODES, {}, MemoryLedger(tmp_path), clock=WallClock())
    with pytest.raises(CheckpointError, match="clock is 'virtual', this run's is 'wall'"):
        fresh.run(model(), num_rounds=3, resume=read_state(first.states[1]))


def test_a_state_of_another_mode_is_refused_naming_both(tmp_path: Path) -> None:
    first = MemoryLedger(tmp_path / "first")
    with pytest.raises(Cut):
        engine("sync", FIRST_NODES, {}, first, cut_after=1).run(
            model(), num_rounds=3, train_config=ConfigRecord({keys.LOCAL_STEPS: 2})
        )
    fresh = engine("async", RESUMED_NODES, {}, MemoryLedger(tmp_path))
    with pytest.raises(CheckpointError, match="ran sync mode 'sync', this run 'async'"):
        fresh.run(model(), num_rounds=3, resume=read_state(first.states[1]))


def test_wall_clock_work_in_flight_is_sent_again(tmp_path: Path) -> None:
    # Not exact on the wall clock, but sensible: what was out is sent again, once.
    disk: Disk = {}
    first = MemoryLedger(tmp_path / "first")
    config = ConfigRecord({keys.LOCAL_STEPS: 2})
    with pytest.raises(Cut):
        engine("async", FIRST_NODES, disk, first, cut_after=2, clock=WallClock()).run(
            model(), num_rounds=4, train_config=config
        )
    state = read_state(first.states[2])
    out = state["engine"]["mailbox"]["work"]
    second = MemoryLedger(tmp_path / "second")
    resumed = engine("async", RESUMED_NODES, disk, second, clock=WallClock())
    result = resumed.run(model(), num_rounds=4, train_config=config, resume=state)
    assert [s.server_round for s in second.rounds] == [3, 4]
    assert resumed.version == 4
    assert all(math.isfinite(v) for v in record_to_arrays(result.arrays)["w"].ravel())
    if out:  # the re-sent messages went to the new node ids, with the same site-work
        grid = resumed.grid
        assert isinstance(grid, ScriptedGrid)
        first_pushed = [m for m in grid.pushed if m.metadata.message_type == MessageType.TRAIN]
        resent = {
            (m.metadata.dst_node_id, int(m.content[keys.CONFIG][keys.SITE_WORK]))
            for m in first_pushed[: len(out)]
        }
        names = {s["node_id"]: s["name"] for s in state["engine"]["sites"]}
        expected = {
            (RESUMED_NODES[names[w["node_id"]]], int(w["content"][keys.CONFIG][keys.SITE_WORK]))
            for w in out
        }
        assert resent == expected
