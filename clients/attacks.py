"""Hostile sites, for red-teaming a deployment: a ClientApp mod that makes one site attack.

This is a tool to attack your own federation with, not a defence. Put ``attack_mod`` in
front of your algorithm's mod on your ClientApp's train function; one chosen site then
rewrites what it sends the server from a chosen round on, and ``flplatform history
updates`` shows what the server made of it::

    from clients.attacks import AttackPlan, attack_mod

    @app.train(mods=[attack_mod(AttackPlan("sign-flip", site="california", start_round=2)),
                     flplatform_mod()])
    def train(msg, context): ...

Without a plan, ``attack_mod()`` reads one from the run config (``attack.kind``,
``attack.site``, ``attack.round``: a ``[tool.flwr.app.config.attack]`` table in the app's
pyproject.toml, so ``flplatform run APP -c attack.kind=huge`` picks the attack; see
``tests/integration/apps/attack_app``). Every other site, and the chosen one before its
round, is honest. The mod must come first in ``mods``: it rewrites the reply as it goes
on the wire, after the algorithm's mod has made the upload (a whole model, a compressed
delta, a count sketch). Only training replies are touched: the site introduces itself
honestly (its ``num-examples`` when it joins) and evaluates honestly.

The attacks (``KINDS``)
-----------------------
``huge``         every float array filled with 1e30 (finite; a float16 array gets its max).
``float32-max``  every float array filled with float32's maximum (pair it with server
                 momentum, ``server-momentum = 0.9``: the momentum step then overflows).
``examples``     the honest update, claiming ``num-examples`` = 10**12.
``replay``       the site's first training reply (arrays and metrics), re-sent unchanged
                 every round, without training. The first reply itself is honest: with
                 ``attack.round = 1`` the replays start in round 2.
``sketch``       a count-sketch reply (FetchSGD, Sketched-SGD's sketch round) with every
                 table value 1e30; refused (the site replies with an error) if the server
                 does not run a sketching algorithm.
``sign-flip``    the negated update, same norm: a whole model x_n becomes x − (x_n − x)
                 for the model x the site was sent; a delta or sketch upload is negated
                 (every carrier of the update's value: floats, an int8 codec's levels).
``suicide``      the ClientApp's process kills itself (SIGKILL) on receiving its training
                 message of that round (once: later rounds are honest, should it come back).
``crash-loop``   the ClientApp's process kills itself on every training message from that
                 round on: a site whose native library or memory fails each time.
``silent``       from that round, the site sends no update: it replies with an error, and
                 trains nothing. The baseline of "the same run with the attacker silent":
                 the same sites and data split (a Dirichlet split depends on the number of
                 sites), the same honest first rounds, only the attacker's later updates
                 missing, which is what a perfect defence that rejects them leaves.
``none``         honest (the run config's default).

The site is chosen by its partition id (simulation: ``partition-id`` in the node config)
or its name: a deployed site's ``site-name`` node config, or in simulation the name the
run config's ``sites`` key gives its partition (flplatform's convention). The round is the
server's ``server-round`` from the message's config (the site's own count of training
messages when the server sends none).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict

from flplatform.core import keys
from flplatform.core.arrays import arrays_to_record, record_to_arrays
from flplatform.core.checks import integer, one_of, require
from flplatform.core.errors import ConfigError
from strategies.codecs import INT8_PREFIX, SCALE_SUFFIX
from strategies.mods.contract import Mod, TrainFunction, is_training, round_config, sent_model
from strategies.mods.fetchsgd import SKETCH

HUGE = "huge"
FLOAT32_MAX = "float32-max"
EXAMPLES = "examples"
REPLAY = "replay"
SKETCH_ATTACK = "sketch"
SIGN_FLIP = "sign-flip"
SUICIDE = "suicide"
CRASH_LOOP = "crash-loop"
SILENT = "silent"
NONE = "none"
KINDS = (
    *(HUGE, FLOAT32_MAX, EXAMPLES, REPLAY, SKETCH_ATTACK, SIGN_FLIP),
    *(SUICIDE, CRASH_LOOP, SILENT, NONE),
)

HUGE_VALUE = 1e30
CLAIMED_EXAMPLES = 10**12

# The run-config keys attack_mod() reads (a [tool.flwr.app.config.attack] table).
KIND_KEY = "attack.kind"
SITE_KEY = "attack.site"
ROUND_KEY = "attack.round"

# What the site keeps in its context.state: its first reply's records (replay) and its
# count of training messages; one key per record, all under keys.ATTACK_STATE.
_REPLAY_ARRAYS = f"{keys.ATTACK_STATE}.arrays"
_REPLAY_METRICS = f"{keys.ATTACK_STATE}.metrics"
_REPLAY_CONFIG = f"{keys.ATTACK_STATE}.config"
_COUNT = f"{keys.ATTACK_STATE}.count"
_TRAININGS = "trainings"
# Flower's Error code of a silent site's reply: there is no code for "chose not to answer".
_SILENT_CODE = 0


@dataclass(frozen=True)
class AttackPlan:
    """Which site attacks, how, and from which server round on.

    Parameters
    ----------
    kind : str
        One of ``KINDS``.
    site : str
        The attacker: a partition id (``"2"``) or a site name (``"california"``).
    start_round : int
        The first server round (>= 1) whose training reply is hostile.
    """

    kind: str = NONE
    site: str = ""
    start_round: int = 1

    def __post_init__(self) -> None:
        require(
            one_of(self.kind, "attack kind", KINDS),
            integer(self.start_round, "attack round", minimum=1),
            None if self.site.strip() or self.kind == NONE else "attack site must name a site",
        )

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> AttackPlan:
        """The plan the run config's ``attack.*`` keys describe (honest when absent)."""
        kind = str(run_config.get(KIND_KEY, NONE)).strip().lower()
        raw_round = run_config.get(ROUND_KEY, 1)
        if isinstance(raw_round, bool) or not isinstance(raw_round, int):
            raise ConfigError(f"{ROUND_KEY} must be an integer >= 1, got {raw_round!r}")
        return cls(kind=kind, site=str(run_config.get(SITE_KEY, "")).strip(), start_round=raw_round)

    def chooses(self, context: Context) -> bool:
        """Whether the site running in ``context`` is the attacker."""
        return self.kind != NONE and self.site in site_labels(context)


