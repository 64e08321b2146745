"""Flower's own strategies (FedAvg, FedProx, FedAdam, FedAvgM, ...) under the round engine.

``FlowerStrategyAdapter`` wraps any ``flwr.serverapp.strategy.Strategy`` that lacks the
engine's streaming hooks, so ``flplatform.start`` can run it with the ledger, byte
accounting and a simulated network. Sampling, messages and aggregation stay the wrapped
strategy's own (Flower's strategies sample with ``random``); the adapter only

* keeps each accepted reply of a round and hands the round's replies to the wrapped
  strategy's ``aggregate_train`` at the end, as Flower's ``start`` does;
* checks every reply as it arrives, with the rules the wrapped strategy's aggregation
  applies (Flower's ``validate_message_reply_consistency``: one ArrayRecord and one
  MetricRecord, the same keys as the round's first accepted reply, a single-valued weight)
  plus the platform's own (a positive ``num-examples``, the global model's array names,
  shapes and dtypes, finite values). A reply that Flower would refuse is REJECTED with the
  reason, instead of making ``aggregate_train`` refuse the whole round;
* never lets a strategy's node sampling wait for more nodes than the engine offers: Flower's
  ``sample_nodes`` sleeps until ``min_available_nodes`` are connected, so with fewer idle
  sites the adapter sends nothing and the engine offers work again as sites join.

The wrapped strategy aggregates a round's replies at once and knows no stale updates, so
it runs fully synchronously only (``engine_policy``).
"""

from __future__ import annotations

import gc
import logging
import random
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from flplatform.core import keys
from flplatform.core.arrays import arrays_to_record, encode, record_to_arrays
from flplatform.core.errors import ConfigError, RunFailed, StepRefused, UpdateRejected
from flplatform.core.flower_internals import (
    InconsistentMessageReplies,
    validate_message_reply_consistency,
)
from flplatform.core.reply_checks import check_arrays, check_num_examples
from flplatform.core.state import MISSING, StateReader
from flplatform.engine import AggregationPolicy, Contribution, EngineStrategy, Synchrony, Update
from flplatform.engine.replies import first_number

log = logging.getLogger("flplatform.run.flower_adapter")


