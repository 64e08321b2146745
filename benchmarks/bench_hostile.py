"""Hostile sites: each attack's final accuracy with and without the defence, and what the
server's checks cost per 1M-parameter reply, as JSON.

The federation is the hostile-site suite's (tests/integration/test_hostile.py): the hostile
app (tests/integration/apps/attack_app), digits, the MLP, three sites (london, ohio,
california; Dirichlet α = 0.5), sync, 20 rounds; california attacks from round 2 with
each of ``clients.attacks``' kinds. ``silent`` (no update from round 2 on) is each
federation's baseline: the same run with the attacker silent. Every run is ``flplatform
run`` of the app (through ``flplatform.launch.app_directory``), read back from its ledger; a run the
attack made fail (the engine stops after ``max-failed-rounds`` rounds without an applied
update) counts with the rounds it recorded.

"With the defence" is the platform's defaults (the app's own configuration, plus
``--defence-on`` options if given, e.g. ``update-min-cosine=0``: the direction check, off
by default); "without" adds the options that switch it off (``--defence-off``, default
``update-norm-ratio=0 max-site-share=1 reject-replays=false``). Only options the app
declares are passed: Flower refuses undeclared run-config keys; an option the app does not
declare is named in ``defence.missing``, and with none declared each attack runs once,
reported as ``without_defence`` (``with_defence`` null).

An attack is ``KIND`` or ``KIND:SCALE`` (``attack.scale``: ``scaled:5``, ``sign-flip:10``,
ALIE's z ``alie:1``, IPM's ε ``ipm:0.1``; clients/attacks.py). The published attacks run
over a matrix of federations: ``--aggregators mean,median,trimmed-mean``, ``--attackers
1/4,2/10`` (f of n sites attack: the last f partitions), ``--splits non-iid,iid``
(Dirichlet α = 0.5, or IID), ``--modes sync,k-sync,k-async`` (K = n/2; a median or trimmed
mean over rounds too small to outvote anyone, such as trimmed-mean's default 0.2 of 4 sites, is
refused by the run's configuration and reported failed); each combination, on top
of the attack's own federation (plain, FedAvgM, FetchSGD), is a federation with its own
silent baseline (the same sites, the attackers silent). Every run is timed on the
simulated clock (the attack app's world network; matrix runs with seeded exponential
compute times), so that an attacker that spends real time computing the honest updates
does not arrive late in k-async. Without these options an attack runs in the suite's
federation (three sites, california attacking). ``honest_rejected`` counts the honest
sites' rejected updates of each run.

Time: ``wall_seconds`` of each run, and ``wall_ratio_to_silent``, what the attack cost the
others in time (a site whose process dies every round is benched, doubling: target ≤ 1.5).

Accuracy: ``final_accuracy`` is the mean of the last 3 rounds' server-side accuracy (one
round on digits' 360 test images with two non-IID sites moves it by up to 3.6 points),
``last_accuracy`` the last round's alone.

The cost of the checks: ``check_cost`` times a callable over a 1M-parameter update (the
four float32 arrays of an MLP 784→1 258→10, 1 000 120 parameters, as a model reply
holds them)
and gives the median wall and CPU seconds per call, of the engine's guard and, for
comparison, of stand-ins: the update's L2 norm (float64 accumulation, which a float32-max
update cannot overflow; and float32, for comparison) and a replay fingerprint of the
arrays' names, shapes, dtypes and bytes (zlib.crc32 and hashlib.blake2b, 16-byte
digest). ``guard_default`` and ``guard_with_direction`` time the engine's own
``UpdateGuard.consider`` (flplatform/engine/guard.py) on such an update.

    python benchmarks/bench_hostile.py [--attacks huge,examples,sign-flip:10,...] [--rounds 20]
        [--aggregators mean,median] [--attackers 1/4,2/10] [--splits non-iid,iid]
        [--modes sync,k-async] [--defence-off KEY=VALUE ...] [--defence-on KEY=VALUE ...]
        [--federation KEY=VALUE ...] [--repeats 20] [--skip-simulations] [--out FILE]

    # the published attacks, at the defaults (about 25 minutes on 2 cores: 12 federations,
    # 5 runs each; ALIE's own z is 0 for 1 attacker of 4, so z = 1 here; the README's
    # table; add --defence-on update-min-cosine=-0.1 for its third row)
    python benchmarks/bench_hostile.py --attacks alie:1,ipm,scaled:5,sign-flip:10 \
        --aggregators centered-clip --attackers 1/4,2/10 --splits non-iid,iid \
        --modes sync,k-sync,k-async --defence-off

    # the direction check on the CNN (8 sites, one local step a round: the honest updates
    # it rejects with no attacker, the README's guard section; about 1 minute)
    python benchmarks/bench_hostile.py --attacks sign-flip:10 --aggregators centered-clip \
        --attackers 2/8 --splits non-iid --modes sync --defence-off \
        --defence-on update-min-cosine=-0.1 --rounds 30 \
        --federation model=cnn dataset=mnist5k local-epochs=0 local-steps=1
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import math
import platform
import re
import shutil
import statistics
import sys
import time
import uuid
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from bench_support import emit, fresh_home

from clients.attacks import KINDS, NONE, SILENT
from flplatform.core.arrays import arrays_to_record
from flplatform.core.checks import as_site_names
from flplatform.core.errors import RunFailed
from flplatform.engine.guard import GuardOptions, UpdateGuard
from flplatform.launch.app_directory import RunOverrides, plan_run, read_app
from flplatform.launch.simulation import run_app
from storage import LedgerRepository

ROOT = Path(__file__).resolve().parents[1]
ATTACK_APP = ROOT / "tests" / "integration" / "apps" / "attack_app"
FINAL_ROUNDS = 3
PARAMETERS = 1_000_000

# The federation each attack runs in (the suite's): run-config items on the app's own.
FEDERATIONS: dict[str, tuple[str, ...]] = {
    "plain": (),
    "server-momentum 0.9": ("server-momentum=0.9",),
    "fetchsgd": ("strategy=fetchsgd", "k=500"),
}
ATTACK_FEDERATION = {
    "huge": "plain",
    "float32-max": "server-momentum 0.9",
    "examples": "plain",
    "replay": "plain",
    "sketch": "fetchsgd",
    "scaled": "plain",
    "sign-flip": "plain",
    "alie": "plain",
    "ipm": "plain",
    "suicide": "plain",
    "crash-loop": "plain",
}
# The update guard's options (flplatform/engine/guard.py) that switch each check off.
DEFENCE_OFF = ("update-norm-ratio=0", "max-site-share=1", "reject-replays=false")
SPLITS = {"non-iid": ("partition=dirichlet", "alpha=0.5"), "iid": ("partition=iid",)}
MODES = ("sync", "k-sync", "k-async")

Update = Mapping[str, np.ndarray]


# ============================================================ the cost of the checks
def l2_norm_float64(update: Update) -> float:
    """‖u‖₂ accumulated in float64 (finite for any finite float32 update).

    ``einsum`` casts in small buffers: no float64 copy of the update (``astype`` would
    cost 11 ms per 1M parameters, mostly page faults of the fresh 8 MB).
    """
    total = 0.0
    for array in update.values():
        flat = array.reshape(-1)
        total += float(np.einsum("i,i->", flat, flat, dtype=np.float64))
    return math.sqrt(total)


def l2_norm_float32(update: Update) -> float:
    """‖u‖₂ in the arrays' own float32 (overflows to inf from about 1e19 per coordinate)."""
    return math.sqrt(sum(float(np.dot(a.reshape(-1), a.reshape(-1))) for a in update.values()))


