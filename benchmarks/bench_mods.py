"""ClientApp mods: each mod's own cost per training call, next to the SGD step it wraps, as JSON.

What is measured: for each d (default 1M and 10M parameters) and each site half of
``strategies/mods``, the seconds a training call spends in the mod itself, everything
besides the user's train function: reading the server's message, rebuilding the dense
model, handing it to the user as an ``ArrayRecord`` and reading the user's reply back,
the delta, the codec or count sketch, and the state kept in ``context.state`` (loaded
and saved every call).

How: the model is an MLP 784→h→10 (h sized so it has about d parameters; its
``state_dict`` as float32 arrays) plus a BatchNorm-like int64 counter: five arrays, in the
model's own key order. The user's function is a no-op trainer: it returns the arrays it
was given plus a change (a constant added to a random 1% of coordinates, the counter + 1),
precomputed, so its own cost is building its reply record (one copy, as a user's
``ArrayRecord(model.state_dict())``). Each round restores the site's state to the same
steady state (untimed), times one full mod call around the no-op and then the no-op alone
on the message the mod hands it; overhead = median over ``--repeats`` rounds (after one
warm-up) of the difference. The garbage collector runs before every timed call (untimed):
Flower's records refer to themselves, so without it a call would pay the page faults of
fresh memory whenever the call before it still held its model. Real Flower ``Message``s
and ``Context``s, as in tests/strategies/test_mods.py. Steady state per mod:

- ``model_mod`` (local-SGD): stateless; ``codec_mod int8`` / ``topk:0.01``: a float64
  error-feedback residual held; ``delayed_mod`` (D = 1): period 3 on version 1, two kept
  periods (in the model's dtypes), one settled by this message; DTS: ``delayed_mod``
  outside ``codec_mod("topk:0.01")``, with both states; streaming sync (F = 4 fragments,
  D = 1, int4 as streaming DiLoCo sends it, the server naming the codec): the site holds
  the global model of version q − 3, its kept fragments of periods q − 2 and q − 1, a
  float64 carry of the arrays period q − 1 did not send and a residual per array; it is
  sent the one fragment round q − 2 stepped and replies with fragment (q − 1) mod F:
  period 5 the MLP's 784 × h weight (most of the model), period 6 its h biases (the
  weight's change goes to the carry);
- ``fetchsgd_mod``: the site holds version 0 and is sent version 1 whole (dense sync of a
  known site: it still loads the model it held) or as k = 0.1% changed coordinates;
  r = 5 rows, c = 5k columns;
- ``sketched_sgd_mod`` sketch round: sparse sync of k coordinates that are also the
  coordinates to zero in u and v (momentum 0.9); values round: v at P·k = 2k candidates,
  no user call, so its overhead is the whole call.

The breakdown times the functions the mod calls, on the same inputs, one at a time in
the same rounds (median): ``read_message`` (``sent_model``: views), ``state_load`` /
``state_save`` (``ModState``, the delayed kept periods), ``rebuild`` (``synced_model``,
``SitePeriods.local_model``), ``hand_to_user`` (``arrays_to_record`` of a writable copy of
the start: an upper bound, since a start that is the message's own model is handed on
as the same Arrays), ``read_reply`` (``read_trained``: views, checks), ``delta``
(``difference``, ``Layout.flat_difference``), ``error_feedback`` (``ErrorFeedback.compress``:
u + e, encode, the new residual), ``codec_state_load`` / ``codec_state_save``,
``accumulate`` (``SiteAccumulators.stepped`` and finiteness), ``sketch`` (``sketch_of``),
``reply_record`` (the upload's record). ``unaccounted`` = overhead − their sum.
``site_state_mib``: what the site keeps between calls (the arrays in ``context.state``)
in the steady state.

The training step it wraps: one SGD step (forward, backward, ``optimizer.step``, momentum
0.9) of the same MLP on a batch of 32 random MNIST-shaped inputs, on CPU, median of
``--repeats`` after a warm-up; ``overhead_per_step`` = overhead / step. Torch runs on
``--threads`` threads (default 1: on a shared machine two threads made the step erratic,
5× slower at times); the mods are single-threaded, so on more cores the step
shrinks and the ratios grow. A round of E local steps pays the overhead once: it costs
E·step + overhead. Every time is taken twice, wall clock (``*_seconds``, ``breakdown``)
and this process's CPU time (``*_cpu_seconds``, ``breakdown_cpu``, ``*_per_step_cpu``):
on a shared machine the CPU time is the steadier of the two. ``peak_rss_mib`` is the
process's peak resident memory after a size's cases (and every smaller size's).

Goal (issue "Scale"): at d = 10M every mod's own CPU time per call at most 2 SGD steps,
DTS (delayed + top-k) at most 3.

Measured on this project's 2-core machine (``--sizes 10000000 --repeats 3``, 1 torch
thread, idle), CPU ms per call and per SGD step, before and after the work that made the
mods read views, encode once and keep state in the model's dtypes; "after" gives two
runs (the step: 49.5 and 46.6 ms), their spread is what a user should expect:

                                       before           after
                                    ms   /step       ms        /step
    model_mod (local-SGD)          136    2.3        3          0.06-0.07
    codec_mod int8                 390    6.7       61-64 *     1.6-1.8 *
    codec_mod int4                   -      -       74-79 *     1.9-2.2 *
    codec_mod topk:0.01            497    8.5       43-48       0.9-1.0
    delayed_mod                    368    6.3       31-38       0.6-0.8
    delayed + codec topk (DTS)     602   10.3       67-76       1.4-1.5
    fetchsgd_mod dense sync        261    4.5       91-94       1.9-2.0
    fetchsgd_mod sparse sync       283    4.9       97-111      2.0-2.4
    sketched_sgd_mod sketch        532    9.1      149-180      3.2-3.6
    sketched_sgd_mod values         36    0.6        1          0.0

At d = 100M (``--sizes 100000000 --repeats 2``; the step 564 ms) every case completes:
0.05 (model_mod) to 4.3 (Sketched-SGD's sketch round) steps, peak RSS 11.7 GB.

(the "before" step was 58 ms; its ratios are to that step. * Measured on a later day,
the step 36-39 ms, after the quantizers made the decoded values and the new residual
chunk by chunk, in larger chunks: the code before took 69 ms (int8) and 100-104 ms
(int4) in the same runs.) What is left is the algorithms' own work: the count sketch
(r = 5 rows: five scatter-adds of d values, about 80 ms at 10M on one core, up to 120 ms
for Sketched-SGD's v) dominates both sketched mods, and stochastic rounding draws one
float64 uniform per coordinate (about 18 ms at 10M; int4 adds its block scales).
Misses: Sketched-SGD's sketch round (the sketch alone is about 2.4 steps, its
accumulators u ← m·u + g, v ← v + u about 1); FetchSGD's sparse sync and int4 are at the
goal's edge (2.0-2.4 and 1.9-2.2 steps).
Flower's ``Array`` holds ``bytes``: a model-sized array a mod creates (the rebuilt model
it hands on, a new kept state) is one copy into a new ``bytes``, about 4 ms per 40 MB
once freed memory is reused (``strategies.mods.contract.reuse_freed_memory``; about 25 ms
when every copy faults in fresh pages, as glibc's default gives for blocks over 32 MiB).

    python benchmarks/bench_mods.py [--sizes 1000000 10000000] [--repeats 5] [--threads 1]
        [--only codec fetchsgd] [--out report.json]
    python benchmarks/bench_mods.py --sizes 20000 --repeats 1    # a few seconds
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import resource
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import flwr
import numpy as np
import torch
from bench_support import emit
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.supercore.task_identity import TaskIdentity

from flplatform.core import keys
from flplatform.core.arrays import arrays_to_record, record_to_arrays
from strategies.codecs import Codec, ErrorFeedback, make_codec
from strategies.compensation import SitePeriods
from strategies.fragments import fragment_of_round, split_fragments
from strategies.layout import Layout, difference
from strategies.mods import codec_mod, delayed_mod, fetchsgd_mod, model_mod, sketched_sgd_mod
from strategies.mods.codec import RESIDUAL
from strategies.mods.contract import (
    Mod,
    ModState,
    TrainFunction,
    read_trained,
    reuse_freed_memory,
    sent_model,
)
from strategies.mods.delayed import DelayedSiteConfig, load_site_periods, save_site_periods
from strategies.mods.delayed import synced_model as streaming_synced_model
from strategies.mods.fetchsgd import SKETCH, remember_model, sketch_of, synced_model
from strategies.mods.sketched_sgd import (
    ACCUMULATORS,
    CANDIDATES,
    EXAMPLES,
    SKETCHED_ROUND,
    ZEROED_STEP,
    StepPhase,
)
from strategies.sketch_feedback import SiteAccumulators
from strategies.sparse_sync import DENSE, SYNC_INDICES, SYNC_VALUES
from strategies.top_k import index_dtype

INPUTS, CLASSES, BATCH = 784, 10, 32
COUNTER = "norm.num_batches_tracked"  # the BatchNorm-like int64 array
CHANGE_FRACTION = 0.01  # coordinates the no-op trainer changes
SYNC_FRACTION = 0.001  # k / d: coordinates a sparse sync changes, and the sketches' k
ROWS, CANDIDATE_FACTOR, MOMENTUM, EXAMPLES_PER_CALL = 5, 2, 0.9, 32
CPU = torch.device("cpu")
Arrays = dict[str, np.ndarray]


# ------------------------------------------------------------------------- timing
def _seconds(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall, CPU) seconds of one call; CPU time is this process's, all its threads."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median (wall, CPU) seconds of ``repeats`` calls after one warm-up (gc off)."""
    fn()
    times = []
    for _ in range(repeats):
        gc.disable()
        try:
            times.append(_seconds(fn))
        finally:
            gc.enable()
    return statistics.median(w for w, _ in times), statistics.median(c for _, c in times)