@contextmanager
def _collections_of_new_objects_only() -> Iterator[None]:
    """Hide the process's existing objects from the garbage collector for the block.

    Flower's ``ArrayRecord.to_numpy_ndarrays(keep_input=False)`` ends with a full
    ``gc.collect()`` (and runs one per 200 MB converted), and QFedAvg and Bulyan convert
    replies that way, one collection each: in a ServerApp process (torch, Flower and the
    ledger loaded) each walks the whole heap. Frozen, a collection walks only what the
    aggregation made; the arrays Flower drops are freed as before (by their reference
    counts, not the collector). The young generations are collected first (cheap), so
    their garbage does not wait in the oldest one. A heap the user froze is left as it is.
    """
    if gc.get_freeze_count():
        yield
        return
    gc.collect(1)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class FlowerStrategyAdapter(EngineStrategy):
    """Run a Flower Message-API strategy through the engine's streaming hooks.

    Parameters
    ----------
    strategy : flwr.serverapp.strategy.Strategy
        The strategy to run, e.g. ``FedAvg(fraction_evaluate=0.0)``. Its
        ``weighted_by_key`` (Flower's FedAvg family; ``num-examples`` otherwise) is the
        weight every training reply must carry.

    Raises
    ------
    ConfigError
        If ``strategy`` is not a Flower ``Strategy``.
    """

    def __init__(self, strategy: Strategy) -> None:
        if not isinstance(strategy, Strategy):
            raise ConfigError(
                f"FlowerStrategyAdapter wraps a flwr.serverapp.strategy.Strategy, got "
                f"{type(strategy).__name__}"
            )
        self.strategy = strategy
        weighted_by = getattr(strategy, "weighted_by_key", keys.NUM_EXAMPLES)
        self.weighted_by_key = weighted_by if isinstance(weighted_by, str) else keys.NUM_EXAMPLES
        self._round = 0
        self._replies: list[Message] = []
        self._base: dict[str, np.ndarray] = {}
        self._base_record: ArrayRecord | None = None
        self._said_dtypes = False
        # the round's Σ w·value of the integer and bool arrays, and Σ w (see add_update)
        self._whole_sum: dict[str, np.ndarray] = {}
        self._whole_weight = 0.0
        self._first: RecordDict | None = None  # the round's first kept reply, as it came

    @property
    def name(self) -> str:
        """The wrapped strategy's class name (``FedAvg``)."""
        return type(self.strategy).__name__

    @property
    def ledger_name(self) -> str:
        """The strategy's name in the ledger: ``flwr-`` and the class name in lower case."""
        return f"flwr-{self.name.lower()}"

    def summary(self) -> None:
        """Log the wrapped strategy's configuration."""
        self.strategy.summary()

    def engine_policy(self, requested: Synchrony, *, num_rounds: int) -> AggregationPolicy:
        """The requested policy, which must be sync mode ``sync`` (Flower counts rounds)."""
        if requested.name != "sync":
            raise ConfigError(
                f"Flower's {self.name} aggregates each round's replies at once "
                f"(aggregate_train) and knows no stale updates: it runs with sync mode "
                f"'sync' only, got {requested.name!r}; for the other modes use flplatform's "
                "strategies.local_sgd.LocalSGDAveraging (FedAvg/FedAvgM)"
            )
        return requested

    # ------------------------------------------------------------ Flower hooks
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's training messages; none while it would wait for nodes."""
        if not self._enough_nodes(grid, "min_train_nodes", "train"):
            return []
        learned = _learned(arrays)
        messages = self.strategy.configure_train(server_round, learned, config, grid)
        return _with_whole(messages, arrays, learned)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's evaluation messages; none while it would wait for nodes."""
        if not self._enough_nodes(grid, "min_evaluate_nodes", "evaluate"):
            return []
        learned = _learned(arrays)
        messages = self.strategy.configure_evaluate(server_round, learned, config, grid)
        return _with_whole(messages, arrays, learned)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """The wrapped strategy's aggregate of the replies it would accept (None if none).

        An evaluation reply that Flower's checks would refuse (or whose weight is not a
        positive number) is left out with a warning rather than failing the round's
        evaluation; an evaluation that fails anyway is logged and yields None.
        """
        kept: list[Message] = []
        first: list[RecordDict] = []
        for reply in replies:
            if reply.has_error():
                kept.append(reply)  # Flower's strategies count and log these themselves
                continue
            try:
                self._check_consistent([reply.content], check_arrays=False)
                self._check_consistent([*first, reply.content], check_arrays=False)
                self._weight(reply.content)
            except UpdateRejected as exc:
                log.warning(
                    "leaving out the evaluation reply of node %s: %s",
                    reply.metadata.src_node_id,
                    exc.reason,
                )
                continue
            first = first or [reply.content]
            kept.append(reply)
        try:
            return self.strategy.aggregate_evaluate(server_round, kept)
        except Exception:  # evaluation is a measurement: it must not end the run
            log.exception("%s.aggregate_evaluate failed in round %d", self.name, server_round)
            return None

    # ------------------------------------------------- streaming aggregation
    def begin_aggregation(self, server_round: int, arrays: ArrayRecord) -> None:
        """Start collecting the replies of ``server_round``, formed on top of ``arrays``."""
        self._round = server_round
        self._replies = []
        self._whole_sum, self._whole_weight, self._first = {}, 0.0, None
        if arrays is not self._base_record:  # decode each version once
            self._base, self._base_record = record_to_arrays(arrays), arrays

    def read_update(self, reply: Message, *, base: ArrayRecord) -> Update:
        """Check one reply; its update is its model minus ``base``.

        Raises ``UpdateRejected`` if the reply is malformed or the wrapped strategy would
        refuse it.
        """
        content = reply.content
        if len(content.array_records) != 1 or len(content.metric_records) != 1:
            raise UpdateRejected(
                f"a reply to Flower's {self.name} holds exactly one ArrayRecord and one "
                f"MetricRecord, got {len(content.array_records)} and "
                f"{len(content.metric_records)}"
            )
        self._check_consistent([content])  # on its own first: the more telling reason
        if self._first is not None:
            self._check_consistent([self._first, content])
        self._weight(content)
        (metrics,) = content.metric_records.values()
        num_examples = check_num_examples(metrics.get(keys.NUM_EXAMPLES))
        (record,) = content.array_records.values()
        try:
            received = record_to_arrays(record)
        except Exception as exc:  # not .npy bytes, pickled objects, truncated data
            raise UpdateRejected(f"arrays cannot be decoded: {exc}") from None
        expected = self._base if base is self._base_record else record_to_arrays(base)
        check_arrays(received, expected)
        delta = [
            received[k].astype(np.float64) - expected[k]
            for k in expected
            if np.issubdtype(expected[k].dtype, np.inexact)
        ]
        contribution = Contribution(
            num_examples=num_examples,
            train_loss=first_number(metrics, keys.TRAIN_LOSS_ALIASES),
            compute_seconds=first_number(metrics, (keys.COMPUTE_SECONDS,)),
        )
        return Update(contribution, vector=delta, payload=(reply, received, expected))

    def add_update(self, update: Update, *, weight: float, scale: float = 1.0) -> None:
        """Keep the reply for the round's ``aggregate_train``, as the guard allows it.

        Flower's strategy reads the reply itself: a clipped update is written back into it
        as base + s·(x − base), and a capped weight scales the reply's weight key. Integer
        and bool arrays (a BatchNorm's counter) are not the strategy's: training counts
        them, it does not learn them, and in a clipping norm or a q-fair step a counter's
        jump would outweigh every weight (QFedAvg and the server-side DP wrappers also
        fail on them outright). They become the weighted mean of the sites' values, as
        FedAvg's rule and flplatform's own strategies make them (``finish_aggregation``).
        """
        reply, received, expected = update.payload
        content = reply.content
        if self._first is None:  # as it came: what later replies must be consistent with
            self._first = RecordDict(dict(content.items()))
        whole = [k for k, v in received.items() if not np.issubdtype(v.dtype, np.inexact)]
        for key in whole:
            value = received[key].astype(np.float64) * weight
            total = self._whole_sum.get(key)
            self._whole_sum[key] = value if total is None else total + value
        if whole:
            self._whole_weight += weight
        if scale != 1.0 or whole:
            (name,) = content.array_records.keys()
            record = content.array_records[name]
            learned = ArrayRecord()
            for key, value in received.items():
                if key in whole:
                    continue
                if scale == 1.0:
                    learned[key] = record[key]  # as it came
                else:
                    moved = expected[key] + scale * (value.astype(np.float64) - expected[key])
                    learned[key] = encode(moved.astype(value.dtype))
            content[name] = learned
        claimed = update.contribution.num_examples
        if weight < claimed:
            (name,) = content.metric_records.keys()
            metrics = content.metric_records[name]
            metrics[self.weighted_by_key] = self._weight(content) * weight / claimed
            if self.weighted_by_key != keys.NUM_EXAMPLES:
                metrics[keys.NUM_EXAMPLES] = int(weight)
        self._replies.append(reply)

    def finish_aggregation(self) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The wrapped strategy's ``aggregate_train`` over the round's accepted replies.

        Returns
        -------
        tuple of (ArrayRecord or None, MetricRecord or None)
            The new global model and the training metrics; (None, None) when no reply was
            accepted or the strategy refused the replies after all (the model stays).

        Raises
        ------
        RunFailed
            If the wrapped strategy's aggregation raises anything else (a fault in the
            strategy, not in a reply).
        """
        replies, self._replies, self._first = self._replies, [], None
        if not replies:
            return None, None
        try:
            with _collections_of_new_objects_only():
                arrays, metrics = self.strategy.aggregate_train(self._round, replies)
        except InconsistentMessageReplies as exc:
            log.warning("%s refused the replies of round %d: %s", self.name, self._round, exc)
            return None, None
        except Exception as exc:
            raise RunFailed(
                f"Flower's {self.name}.aggregate_train failed in round {self._round}: {exc!r}"
            ) from exc
        if arrays is not None:
            aggregated = record_to_arrays(arrays)
            for key, total in self._whole_sum.items():
                aggregated[key] = total / self._whole_weight
            arrays = self._in_model_dtypes(
                {k: aggregated[k] for k in self._base if k in aggregated}
                | {k: v for k, v in aggregated.items() if k not in self._base}
            )
        return arrays, metrics

    def _in_model_dtypes(self, aggregated: dict[str, np.ndarray]) -> ArrayRecord:
        """``aggregated`` with the round's model's dtypes, its arrays checked finite.

        Flower's strategies compute in NumPy's promotion rules: under NumPy 2, FedAdam's
        bias-corrected step (a float64 scalar times a float32 array) returns float64
        weights. Flower's own ``start`` sends that on and PyTorch sites cast it on loading;
        here every reply must carry the model's dtypes, so the model's own dtypes win, said
        once in the log. The integer arrays' means (``add_update``) are rounded to the
        nearest, and refused outside their dtype's range.
        """
        changed: list[str] = []
        for key, value in aggregated.items():
            model = self._base.get(key)
            if model is not None and value.dtype != model.dtype:
                whole = not np.issubdtype(model.dtype, np.inexact)
                if not whole:  # our own means of the integer arrays are no news
                    changed.append(f"'{key}' {value.dtype} (the model's {model.dtype})")
                if whole and np.issubdtype(value.dtype, np.inexact):
                    value = np.rint(value)
                    info = np.iinfo(model.dtype) if model.dtype.kind in "iu" else None
                    low, high = (0, 1) if info is None else (info.min, info.max)
                    inside = np.isfinite(value).all() and (
                        value.size == 0 or low <= value.min() <= value.max() <= high
                    )
                    if not inside:
                        raise StepRefused(
                            f"array '{key}' ({model.dtype}) would hold values outside its range"
                        )
                aggregated[key] = value.astype(model.dtype)
            if (
                np.issubdtype(aggregated[key].dtype, np.inexact)
                and not np.isfinite(aggregated[key]).all()
            ):
                raise StepRefused(f"Flower's {self.name} made array '{key}' non-finite")
        if changed and not self._said_dtypes:
            self._said_dtypes = True
            log.warning(
                "Flower's %s returned %s%s: its arrays are cast back to the model's dtypes "
                "every round (said once)",
                self.name,
                ", ".join(changed[:3]),
                f" and {len(changed) - 3} more" if len(changed) > 3 else "",
            )
        return arrays_to_record(aggregated)

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What the wrapped Flower strategy changes as it runs, and Python's ``random``.

        Flower keeps its server state in attributes (``FLOWER_STATE``: FedOpt's m_t, v_t,
        FedAvgM's momentum, the DP wrappers' clipping norm, ...), through a DP wrapper's
        inner strategy too; FedAvg has none. Flower samples nodes with the ``random``
        module, so its position is saved as well (a resumed run then samples the same
        nodes, as long as nothing else in the process draws from it).
        """
        return {"flower": _flower_state(self.strategy), "random": random.getstate()}

    def load_state_dict(
        self, state: Mapping[str, Any], *, nodes: Mapping[int, int] | None = None
    ) -> None:
        """Restore ``state_dict()`` into the same Flower strategy; ``CheckpointError`` lists
        every problem, nothing changed (not even ``random``)."""
        reader = StateReader(f"{type(self).__name__}({self.name})", nodes)
        fields = reader.fields(state, "", "flower", "random")
        if fields is None:
            reader.raise_if_any()
            return
        assignments: list[tuple[Any, str, Any]] = []
        _read_flower_state(reader, self.strategy, fields["flower"], "flower", assignments)
        generator = random.Random()
        try:
            if fields["random"] is not MISSING:
                generator.setstate(fields["random"])
        except (TypeError, ValueError) as exc:
            reader.add(f"'random' is not a state of Python's random module: {exc}")
        reader.raise_if_any()
        for owner, name, value in assignments:
            setattr(owner, name, value)
        random.setstate(generator.getstate())

    # ------------------------------------------------------------ helpers
    def _check_consistent(self, contents: list[RecordDict], *, check_arrays: bool = True) -> None:
        """Flower's own consistency rule over ``contents`` (the last one is being judged)."""
        try:
            validate_message_reply_consistency(
                contents, weighted_by_key=self.weighted_by_key, check_arrayrecord=check_arrays
            )
        except InconsistentMessageReplies as exc:
            reason = str(exc).replace(" Skipping aggregation.", "").strip()
            raise UpdateRejected(f"Flower's {self.name} would refuse it: {reason}") from None

    def _weight(self, content: RecordDict) -> float:
        """The reply's aggregation weight: a finite number > 0, or ``UpdateRejected``."""
        (metrics,) = content.metric_records.values()
        value = metrics.get(self.weighted_by_key)
        weight = first_number(metrics, (self.weighted_by_key,))
        if weight is None or weight <= 0:
            raise UpdateRejected(
                f"'{self.weighted_by_key}' (the weight of Flower's {self.name}) must be a "
                f"number > 0, got {value!r}"
            )
        return weight

    def _enough_nodes(self, grid: Grid, minimum: str, what: str) -> bool:
        """Whether the wrapped strategy's sampling would find its nodes without waiting."""
        nodes = len(list(grid.get_node_ids()))
        need = max(_count(self.strategy, "min_available_nodes"), _count(self.strategy, minimum))
        if nodes >= need:
            return True
        log.info(
            "%s needs %d nodes to %s, %d are free: waiting for more", self.name, need, what, nodes
        )
        return False


