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
from strategies.sketch_feedback import ChangeLog, SketchFeedback
from strategies.validation import check_num_examples

log = logging.getLogger("flplatform.strategies.fetchsgd")

SITE_ALGORITHM = "fetchsgd"
SKETCH = "sketch"  # the reply's table
SYNC_INDICES, SYNC_VALUES = "sync.indices", "sync.values"  # a sparse download
DENSE = -1  # sync-from of a message carrying the whole model
# More changed coordinates than this fraction of d travel as the whole model.
DENSE_ABOVE = 0.5


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
        # Fixed once the model is known (first configure_train or begin_aggregation).
        self.layout: Layout | None = None
        self.feedback: SketchFeedback | None = None
        self.flat = torch.empty(0)  # x, flattened in the layout's order (float32)
        self.record: ArrayRecord | None = None  # x as sent to sites
        self.version = 0
        self.changes = ChangeLog()
        self.synced: dict[int, int] = {}  # node → version it holds (confirmed by a reply)
        self._sent: dict[int, int] = {}  # node → version its outstanding message carries
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
        if self.layout is not None:
            return
        model = record_to_arrays(arrays)
        self.layout = Layout.of(model)
        sketch = CountSketch.from_seed(
            self.layout.size, rows=self.rows, cols=self.cols, seed=self.sketch_seed
        )
        self.feedback = SketchFeedback(
            sketch, k=self.k, rho=self.rho, eta=self.eta, removal=self.removal
        )
        self.flat = torch.from_numpy(self.layout.flatten(model).astype(np.float32))
        self.record = arrays

    def _download(self, node_id: int) -> tuple[ArrayRecord, int]:
        """What ``node_id`` needs to hold x: (record, version it must hold first or DENSE)."""
        assert self.layout is not None and self.record is not None  # set by _use
        # Taken, not read: until the site replies to this message, what it holds is not
        # known (a failed or lost message is followed by the whole model).
        held = self.synced.pop(node_id, None)
        changed = None if held is None else self.changes.changed_since(held, self.version)
        if held is None or changed is None or len(changed) > DENSE_ABOVE * self.layout.size:
            return self.record, DENSE
        indices = changed.numpy().astype(np.int32 if self.layout.size < 2**31 else np.int64)
        values = self.flat[changed].numpy()
        return arrays_to_record({SYNC_INDICES: indices, SYNC_VALUES: values}), held

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
            record, sync_from = self._download(node_id)
            site_config = ConfigRecord(dict(config))
            site_config.update(
                {
                    keys.SERVER_ROUND: server_round,
                    keys.SITE_ALGORITHM: SITE_ALGORITHM,
                    keys.MODEL_VERSION: self.version,
                    keys.SYNC_FROM: sync_from,
                    keys.SKETCH_SEED: self.sketch_seed,
                    keys.SKETCH_ROWS: self.rows,
                    keys.SKETCH_COLS: self.cols,
                }
            )
            content = RecordDict({keys.ARRAYS: record, keys.CONFIG: site_config})
            messages.append(Message(content, dst_node_id=node_id, message_type=MessageType.TRAIN))
            self._sent[node_id] = self.version
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's batch hook, through the streaming path (malformed replies skipped)."""
        assert self.record is not None, "configure_train runs first"
        return aggregate_batch(self, server_round, self.record, replies)

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
        content = reply.content
        if keys.ARRAYS not in content or keys.METRICS not in content:
            raise UpdateRejected(
                f"reply must hold '{keys.ARRAYS}' and '{keys.METRICS}' records, "
                f"got {sorted(content.keys())}"
            )
        metrics = content[keys.METRICS]
        record = content[keys.ARRAYS]
        if not isinstance(metrics, MetricRecord) or not isinstance(record, ArrayRecord):
            raise UpdateRejected("reply records have the wrong types")
        node_id = reply.metadata.src_node_id
        if node_id in self._sent:  # it applied the download, whatever becomes of its sketch
            self.synced[node_id] = self._sent.pop(node_id)
        num_examples = check_num_examples(metrics.get(keys.NUM_EXAMPLES))
        if list(record.keys()) != [SKETCH]:
            raise UpdateRejected(
                f"FetchSGD replies carry one '{SKETCH}' array, got {sorted(record.keys())}: "
                "is the site running flplatform's fetchsgd site part?"
            )
        try:
            table = record_to_arrays(record)[SKETCH]
        except Exception as exc:
            raise UpdateRejected(f"sketch cannot be decoded: {exc}") from None
        shape = (self.rows, self.cols)
        if table.shape != shape or table.dtype != np.float32:
            raise UpdateRejected(
                f"sketch must be float32 of shape {shape}, got {table.dtype} {table.shape}"
            )
        if not np.isfinite(table).all():
            raise UpdateRejected("sketch contains NaN or Inf")
        weighted = torch.from_numpy(table.astype(np.float32)) * float(num_examples * weight_scale)
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
        assert self.feedback is not None and self.layout is not None
        if self._table is None or self._count == 0:
            return None, None
        indices, values = self.feedback.step(self._table / self._weight)
        self.flat[indices] += values
        self.version += 1
        self.changes.record(self.version, indices)
        self.record = arrays_to_record(self.layout.unflatten(self.flat.numpy()))
        metrics = MetricRecord(
            {"num-updates": self._count, "applied-coordinates": int(indices.numel())}
        )
        if self._loss[1] > 0:
            metrics[keys.TRAIN_LOSS] = self._loss[0] / self._loss[1]
        self._table = None
        return self.record, metrics

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