def rounds(
    calls: Mapping[str, Callable[[], object]], restore: Callable[[], None], repeats: int
) -> dict[str, list[tuple[float, float]]]:
    """(wall, CPU) seconds of each call in each of ``repeats`` rounds, after a warm-up round.

    Each round restores the site's state (untimed), then times every call once, one after
    the other (the mod call first, while the state is as restored): a slow spell of the
    shared machine hits a mod call, the user alone and the parts alike.
    """
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
    for round_ in range(repeats + 1):
        restore()
        measured = {}
        for name, fn in calls.items():
            # Flower's records refer to themselves: what the last call made is freed by
            # the collector. Collected before each call (untimed), every call starts
            # with the same free memory; otherwise a call pays the page faults of
            # fresh memory whenever the one before it still holds its model.
            gc.collect()
            gc.disable()
            try:
                measured[name] = _seconds(fn)
            finally:
                gc.enable()
        if round_:
            for name, seconds in measured.items():
                times[name].append(seconds)
    return times


def summary(times: Mapping[str, list[float]], parts: Iterable[str]) -> dict[str, Any]:
    """Overhead (median over rounds of mod call − user alone) and the parts' medians."""
    differences = [c - u for c, u in zip(times["mod call"], times["user alone"], strict=True)]
    overhead = statistics.median(differences)
    breakdown = {name: statistics.median(times[name]) for name in parts}
    breakdown["sum_of_parts"] = sum(breakdown.values())
    breakdown["unaccounted"] = overhead - breakdown["sum_of_parts"]
    return {
        "overhead": overhead,
        "overhead_min": min(differences),
        "call": statistics.median(times["mod call"]),
        "user": statistics.median(times["user alone"]),
        "breakdown": breakdown,
    }


