"""``sketched_sgd_mod``: the site half of Sketched-SGD (strategies/sketched_sgd.py).

Sketch round: sync the model (as ``fetchsgd_mod``), zero u and v at the coordinates of
the step the server says this site's values went into, hand the model to the user's
function, fold its delta g = x_n − x into the site's momentum and error
(u ← m·u + g, v ← v + u) and reply with S(v). The user's function sees ``server-round``
set to the step (model version + 1), not the round: a step takes two rounds, and a
training loop that draws its data order from the round then draws one per step.

Values round: reply v at the server's candidate coordinates, from the accumulators of
the sketch it asks about. The user's function is not called: nothing is trained.

The arrays the server names in ``averaged-arrays`` (running statistics, integer
counters) stay out of u, v and the sketch: the site keeps their trained values and sends
them whole with its values, which the server averages into the step.
A site whose accumulators are gone while the server relies on them (a restarted
SuperNode) starts again from u = v = 0 and says so; one told to apply changes to a model
it no longer holds, or asked for values it no longer has, replies that it lost its state.
"""

from __future__ import annotations

import warnings
from enum import StrEnum

import numpy as np
import torch
from flwr.app import Context, Message, MetricRecord

from flplatform.core import keys
from flplatform.core.arrays import record_views
from flplatform.core.errors import ConfigError
from strategies.averaged_arrays import pack
from strategies.count_sketch import CountSketch, sketch_device
from strategies.layout import Layout
from strategies.mods.contract import (
    Mod,
    ModState,
    TrainFunction,
    UserResult,
    call_user,
    int_config,
    is_training,
    mark_lost,
    new_state,
    reply_with,
    round_config,
    site_algorithm,
    state_lost_reply,
)
from strategies.mods.fetchsgd import (
    SKETCH,
    averaged_names,
    remember_model,
    sketch_of,
    synced_model,
)
from strategies.mods.snapshots import load_state, save_state
from strategies.sketch_feedback import SiteAccumulators
from strategies.sparse_sync import SYNC_INDICES, valid_indices


class StepPhase(StrEnum):
    """Which of a Sketched-SGD step's two rounds a message belongs to (``keys.STEP_PHASE``)."""

    SKETCH = "sketch"  # sites train and upload a sketch of their accumulated update
    VALUES = "values"  # sites send the exact values at the server's candidate coordinates


CANDIDATES = "candidates"  # a values request's indices
VALUES = "values"  # a values reply's array
ZERO = "zero"  # a sketch message's record of coordinates to zero, when not its sync's
ZERO_INDICES = "zero.indices"
ACCUMULATORS = "accumulators"  # the state group holding u and v
TRAINED_AVERAGED = "trained-averaged"  # the state group holding the averaged arrays, trained
ZEROED_STEP, SKETCHED_ROUND, EXAMPLES = "zeroed-step", "sketched-round", "examples"


def _accumulators(state: ModState, d: int, momentum: float) -> SiteAccumulators:
    """The stored u and v, read in place (``SiteAccumulators.stepped`` never writes them)."""
    stored = state.groups.get(ACCUMULATORS)
    if stored is None:
        return SiteAccumulators.zeros(d, momentum)
    u, v = stored.get("u"), stored.get("v")
    if u is None or v is None or u.shape != (d,) or v.shape != (d,):
        raise ConfigError(
            f"this site's Sketched-SGD accumulators do not fit a model of {d} parameters"
        )
    u, v = u.astype(np.float32, copy=False), v.astype(np.float32, copy=False)
    with warnings.catch_warnings():  # read-only views of the state: only read
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return SiteAccumulators(momentum, torch.from_numpy(u), torch.from_numpy(v))


def _zero_indices(msg: Message, d: int) -> np.ndarray:
    """The coordinates the message says to zero: its own record, else its sync's."""
    if ZERO in msg.content.array_records:
        indices = record_views(msg.content.array_records[ZERO]).get(ZERO_INDICES)
    else:
        sent = msg.content.array_records.get(keys.ARRAYS)
        indices = None if sent is None else record_views(sent).get(SYNC_INDICES)
    if indices is None or not valid_indices(indices, d):
        raise ConfigError("the server's coordinates to zero are missing or malformed")
    return indices.astype(np.int64)


def sketched_sgd_mod() -> Mod:
    """The site half of ``SketchedSGD``: sketch rounds train, values rounds do not."""

    def mod(msg: Message, context: Context, call_next: TrainFunction) -> Message:
        if not is_training(msg) or site_algorithm(msg) != keys.SKETCHED_SGD:
            return call_next(msg, context)
        raw = round_config(msg)
        phase = raw.get(keys.STEP_PHASE)
        if phase == StepPhase.VALUES:
            return _values_reply(msg, context)
        if phase != StepPhase.SKETCH:
            raise ConfigError(
                f"round config '{keys.STEP_PHASE}' must be {StepPhase.SKETCH.value!r} or "
                f"{StepPhase.VALUES.value!r}, got {phase!r}"
            )
        return _sketch_reply(msg, context, call_next)

    return mod


