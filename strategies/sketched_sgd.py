"""Sketched-SGD: two rounds per step; sites keep momentum and error, the server finds heavy hitters.

ALGORITHMS.md §3 (Ivkin et al., "Communication-efficient Distributed SGD with Sketching",
2019). One step takes two rounds of the round engine, each a row in the ledger:

* **Sketch round.** Server → site: the coordinates changed since the version the site holds
  (``strategies.sparse_sync``), and which applied coordinates to zero. Site: trains p local
  steps from x; its update g is the delta x_n − x; u ← m·u + g, v ← v + u (``u``, ``v`` kept
  in the site's persistent state); replies with the count sketch S(v) (r × c float32).
* **Values round.** Server: the weighted mean of the tables, estimates of every coordinate,
  and the P·k of largest magnitude as candidates; it asks each site whose sketch it took for
  v at those candidates (P·k indices down, P·k float32 values up). Server: the exact
  weighted mean of those values; Δ = its top k; x ← x + η·Δ.

A site whose values went into Δ zeroes u and v at Δ's coordinates when it next hears from
the server (carried by its next sketch-round message, once, whatever is lost on the way); a
site whose values did not arrive keeps them, so its work reaches a later step. With k = d
every coordinate is a candidate and applied, u and v are zeroed whole each step, and the
method is local-SGD averaging with server learning rate η.

Learning rate and momentum: the site's lr is inside g; m (``step-momentum`` in the run
config: the step's momentum, kept at the sites because only they hold dense vectors) and
η (``server-lr``) act on the steps. Running statistics and integer arrays
(``strategies.averaged_arrays``) are not sketched or accumulated: each site sends their
trained values whole with its values, and the step sets them to the weighted mean (the
sites' sketches' weights), as FedAvg would.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid

from flplatform.core import keys
from flplatform.core.arrays import arrays_to_record
from flplatform.core.checks import require
from flplatform.core.errors import ConfigError, StepRefused, UpdateRejected
from flplatform.core.reply_checks import check_num_examples, reply_parts
from flplatform.core.state import MISSING, StateReader
from flplatform.engine import Contribution, Update
from flplatform.engine.replies import first_number
from strategies.averaged_arrays import AVERAGED
from strategies.count_sketch import CountSketch, sketch_device
from strategies.knobs import SketchedSGDKnobs
from strategies.local_sgd import lost_without_update, reject_state_lost, state_lost_note
from strategies.mods.sketched_sgd import (
    CANDIDATES,
    VALUES,
    ZERO,
    ZERO_INDICES,
    StepPhase,
)
from strategies.sampling import sample_sites
from strategies.sketch_feedback import candidate_coordinates, exact_top_k
from strategies.sketched_common import (
    AveragedSum,
    SketchedStrategy,
    averaged_changes,
    judged_averaged,
    sketch_table,
)
from strategies.sparse_sync import SparseModel
from strategies.top_k import index_dtype

log = logging.getLogger("flplatform.strategies.sketched_sgd")

SITE_ALGORITHM = keys.SKETCHED_SGD


@dataclass
class SketchedSGDState:
    """The server's state between rounds: the step in progress and what sites are owed.

    A step is a sketch round (``phase`` SKETCH: candidates chosen from the sketches of
    ``contributors``) then a values round (``phase`` VALUES). Each site whose values went
    into step s is owed the zeroing of ``applied[s]`` (``pending_zero``), carried by its
    next sketch-round message (``zero_sent``, until it answers). The model and what each
    site holds of it are the ``SparseModel``'s.
    """

    phase: StepPhase = StepPhase.SKETCH  # what the next round asks of the sites
    candidates: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    sketch_round: int = 0  # the round whose sketches chose the candidates
    contributors: dict[int, float] = field(default_factory=dict)  # node → its sketch's weight
    pending_zero: dict[int, int] = field(default_factory=dict)  # node → step it must zero
    applied: dict[int, torch.Tensor] = field(default_factory=dict)  # step → its coordinates
    zero_sent: dict[int, int] = field(default_factory=dict)  # node → zero step in flight
    sketched: set[int] = field(default_factory=set)  # sites holding accumulators

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint data: coordinates as int64 arrays, node ids as they are."""
        return {
            "phase": self.phase.value,
            "candidates": self.candidates.numpy().astype(np.int64),
            "sketch_round": self.sketch_round,
            "contributors": dict(self.contributors),
            "pending_zero": dict(self.pending_zero),
            "applied": {step: i.numpy().astype(np.int64) for step, i in self.applied.items()},
            "zero_sent": dict(self.zero_sent),
            "sketched": set(self.sketched),
        }

    @classmethod
    def read(
        cls, reader: StateReader, state: Any, where: str, *, d: int
    ) -> SketchedSGDState | None:
        """The state ``state_dict()`` wrote, for a model of d coordinates."""
        names = ("phase", "candidates", "sketch_round", "contributors", "pending_zero")
        fields = reader.fields(state, where, *names, "applied", "zero_sent", "sketched")
        if fields is None:
            return None
        phases = [p.value for p in StepPhase]
        if fields["phase"] is not MISSING and fields["phase"] not in phases:
            reader.add(f"'{where}.phase' must be one of {phases}, got {fields['phase']!r:.40}")
        candidates = reader.indices(fields["candidates"], f"{where}.candidates", d=d)
        sketch_round = reader.integer(fields["sketch_round"], f"{where}.sketch_round", minimum=0)

        def weight(value: Any, at: str) -> float | None:
            return reader.real(value, at, minimum=0.0)

        def step(value: Any, at: str) -> int | None:
            return reader.integer(value, at, minimum=1)

        contributors = reader.keyed(
            fields["contributors"], f"{where}.contributors", weight, by_node=True
        )
        pending = reader.keyed(fields["pending_zero"], f"{where}.pending_zero", step, by_node=True)
        applied = reader.keyed(
            fields["applied"], f"{where}.applied", lambda v, at: reader.indices(v, at, d=d)
        )
        zero_sent = reader.keyed(fields["zero_sent"], f"{where}.zero_sent", step, by_node=True)
        sketched = reader.node_set(fields["sketched"], f"{where}.sketched")
        if pending is not None and applied is not None:
            lacking = sorted(set(pending.values()) - set(applied))
            if lacking:
                reader.add(f"'{where}.pending_zero' names steps {lacking} that 'applied' lacks")
        parts = (candidates, sketch_round, contributors, pending, applied, zero_sent, sketched)
        if any(p is None for p in parts) or reader.problems.problems:
            return None
        return cls(
            phase=StepPhase(fields["phase"]),
            candidates=torch.from_numpy(candidates),
            sketch_round=sketch_round or 0,
            contributors=contributors or {},
            pending_zero=pending or {},
            applied={s: torch.from_numpy(i) for s, i in (applied or {}).items()},
            zero_sent=zero_sent or {},
            sketched=sketched or set(),
        )