# ---------------------------------------------------------------------- the model
def hidden_for(d: int) -> int:
    """h of the MLP 784→h→10 with about d parameters: 795·h + 10 of them."""
    return max(1, round((d - CLASSES) / (INPUTS + 1 + CLASSES)))


def mlp(hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(INPUTS, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, CLASSES)
    )


def train_step_seconds(model: torch.nn.Module, repeats: int) -> tuple[float, float]:
    """One SGD step (forward, backward, momentum step) on a batch of 32: median (wall, CPU)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, INPUTS, generator=gen)
    y = torch.randint(0, CLASSES, (BATCH,), generator=gen)

    def step() -> None:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()

    step()  # momentum buffers exist from the first step on
    return timed(step, repeats)


def model_arrays(model: torch.nn.Module) -> Arrays:
    """The model's state_dict as float32 arrays, in its own order, plus an int64 counter."""
    arrays = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    arrays[COUNTER] = np.array(7, dtype=np.int64)
    return arrays


def changed(arrays: Mapping[str, np.ndarray], fraction: float, rng: np.random.Generator) -> Arrays:
    """``arrays`` with a constant added to a random ``fraction`` of each float array's
    coordinates and integer arrays + 1: what the no-op trainer returns."""
    out = {}
    for name, value in arrays.items():
        new = np.array(value)
        if new.dtype.kind == "f":
            flat = new.reshape(-1)
            picked = rng.choice(flat.size, max(1, int(flat.size * fraction)), replace=False)
            flat[picked] += np.asarray(1e-3, dtype=new.dtype)
        else:
            new += 1
        out[name] = new
    return out


def small_like(
    arrays: Mapping[str, np.ndarray], rng: np.random.Generator, *, own: bool = False
) -> Arrays:
    """Arrays shaped like ``arrays``, small values: a residual (float64) or, ``own``, a
    kept step (in the arrays' own dtypes, as the delayed mod keeps them)."""
    return {
        k: (rng.standard_normal(np.shape(v)) * 1e-4).astype(v.dtype if own else np.float64)
        for k, v in arrays.items()
    }


# ---------------------------------------------------------------- Flower objects
def train_message(arrays: Mapping[str, np.ndarray], **config: Any) -> Message:
    """A training message as the server sends it (tests/strategies/test_mods.py)."""
    content = RecordDict(
        {keys.ARRAYS: arrays_to_record(dict(arrays)), keys.CONFIG: ConfigRecord(dict(config))}
    )
    return Message(content, dst_node_id=1, message_type=MessageType.TRAIN)


def site_context() -> Context:
    """A site's Flower context (tests/helpers/delayed_sites.py)."""
    return Context(
        run_id=1,
        node_id=1,
        node_config={keys.PARTITION_ID: 0},
        state=RecordDict(),
        run_config={},
    )


