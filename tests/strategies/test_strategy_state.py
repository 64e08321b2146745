"""A strategy's server state survives a checkpoint: a run cut between rounds goes on bit for bit.

Each test plays the engine for a strategy (begin → configure_train → work_for → scripted
replies → finish) for k rounds, writes ``state_dict()`` to a checkpoint file and reads it
back (``flplatform.core.checkpoint``), loads it into a fresh strategy built with the same
options whose sites have NEW node ids (as a resumed simulation's do), and continues both
the uninterrupted strategy and the restored one with the same replies. The messages they
send, the models they form and their final states must be identical.

Replies are pure functions of (site name, what the message carries), so a wrong download,
config or candidate set after the resume changes the models.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAdam, FedAvgM
from hypothesis import given, settings
from hypothesis import strategies as st

from flplatform.core import keys
from flplatform.core.arrays import arrays_to_record, record_to_arrays
from flplatform.core.checkpoint import CheckpointError, read_state, write_state
from flplatform.core.seeding import derive_seed
from flplatform.engine import EngineStrategy
from flplatform.run.flower_adapter import FlowerStrategyAdapter
from strategies.codecs import make_codec
from strategies.count_sketch import CountSketch
from strategies.delayed import DelayedCompensated
from strategies.fetchsgd import FetchSGD
from strategies.local_sgd import LocalSGDAveraging
from strategies.mods.fetchsgd import SKETCH
from strategies.mods.sketched_sgd import CANDIDATES, VALUES, StepPhase
from strategies.sketched_sgd import SketchedSGD

pytestmark = pytest.mark.usefixtures("task_identity")

SITES = ("amsterdam", "berlin", "cairo")
OLD_IDS = {11: "amsterdam", 12: "berlin", 13: "cairo"}
# A resumed run's sites come back with new ids, in another order.
NEW_IDS = {903: "amsterdam", 902: "berlin", 901: "cairo"}
REMAP = {old: next(n for n, s in NEW_IDS.items() if s == name) for old, name in OLD_IDS.items()}
MODEL = {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4), "b": np.zeros(3, np.float32)}


# ====================================================================== the harness
class Grid:
    """What configure_train asks of a grid: the node ids it may use."""

    def __init__(self, node_ids: list[int]) -> None:
        self.node_ids = node_ids

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)


def rng(*parts: object) -> np.random.Generator:
    return np.random.default_rng(derive_seed(0, *map(str, parts)))


def sent_model(message: Message) -> dict[str, np.ndarray]:
    return record_to_arrays(message.content[keys.ARRAYS])


def reply(message: Message, arrays: dict[str, np.ndarray], examples: int, **extra: Any) -> Message:
    metrics = MetricRecord({keys.NUM_EXAMPLES: examples, keys.TRAIN_LOSS: 0.5, **extra})
    content = RecordDict({keys.ARRAYS: arrays_to_record(arrays), keys.METRICS: metrics})
    return Message(content, reply_to=message)


Respond = Callable[[Message, str], Message | None]  # (message, site name) → reply, or none yet


@dataclass
class Run:
    """One strategy played by a scripted engine: its model, its sites, its in-flight work."""

    strategy: EngineStrategy
    respond: Respond
    names: dict[int, str]  # node id → site name
    model: ArrayRecord = field(default_factory=lambda: arrays_to_record(MODEL))
    version: int = 0
    outstanding: dict[int, Message] = field(default_factory=dict)  # node → message in flight
    sent: list[tuple[Any, ...]] = field(default_factory=list)  # what each round sent
    models: list[dict[str, np.ndarray]] = field(default_factory=list)

    def round(self, server_round: int, passes: int = 1) -> None:
        """One round: dispatch to idle sites, take the replies that are ready, aggregate.

        ``passes`` > 1 lets sites that answered get more work in the same round (a
        pipelined policy's sites working ahead).
        """
        strategy = self.strategy
        strategy.begin_aggregation(server_round, self.model)
        for _ in range(passes):
            idle = [n for n in self.names if n not in self.outstanding]
            config = ConfigRecord({keys.MODEL_VERSION: self.version, "lr": 0.1})
            drafts = list(strategy.configure_train(server_round, self.model, config, Grid(idle)))
            for message in sorted(drafts, key=self._name_of):
                strategy.work_for(message, server_round=server_round, model_version=self.version)
                self.outstanding[message.metadata.dst_node_id] = message
                self.sent.append(describe(message, self._name_of(message)))
            for node in sorted(self.outstanding, key=self.names.__getitem__):
                answer = self.respond(self.outstanding[node], self.names[node])
                if answer is None:
                    continue
                del self.outstanding[node]
                update = strategy.read_update(answer, base=self.model)
                strategy.add_update(update, weight=update.contribution.num_examples)
        arrays, _ = strategy.finish_aggregation()
        if arrays is not None:
            self.model, self.version = arrays, self.version + 1
        self.models.append(record_to_arrays(self.model))

    def _name_of(self, message: Message) -> str:
        return self.names[message.metadata.dst_node_id]

    def resumed(self, strategy: EngineStrategy, path: Path, passes: int = 1) -> Run:
        """A fresh run restored from a checkpoint of this one, its sites with new node ids.

        The model and the in-flight messages are the engine's to restore; here they are
        carried over as they are, re-addressed to the new ids.
        """
        write_state(path, {"strategy": self.strategy.state_dict(), "model": self.model})
        saved = read_state(path)
        strategy.load_state_dict(saved["strategy"], nodes=REMAP)
        outstanding = {
            REMAP[node]: readdressed(message, REMAP[node])
            for node, message in self.outstanding.items()
        }
        return type(self)(
            strategy,
            self.respond,
            dict(NEW_IDS),
            model=saved["model"],
            version=self.version,
            outstanding=outstanding,
        )


def readdressed(message: Message, node: int) -> Message:
    return Message(message.content, dst_node_id=node, message_type=message.metadata.message_type)


def describe(message: Message, name: str) -> tuple[Any, ...]:
    """What a message asks of its site, without node ids: its config and array bytes."""
    content = message.content
    config = tuple(sorted(content.config_records.get(keys.CONFIG, ConfigRecord()).items()))
    arrays = tuple(
        (record_name, tuple((k, v.numpy().tobytes()) for k, v in record.items()))
        for record_name, record in content.array_records.items()
    )
    return (name, config, arrays)


def same(a: Any, b: Any, where: str = "state") -> None:
    """Deep, exact equality of two state trees (dict order, dtypes and bits included)."""
    if isinstance(a, np.ndarray | torch.Tensor):
        a, b = np.asarray(a), np.asarray(b)
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert a.tobytes() == b.tobytes(), where
    elif isinstance(a, ArrayRecord):
        same(record_to_arrays(a), record_to_arrays(b), where)
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping), where
        if all(isinstance(k, int) for k in a):
            # Keyed by node id (or period): the order follows the ids, which a resumed run
            # draws anew; no strategy's arithmetic depends on it.
            assert sorted(a) == sorted(b), where
        else:  # array names: the model's own order
            assert list(a) == list(b), where
        for key in a:
            same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"


def renamed(state: dict[str, Any], make: Callable[[], EngineStrategy]) -> dict[str, Any]:
    """``state`` as a run with the new node ids holds it (through a third strategy)."""
    strategy = make()
    strategy.load_state_dict(state, nodes=REMAP)
    return strategy.state_dict()


def check_resume(
    make: Callable[[], EngineStrategy],
    respond: Respond,
    *,
    cut: int,
    rounds: int,
    path: Path,
    passes: int = 1,
) -> tuple[Run, Run]:
    """Run ``rounds`` uninterrupted and cut after ``cut``; both must agree bit for bit."""
    whole = Run(make(), respond, dict(OLD_IDS))
    for r in range(1, cut + 1):
        whole.round(r, passes)
    restored = whole.resumed(make(), path, passes)
    mark = len(whole.sent)
    for r in range(cut + 1, rounds + 1):
        whole.round(r, passes)
        restored.round(r, passes)
    assert restored.sent == whole.sent[mark:]
    for before, after in zip(whole.models[cut:], restored.models, strict=True):
        same(before, after, "model")
    same(renamed(whole.strategy.state_dict(), make), restored.strategy.state_dict())
    return whole, restored


# ====================================================================== replies
def model_reply(message: Message, name: str) -> Message:
    """Flower's convention: the model after local training (a deterministic nudge)."""
    start = sent_model(message)
    round_ = message.content[keys.CONFIG][keys.SERVER_ROUND]
    nudge = rng(name, round_)
    trained = {k: (v + 0.1 * nudge.normal(size=v.shape)).astype(v.dtype) for k, v in start.items()}
    return reply(message, trained, examples=10 + SITES.index(name))


def codec_reply(codec: str) -> Respond:
    """The codec mod's reply: the delta, compressed (no residual: the server cannot tell)."""

    def respond(message: Message, name: str) -> Message:
        round_ = message.content[keys.CONFIG][keys.SERVER_ROUND]
        delta = {
            k: rng(name, round_, k).normal(size=v.shape).astype(v.dtype) for k, v in MODEL.items()
        }
        # A site with a residual says it kept it; the ledger would show a lost one.
        wire = make_codec(codec).encode(delta, rng=rng(name, round_, "codec"))
        answer = reply(message, wire, examples=5 + SITES.index(name))
        answer.content[keys.CONFIG] = ConfigRecord({keys.CODEC: codec})
        return answer

    return respond


# ====================================================================== local-SGD
@pytest.mark.parametrize(
    ("options", "respond"),
    [
        ({"beta": 0.9, "eta": 0.7}, model_reply),
        ({"beta": 0.5, "codec": "int8"}, codec_reply("int8")),
        ({"aggregator": "median"}, model_reply),
        ({"beta": 0.9, "eta": 0.7, "nesterov": True}, model_reply),
        # cut 1 and 3: inside and at the end of a period of the delayed momentum
        ({"beta": 0.9, "nesterov": True, "momentum_every": 3}, model_reply),
        ({"aggregator": "centered-clip", "clip_radius": 0.5}, model_reply),
        ({"aggregator": "centered-clip", "beta": 0.5, "codec": "int8"}, codec_reply("int8")),
    ],
    ids=[
        "server-momentum",
        "momentum-and-codec",
        "median",
        "nesterov",
        "delayed-nesterov",
        "centered-clip",
        "centered-clip-and-codec",
    ],
)
@pytest.mark.parametrize("cut", [1, 3])
def test_local_sgd_resumes_bit_for_bit(
    options: dict[str, Any], respond: Respond, cut: int, tmp_path: Path
) -> None:
    whole, restored = check_resume(
        lambda: LocalSGDAveraging(**options), respond, cut=cut, rounds=5, path=tmp_path / "s.npz"
    )
    strategy = restored.strategy
    assert isinstance(strategy, LocalSGDAveraging)
    if "codec" in options:  # every site is told to expect its residual, under its new id
        assert strategy.state_dict()["compressing"] == set(NEW_IDS)
        assert all(dict(m[1])[keys.STATE_EXPECTED] for m in restored.sent)


@settings(max_examples=8, deadline=None)
@given(cut=st.integers(1, 5))
def test_any_cut_point_of_local_sgd_with_momentum_and_a_codec_continues_the_run(cut: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        check_resume(
            lambda: LocalSGDAveraging(beta=0.9, codec="topk:3"),
            codec_reply("topk:3"),
            cut=cut,
            rounds=6,
            path=Path(folder) / "s.npz",
        )


# ====================================================================== delayed
class DelayedSites:
    """Sites answering their period q once round q − lead is open: lead 0 waits for the
    round (slow), lead 2 answers at once (fast: D = 2 periods ahead)."""

    def __init__(self, lead: Mapping[str, int]) -> None:
        self.lead = lead
        self.open_round = 0  # set by DelayedRun, as the engine's policy would know it
        self.targets = {name: rng(name, "target").normal(size=(3, 4)) for name in SITES}

    def __call__(self, message: Message, name: str) -> Message | None:
        period = message.content[keys.CONFIG][keys.SERVER_ROUND]
        if period > self.open_round + self.lead[name]:
            return None
        start = sent_model(message)
        # A_{n,q}: a step toward the site's target from the (stale) model it was sent.
        step = {"w": 0.3 * (self.targets[name] - start["w"]), "b": np.full(3, 0.1 * period)}
        arrays = {k: v.astype(np.float32) for k, v in step.items()}
        return reply(message, arrays, examples=10 * (1 + SITES.index(name)), period=period)


LEADS = {"amsterdam": 0, "berlin": 1, "cairo": 2}


class DelayedRun(Run):
    def round(self, server_round: int, passes: int = 1) -> None:
        assert isinstance(self.respond, DelayedSites)
        self.respond.open_round = server_round
        super().round(server_round, passes)


@pytest.mark.parametrize("cut", [2, 3, 5])
def test_delayed_d2_resumes_with_work_drafted_but_not_answered(cut: int, tmp_path: Path) -> None:
    def make() -> DelayedCompensated:
        return DelayedCompensated(delay=2, num_rounds=8, eta=0.8)

    whole = DelayedRun(make(), DelayedSites(LEADS), dict(OLD_IDS))
    for r in range(1, cut + 1):
        whole.round(r, passes=3)
    # The cut falls with work in flight and updates of later periods already summed.
    saved = whole.strategy.state_dict()
    assert whole.outstanding and saved["awaited"]
    assert any(period > cut for period in saved["open"])
    restored = whole.resumed(make(), tmp_path / "s.npz")
    mark = len(whole.sent)
    for r in range(cut + 1, 9):
        whole.round(r, passes=3)
        restored.round(r, passes=3)
    assert restored.sent == whole.sent[mark:]
    for before, after in zip(whole.models[cut:], restored.models, strict=True):
        same(before, after, "model")
    same(renamed(whole.strategy.state_dict(), make), restored.strategy.state_dict())


# ====================================================================== sketched
def sketch_of(vector: np.ndarray, strategy_seed: int, rows: int, cols: int) -> np.ndarray:
    sketch = CountSketch.from_seed(len(vector), rows=rows, cols=cols, seed=strategy_seed)
    return sketch.sketch(torch.from_numpy(vector.astype(np.float32))).numpy()


D = 15  # coordinates of MODEL


def fetchsgd_reply(seed: int, rows: int, cols: int) -> Respond:
    def respond(message: Message, name: str) -> Message:
        config = message.content[keys.CONFIG]
        round_ = config[keys.SERVER_ROUND]
        # The delta depends on what the site was sent (a sparse download or the model).
        download = np.concatenate([v.ravel() for v in sent_model(message).values()])
        g = rng(name, round_).normal(size=D) + 0.01 * download.sum()
        return reply(message, {SKETCH: sketch_of(g, seed, rows, cols)}, 10 + SITES.index(name))

    return respond


@pytest.mark.parametrize("cut", [1, 2, 4])
def test_fetchsgd_resumes_bit_for_bit(cut: int, tmp_path: Path) -> None:
    def make() -> FetchSGD:
        return FetchSGD(k=4, sketch_rows=3, sketch_cols=12, rho=0.9, eta=0.5, seed=3)

    probe = make()
    respond = fetchsgd_reply(probe.sketch_seed, 3, 12)
    whole, _ = check_resume(make, respond, cut=cut, rounds=6, path=tmp_path / "s.npz")
    saved = whole.strategy.state_dict()
    assert saved["momentum"].shape == (3, 12) and saved["model"]["synced"]


def sketched_reply(seed: int, rows: int, cols: int) -> Respond:
    """Sketch round: S(v) of a vector fixed by (site, round); values round: v there."""

    def v_of(name: str, round_: int) -> np.ndarray:
        return rng(name, round_, "v").normal(size=D).astype(np.float32)

    def respond(message: Message, name: str) -> Message:
        config = message.content[keys.CONFIG]
        if config[keys.STEP_PHASE] == StepPhase.VALUES.value:
            candidates = record_to_arrays(message.content[keys.ARRAYS])[CANDIDATES]
            v = v_of(name, config[keys.SKETCHED_ROUND])
            return reply(message, {VALUES: v[candidates]}, 10 + SITES.index(name))
        table = sketch_of(v_of(name, config[keys.SERVER_ROUND]), seed, rows, cols)
        return reply(message, {SKETCH: table}, 10 + SITES.index(name))

    return respond


@pytest.mark.parametrize(
    ("cut", "phase"), [(1, StepPhase.VALUES), (2, StepPhase.SKETCH), (5, StepPhase.VALUES)]
)
def test_sketched_sgd_resumes_after_a_sketch_round_and_after_a_values_round(
    cut: int, phase: StepPhase, tmp_path: Path
) -> None:
    def make() -> SketchedSGD:
        return SketchedSGD(k=3, sketch_rows=3, sketch_cols=20, candidate_factor=2, seed=5)

    probe = make()
    respond = sketched_reply(probe.sketch_seed, 3, 20)
    whole = Run(make(), respond, dict(OLD_IDS))
    for r in range(1, cut + 1):
        whole.round(r)
    strategy = whole.strategy
    assert isinstance(strategy, SketchedSGD)
    # the phase the NEXT round runs: after a sketch round, the values round
    assert strategy.state.phase is phase
    check_resume(make, respond, cut=cut, rounds=8, path=tmp_path / "s.npz")


# ====================================================================== Flower
@pytest.mark.parametrize(
    "make",
    [
        lambda: FedAdam(fraction_evaluate=0.0, eta=0.05, beta_1=0.9, beta_2=0.99),
        lambda: FedAvgM(fraction_evaluate=0.0, server_momentum=0.9),
    ],
    ids=["FedAdam", "FedAvgM"],
)
def test_a_stateful_flower_strategy_resumes_through_the_adapter(
    make: Callable[[], Any], tmp_path: Path
) -> None:
    whole, restored = check_resume(
        lambda: FlowerStrategyAdapter(make()), model_reply, cut=2, rounds=4, path=tmp_path / "s"
    )
    flower = restored.strategy.state_dict()["flower"]  # type: ignore[attr-defined]
    assert any(flower.get(name) is not None for name in ("m_t", "momentum_vector"))


# ====================================================================== bad states
def _trained_local_sgd() -> LocalSGDAveraging:
    run = Run(LocalSGDAveraging(beta=0.9, codec="int8"), codec_reply("int8"), dict(OLD_IDS))
    run.round(1)
    run.round(2)
    assert isinstance(run.strategy, LocalSGDAveraging)
    return run.strategy


def test_a_bad_local_sgd_state_names_every_problem_and_changes_nothing() -> None:
    strategy = _trained_local_sgd()
    before = strategy.state_dict()
    bad = strategy.state_dict()
    bad["velocity"]["w"] = np.zeros(5)
    del bad["compressing"]
    with pytest.raises(CheckpointError) as caught:
        strategy.load_state_dict(bad)
    message = str(caught.value)
    assert "'velocity.w' has shape (5,), this run needs (3, 4)" in message
    assert "'compressing' is missing" in message
    same(before, strategy.state_dict())


def test_a_node_the_map_does_not_hold_is_refused() -> None:
    strategy = _trained_local_sgd()
    before = strategy.state_dict()
    with pytest.raises(CheckpointError, match="names node 13, which the node map does not hold"):
        strategy.load_state_dict(strategy.state_dict(), nodes={11: 1, 12: 2})
    same(before, strategy.state_dict())


def test_delayed_nesterov_state_is_checked_like_the_velocity() -> None:
    def make() -> LocalSGDAveraging:
        return LocalSGDAveraging(beta=0.9, nesterov=True, momentum_every=2)

    run = Run(make(), model_reply, dict(OLD_IDS))
    run.round(1)  # mid-period: a pending sum, no velocity yet
    strategy = run.strategy
    state = strategy.state_dict()
    assert state["steps"] == 1 and not state["velocity"] and set(state["pending"]) == {"w", "b"}
    bad = strategy.state_dict()
    bad["pending"]["w"] = np.full((3, 4), np.nan)
    del bad["steps"]
    with pytest.raises(CheckpointError) as caught:
        strategy.load_state_dict(bad)
    assert "'pending.w'" in str(caught.value) and "'steps' is missing" in str(caught.value)
    same(state, strategy.state_dict())
    # A run whose momentum moves at another period cannot take the pending sum over.
    for other in (1, 3):
        with pytest.raises(CheckpointError, match=f"server-momentum-every 2, this run has {other}"):
            LocalSGDAveraging(beta=0.9, nesterov=True, momentum_every=other).load_state_dict(state)


def test_delayed_nesterov_keeps_running_statistics_in_the_models_order() -> None:
    # Running statistics (averaged, no momentum) beside a weight: the saved velocity and
    # pending sum hold every array in the model's order at any step, and a strategy that
    # knows the model takes them back.
    model = {"w": np.zeros((3, 4), np.float32), "bn.running_mean": np.zeros(3, np.float32)}

    def respond(message: Message, name: str) -> Message:
        start = sent_model(message)
        nudge = rng(name, message.content[keys.CONFIG][keys.SERVER_ROUND])
        trained = {k: (v + nudge.normal(size=v.shape)).astype(v.dtype) for k, v in start.items()}
        return reply(message, trained, examples=10)

    def make() -> LocalSGDAveraging:
        return LocalSGDAveraging(beta=0.9, nesterov=True, momentum_every=2)

    run = Run(make(), respond, dict(OLD_IDS), model=arrays_to_record(model))
    for server_round in (1, 2, 3):
        run.round(server_round)
        state = run.strategy.state_dict()
        assert list(state["pending"]) == list(model)
        assert list(state["velocity"]) == ([] if server_round == 1 else list(model))
        assert not state["velocity"].get("bn.running_mean", np.zeros(1)).any()
        run.strategy.load_state_dict(state)  # knows the model: names, order and shapes checked


def test_momentum_saved_for_a_run_without_momentum_is_refused() -> None:
    state = _trained_local_sgd().state_dict()
    with pytest.raises(CheckpointError, match="no server momentum"):
        LocalSGDAveraging(codec="int8").load_state_dict(state)


def test_centered_clip_state_is_checked_and_needs_the_same_aggregator() -> None:
    def make() -> LocalSGDAveraging:
        return LocalSGDAveraging(aggregator="centered-clip")

    run = Run(make(), model_reply, dict(OLD_IDS))
    for server_round in (1, 2):
        run.round(server_round)
    strategy = run.strategy
    state = strategy.state_dict()
    assert list(state["center"]) == list(MODEL) and len(state["distances"]) == 2
    bad = strategy.state_dict()
    bad["center"]["w"] = np.zeros(7)
    bad["distances"] = [[1.0, -2.0]]
    with pytest.raises(CheckpointError) as caught:
        strategy.load_state_dict(bad)
    message = str(caught.value)
    assert "'center.w' has shape (7,), this run needs (3, 4)" in message
    assert "'distances' must be a finite number >= 0.0, got -2.0" in message
    same(state, strategy.state_dict())
    # The centre means nothing to another aggregator, and another's state lacks it.
    with pytest.raises(
        CheckpointError, match="saved with aggregator centered-clip, this run has mean"
    ):
        LocalSGDAveraging().load_state_dict(state)
    with pytest.raises(CheckpointError, match="saved without aggregator centered-clip"):
        make().load_state_dict(LocalSGDAveraging().state_dict())


def test_a_bad_fetchsgd_state_names_every_problem_and_changes_nothing() -> None:
    def make() -> FetchSGD:
        return FetchSGD(k=4, sketch_rows=3, sketch_cols=12, seed=3)

    run = Run(make(), fetchsgd_reply(make().sketch_seed, 3, 12), dict(OLD_IDS))
    run.round(1)
    strategy = run.strategy
    before = strategy.state_dict()
    bad = strategy.state_dict()
    bad["error"] = np.zeros((3, 11), np.float32)
    bad["model"]["flat"] = bad["model"]["flat"].astype(np.float64)
    del bad["model"]["synced"]
    with pytest.raises(CheckpointError) as caught:
        strategy.load_state_dict(bad)
    message = str(caught.value)
    assert message.startswith("cannot restore FetchSGD from the checkpoint: ")
    assert "'error' has shape (3, 11), this run needs (3, 12)" in message
    assert "'model.synced' is missing" in message
    same(before, strategy.state_dict())
    # A fresh strategy with other sketch settings refuses the tables too.
    other = FetchSGD(k=4, sketch_rows=5, sketch_cols=12, seed=3)
    with pytest.raises(CheckpointError, match="'momentum' has shape \\(3, 12\\), this run needs"):
        other.load_state_dict(before)


def test_a_bad_delayed_state_is_refused_and_changes_nothing() -> None:
    run = DelayedRun(
        DelayedCompensated(delay=2, num_rounds=8),
        DelayedSites(LEADS),
        dict(OLD_IDS),
    )
    for r in (1, 2, 3):
        run.round(r, passes=3)
    strategy = run.strategy
    before = strategy.state_dict()
    bad = strategy.state_dict()
    del bad["open"]
    bad["models"] = {0: bad["models"][max(bad["models"])]}
    with pytest.raises(CheckpointError) as caught:
        strategy.load_state_dict(bad)
    message = str(caught.value)
    assert "'open' is missing" in message
    with pytest.raises(CheckpointError, match="lacks the current version 3"):
        DelayedCompensated(delay=2, num_rounds=8).load_state_dict(
            {**before, "models": bad["models"]}
        )
    with pytest.raises(
        CheckpointError, match="holds versions \\[0, 1\\], outside 2…3 of a run with delay 0"
    ):
        shallow = DelayedCompensated(delay=0, num_rounds=8)
        shallow.load_state_dict(before)  # versions 0…3 kept: not a run with D = 0
    same(before, strategy.state_dict())


def test_a_bad_sketched_sgd_state_is_refused_and_changes_nothing() -> None:
    def make() -> SketchedSGD:
        return SketchedSGD(k=3, sketch_rows=3, sketch_cols=20, seed=5)

    run = Run(make(), sketched_reply(make().sketch_seed, 3, 20), dict(OLD_IDS))
    for r in (1, 2, 3):
        run.round(r)
    strategy = run.strategy
    before = strategy.state_dict()
    bad = strategy.state_dict()
    bad["step"]["phase"] = "gather"
    bad["step"]["candidates"] = np.array([0, D + 4])
    with pytest.raises(CheckpointError) as caught:
        strategy.load_state_dict(bad)
    message = str(caught.value)
    assert "'step.phase' must be one of ['sketch', 'values']" in message
    assert f"'step.candidates' holds coordinates outside [0, {D})" in message
    same(before, strategy.state_dict())


def test_a_bad_flower_state_is_refused_and_leaves_random_alone() -> None:
    import random

    run = Run(
        FlowerStrategyAdapter(FedAdam(fraction_evaluate=0.0, beta_1=0.9)),
        model_reply,
        dict(OLD_IDS),
    )
    run.round(1)
    strategy = run.strategy
    before = strategy.state_dict()
    bad = strategy.state_dict()
    bad["flower"]["m_t"] = {"w": np.zeros((3, 4), np.float32)}
    bad["random"] = (3, (1, 2), None)
    position = random.getstate()
    with pytest.raises(CheckpointError) as caught:
        strategy.load_state_dict(bad)
    message = str(caught.value)
    assert "cannot restore FlowerStrategyAdapter(FedAdam)" in message
    assert "'flower.m_t' holds arrays ['w'], this run's model has ['w', 'b']" in message
    assert "'random' is not a state of Python's random module" in message
    assert random.getstate() == position
    same(before, strategy.state_dict())


def test_a_stateless_state_loads_into_a_fresh_strategy_before_any_round() -> None:
    # Nothing ran yet: a checkpoint of round 0 restores to the same fresh strategies.
    for make in (
        lambda: LocalSGDAveraging(beta=0.9),
        lambda: FetchSGD(k=2),
        lambda: SketchedSGD(k=2),
        lambda: DelayedCompensated(delay=1, num_rounds=3),
    ):
        state = make().state_dict()
        fresh = make()
        fresh.load_state_dict(state, nodes={})
        same(state, fresh.state_dict())
