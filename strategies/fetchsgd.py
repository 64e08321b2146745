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

Bytes are what crossed: the sketch up; the changed coordinates (or the model) down. A
plain Flower ClientApp cannot take part (it sends a model, not a sketch) and is rejected
with a reason saying so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import numpy as np
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from clients.site import Site
from clients.training import TrainStats
from flplatform import keys
from flplatform.engine import Contribution, Synchrony, start_with_engine
from flplatform.engine.wire import arrays_to_record, record_to_arrays
from flplatform.errors import ConfigError, UpdateRejected
from flplatform.seeding import derive_seed
from strategies.codecs import Layout
from strategies.count_sketch import CountSketch
from strategies.local_sgd import (
    LocalSGDAveraging,
    SiteTrainConfig,
    aggregate_batch,
    first_number,
    num_classes_of,
    train_on_site,
)
from strategies.site_parts import register
from strategies.sketch_feedback import SketchFeedback
from strategies.sparse_sync import SparseModel, int_config, remember_model, synced_model
from strategies.validation import check_num_examples

log = logging.getLogger("flplatform.strategies.fetchsgd")

SITE_ALGORITHM = "fetchsgd"
SKETCH = "sketch"  # the reply's table


class FetchSGD(Strategy):
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
    ) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"k must be an integer >= 1 coordinates, got {k!r}")
        if sketch_rows < 1 or sketch_rows % 2 == 0:
            raise ConfigError(f"sketch-rows must be odd and >= 1, got {sketch_rows}")
        if sketch_cols < 0:
            raise ConfigError(f"sketch-cols must be >= 0 (0: 5·k), got {sketch_cols}")
        self.k = k
        self.rows = sketch_rows
        self.cols = sketch_cols or 5 * k
        self.rho, self.eta, self.removal = rho, eta, removal
        self.sketch_seed = derive_seed(seed, "fetchsgd-sketch")
        self._sampling = LocalSGDAveraging(
            fraction_train=fraction_train, fraction_evaluate=fraction_evaluate, seed=seed
        )
        self.model = SparseModel()  # x, its versions, and what each site holds
        # Fixed once the model is known (first configure_train or begin_aggregation).
        self.feedback: SketchFeedback | None = None
        self._table: torch.Tensor | None = None
        self._weight = 0.0
        self._count = 0
        self._loss = (0.0, 0.0)
        if removal not in ("zero", "subtract"):  # checked again, fully, by SketchFeedback
            raise ConfigError(f"unknown sketch removal {removal!r}; allowed: zero, subtract")

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
            sketch = CountSketch.from_seed(
                self.model.size, rows=self.rows, cols=self.cols, seed=self.sketch_seed
            )
            self.feedback = SketchFeedback(
                sketch, k=self.k, rho=self.rho, eta=self.eta, removal=self.removal
            )

    # ------------------------------------------------------------ Flower hooks
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send each sampled site the coordinates it lacks and the sketch to use."""
        self._use(arrays)
        nodes = self._sampling.sample(
            server_round, grid.get_node_ids(), self._sampling.fraction_train
        )
        messages = []
        for node_id in nodes:
            record, sync_from = self.model.download(node_id)
            site_config = ConfigRecord(dict(config))
            site_config.update(
                {
                    keys.SERVER_ROUND: server_round,
                    keys.SITE_ALGORITHM: SITE_ALGORITHM,
                    keys.MODEL_VERSION: self.model.version,
                    keys.SYNC_FROM: sync_from,
                    keys.SKETCH_SEED: self.sketch_seed,
                    keys.SKETCH_ROWS: self.rows,
                    keys.SKETCH_COLS: self.cols,
                }
            )
            content = RecordDict({keys.ARRAYS: record, keys.CONFIG: site_config})
            messages.append(Message(content, dst_node_id=node_id, message_type=MessageType.TRAIN))
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's batch hook, through the streaming path (malformed replies skipped)."""
        assert self.model.record is not None, "configure_train runs first"
        return aggregate_batch(self, server_round, self.model.record, replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """As local-SGD averaging: a seeded sample of sites evaluates the whole model."""
        return self._sampling.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Example-weighted mean of the sites' evaluation metrics."""
        return self._sampling.aggregate_evaluate(server_round, replies)

    # ------------------------------------------------- streaming aggregation
    def begin_aggregation(self, server_round: int, arrays: ArrayRecord) -> None:
        """Start summing this round's tables."""
        self._use(arrays)
        self._table, self._weight, self._count, self._loss = None, 0.0, 0, (0.0, 0.0)

    def accumulate(
        self, reply: Message, *, base: ArrayRecord, weight_scale: float = 1.0
    ) -> Contribution:
        """Add w_n·S(g_n); the site now holds the version its message carried."""
        assert self.feedback is not None
        record, metrics = reply_parts(reply)
        # It applied the download, whatever becomes of its sketch.
        self.model.confirm(reply.metadata.src_node_id)
        num_examples = check_num_examples(metrics.get(keys.NUM_EXAMPLES))
        table = sketch_table(record, (self.rows, self.cols), SITE_ALGORITHM)
        # float64: finite float32 tables times large weights cannot overflow the sum
        weighted = torch.from_numpy(table.astype(np.float64)) * float(num_examples * weight_scale)
        self._table = weighted if self._table is None else self._table.add_(weighted)
        self._weight += num_examples
        self._count += 1
        loss = first_number(metrics, keys.TRAIN_LOSS_ALIASES)
        if loss is not None:
            self._loss = (self._loss[0] + num_examples * loss, self._loss[1] + num_examples)
        seconds = first_number(metrics, (keys.COMPUTE_SECONDS,))
        return Contribution(num_examples=num_examples, train_loss=loss, compute_seconds=seconds)

    def finish_aggregation(self) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Δ from the sketches; x ← x + Δ; None when no sketch was accepted."""
        assert self.feedback is not None
        if self._table is None or self._count == 0:
            return None, None
        mean = (self._table / self._weight).to(torch.float32)
        if not torch.isfinite(mean).all():
            log.warning("the sketches' mean overflows float32; no step this round")
            self._table = None
            return None, None
        indices, values = self.feedback.step(mean)
        record = self.model.apply(indices, values)
        metrics = MetricRecord(
            {"num-updates": self._count, "applied-coordinates": int(indices.numel())}
        )
        if self._loss[1] > 0:
            metrics[keys.TRAIN_LOSS] = self._loss[0] / self._loss[1]
        self._table = None
        return record, metrics

    # -------------------------------------------------------------- driving
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Flower's ``start``, run by flplatform's round engine (fully synchronous)."""
        return start_with_engine(
            self,
            grid,
            initial_arrays,
            policy=Synchrony("sync"),
            num_rounds=num_rounds,
            timeout=timeout,
            train_config=train_config,
            evaluate_config=evaluate_config,
            evaluate_fn=evaluate_fn,
            federated_evaluation=self._sampling.fraction_evaluate > 0,
        )


# ====================================================== replies (shared by sketched strategies)
def reply_parts(reply: Message) -> tuple[ArrayRecord, MetricRecord]:
    """A site's reply as its arrays and metrics records; ``UpdateRejected`` if it is not."""
    content = reply.content
    if keys.ARRAYS not in content or keys.METRICS not in content:
        raise UpdateRejected(
            f"reply must hold '{keys.ARRAYS}' and '{keys.METRICS}' records, "
            f"got {sorted(content.keys())}"
        )
    record, metrics = content[keys.ARRAYS], content[keys.METRICS]
    if not isinstance(metrics, MetricRecord) or not isinstance(record, ArrayRecord):
        raise UpdateRejected("reply records have the wrong types")
    return record, metrics


def sketch_table(record: ArrayRecord, shape: tuple[int, int], algorithm: str) -> np.ndarray:
    """The one finite float32 r × c table a sketch reply carries; ``UpdateRejected`` if not."""
    if list(record.keys()) != [SKETCH]:
        raise UpdateRejected(
            f"sketch replies carry one '{SKETCH}' array, got {sorted(record.keys())}: "
            f"is the site running flplatform's {algorithm} site part?"
        )
    try:
        table = record_to_arrays(record)[SKETCH]
    except Exception as exc:
        raise UpdateRejected(f"sketch cannot be decoded: {exc}") from None
    if table.shape != shape or table.dtype != np.float32:
        raise UpdateRejected(
            f"sketch must be float32 of shape {shape}, got {table.dtype} {table.shape}"
        )
    if not np.isfinite(table).all():
        raise UpdateRejected("sketch contains NaN or Inf")
    return table


def local_delta(
    model_arrays: dict[str, np.ndarray], site: Site, config: SiteTrainConfig, context: Context
) -> tuple[np.ndarray, TrainStats]:
    """Train from ``model_arrays`` as ``config`` says; the flat delta x_n − x (float64)."""
    state_dict = {k: torch.from_numpy(np.array(v)) for k, v in model_arrays.items()}
    model = site.build_model(num_classes=num_classes_of(state_dict), seed=config.seed)
    model.load_state_dict(state_dict)
    stats, _ = train_on_site(model, site, config, context)
    trained = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    layout = Layout.of(model_arrays)
    return layout.flatten(trained) - layout.flatten(model_arrays), stats


# =============================================================== site part
@register(SITE_ALGORITHM)
def train_site(msg: Message, context: Context, site: Site) -> Message:
    """Sync the model, train p local steps, reply with the count sketch of the delta."""
    raw = msg.content.config_records.get(keys.CONFIG, ConfigRecord())
    config = SiteTrainConfig.from_record(raw)
    version = int_config(raw, keys.MODEL_VERSION, 0)
    seed = int_config(raw, keys.SKETCH_SEED, 0)
    rows = int_config(raw, keys.SKETCH_ROWS, 1)
    cols = int_config(raw, keys.SKETCH_COLS, 1)
    model_arrays = synced_model(
        msg, context, state_key=keys.FETCHSGD_STATE, model_key=keys.FETCHSGD_MODEL
    )
    delta, stats = local_delta(model_arrays, site, config, context)
    layout = Layout.of(model_arrays)
    sketch = CountSketch.from_seed(layout.size, rows=rows, cols=cols, seed=seed)
    table = sketch.sketch(torch.from_numpy(delta.astype(np.float32)).to(site.device)).cpu()
    # Only now, with the work done, does the site hold the synced model.
    remember_model(
        context, model_arrays, version, state_key=keys.FETCHSGD_STATE, model_key=keys.FETCHSGD_MODEL
    )
    metrics = MetricRecord(
        {
            keys.NUM_EXAMPLES: len(site.x_train),
            keys.TRAIN_LOSS: stats.loss,
            keys.COMPUTE_SECONDS: stats.seconds,
        }
    )
    content = RecordDict(
        {keys.ARRAYS: arrays_to_record({SKETCH: table.numpy()}), keys.METRICS: metrics}
    )
    return Message(content, reply_to=msg)