def user_reply(msg: Message, arrays: ArrayRecord) -> Message:
    """A user's reply: its trained ``arrays`` and Flower's metrics."""
    metrics = MetricRecord({keys.NUM_EXAMPLES: EXAMPLES_PER_CALL, keys.TRAIN_LOSS: 0.5})
    return Message(RecordDict({keys.ARRAYS: arrays, keys.METRICS: metrics}), reply_to=msg)


class NoOpTrainer:
    """A user's train function that trains nothing: its reply is the precomputed model."""

    def __init__(self, trained: Arrays) -> None:
        self.trained = trained

    def __call__(self, msg: Message, context: Context) -> Message:
        return user_reply(msg, arrays_to_record(self.trained))  # one copy, as a user's


@dataclass
class Seen:
    """What the mod handed the user, and the no-op's reply to it."""

    inner: Message  # the message the user's function got
    start: Arrays  # its dense model
    trained: Arrays
    reply: Message


@dataclass
class Case:
    """One mod in its steady state: the message, the site's context and its breakdown."""

    mod: Mod
    msg: Message
    context: Context
    parts: Callable[[Seen | None], dict[str, Callable[[], object]]]
    calls_user: bool = True


def chain(outer: Mod, inner: Mod) -> Mod:
    """``mods=[outer, inner]`` as Flower chains them."""

    def mod(msg: Message, context: Context, call_next: TrainFunction) -> Message:
        return outer(msg, context, lambda m, c: inner(m, c, call_next))

    return mod


# ------------------------------------------------------------------ breakdowns
def contract_parts(msg: Message, seen: Seen) -> dict[str, Callable[[], object]]:
    """What every mod does around the user: read the message, hand over, read back."""
    return {
        "read_message": lambda: sent_model(msg),
        "hand_to_user": lambda: arrays_to_record(dict(seen.start)),
        "read_reply": lambda: read_trained(seen.reply, seen.start),
    }


def codec_parts(
    context: Context, update: Arrays, codec: Codec, *, dense: bool = False
) -> dict[str, Callable[[], object]]:
    """``compress_upload``: load the residual, compress with error feedback, save it. An
    update of some of the model's arrays (streaming sync) uses and replaces their
    residuals only."""
    rng = np.random.default_rng(0)
    state = ModState.load(context, keys.CODEC_STATE)
    assert state is not None
    stored = {k: v for k, v in state.groups[RESIDUAL].items() if k in update}
    others = {k: v for k, v in state.groups[RESIDUAL].items() if k not in update}

    def compress() -> ErrorFeedback:
        feedback = ErrorFeedback()
        feedback.residual = {k: v.astype(np.float64, copy=False) for k, v in stored.items()}
        feedback.compress(update, codec, rng=rng, dense=dense)
        return feedback

    after = {**others, **compress().residual}
    return {
        "codec_state_load": lambda: ModState.load(context, keys.CODEC_STATE),
        "error_feedback": compress,
        "codec_state_save": lambda: ModState({"calls": 2}, {RESIDUAL: after}).save(
            context, keys.CODEC_STATE
        ),
    }


def save_residual(context: Context, model: Arrays, rng: np.random.Generator) -> None:
    ModState({"calls": 1}, {RESIDUAL: small_like(model, rng)}).save(context, keys.CODEC_STATE)


def local_sgd_case(model: Arrays, rng: np.random.Generator) -> Case:
    msg = train_message(model, **{keys.SITE_ALGORITHM: keys.LOCAL_SGD})

    def parts(seen: Seen | None) -> dict[str, Callable[[], object]]:
        assert seen is not None
        return {
            **contract_parts(msg, seen),
            "reply_record": lambda: arrays_to_record(dict(seen.trained)),
        }

    return Case(model_mod(), msg, site_context(), parts)


def codec_case(model: Arrays, rng: np.random.Generator, spec: str) -> Case:
    context = site_context()
    save_residual(context, model, rng)
    config = {
        keys.SITE_ALGORITHM: keys.LOCAL_SGD,
        keys.CODEC: spec,
        keys.SEED: 0,
        keys.SERVER_ROUND: 2,
        keys.STATE_EXPECTED: True,
    }
    msg = train_message(model, **config)
    codec = make_codec(spec)

    def parts(seen: Seen | None) -> dict[str, Callable[[], object]]:
        assert seen is not None
        start, trained = seen.start, seen.trained

        def delta() -> Arrays:
            return difference(trained, start)

        wire = codec.encode(delta(), rng=np.random.default_rng(0))
        return {
            **contract_parts(msg, seen),
            "delta": delta,
            **codec_parts(context, delta(), codec),
            "reply_record": lambda: arrays_to_record(wire),
        }

    return Case(codec_mod(spec), msg, context, parts)