def _sketch_reply(msg: Message, context: Context, call_next: TrainFunction) -> Message:
    raw = round_config(msg)
    version = int_config(raw, keys.MODEL_VERSION, 0)
    seed = int_config(raw, keys.SKETCH_SEED, 0)
    rows = int_config(raw, keys.SKETCH_ROWS, 1)
    cols = int_config(raw, keys.SKETCH_COLS, 1)
    zero_step = int_config(raw, keys.ZERO_STEP, 0)
    server_round = int_config(raw, keys.SERVER_ROUND, 0)
    momentum = raw.get(keys.STEP_MOMENTUM)
    # an int too: a server's momentum=0 reaches the site as the integer it was given
    if isinstance(momentum, bool) or not isinstance(momentum, int | float) or not 0 <= momentum < 1:
        raise ConfigError(f"round config '{keys.STEP_MOMENTUM}' must be in [0, 1)")
    momentum = float(momentum)
    kept = load_state(msg, context, keys.SKETCHED_STATE)
    model = synced_model(msg, kept)
    if model is None:
        return state_lost_reply(msg, "the model this site was synced to")
    lost = kept is None and raw.get(keys.STATE_EXPECTED) is True
    state = kept or new_state()
    layout = Layout.of(model)
    averaged = averaged_names(raw, model)
    # checked before the user's training, which a malformed sketch would waste
    sketch = CountSketch.from_seed(layout.size, rows=rows, cols=cols, seed=seed)
    stored = _accumulators(state, layout.size, momentum)
    zeroed = state.meta.get(ZEROED_STEP, 0)
    zero = None
    if zero_step > zeroed:  # once per step, however often the message is sent
        if not lost:  # restarted accumulators are zero everywhere already
            zero = torch.from_numpy(_zero_indices(msg, layout.size))
        zeroed = zero_step
    # The data order follows the step (version + 1), not the round, as local-SGD
    # averaging's does: a step takes two rounds.
    result = call_user(
        msg, context, call_next, model, config_updates={keys.SERVER_ROUND: version + 1}
    )
    if not isinstance(result, UserResult):
        return result
    update = layout.flat_difference(result.trained, model)  # (d,) float32
    layout.zero(update, averaged)  # sent whole with the values, never accumulated
    accumulators = stored.stepped(torch.from_numpy(update), zero)
    if not accumulators.is_finite():
        # Kept out of u and v: the site's stored accumulators stay as they were, so one
        # diverging local training costs this round, not the rest of the run.
        raise ConfigError(
            "local training diverged (its update is not finite): lower lr or local-steps"
        )
    table = sketch_of(accumulators.v.numpy(), sketch, sketch_device())
    # Only now, with the work done, does the site hold the synced model and its new v.
    remember_model(state, model, version)
    state.groups[ACCUMULATORS] = {"u": accumulators.u.numpy(), "v": accumulators.v.numpy()}
    if averaged:
        state.groups[TRAINED_AVERAGED] = {name: result.trained[name] for name in averaged}
    else:
        state.groups.pop(TRAINED_AVERAGED, None)
    state.meta.update(
        {ZEROED_STEP: zeroed, SKETCHED_ROUND: server_round, EXAMPLES: result.num_examples}
    )
    save_state(msg, context, keys.SKETCHED_STATE, state)
    metrics = mark_lost(result.metrics, lost)
    return reply_with(msg, {SKETCH: table}, metrics, extra=result.extra)


def _values_reply(msg: Message, context: Context) -> Message:
    """v at the candidates, from the accumulators of the sketch the server asks about."""
    raw = round_config(msg)
    asked_round = int_config(raw, keys.SKETCHED_ROUND, 1)
    state = load_state(msg, context, keys.SKETCHED_STATE)
    if state is None or ACCUMULATORS not in state.groups:
        return state_lost_reply(msg, f"the accumulators of its sketch of round {asked_round}")
    sketched = state.meta.get(SKETCHED_ROUND, 0)
    if sketched != asked_round:
        raise ConfigError(
            f"the server asks for the values of the sketch of round {asked_round}; this site's "
            f"last sketch is of round {sketched or 'none'}"
        )
    v = state.groups[ACCUMULATORS]["v"]
    sent = msg.content.array_records.get(keys.ARRAYS)
    candidates = None if sent is None else record_views(sent).get(CANDIDATES)
    if candidates is None or not valid_indices(candidates, len(v)):
        raise ConfigError("the server's candidate coordinates are missing or malformed")
    trained = state.groups.get(TRAINED_AVERAGED, {})
    averaged = averaged_names(raw, trained)  # kept by this site's sketch of that round
    # The values count as much as the sketch they belong to.
    metrics = MetricRecord({keys.NUM_EXAMPLES: state.meta.get(EXAMPLES, 1)})
    upload = {VALUES: v[candidates].astype(np.float32), **pack(trained, averaged)}
    return reply_with(msg, upload, metrics)