class SketchedSGD(SketchedStrategy):
    """Sketched-SGD as a Flower Message-API strategy, driven by the round engine.

    Parameters
    ----------
    k : int
        Coordinates applied per step.
    sketch_rows, sketch_cols : int
        r (odd) and c of the count sketch; c = 0 means 5·k.
    candidate_factor : int
        P: the values round asks for the P·k coordinates of largest estimate.
    momentum : float
        m, the step momentum the sites keep (u ← m·u + g).
    eta : float
        Server learning rate: x ← x + η·Δ.
    fraction_train, fraction_evaluate : float
        Seeded sampling of sites per sketch round, as local-SGD averaging.
    seed : int
        The run's seed; the sketch's hashes derive from it.
    averaged_arrays : sequence of str
        Arrays (names or shell patterns) sent whole and set to the sites' weighted mean
        (``SketchedStrategy``).
    """

    def __init__(
        self,
        *,
        k: int,
        sketch_rows: int = 5,
        sketch_cols: int = 0,
        candidate_factor: int = 2,
        momentum: float = 0.0,
        eta: float = 1.0,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 0.0,
        seed: int = 0,
        averaged_arrays: Sequence[str] = (),
    ) -> None:
        require(
            SketchedSGDKnobs(
                k=k,
                sketch_rows=sketch_rows,
                sketch_cols=sketch_cols,
                fraction_train=fraction_train,
                fraction_evaluate=fraction_evaluate,
                averaged_arrays=averaged_arrays,
                candidate_factor=candidate_factor,
                momentum=momentum,
                eta=eta,
            ).problems()
        )
        super().__init__(  # the knobs were checked above, all at once
            site_algorithm=SITE_ALGORITHM,
            k=k,
            sketch_rows=sketch_rows,
            sketch_cols=sketch_cols,
            fraction_train=fraction_train,
            fraction_evaluate=fraction_evaluate,
            seed=seed,
            averaged_arrays=averaged_arrays,
        )
        # floats on the wire whatever the caller gave (momentum=0 was sent as an integer)
        self.candidate_factor, self.momentum, self.eta = candidate_factor, float(momentum), eta
        self.sketch: CountSketch | None = None  # fixed once the model is known
        self.state = SketchedSGDState()  # the step in progress and what sites are owed
        # ---- this round (begin_aggregation starts them afresh: not checkpointed)
        self._round_phase, self._round = StepPhase.SKETCH, 0
        self._asked: set[int] = set()
        self._answered: set[int] = set()
        self._sum: torch.Tensor | None = None  # Σ w·S(v) or Σ w·v[candidates]
        self._averaged = AveragedSum()  # the arrays sent whole with this round's values
        self._weight = 0.0
        self._loss = (0.0, 0.0)

    def summary(self) -> None:
        """Log the configuration."""
        log.info(
            "Sketched-SGD: k=%s P=%s sketch=%sx%s momentum=%s eta=%s",
            self.k,
            self.candidate_factor,
            self.rows,
            self.cols,
            self.momentum,
            self.eta,
        )

    def _use(self, arrays: ArrayRecord) -> None:
        if self.model.adopt(arrays):
            if self.k > self.model.size:
                raise ConfigError(f"k must be at most the model's {self.model.size} parameters")
            self.sketch = CountSketch.from_seed(
                self.model.size, rows=self.rows, cols=self.cols, seed=self.sketch_seed
            )

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``SketchedSGDState`` and the sparse-sync model; the round's sums are not in it
        (``begin_aggregation`` starts them afresh, after a sketch round or a values round).
        """
        return {"step": self.state.state_dict(), "model": self.model.state_dict()}

    def load_state_dict(
        self, state: Mapping[str, Any], *, nodes: Mapping[int, int] | None = None
    ) -> None:
        """Restore ``state_dict()``; ``CheckpointError`` lists every problem, nothing changed."""
        reader = StateReader(type(self).__name__, nodes)
        fields = reader.fields(state, "", "step", "model")
        if fields is None:
            reader.raise_if_any()
            return
        model = SparseModel.read(reader, fields["model"], "model", self.averaged_arrays)
        d = 0 if model is None else model.size
        step = SketchedSGDState.read(reader, fields["step"], "step", d=d)
        if model is not None:
            if model.layout is not None and self.k > model.size:
                reader.add(f"k = {self.k} exceeds the saved model's {model.size} parameters")
            if self.model.layout is not None and model.layout != self.model.layout:
                reader.add("the saved model is not the model this run holds")
        reader.raise_if_any()
        assert model is not None and step is not None  # a problem was noted otherwise
        sketch = None
        if model.layout is not None:
            sketch = CountSketch.from_seed(
                model.size, rows=self.rows, cols=self.cols, seed=self.sketch_seed
            )
        self.model, self.state, self.sketch = model, step, sketch

    # ------------------------------------------------------------ Flower hooks
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sketch round: sync and train; values round: ask the sketches' sites for values."""
        self._use(arrays)
        self._open(server_round)
        nodes = list(grid.get_node_ids())  # the engine's order: by site name
        if self._round_phase == StepPhase.VALUES:
            # Asked again while unanswered: a site drawn as away (simulated availability)
            # got nothing; one whose reply failed is not offered work again this round.
            wanted = [n for n in nodes if n in self.state.contributors and n not in self._answered]
            if wanted or self._asked:
                return [self._values_request(n, server_round, config) for n in wanted]
            # Every site whose sketch chose the candidates is gone: start the step afresh.
            log.warning(
                "round %s: no site that sent a sketch is here; sketching again", server_round
            )
            self._round_phase = self.state.phase = StepPhase.SKETCH
            self.state.contributors = {}
        sampled = sample_sites(self.seed, server_round, nodes, self.fraction_train)
        return [self._sketch_request(n, server_round, config) for n in sampled]

    def _sketch_request(self, node_id: int, server_round: int, config: ConfigRecord) -> Message:
        zero_step = self.state.pending_zero.get(node_id, 0)
        extra = {
            keys.STEP_PHASE: StepPhase.SKETCH.value,
            keys.STEP_MOMENTUM: self.momentum,
            keys.ZERO_STEP: zero_step,
            keys.STATE_EXPECTED: node_id in self.state.sketched,
        }
        content, sync_from = self._sketch_content(node_id, server_round, config, **extra)
        # The step's coordinates are exactly this sync's when the site holds the version
        # before it and that step is the latest: then they travel once.
        if zero_step and not (sync_from == zero_step - 1 and self.model.version == zero_step):
            indices = self.state.applied[zero_step].numpy().astype(index_dtype(self.model.size))
            content[ZERO] = arrays_to_record({ZERO_INDICES: indices})
        if zero_step:
            self.state.zero_sent[node_id] = zero_step
        return Message(content, dst_node_id=node_id, message_type=MessageType.TRAIN)

    def _values_request(self, node_id: int, server_round: int, config: ConfigRecord) -> Message:
        self._asked.add(node_id)
        site_config = ConfigRecord(dict(config))
        site_config.update(
            {
                keys.SERVER_ROUND: server_round,
                keys.SITE_ALGORITHM: SITE_ALGORITHM,
                keys.STEP_PHASE: StepPhase.VALUES.value,
                keys.SKETCHED_ROUND: self.state.sketch_round,
                # No training: the virtual clock books no compute for it.
                keys.LOCAL_STEPS: 0,
                keys.LOCAL_EPOCHS: 0,
                **self.averaged_config(),
            }
        )
        indices = self.state.candidates.numpy().astype(index_dtype(self.model.size))
        content = RecordDict(
            {keys.ARRAYS: arrays_to_record({CANDIDATES: indices}), keys.CONFIG: site_config}
        )
        return Message(content, dst_node_id=node_id, message_type=MessageType.TRAIN)

    # ------------------------------------------------- streaming aggregation
    def _open(self, server_round: int) -> None:
        """This round's phase and whom it asks, set once, by whichever hook comes first:
        the engine begins a round before it drafts its messages, Flower's own loop
        (``configure_train`` then the batch ``aggregate_train``) drafts them first."""
        if server_round == self._round:
            return
        self._round_phase = self.state.phase
        self._round = server_round
        self._asked, self._answered = set(), set()

    def begin_aggregation(self, server_round: int, arrays: ArrayRecord) -> None:
        """Start this round: a sketch round or the values round of the step in progress."""
        self._use(arrays)
        self._open(server_round)
        self._sum, self._weight, self._loss = None, 0.0, (0.0, 0.0)
        self._averaged = AveragedSum()
        if self.state.phase == StepPhase.SKETCH:
            self.state.contributors = {}

    def read_update(self, reply: Message, *, base: ArrayRecord) -> Update:
        """Read a site's sketch (sketch round) or its values at the candidates."""
        node_id = reply.metadata.src_node_id
        if lost_without_update(reply.content):
            # Its accumulators and model are gone: nothing it owes is pending any more,
            # and its next message carries the whole model.
            self._forget_zero(node_id)
            self.model.forget(node_id)
            self.state.sketched.discard(node_id)
        reject_state_lost(reply.content, "it is sent the whole model and restarts u = v = 0")
        record, metrics = reply_parts(reply)
        num_examples = check_num_examples(metrics.get(keys.NUM_EXAMPLES))
        if self._round_phase == StepPhase.SKETCH:
            # It synced and zeroed, whatever becomes of its sketch.
            self.model.confirm(node_id)
            if self.state.zero_sent.get(node_id) == self.state.pending_zero.get(node_id, 0):
                self._forget_zero(node_id)
            table = sketch_table(record, (self.rows, self.cols), SITE_ALGORITHM)
            self.state.sketched.add(node_id)
            loss = first_number(metrics, keys.TRAIN_LOSS_ALIASES)
            seconds = first_number(metrics, (keys.COMPUTE_SECONDS,))
            note = state_lost_note(metrics, "its momentum u and error v restarted at zero")
            contribution = Contribution(
                num_examples, train_loss=loss, compute_seconds=seconds, note=note
            )
            return Update(contribution, vector=[table], kind="sketch", payload=(node_id, table))
        # ---- values round
        if node_id not in self._asked or node_id in self._answered:
            raise UpdateRejected(f"node {node_id} was not asked for values this round")
        others = [key for key in record if key != VALUES]
        if VALUES not in record or any(
            not (self.model.averaged and k.startswith(AVERAGED)) for k in others
        ):
            wanted = f"one '{VALUES}' array" + (
                " and the averaged arrays" if self.model.averaged else ""
            )
            raise UpdateRejected(
                f"values replies carry {wanted}, got {sorted(record.keys())!r:.200}"
            )
        try:
            values = record[VALUES].numpy()
        except Exception as exc:
            raise UpdateRejected(f"values cannot be decoded: {exc}") from None
        shape = (len(self.state.candidates),)
        if values.shape != shape or values.dtype != np.float32:
            raise UpdateRejected(
                f"values must be float32 of shape {shape}, got {values.dtype} {values.shape}"
            )
        if not np.isfinite(values).all():
            raise UpdateRejected("values contain NaN or Inf")
        if node_id not in self.state.contributors:
            raise UpdateRejected(f"node {node_id}'s sketch was not counted this step")
        changes = averaged_changes(record, self.model)
        payload = (node_id, values, changes)
        return Update(
            Contribution(num_examples),
            vector=[values],
            averaged=judged_averaged(changes, self.model),
            kind="values",
            payload=payload,
        )

    def add_update(self, update: Update, *, weight: float, scale: float = 1.0) -> None:
        """Sketch round: add w·s·S(g_n). Values round: add the values, weighted as the
        site's sketch was (``weight`` is then not used: the step's weights were fixed when
        its sketches were counted)."""
        node_id, array, *rest = update.payload
        if update.kind == "sketch":
            # (Sync only: the policy's scale is 1; the guard's clips the table.)
            self._add(torch.from_numpy(array.astype(np.float32)), weight * scale, weight)
            self.state.contributors[node_id] = weight
            loss = update.contribution.train_loss
            if loss is not None:
                self._loss = (self._loss[0] + weight * loss, self._loss[1] + weight)
            return
        sketch_weight = self.state.contributors[node_id]
        self._add(torch.from_numpy(array.astype(np.float32)), sketch_weight * scale, sketch_weight)
        self._averaged.add(rest[0], float(sketch_weight * scale))
        self._answered.add(node_id)

    def _add(self, values: torch.Tensor, scaled: float, weight: float) -> None:
        # float64: finite float32 values times large weights cannot overflow the sum
        weighted = values.to(torch.float64) * float(scaled)
        self._sum = weighted if self._sum is None else self._sum.add_(weighted)
        self._weight += weight

    def _forget_zero(self, node_id: int) -> None:
        step = self.state.pending_zero.pop(node_id, None)
        self.state.zero_sent.pop(node_id, None)
        if step is not None and step not in self.state.pending_zero.values():
            self.state.applied.pop(step, None)

    def finish_aggregation(self) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Sketch round: choose the candidates (x unchanged); values round: the step."""
        assert self.sketch is not None
        if self._round_phase == StepPhase.SKETCH:
            if self._sum is None:
                return None, None
            count = min(self.candidate_factor * self.k, self.model.size)
            mean = (self._sum / self._weight).to(torch.float32)
            if not torch.isfinite(mean).all():
                self.state.phase = StepPhase.SKETCH  # (it was) the next round sketches again
                raise StepRefused("the sketches' mean overflows float32")
            self.state.candidates = candidate_coordinates(
                self.sketch, mean.to(sketch_device()), count, self.model.averaged_spans()
            ).cpu()
            self.state.phase, self.state.sketch_round = StepPhase.VALUES, self._round
            metrics = MetricRecord(
                {
                    "num-updates": len(self.state.contributors),
                    "candidates": len(self.state.candidates),
                }
            )
            if self._loss[1] > 0:
                metrics[keys.TRAIN_LOSS] = self._loss[0] / self._loss[1]
            return None, metrics
        # ---- values round: whatever arrived, the next round sketches again
        self.state.phase = StepPhase.SKETCH
        if self._sum is None:
            return None, None
        mean = (self._sum / self._weight).to(torch.float32)
        indices, values = exact_top_k(self.state.candidates, mean, self.k)
        step = self.eta * values
        averaged = self._averaged.means(self.model, self._weight)
        if (
            not torch.isfinite(step).all()
            or not torch.isfinite(self.model.flat[indices] + step).all()
        ):
            # The sites keep their values (none is told to zero) for a later step.
            raise StepRefused("the step would make the model non-finite in float32")
        try:
            record = self.model.apply(indices, step, averaged)
        except ValueError as exc:  # an averaged array's mean out of its dtype's range
            raise StepRefused(f"the step does not fit the model: {exc}") from None
        self.state.applied[self.model.version] = indices
        for node_id in self._answered:
            self.state.pending_zero[node_id] = self.model.version
        metrics = MetricRecord(
            {"num-updates": len(self._answered), "applied-coordinates": int(indices.numel())}
        )
        return record, metrics