def site_labels(context: Context) -> set[str]:
    """Every label that names this site: its partition id, its node-config name, the name
    the run config's ``sites`` list gives its partition."""
    node = context.node_config
    labels = {str(node[key]) for key in (keys.PARTITION_ID, keys.SITE_NAME) if key in node}
    partition = node.get(keys.PARTITION_ID)
    sites = context.run_config.get("sites")
    if isinstance(partition, int) and isinstance(sites, str):
        names = [name.strip() for name in sites.split(",")]
        if 0 <= partition < len(names) and names[partition]:
            labels.add(names[partition])
    return labels


# ====================================================================== the attacks' maths
def filled(arrays: Mapping[str, np.ndarray], value: float) -> dict[str, np.ndarray]:
    """Every float array filled with ``value``, clamped to its dtype's largest finite value
    (a finite attack stays finite in float16); other arrays unchanged."""
    out = {}
    for name, array in arrays.items():
        if np.issubdtype(array.dtype, np.floating):
            top = float(np.finfo(array.dtype).max)
            out[name] = np.full(array.shape, min(value, top), dtype=array.dtype)
        else:
            out[name] = array
    return out


def sign_flipped_model(
    base: Mapping[str, np.ndarray], trained: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """x − (x_n − x) = 2x − x_n for every float array; integer and bool arrays as trained.

    ``ConfigError`` if the two do not hold the same arrays (the server sent no whole model).
    """
    if list(base) != list(trained) or any(base[k].shape != trained[k].shape for k in base):
        raise ConfigError(
            "sign-flip: the reply is a whole model, but the server's message did not carry the "
            "same arrays to flip it around"
        )
    out = {}
    for name, array in trained.items():
        if np.issubdtype(array.dtype, np.floating):
            # In float64: 2x − x_n of two float32 values is exact there, then rounded once.
            flipped = 2 * base[name].astype(np.float64) - array.astype(np.float64)
            out[name] = flipped.astype(array.dtype)
        else:
            out[name] = array
    return out


def negated_upload(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An upload that carries the update linearly (a delta, a count sketch, a top-k or int8
    codec's wire arrays), negated: it decodes to −update.

    Float arrays are negated, except an int8 codec's scales (a scale is >= 0; its levels
    carry the sign, and are negated instead); indices and raw integers stay as they are.
    """
    out = {}
    for name, array in arrays.items():
        is_scale = name.startswith(INT8_PREFIX) and name.endswith(SCALE_SUFFIX)
        is_levels = name.startswith(INT8_PREFIX) and array.dtype == np.int8
        if (np.issubdtype(array.dtype, np.floating) and not is_scale) or is_levels:
            out[name] = -array  # int8 levels lie in [−127, 127]: no overflow
        else:
            out[name] = array
    return out


# ====================================================================== the mod
def attack_mod(plan: AttackPlan | None = None) -> Mod:
    """A ClientApp mod that makes the chosen site's training replies hostile.

    ``plan``: the attack; None reads it from the run config at each message
    (``AttackPlan.from_run_config``). List it first in ``mods``.
    """

    def mod(msg: Message, context: Context, call_next: TrainFunction) -> Message:
        if not is_training(msg):
            return call_next(msg, context)
        attack = plan or AttackPlan.from_run_config(context.run_config)
        if not attack.chooses(context):
            return call_next(msg, context)
        server_round = _server_round(msg, context)
        hostile = server_round >= attack.start_round
        # ---- attacks that send nothing the site computed
        if (attack.kind == SUICIDE and server_round == attack.start_round) or (
            attack.kind == CRASH_LOOP and hostile
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        if attack.kind == SILENT and hostile:
            reason = f"silent attacker: no update from round {attack.start_round} on"
            return Message(Error(code=_SILENT_CODE, reason=reason), reply_to=msg)
        if attack.kind == REPLAY and hostile and _REPLAY_ARRAYS in context.state:
            return _replayed(msg, context)
        # ---- attacks that rewrite the honest reply
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        if attack.kind == REPLAY and _REPLAY_ARRAYS not in context.state:
            _remember(reply, context)
        if not hostile or attack.kind in (SUICIDE, CRASH_LOOP, REPLAY):
            return reply
        return _rewritten(attack.kind, msg, reply)

    return mod


def _server_round(msg: Message, context: Context) -> int:
    """The message's ``server-round``, else this site's count of training messages."""
    state = context.state.config_records.get(_COUNT, ConfigRecord())
    count = state.get(_TRAININGS, 0)
    count = (count if isinstance(count, int) else 0) + 1
    context.state[_COUNT] = ConfigRecord({_TRAININGS: count})
    sent = round_config(msg).get(keys.SERVER_ROUND)
    return sent if isinstance(sent, int) and not isinstance(sent, bool) else count


def _remember(reply: Message, context: Context) -> None:
    """Keep the reply's records, copied (the reply itself goes on to be serialized)."""
    content = reply.content
    if keys.ARRAYS in content.array_records:
        arrays = record_to_arrays(content.array_records[keys.ARRAYS])
        context.state[_REPLAY_ARRAYS] = arrays_to_record({k: v.copy() for k, v in arrays.items()})
    if keys.METRICS in content.metric_records:
        context.state[_REPLAY_METRICS] = MetricRecord(dict(content.metric_records[keys.METRICS]))
    if keys.CONFIG in content.config_records:
        context.state[_REPLAY_CONFIG] = ConfigRecord(dict(content.config_records[keys.CONFIG]))


def _replayed(msg: Message, context: Context) -> Message:
    """The first reply's records again, as a reply to ``msg``."""
    state = context.state
    arrays = record_to_arrays(state.array_records[_REPLAY_ARRAYS])
    content = RecordDict({keys.ARRAYS: arrays_to_record(arrays)})
    if _REPLAY_METRICS in state.metric_records:
        content[keys.METRICS] = MetricRecord(dict(state.metric_records[_REPLAY_METRICS]))
    if _REPLAY_CONFIG in state.config_records:
        content[keys.CONFIG] = ConfigRecord(dict(state.config_records[_REPLAY_CONFIG]))
    return Message(content, reply_to=msg)


def _rewritten(kind: str, msg: Message, reply: Message) -> Message:
    """``reply`` with its ``arrays`` or its ``num-examples`` rewritten by the attack."""
    content = RecordDict(dict(reply.content.items()))
    if kind == EXAMPLES:
        metrics = content.metric_records.get(keys.METRICS, MetricRecord())
        content[keys.METRICS] = MetricRecord({**metrics, keys.NUM_EXAMPLES: CLAIMED_EXAMPLES})
        return Message(content, reply_to=msg)
    record = content.array_records.get(keys.ARRAYS)
    if record is None:
        raise ConfigError(f"attack '{kind}': the site's reply carries no '{keys.ARRAYS}'")
    arrays = record_to_arrays(record)
    if kind == HUGE:
        arrays = filled(arrays, HUGE_VALUE)
    elif kind == FLOAT32_MAX:
        arrays = filled(arrays, float(np.finfo(np.float32).max))
    elif kind == SKETCH_ATTACK:
        if SKETCH not in arrays:
            raise ConfigError(
                "attack 'sketch' needs a count-sketch reply (strategy fetchsgd or sketched-sgd); "
                f"this reply holds {', '.join(list(arrays)[:5])}"
            )
        arrays = {**arrays, SKETCH: filled({SKETCH: arrays[SKETCH]}, HUGE_VALUE)[SKETCH]}
    elif kind == SIGN_FLIP:
        reply_config = content.config_records.get(keys.CONFIG, ConfigRecord())
        if SKETCH in arrays or reply_config.get(keys.UPDATE_KIND) == keys.DELTA:
            arrays = negated_upload(arrays)
        else:
            arrays = sign_flipped_model(sent_model(msg), arrays)
    content[keys.ARRAYS] = arrays_to_record(arrays)
    return Message(content, reply_to=msg)


__all__ = [
    "KINDS",
    "AttackPlan",
    "attack_mod",
    "filled",
    "negated_upload",
    "sign_flipped_model",
    "site_labels",
]
