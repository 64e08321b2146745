"""Delayed compensated updates (DTS, "Distributed Training Across the World"; DGA).

ALGORITHMS.md §2; the bookkeeping is in ``strategies.compensation``. No site ever waits
for the latest global average:

* Period r at site n: p local steps from its local model give the accumulated step
  A_{n,r}; the site keeps it and sends it tagged with r.
* Round r's average Ā_r = Σ w_n A_{n,r} / Σ w_n (weights: examples) over the sites whose
  round-r update was included; the global model is x_r = x_{r−1} + η·Ā_r (with an outer
  momentum, its step on Ā_r).
* A site may start period q as soon as it has sent period q − 1 and x_{q−1−D} exists:
  it is sent that D-round-old model, tells which of its own periods made it into the
  averages, and rebuilds x_local = x_{q−1−D} + (its periods since) — the swap
  x ← x − A_{n,r} + Ā_r in closed form. A period left out is carried into the next
  update instead of swapped.

With ``PeriodSync`` (the engine's policy for this strategy) round r is aggregated when
every period-r update is back, while fast sites run up to D periods ahead; on a virtual
clock their downloads and uploads overlap their computation, so with D large enough the
round trip leaves the critical path. D = 0 is local-SGD averaging, D = 0 with p = 1
synchronous SGD.

Choices: site momentum restarts every period (A_{n,r} is the period's net change, so the
swap leaves no residue); the server applies Ā_r with learning rate η, and with an outer
momentum β if asked (heavy ball, or Nesterov: DiLoCo's outer step, ``strategies.aggregation``;
the swap holds either way, as the site rebuilds its model on the x_v it is sent, whatever
step made it); every site takes part in every period (no sampling). The reply's
``arrays`` hold A_{n,r}, not a model: the site half is ``strategies.mods.delayed_mod``
around the site's own train function; a ClientApp without it replies with no ``period``
and is rejected, the reason saying so.

With a codec (``codec="topk:0.01"``, DTS's recipe) sites upload A_{n,r} compressed with
error feedback and the server decodes it before averaging; the ledger counts the bytes
that crossed. A site that lost its kept periods (a restarted SuperNode) says so: its
unsettled periods are dropped and its update, trained from the global model, counts.

Streaming sync (``fragments`` F > 1; Douillard et al. 2025, "Streaming DiLoCo with
overlapping communication"): the model's arrays are split into F fragments
(``strategies.fragments``) and round r averages and steps fragment (r − 1) mod F only, so
each fragment is synced every F rounds with the change its sites made since its last sync
(the rest of A_{n,r} waits in the site's carry). The outer step of a fragment reaches the
sites D rounds late and is swapped in by the compensation above; DiLoCo-style mixing
(x ← α·x_local + (1 − α)·x_global) would instead blend away part of the site's own
progress of those D rounds, which the swap keeps exactly; with D = 0 the swap is DiLoCo.
Downloads are fragments too: a site is sent the arrays changed since the global version it
holds (first contact, a failed or lost message: the whole model). The momentum of a
fragment moves only when it is stepped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from flplatform.core import keys
from flplatform.core.arrays import arrays_to_record, record_to_arrays
from flplatform.core.checks import require
from flplatform.core.errors import ConfigError, StepRefused, UpdateRejected
from flplatform.core.reply_checks import check_arrays, check_num_examples, reply_parts
from flplatform.core.state import StateReader
from flplatform.engine import (
    AggregationPolicy,
    Contribution,
    EngineStrategy,
    PeriodSync,
    Synchrony,
    Update,
    Work,
)
from flplatform.engine.replies import first_number, record_of
from flplatform.run.start import PlatformStart
from strategies.aggregation import (
    ServerOptimizerState,
    WeightedDeltaSum,
    apply_server_update,
)
from strategies.averaged_arrays import averaged_of, judged_changes
from strategies.codecs import Codec, Identity, make_codec
from strategies.compensation import ServerPeriods
from strategies.fragments import Fragments, changed_since, fragment_of_round, split_fragments
from strategies.knobs import DELAYED_SYNC_ONLY, DelayedKnobs
from strategies.layout import Layout
from strategies.local_sgd import (
    aggregate_batch,
    codec_config,
    fit_codec,
    lost_without_update,
    reject_state_lost,
    state_lost_note,
)
from strategies.sampling import evaluation_messages, mean_evaluation
from strategies.sparse_sync import DENSE, HeldVersions, sent_pair

log = logging.getLogger("flplatform.strategies.delayed")

SITE_ALGORITHM = keys.DELAYED


@dataclass
class DelayedState:
    """Server state that outlives a round.

    ``models`` is the FIFO of the last D + 1 global models (version → record), what
    sites starting a period are sent; ``open`` holds one accumulator per period that
    has updates but no average yet (at most D + 1, however many sites there are).
    """

    periods: ServerPeriods
    version: int = 0
    models: dict[int, ArrayRecord] = field(default_factory=dict)
    open: dict[int, WeightedDeltaSum] = field(default_factory=dict)
    losses: dict[int, tuple[float, float]] = field(default_factory=dict)  # Σ n·loss, Σ n
    replied: dict[int, set[int]] = field(default_factory=dict)  # node → periods it answered
    drafted: dict[int, Work] = field(default_factory=dict)  # node → its last drafted work
    optimizer: ServerOptimizerState = field(default_factory=ServerOptimizerState)  # β > 0
    held: HeldVersions = field(default_factory=HeldVersions)  # streaming sync's downloads

    def state_dict(self) -> dict[str, Any]:
        """Everything above as checkpoint data (node ids as they are)."""
        periods = self.periods
        return {
            "version": self.version,
            "models": dict(self.models),
            "open": {
                period: {
                    "sums": {k: v.copy() for k, v in acc.sums.items()},
                    "total_weight": acc.total_weight,
                    "count": acc.count,
                }
                for period, acc in self.open.items()
            },
            "losses": {period: tuple(pair) for period, pair in self.losses.items()},
            "next_period": dict(periods.next_period),
            "unsettled": {n: set(p) for n, p in periods.unsettled.items()},
            "included": {n: set(p) for n, p in periods.included.items()},
            "awaited": dict(periods.awaited),
            "replied": {n: set(p) for n, p in self.replied.items()},
            "drafted": {
                n: {
                    "period": w.period,
                    "model_version": w.model_version,
                    "delay": w.delay,
                    "fragment": w.fragment,
                }
                for n, w in self.drafted.items()
            },
            "velocity": {k: v.copy() for k, v in self.optimizer.velocity.items()},
            "synced": dict(self.held.synced),
            "syncing": {n: list(pair) for n, pair in self.held.sent.items()},
        }

    @classmethod
    def read(
        cls,
        reader: StateReader,
        state: Mapping[str, Any],
        *,
        delay: int,
        model: Mapping[str, np.ndarray] | None,
        fragments: int = 1,
    ) -> DelayedState | None:
        """The state ``state_dict()`` wrote, checked against a run with this ``delay`` and
        ``fragments``.

        ``model``: the arrays the strategy holds already, which every saved model must
        match (None: they need only match one another). Problems go to ``reader``.
        """
        names = (
            *("version", "models", "open", "losses", "next_period", "unsettled"),
            *("included", "awaited", "replied", "drafted"),
        )
        # Saved before outer momentum and streaming sync: none of either then.
        later = ("velocity", "synced", "syncing")
        present = [n for n in later if isinstance(state, Mapping) and n in state]
        fields = reader.fields(state, "", *names, *present)
        if fields is None:
            return None
        version = reader.integer(fields["version"], "version", minimum=0)
        models = reader.keyed(fields["models"], "models", lambda v, at: _record(reader, v, at))
        if version is not None and models is not None:
            # After a round: versions v − 1 − D … v (pruned when the next round begins).
            if version not in models and (version or models):  # (empty before round 1)
                reader.add(f"'models' lacks the current version {version}")
            stale = sorted(v for v in models if not version - 1 - delay <= v <= version)
            if stale:
                reader.add(
                    f"'models' holds versions {stale}, outside {version - 1 - delay}…{version} "
                    f"of a run with delay {delay}"
                )
        decoded = _decoded_models(reader, models or {}, model)
        like = model or next(iter(decoded.values()), None)
        losses = reader.keyed(fields["losses"], "losses", lambda v, at: _loss(reader, v, at))
        split = None
        if fragments > 1 and like is not None:
            try:
                split = split_fragments([(k, int(v.size)) for k, v in like.items()], fragments)
            except ConfigError as exc:
                reader.add(str(exc))

        open_ = reader.keyed(
            fields["open"], "open", lambda v, at: _weighted_sum(reader, v, at, like=like)
        )
        for period, acc in (open_ or {}).items():  # a period's sums: its fragment's arrays
            if like is None or (fragments > 1 and split is None):
                break
            expected = tuple(like) if split is None else split[fragment_of_round(period, fragments)]
            if tuple(acc.sums) != expected:
                reader.add(
                    f"'open[{period}]' holds arrays {list(acc.sums)[:6]}, but period {period} "
                    f"sums {list(expected)[:6]}"
                )
        # the momentum holds the arrays stepped so far: each an array of the model
        velocity = (
            reader.arrays(fields["velocity"], "velocity", like=_part(like, fields["velocity"]))
            if "velocity" in fields
            else {}
        )
        synced = (
            reader.keyed(
                fields["synced"],
                "synced",
                lambda v, at: reader.integer(v, at, minimum=0),
                by_node=True,
            )
            if "synced" in fields
            else {}
        )
        syncing = (
            reader.keyed(
                fields["syncing"], "syncing", lambda v, at: sent_pair(reader, v, at), by_node=True
            )
            if "syncing" in fields
            else {}
        )
        by_node = {"by_node": True}
        next_period = reader.keyed(fields["next_period"], "next_period", reader.integer, **by_node)
        awaited = reader.keyed(fields["awaited"], "awaited", reader.integer, **by_node)
        unsettled = reader.keyed(fields["unsettled"], "unsettled", reader.integers, **by_node)
        included = reader.keyed(fields["included"], "included", reader.integers, **by_node)
        replied = reader.keyed(fields["replied"], "replied", reader.integers, **by_node)
        drafted = reader.keyed(
            fields["drafted"], "drafted", lambda v, at: _work(reader, v, at), **by_node
        )
        parts = (version, models, open_, losses, next_period, awaited, unsettled, included)
        later_parts = (velocity, synced, syncing)
        if any(p is None for p in (*parts, *later_parts, replied, drafted)) or (
            reader.problems.problems
        ):
            return None
        periods = ServerPeriods(
            delay,
            next_period=next_period or {},
            unsettled=unsettled or {},
            included=included or {},
            awaited=awaited or {},
        )
        return cls(
            periods=periods,
            version=version or 0,
            models=models or {},
            open=open_ or {},
            losses=losses or {},
            replied=replied or {},
            drafted=drafted or {},
            optimizer=ServerOptimizerState(velocity=velocity or {}),
            held=HeldVersions(synced or {}, syncing or {}),
        )


def _record(reader: StateReader, value: Any, where: str) -> ArrayRecord | None:
    if not isinstance(value, ArrayRecord):
        reader.add(f"'{where}' must be a model (an ArrayRecord), got {type(value).__name__}")
        return None
    return value


def _decoded_models(
    reader: StateReader,
    models: Mapping[int, ArrayRecord],
    model: Mapping[str, np.ndarray] | None,
) -> dict[int, dict[str, np.ndarray]]:
    """Each saved model's arrays, all with the names, shapes and dtypes of the first (or
    of ``model``, the one the strategy holds)."""
    decoded: dict[int, dict[str, np.ndarray]] = {}
    for version, record in models.items():
        try:
            arrays = record_to_arrays(record)
        except Exception as exc:  # not .npy bytes: a damaged checkpoint
            reader.add(f"'models[{version}]' cannot be decoded: {exc}")
            continue
        like = model or next(iter(decoded.values()), None)
        if like is not None and _signature(arrays) != _signature(like):
            reader.add(f"'models[{version}]' does not have this run's model arrays")
            continue
        decoded[version] = arrays
    return decoded


def _signature(arrays: Mapping[str, np.ndarray]) -> list[tuple[str, tuple[int, ...], str]]:
    return [(k, tuple(v.shape), str(v.dtype)) for k, v in arrays.items()]


def _loss(reader: StateReader, value: Any, where: str) -> tuple[float, float] | None:
    """(Σ n·loss, Σ n) of a period's accepted updates."""
    if not isinstance(value, tuple | list) or len(value) != 2:
        reader.add(f"'{where}' must be a pair (Σ n·loss, Σ n), got {value!r:.60}")
        return None
    total, weight = reader.real(value[0], f"{where}[0]"), reader.real(value[1], f"{where}[1]")
    return None if total is None or weight is None else (total, weight)


