"""Site snapshots (strategies/mods/snapshots.py): work n acts on the state after work n − 1.

Each mod runs for real around a plain Flower train function, on scripted messages that
carry ``site-work`` and ``run-key`` as our engine sends them. The reference is the
uninterrupted site: one Flower context that handles every work in order.
"""

from __future__ import annotations

import copy
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)

from clients.site import load_site
from flplatform.core import keys
from flplatform.core.arrays import arrays_to_record, record_to_arrays
from flplatform.core.errors import ConfigError
from flplatform.engine import APPLIED, PeriodSync, RoundSummary, Synchrony
from flplatform.engine.engine import RoundEngine
from strategies.delayed import DelayedCompensated
from strategies.layout import Layout
from strategies.mods import codec_mod, delayed_mod, fetchsgd_mod, sketched_sgd_mod, snapshots
from strategies.mods.contract import Mod, ModState
from strategies.mods.sketched_sgd import CANDIDATES, StepPhase
from strategies.mods.snapshots import (
    KEEP,
    SiteSnapshots,
    forget_run,
    safe_name,
    state_root,
    work_of,
)
from strategies.sparse_sync import DENSE, SYNC_INDICES, SYNC_VALUES
from tests.helpers.algorithms import ALGORITHMS
from tests.helpers.delayed_sites import context, digits_site
from tests.helpers.scripted_grid import ScriptedGrid
from tests.helpers.sites import restart_before_round

pytestmark = pytest.mark.usefixtures("task_identity")

RUN = "run-7f3a"
WORKS = 6


def model_at(version: int) -> dict[str, np.ndarray]:
    """The server's model of ``version``: float32, float16, an int counter, a bool mask."""
    step = version / 8
    return {
        "z.weight": (np.arange(12, dtype=np.float32).reshape(3, 4) / 10 + step).astype(np.float32),
        "a.bias": np.array([0.5, -0.25, 1.0, 2.0], dtype=np.float16) + np.float16(step),
        "bn.num_batches_tracked": np.array(7 + version, dtype=np.int64),
        "mask": np.array([True, False, True]),
    }


def user_train(msg: Message, ctx: Context) -> Message:
    """A deterministic user: floats shrink towards 0.125 by an amount that depends on them."""
    trained = {}
    for name, value in record_to_arrays(msg.content[keys.ARRAYS]).items():
        if value.dtype.kind == "f":
            trained[name] = (value * 0.875 + 0.125 + np.sin(value) / 16).astype(value.dtype)
        elif value.dtype.kind == "i":
            trained[name] = value + 3
        else:
            trained[name] = value
    # Its own compute seconds: the mod's measured ones would differ between two runs.
    metrics = MetricRecord({keys.NUM_EXAMPLES: 20, keys.TRAIN_LOSS: 0.5, keys.COMPUTE_SECONDS: 1.0})
    content = RecordDict({keys.ARRAYS: arrays_to_record(trained), keys.METRICS: metrics})
    return Message(content, reply_to=msg)


def message(arrays: dict[str, np.ndarray], config: dict[str, Any], **records: Any) -> Message:
    content = RecordDict(
        {keys.ARRAYS: arrays_to_record(arrays), keys.CONFIG: ConfigRecord(config), **records}
    )
    return Message(content, dst_node_id=1, message_type=MessageType.TRAIN)


def ours(n: int, run_key: str = RUN) -> dict[str, Any]:
    """What our engine adds to the n-th training message of a site."""
    return {keys.SITE_WORK: n, keys.RUN_KEY: run_key}


# ================================================================ the scripts
# Each script gives work n's message (n = 1..WORKS) as a server of its algorithm sends it.
def codec_work(n: int, extra: dict[str, Any]) -> Message:
    config = {
        keys.SITE_ALGORITHM: keys.LOCAL_SGD,
        keys.CODEC: "topk:3",
        keys.SEED: 1,
        keys.SERVER_ROUND: n,
        keys.STATE_EXPECTED: n > 1,
    }
    return message(model_at(n - 1), {**config, **extra})


def delayed_work(n: int, extra: dict[str, Any], codec: str | None = None) -> Message:
    version = max(0, n - 2)  # D = 1; period 2 was left out of its average (a carry)
    config = {
        keys.SITE_ALGORITHM: keys.DELAYED,
        keys.SERVER_ROUND: n,
        keys.MODEL_VERSION: version,
        keys.INCLUDED_PERIODS: [version] if version >= 1 and version != 2 else [],
        keys.STATE_EXPECTED: n > 1,
        **({keys.CODEC: codec, keys.SEED: 1} if codec else {}),
    }
    return message(model_at(version), {**config, **extra})


