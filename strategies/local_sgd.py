"""Local-SGD averaging: FedAvg, FedAvgM and periodic model averaging.

McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
Data" (FedAvg, 2017); Hsu et al., "Measuring the Effects of Non-Identical Data
Distribution for Federated Visual Classification" (FedAvgM, 2019). ALGORITHMS.md §1.

Site n starts from the global model x, runs H local SGD steps (or E epochs) and replies
with its model x_n and n_n examples: Flower's standard convention, so any Flower
ClientApp that trains and returns ``arrays`` + ``metrics[num-examples]`` takes part.
The server forms Δ_n = x_n − x against the version the site was sent and applies

    Δ̄ = Σ n_n Δ_n / Σ n_n,   v ← β v + Δ̄,   x ← x + η v      (β = 0, η = 1: FedAvg)

Site momentum restarts at every sync (a fresh optimiser per round). Buffers the training
sets rather than learns (BatchNorm statistics and counters, and the arrays the user names:
``strategies.averaged_arrays``) step by Δ̄ alone, whatever β and η: momentum would carry a
running variance past its sites' values. In sync rounds, where every Δ_n is measured from
the current x, that makes them the sites' weighted mean, as in FedAvg; a stale update (the
asynchronous modes) brings its change from the model its site started from.

Robust aggregation (``aggregator = "median"`` or ``"trimmed-mean"``): the round's Δ̄ is
the coordinate-wise median, or the mean after cutting ``trim_fraction`` of the values at
each end, of the updates (Flower's ``aggregate_median`` / ``aggregate_trimmed_avg``). Like
Flower's FedMedian and FedTrimmedAvg they weigh sites equally, and they hold the round's
updates (one model-sized array per site) instead of one running sum. Centred clipping
(``aggregator = "centered-clip"``, ``strategies.centered_clip``) streams: each update is
clipped to ``clip_radius`` median recent distances from the last step's Δ̄ as it arrives,
and the sites keep their weights.

With a codec (``codec = "topk:0.01"``, ``"int8"`` or ``"int4"``, strategies/codecs.py) the site's
``codec_mod`` uploads Δ_n compressed with error feedback,
e_n ← (Δ_n + e_n) − decode(encode(Δ_n + e_n)), and names the codec in its reply's
``config`` record; the server decodes it to Δ_n. A ClientApp without the mod ignores the
codec and replies with its model, which is averaged as usual, so it still takes part.
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
from flplatform.core.arrays import arrays_to_record, record_views
from flplatform.core.checks import require
from flplatform.core.errors import StepRefused, UpdateRejected
from flplatform.core.flower_internals import aggregate_median, aggregate_trimmed_avg
from flplatform.core.reply_checks import check_arrays, check_num_examples, reply_parts
from flplatform.core.state import MISSING, StateReader
from flplatform.engine import Contribution, EngineStrategy, Update
from flplatform.engine.replies import first_number, record_of
from flplatform.engine.wire import measure
from flplatform.run.start import PlatformStart
from strategies.aggregation import (
    ServerOptimizerState,
    WeightedDeltaSum,
    apply_server_update,
    float64_model,
    model_delta,
)
from strategies.averaged_arrays import averaged_of, judged_changes, named_arrays
from strategies.centered_clip import CenteredClip
from strategies.codecs import Codec, Identity, make_codec, with_averaged
from strategies.knobs import (
    CENTERED_CLIP,
    MEAN,
    MEDIAN,
    LocalSGDKnobs,
    robust_aggregation_problem,
)
from strategies.layout import Layout
from strategies.sampling import evaluation_messages, mean_evaluation, sample_sites

log = logging.getLogger("flplatform.strategies.local_sgd")

# Models with more values than this always shrink under a codec: Flower's framing costs a
# few hundred bytes per array, what int8 or top-k save grows with the values.
_FRAMING_MATTERS_BELOW = 1_000_000


def codec_enlarges(codec: Codec, arrays: ArrayRecord) -> str | None:
    """Why ``codec``'s uploads of ``arrays``' model are larger than the model itself, or
    None when they are smaller (always for models of a million values and more).

    A codec's upload is several arrays per model array (indices and values, codes and a
    scale) and Flower frames each one: on a small model the framing outweighs what the
    codec saves. Measured on the arrays as Flower would send them (``engine.wire``).
    """
    model = record_views(arrays)
    values = sum(int(a.size) for a in model.values())
    if isinstance(codec, Identity) or values >= _FRAMING_MATTERS_BELOW:
        return None
    zero = {name: np.zeros_like(a) for name, a in model.items()}
    wire = codec.encode(zero, rng=np.random.default_rng(0))  # sizes do not depend on values
    dense = measure(RecordDict({keys.ARRAYS: arrays})).object_bytes
    sent = measure(RecordDict({keys.ARRAYS: arrays_to_record(wire)})).object_bytes
    if sent < dense:
        return None
    return (
        f"codec {codec.name} uploads {sent:,} B of arrays where the whole model is {dense:,} B "
        f"({values:,} values in {len(model)} arrays): on a model this small Flower's framing "
        "of each array it sends outweighs what it saves; codec none sends less"
    )


def fit_codec(codec: Codec, named: Sequence[str], arrays: ArrayRecord) -> Codec:
    """The run's codec once the model (``arrays``) is known: sending exactly the arrays
    the user ``named`` (names or patterns; ``ConfigError`` for one that matches none),
    and saying once in the log when it would enlarge the uploads (``codec_enlarges``).
    The caller asks once per run."""
    codec = with_averaged(codec, named_arrays(named, arrays.keys()))
    enlarges = codec_enlarges(codec, arrays)
    if enlarges is not None:
        log.warning("%s", enlarges)
    return codec


def codec_config(codec: Codec) -> dict[str, str | list[str]]:
    """What a training message tells the sites' codec mod: the codec, and the arrays the
    user named to travel exactly (the mod sends the rule's own exactly by itself)."""
    named = {keys.AVERAGED_ARRAYS: list(codec.averaged)} if codec.averaged else {}
    return {keys.CODEC: codec.name, **named}


SITE_ALGORITHM = keys.LOCAL_SGD


@dataclass
class LocalSGDState:
    """Server state that outlives a round: the FedAvgM velocity (saved and restored by
    ``LocalSGDAveraging.state_dict``/``load_state_dict``, with the rest of its state).

    The model version is the engine's to count (it also counts rounds that apply no
    update); the strategy keeps only what its own update rule needs.
    """

    optimizer: ServerOptimizerState = field(default_factory=ServerOptimizerState)


class LocalSGDAveraging(PlatformStart, Strategy, EngineStrategy):
    """Local-SGD averaging as a Flower Message-API strategy, driven by the round engine.

    Parameters
    ----------
    eta : float
        Server learning rate η (1.0 is FedAvg).
    beta : float
        Server momentum β in [0, 1) (> 0 is FedAvgM).
    nesterov : bool
        Nesterov momentum instead of heavy ball (needs β > 0): DiLoCo's outer step, the
        model moved by η·(Δ̄ + β v) (``strategies.aggregation``).
    momentum_every : int
        N > 1 (with ``nesterov``): delayed Nesterov, for the async modes: the momentum
        moves every N-th server step, from those steps' mean, and each step moves the
        model by η·Δ̄/N besides.
    fraction_train : float
        Fraction of connected sites sampled per round, in (0, 1]; at least one site.
    fraction_evaluate : float
        Fraction of sites asked to evaluate the global model after each round (0: none).
    seed : int
        Sampling depends only on (seed, round).
    codec : str
        Upload compression the sites' ``codec_mod`` applies (``none``, ``int8``, ``int4``,
        ``topk:<k>``, ``topk:<fraction>``), with error feedback at the site.
    aggregator : {"mean", "median", "trimmed-mean", "centered-clip"}
        How the round's updates are combined (see the module).
    trim_fraction : float
        ``trimmed-mean``: the fraction of values cut at each end, in [0, 0.5).
    clip_radius : float
        ``centered-clip``: the radius τ in median recent distances from the centre, > 0.
    averaged_arrays : sequence of str
        Arrays (names or shell patterns) the codec must send exactly, like the running
        statistics and integer arrays it finds by itself: buffers the training sets
        rather than learns, such as a running class distribution
        (``strategies.averaged_arrays``). Each must match an array of the model.
    """

    def __init__(
        self,
        *,
        eta: float = 1.0,
        beta: float = 0.0,
        nesterov: bool = False,
        momentum_every: int = 1,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 0.0,
        seed: int = 0,
        codec: str = "none",
        aggregator: str = MEAN,
        trim_fraction: float = 0.2,
        clip_radius: float = 1.0,
        averaged_arrays: Sequence[str] = (),
    ) -> None:
        require(
            LocalSGDKnobs(
                eta=eta,
                beta=beta,
                nesterov=nesterov,
                momentum_every=momentum_every,
                fraction_train=fraction_train,
                fraction_evaluate=fraction_evaluate,
                codec=codec,
                aggregator=aggregator,
                trim_fraction=trim_fraction,
                clip_radius=clip_radius,
                averaged_arrays=averaged_arrays,
            ).problems()
        )
        self.averaged_arrays = tuple(averaged_arrays)
        self.aggregator = aggregator
        self.trim_fraction = trim_fraction
        self.clip_radius = clip_radius
        self._held: list[dict[str, np.ndarray]] = []  # median, trimmed mean: the round's updates
        self._said_not_robust = False  # that a round was too small to outvote anyone, once
        self._warning: str | None = None  # ... until the engine takes it (take_warning)
        # centred clipping: its centre and recent distances (None: another aggregator)
        self._centered = CenteredClip(clip_radius) if aggregator == CENTERED_CLIP else None
        self.eta = eta
        self.beta = beta
        self.nesterov = nesterov
        self.momentum_every = momentum_every
        self.fraction_train = fraction_train
        self.fraction_evaluate = fraction_evaluate
        self.seed = seed
        self.codec: Codec = make_codec(codec)
        self._fitted_codec = False  # whether the codec was fitted to the model (once)
        self._layout: Layout | None = None
        # the model's arrays averaged as they are (running statistics, counters), set with
        # the model: the guard judges them apart, centred clipping leaves them whole
        self._averaged: tuple[str, ...] = ()
        self.state = LocalSGDState()
        self._acc = WeightedDeltaSum()
        self._current: dict[str, np.ndarray] = {}
        self._current_record: ArrayRecord | None = None
        # Model-sized float64 memory, kept from one use to the next (fresh pages cost more
        # than the arithmetic): _current in float64 for the subtraction, made once per
        # version (None: not yet) into the last version's (_spent64); the Δ last added,
        # which the next is written into (_spare); the last round's sums (_spent_sums).
        self._current64: dict[str, np.ndarray] | None = None
        self._spent64: dict[str, np.ndarray] = {}
        self._spent_sums: dict[str, np.ndarray] = {}
        self._spare: dict[str, np.ndarray] = {}  # a Δ already added: the next one's memory
        self._loss_sum = 0.0
        self._loss_weight = 0.0
        self._compressing: set[int] = set()  # sites whose compressed uploads were taken
        # load_state_dict ran before the model was known: its arrays are checked against
        # the first model the strategy is handed
        self._restored = False

    def take_warning(self) -> str | None:
        """That a round was too small for the median or trimmed mean to outvote anyone
        (once a run): an own ServerApp's sites are known only as it runs."""
        warning, self._warning = self._warning, None
        return warning

    def summary(self) -> None:
        """Log the configuration."""
        log.info(
            "LocalSGDAveraging: eta=%s beta=%s nesterov=%s momentum_every=%s "
            "fraction_train=%s fraction_evaluate=%s seed=%s aggregator=%s clip_radius=%s",
            self.eta,
            self.beta,
            self.nesterov,
            self.momentum_every,
            self.fraction_train,
            self.fraction_evaluate,
            self.seed,
            self.aggregator,
            self.clip_radius,
        )

    # ------------------------------------------------------------ Flower hooks
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send the global model and the round's config to a seeded sample of sites."""
        self._use_current(arrays)
        config = ConfigRecord(dict(config))  # never write into the caller's record
        config[keys.SERVER_ROUND] = server_round
        config[keys.SITE_ALGORITHM] = SITE_ALGORITHM
        nodes = sample_sites(self.seed, server_round, grid.get_node_ids(), self.fraction_train)
        if isinstance(self.codec, Identity):
            content = RecordDict({keys.ARRAYS: arrays, keys.CONFIG: config})
            return [Message(content, dst_node_id=n, message_type=MessageType.TRAIN) for n in nodes]
        config.update(codec_config(self.codec))
        # A site that uploaded compressed before holds an error-feedback residual. Two
        # shared contents, not one per site: the engine measures each content once.
        contents = {
            expected: RecordDict(
                {
                    keys.ARRAYS: arrays,
                    keys.CONFIG: ConfigRecord({**config, keys.STATE_EXPECTED: expected}),
                }
            )
            for expected in (False, True)
        }
        return [
            Message(contents[n in self._compressing], dst_node_id=n, message_type=MessageType.TRAIN)
            for n in nodes
        ]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's batch hook, through the streaming path (malformed replies skipped)."""
        return aggregate_batch(self, server_round, arrays_to_record(self._current), replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Ask a seeded sample of sites to evaluate the global model on local data."""
        return evaluation_messages(
            self.seed, server_round, arrays, config, grid.get_node_ids(), self.fraction_evaluate
        )

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Example-weighted mean of the sites' evaluation metrics."""
        return mean_evaluation(replies)

    # ------------------------------------------------- streaming aggregation
    def _use_current(self, arrays: ArrayRecord) -> None:
        """Make ``arrays`` the model updates are applied to, decoding it once per version
        (in place: the arrays read the record's bytes, which it keeps).

        The engine hands the same record to ``begin_aggregation`` and to every
        ``configure_train`` of a round; decoding it each time would cost a model-sized
        decode per dispatch.
        """
        changed = arrays is not self._current_record
        if changed:
            self._current, self._current_record = record_views(arrays), arrays
            self._spent64, self._current64 = self._current64 or self._spent64, None
            self._layout = None
        if not self._fitted_codec:
            self.codec = fit_codec(self.codec, self.averaged_arrays, arrays)
            self._fitted_codec = True
        if changed:
            self._averaged = averaged_of(self._current, self.codec.averaged)
            if self._centered is not None:
                # running statistics and counters keep the plain mean (strategies.centered_clip)
                self._centered.skip = frozenset(self._averaged)
        if self._restored:
            self._restored = False
            self._check_restored()

    def begin_aggregation(self, server_round: int, arrays: ArrayRecord) -> None:
        """Start a new accumulator for the round producing the next version."""
        self._use_current(arrays)
        self._acc = WeightedDeltaSum(into=self._spent_sums)
        self._held = []
        if self._centered is not None:
            self._centered.begin_round()
        self._loss_sum, self._loss_weight = 0.0, 0.0

    def read_update(self, reply: Message, *, base: ArrayRecord) -> Update:
        """Validate one reply and read Δ_n, measured against the version sent."""
        content = reply.content
        record, metrics = reply_parts(reply)
        num_examples = check_num_examples(metrics.get(keys.NUM_EXAMPLES))
        # Decoding the base once per round, not once per reply, and the reply in place,
        # keeps the server's cost per reply at one subtraction and one multiply-add.
        base_arrays = self._current if base is self._current_record else record_views(base)
        try:
            received = record_views(record)
        except Exception as exc:  # not .npy bytes, pickled objects, truncated data
            raise UpdateRejected(f"arrays cannot be decoded: {exc}") from None
        codec = _reply_codec(content)
        if codec is None:  # a whole model, Flower's convention
            check_arrays(received, base_arrays)
            if base is self._current_record:
                if self._current64 is None:
                    self._current64 = float64_model(self._current, into=self._spent64)
                base_arrays = self._current64
            spare, self._spare = self._spare, {}
            delta = {
                k: model_delta(received[k], base_arrays[k], out=spare.get(k)) for k in base_arrays
            }
        else:
            delta = self._decode(codec, received)
            self._compressing.add(reply.metadata.src_node_id)
        loss = first_number(metrics, keys.TRAIN_LOSS_ALIASES)
        seconds = first_number(metrics, (keys.COMPUTE_SECONDS,))
        note = state_lost_note(metrics, "its error-feedback residual restarted at zero")
        contribution = Contribution(
            num_examples, train_loss=loss, compute_seconds=seconds, note=note
        )
        return Update(
            contribution,
            vector=[part for k, part in delta.items() if k not in self._averaged],
            averaged=judged_changes(
                {k: part for k, part in delta.items() if k in self._averaged},
                {k: self._current[k].dtype for k in self._averaged},
            ),
            payload=delta,
        )

    def add_update(self, update: Update, *, weight: float, scale: float = 1.0) -> str | None:
        """Add w·s·Δ_n to the round's sum (centred clipping: w·α·(s·Δ_n − c)), or hold s·Δ_n
        for the median and the trimmed mean."""
        delta: dict[str, np.ndarray] = update.payload
        if self._centered is not None:
            # Δ is the strategy's own float64 (read_update), and nothing reads it again
            if scale != 1.0:
                for part in delta.values():
                    np.multiply(part, scale, out=part)
            alpha = self._centered.clip(delta)  # in place: Δ_n − c
            shrunk = alpha < 1.0 and bool(self._centered.skip)  # running statistics: whole
            if shrunk:
                self._centered.shrink(delta, alpha)
            self._acc.add(delta, weight, scale=1.0 if shrunk else alpha, spent=True)
            self._spare = delta
            self._add_loss(update, weight)
            return self._centered.note(alpha)
        elif self.aggregator == MEAN:
            # added, nothing reads Δ again (EngineStrategy.add_update): scaled in place, and
            # its memory holds the next one
            self._acc.add(delta, weight, scale=scale, spent=True)
            self._spare = delta
        else:
            self._held.append({k: v * scale for k, v in delta.items()} if scale != 1 else delta)
        self._add_loss(update, weight)
        return None

    def _add_loss(self, update: Update, weight: float) -> None:
        loss = update.contribution.train_loss
        if loss is not None:
            self._loss_sum += weight * loss
            self._loss_weight += weight

    def _decode(self, name: str, wire: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Δ_n from a compressed reply, in float64; only the codec the server asked for."""
        if name != self.codec.name:
            raise UpdateRejected(
                f"reply compressed with codec '{name}', but this run asked for '{self.codec.name}'"
            )
        if self._layout is None:
            self._layout = Layout.of(self._current)
        decoded = self.codec.decode(wire, self._layout)  # validates: UpdateRejected
        return {k: decoded[k].astype(np.float64) for k in self._current}

    def finish_aggregation(self) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Apply the server update; None when no update was accepted this round."""
        summed = self.aggregator in (MEAN, CENTERED_CLIP)
        count = self._acc.count if summed else len(self._held)
        if count == 0:
            if self._centered is not None:
                self._centered.end_round(stepped=False)
            return None, None
        mean = self._acc.mean(spent=True) if summed else self._robust_mean()
        if self._centered is not None:
            mean = self._centered.recentre(mean)
            self._centered.propose(mean)
        # Free the round's sum before the next round, whether or not the step is taken;
        # its memory holds the next round's.
        self._acc, self._held = WeightedDeltaSum(), []
        self._spent_sums = mean if summed else {}
        stepped = False
        try:
            new = apply_server_update(
                self._current,
                mean,
                eta=self.eta,
                beta=self.beta,
                nesterov=self.nesterov,
                momentum_every=self.momentum_every,
                state=self.state.optimizer,
                spent=True,
                x64=self._current64,
                averaged=self._averaged,
            )
            stepped = True
        except StepRefused as exc:
            raise StepRefused(f"the server step: {exc.reason}") from None
        finally:
            if self._centered is not None:  # the step's Δ̄ is the next centre if taken
                self._centered.end_round(stepped=stepped)
        metrics = MetricRecord({"num-updates": count})
        if self._loss_weight > 0:
            metrics[keys.TRAIN_LOSS] = self._loss_sum / self._loss_weight
        return arrays_to_record(new), metrics  # a copy: ``new`` may be _spent_sums

    def _robust_mean(self) -> dict[str, np.ndarray]:
        """The coordinate-wise median or trimmed mean of the held updates (Flower's maths)."""
        names = list(self._current)
        results = [([held[k] for k in names], 1) for held in self._held]
        # A run's configuration refuses such rounds (flplatform.app.config_rules); an own
        # ServerApp's sites are known only now.
        problem = robust_aggregation_problem(self.aggregator, self.trim_fraction, len(results))
        if problem is not None and not self._said_not_robust:
            self._said_not_robust = True
            self._warning = problem
            log.warning("%s (said once)", problem)
        if self.aggregator == MEDIAN:
            combined = aggregate_median(results)
        else:
            combined = aggregate_trimmed_avg(results, self.trim_fraction)
        return {k: np.asarray(v, np.float64) for k, v in zip(names, combined, strict=True)}

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The server momentum v and the sites whose compressed uploads were taken; with
        delayed Nesterov, the Δ̄ summed since the momentum last moved and the steps taken;
        with centred clipping, its centre and the distances of past rounds.

        Everything else is the round's (reset by ``begin_aggregation``) or derived from
        the model the engine hands over (``_current``, the codec's layout).
        """
        optimizer = self.state.optimizer
        state: dict[str, Any] = {
            "velocity": {k: v.copy() for k, v in optimizer.velocity.items()},
            # Each is told to expect its error-feedback residual (STATE_EXPECTED).
            "compressing": set(self._compressing),
        }
        if self.momentum_every > 1:
            state["pending"] = {k: v.copy() for k, v in optimizer.pending.items()}
            state["steps"] = optimizer.steps
            state["momentum-every"] = self.momentum_every
        if self._centered is not None:
            state.update(self._centered.state_dict())
        return state

    def load_state_dict(
        self, state: Mapping[str, Any], *, nodes: Mapping[int, int] | None = None
    ) -> None:
        """Restore ``state_dict()``; ``CheckpointError`` lists every problem, nothing changed.

        The velocity (and delayed Nesterov's pending sum) must be float64 and finite, empty
        when β = 0, and have the current model's names and shapes once the strategy knows
        the model.
        """
        reader = StateReader(type(self).__name__, nodes)
        delayed = ("pending", "steps", "momentum-every") if self.momentum_every > 1 else ()
        centered = ("center", "distances") if self._centered is not None else ()
        saved = state if isinstance(state, Mapping) else {}
        saved_every = saved.get("momentum-every", 1)
        if saved_every != self.momentum_every:  # the pending sum is of saved_every steps
            reader.add(
                f"the state was saved with server-momentum-every {saved_every!r:.20}, this run "
                f"has {self.momentum_every}: resume it with the value it ran with"
            )
        if ("center" in saved) != bool(centered):
            reader.add(
                f"the state was saved {'with' if 'center' in saved else 'without'} aggregator "
                f"{CENTERED_CLIP}, this run has {self.aggregator}: resume it with the "
                "aggregator it ran with"
            )
        fields = reader.fields(state, "", "velocity", "compressing", *delayed, *centered)
        velocity = compressing = None
        pending: dict[str, np.ndarray] | None = {}
        steps: int | None = 0
        center: dict[str, np.ndarray] | None = {}
        distances: list[list[float]] | None = []
        if fields is not None:
            saved = fields["velocity"]
            # Empty until the first step with momentum; then one array per model array.
            model = self._current if saved and self._current else None
            velocity = reader.arrays(saved, "velocity", like=model)
            compressing = reader.node_set(fields["compressing"], "compressing")
            if velocity and self.beta == 0.0:
                reader.add("'velocity' is saved, but this run has no server momentum (β = 0)")
            if delayed:
                held = fields["pending"]
                model = self._current if held and self._current else None
                pending = reader.arrays(held, "pending", like=model)
                steps = reader.integer(fields["steps"], "steps", minimum=0)
            if self._centered is not None:
                kept = fields["center"]
                skip = self._centered.skip  # set with the model (_use_current)
                clipped = {k: v for k, v in self._current.items() if k not in skip}
                center = reader.arrays(kept, "center", like=clipped if kept and clipped else None)
                distances = _distance_rounds(reader, fields["distances"])
        reader.raise_if_any()
        assert velocity is not None and compressing is not None  # noted otherwise
        assert pending is not None and steps is not None
        self.state.optimizer = ServerOptimizerState(velocity, pending, steps)
        self._compressing = compressing
        if self._centered is not None:
            assert center is not None and distances is not None
            self._centered.restore(center, distances)
        self._restored = not self._current

    def _check_restored(self) -> None:
        """The restored state against the first model handed over: the same arrays, the
        same shapes; ``CheckpointError`` (the run stops) rather than every update failing."""
        reader = StateReader(type(self).__name__)
        optimizer = self.state.optimizer
        for name, saved in (("velocity", optimizer.velocity), ("pending", optimizer.pending)):
            if saved:
                reader.arrays(saved, name, like=self._current)
        if self._centered is not None:
            for problem in self._centered.misfits(self._current):
                reader.add(problem)
        reader.raise_if_any()

    # -------------------------------------------------------------- driving

    @property
    def ledger_name(self) -> str:
        """The strategy's name in the ledger."""
        return SITE_ALGORITHM


def _distance_rounds(reader: StateReader, value: Any) -> list[list[float]] | None:
    """Centred clipping's saved distances: a list of rounds, each a list of numbers >= 0."""
    if value is MISSING:  # noted by ``fields``
        return None
    if not isinstance(value, list) or not all(isinstance(r, list) for r in value):
        reader.add(f"'distances' must be a list of lists of numbers, got {value!r:.60}")
        return None
    rounds = [[reader.real(d, "distances", minimum=0.0) for d in r] for r in value]
    if any(d is None for r in rounds for d in r):
        return None
    return rounds  # type: ignore[return-value]


def aggregate_batch(
    strategy: EngineStrategy, server_round: int, base: ArrayRecord, replies: Iterable[Message]
) -> tuple[ArrayRecord | None, MetricRecord | None]:
    """Flower's batch ``aggregate_train`` through a strategy's streaming hooks.

    Error replies are skipped and malformed ones logged, as the engine does; what the
    engine would note in an update's ledger row (an aggregator's clipping) is logged.
    """
    strategy.begin_aggregation(server_round, base)
    for reply in replies:
        if reply.has_error():
            continue
        node = reply.metadata.src_node_id
        try:
            update = strategy.read_update(reply, base=base)
            note = strategy.add_update(update, weight=update.contribution.num_examples)
        except UpdateRejected as exc:
            log.warning("skipping reply from node %s: %s", node, exc)
            continue
        if note:
            log.info("round %s, reply from node %s: %s", server_round, node, note)
    try:
        return strategy.finish_aggregation()
    except StepRefused as exc:
        log.warning("round %s: step not applied: %s", server_round, exc.reason)
        return None, None


def _reply_codec(content: RecordDict) -> str | None:
    """The codec a reply says it was compressed with; None for a whole model."""
    config = record_of(content, keys.CONFIG, ConfigRecord)
    if config is None or keys.CODEC not in config:
        return None
    name = config[keys.CODEC]
    if not isinstance(name, str):
        raise UpdateRejected(f"reply config '{keys.CODEC}' must be a codec name, got {name!r}")
    return name


def state_lost_note(metrics: MetricRecord, consequence: str) -> str | None:
    """The ledger's note for an accepted update whose site says it lost its kept state."""
    if metrics.get(keys.STATE_LOST) != 1:
        return None
    return f"site lost its state (a restarted SuperNode?): {consequence}"


def lost_without_update(content: RecordDict) -> bool:
    """Whether a reply says its site lost its state and so carries no update."""
    metrics = record_of(content, keys.METRICS, MetricRecord)
    return metrics is not None and metrics.get(keys.STATE_LOST) == 1 and keys.ARRAYS not in content


def reject_state_lost(content: RecordDict, resync: str) -> None:
    """Reject a reply that says the site lost its state and so carries no update."""
    if lost_without_update(content):
        config = record_of(content, keys.CONFIG, ConfigRecord)
        what = config.get(keys.STATE_LOST_DETAIL) if config is not None else None
        lacking = f" ({what})" if isinstance(what, str) else ""
        raise UpdateRejected(
            f"site lost its state{lacking[:120]}, a restarted SuperNode?: {resync}"
        )