def _part(like: Mapping[str, np.ndarray] | None, saved: Any) -> Mapping[str, np.ndarray] | None:
    """The model arrays ``saved`` (a mapping of arrays) names, for ``StateReader.arrays``:
    each must be an array of the model (a fragment's sums hold its arrays only)."""
    if like is None or not isinstance(saved, Mapping):
        return like
    return {k: like[k] for k in saved if k in like} if set(saved) <= set(like) else like


def _weighted_sum(
    reader: StateReader, value: Any, where: str, *, like: Mapping[str, np.ndarray] | None
) -> WeightedDeltaSum | None:
    """A period's open accumulator: Σ w·s·A (float64, the model's arrays, or a fragment's),
    Σ w, count."""
    fields = reader.fields(value, where, "sums", "total_weight", "count")
    if fields is None:
        return None
    sums = reader.arrays(fields["sums"], f"{where}.sums", like=_part(like, fields["sums"]))
    total = reader.real(fields["total_weight"], f"{where}.total_weight", minimum=0.0)
    count = reader.integer(fields["count"], f"{where}.count", minimum=1)
    if sums is None or total is None or count is None:
        return None
    return WeightedDeltaSum(sums=sums, total_weight=total, count=count)


def _work(reader: StateReader, value: Any, where: str) -> Work | None:
    # saved since streaming sync (None: the whole model); older checkpoints lack it
    later = ("fragment",) if isinstance(value, Mapping) and "fragment" in value else ()
    fields = reader.fields(value, where, "period", "model_version", "delay", *later)
    if fields is None:
        return None
    period = reader.integer(fields["period"], f"{where}.period", minimum=1)
    version = reader.integer(fields["model_version"], f"{where}.model_version", minimum=0)
    delay = reader.integer(fields["delay"], f"{where}.delay", minimum=0)
    saved = fields.get("fragment")
    fragment = None if saved is None else reader.integer(saved, f"{where}.fragment", minimum=0)
    if (
        period is None
        or version is None
        or delay is None
        or (saved is not None and fragment is None)
    ):
        return None
    return Work(period, version, delay=delay, fragment=fragment)