SKETCH = {keys.SKETCH_SEED: 3, keys.SKETCH_ROWS: 3, keys.SKETCH_COLS: 16}


def sparse_changes(version: int) -> dict[str, np.ndarray]:
    """The coordinates changed from ``version`` − 1 to ``version`` and their new values."""
    layout = Layout.of(model_at(0))
    old, new = layout.flatten(model_at(version - 1)), layout.flatten(model_at(version))
    changed = np.flatnonzero(old != new)[::2]  # a sparse sync carries some of them
    return {SYNC_INDICES: changed.astype(np.int64), SYNC_VALUES: new[changed]}


def fetchsgd_work(n: int, extra: dict[str, Any]) -> Message:
    config = {
        keys.SITE_ALGORITHM: keys.FETCHSGD,
        keys.MODEL_VERSION: n - 1,
        keys.SYNC_FROM: DENSE if n == 1 else n - 2,
        **SKETCH,
    }
    arrays = model_at(0) if n == 1 else sparse_changes(n - 1)
    return message(arrays, {**config, **extra})


def sketched_work(n: int, extra: dict[str, Any]) -> Message:
    """Odd works are sketch rounds of step (n + 1) / 2, even ones their values rounds."""
    if n % 2 == 0:
        config = {
            keys.SITE_ALGORITHM: keys.SKETCHED_SGD,
            keys.STEP_PHASE: StepPhase.VALUES.value,
            keys.SKETCHED_ROUND: n - 1,
            keys.SERVER_ROUND: n,
        }
        return message({CANDIDATES: np.array([0, 5, 12, 14], np.int64)}, {**config, **extra})
    step = (n + 1) // 2
    config = {
        keys.SITE_ALGORITHM: keys.SKETCHED_SGD,
        keys.STEP_PHASE: StepPhase.SKETCH.value,
        keys.MODEL_VERSION: step - 1,
        keys.SYNC_FROM: DENSE if step == 1 else step - 2,
        keys.SERVER_ROUND: n,
        keys.STEP_MOMENTUM: 0.5,
        keys.ZERO_STEP: step - 1,
        keys.STATE_EXPECTED: step > 1,
        **SKETCH,
    }
    arrays = model_at(0) if step == 1 else sparse_changes(step - 1)
    return message(arrays, {**config, **extra})


def chained(*mods: Mod) -> Mod:
    """Mods as Flower's ``make_ffn`` chains them: the first is outermost."""

    def mod(
        msg: Message, ctx: Context, call_next: Callable[[Message, Context], Message]
    ) -> Message:
        def inner(m: Message, c: Context, depth: int = 0) -> Message:
            if depth == len(mods):
                return call_next(m, c)
            return mods[depth](m, c, lambda m2, c2: inner(m2, c2, depth + 1))

        return inner(msg, ctx)

    return mod


SCRIPTS: dict[str, tuple[Mod, Callable[[int, dict[str, Any]], Message], tuple[str, ...]]] = {
    "codec": (codec_mod("topk:3"), codec_work, (keys.CODEC_STATE,)),
    "delayed": (delayed_mod(), delayed_work, (keys.DELAYED_STATE,)),
    "delayed+codec": (
        chained(delayed_mod(), codec_mod("topk:3")),
        lambda n, extra: delayed_work(n, extra, codec="topk:3"),
        (keys.DELAYED_STATE, keys.CODEC_STATE),
    ),
    "fetchsgd": (fetchsgd_mod(), fetchsgd_work, (keys.FETCHSGD_STATE,)),
    "sketched-sgd": (sketched_sgd_mod(), sketched_work, (keys.SKETCHED_STATE,)),
}


def site(tmp_path: Path, node_id: int = 1, **node_config: Any) -> Context:
    """A site's Flower context; a new node id each time, as a resumed run gives."""
    return context(
        node_id, {keys.SITE_NAME: "london", keys.STATE_DIR: str(tmp_path), **node_config}
    )


def as_plain(reply: Message) -> dict[str, Any]:
    """A reply's whole content, comparable with ``==`` (arrays as bytes, dtype and shape)."""
    assert not reply.has_error(), reply.error
    plain: dict[str, Any] = {}
    for name, record in reply.content.array_records.items():
        plain[name] = {
            k: (v.dtype.str, v.shape, v.tobytes()) for k, v in record_to_arrays(record).items()
        }
    for name, record in [
        *reply.content.metric_records.items(),
        *reply.content.config_records.items(),
    ]:
        plain[name] = dict(record)
    return plain