def delayed_case(model: Arrays, rng: np.random.Generator, spec: str | None) -> Case:
    """Period 3 of D = 1: version 1 settles period 1 (included); period 2 stays kept."""
    context = site_context()
    kept = SitePeriods(
        pending={1: small_like(model, rng, own=True), 2: small_like(model, rng, own=True)}
    )
    save_site_periods(context, kept)
    config: dict[str, Any] = {
        keys.SITE_ALGORITHM: keys.DELAYED,
        keys.SERVER_ROUND: 3,
        keys.MODEL_VERSION: 1,
        keys.INCLUDED_PERIODS: [1],
        keys.STATE_EXPECTED: True,
    }
    mod = delayed_mod()
    codec = None
    if spec is not None:
        save_residual(context, model, rng)
        config.update({keys.CODEC: spec, keys.SEED: 0})
        mod, codec = chain(delayed_mod(), codec_mod(spec)), make_codec(spec)
    msg = train_message(model, **config)

    def parts(seen: Seen | None) -> dict[str, Callable[[], object]]:
        assert seen is not None
        periods = load_site_periods(context)
        assert periods is not None
        periods.settle(1, (1,))
        global_model = sent_model(msg)

        def rebuild() -> Arrays:
            return periods.local_model(global_model, compensate=True)

        def delta() -> Arrays:
            return periods.record(3, seen.start, seen.trained, compensate=True)

        update = delta()
        saved = SitePeriods(pending=dict(periods.pending))
        result = {
            **contract_parts(msg, seen),
            "state_load": lambda: load_site_periods(context),
            "rebuild": rebuild,
            "delta": delta,
            "state_save": lambda: save_site_periods(context, saved),
        }
        upload = update
        if codec is not None:
            result.update(codec_parts(context, update, codec))
            upload = codec.encode(update, rng=np.random.default_rng(0))
        result["reply_record"] = lambda: arrays_to_record(upload)
        return result

    return Case(mod, msg, context, parts)


STREAMING_FRAGMENTS = 4
STREAMING_CODEC = "int4"


def streaming_case(model: Arrays, rng: np.random.Generator, period: int) -> Case:
    """Streaming sync (F = 4, D = 1, int4 as streaming DiLoCo sends it), period ``period``:
    version q − 2 as the one fragment round q − 2 stepped, to a site holding version q − 3
    (its model, its kept fragments of periods q − 2 and q − 1, the carry of every array
    period q − 1 did not send, a residual per array); the reply is fragment (q − 1) mod F."""
    context = site_context()
    names = [(name, int(array.size)) for name, array in model.items()]
    fragments = split_fragments(names, STREAMING_FRAGMENTS)
    sent_of = {
        j: fragments[fragment_of_round(j, STREAMING_FRAGMENTS)] for j in range(1, period + 1)
    }
    version, held = period - 2, period - 3
    kept = SitePeriods(
        pending={
            j: small_like({k: model[k] for k in sent_of[j]}, rng, own=True)
            for j in (version, period - 1)
        },
        carry=small_like({k: v for k, v in model.items() if k not in sent_of[period - 1]}, rng),
    )
    save_site_periods(context, kept, synced=(dict(model), held))
    save_residual(context, model, rng)
    config: dict[str, Any] = {
        keys.SITE_ALGORITHM: keys.DELAYED,
        keys.SERVER_ROUND: period,
        keys.MODEL_VERSION: version,
        keys.INCLUDED_PERIODS: [version],
        keys.STATE_EXPECTED: True,
        keys.FRAGMENTS: STREAMING_FRAGMENTS,
        keys.SYNC_FROM: held,
        keys.CODEC: STREAMING_CODEC,
        keys.SEED: 0,
    }
    stepped = changed({k: model[k] for k in sent_of[version]}, 1.0, rng)
    msg = train_message(stepped, **config)
    codec = make_codec(STREAMING_CODEC)
    fragment = sent_of[period]

    def parts(seen: Seen | None) -> dict[str, Callable[[], object]]:
        assert seen is not None
        state = ModState.load(context, keys.DELAYED_STATE)
        delayed = DelayedSiteConfig.from_record(msg.content[keys.CONFIG])
        global_model = streaming_synced_model(msg, delayed, state)
        assert global_model is not None
        periods = load_site_periods(context)
        assert periods is not None
        periods.settle(version, (version,))

        def rebuild() -> Arrays:
            return periods.local_model(global_model, compensate=True, partial=True)

        def delta() -> Arrays:
            again = SitePeriods(pending=dict(periods.pending), carry=periods.carry)
            return again.record(
                period, seen.start, seen.trained, compensate=True, fragment=fragment
            )

        update = delta()
        after = SitePeriods(pending=dict(periods.pending), carry=periods.carry)
        after.record(period, seen.start, seen.trained, compensate=True, fragment=fragment)
        upload = codec.encode(update, rng=np.random.default_rng(0))
        return {
            **contract_parts(msg, seen),
            "state_load": lambda: ModState.load(context, keys.DELAYED_STATE),
            "rebuild": lambda: (streaming_synced_model(msg, delayed, state), rebuild()),
            "delta": delta,
            **codec_parts(context, update, codec, dense=True),
            "state_save": lambda: save_site_periods(context, after, synced=(global_model, version)),
            "reply_record": lambda: arrays_to_record(upload),
        }

    return Case(delayed_mod(), msg, context, parts)


