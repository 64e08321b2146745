"""ClientApp mods: the platform's algorithms around any user's Flower train function.

A Flower user keeps their ``@app.train()`` function (their model, data loader and loop)
and adds the mod of the algorithm the server runs::

    @app.train(mods=[flplatform_mod()])        # whatever the server's round config asks
    @app.train(mods=[fetchsgd_mod()])          # or one algorithm: delayed_mod(),
    @app.train(mods=[delayed_mod(), codec_mod("topk:0.01")])   # sketched_sgd_mod(), ...

as Flower's own ``fixedclipping_mod`` pairs with its DP strategy wrapper. The server half
of each is a strategy in ``strategies/`` (``LocalSGDAveraging``, ``DelayedCompensated``,
``FetchSGD``, ``SketchedSGD``); the message's ``site-algorithm`` says which mod acts.

The mod contract
----------------
Every mod here, for a training message of its algorithm:

1. **Rebuilds the dense model** the user's function must train from and puts it in the
   message's ``arrays``, in the model's own key order: FetchSGD and Sketched-SGD the
   model the site was last sent plus the sparse changes; delayed updates x_{q−1−D} plus
   the site's own later periods; local-SGD the model as sent.
2. **Calls the user's function** (``call_next``) and times it: ``compute-seconds`` is
   added to the metrics unless the function reported its own, because user code may
   ignore ``local-steps`` and the virtual clock's ``measured`` model needs real seconds.
3. **Reads back** ``arrays`` (the same names, shapes and dtypes it was given; finite
   floats; its own key order is put back into the model's) and ``num-examples``, and
   refuses anything else with a reason the user can act on: an error reply with Flower's
   ``MOD_FAILED_PRECONDITION`` code (``keys.SITE_REFUSED_CODE``), which the ledger records
   as a rejected update with that reason.
4. **Turns (trained − start) into the algorithm's upload**: the whole model (local-SGD,
   Flower's convention), the delta compressed with error feedback (``codec_mod``), the
   accumulated period step (``delayed_mod``), the count sketch (``fetchsgd_mod``,
   ``sketched_sgd_mod``); a delta is marked ``update = "delta"`` in the reply's config,
   and every reply names the mod that answered (``site-mod``): a server whose site half
   is a mod (delayed, FetchSGD, Sketched-SGD) rejects a reply without it, naming both
   halves and the fix, and stops the run when no site of a round had it.
5. **Keeps its state under one key** (``flplatform.core.keys.*_STATE``). A message of our
   engine names its work (``site-work`` n, ``run-key``): the mod then acts on the state
   after work n − 1, read from the site's snapshots on its own disk, and snapshots what
   work n leaves; ``context.state`` holds only the tag of that snapshot, because Flower
   copies the context to the process handling each message and back
   (``strategies.mods.snapshots``: ``load_state``/``save_state``). Where no snapshot can
   be kept (a server that is not ours, a site without a stable name, a failed write) the
   state lives in ``context.state``. When it is missing although the server
   says it relies on it (``state-expected``; a fresh machine), the mod says so in its
   reply (``state-lost``) and the server resyncs the site: a dense download, unsettled
   periods dropped, momentum and error restarted at zero, recorded in the ledger.
6. **Answers protocol stages that need no training** without calling the user
   (Sketched-SGD's values round), as Flower's ``secaggplus_mod`` answers its stages.
7. **Passes every other message through untouched**: queries, evaluation, and training
   messages of another algorithm.

Arrays nothing compresses: running statistics and integer and bool arrays
(``strategies.averaged_arrays``), and those the server names in ``averaged-arrays`` (the
user's strategy's ``averaged_arrays``: buffers no name tells apart). ``topk`` and
``int8``/``int4`` send their deltas exactly beside the compressed weights; FetchSGD and
Sketched-SGD keep them out of the sketch, sites send their trained values whole and the
server sets them to the sites' weighted mean (a bool array: on where it rounds to 1).
Deltas travel in the model's dtypes, so a bool or unsigned array can only grow through a
delta upload (a mask bit turned off, an unsigned counter that decreases, is sent as no
change: ``strategies.layout.carried``): keep such arrays constant
during training, or use local-SGD without a codec, which sends the model whole. Flower's
``ArrayRecord`` cannot hold bfloat16 (NumPy has no such dtype): keep bfloat16 models'
weights in float32 between rounds (autocast for speed).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from flwr.app import Context, Message

from flplatform.core import keys
from strategies.mods.codec import codec_mod, requested_codec
from strategies.mods.contract import (
    Mod,
    TrainFunction,
    UserResult,
    call_user,
    is_training,
    reply_with,
    sent_model,
    site_algorithm,
)

if TYPE_CHECKING:
    from strategies.mods.delayed import delayed_mod
    from strategies.mods.fetchsgd import fetchsgd_mod
    from strategies.mods.sketched_sgd import sketched_sgd_mod

# The delayed and sketched mods load torch: imported on first use, so a process that only
# needs the package's light parts (the CLI forgetting a run's snapshots) starts without it.
_LAZY = {
    "delayed_mod": "strategies.mods.delayed",
    "fetchsgd_mod": "strategies.mods.fetchsgd",
    "sketched_sgd_mod": "strategies.mods.sketched_sgd",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "codec_mod",
    "delayed_mod",
    "fetchsgd_mod",
    "flplatform_mod",
    "model_mod",
    "sketched_sgd_mod",
]


def model_mod() -> Mod:
    """Local-SGD's site half: the user's trained model, checked, with compute seconds.

    Flower's own convention (a whole model); the mod adds the contract's checks and
    timing, so a bad reply is refused at the site with a reason rather than averaged.
    """

    def mod(msg: Message, context: Context, call_next: TrainFunction) -> Message:
        if (
            not is_training(msg)
            or site_algorithm(msg) not in (keys.LOCAL_SGD, None)
            or keys.ARRAYS not in msg.content.array_records  # not Flower's convention
        ):
            return call_next(msg, context)
        result = call_user(msg, context, call_next, sent_model(msg))
        if not isinstance(result, UserResult):
            return result
        return reply_with(msg, result.trained, result.metrics, extra=result.extra)

    return mod


def flplatform_mod() -> Mod:
    """One mod for every algorithm: the one the server's round config names acts.

    Local-SGD with a codec the server asked for compresses (``codec_mod``); without one
    the model goes back whole (``model_mod``).
    """
    from strategies.mods.delayed import delayed_mod
    from strategies.mods.fetchsgd import fetchsgd_mod
    from strategies.mods.sketched_sgd import sketched_sgd_mod

    handlers = {
        keys.DELAYED: delayed_mod(),
        keys.FETCHSGD: fetchsgd_mod(),
        keys.SKETCHED_SGD: sketched_sgd_mod(),
    }
    compressed, whole = codec_mod(), model_mod()

    def mod(msg: Message, context: Context, call_next: TrainFunction) -> Message:
        if not is_training(msg):
            return call_next(msg, context)
        handler = handlers.get(site_algorithm(msg) or "")
        if handler is None:
            handler = compressed if requested_codec(msg) is not None else whole
        return handler(msg, context, call_next)

    return mod