def uninterrupted(tmp_path: Path, case: str, works: int = WORKS) -> list[dict[str, Any]]:
    """The replies of one site handling works 1..``works`` in one Flower context."""
    mod, script, _ = SCRIPTS[case]
    ctx = site(tmp_path)
    return [as_plain(mod(script(n, ours(n)), ctx, user_train)) for n in range(1, works + 1)]


# ====================================================== (a) a new Flower run
@pytest.mark.parametrize("case", sorted(SCRIPTS))
@pytest.mark.parametrize("resumed_at", range(2, WORKS + 1))
def test_a_fresh_context_acts_on_the_snapshot_of_the_work_before(
    tmp_path: Path, case: str, resumed_at: int
) -> None:
    mod, script, _ = SCRIPTS[case]
    reference = uninterrupted(tmp_path / "reference", case)
    before = site(tmp_path)
    for n in range(1, resumed_at):
        mod(script(n, ours(n)), before, user_train)
    # A resumed run is a new Flower run: an empty context (and a new node id), same disk.
    resumed = site(tmp_path, node_id=99)
    replies = [
        as_plain(mod(script(n, ours(n)), resumed, user_train)) for n in range(resumed_at, WORKS + 1)
    ]
    assert replies == reference[resumed_at - 1 :]
    assert all(keys.STATE_LOST not in r[keys.METRICS] for r in replies)


# ================================================ (b) work the site did already
@pytest.mark.parametrize("case", sorted(SCRIPTS))
def test_work_sent_again_gets_the_same_reply_again(tmp_path: Path, case: str) -> None:
    mod, script, _ = SCRIPTS[case]
    ctx = site(tmp_path)
    first = [as_plain(mod(script(n, ours(n)), ctx, user_train)) for n in range(1, 4)]
    assert as_plain(mod(script(3, ours(3)), ctx, user_train)) == first[2]
    # ... and the run goes on from there as if it had been sent once.
    reference = uninterrupted(tmp_path / "reference", case, works=5)
    later = [as_plain(mod(script(n, ours(n)), ctx, user_train)) for n in (4, 5)]
    assert later == reference[3:]


@pytest.mark.parametrize("case", sorted(SCRIPTS))
def test_a_resume_may_resend_work_behind_what_the_site_did(tmp_path: Path, case: str) -> None:
    """The site did work 5 before the server died; the last committed round re-sends 4."""
    mod, script, _ = SCRIPTS[case]
    reference = uninterrupted(tmp_path / "reference", case)
    old = site(tmp_path)
    for n in range(1, 6):
        mod(script(n, ours(n)), old, user_train)
    resumed = site(tmp_path, node_id=42)
    replies = [as_plain(mod(script(n, ours(n)), resumed, user_train)) for n in (4, 5, 6)]
    assert replies == reference[3:]


def test_work_that_failed_left_the_state_as_it_was(tmp_path: Path) -> None:
    """Work 2 raised in the user's code: work 3 acts on the state after work 1."""
    mod, script, _ = SCRIPTS["codec"]

    def failing(msg: Message, ctx: Context) -> Message:
        if msg.content[keys.CONFIG][keys.SITE_WORK] == 2:
            raise RuntimeError("CUDA out of memory")
        return user_train(msg, ctx)

    ctx = site(tmp_path)
    mod(script(1, ours(1)), ctx, failing)
    with pytest.raises(RuntimeError):
        mod(script(2, ours(2)), ctx, failing)
    original = as_plain(mod(script(3, ours(3)), ctx, failing))
    SiteSnapshots.of(ctx, RUN).forget_from(keys.CODEC_STATE, 3)  # type: ignore[union-attr]
    resumed = as_plain(mod(script(3, ours(3)), site(tmp_path, node_id=5), failing))
    assert resumed == original
    assert keys.STATE_LOST not in resumed[keys.METRICS]


# ============================================================ (c) state lost
def _today(mod: Mod, msg: Message) -> dict[str, Any]:
    """What a site with an empty context replies today: the message without our keys."""
    config = {
        k: v for k, v in msg.content[keys.CONFIG].items() if k not in (keys.SITE_WORK, keys.RUN_KEY)
    }
    content = RecordDict(dict(msg.content.items()))
    content[keys.CONFIG] = ConfigRecord(config)
    plain = Message(content, dst_node_id=1, message_type=MessageType.TRAIN)
    reply = as_plain(mod(plain, context(7), user_train))
    return reply


