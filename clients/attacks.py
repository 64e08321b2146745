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
``attack.site``, ``attack.round``, ``attack.scale``: a ``[tool.flwr.app.config.attack]``
table in the app's pyproject.toml, so ``flplatform run APP -c attack.kind=huge`` picks the
attack; see ``tests/integration/apps/attack_app``). Every other site, and the chosen ones
before their round, are honest. Several sites attack together when ``site`` lists them
(``"ohio,california"``); they collude in ``alie`` and ``ipm``. The mod must come first
in ``mods``: it rewrites the reply as it goes on the wire, after the algorithm's mod has
made the upload (a whole model, a compressed delta, a count sketch). Only training
replies are touched: the site introduces itself honestly (its ``num-examples`` when it
joins) and evaluates honestly.

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
``scaled``       the honest update times ``scale`` (default 5): a whole model x_n becomes
                 x + s·(x_n − x) for the model x the site was sent; a delta or sketch
                 upload is multiplied by s (every carrier of the update's value: floats,
                 an int8 codec's scales, and its levels' signs for s < 0).
``sign-flip``    the update times −``scale`` (default 1: same norm, negated).
``alie``         "A Little Is Enough" (Baruch et al., NeurIPS 2019): every attacker sends
                 μ − z·σ, the coordinate-wise mean and standard deviation of the honest
                 sites' updates of the round; z = ``scale``, by default the paper's
                 z_max = Φ⁻¹((n − s)/n), s = ⌊n/2 + 1⌋ − f for n sites of which f attack
                 (0 for 1 of 4, 0.25 for 2 of 10: the paper's z is made for large n).
``ipm``          inner-product manipulation (Xie et al., UAI 2019): every attacker sends
                 −ε·μ, ε = ``scale`` (default 0.1), against the honest sites' mean μ.
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

``alie`` and ``ipm`` are given the honest updates, as the papers' attackers are: in a
simulation the attacker computes each honest site's update of the round itself, calling
the rest of the ClientApp (the algorithm's mod and the train function) with the message
it was sent, as that site (its ``partition-id``, a fresh ``context.state``, snapshots in
a scratch directory deleted afterwards). In sync rounds of a stateless site (local-SGD
averaging with an uncompressed upload) that is the update the site sends; in the async
modes the honest sites train on the models they were sent, maybe older ones; a site that
keeps state across rounds (a codec's residual, delayed updates' periods) cannot be
computed this way. They need a simulation (the other partitions' data on the attacker's
machine) and a reply that is a whole model or an uncompressed delta, and refuse anything
else with a ``ConfigError``.

The site is chosen by its partition id (simulation: ``partition-id`` in the node config)
or its name: a deployed site's ``site-name`` node config, or in simulation the name the
run config's ``sites`` key gives its partition (flplatform's convention). The round is the
server's ``server-round`` from the message's config (the site's own count of training
messages when the server sends none).
"""

from __future__ import annotations

import os
import signal
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict

from clients.site import run_config_of
from flplatform.core import keys
from flplatform.core.arrays import arrays_to_record, record_to_arrays
from flplatform.core.checks import as_site_names, integer, number, one_of, require
from flplatform.core.errors import ConfigError
from strategies.averaged_arrays import AVERAGED
from strategies.codecs import INT4_PREFIX, INT8_PREFIX, SCALE_SUFFIX
from strategies.mods.contract import Mod, TrainFunction, is_training, round_config, sent_model
from strategies.mods.fetchsgd import SKETCH

HUGE = "huge"
SCALED = "scaled"
ALIE = "alie"
IPM = "ipm"
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
    *(HUGE, FLOAT32_MAX, EXAMPLES, REPLAY, SKETCH_ATTACK, SCALED, SIGN_FLIP, ALIE, IPM),
    *(SUICIDE, CRASH_LOOP, SILENT, NONE),
)

HUGE_VALUE = 1e30
CLAIMED_EXAMPLES = 10**12
# Each kind's ``scale`` when the plan gives none (ALIE's z depends on the federation).
DEFAULT_SCALE = {SCALED: 5.0, SIGN_FLIP: 1.0, IPM: 0.1}
# The attacks computed from the honest sites' updates of the round.
OMNISCIENT = (ALIE, IPM)

# The run-config keys attack_mod() reads (a [tool.flwr.app.config.attack] table).
KIND_KEY = "attack.kind"
SITE_KEY = "attack.site"
ROUND_KEY = "attack.round"
SCALE_KEY = "attack.scale"  # 0: the kind's default

# What the site keeps in its context.state: its first reply's records (replay) and its
# count of training messages; one key per record, all under keys.ATTACK_STATE.
_REPLAY_ARRAYS = f"{keys.ATTACK_STATE}.arrays"
_REPLAY_METRICS = f"{keys.ATTACK_STATE}.metrics"
_REPLAY_CONFIG = f"{keys.ATTACK_STATE}.config"
_REPLAY_ROUND = f"{keys.ATTACK_STATE}.round"  # the latest round a replayer was asked for
_ROUND = "round"
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
        The attackers: partition ids (``"2"``) or site names (``"california"``), one or
        several, comma-separated.
    start_round : int
        The first server round (>= 1) whose training reply is hostile.
    scale : float
        The factor of ``scaled`` and ``sign-flip``, ALIE's z, IPM's ε (see the module);
        0 takes the kind's default.
    """

    kind: str = NONE
    site: str = ""
    start_round: int = 1
    scale: float = 0.0

    def __post_init__(self) -> None:
        require(
            one_of(self.kind, "attack kind", KINDS),
            integer(self.start_round, "attack round", minimum=1),
            None if self.sites or self.kind == NONE else "attack site must name a site",
            number(self.scale, "attack scale", at_least=0.0, says="a number >= 0 (0: default)"),
        )

    @property
    def sites(self) -> frozenset[str]:
        """The attackers' labels, as ``site`` lists them."""
        return frozenset(part.strip() for part in self.site.split(",") if part.strip())

    def factor(self, num_sites: int, num_attackers: int) -> float:
        """``scale``, or the kind's default (ALIE's for ``num_attackers`` of ``num_sites``)."""
        if self.scale:
            return float(self.scale)
        if self.kind == ALIE:
            return alie_z(num_sites, num_attackers)
        return DEFAULT_SCALE.get(self.kind, 1.0)

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> AttackPlan:
        """The plan the run config's ``attack.*`` keys describe (honest when absent)."""
        kind = str(run_config.get(KIND_KEY, NONE)).strip().lower()
        raw_round = run_config.get(ROUND_KEY, 1)
        if isinstance(raw_round, bool) or not isinstance(raw_round, int):
            raise ConfigError(f"{ROUND_KEY} must be an integer >= 1, got {raw_round!r}")
        raw_scale = run_config.get(SCALE_KEY, 0.0)
        if isinstance(raw_scale, bool) or not isinstance(raw_scale, (int, float)):
            raise ConfigError(f"{SCALE_KEY} must be a number >= 0, got {raw_scale!r}")
        return cls(
            kind=kind,
            site=str(run_config.get(SITE_KEY, "")).strip(),
            start_round=raw_round,
            scale=float(raw_scale),
        )

    def chooses(self, context: Context, run_config: Mapping[str, Any] | None = None) -> bool:
        """Whether the site running in ``context`` is one of the attackers (``run_config``:
        the run's, by default the context's)."""
        return self.kind != NONE and bool(self.sites & site_labels(context, run_config))


def site_labels(context: Context, run_config: Mapping[str, Any] | None = None) -> set[str]:
    """Every label that names this site: its partition id, its node-config name, the name
    the run config's ``sites`` list gives its partition (``run_config``: the run's, by
    default the context's)."""
    node = context.node_config
    labels = {str(node[key]) for key in (keys.PARTITION_ID, keys.SITE_NAME) if key in node}
    partition = node.get(keys.PARTITION_ID)
    if isinstance(partition, int):
        labels |= _partition_labels(
            context.run_config if run_config is None else run_config, partition
        )
    return labels


def _partition_labels(run_config: Mapping[str, Any], partition: int) -> set[str]:
    """A simulated partition's labels: its id, and its name in the run config's ``sites``."""
    labels = {str(partition)}
    sites = run_config.get("sites")
    if sites is not None:
        try:  # a count names the default sites, as the server does (sites = 4)
            names = as_site_names("sites", sites)
        except ConfigError:
            names = ()
        if 0 <= partition < len(names):
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


def _same_arrays(base: Mapping[str, np.ndarray], trained: Mapping[str, np.ndarray]) -> bool:
    return list(base) == list(trained) and all(base[k].shape == trained[k].shape for k in base)


def scaled_model(
    base: Mapping[str, np.ndarray], trained: Mapping[str, np.ndarray], factor: float
) -> dict[str, np.ndarray]:
    """x + s·(x_n − x) for every float array (s = −1: the sign flip 2x − x_n); integer and
    bool arrays as trained.

    ``ConfigError`` if the two do not hold the same arrays (the server sent no whole model).
    """
    if not _same_arrays(base, trained):
        raise ConfigError(
            "the reply is a whole model, but the server's message did not carry the same "
            "arrays to scale its update around"
        )
    out = {}
    for name, array in trained.items():
        if np.issubdtype(array.dtype, np.floating):
            # In float64 (2x − x_n of two float32 values is exact there), rounded once.
            start = base[name].astype(np.float64)
            out[name] = (start + factor * (array.astype(np.float64) - start)).astype(array.dtype)
        else:
            out[name] = array
    return out


def scaled_upload(arrays: Mapping[str, np.ndarray], factor: float) -> dict[str, np.ndarray]:
    """An upload that carries the update linearly (a delta, a count sketch, a top-k, int8 or
    int4 codec's wire arrays), scaled: it decodes to ``factor`` × update.

    Float arrays are scaled, except a quantizing codec's scales, which take |factor| (a
    scale is >= 0), its levels carrying the sign (negated for a negative factor: int4's
    nibbles q + 8 become 16 − nibble), and the trained values FetchSGD sends whole beside
    its sketch (``averaged/``: values, not an update); indices and raw integers stay.
    """
    out = {}
    for name, array in arrays.items():
        int8, int4 = name.startswith(INT8_PREFIX), name.startswith(INT4_PREFIX)
        # By dtype first: the levels of a model array named "x.scale" are "int8.x.scale"
        if int8 and array.dtype == np.int8:
            out[name] = -array if factor < 0 else array  # in [−127, 127]: no overflow
        elif int4 and array.dtype == np.uint8:
            flipped = (16 - (array & 0x0F)) | ((16 - (array >> 4)) << 4)
            out[name] = flipped.astype(np.uint8) if factor < 0 else array  # 8 stays 8
        elif (int8 or int4) and name.endswith(SCALE_SUFFIX) and array.dtype.kind == "f":
            out[name] = (array * abs(factor)).astype(array.dtype)
        elif name.startswith(AVERAGED):
            out[name] = array
        elif np.issubdtype(array.dtype, np.floating):
            out[name] = (array.astype(np.float64) * factor).astype(array.dtype)
        else:
            out[name] = array
    return out


def alie_z(num_sites: int, num_attackers: int) -> float:
    """ALIE's z_max = Φ⁻¹((n − s)/n), s = ⌊n/2 + 1⌋ − f: the largest shift, in honest
    standard deviations, that keeps the attackers' value inside what a majority-based
    rule takes for honest (Baruch et al. 2019, §3); 0 where that leaves nothing."""
    supporters = num_sites // 2 + 1 - num_attackers
    share = (num_sites - supporters) / num_sites if num_sites > 0 else 0.0
    if not 0.0 < share < 1.0:
        return 0.0
    return max(0.0, statistics.NormalDist().inv_cdf(share))


def alie_update(honest: Sequence[Mapping[str, np.ndarray]], z: float) -> dict[str, np.ndarray]:
    """μ − z·σ per coordinate over the honest updates (σ with Bessel's correction, as the
    paper's code computes it; 0 for one update), in float64."""
    if not honest:
        raise ConfigError("ALIE needs at least one honest site's update")
    out = {}
    for name in honest[0]:
        stacked = np.stack([np.asarray(u[name], dtype=np.float64) for u in honest])
        spread = stacked.std(axis=0, ddof=1) if len(honest) > 1 else np.zeros_like(stacked[0])
        out[name] = stacked.mean(axis=0) - z * spread
    return out


def ipm_update(honest: Sequence[Mapping[str, np.ndarray]], epsilon: float) -> dict[str, np.ndarray]:
    """−ε·μ over the honest updates, in float64."""
    if not honest:
        raise ConfigError("IPM needs at least one honest site's update")
    return {
        name: -epsilon * np.mean([np.asarray(u[name], dtype=np.float64) for u in honest], axis=0)
        for name in honest[0]
    }


# ====================================================================== the mod
def attack_mod(plan: AttackPlan | None = None) -> Mod:
    """A ClientApp mod that makes the chosen site's training replies hostile.

    ``plan``: the attack; None reads it from the run config at each message
    (``AttackPlan.from_run_config``; in a sweep, the member's own, which its messages
    carry). List it first in ``mods``.
    """

    def mod(msg: Message, context: Context, call_next: TrainFunction) -> Message:
        if not is_training(msg):
            return call_next(msg, context)
        run_config = run_config_of(msg, context)
        attack = plan or AttackPlan.from_run_config(run_config)
        if not attack.chooses(context, run_config):
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
        if attack.kind == REPLAY:
            _forget_another_runs_reply(context, server_round)
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
        if attack.kind in OMNISCIENT:
            return _colluding(attack, msg, context, call_next, reply)
        return _rewritten(attack, msg, reply)

    return mod


def _server_round(msg: Message, context: Context) -> int:
    """The message's ``server-round``, else this site's count of training messages."""
    state = context.state.config_records.get(_COUNT, ConfigRecord())
    count = state.get(_TRAININGS, 0)
    count = (count if isinstance(count, int) else 0) + 1
    context.state[_COUNT] = ConfigRecord({_TRAININGS: count})
    sent = round_config(msg).get(keys.SERVER_ROUND)
    return sent if isinstance(sent, int) and not isinstance(sent, bool) else count


def _forget_another_runs_reply(context: Context, server_round: int) -> None:
    """Drop the kept reply when the rounds start again: the runs of a sweep share the
    site's context, each from round 1, and a run replays its own first reply."""
    state = context.state
    seen = state.config_records.get(_REPLAY_ROUND, ConfigRecord()).get(_ROUND)
    if isinstance(seen, int) and server_round < seen:
        for key in (_REPLAY_ARRAYS, _REPLAY_METRICS, _REPLAY_CONFIG):
            if key in state:
                del state[key]
    state[_REPLAY_ROUND] = ConfigRecord({_ROUND: server_round})


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


def _rewritten(attack: AttackPlan, msg: Message, reply: Message) -> Message:
    """``reply`` with its ``arrays`` or its ``num-examples`` rewritten by the attack."""
    kind = attack.kind
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
    elif kind in (SCALED, SIGN_FLIP):
        factor = attack.factor(0, 0) * (-1.0 if kind == SIGN_FLIP else 1.0)
        if SKETCH in arrays or _is_delta(reply):
            arrays = scaled_upload(arrays, factor)
        else:
            arrays = scaled_model(sent_model(msg), arrays, factor)
    content[keys.ARRAYS] = arrays_to_record(arrays)
    return Message(content, reply_to=msg)


# ================================================ ALIE and IPM: given the honest updates
def _is_delta(reply: Message) -> bool:
    config = reply.content.config_records.get(keys.CONFIG, ConfigRecord())
    return config.get(keys.UPDATE_KIND) == keys.DELTA


def _uploaded(kind: str, reply: Message, base: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The reply's arrays, if they are a whole model or an uncompressed delta of ``base``'s
    arrays; ``ConfigError`` for any other upload."""
    record = reply.content.array_records.get(keys.ARRAYS)
    arrays = {} if record is None else record_to_arrays(record)
    if SKETCH in arrays or not _same_arrays(base, arrays):
        raise ConfigError(
            f"attack '{kind}' needs replies that are a whole model or an uncompressed delta "
            f"(local-SGD averaging without a codec, or the delayed strategy); this one holds "
            f"{', '.join(list(arrays)[:5]) or 'no arrays'}"
        )
    return arrays


def _update_of(kind: str, reply: Message, base: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The update a reply carries, float arrays only, in float64: the delta it uploads, or
    trained − sent for a whole model."""
    arrays = _uploaded(kind, reply, base)
    delta = _is_delta(reply)
    return {
        name: array.astype(np.float64) if delta else array.astype(np.float64) - base[name]
        for name, array in arrays.items()
        if np.issubdtype(array.dtype, np.floating)
    }


def _honest_updates(
    attack: AttackPlan, msg: Message, context: Context, call_next: TrainFunction
) -> tuple[list[dict[str, np.ndarray]], int, int]:
    """Each honest site's update of this round, computed here as that site would: the
    updates, the number of sites, the number of attackers."""
    node = context.node_config
    total = node.get(keys.NUM_PARTITIONS)
    if isinstance(total, bool) or not isinstance(total, int) or keys.PARTITION_ID not in node:
        raise ConfigError(
            f"attack '{attack.kind}' computes the honest sites' updates on their data: it "
            f"needs a simulation ('{keys.PARTITION_ID}' and '{keys.NUM_PARTITIONS}' in the "
            "node config)"
        )
    run_config = run_config_of(msg, context)
    attackers = {j for j in range(total) if _partition_labels(run_config, j) & attack.sites}
    base = sent_model(msg)
    updates = []
    # The message as sent (its work number orders the site's batches), each honest site in
    # a context of its own whose snapshots go to a directory deleted afterwards: nothing
    # of theirs reaches the attacker's state or the sites' own snapshots.
    with tempfile.TemporaryDirectory(prefix="flplatform-attack-") as scratch:
        for partition in sorted(set(range(total)) - attackers):
            honest_node = {k: v for k, v in node.items() if k != keys.SITE_NAME}
            honest_node[keys.PARTITION_ID] = partition
            honest_node[keys.STATE_DIR] = str(Path(scratch) / str(partition))
            as_site = Context(
                run_id=context.run_id,
                node_id=context.node_id,
                node_config=honest_node,
                state=RecordDict(),
                run_config=context.run_config,
            )
            reply = call_next(msg, as_site)
            if reply.has_error():
                raise ConfigError(
                    f"attack '{attack.kind}': the honest update of site {partition} failed: "
                    f"{reply.error.reason}"
                )
            updates.append(_update_of(attack.kind, reply, base))
    return updates, total, len(attackers)


def _colluding(
    attack: AttackPlan, msg: Message, context: Context, call_next: TrainFunction, reply: Message
) -> Message:
    """``reply`` (the attacker's own, for its metrics and form) carrying ALIE's or IPM's
    update in place of its own."""
    base = sent_model(msg)
    arrays = _uploaded(attack.kind, reply, base)  # checked before the honest sites train
    honest, num_sites, num_attackers = _honest_updates(attack, msg, context, call_next)
    factor = attack.factor(num_sites, num_attackers)
    hostile = alie_update(honest, factor) if attack.kind == ALIE else ipm_update(honest, factor)
    delta = _is_delta(reply)
    for name, update in hostile.items():
        value = update if delta else base[name].astype(np.float64) + update
        arrays[name] = value.astype(arrays[name].dtype)
    content = RecordDict(dict(reply.content.items()))
    content[keys.ARRAYS] = arrays_to_record(arrays)
    return Message(content, reply_to=msg)


__all__ = [
    "KINDS",
    "AttackPlan",
    "attack_mod",
    "alie_update",
    "alie_z",
    "filled",
    "ipm_update",
    "scaled_model",
    "scaled_upload",
    "site_labels",
]