def _described(update: Update) -> bytes:
    return repr([(name, a.shape, a.dtype.str) for name, a in update.items()]).encode()


def _bytes_of(array: np.ndarray) -> memoryview:
    """The array's bytes, without a copy when it is contiguous."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


def fingerprint_crc32(update: Update) -> int:
    """CRC-32 of the arrays' layout and bytes (a replay check's key)."""
    crc = zlib.crc32(_described(update))
    for array in update.values():
        crc = zlib.crc32(_bytes_of(array), crc)
    return crc


def fingerprint_blake2b(update: Update) -> bytes:
    """BLAKE2b (16-byte digest) of the arrays' layout and bytes."""
    digest = hashlib.blake2b(_described(update), digest_size=16)
    for array in update.values():
        digest.update(_bytes_of(array))
    return digest.digest()


def _warm_guard(options: GuardOptions, like: Update) -> UpdateGuard:
    """A guard past its first round (three updates shaped as ``like``): it judges on
    arrival, against a direction of the same shape."""
    guard = UpdateGuard(options)
    guard.begin_round(1)
    for site in range(3):
        guard.consider(site, site=site, kind="delta", claimed=10, vector=list(like.values()))
    guard.settle()
    guard.round_finished()
    guard.begin_round(2)
    return guard


def guard_check(options: GuardOptions) -> Callable[[Update], object]:
    """The engine's guard judging one reply's update (norm, weight, and the direction when
    on; replay by content id, which the engine's byte metering has already computed, so it
    is not timed here). Warmed on the first call, which ``check_cost`` does not time."""
    guards: list[UpdateGuard] = []
    tickets = iter(range(10, 10**9))

    def check(update: Update) -> object:
        if not guards:
            guards.append(_warm_guard(options, update))
        ticket = next(tickets)
        return guards[0].consider(
            ticket, site=ticket, kind="delta", claimed=10, vector=list(update.values())
        )

    return check