@pytest.mark.parametrize("case", sorted(SCRIPTS))
@pytest.mark.parametrize("at", [3, 4])
def test_without_snapshots_the_state_lost_path_runs_as_today(
    tmp_path: Path, case: str, at: int
) -> None:
    mod, script, state_keys = SCRIPTS[case]
    before = site(tmp_path)
    for n in range(1, at):
        mod(script(n, ours(n)), before, user_train)
    for key in state_keys:  # a fresh machine: the snapshots are gone
        for work in range(1, at):
            (tmp_path / "run-7f3a" / "london" / key / f"work-{work:09d}.npz").unlink(
                missing_ok=True
            )
    reply = as_plain(mod(script(at, ours(at)), site(tmp_path, node_id=8), user_train))
    expected = _today(mod, script(at, {}))
    assert reply == expected
    assert expected[keys.METRICS].get(keys.STATE_LOST) == 1


def test_an_unreadable_snapshot_is_lost_state_never_an_older_one(tmp_path: Path) -> None:
    mod, script, _ = SCRIPTS["codec"]
    ctx = site(tmp_path)
    for n in range(1, 4):
        mod(script(n, ours(n)), ctx, user_train)
    (tmp_path / RUN / "london" / keys.CODEC_STATE / "work-000000003.npz").write_bytes(b"junk")
    reply = as_plain(mod(script(4, ours(4)), site(tmp_path, node_id=2), user_train))
    assert reply == _today(mod, script(4, {}))


def test_a_snapshot_that_cannot_be_written_costs_the_resume_not_the_reply(
    tmp_path: Path,
) -> None:
    mod, script, _ = SCRIPTS["codec"]
    ctx = site(tmp_path)
    for n in (1, 2):
        mod(script(n, ours(n)), ctx, user_train)
    # Work 3's file cannot be put in place (a directory stands there).
    (tmp_path / RUN / "london" / keys.CODEC_STATE / "work-000000003.npz" / "x").mkdir(parents=True)
    reply = as_plain(mod(script(3, ours(3)), ctx, user_train))
    assert reply == uninterrupted(tmp_path / "reference", "codec", works=4)[2]
    assert keys.CODEC_STATE in ctx.state  # kept in Flower's context instead
    # Snapshot 2 must not pass for the state after work 3: a resume finds the state lost.
    resumed = as_plain(mod(script(4, ours(4)), site(tmp_path, node_id=3), user_train))
    assert resumed == _today(mod, script(4, {}))
    # The site itself carries on from the state in its context, as if nothing happened.
    shutil.rmtree(tmp_path / RUN / "london" / keys.CODEC_STATE / "work-000000003.npz")
    going_on = as_plain(mod(script(4, ours(4)), ctx, user_train))
    assert going_on == uninterrupted(tmp_path / "reference4", "codec", works=4)[3]
    # A state directory that is not one: the site still trains.
    (tmp_path / "file").write_text("not a directory")
    other = context(4, {keys.SITE_NAME: "ohio", keys.STATE_DIR: str(tmp_path / "file")})
    assert not mod(script(1, ours(1)), other, user_train).has_error()


def test_a_snapshot_whose_reply_never_left_is_dropped_while_the_state_is_in_the_context(
    tmp_path: Path,
) -> None:
    """Work 2's snapshot failed (the state is in the context); work 3 wrote one but its
    context was lost with its reply. Snapshot 3 must go when work 4 comes: a re-sent work 4
    would take it for the state after work 3."""
    mod, script, _ = SCRIPTS["codec"]
    ctx = site(tmp_path)
    mod(script(1, ours(1)), ctx, user_train)
    blocker = tmp_path / RUN / "london" / keys.CODEC_STATE / "work-000000002.npz" / "x"
    blocker.mkdir(parents=True)
    mod(script(2, ours(2)), ctx, user_train)
    assert keys.CODEC_STATE in ctx.state
    shutil.rmtree(blocker.parent)
    mod(script(3, ours(3)), copy.deepcopy(ctx), user_train)  # its context is thrown away
    third = tmp_path / RUN / "london" / keys.CODEC_STATE / "work-000000003.npz"
    assert third.exists()
    mod(script(4, ours(4)), ctx, user_train)
    assert not third.exists()


def test_another_runs_state_is_not_this_runs(tmp_path: Path) -> None:
    """A context holding run A's state does not give it to run B's second work."""
    mod, script, _ = SCRIPTS["codec"]
    ctx = site(tmp_path)
    mod(script(1, ours(1, "run-a")), ctx, user_train)
    reply = as_plain(mod(script(2, ours(2, "run-b")), ctx, user_train))
    assert reply[keys.METRICS][keys.STATE_LOST] == 1