def sketch_config(d: int) -> dict[str, int]:
    k = max(1, int(d * SYNC_FRACTION))
    return {keys.SKETCH_SEED: 3, keys.SKETCH_ROWS: ROWS, keys.SKETCH_COLS: 5 * k}


def sparse_sync(model: Arrays, rng: np.random.Generator) -> Arrays:
    """The coordinates changed since version 0 (k = 0.1% of d) and their new values."""
    layout = Layout.of(model)
    k = max(1, int(layout.size * SYNC_FRACTION))
    indices = np.sort(rng.choice(layout.size, k, replace=False))
    values = layout.flatten(model, np.float32)[indices] + np.float32(1e-3)
    return {SYNC_INDICES: indices.astype(index_dtype(layout.size)), SYNC_VALUES: values}


def sketch_parts(
    msg: Message, seen: Seen, config: Mapping[str, int]
) -> dict[str, Callable[[], object]]:
    """The sketched mods' shared steps: the flat float64 delta, then its sketch."""
    layout = Layout.of(seen.start)

    def delta() -> np.ndarray:
        return layout.flat_difference(seen.trained, seen.start)

    flat = delta()
    rows, cols, seed = config[keys.SKETCH_ROWS], config[keys.SKETCH_COLS], config[keys.SKETCH_SEED]
    return {
        **contract_parts(msg, seen),
        "delta": delta,
        "sketch": lambda: sketch_of(flat, rows, cols, seed, CPU),
    }


def fetchsgd_case(model: Arrays, rng: np.random.Generator, sparse: bool) -> Case:
    """Version 1 to a site holding version 0: whole, or as k changed coordinates."""
    context = site_context()
    held = ModState({}, {})
    remember_model(held, model, 0)
    held.save(context, keys.FETCHSGD_STATE)
    sketch = sketch_config(Layout.of(model).size)
    config = {
        keys.SITE_ALGORITHM: keys.FETCHSGD,
        keys.MODEL_VERSION: 1,
        keys.SERVER_ROUND: 2,
        keys.SYNC_FROM: 0 if sparse else DENSE,
        keys.STATE_EXPECTED: True,
        **sketch,
    }
    msg = train_message(sparse_sync(model, rng) if sparse else model, **config)

    def parts(seen: Seen | None) -> dict[str, Callable[[], object]]:
        assert seen is not None
        state = ModState.load(context, keys.FETCHSGD_STATE)
        after = ModState({}, {})
        remember_model(after, seen.start, 1)
        result = sketch_parts(msg, seen, sketch)
        table = result["sketch"]()
        result.update(
            {
                "read_message": lambda: sent_model(msg),
                "state_load": lambda: ModState.load(context, keys.FETCHSGD_STATE),
                "rebuild": lambda: synced_model(msg, state),
                "state_save": lambda: after.save(context, keys.FETCHSGD_STATE),
                "reply_record": lambda: arrays_to_record({SKETCH: table}),
            }
        )
        if not sparse:
            del result["rebuild"]  # a dense sync's model is the message: read_message
        return result

    return Case(fetchsgd_mod(), msg, context, parts)


def sketched_state(context: Context, model: Arrays, rng: np.random.Generator) -> None:
    """A site that sketched round 1 on version 0: the model, u and v (float32)."""
    d = Layout.of(model).size
    u = (rng.standard_normal(d) * 1e-4).astype(np.float32)
    v = (rng.standard_normal(d) * 1e-4).astype(np.float32)
    state = ModState(
        {ZEROED_STEP: 0, SKETCHED_ROUND: 1, EXAMPLES: EXAMPLES_PER_CALL},
        {ACCUMULATORS: {"u": u, "v": v}},
    )
    remember_model(state, model, 0)
    state.save(context, keys.SKETCHED_STATE)