def flower_content_id(update: Update) -> str:
    """The replay fingerprint's cost when no one computed it yet: Flower's content id
    (SHA-256 of the serialized record). In the engine the byte metering pays it."""
    return arrays_to_record(dict(update)).object_id


# The server's checks of one reply, timed by check_cost: the engine's guard (default
# options; and with the direction check on), and for comparison the stand-ins.
CHECKS: dict[str, Callable[[Update], object]] = {
    "guard_default": guard_check(GuardOptions()),
    "guard_with_direction": guard_check(GuardOptions(min_cosine=-0.1)),
    "flower_content_id_uncached": flower_content_id,
    "l2_norm_float64": l2_norm_float64,
    "l2_norm_float32": l2_norm_float32,
    "fingerprint_crc32": fingerprint_crc32,
    "fingerprint_blake2b": fingerprint_blake2b,
}


def million_parameter_update(parameters: int = PARAMETERS, seed: int = 0) -> dict[str, np.ndarray]:
    """An MLP 784→h→10's float32 arrays, h chosen so they hold about ``parameters``."""
    hidden = max(1, round((parameters - 10) / (784 + 1 + 10)))
    shapes = {"0.weight": (hidden, 784), "0.bias": (hidden,), "2.weight": (10, hidden)}
    shapes["2.bias"] = (10,)
    rng = np.random.default_rng(seed)
    return {k: rng.normal(0, 0.01, size=s).astype(np.float32) for k, s in shapes.items()}


def check_cost(
    check: Callable[[Update], object], update: Update, *, repeats: int = 20
) -> dict[str, float]:
    """Median wall and CPU milliseconds of ``check(update)`` over ``repeats`` calls (after a
    warm-up call), per 1M parameters of ``update``."""
    size = sum(a.size for a in update.values())
    check(update)  # warm: first-touch page faults and lazy imports are not the check's cost
    wall, cpu = [], []
    for _ in range(repeats):
        began, began_cpu = time.perf_counter(), time.process_time()
        check(update)
        wall.append(time.perf_counter() - began)
        cpu.append(time.process_time() - began_cpu)
    per_million = PARAMETERS / size
    return {
        "wall_ms_per_1M": round(statistics.median(wall) * 1e3 * per_million, 3),
        "cpu_ms_per_1M": round(statistics.median(cpu) * 1e3 * per_million, 3),
    }