# ============================================ (d) a server that is not ours
@pytest.mark.parametrize("case", sorted(SCRIPTS))
def test_messages_without_site_work_keep_todays_behaviour_and_write_nothing(
    tmp_path: Path, case: str
) -> None:
    mod, script, _ = SCRIPTS[case]
    ctx = site(tmp_path)
    replies = [as_plain(mod(script(n, {}), ctx, user_train)) for n in range(1, WORKS + 1)]
    assert list(tmp_path.iterdir()) == []
    assert keys.WORK_TAGS not in ctx.state
    # The same state as the tagged run: only the bookkeeping differs.
    assert replies == uninterrupted(tmp_path / "reference", case)


# ================================ (e) the state lives on the disk, not in the context
@pytest.mark.parametrize("case", sorted(SCRIPTS))
def test_flowers_context_carries_only_the_tag_of_the_state_on_disk(
    tmp_path: Path, case: str
) -> None:
    """Flower copies context.state to the process handling each message and back: the
    state (hundreds of MB at 10M parameters) stays in the snapshot, the context holds its
    work's tag, and a process that never saw the site reads the file (same replies)."""
    mod, script, state_keys = SCRIPTS[case]
    reference = uninterrupted(tmp_path / "reference", case)
    ctx = site(tmp_path)
    replies = []
    for n in range(1, WORKS + 1):
        replies.append(as_plain(mod(script(n, ours(n)), ctx, user_train)))
        assert not any(key in ctx.state for key in state_keys), list(ctx.state)
        tags = ctx.state.config_records[keys.WORK_TAGS]
        # (Sketched-SGD's values round writes no state: its tag stays the sketch's)
        assert all(n - 1 <= tags[key] <= n for key in state_keys if key in tags)
        if n == 3:  # as a new process would: nothing remembered, the files read
            snapshots._RECENT.clear()
    assert replies == reference


