"""FetchSGD: sites upload count sketches; momentum and error live in the server's sketches.

ALGORITHMS.md §3 (Rothchild et al., "FetchSGD: Communication-Efficient Federated Learning
with Sketching", 2020); the server's maths is ``strategies.sketch_feedback``. One round:

* Server → site: the model, as every coordinate that changed since the version the site
  holds (indices + values; the whole model on first contact, after a lost message, or
  when more than half of it changed), the sketch's seed and shape, and the config.
* Site: brings its stored model up to date, trains p local steps, and replies with the
  count sketch S(g_n) of its delta g_n = x_n − x (r × c float32, whatever d is). Sites keep
  no optimiser state between rounds, only the model they were sent.
* Server: weighted mean of the tables, momentum and error in sketch space, top-k of the
  error's estimates, x ← x + Δ, and Δ's buckets removed from the error (``zero``: the
  authors' code; ``subtract``: the paper).
* Running statistics and integer arrays (``strategies.averaged_arrays``) are not sketched:
  sites send them whole, the server sets them to the sites' weighted mean (FedAvg's rule)
  and never picks their coordinates from the sketch.
* Nor does it pick a coordinate of a float array no accepted site changed in the round (a
  frozen weight: the sites name them, ``unchanged-arrays``): its estimate is only the
  noise of the coordinates sharing its buckets.

Bytes are what crossed: the sketch and the arrays sent whole up; the changed coordinates
(or the model) down. The
site half is ``strategies.mods.fetchsgd_mod`` around the site's own train function; a
ClientApp without it sends a model, not a sketch, and is rejected with a reason saying so.
A site that lost the model it was synced to (a restarted SuperNode) says so instead of
training, and is sent the whole model next time.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid

from flplatform.core import keys
from flplatform.core.checks import require
from flplatform.core.errors import StepRefused
from flplatform.core.reply_checks import check_num_examples, reply_parts
from flplatform.core.state import StateReader
from flplatform.engine import Contribution, Update
from flplatform.engine.replies import first_number
from strategies.count_sketch import CountSketch, sketch_device
from strategies.knobs import FetchSGDKnobs
from strategies.local_sgd import reject_state_lost
from strategies.sampling import sample_sites
from strategies.sketch_feedback import SketchFeedback
from strategies.sketched_common import (
    AveragedSum,
    SketchedStrategy,
    averaged_changes,
    judged_averaged,
    sketch_table,
    unchanged_arrays,
)
from strategies.sparse_sync import SparseModel

log = logging.getLogger("flplatform.strategies.fetchsgd")

SITE_ALGORITHM = keys.FETCHSGD


class FetchSGD(SketchedStrategy):
    """FetchSGD as a Flower Message-API strategy, driven by the round engine.

    Parameters
    ----------
    k : int
        Coordinates applied per round.
    sketch_rows, sketch_cols : int
        r (odd) and c of the count sketch; c = 0 means 5·k.
    rho : float
        Momentum in sketch space.
    eta : float
        Server learning rate (scales the momentum into the error).
    removal : {"zero", "subtract"}
        How an applied step leaves the error sketch.
    fraction_train, fraction_evaluate : float
        Seeded sampling of sites per round, as local-SGD averaging.
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
        rho: float = 0.9,
        eta: float = 1.0,
        removal: str = "zero",
        fraction_train: float = 1.0,
        fraction_evaluate: float = 0.0,
        seed: int = 0,
        averaged_arrays: Sequence[str] = (),
    ) -> None:
        require(
            FetchSGDKnobs(
                k=k,
                sketch_rows=sketch_rows,
                sketch_cols=sketch_cols,
                fraction_train=fraction_train,
                fraction_evaluate=fraction_evaluate,
                averaged_arrays=averaged_arrays,
                rho=rho,
                eta=eta,
                removal=removal,
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
        self.rho, self.eta, self.removal = rho, eta, removal
        # Fixed once the model is known (first configure_train or begin_aggregation).
        self.feedback: SketchFeedback | None = None
        self._table: torch.Tensor | None = None
        self._averaged = AveragedSum()  # the arrays sent whole, this round
        # arrays no accepted site changed this round (frozen weights): None before a reply
        self._unchanged: set[str] | None = None
        self._weight = 0.0
        self._count = 0
        self._loss = (0.0, 0.0)

    def summary(self) -> None:
        """Log the configuration."""
        log.info(
            "FetchSGD: k=%s sketch=%sx%s rho=%s eta=%s removal=%s",
            self.k,
            self.rows,
            self.cols,
            self.rho,
            self.eta,
            self.removal,
        )

    # ------------------------------------------------------------ model bookkeeping
    def _use(self, arrays: ArrayRecord) -> None:
        """Adopt ``arrays`` as x the first time (the engine's initial model)."""
        if self.model.adopt(arrays):
            self.feedback = self._feedback_for(self.model)

    def _feedback_for(self, model: SparseModel) -> SketchFeedback:
        """The sketch state for ``model`` (empty tables)."""
        assert model.layout is not None
        sketch = CountSketch.from_seed(
            model.size, rows=self.rows, cols=self.cols, seed=self.sketch_seed
        )
        return SketchFeedback(
            sketch,
            k=self.k,
            rho=self.rho,
            eta=self.eta,
            removal=self.removal,
            excluded=model.averaged_spans(),
        )

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The momentum and error sketches S_u, S_e and the sparse-sync model bookkeeping.

        The round's table sum is not in it: ``begin_aggregation`` starts it afresh.
        """
        tables = {} if self.feedback is None else self.feedback.state_dict()
        return {
            "momentum": None if "momentum" not in tables else tables["momentum"].cpu().numpy(),
            "error": None if "error" not in tables else tables["error"].cpu().numpy(),
            "model": self.model.state_dict(),
        }

    def load_state_dict(
        self, state: Mapping[str, Any], *, nodes: Mapping[int, int] | None = None
    ) -> None:
        """Restore ``state_dict()``; ``CheckpointError`` lists every problem, nothing changed.

        The tables must be finite float32 r × c of this run's sketch; the model's
        coordinates must number at least k.
        """
        reader = StateReader(type(self).__name__, nodes)
        fields = reader.fields(state, "", "momentum", "error", "model")
        if fields is None:
            reader.raise_if_any()
            return
        model = SparseModel.read(reader, fields["model"], "model", self.averaged_arrays)
        shape = (self.rows, self.cols)
        tables = {}
        for name in ("momentum", "error"):
            if fields[name] is not None:
                tables[name] = reader.array(
                    fields[name], name, shape=shape, dtype=np.float32, finite=True
                )
        if len(tables) == 1:
            reader.add("'momentum' and 'error' are saved together or not at all")
        if model is not None:
            if model.layout is None and tables:
                reader.add("sketch tables are saved, but no model")
            if model.layout is not None and self.k > model.size:
                reader.add(f"k = {self.k} exceeds the saved model's {model.size} parameters")
            if self.model.layout is not None and model.layout != self.model.layout:
                reader.add("the saved model is not the model this run holds")
        reader.raise_if_any()
        assert model is not None  # a problem was noted otherwise
        feedback = None
        if model.layout is not None:
            feedback = self._feedback_for(model)
            if tables:
                feedback.momentum = torch.from_numpy(tables["momentum"])
                feedback.error = torch.from_numpy(tables["error"])
        self.model, self.feedback = model, feedback

    # ------------------------------------------------------------ Flower hooks
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send each sampled site the coordinates it lacks and the sketch to use."""
        self._use(arrays)
        nodes = sample_sites(self.seed, server_round, grid.get_node_ids(), self.fraction_train)
        return [
            Message(
                self._sketch_content(node_id, server_round, config)[0],
                dst_node_id=node_id,
                message_type=MessageType.TRAIN,
            )
            for node_id in nodes
        ]

    # ------------------------------------------------- streaming aggregation
    def begin_aggregation(self, server_round: int, arrays: ArrayRecord) -> None:
        """Start summing this round's tables."""
        self._use(arrays)
        self._table, self._weight, self._count, self._loss = None, 0.0, 0, (0.0, 0.0)
        self._averaged = AveragedSum()
        self._unchanged = None

    def read_update(self, reply: Message, *, base: ArrayRecord) -> Update:
        """Read S(g_n) and the arrays averaged whole; the site now holds the version its
        message carried."""
        assert self.feedback is not None
        # Unconfirmed, a site that lost its model is sent the whole model next time.
        reject_state_lost(reply.content, "it is sent the whole model next time")
        record, metrics = reply_parts(reply)
        # It applied the download, whatever becomes of its sketch.
        self.model.confirm(reply.metadata.src_node_id)
        num_examples = check_num_examples(metrics.get(keys.NUM_EXAMPLES))
        table = sketch_table(record, (self.rows, self.cols), SITE_ALGORITHM, self.model.averaged)
        changes = averaged_changes(record, self.model)
        unchanged = unchanged_arrays(reply, self.model)
        contribution = Contribution(
            num_examples=num_examples,
            train_loss=first_number(metrics, keys.TRAIN_LOSS_ALIASES),
            compute_seconds=first_number(metrics, (keys.COMPUTE_SECONDS,)),
        )
        # Sketches are linear: a table's norm and direction stand for its update's.
        return Update(
            contribution,
            vector=[table],
            averaged=judged_averaged(changes, self.model),
            kind="sketch",
            payload=(table, changes, unchanged),
        )

    def add_update(self, update: Update, *, weight: float, scale: float = 1.0) -> None:
        """Add w·s·S(g_n) to the round's table, and w·s·(value − x) to each averaged array's."""
        table, changes, unchanged = update.payload
        self._unchanged = unchanged if self._unchanged is None else self._unchanged & unchanged
        # float64: finite float32 tables times large weights cannot overflow the sum
        weighted = torch.from_numpy(table.astype(np.float64)) * float(weight * scale)
        self._table = weighted if self._table is None else self._table.add_(weighted)
        self._averaged.add(changes, float(weight * scale))
        self._weight += weight
        self._count += 1
        loss = update.contribution.train_loss
        if loss is not None:
            self._loss = (self._loss[0] + weight * loss, self._loss[1] + weight)

    def finish_aggregation(self) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Δ from the sketches; x ← x + Δ; None when no sketch was accepted."""
        assert self.feedback is not None
        if self._table is None or self._count == 0:
            return None, None
        mean = (self._table / self._weight).to(torch.float32)
        self._table = None
        if not torch.isfinite(mean).all():
            raise StepRefused("the sketches' mean overflows float32")
        before = self.feedback.state_dict()
        # S_u, S_e and the estimate of every coordinate on the GPU when there is one. Not
        # for "subtract": sketching S(Δ) there adds with CUDA's atomics, in no fixed order,
        # and a resumed run must end bit for bit as the uninterrupted one.
        device = sketch_device() if self.removal == "zero" else torch.device("cpu")
        # Never a coordinate of an array no site changed: its estimate is only the noise of
        # the coordinates sharing its buckets (a frozen weight would move by it).
        assert self.model.layout is not None
        frozen = tuple(self.model.layout.span(name) for name in sorted(self._unchanged or ()))
        indices, values = self.feedback.step(mean.to(device), excluded=frozen)
        indices, values = indices.cpu(), values.cpu()
        averaged = self._averaged.means(self.model, self._weight)
        problem = None
        if not (
            torch.isfinite(values).all()
            and torch.isfinite(self.model.flat[indices] + values.to(self.model.flat.dtype)).all()
        ):
            problem = "the step would make the model non-finite in float32"
        else:
            try:
                record = self.model.apply(indices, values, averaged)
            except ValueError as exc:  # an averaged array's mean out of its dtype's range
                problem = f"the step does not fit the model: {exc}"
        if problem is not None:
            # Momentum and error as they were: the refused step leaves no trace.
            if before:
                self.feedback.load_state_dict(before)
            else:
                self.feedback.momentum = self.feedback.error = None
            raise StepRefused(problem)
        metrics = MetricRecord(
            {"num-updates": self._count, "applied-coordinates": int(indices.numel())}
        )
        if self._loss[1] > 0:
            metrics[keys.TRAIN_LOSS] = self._loss[0] / self._loss[1]
        self._table = None
        return record, metrics