def measure_checks(repeats: int) -> dict[str, Any]:
    update = million_parameter_update()
    costs = {name: check_cost(check, update, repeats=repeats) for name, check in CHECKS.items()}
    fingerprints = {name: costs[name]["cpu_ms_per_1M"] for name in costs if "fingerprint" in name}
    cheaper = min(fingerprints, key=fingerprints.__getitem__)
    return {
        "parameters": sum(a.size for a in update.values()),
        # guard_*: the engine's own UpdateGuard.consider on a float32 update (local-SGD's
        # deltas are float64 already); the rest: stand-ins, for comparison
        "checks": costs,
        "cheaper_fingerprint": cheaper,
        # what a guard of one norm and one fingerprint per reply would cost the server
        "norm_and_fingerprint_cpu_ms_per_1M": round(
            costs["l2_norm_float64"]["cpu_ms_per_1M"] + costs[cheaper]["cpu_ms_per_1M"], 3
        ),
    }


# ============================================================ the simulations
def run_attack(
    app_dir: Path, db: str, attack: str, items: Sequence[str], rounds: int | None
) -> dict[str, Any]:
    """One ``flplatform run`` of the attack app with ``attack`` (KIND[:SCALE]) attacking;
    its ledger's story. ``items`` may set ``attack.site`` (else the app's)."""
    app = read_app(app_dir)
    kind, _, scale = attack.partition(":")
    config = [f"attack.kind={kind}", *([f"attack.scale={float(scale)}"] if scale else []), *items]
    given = RunOverrides(rounds=rounds, db=db, run_config=tuple(config))
    plan = plan_run(app, given, tag=uuid.uuid4().hex)
    began = time.perf_counter()
    with contextlib.suppress(RunFailed):  # an attack may fail the run: its ledger tells
        run_app(plan)
    wall = time.perf_counter() - began
    with LedgerRepository.open(db) as repository:
        run = repository.find_run_by_tag(plan.tag)
        if run is None:
            return {"status": "not started", "wall_seconds": round(wall, 1)}
        rounds_done = repository.list_rounds(run.id)
        attackers = attacker_names(dict(item.split("=", 1) for item in items), app.config)
        updates = repository.list_updates(run.id)
        flagged = [
            (u.round, u.site, u.status, u.reason)
            for u in updates
            if u.site in attackers and (u.status != "applied" or u.reason)
        ]
        honest_rejected = sum(
            1 for u in updates if u.site not in attackers and u.status == "rejected"
        )
    accuracies = [float(r.metrics.get("accuracy") or 0.0) for r in rounds_done]
    tail = accuracies[-FINAL_ROUNDS:]
    return {
        "final_accuracy": round(sum(tail) / FINAL_ROUNDS, 4) if tail else None,
        "last_accuracy": round(accuracies[-1], 4) if accuracies else None,
        "status": run.status,
        "error": run.error,
        "rounds": len(rounds_done),
        "attacker_flagged": [list(row) for row in flagged[:3]],
        "attacker_flagged_count": len(flagged),
        "honest_rejected": honest_rejected,
        "wall_seconds": round(wall, 1),
    }


def attacker_names(given: Mapping[str, str], declared: Mapping[str, Any]) -> set[str]:
    """The attackers' names in the ledger: ``attack.site``'s entries, a partition id named
    as the run's ``sites`` name it (a count names the default sites, then site-5, ...)."""
    names = as_site_names("sites", given.get("sites", declared.get("sites", "")))
    listed = str(given.get("attack.site", declared.get("attack.site", "")))
    entries = [part.strip() for part in listed.split(",") if part.strip()]
    return {names[int(e)] if e.isdecimal() and int(e) < len(names) else e for e in entries}


