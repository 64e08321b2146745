"""Compare synchrony modes on one federation: run each, then read the ledger back.

Every mode trains the same sites on the same data and network; what differs is when
the server aggregates. To compare like with like each mode gets the same number of site
updates: fully sync runs R rounds of P updates, a K mode R·P/K steps of K, async R·P
steps of one, and delayed updates (``delayed``: local-SGD's rounds, but no site waits
for the latest average) R rounds of P. The results (and the plots) are read from the
ledger, never from memory, so ``flplatform history`` shows exactly what the table
summarises.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flplatform.checks import integer, require
from flplatform.config import RunConfig
from flplatform.engine.synchrony import SYNC_MODES
from flplatform.errors import ConfigError
from storage import LedgerRepository, RoundRecord, RunRecord

# The modes the cross-silo demo compares: local-SGD averaging (sync) and delayed updates
# beside it, then Dutta et al.'s table in order.
DELAYED_MODE = "delayed"
DEMO_MODES = (
    "sync",
    DELAYED_MODE,
    "k-sync",
    "k-batch-sync",
    "async",
    "k-async",
    "k-batch-async",
    "buffered",
)
# Optional rows (--modes): compressed uploads and FetchSGD, each beside local-SGD's bytes.
# FetchSGD's k suits the demo's 5k-parameter MLP (about 5% of it); on so small a model a
# sketch is as big as the model, which the table shows as it is.
COMPRESSION_MODES: dict[str, tuple[str, dict[str, Any]]] = {
    "topk": ("local-sgd topk:0.05", {"codec": "topk:0.05"}),
    "int8": ("local-sgd int8", {"codec": "int8"}),
    "fetchsgd": (
        "fetchsgd k=250",
        {"strategy": "fetchsgd", "k": 250, "sketch-momentum": 0.9},
    ),
    "sketched-sgd": (
        "sketched-sgd k=250",
        {"strategy": "sketched-sgd", "k": 250},  # step momentum 0: the sites' own suffices
    ),
}
# Sketched-SGD takes two rounds per step (sketches, then exact values): as many steps, and
# so as many site trainings, as the other rows take twice the rounds.
ROUNDS_PER_STEP = {"sketched-sgd": 2}
ACCURACY = "accuracy"


@dataclass(frozen=True)
class ModePlan:
    """One mode of a comparison: its label, settings and number of server steps."""

    label: str
    settings: dict[str, Any]  # run-config keys: sync, k, ...
    rounds: int


@dataclass(frozen=True)
class ModeResult:
    """One mode's run as the ledger recorded it."""

    label: str
    run_id: int
    final_accuracy: float | None
    best_accuracy: float | None
    simulated_seconds: float | None
    time_to_target: float | None  # simulated seconds to first reach the target
    server_steps: int
    bytes_up: int
    bytes_down: int
    mean_staleness: dict[str, float | None]  # per site, over applied updates
    wall_seconds: float | None
    # (simulated seconds, server step, accuracy) after each step
    curve: list[tuple[float | None, int, float | None]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (the curve included)."""
        return {
            "mode": self.label,
            "run_id": self.run_id,
            "final_accuracy": self.final_accuracy,
            "best_accuracy": self.best_accuracy,
            "simulated_seconds": self.simulated_seconds,
            "time_to_target": self.time_to_target,
            "server_steps": self.server_steps,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "mean_staleness": self.mean_staleness,
            "wall_seconds": self.wall_seconds,
            "curve": [list(point) for point in self.curve],
        }


def plan_modes(
    modes: Sequence[str], *, sites: int, rounds: int, k: int, delay: int = 2
) -> list[ModePlan]:
    """Plans with equal numbers of site updates: ``rounds`` × ``sites`` for every mode."""
    # Every problem now, in one error: each plan runs for minutes before the next is built.
    require(
        integer(rounds, "rounds", minimum=1),
        integer(k, "k", minimum=1, maximum=sites, says=f"between 1 and the {sites} sites"),
        integer(delay, "delay", minimum=0, says=">= 0 rounds"),
    )
    plans = []
    for mode in modes:
        if mode == DELAYED_MODE:
            settings = {"strategy": DELAYED_MODE, "sync": "sync", "delay": delay}
            plans.append(ModePlan(f"delayed (D={delay})", settings, rounds))
            continue
        if mode in COMPRESSION_MODES:
            label, settings = COMPRESSION_MODES[mode]
            steps = rounds * ROUNDS_PER_STEP.get(mode, 1)
            plans.append(ModePlan(label, {"sync": "sync", **settings}, steps))
            continue
        if mode not in SYNC_MODES:
            allowed = ", ".join((*SYNC_MODES, DELAYED_MODE, *COMPRESSION_MODES))
            raise ConfigError(f"unknown mode {mode!r}; allowed: {allowed}")
        per_step = sites if mode == "sync" else 1 if mode == "async" else k
        label = mode if mode in ("sync", "async") else f"{mode} (K={k})"
        plans.append(
            ModePlan(label, {"sync": mode, "k": k}, max(1, math.ceil(rounds * sites / per_step)))
        )
    return plans


def run_comparison(
    base: RunConfig,
    plans: Sequence[ModePlan],
    *,
    run: Callable[[RunConfig, ModePlan], RunRecord],
) -> list[int]:
    """Run every plan on ``base`` (same sites, data, network, seed); return the run ids."""
    return [run(plan_config(base, plan), plan).id for plan in plans]


def plan_config(base: RunConfig, plan: ModePlan) -> RunConfig:
    """The run configuration of one plan; ``ConfigError`` if it cannot run."""
    return RunConfig.from_mapping(
        {**base.to_run_config(), **plan.settings, "num-server-rounds": plan.rounds}
    )


def read_results(
    repository: LedgerRepository,
    run_ids: Sequence[int],
    labels: Sequence[str],
    *,
    target: float,
) -> list[ModeResult]:
    """Summarise each run from the ledger (accuracy curve, time to target, bytes, staleness)."""
    results = []
    for run_id, label in zip(run_ids, labels, strict=True):
        record = repository.get_run(run_id)
        rounds = repository.list_rounds(run_id)
        sites = repository.site_summaries(run_id)
        curve = [(r.virtual_finished_at, r.round, _accuracy(r)) for r in rounds]
        accuracies = [a for _, _, a in curve if a is not None]
        results.append(
            ModeResult(
                label=label,
                run_id=run_id,
                final_accuracy=accuracies[-1] if accuracies else None,
                best_accuracy=max(accuracies) if accuracies else None,
                simulated_seconds=record.simulated_seconds,
                time_to_target=time_to_reach(rounds, target),
                server_steps=len(rounds),
                # every byte of the run, its site queries included (the wire's count)
                bytes_up=record.bytes_up,
                bytes_down=record.bytes_down,
                mean_staleness={s.name: s.mean_staleness for s in sites},
                wall_seconds=record.wall_seconds,
                curve=curve,
            )
        )
    return results


def time_to_reach(rounds: Sequence[RoundRecord], target: float) -> float | None:
    """Simulated seconds at the end of the first step whose accuracy reaches ``target``."""
    for r in rounds:
        accuracy = _accuracy(r)
        if accuracy is not None and accuracy >= target:
            return r.virtual_finished_at
    return None


def _accuracy(record: RoundRecord) -> float | None:
    value = record.metrics.get(ACCURACY)
    return float(value) if isinstance(value, int | float) else None


def plot_results(
    results: Sequence[ModeResult], out_dir: Path, *, title: str, target: float | None = None
) -> tuple[Path, Path]:
    """Write accuracy against simulated time and against server steps, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = (out_dir / "accuracy_vs_simulated_time.png", out_dir / "accuracy_vs_server_steps.png")
    for path, x_index, x_label in (
        (paths[0], 0, "simulated time (s)"),
        (paths[1], 1, "server steps"),
    ):
        fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
        for result in results:
            points = [
                (p[x_index], p[2])
                for p in result.curve
                if p[x_index] is not None and p[2] is not None
            ]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, label=result.label, linewidth=1.5)
        if target is not None:
            ax.axhline(target, color="grey", linestyle=":", linewidth=1, label=f"target {target:g}")
        ax.set_xlabel(x_label)
        ax.set_ylabel("test accuracy")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
    return paths
