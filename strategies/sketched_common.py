"""What the sketched strategies (FetchSGD, Sketched-SGD) share.

Server side, ``SketchedStrategy``: the sketch's settings (k, r, c and a seed derived from the
run's), seeded sampling and evaluation as local-SGD averaging, the model with sparse
downloads, the training message that syncs a site and names the sketch, and Flower's batch
and ``start`` hooks run by the round engine (fully synchronous). Checks on a sketch reply
(``sketch_table``). The site halves are ``strategies.mods``.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from flplatform.core import keys
from flplatform.core.errors import UpdateRejected
from flplatform.core.seeding import derive_seed
from flplatform.engine import AggregationPolicy, EngineStrategy, Synchrony, Update
from flplatform.engine.replies import record_of
from flplatform.run.start import PlatformStart
from strategies.averaged_arrays import AVERAGED, judged_changes
from strategies.codecs import averaged_from_wire, averaged_keys
from strategies.knobs import sketched_sync_only
from strategies.layout import Layout
from strategies.local_sgd import aggregate_batch
from strategies.mods.fetchsgd import SKETCH
from strategies.sampling import evaluation_messages, mean_evaluation
from strategies.sparse_sync import SparseModel


class SketchedStrategy(PlatformStart, Strategy, EngineStrategy):
    """The parts of a sketched strategy that do not depend on its update rule.

    Parameters
    ----------
    site_algorithm : str
        The algorithm the sites' mod runs (its name in the round config).
    k : int
        Coordinates applied per step.
    sketch_rows, sketch_cols : int
        r (odd) and c of the count sketch; c = 0 means 5·k.
    fraction_train, fraction_evaluate : float
        Seeded sampling of sites per round, as local-SGD averaging.
    seed : int
        The run's seed; the sketch's hashes derive from it and ``site_algorithm``.
    averaged_arrays : sequence of str
        Arrays (names or shell patterns) the sites send whole and the server sets to
        their weighted mean, beside the running statistics and integer arrays found by
        ``strategies.averaged_arrays``' rule: buffers the training sets rather than learns.
    """

    def __init__(
        self,
        *,
        site_algorithm: str,
        k: int,
        sketch_rows: int,
        sketch_cols: int,
        fraction_train: float,
        fraction_evaluate: float,
        seed: int,
        averaged_arrays: Sequence[str],
    ) -> None:
        # the subclass checked every knob, these included, all at once
        self.site_algorithm = site_algorithm
        self.k, self.rows, self.cols = k, sketch_rows, sketch_cols or 5 * k
        self.sketch_seed = derive_seed(seed, f"{site_algorithm}-sketch")
        self.seed = seed
        self.fraction_train, self.fraction_evaluate = fraction_train, fraction_evaluate
        self.averaged_arrays = tuple(averaged_arrays)
        self.model = SparseModel(self.averaged_arrays)  # x, its versions, what sites hold

    def _sketch_content(
        self, node_id: int, server_round: int, config: ConfigRecord, **extra: Any
    ) -> tuple[RecordDict, int]:
        """A training message's content: what ``node_id`` lacks of x, the sketch to use and
        ``extra`` config; and the version the download starts from (or DENSE)."""
        record, sync_from = self.model.download(node_id)
        site_config = ConfigRecord(dict(config))
        site_config.update(
            {
                keys.SERVER_ROUND: server_round,
                keys.SITE_ALGORITHM: self.site_algorithm,
                keys.MODEL_VERSION: self.model.version,
                keys.SYNC_FROM: sync_from,
                keys.SKETCH_SEED: self.sketch_seed,
                keys.SKETCH_ROWS: self.rows,
                keys.SKETCH_COLS: self.cols,
                **self.averaged_config(),
                **extra,
            }
        )
        return RecordDict({keys.ARRAYS: record, keys.CONFIG: site_config}), sync_from

    def averaged_config(self) -> dict[str, list[str]]:
        """The round config naming the arrays the sites send whole (none: nothing)."""
        averaged = self.model.averaged
        return {keys.AVERAGED_ARRAYS: list(averaged)} if averaged else {}

    def message_not_sent(self, message: Message) -> None:
        """The engine did not send this drafted message: its site holds what it held.

        Only a message that carried a download changed what the server assumes the site
        holds (Sketched-SGD's values requests carry none).
        """
        config = message.content.config_records.get(keys.CONFIG)
        if config is not None and keys.SYNC_FROM in config:
            self.model.withdraw(message.metadata.dst_node_id)

    # --------------------------------- the update rule: the engine's streaming hooks
    @abstractmethod
    def begin_aggregation(self, server_round: int, arrays: ArrayRecord) -> None:
        """Start a round's aggregation."""

    @abstractmethod
    def read_update(self, reply: Message, *, base: ArrayRecord) -> Update:
        """Read and check one reply, or raise ``UpdateRejected``."""

    @abstractmethod
    def add_update(self, update: Update, *, weight: float, scale: float = 1.0) -> None:
        """Add a read update with the weight and scale the engine allows."""

    @abstractmethod
    def finish_aggregation(self) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The round's new model (None: unchanged) and its metrics."""

    # ------------------------------------------------------------ Flower hooks
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
        return evaluation_messages(
            self.seed, server_round, arrays, config, grid.get_node_ids(), self.fraction_evaluate
        )

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Example-weighted mean of the sites' evaluation metrics."""
        return mean_evaluation(replies)

    def engine_policy(self, requested: Synchrony, *, num_rounds: int) -> AggregationPolicy:
        """The requested policy, which must be sync mode ``sync``."""
        sketched_sync_only(self.site_algorithm).check(requested.name)
        return requested

    @property
    def ledger_name(self) -> str:
        """The strategy's name in the ledger."""
        return self.site_algorithm

    @property
    def site_mod(self) -> str:
        """The sketching mod: a site sends a sketch, not a model."""
        return self.site_algorithm


# ================================================================ replies
def sketch_table(
    record: ArrayRecord, shape: tuple[int, int], algorithm: str, averaged: Sequence[str] = ()
) -> np.ndarray:
    """The finite float32 r × c table a sketch reply carries; ``UpdateRejected`` if not.

    Beside it the reply holds the vectors the ``averaged`` arrays travel in, and nothing
    else (``averaged_values`` reads them)."""
    others = [key for key in record if key != SKETCH]
    if SKETCH not in record or any(not (averaged and k.startswith(AVERAGED)) for k in others):
        wanted = f"one '{SKETCH}' array"
        if averaged:
            wanted += f" and its {len(averaged)} averaged arrays"
        raise UpdateRejected(
            f"sketch replies carry {wanted}, got {sorted(record.keys())!r:.200}: "
            f"does the site's ClientApp train with strategies.mods' "
            f"{algorithm.replace('-', '_')}_mod() (or flplatform_mod())?"
        )
    try:
        table = record[SKETCH].numpy()
    except Exception as exc:
        raise UpdateRejected(f"sketch cannot be decoded: {exc}") from None
    if table.shape != shape or table.dtype != np.float32:
        raise UpdateRejected(
            f"sketch must be float32 of shape {shape}, got {table.dtype} {table.shape}"
        )
    if not np.isfinite(table).all():
        raise UpdateRejected("sketch contains NaN or Inf")
    return table


def averaged_values(
    record: ArrayRecord, layout: Layout, averaged: Sequence[str]
) -> dict[str, np.ndarray]:
    """The ``averaged`` arrays a sketch reply carries whole, each in its dtype and shape;
    ``UpdateRejected`` unless they come as ``strategies.averaged_arrays.pack`` makes them
    (one vector per carrier dtype, of the right length, finite, each value fitting its
    array's dtype: ``strategies.codecs.averaged_from_wire``)."""
    expected = averaged_keys(layout, averaged)
    wire = {}
    for key in expected:
        if key not in record:
            raise UpdateRejected(f"the averaged arrays' vector '{key}' is missing")
        try:
            wire[key] = record[key].numpy()
        except Exception as exc:
            raise UpdateRejected(f"'{key}' cannot be decoded: {exc}") from None
    unexpected = [k for k in record if k.startswith(AVERAGED) and k not in expected]
    if unexpected:
        raise UpdateRejected(f"unexpected arrays {unexpected!r:.200} beside the sketch")
    return averaged_from_wire(wire, layout, averaged)


def averaged_changes(record: ArrayRecord, model: SparseModel) -> dict[str, np.ndarray]:
    """What a site's training did to the arrays it sent whole: its value − x, flat float64
    (``averaged_values`` checks them). The guard judges them apart (``Update.averaged``)."""
    assert model.layout is not None
    return {
        name: value.reshape(-1).astype(np.float64) - model.flat[model.span(name)].numpy()
        for name, value in averaged_values(record, model.layout, model.averaged).items()
    }


def judged_averaged(changes: Mapping[str, np.ndarray], model: SparseModel) -> list[np.ndarray]:
    """The ``averaged_changes`` the update guard judges (``judged_changes``: the float ones)."""
    assert model.layout is not None
    return judged_changes(changes, {name: model.layout.dtype_of(name) for name in changes})


def unchanged_arrays(reply: Message, model: SparseModel) -> set[str]:
    """The arrays a site says its training left exactly as they were (``unchanged-arrays``
    in its reply's config; none if it says nothing); ``UpdateRejected`` unless each is a
    sketched array of the model."""
    config = record_of(reply.content, keys.CONFIG, ConfigRecord)
    names = config.get(keys.UNCHANGED_ARRAYS, []) if config is not None else []
    assert model.layout is not None
    known = set(model.layout.names) - set(model.averaged)
    if not isinstance(names, list) or not all(isinstance(n, str) and n in known for n in names):
        raise UpdateRejected(
            f"'{keys.UNCHANGED_ARRAYS}' must list sketched arrays of the model, got {names!r:.120}"
        )
    return {str(name) for name in names}


@dataclass
class AveragedSum:
    """Σ w·s·(value − x) of a step's arrays sent whole, and the new values it gives."""

    totals: dict[str, np.ndarray] = field(default_factory=dict)

    def add(self, changes: dict[str, np.ndarray], factor: float) -> None:
        """Add ``factor`` (w·s) times one site's changes."""
        for name, change in changes.items():
            total = self.totals.get(name)
            self.totals[name] = change * factor if total is None else total + change * factor

    def means(self, model: SparseModel, weight: float) -> dict[str, np.ndarray]:
        """Each array's new value, x + Σ w·s·(value − x) / Σ w (float64, flat)."""
        return {
            name: model.flat[model.span(name)].numpy().astype(np.float64) + total / weight
            for name, total in self.totals.items()
        }