def _learned(arrays: ArrayRecord) -> ArrayRecord:
    """``arrays`` without its integer and bool arrays (the strategy's share of the model)."""
    if all(np.issubdtype(_dtype(a), np.inexact) for a in arrays.values()):
        return arrays
    learned = ArrayRecord()
    for key, array in arrays.items():
        if np.issubdtype(_dtype(array), np.inexact):
            learned[key] = array
    return learned


def _dtype(array: Array) -> np.dtype[Any]:
    return np.dtype(array.dtype)


def _with_whole(
    messages: Iterable[Message], arrays: ArrayRecord, learned: ArrayRecord
) -> list[Message]:
    """``messages`` whose model (an ArrayRecord holding ``learned``, ``arrays``' learned
    arrays) has the integer and bool arrays back, in the model's key order: the sites get
    the whole model."""
    messages = list(messages)
    if learned is arrays:
        return messages
    for message in messages:
        for name, record in list(message.content.array_records.items()):
            if list(record.keys()) == list(learned.keys()):
                whole = ArrayRecord()
                for key in arrays:
                    whole[key] = record[key] if key in record else arrays[key]
                message.content[name] = whole
    return messages


def _count(strategy: Any, name: str) -> int:
    """An integer attribute of ``strategy`` (0 if it has none)."""
    value = getattr(strategy, name, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


# What Flower 1.x strategies change as they run (read from their source): the model the
# server optimiser steps from, its moments, FedAvgM's momentum, DP adaptive clipping's norm,
# the bagging ensemble. Configuration (learning rates, fractions) is rebuilt from options.
FLOWER_STATE = ("current_arrays", "m_t", "v_t", "momentum_vector", "clipping_norm", "current_bst")


def _flower_state(strategy: Any) -> dict[str, Any]:
    """The ``FLOWER_STATE`` attributes ``strategy`` has, and its inner strategy's."""
    state: dict[str, Any] = {
        name: _copy(getattr(strategy, name)) for name in FLOWER_STATE if hasattr(strategy, name)
    }
    inner = getattr(strategy, "strategy", None)
    if isinstance(inner, Strategy):
        state["strategy"] = _flower_state(inner)
    return state


def _copy(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    if isinstance(value, ArrayRecord):
        return value.copy()
    return value


def _read_flower_state(
    reader: StateReader,
    strategy: Any,
    state: Any,
    where: str,
    assignments: list[tuple[Any, str, Any]],
) -> None:
    """Check ``state`` against ``strategy``'s attributes; queue the assignments."""
    names = [n for n in FLOWER_STATE if hasattr(strategy, n)]
    inner = getattr(strategy, "strategy", None)
    expected = [*names, *(["strategy"] if isinstance(inner, Strategy) else [])]
    fields = reader.fields(state, where, *expected)
    if fields is None:
        return
    model = fields.get("current_arrays")
    model_arrays = _named_arrays(model)
    for name in names:
        value, at = fields[name], f"{where}.{name}"
        current = getattr(strategy, name)
        if value is MISSING:
            continue
        if value is None:
            assignments.append((strategy, name, None))
        elif name == "clipping_norm":
            norm = reader.real(value, at, minimum=0.0)
            if norm is not None:
                assignments.append((strategy, name, norm))
        elif name == "current_bst":
            if isinstance(value, bytes):
                assignments.append((strategy, name, value))
            else:
                reader.add(f"'{at}' must be bytes, got {type(value).__name__}")
        elif name == "current_arrays" and isinstance(value, ArrayRecord):
            assignments.append((strategy, name, value.copy()))
        elif isinstance(value, dict):  # FedOpt's model, m_t, v_t: name → array
            like = model_arrays if name != "current_arrays" else None
            arrays = reader.arrays(value, at, like=like, dtype=None)
            if arrays is not None:
                assignments.append((strategy, name, arrays))
        elif isinstance(value, list):  # FedAvgM's momentum: one array per model array
            like_list = None if model_arrays is None else list(model_arrays.values())
            arrays_list = [
                reader.array(
                    v,
                    f"{at}[{i}]",
                    shape=None if like_list is None or i >= len(like_list) else like_list[i].shape,
                    finite=True,
                )
                for i, v in enumerate(value)
            ]
            if like_list is not None and len(value) != len(like_list):
                reader.add(f"'{at}' holds {len(value)} arrays, the model {len(like_list)}")
            if all(a is not None for a in arrays_list):
                assignments.append((strategy, name, arrays_list))
        else:
            reader.add(
                f"'{at}' has an unexpected {type(value).__name__} "
                f"(Flower's {type(strategy).__name__} holds a {type(current).__name__})"
            )
    if isinstance(inner, Strategy):
        _read_flower_state(reader, inner, fields["strategy"], f"{where}.strategy", assignments)


def _named_arrays(model: Any) -> dict[str, np.ndarray] | None:
    """A saved ``current_arrays`` as name → array (an ArrayRecord or FedOpt's dict)."""
    if isinstance(model, ArrayRecord):
        return {k: v.numpy() for k, v in model.items()}
    if isinstance(model, dict) and all(isinstance(v, np.ndarray) for v in model.values()):
        return model
    return None