def federations(
    aggregators: Sequence[str],
    attackers: Sequence[str],
    splits: Sequence[str],
    modes: Sequence[str],
) -> dict[str, tuple[str, ...]]:
    """The matrix's federations: a label → the run-config items that make it."""
    out: dict[str, tuple[str, ...]] = {}
    for aggregator, share, split, mode in itertools.product(aggregators, attackers, splits, modes):
        f, n = (int(part) for part in share.split("/"))
        items = (
            f"aggregator={aggregator}",
            f"sites={n}",
            f"attack.site={','.join(str(i) for i in range(n - f, n))}",
            *SPLITS[split],
            "network=world",
            "compute-model=exponential",
            f"sync={mode}",
            *((f"k={max(1, n // 2)}",) if mode != "sync" else ()),
        )
        out[f"{aggregator} {share} {split} {mode}"] = items
    return out


def declared(app_dir: Path, items: Sequence[str]) -> tuple[list[str], list[str]]:
    """``items`` split into those whose key the app declares and those it does not."""
    config = read_app(app_dir).config
    known = [item for item in items if item.partition("=")[0].strip() in config]
    return known, [item for item in items if item not in known]


def measure_attacks(
    attacks: Sequence[str],
    rounds: int | None,
    off: Sequence[str],
    on: Sequence[str],
    matrix: Mapping[str, tuple[str, ...]] | None = None,
    every: Sequence[str] = (),
) -> dict[str, Any]:
    """Each attack in its federations (the matrix's, or its own), against the attacker
    silent there, with and without the defence; ``every``: run-config items added to every
    federation (the app must declare their keys)."""
    home = fresh_home()
    app_dir = home / "attack_app"  # Flower builds its FAB from the directory: a clean copy
    shutil.copytree(ATTACK_APP, app_dir, ignore=shutil.ignore_patterns("__pycache__"))
    db = f"sqlite:///{home / 'ledger.db'}"
    undeclared = declared(app_dir, every)[1]
    if undeclared:
        raise SystemExit(f"--federation: the attack app declares no key of {undeclared}")
    off_known, off_missing = declared(app_dir, off)
    on_known, on_missing = declared(app_dir, on)
    # The app declares the guard's options, or the defence is not in this build.
    defended = bool(declared(app_dir, DEFENCE_OFF)[0])
    settings = {"with": tuple(on_known)} if defended else {"without": ()}
    if defended and off_known:  # `--defence-off` without options: the defaults alone
        settings["without"] = tuple(off_known)
    results: dict[str, Any] = {}
    silent: dict[tuple[str, str], dict[str, Any]] = {}
    cases = [
        (attack, federation, items)
        for attack in attacks
        for federation, items in (
            matrix or {ATTACK_FEDERATION[attack.partition(":")[0]]: ()}
        ).items()
    ]
    for attack, federation, federation_items in cases:
        own = ATTACK_FEDERATION[attack.partition(":")[0]]  # plain, FedAvgM or FetchSGD
        base = FEDERATIONS[own]
        if matrix:
            federation = f"{federation} {own}" if own != "plain" else federation
        row: dict[str, Any] = {"attack": attack, "federation": federation}
        for label, extra in settings.items():
            items = (*base, *federation_items, *every, *extra)
            if (federation, label) not in silent:
                silent[(federation, label)] = run_attack(app_dir, db, SILENT, items, rounds)
            attacked = run_attack(app_dir, db, attack, items, rounds)
            baseline = silent[(federation, label)]
            loss = None
            if attacked["final_accuracy"] is not None and baseline["final_accuracy"] is not None:
                loss = round(baseline["final_accuracy"] - attacked["final_accuracy"], 4)
            # The time the attack cost the others (the suicide's target: at most 1.5×).
            wall_ratio = round(attacked["wall_seconds"] / max(baseline["wall_seconds"], 1e-9), 2)
            row[f"{label}_defence"] = {
                **attacked,
                "points_below_silent": loss,
                "wall_ratio_to_silent": wall_ratio,
            }
            row[f"silent_{label}_defence"] = baseline
        row.setdefault("with_defence", None)
        results[f"{attack} @ {federation}" if matrix else attack] = row
    return {
        "federation_items": list(every),
        "defence": {
            "present": defended,
            "with": list(on_known),
            "without": list(off_known),
            "missing": off_missing + on_missing,
            "note": None
            if defended
            else "the app declares none of the options that switch the defence off: each "
            "attack ran once, with today's engine (without_defence)",
        },
        "attacks": results,
    }