def test_a_process_remembers_states_within_its_budget_and_reads_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two sites in one process (a simulation's actor) with room for one state: each reads
    its own file when the other's is the one remembered, and replies as if alone."""
    mod, script, _ = SCRIPTS["delayed+codec"]
    reference = uninterrupted(tmp_path / "reference", "delayed+codec")
    monkeypatch.setattr(snapshots, "RECENT_BYTES", 1)
    monkeypatch.setattr(snapshots, "_RECENT", snapshots.OrderedDict())
    london = site(tmp_path / "shared")
    ohio = context(2, {keys.SITE_NAME: "ohio", keys.STATE_DIR: str(tmp_path / "shared")})
    for n in range(1, WORKS + 1):
        for ctx in (london, ohio):
            assert as_plain(mod(script(n, ours(n)), ctx, user_train)) == reference[n - 1]
            assert len(snapshots._RECENT) == 1


def fresh_machine_from(tmp_path: Path, case: str, first: int, last: int) -> list[dict[str, Any]]:
    """The replies of a site that meets works ``first``..``last`` with nothing kept."""
    mod, script, _ = SCRIPTS[case]
    ctx = site(tmp_path / "fresh-machine")
    return [as_plain(mod(script(n, ours(n)), ctx, user_train)) for n in range(first, last + 1)]


@pytest.mark.parametrize("case", sorted(SCRIPTS))
def test_a_snapshot_deleted_under_a_running_site_stays_lost(tmp_path: Path, case: str) -> None:
    """The site goes on as a fresh machine would: an older snapshot never passes for the
    lost state, in this work or the next (a mod that saves nothing on a lost state)."""
    mod, script, state_keys = SCRIPTS[case]
    ctx = site(tmp_path)
    for n in (1, 2, 3):
        mod(script(n, ours(n)), ctx, user_train)
    for key in state_keys:  # the newest goes; older ones stay on the disk
        (tmp_path / RUN / "london" / key / "work-000000003.npz").unlink(missing_ok=True)
    replies = [as_plain(mod(script(n, ours(n)), ctx, user_train)) for n in (4, 5, 6)]
    assert replies == fresh_machine_from(tmp_path, case, 4, 6)


def test_another_nodes_snapshot_under_the_same_name_is_never_this_sites_state(
    tmp_path: Path,
) -> None:
    """Two nodes misconfigured with one site name and state directory: each acts only on
    snapshots it wrote itself, and the overwritten one finds its state lost."""
    mod, script, _ = SCRIPTS["fetchsgd"]
    mine, other = site(tmp_path, node_id=1), site(tmp_path, node_id=2)
    for n in (1, 2):
        mod(script(n, ours(n)), mine, user_train)
    other_first = user_train

    def others_train(msg: Message, ctx: Context) -> Message:  # another node's data
        reply = other_first(msg, ctx)
        arrays = {
            k: v * 2 if v.dtype.kind == "f" else v
            for k, v in record_to_arrays(reply.content[keys.ARRAYS]).items()
        }
        reply.content[keys.ARRAYS] = arrays_to_record(arrays)
        return reply

    for n in (1, 2):
        mod(script(n, ours(n)), other, others_train)
    snapshots._RECENT.clear()  # the other node is another process
    reply = as_plain(mod(script(3, ours(3)), mine, user_train))
    assert reply == fresh_machine_from(tmp_path, "fetchsgd", 3, 3)[0]
    assert reply[keys.METRICS][keys.STATE_LOST] == 1


def test_a_running_site_reads_its_state_from_memory_and_a_new_process_from_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mod, script, _ = SCRIPTS["delayed+codec"]
    reads: list[Path] = []
    original = snapshots.read_state

    def counted(path: Path) -> Any:
        reads.append(path)
        return original(path)

    monkeypatch.setattr(snapshots, "read_state", counted)
    ctx = site(tmp_path)
    for n in range(1, 4):
        mod(script(n, ours(n)), ctx, user_train)
    assert reads == []
    snapshots._RECENT.clear()
    mod(script(4, ours(4)), ctx, user_train)
    assert sorted(p.parent.name for p in reads) == sorted((keys.CODEC_STATE, keys.DELAYED_STATE))
    assert all(p.name == "work-000000003.npz" for p in reads)


def test_the_state_a_site_is_given_is_read_only_from_memory_and_from_the_file(
    tmp_path: Path,
) -> None:
    store = SiteSnapshots(tmp_path)
    store.write("k", 1, ModState({"calls": 1}, {"g": {"x": np.arange(3.0)}}), writer="w1")
    for forget in (False, True):
        if forget:
            snapshots._RECENT.clear()
        found = store.read("k", 1, writer="w1")
        assert found is not None and found[1] == "w1"
        assert not found[0].groups["g"]["x"].flags.writeable
        assert found[0].meta == {"calls": 1}
    assert store.read("k", 1, writer="w2") is None  # another writer's


def test_malformed_site_work_is_refused(tmp_path: Path) -> None:
    mod, script, _ = SCRIPTS["codec"]
    for bad in (0, -1, True, "3"):
        with pytest.raises(ConfigError, match="site-work"):
            mod(script(1, {keys.SITE_WORK: bad, keys.RUN_KEY: RUN}), site(tmp_path), user_train)
    with pytest.raises(ConfigError, match="run-key"):
        mod(script(1, {keys.SITE_WORK: 1, keys.RUN_KEY: 7}), site(tmp_path), user_train)
    assert work_of(script(1, {keys.SITE_WORK: 2})) is None  # no run key: not our engine
    assert work_of(script(1, {keys.SITE_WORK: 2, keys.RUN_KEY: ""})) is None  # no run


# ================================================================ (e) paths
@pytest.mark.parametrize(
    ("run_key", "site_name"),
    [("../x", "london"), ("../../../../tmp/evil", "../../up"), ("/abs", "a/b"), ("..", ".")],
)
def test_names_from_the_network_stay_inside_the_state_directory(
    tmp_path: Path, run_key: str, site_name: str
) -> None:
    root = tmp_path / "state"
    mod, script, _ = SCRIPTS["codec"]
    ctx = context(1, {keys.SITE_NAME: site_name, keys.STATE_DIR: str(root)})
    for n in (1, 2):
        mod(script(n, ours(n, run_key)), ctx, user_train)
    assert [p.name for p in tmp_path.iterdir()] == ["state"]
    files = [p for p in root.rglob("*") if p.is_file()]
    assert len(files) == 2
    for file in files:
        assert file.resolve().is_relative_to(root.resolve())
        assert ".." not in file.relative_to(root).parts
    # ... and they are found again by the next Flower run.
    resumed = context(2, {keys.SITE_NAME: site_name, keys.STATE_DIR: str(root)})
    reply = as_plain(mod(script(3, ours(3, run_key)), resumed, user_train))
    assert keys.STATE_LOST not in reply[keys.METRICS]


def test_safe_names_keep_plain_names_and_hash_the_rest() -> None:
    assert safe_name("run-7f3a") == "run-7f3a" and safe_name("partition-3") == "partition-3"
    for hostile in ("..", ".", "../x", "a/b", "", " x", "x" * 65, "é"):
        name = safe_name(hostile)
        assert name.startswith("h-") and "/" not in name and name not in (".", "..")
    assert safe_name("../x") != safe_name("../y")


# ========================================================= (f) and (g) files
@pytest.mark.parametrize("case", sorted(SCRIPTS))
def test_the_newest_four_snapshots_are_kept_owner_only(tmp_path: Path, case: str) -> None:
    mod, script, state_keys = SCRIPTS[case]
    ctx = site(tmp_path)
    for n in range(1, WORKS + 1):
        mod(script(n, ours(n)), ctx, user_train)
    store = SiteSnapshots.of(ctx, RUN)
    assert store is not None and store.directory == tmp_path / RUN / "london"
    for key in state_keys:
        works = store.works(key)
        # Sketched-SGD's values rounds change nothing, so they write nothing.
        written = [n for n in range(1, WORKS + 1) if case != "sketched-sgd" or n % 2]
        assert works == written[-KEEP:]
        for work in works:
            mode = stat.S_IMODE(store.path(key, work).stat().st_mode)
            assert mode == 0o600, oct(mode)
    leftovers = [p for p in (tmp_path / RUN).rglob("*") if p.is_file() and p.suffix != ".npz"]
    assert leftovers == []  # no temporary file stays behind
    # the directories it made, whose names are the run's key and the site's, too (the
    # state root was there already: it keeps its own mode)
    made = [tmp_path / RUN, *(p for p in (tmp_path / RUN).rglob("*") if p.is_dir())]
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in made} == {oct(0o700)}


