"""``fetchsgd_mod``: the site half of FetchSGD (strategies/fetchsgd.py).

Bring the stored model up to the server's (the message carries the coordinates changed
since the version this site holds, or the whole model), hand it to the user's function,
and reply with the count sketch S(x_n − x) (r × c float32, whatever d is). The site keeps
no optimiser state between rounds, only the model it was synced to.

The arrays the server names in ``averaged-arrays`` (running statistics, integer counters:
``strategies.averaged_arrays``) stay out of the sketch: their trained values travel whole
beside the table, concatenated (``averaged/float32``, ``averaged/float64``). float16
arrays are sketched in float32 and stored back in float16.

A site told to apply changes to a model it no longer holds (a restarted SuperNode)
replies that it lost its state, without training; the server sends it the whole model
next time.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message

from flplatform.core import keys
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
    new_state,
    reply_with,
    round_config,
    sent_model,
    site_algorithm,
    state_lost_reply,
)
from strategies.mods.snapshots import load_state, save_state
from strategies.sparse_sync import DENSE, SYNC_INDICES, SYNC_VALUES, valid_indices

SKETCH = "sketch"  # a sketch reply's table
MODEL = "model"  # the state group holding the model the site was synced to
VERSION = "version"


def synced_model(msg: Message, state: ModState | None) -> dict[str, np.ndarray] | None:
    """The model the server holds, from the message and the site's stored copy.

    None when the message holds only changes and the site lacks the version they apply
    to (its state was lost), or holds a newer version than the message's (a message that
    arrived late: its changes would leave a model that is neither version, as the delayed
    mod's ``synced_model`` also refuses). Arrays come in the server's model's key order.
    """
    config = round_config(msg)
    sync_from = int_config(config, keys.SYNC_FROM, DENSE)
    version = int_config(config, keys.MODEL_VERSION, 0)
    sent = sent_model(msg)
    if sync_from == DENSE:
        return sent
    held = None if state is None else state.meta.get(VERSION)
    stored = None if state is None else state.groups.get(MODEL)
    # Changes since an older version than the site holds still bring it to the server's
    # model: they cover every coordinate changed since, with its current value.
    if stored is None or held is None or not sync_from <= held <= version:
        return None
    layout = Layout.of(stored)
    indices, values = sent.get(SYNC_INDICES), sent.get(SYNC_VALUES)
    if (
        indices is None
        or values is None
        or not valid_indices(indices, layout.size)
        or indices.shape != values.shape
    ):
        raise ConfigError("the server's sparse model update is malformed")
    try:
        model = layout.assign(stored, indices, values)
    except ValueError as exc:  # a value that does not fit an integer array
        raise ConfigError(f"the server's sparse model update is malformed: {exc}") from None
    return {name: model[name] for name in stored}  # the stored (server's) order


def remember_model(state: ModState, model: dict[str, np.ndarray], version: int) -> None:
    """Keep ``model`` (server version ``version``) as what this site holds."""
    state.groups[MODEL] = model
    state.meta[VERSION] = version


def averaged_names(config: ConfigRecord, model: dict[str, np.ndarray]) -> list[str]:
    """The arrays the server averages whole (``averaged-arrays``; none if it names none)."""
    names = config.get(keys.AVERAGED_ARRAYS, [])
    if not isinstance(names, list) or not all(isinstance(n, str) and n in model for n in names):
        raise ConfigError(
            f"round config '{keys.AVERAGED_ARRAYS}' must list arrays of the model, "
            f"got {names!r:.120}"
        )
    return [str(name) for name in names]


def sketched_upload(
    layout: Layout,
    trained: dict[str, np.ndarray],
    start: dict[str, np.ndarray],
    averaged: list[str],
    sketch: Callable[[np.ndarray], np.ndarray],
) -> tuple[dict[str, np.ndarray], list[str]]:
    """The reply's arrays: S(trained − start) without the ``averaged`` arrays' coordinates,
    and those arrays' trained values whole; and the other arrays training left exactly as
    they were (a frozen parameter), for the server to keep out of its recovery."""
    delta = layout.flat_difference(trained, start)  # (d,) float32, a new array
    layout.zero(delta, averaged)
    unchanged = [
        name
        for name in layout.names
        if name not in averaged and not delta[slice(*layout.span(name))].any()
    ]
    return {SKETCH: sketch(delta), **pack(trained, averaged)}, unchanged


def sketch_of(delta: np.ndarray, sketch: CountSketch, device: torch.device) -> np.ndarray:
    """S(delta): the r × c count sketch of a flat float vector, computed on ``device``."""
    tensor = torch.from_numpy(delta.astype(np.float32, copy=False)).to(device)
    return sketch.sketch(tensor).cpu().numpy()


def fetchsgd_mod() -> Mod:
    """The site half of ``FetchSGD``: sync, call the user's training, reply S(x_n − x)."""

    def mod(msg: Message, context: Context, call_next: TrainFunction) -> Message:
        if not is_training(msg) or site_algorithm(msg) != keys.FETCHSGD:
            return call_next(msg, context)
        raw = round_config(msg)
        version = int_config(raw, keys.MODEL_VERSION, 0)
        seed = int_config(raw, keys.SKETCH_SEED, 0)
        rows = int_config(raw, keys.SKETCH_ROWS, 1)
        cols = int_config(raw, keys.SKETCH_COLS, 1)
        state = load_state(msg, context, keys.FETCHSGD_STATE)
        model = synced_model(msg, state)
        if model is None:
            return state_lost_reply(msg, "the model this site was synced to")
        averaged = averaged_names(raw, model)
        layout = Layout.of(model)
        # checked before the user's training, which a malformed sketch would waste
        sketch = CountSketch.from_seed(layout.size, rows=rows, cols=cols, seed=seed)
        result = call_user(msg, context, call_next, model)
        if not isinstance(result, UserResult):
            return result
        device = sketch_device()
        upload, unchanged = sketched_upload(
            layout, result.trained, model, averaged, lambda delta: sketch_of(delta, sketch, device)
        )
        # Only now, with the work done, does the site hold the synced model.
        state = state or new_state()
        remember_model(state, model, version)
        save_state(msg, context, keys.FETCHSGD_STATE, state)
        config = {keys.UNCHANGED_ARRAYS: unchanged} if unchanged else {}
        return reply_with(msg, upload, result.metrics, config=config, extra=result.extra)

    return mod