class DelayedCompensated(PlatformStart, Strategy, EngineStrategy):
    """Delayed compensated updates as a Flower Message-API strategy, run by the engine.

    Parameters
    ----------
    delay : int
        D ≥ 0: rounds between a period's end and its average reaching the site.
    num_rounds : int
        Rounds of the run: no site is given a period beyond the last.
    compensate : bool
        Swap the site's own stale steps for the averages (True), or train from the stale
        global model alone (False: plain delayed SGD, the ablation).
    eta : float
        Server learning rate η applied to each average.
    beta : float
        Outer momentum β in [0, 1) on the averages (0: none).
    nesterov : bool
        Nesterov momentum instead of heavy ball (needs β > 0): DiLoCo's outer step.
    fragments : int
        F ≥ 1: streaming sync, each round syncing one of F fragments of the model (1: the
        whole model every round). Needs compensation.
    fraction_evaluate : float
        Fraction of idle sites asked to evaluate the global model after each round.
    seed : int
        Evaluation sampling depends only on (seed, round).
    codec : str
        Upload compression of A_{n,r} with error feedback at the site (``none``,
        ``int8``, ``int4``, ``topk:<k>``, ``topk:<fraction>``).
    averaged_arrays : sequence of str
        Arrays (names or shell patterns) the codec must send exactly, as
        ``LocalSGDAveraging``'s.
    """

    def __init__(
        self,
        *,
        delay: int,
        num_rounds: int,
        compensate: bool = True,
        eta: float = 1.0,
        beta: float = 0.0,
        nesterov: bool = False,
        fragments: int = 1,
        fraction_evaluate: float = 0.0,
        seed: int = 0,
        codec: str = "none",
        averaged_arrays: Sequence[str] = (),
    ) -> None:
        require(
            DelayedKnobs(
                delay=delay,
                num_rounds=num_rounds,
                compensate=compensate,
                eta=eta,
                beta=beta,
                nesterov=nesterov,
                fragments=fragments,
                fraction_evaluate=fraction_evaluate,
                codec=codec,
                averaged_arrays=averaged_arrays,
            ).problems()
        )
        self.averaged_arrays = tuple(averaged_arrays)
        self.delay = delay
        self.num_rounds = num_rounds
        self.compensate = bool(compensate)
        self.eta = eta
        self.beta = beta
        self.nesterov = bool(nesterov)
        self.fragments = fragments
        self._split: Fragments = ()  # the fragments' arrays, once the model is known
        # (version, held version) → the arrays a site holding that version lacks
        self._downloads: dict[tuple[int, int], ArrayRecord] = {}
        self.seed = seed
        self.codec: Codec = make_codec(codec)
        self._fitted_codec = False  # whether the codec was fitted to the model (once)
        self.state = DelayedState(periods=ServerPeriods(delay))
        self._round = 0
        self._current: dict[str, np.ndarray] = {}
        self._current_record: ArrayRecord | None = None
        self.fraction_evaluate = fraction_evaluate

    def summary(self) -> None:
        """Log the configuration."""
        log.info(
            "DelayedCompensated: delay=%s compensate=%s eta=%s beta=%s nesterov=%s "
            "fragments=%s rounds=%s",
            self.delay,
            self.compensate,
            self.eta,
            self.beta,
            self.nesterov,
            self.fragments,
            self.num_rounds,
        )

    # ------------------------------------------------------------ Flower hooks
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Start every idle site on its next period, if its D-round-old model exists."""
        periods = self.state.periods
        # Driven without begin_aggregation (Flower's own loop): the model given is current.
        self.state.models.setdefault(self.state.version, arrays)
        self._fit_codec(arrays)
        messages = []
        for node_id in sorted(grid.get_node_ids()):
            period = periods.period_for(
                node_id, open_round=server_round, last_round=self.num_rounds
            )
            if period is None:
                continue
            version = periods.version_for(period)
            # Only answered, unsettled periods matter (at most D + 1 of them are kept).
            held = periods.unsettled.get(node_id, set()) & self.state.replied.get(node_id, set())
            self.state.replied[node_id] = held
            site_config = ConfigRecord(dict(config))  # never write into the caller's record
            site_config.update(
                {
                    keys.SERVER_ROUND: period,
                    keys.MODEL_VERSION: version,
                    keys.SITE_ALGORITHM: SITE_ALGORITHM,
                    keys.DELAY: self.delay,
                    keys.COMPENSATE: self.compensate,
                    keys.INCLUDED_PERIODS: periods.news_for(node_id, version),
                    # Compensating, a site holds the steps of the unsettled periods it
                    # answered (a period drafted but never answered left nothing there).
                    keys.STATE_EXPECTED: self.compensate and bool(held),
                }
            )
            if not isinstance(self.codec, Identity):
                site_config.update(codec_config(self.codec))
            model = self.state.models[version]
            fragment = None
            if self.fragments > 1:
                model, site_config[keys.SYNC_FROM] = self._download(node_id, version)
                site_config[keys.FRAGMENTS] = self.fragments
                fragment = fragment_of_round(period, self.fragments)
            content = RecordDict({keys.ARRAYS: model, keys.CONFIG: site_config})
            messages.append(Message(content, dst_node_id=node_id, message_type=MessageType.TRAIN))
            periods.sent(node_id, period)
            # The model lacks the averages of rounds version + 1 … period − 1: D of them
            # once the pipeline is full.
            self.state.drafted[node_id] = Work(
                period, version, delay=max(0, period - 1 - version), fragment=fragment
            )
        return messages

    def _download(self, node_id: int, version: int) -> tuple[ArrayRecord, int]:
        """Streaming sync: what ``node_id`` needs to hold x_version, (record, the version it
        must hold first or DENSE): the arrays of the fragments changed since the version it
        holds, or the whole model when that is unknown (first contact, a failed or lost
        message) or every fragment changed since."""
        model = self.state.models[version]
        held = self.state.held.take(node_id, version)
        if held is None or held > version:
            return model, DENSE
        changed = changed_since(held, version, self.fragments)
        if len(changed) == self.fragments:
            return model, DENSE
        if (version, held) not in self._downloads:
            # one record per (version, held): the engine measures each content once
            names = {name for f in changed for name in self._split[f]}
            arrays = {k: model[k] for k in model if k in names}  # the model's order
            self._downloads = {
                key: record for key, record in self._downloads.items() if key[0] >= version
            }
            self._downloads[(version, held)] = ArrayRecord(arrays)
        return self._downloads[(version, held)], held

    def _fragment_arrays(self, period: int) -> tuple[str, ...]:
        """The arrays period ``period``'s updates carry (all of them without fragments)."""
        if self.fragments == 1:
            return tuple(self._current)
        return self._split[fragment_of_round(period, self.fragments)]

    def message_not_sent(self, message: Message) -> None:
        """The engine did not send this drafted message: its site holds what it held."""
        self.state.held.withdraw(message.metadata.dst_node_id)

    def work_for(self, message: Message, *, server_round: int, model_version: int) -> Work:
        """Period q and the model x_{q−1−D} of the message drafted for its site."""
        return self.state.drafted.pop(message.metadata.dst_node_id)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's batch hook: accumulate the round's replies and average them."""
        base = self.state.models[self.state.version]
        return aggregate_batch(self, server_round, base, replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """As local-SGD averaging: a seeded sample of idle sites evaluates x_r."""
        return evaluation_messages(
            self.seed, server_round, arrays, config, grid.get_node_ids(), self.fraction_evaluate
        )

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Example-weighted mean of the sites' evaluation metrics."""
        return mean_evaluation(replies)

    def _fit_codec(self, arrays: ArrayRecord) -> None:
        """Fit the codec, and split the fragments, to the model once
        (``strategies.local_sgd.fit_codec``, ``strategies.fragments.split_fragments``)."""
        if not self._fitted_codec:
            self.codec = fit_codec(self.codec, self.averaged_arrays, arrays)
            self._fitted_codec = True
        if self.fragments > 1 and not self._split:
            sizes = [(name, int(np.prod(arrays[name].shape))) for name in arrays]
            self._split = split_fragments(sizes, self.fragments)  # ConfigError: too few arrays

    # ------------------------------------------------- streaming aggregation
    def begin_aggregation(self, server_round: int, arrays: ArrayRecord) -> None:
        """Round ``server_round`` forms Ā_r on top of ``arrays`` (x_{r−1})."""
        state = self.state
        self._round = server_round
        if arrays is not self._current_record:  # decode each version once
            self._current, self._current_record = record_to_arrays(arrays), arrays
        self._fit_codec(arrays)
        state.models[state.version] = arrays
        oldest = state.version - self.delay  # what a site starting period r + D is sent
        state.models = {v: a for v, a in state.models.items() if v >= oldest}

    def read_update(self, reply: Message, *, base: ArrayRecord) -> Update:
        """Read A_{n,q}, the update of the period q the site computed, and check it."""
        node_id = reply.metadata.src_node_id
        periods = self.state.periods
        # Whatever the reply holds, the site answered: it is not re-offered the period.
        asked = periods.answered(node_id)
        if asked is not None and not reply.has_error():
            self.state.replied.setdefault(node_id, set()).add(asked)
        content = reply.content
        if reply.has_error() or lost_without_update(content):
            self.state.held.forget(node_id)  # the whole model next time
        reject_state_lost(content, "it trains from the global model next period")
        record, metrics = reply_parts(reply)
        period = metrics.get(keys.PERIOD)
        if isinstance(period, bool) or not isinstance(period, int):
            raise UpdateRejected(
                f"delayed updates carry the '{keys.PERIOD}' they were computed for, got "
                f"{period!r}: does the site's ClientApp train with strategies.mods' delayed_mod() "
                "(or flplatform_mod())?"
            )
        # The site's mod ran: it holds the global model its message carried.
        self.state.held.confirm(node_id)
        if asked is None:
            raise UpdateRejected("no update was awaited from this site (a duplicate reply?)")
        if period != asked or period not in periods.unsettled.get(node_id, set()):
            raise UpdateRejected(
                f"reply for period {period}, but this site was asked for period {asked}"
            )
        if period in periods.included.get(node_id, set()):
            raise UpdateRejected(f"period {period} of this site was counted already")
        note = state_lost_note(
            metrics, "its unsettled periods were dropped; this update is from the global model"
        )
        if note is not None:
            periods.forget(node_id, keep=period)
        elif metrics.get(keys.RESIDUAL_LOST) == 1:
            note = (
                "site lost its error-feedback residual (a restarted SuperNode?): it restarted "
                "at zero; its periods were kept"
            )
        # The site has now settled everything up to the model it was sent, whatever
        # becomes of this update.
        periods.acknowledged(node_id, periods.version_for(period))
        if period < self._round:
            raise UpdateRejected(f"period {period} was averaged already (round {self._round})")
        num_examples = check_num_examples(metrics.get(keys.NUM_EXAMPLES))
        try:
            update = record_to_arrays(record)
        except Exception as exc:  # not .npy bytes, pickled objects, truncated data
            raise UpdateRejected(f"arrays cannot be decoded: {exc}") from None
        update = self._decode(content, update, self._fragment_arrays(period))
        loss = first_number(metrics, keys.TRAIN_LOSS_ALIASES)
        seconds = first_number(metrics, (keys.COMPUTE_SECONDS,))
        contribution = Contribution(
            num_examples, train_loss=loss, compute_seconds=seconds, note=note
        )
        payload = (node_id, period, update)
        # the guard compares an update with those of the same fragment only
        kind = "delta"
        if self.fragments > 1:
            kind = f"delta/fragment-{fragment_of_round(period, self.fragments)}"
        averaged = set(averaged_of(update, self.codec.averaged))  # judged apart by the guard
        return Update(
            contribution,
            vector=[part for k, part in update.items() if k not in averaged],
            averaged=judged_changes(
                {k: part for k, part in update.items() if k in averaged},
                {k: self._current[k].dtype for k in update},
            ),
            kind=kind,
            payload=payload,
        )

    def add_update(self, update: Update, *, weight: float, scale: float = 1.0) -> None:
        """Add w·s·A_{n,q} to the accumulator of period q; the site's period is counted."""
        node_id, period, arrays = update.payload
        if period < self._round:  # held by the guard past its own round's average
            raise UpdateRejected(f"period {period} was averaged already (round {self._round})")
        self.state.open.setdefault(period, WeightedDeltaSum()).add(arrays, weight, scale=scale)
        self.state.periods.counted(node_id, period)
        loss = update.contribution.train_loss
        if loss is not None:
            total, loss_weight = self.state.losses.get(period, (0.0, 0.0))
            self.state.losses[period] = (total + weight * loss, loss_weight + weight)

    def _decode(
        self, content: RecordDict, received: dict[str, np.ndarray], names: Sequence[str]
    ) -> dict:
        """A_{n,q} from the reply's arrays (the model's ``names``: a fragment's, or all): as
        sent, or decoded with the run's codec."""
        expected = {k: self._current[k] for k in names}
        config = record_of(content, keys.CONFIG, ConfigRecord)
        named = None if config is None else config.get(keys.CODEC)
        if isinstance(self.codec, Identity) and named in (None, "none"):
            check_arrays(received, expected)
            return received
        if named != self.codec.name:
            raise UpdateRejected(
                f"reply compressed with codec {named!r}, but this run asked for '{self.codec.name}'"
            )
        decoded = self.codec.decode(received, Layout.of(expected))  # UpdateRejected
        return {k: decoded[k] for k in expected}

    def finish_aggregation(self) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """x_r = x_{r−1} + η·Ā_r (with momentum, the momentum's step; with fragments, on
        round r's fragment only); a round without included updates leaves x unchanged.

        Every round makes a version (an empty average is zero), so version r is the model
        sites starting period r + 1 + D are sent.
        """
        state = self.state
        acc = state.open.pop(self._round, None)
        metrics = MetricRecord({"num-updates": acc.count if acc else 0})
        refused: StepRefused | None = None
        if acc is not None and acc.count:
            stepped = {k: self._current[k] for k in self._fragment_arrays(self._round)}
            try:
                new = apply_server_update(
                    stepped,
                    acc.mean(),
                    eta=self.eta,
                    beta=self.beta,
                    nesterov=self.nesterov,
                    state=state.optimizer,
                    # buffers: their mean change, no η
                    averaged=averaged_of(stepped, self.codec.averaged),
                )
                self._current = {k: new.get(k, v) for k, v in self._current.items()}
            except StepRefused as exc:  # an empty average: x unchanged, still a version
                refused = exc
                # No site's update of this period is in the model: none may swap it out.
                for included in state.periods.included.values():
                    included.discard(self._round)
        total, weight = state.losses.pop(self._round, (0.0, 0.0))
        if weight > 0:
            metrics[keys.TRAIN_LOSS] = total / weight
        state.version += 1
        record = arrays_to_record(self._current)
        self._current_record = record
        state.models[state.version] = record
        if refused is not None:
            raise StepRefused(f"the average Ā_{self._round}: {refused.reason}", arrays=record)
        return record, metrics

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``DelayedState`` as checkpoint data: the last D + 2 models, the open periods'
        sums, and every site's periods (sent, answered, included, awaited, drafted).

        The round being aggregated and the decoded current model are not in it: the next
        ``begin_aggregation`` sets them from the model the engine hands over.
        """
        return self.state.state_dict()

    def load_state_dict(
        self, state: Mapping[str, Any], *, nodes: Mapping[int, int] | None = None
    ) -> None:
        """Restore ``state_dict()``; ``CheckpointError`` lists every problem, nothing changed."""
        reader = StateReader(type(self).__name__, nodes)
        restored = DelayedState.read(
            reader,
            state,
            delay=self.delay,
            model=self._current or None,
            fragments=self.fragments,
        )
        reader.raise_if_any()
        assert restored is not None  # a problem was noted otherwise
        self.state = restored
        current = restored.models.get(restored.version)
        if current is not None:
            self._current, self._current_record = record_to_arrays(current), current

    # -------------------------------------------------------------- driving

    def engine_policy(self, requested: Synchrony, *, num_rounds: int) -> AggregationPolicy:
        """``PeriodSync`` (sites working ahead) for ``num_rounds`` rounds; sync mode only."""
        DELAYED_SYNC_ONLY.check(requested.name)
        self.num_rounds = num_rounds  # no site is given a period beyond the last
        return PeriodSync()

    @property
    def ledger_name(self) -> str:
        """The strategy's name in the ledger."""
        return SITE_ALGORITHM

    @property
    def site_mod(self) -> str:
        """The delayed mod: a site sends its period's step, not a model."""
        return SITE_ALGORITHM