# =============================================================== site part
def _int_config(config: ConfigRecord, key: str, low: int) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"round config '{key}' must be an integer >= {low}, got {value!r}")
    return value


def synced_model(msg: Message, context: Context) -> dict[str, np.ndarray]:
    """The model the server holds, from the message and the site's stored copy."""
    config = msg.content.config_records.get(keys.CONFIG, ConfigRecord())
    sync_from = _int_config(config, keys.SYNC_FROM, DENSE)
    if keys.ARRAYS not in msg.content.array_records:
        raise ConfigError(f"the server's message has no '{keys.ARRAYS}' record")
    sent = record_to_arrays(msg.content.array_records[keys.ARRAYS])
    if sync_from == DENSE:
        return sent
    state = context.state.config_records.get(keys.FETCHSGD_STATE, ConfigRecord())
    stored = context.state.array_records.get(keys.FETCHSGD_MODEL)
    held = state.get("version")
    # Changes since an older version than the site holds still bring it to the server's
    # model: they cover every coordinate changed since, with its current value.
    if stored is None or not isinstance(held, int) or held < sync_from:
        raise ConfigError(
            f"this site holds model version {held!r}, but the server sent the changes since "
            f"version {sync_from}; it will send the whole model next time"
        )
    model = record_to_arrays(stored)
    layout = Layout.of(model)
    indices, values = sent.get(SYNC_INDICES), sent.get(SYNC_VALUES)
    if (
        indices is None
        or values is None
        or indices.ndim != 1
        or indices.shape != values.shape
        or not np.issubdtype(indices.dtype, np.integer)
        or (len(indices) and (indices.min() < 0 or indices.max() >= layout.size))
    ):
        raise ConfigError("the server's sparse model update is malformed")
    flat = layout.flatten(model)
    flat[indices] = values
    return layout.unflatten(flat)


@register(SITE_ALGORITHM)
def train_site(msg: Message, context: Context, site: Site) -> Message:
    """Sync the model, train p local steps, reply with the count sketch of the delta."""
    raw = msg.content.config_records.get(keys.CONFIG, ConfigRecord())
    config = SiteTrainConfig.from_record(raw)
    version = _int_config(raw, keys.MODEL_VERSION, 0)
    seed = _int_config(raw, keys.SKETCH_SEED, 0)
    rows = _int_config(raw, keys.SKETCH_ROWS, 1)
    cols = _int_config(raw, keys.SKETCH_COLS, 1)
    model_arrays = synced_model(msg, context)
    state_dict = {k: torch.from_numpy(np.array(v)) for k, v in model_arrays.items()}
    model = site.build_model(num_classes=num_classes_of(state_dict), seed=config.seed)
    model.load_state_dict(state_dict)
    stats, _ = train_on_site(model, site, config, context)
    trained = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    layout = Layout.of(model_arrays)
    delta = layout.flatten(trained) - layout.flatten(model_arrays)  # (d,) float64
    sketch = CountSketch.from_seed(layout.size, rows=rows, cols=cols, seed=seed)
    table = sketch.sketch(torch.from_numpy(delta.astype(np.float32)).to(site.device)).cpu()
    # Only now, with the work done, does the site hold the synced model.
    context.state[keys.FETCHSGD_MODEL] = arrays_to_record(model_arrays)
    context.state[keys.FETCHSGD_STATE] = ConfigRecord({"version": version})
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