def sketched_case(model: Arrays, rng: np.random.Generator) -> Case:
    """Round 3, a sketch round: version 1 as k changed coordinates, also the ones to zero."""
    context = site_context()
    sketched_state(context, model, rng)
    d = Layout.of(model).size
    sketch = sketch_config(d)
    config = {
        keys.SITE_ALGORITHM: keys.SKETCHED_SGD,
        keys.STEP_PHASE: StepPhase.SKETCH,
        keys.MODEL_VERSION: 1,
        keys.SERVER_ROUND: 3,
        keys.SYNC_FROM: 0,
        keys.STEP_MOMENTUM: MOMENTUM,
        keys.ZERO_STEP: 1,
        keys.STATE_EXPECTED: True,
        **sketch,
    }
    sync = sparse_sync(model, rng)
    msg = train_message(sync, **config)

    def parts(seen: Seen | None) -> dict[str, Callable[[], object]]:
        assert seen is not None
        state = ModState.load(context, keys.SKETCHED_STATE)
        assert state is not None
        stored = state.groups[ACCUMULATORS]
        zero = torch.from_numpy(sync[SYNC_INDICES].astype(np.int64))

        layout = Layout.of(seen.start)
        update = torch.from_numpy(layout.flat_difference(seen.trained, seen.start))

        def accumulate() -> bool:
            acc = SiteAccumulators(
                MOMENTUM, torch.from_numpy(stored["u"]), torch.from_numpy(stored["v"])
            ).stepped(update, zero)
            return acc.is_finite()

        acc = SiteAccumulators(
            MOMENTUM, torch.from_numpy(stored["u"]), torch.from_numpy(stored["v"])
        ).stepped(update, zero)
        after = ModState(dict(state.meta), {ACCUMULATORS: {"u": acc.u.numpy(), "v": acc.v.numpy()}})
        remember_model(after, seen.start, 1)
        table = sketch_of(acc.v.numpy(), sketch[keys.SKETCH_ROWS], sketch[keys.SKETCH_COLS], 3, CPU)
        result = sketch_parts(msg, seen, sketch)
        result.update(
            {
                "read_message": lambda: sent_model(msg),
                "state_load": lambda: ModState.load(context, keys.SKETCHED_STATE),
                "rebuild": lambda: synced_model(msg, state),
                "accumulate": accumulate,
                "sketch": lambda: sketch_of(
                    acc.v.numpy(), sketch[keys.SKETCH_ROWS], sketch[keys.SKETCH_COLS], 3, CPU
                ),
                "state_save": lambda: after.save(context, keys.SKETCHED_STATE),
                "reply_record": lambda: arrays_to_record({SKETCH: table}),
            }
        )
        return result

    return Case(sketched_sgd_mod(), msg, context, parts)


def values_case(model: Arrays, rng: np.random.Generator) -> Case:
    """Round 2, the values round of the sketch of round 1: v at 2k candidates."""
    context = site_context()
    sketched_state(context, model, rng)
    d = Layout.of(model).size
    count = min(d, CANDIDATE_FACTOR * max(1, int(d * SYNC_FRACTION)))
    candidates = np.sort(rng.choice(d, count, replace=False)).astype(index_dtype(d))
    config = {
        keys.SITE_ALGORITHM: keys.SKETCHED_SGD,
        keys.STEP_PHASE: StepPhase.VALUES,
        keys.SKETCHED_ROUND: 1,
        keys.SERVER_ROUND: 2,
    }
    msg = train_message({CANDIDATES: candidates}, **config)

    def parts(seen: Seen | None) -> dict[str, Callable[[], object]]:
        state = ModState.load(context, keys.SKETCHED_STATE)
        assert state is not None
        v = state.groups[ACCUMULATORS]["v"]
        values = v[candidates].astype(np.float32)
        return {
            "state_load": lambda: ModState.load(context, keys.SKETCHED_STATE),
            "read_message": lambda: record_to_arrays(msg.content[keys.ARRAYS]),
            "gather": lambda: v[candidates].astype(np.float32),
            "reply_record": lambda: arrays_to_record({"values": values}),
        }

    return Case(sketched_sgd_mod(), msg, context, parts, calls_user=False)


CASES: dict[str, Callable[[Arrays, np.random.Generator], Case]] = {
    "model_mod (local-SGD)": local_sgd_case,
    "codec_mod int8": lambda m, r: codec_case(m, r, "int8"),
    "codec_mod int4": lambda m, r: codec_case(m, r, "int4"),
    "codec_mod topk:0.01": lambda m, r: codec_case(m, r, "topk:0.01"),
    "delayed_mod": lambda m, r: delayed_case(m, r, None),
    "delayed_mod + codec_mod topk:0.01 (DTS)": lambda m, r: delayed_case(m, r, "topk:0.01"),
    # period 5 sends the MLP's first fragment, its 784 × h weight (most of the model);
    # period 6 the h biases, the weight's change going to the float64 carry
    "delayed_mod streaming F=4 int4, large fragment": lambda m, r: streaming_case(m, r, 5),
    "delayed_mod streaming F=4 int4, small fragment": lambda m, r: streaming_case(m, r, 6),
    "fetchsgd_mod dense sync": lambda m, r: fetchsgd_case(m, r, sparse=False),
    "fetchsgd_mod sparse sync": lambda m, r: fetchsgd_case(m, r, sparse=True),
    "sketched_sgd_mod sketch round": sketched_case,
    "sketched_sgd_mod values round": values_case,
}


