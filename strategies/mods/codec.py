"""``codec_mod``: a delta upload compressed with error feedback (strategies/codecs.py).

Applies to every strategy whose upload is a delta: local-SGD averaging (the user's
model becomes Δ_n = x_n − x, then the codec's wire) and delayed updates (their
accumulated step A_{n,r}). The server must have asked for a codec (its round config
names one: ``LocalSGDAveraging(codec=...)``, ``DelayedCompensated(codec=...)``); a
message that names none passes through untouched, so a site with this mod still joins a
server that does not decode.

Arrays the server names in ``averaged-arrays`` (those its user named, beside the running
statistics and integer arrays every codec sends exactly) travel exactly too.

Error feedback: e ← (Δ + e) − decode(encode(Δ + e)), e kept in the site's state. A site
whose state was lost (the server says it expects a residual, the site has none) starts
again from e = 0 and says so in its reply.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MetricRecord

from flplatform.core import keys
from flplatform.core.errors import ConfigError
from flplatform.core.seeding import rng_for
from strategies.codecs import Codec, ErrorFeedback, Identity, make_codec, with_averaged
from strategies.layout import difference
from strategies.mods.contract import (
    Mod,
    ModState,
    TrainFunction,
    UserResult,
    call_user,
    is_training,
    mark_lost,
    new_state,
    next_call,
    reply_with,
    round_config,
    sent_model,
    site_algorithm,
    site_identity,
    with_config,
)
from strategies.mods.snapshots import load_state, save_state

RESIDUAL = "residual"


def codec_mod(spec: str | None = None) -> Mod:
    """A mod that uploads deltas compressed with error feedback.

    Parameters
    ----------
    spec : str, optional
        ``'int8'``, ``'int4'``, ``'topk:<k>'`` or ``'topk:<fraction>'``; None follows the codec the
        server's round config names. A spec other than the server's is sent as it is and
        the server rejects it, saying which codec it asked for.
    """
    fixed = None if spec is None else make_codec(spec)  # a bad spec fails at import

    def mod(msg: Message, context: Context, call_next: TrainFunction) -> Message:
        asked = requested_codec(msg)
        if not is_training(msg) or asked is None:
            return call_next(msg, context)
        codec = asked if fixed is None else with_averaged(fixed, asked.averaged)
        algorithm = site_algorithm(msg)
        if algorithm == keys.DELAYED:
            # The delayed mod forms the step and compresses it with our codec: told through
            # the round config when it is inside this mod, through the reply when outside.
            reply = call_next(with_config(msg, {keys.CODEC: codec.name}), context)
            if not reply.has_error():
                config = reply.content.config_records.get(keys.CONFIG, ConfigRecord())
                if keys.CODEC not in config:
                    reply.content[keys.CONFIG] = ConfigRecord({**config, keys.CODEC: codec.name})
            return reply
        if algorithm != keys.LOCAL_SGD:
            return call_next(msg, context)  # sketches are compressed already
        start = sent_model(msg)
        loaded = codec_state(msg, context)
        result = call_user(msg, context, call_next, start)
        if not isinstance(result, UserResult):
            return result
        delta = difference(result.trained, start)
        wire, _, lost = compress_upload(msg, context, delta, codec, loaded, dense=False)
        return compressed_reply(msg, wire, mark_lost(result.metrics, lost), codec, result.extra)

    return mod


def requested_codec(msg: Message) -> Codec | None:
    """The codec a local-SGD or delayed round config names, sending the arrays it names
    in ``averaged-arrays`` exactly; None for none."""
    if site_algorithm(msg) not in (keys.LOCAL_SGD, keys.DELAYED):
        return None  # plain Flower messages (whatever 'codec' means there) and sketches
    config = round_config(msg)
    spec = config.get(keys.CODEC)
    if not isinstance(spec, str) or spec.strip().lower() == "none":
        return None
    named = config.get(keys.AVERAGED_ARRAYS, [])
    if not isinstance(named, list) or not all(isinstance(n, str) for n in named):
        raise ConfigError(
            f"round config '{keys.AVERAGED_ARRAYS}' must list array names, got {named!r:.120}"
        )
    codec = make_codec(spec, averaged=[str(n) for n in named])
    return None if isinstance(codec, Identity) else codec


def codec_state(msg: Message, context: Context) -> tuple[ModState, bool]:
    """The codec's state as the work before ``msg``'s left it, and whether the residual
    the server expected the site to hold was lost; for ``compress_upload``.

    Read before the user's training, not after: reading drops the snapshots of this work
    and later (a resumed run sends work again), and a training that then fails must not
    leave them, or the next work would read a residual of the run the server abandoned.
    """
    state = load_state(msg, context, keys.CODEC_STATE)
    lost = state is None and round_config(msg).get(keys.STATE_EXPECTED) is True
    return state or new_state(), lost


def compress_upload(
    msg: Message,
    context: Context,
    update: Mapping[str, np.ndarray],
    codec: Codec,
    loaded: tuple[ModState, bool],
    *,
    dense: bool = True,
    partial: bool = False,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None, bool]:
    """Encode update + residual and keep the new residual; ``loaded``: ``codec_state``'s.

    Returns the wire, what the server will decode from it (in the update's order; None
    unless ``dense``), and whether the site had lost the residual the server expected it
    to hold. ``partial``: ``update`` holds some of the model's arrays (streaming sync's
    fragment); the other arrays' residuals wait for their own uploads.
    """
    config = round_config(msg)
    state, lost = loaded
    feedback = ErrorFeedback()
    kept = state.groups.get(RESIDUAL) or {}
    others: dict[str, np.ndarray] = {}
    if partial:  # each array's residual, from its own last upload (none yet: 0)
        others = {k: v for k, v in kept.items() if k not in update}
        kept = {
            k: kept[k] if k in kept and kept[k].shape == np.shape(v) else np.zeros(np.shape(v))
            for k, v in update.items()
        }
    if kept and {k: v.shape for k, v in kept.items()} == {
        k: np.shape(v) for k, v in update.items()
    }:
        # read, never written: the saved arrays are used as they are (no copy)
        feedback.residual = {k: v.astype(np.float64, copy=False) for k, v in kept.items()}
    # else: none yet, or a model of another shape (the run changed): e = 0
    calls = next_call(state)
    seed = config.get(keys.SEED, 0)
    server_round = config.get(keys.SERVER_ROUND, 0)
    rng = rng_for(
        seed if isinstance(seed, int) else 0,
        server_round if isinstance(server_round, int) else 0,
        site_identity(context),
        calls,
        "codec",
    )
    wire, sent = feedback.compress(update, codec, rng=rng, dense=dense)
    state.groups[RESIDUAL] = {**others, **feedback.residual}
    save_state(msg, context, keys.CODEC_STATE, state)
    return wire, None if sent is None else {k: sent[k] for k in update}, lost


def compressed_reply(
    msg: Message,
    wire: Mapping[str, np.ndarray],
    metrics: MetricRecord,
    codec: Codec,
    extra: Mapping[str, object],
) -> Message:
    """The reply carrying a compressed delta, naming its codec."""
    config = {keys.CODEC: codec.name, keys.UPDATE_KIND: keys.DELTA}
    return reply_with(msg, wire, metrics, config=config, extra=extra)