# ============================================================== where they go
def test_the_state_directory_follows_node_config_then_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLPLATFORM_SITE_STATE", str(tmp_path / "env"))
    monkeypatch.setenv("FLPLATFORM_HOME", str(tmp_path / "home"))
    assert state_root({keys.STATE_DIR: str(tmp_path / "node")}) == tmp_path / "node"
    assert state_root({}) == tmp_path / "env"
    monkeypatch.delenv("FLPLATFORM_SITE_STATE")
    assert state_root({}) == tmp_path / "home" / "site-state"
    monkeypatch.delenv("FLPLATFORM_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert state_root({}) == tmp_path / "user" / ".flplatform" / "site-state"


def test_a_simulated_site_is_named_by_its_partition_not_its_node_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLPLATFORM_SITE_STATE", str(tmp_path))
    mod, script, _ = SCRIPTS["fetchsgd"]
    simulated = {keys.PARTITION_ID: 2, keys.NUM_PARTITIONS: 4}
    mod(script(1, ours(1)), context(123, simulated), user_train)
    assert (tmp_path / RUN / "partition-2" / keys.FETCHSGD_STATE).is_dir()
    reply = as_plain(mod(script(2, ours(2)), context(456, simulated), user_train))
    assert reply == uninterrupted(tmp_path / "reference", "fetchsgd", works=2)[1]


def test_a_site_without_a_stable_name_keeps_no_snapshots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLPLATFORM_SITE_STATE", str(tmp_path))
    mod, script, _ = SCRIPTS["codec"]
    ctx = context(5)  # a deployed SuperNode with neither site-name nor partition-id
    replies = [as_plain(mod(script(n, ours(n)), ctx, user_train)) for n in (1, 2)]
    assert list(tmp_path.iterdir()) == []
    today = context(5)
    assert replies == [as_plain(mod(script(n, {}), today, user_train)) for n in (1, 2)]


# ============================================ through the engine and strategies
def _numbered(behave: Callable[[Message], Message]) -> Callable[[Message], Message]:
    """A site reached through an engine that numbers its training messages, as ours does."""
    sent = 0

    def call(msg: Message) -> Message:
        nonlocal sent
        if msg.metadata.message_type == MessageType.TRAIN:
            sent += 1
            config = msg.content.config_records.get(keys.CONFIG, ConfigRecord())
            msg.content[keys.CONFIG] = ConfigRecord({**config, **ours(sent)})
        return behave(msg)

    return call


def _engine_run(tmp_path: Path, algorithm: str, restart_before: int | None) -> dict[str, Any]:
    """Four rounds of the real engine and strategy; site 2 restarts before ``restart_before``."""
    make, _ = ALGORITHMS[algorithm]
    strategy = make()
    contexts = {n: context(n) for n in range(1, 4)}
    sites = {n: digits_site(n - 1, 3, contexts[n]) for n in range(1, 4)}
    for ctx in contexts.values():
        ctx.node_config = {**ctx.node_config, keys.STATE_DIR: str(tmp_path)}
    if restart_before is not None:  # a SuperNode restart: context.state is empty again
        sites[2] = restart_before_round(restart_before, contexts, 2, sites[2])
    grid = ScriptedGrid({n: _numbered(sites[n]) for n in sites})
    summaries: list[RoundSummary] = []
    policy = PeriodSync() if isinstance(strategy, DelayedCompensated) else Synchrony("sync")
    engine = RoundEngine(
        grid,
        strategy,
        policy=policy,
        poll_interval=0.0,
        required_sites=3,
        on_round=summaries.append,
    )
    initial = load_site({keys.PARTITION_ID: 0, keys.NUM_PARTITIONS: 3}, {"dataset": "digits"})
    model = ArrayRecord(initial.build_model(num_classes=10, seed=0).state_dict())
    result = engine.run(
        model, num_rounds=4, train_config=ConfigRecord({keys.LOCAL_STEPS: 3, keys.LR: 0.1})
    )
    # No site lost its state: nothing rejected, no resync noted.
    assert all(u.status == APPLIED and not u.reason for s in summaries for u in s.updates)
    return record_to_arrays(result.arrays)


@pytest.mark.parametrize("algorithm", ["delayed", "fetchsgd", "sketched-sgd", "topk"])
def test_a_restarted_site_with_its_disk_carries_on_as_if_it_had_not(
    tmp_path: Path, algorithm: str
) -> None:
    """The server's strategies and the engine see no state loss, and the model is the same."""
    kept = _engine_run(tmp_path / "kept", algorithm, restart_before=None)
    restarted = _engine_run(tmp_path / "restarted", algorithm, restart_before=3)
    assert list(kept) == list(restarted)
    for name in kept:
        np.testing.assert_array_equal(kept[name], restarted[name], err_msg=name)


def test_forgetting_a_run_deletes_every_sites_snapshots_of_it_and_nothing_else(
    tmp_path: Path,
) -> None:
    node = {keys.STATE_DIR: str(tmp_path)}
    state = ModState({"calls": 1}, {"residual": {"w": np.ones(3, np.float32)}})
    for run_key in ("finished-run", "../escape", "other-run"):
        for site in ("a", "b"):
            SiteSnapshots(state_root(node) / safe_name(run_key) / site).write("k", 1, state)
    outside = tmp_path.parent / "escape"
    outside.mkdir(exist_ok=True)

    forget_run("finished-run", node)
    forget_run("../escape", node)
    forget_run("", node)  # no run key: nothing to forget (never the whole root)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-run"]
    assert outside.is_dir()  # a hostile key stays inside the root (safe_name)


# (Sketched-SGD's work 4 is a values round: no training there to fail)
@pytest.mark.parametrize("case", sorted(set(SCRIPTS) - {"sketched-sgd"}))
def test_a_resent_work_whose_training_fails_leaves_no_later_snapshot(
    tmp_path: Path, case: str
) -> None:
    """Found by a review: on a resume the server sends work 4 again; when the site's
    training of it failed, the codec's snapshots of works 4 and 5 of the abandoned run
    stayed (they were dropped only when the residual was read, after the training), and
    work 5 then read a residual counting an upload the server never had. Each mod now
    reads its state before the user's training: work 5 ends as on a site that never did
    the abandoned works."""
    mod, script, _ = SCRIPTS[case]

    def failing(msg: Message, ctx: Context) -> Message:
        if msg.content[keys.CONFIG][keys.SITE_WORK] == 4:
            raise RuntimeError("CUDA out of memory")
        return user_train(msg, ctx)

    first = site(tmp_path / "resumed")
    for n in range(1, 6):  # the abandoned run got as far as work 5
        mod(script(n, ours(n)), first, user_train)
    resumed = site(tmp_path / "resumed", node_id=9)
    with pytest.raises(RuntimeError, match="out of memory"):
        mod(script(4, ours(4)), resumed, failing)
    got = as_plain(mod(script(5, ours(5)), resumed, user_train))
    reference = site(tmp_path / "reference")  # works 1 to 3, then the failed 4, then 5
    for n in range(1, 4):
        mod(script(n, ours(n)), reference, user_train)
    with pytest.raises(RuntimeError, match="out of memory"):
        mod(script(4, ours(4)), reference, failing)
    assert got == as_plain(mod(script(5, ours(5)), reference, user_train))


def test_a_writer_that_died_mid_write_leaves_no_file_for_ever(tmp_path: Path) -> None:
    """Found by a review: a process killed while writing a snapshot (the OOM killer) left
    its temporary file, model-sized, and every such death another. The next write deletes
    those of dead processes; a live one's (being written) stays."""
    mod, script, (key,) = SCRIPTS["codec"]
    ctx = site(tmp_path)
    mod(script(1, ours(1)), ctx, user_train)
    store = SiteSnapshots.of(ctx, RUN)
    assert store is not None
    folder = store.path(key, 1).parent
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = folder / f".work-000000002.npz.{int(gone.stdout)}.tmp"
    live = folder / f".work-000000009.npz.{os.getpid()}.tmp"  # (not this write's own)
    for path in (dead, live):
        path.write_bytes(b"half a snapshot")
    mod(script(2, ours(2)), ctx, user_train)
    assert not dead.exists() and live.exists()
    assert store.works(key) == [1, 2]