# ---------------------------------------------------------------------- running
def measure(case: Case, repeats: int, rng: np.random.Generator) -> dict[str, Any]:
    """Overhead of one mod call in its steady state, and its breakdown."""
    context = case.context
    steady = dict(context.state.items())  # records are replaced by a save, never changed

    def restore() -> None:
        context.state = RecordDict(dict(steady))

    seen: Seen | None = None
    if case.calls_user:
        handed: list[Message] = []

        def echo(msg: Message, ctx: Context) -> Message:
            handed.append(msg)
            return user_reply(msg, msg.content[keys.ARRAYS])

        restore()
        case.mod(case.msg, context, echo)
        (inner,) = handed
        start = record_to_arrays(inner.content[keys.ARRAYS])
        trained = changed(start, CHANGE_FRACTION, rng)
        user = NoOpTrainer(trained)
        seen = Seen(inner, start, trained, user(inner, context))

        def call() -> Message:
            return case.mod(case.msg, context, user)

        def alone() -> Message:
            return user(inner, context)

    else:

        def refuse(msg: Message, ctx: Context) -> Message:
            raise AssertionError("this mod's stage must not call the user's function")

        def call() -> Message:
            return case.mod(case.msg, context, refuse)

        def alone() -> None:
            return None

    restore()
    state_bytes = sum(
        len(array.data)
        for record in context.state.values()
        if isinstance(record, ArrayRecord)
        for array in record.values()
    )
    reply = call()
    if reply.has_error() or keys.STATE_LOST in reply.content.metric_records[keys.METRICS]:
        raise RuntimeError(f"the mod did not answer in its steady state: {reply.content}")
    parts = case.parts(seen)
    times = rounds({"mod call": call, "user alone": alone, **parts}, restore, repeats)
    restore()
    wall = summary({name: [w for w, _ in ts] for name, ts in times.items()}, parts)
    cpu = summary({name: [c for _, c in ts] for name, ts in times.items()}, parts)
    return {
        "overhead_seconds": wall["overhead"],
        "overhead_per_step": None,  # filled in by the caller
        "overhead_seconds_min": wall["overhead_min"],
        "overhead_cpu_seconds": cpu["overhead"],
        "overhead_per_step_cpu": None,
        "mod_call_seconds": wall["call"],
        "user_noop_seconds": wall["user"],
        "breakdown": wall["breakdown"],
        "breakdown_cpu": cpu["breakdown"],
        # what the site keeps between calls (context.state's arrays), in its steady state
        "site_state_mib": state_bytes / 2**20,
    }


def bench_size(d: int, repeats: int, seed: int, only: list[str] | None) -> dict[str, Any]:
    hidden = hidden_for(d)
    model = mlp(hidden)
    step, step_cpu = train_step_seconds(model, repeats)
    arrays = model_arrays(model)
    del model
    rng = np.random.default_rng(seed)
    mods: dict[str, Any] = {}
    for name, make in CASES.items():
        if only and not any(part in name for part in only):
            continue
        result = measure(make(arrays, rng), repeats, rng)
        result["overhead_per_step"] = result["overhead_seconds"] / step
        result["overhead_per_step_cpu"] = result["overhead_cpu_seconds"] / step_cpu
        mods[name] = result
    return {
        "d": Layout.of(arrays).size,
        # the process's peak so far (Linux: KiB): this size's cases, and every smaller one
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "hidden": hidden,
        "arrays": {k: list(np.shape(v)) for k, v in arrays.items()},
        "train_step_seconds": step,
        "train_step_cpu_seconds": step_cpu,
        "mods": mods,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="+", help="measure the mods whose name contains one")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    # Flower's Message wants a task identity outside a running app (as tests/conftest.py).
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 0
    started = time.perf_counter()
    sizes = {str(d): bench_size(d, args.repeats, args.seed, args.only) for d in args.sizes}
    report = {
        "sizes": sizes,
        "settings": {
            "benchmark": "site_mods",
            "repeats": args.repeats,
            "seed": args.seed,
            "model": f"MLP {INPUTS}->h->{CLASSES} float32 state_dict + int64 counter",
            "train_step": f"SGD lr 0.01 momentum 0.9, batch {BATCH}, CPU",
            "noop_change_fraction": CHANGE_FRACTION,
            "sparse_sync_fraction": SYNC_FRACTION,
            "sketch": {"rows": ROWS, "k": "0.1% of d", "cols": "5k", "candidates": "2k"},
            "delayed": {"delay": 1, "kept_periods": 2},
            "sketched_sgd_momentum": MOMENTUM,
            "torch_threads": torch.get_num_threads(),
            "reuse_freed_memory": reuse_freed_memory(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "torch": torch.__version__,
            "flwr": flwr.__version__,
            "machine": platform.machine(),
            "wall_seconds": time.perf_counter() - started,
        },
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