def _number(text: str) -> bool:
    try:
        return math.isfinite(float(text)) and float(text) >= 0
    except ValueError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    attacks = [k for k in KINDS if k not in (SILENT, NONE)]
    parser.add_argument("--attacks", default=",".join(attacks), help="comma-separated kinds")
    parser.add_argument("--rounds", type=int, default=None, help="default: the app's (20)")
    parser.add_argument("--defence-off", nargs="*", default=list(DEFENCE_OFF), metavar="K=V")
    parser.add_argument("--defence-on", nargs="*", default=[], metavar="K=V")
    parser.add_argument(
        "--federation",
        nargs="*",
        default=[],
        metavar="K=V",
        help="run-config items of every federation, e.g. another task: model=cnn "
        "dataset=mnist5k local-epochs=0 local-steps=1",
    )
    parser.add_argument(
        "--aggregators", default="", help="matrix: centered-clip,mean,median,trimmed-mean"
    )
    parser.add_argument("--attackers", default="", help="matrix: f/n shares, e.g. 1/4,2/10")
    parser.add_argument("--splits", default="", help="matrix: " + ",".join(SPLITS))
    parser.add_argument("--modes", default="", help="matrix: " + ",".join(MODES))
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per check")
    parser.add_argument("--skip-simulations", action="store_true", help="only the checks' cost")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    chosen = [k.strip() for k in args.attacks.split(",") if k.strip()]
    unknown = [k for k in chosen if k.partition(":")[0] not in ATTACK_FEDERATION]
    if unknown:
        parser.error(f"unknown attack {', '.join(unknown)}; allowed: {', '.join(attacks)}")
    scales = [k.partition(":")[2] for k in chosen]
    bad_scales = [k for k, v in zip(chosen, scales, strict=True) if v and not _number(v)]
    if bad_scales:
        parser.error(f"SCALE must be a number >= 0 in KIND:SCALE, got {', '.join(bad_scales)}")
    lists = {
        name: [v.strip() for v in getattr(args, name).split(",") if v.strip()]
        for name in ("aggregators", "attackers", "splits", "modes")
    }
    matrix = None
    if any(lists.values()):
        bad = [s for s in lists["attackers"] if not re.fullmatch(r"\d+/\d+", s)]
        bad += [s for s in lists["splits"] if s not in SPLITS]
        bad += [s for s in lists["modes"] if s not in MODES]
        if bad:
            parser.error(f"not a matrix value: {', '.join(bad)}")
        matrix = federations(
            lists["aggregators"] or ["mean"],
            lists["attackers"] or ["1/4"],
            lists["splits"] or ["non-iid"],
            lists["modes"] or ["sync"],
        )
    began = time.perf_counter()
    report: dict[str, Any] = {
        "machine": {"python": sys.version.split()[0], "platform": platform.platform()},
        "check_cost": measure_checks(args.repeats),
    }
    if not args.skip_simulations:
        report.update(
            measure_attacks(
                chosen, args.rounds, args.defence_off, args.defence_on, matrix, args.federation
            )
        )
    report["wall_seconds"] = round(time.perf_counter() - began, 1)
    emit(report, args.out)


if __name__ == "__main__":
    main()
