"""The cross-silo demo as data: three panels, each a fair comparison where its method should win.

Every run trains the same four sites of the world map (London, Ohio, California, Tokyo; one
Flower federation for the whole demo) on scikit-learn's digits, split non-IID (Dirichlet
α = 1), and is scored by the server's test accuracy. A panel picks the network, model,
compute model and rounds under which its method's premise holds:

``stragglers``
    The world network with exponential compute times (the preset: 0.05 s per local step on
    average, seeded per-site speeds in [0.5, 2]), the small MLP, one local epoch per update.
    Fully sync waits for the slowest of four random draws every round; K-sync, K-async and
    buffered aggregation (K = 2) do not. Every mode gets the same number of site updates
    (12 rounds of 4, 24 steps of 2). Measure: simulated time to 90%.
``delayed``
    The world links with fast computers (fixed 0.01 s per local step, so a 10-step period
    takes about as long as Tokyo's 277 ms round trip) and the wide MLP (48k parameters,
    192 KB a model): communication dominates. Synchronous SGD (one step per round, server
    momentum 0.9) and local-SGD averaging (10 steps per round) wait for every round trip;
    DTS (delayed updates, D = 2, 10-step periods) hides it, and top-k uploads (10%) cut
    what is left. Measure: simulated time to 92%; each run's budget leaves it room to reach
    that (synchronous SGD gets the most simulated time of all, and still does not).
``compression``
    The wide MLP again: uploads are what a site pays for. Uncompressed local-SGD averaging
    (8 rounds) against top-k (1%, error feedback), int8, FetchSGD (k = 2000, a 3 × 1000
    sketch, ρ = 0.9) and Sketched-SGD (k = 2000, 3 × 2000, two rounds per step), each with
    twice local-SGD's steps. Measure: upload bytes to 90% (training traffic).

Measured on seeds 0 / 1 / 2 (the clock is simulated, so the numbers do not depend on the
machine or its load):

- stragglers, seconds to 90%: sync 15.0 / 9.5 / 9.5; k-sync 8.8 / 4.6 / 7.4; k-async
  10.0 / 5.0 / 2.6; buffered 9.9 / 5.4 / 4.5. Every straggler-tolerant mode beats sync on
  every seed (1.3-3.7×); which of them comes first changes with the seed.
- delayed, seconds to 92%: local-SGD 4.7 / 3.8 / 3.5; DTS 2.9 / 1.5 / 2.0 (1.6-2.5×
  sooner); DTS + top-k 1.6 / 1.8 / 1.6 (2.1-2.9×: top-k helps on seeds 0 and 2, costs a
  little on seed 1); synchronous SGD does not reach 92% in its 20 rounds (10.5 s, more
  simulated time than any other run; it needs 27-29 rounds, about 15 s, on seeds 0 and 1).
- compression, upload bytes to 90%, times fewer than local-SGD's 3.7 / 2.2 / 3.0 MiB:
  top-k 15.3 / 11.7 / 10.4; FetchSGD 6.5 / 4.3 / 5.8; int8 3.6 on every seed;
  Sketched-SGD 1.9 / 1.7 / 1.8. Top-k wins on this model: with four sites that all take
  part every round, FetchSGD's advantages (stateless sites, sparse participation) do not
  show, and a 48k-parameter model leaves a sketch less room than the benchmark's 509k one
  (``benchmarks/bench_communication.py``: 27× fewer bytes up).

No Flower imports: the CLI runs every panel's members in one sweep and reads them back
through ``flplatform.app.comparison.summarize_runs``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flplatform.app.config import DEFAULT_SITES, RunConfig
from flplatform.core.checks import integer, one_of, require
from flplatform.core.errors import ConfigError

if TYPE_CHECKING:
    from flplatform.app.comparison import RunSummary

# What a panel's runs race for: simulated seconds, or upload bytes, until the target.
TIME = "time"
BYTES = "bytes"

# Every run of the demo: the same sites and data (one federation), scored centrally.
COMMON: dict[str, Any] = {
    "sites": DEFAULT_SITES,
    "dataset": "digits",
    "partition": "dirichlet",
    "alpha": 1.0,
    "batch-size": 32,
    "lr": 0.1,
    "momentum": 0.9,
}


@dataclass(frozen=True)
class Panel:
    """One comparison: its runs, what they race for, and how its plot is drawn.

    ``title`` says what the panel compares and ``setting`` where (the plot's two title
    lines); ``reference`` names the member the others are measured against (the method the
    panel's method claims to beat); ``x`` is the plot's x axis (``comparison.X_AXES``);
    ``note`` is one line a reader needs beside the numbers.
    """

    key: str
    title: str
    setting: str
    measure: str
    target: float
    x: str
    reference: str
    members: tuple[RunConfig, ...]
    note: str


@dataclass(frozen=True)
class Row:
    """One run of a panel in the summary table.

    ``cost``: simulated seconds or upload bytes until the run first reached the panel's
    target (None: not reached). ``versus_reference``: the reference's cost over this run's
    (2.0: reached it in half the time, or with half the bytes); None when either did not
    reach the target.
    """

    panel: str
    name: str
    run_id: int
    cost: float | None
    versus_reference: float | None
    final_accuracy: float | None
    best_accuracy: float | None
    rounds: int
    budget: float | None  # the run's whole simulated seconds, or its training bytes up


@dataclass(frozen=True)
class Verdict:
    """What a panel shows: the run that reached the target cheapest, against the reference.

    ``winner`` is None when no run reached the target; ``factor`` is the reference's cost
    over the winner's (None when the reference did not reach it, or won itself).
    """

    panel: Panel
    rows: tuple[Row, ...]
    winner: Row | None
    reference: Row
    factor: float | None

    @property
    def not_reached(self) -> tuple[Row, ...]:
        """The runs that did not reach the target."""
        return tuple(row for row in self.rows if row.cost is None)


# ================================================================ the panels
PANEL_KEYS = ("stragglers", "delayed", "compression")


def build_panels(
    *,
    seed: int = 0,
    db: str = "",
    keys: Sequence[str] = PANEL_KEYS,
    max_rounds: int | None = None,
) -> tuple[Panel, ...]:
    """The demo's panels named in ``keys`` (in the demo's order), every member validated.

    ``max_rounds`` caps every run's rounds (a quick look: targets may then go unreached).

    Raises
    ------
    ConfigError
        For an unknown or repeated panel key, none at all, or a bad ``max_rounds``.
    """
    require(
        [one_of(key, "panel", PANEL_KEYS) for key in keys],
        None if keys else "choose at least one panel: " + ", ".join(PANEL_KEYS),
        None if len(set(keys)) == len(keys) else f"a panel is listed twice: {', '.join(keys)}",
        None if max_rounds is None else integer(max_rounds, "max-rounds", minimum=1),
    )
    shared = {**COMMON, "seed": seed, "db": db}
    builders = {"stragglers": _stragglers, "delayed": _delayed, "compression": _compression}
    return tuple(builders[key](shared, max_rounds) for key in PANEL_KEYS if key in keys)


def sweep_members(panels: Sequence[Panel]) -> list[RunConfig]:
    """Every panel's runs, in order: the members of the demo's one sweep."""
    return [member for panel in panels for member in panel.members]


def _member(
    panel: str,
    label: str,
    shared: Mapping[str, Any],
    settings: Mapping[str, Any],
    rounds: int,
    max_rounds: int | None,
) -> RunConfig:
    """One run, named ``<panel>: <label>`` so that ledger, table and legend say the same."""
    return RunConfig.from_mapping(
        {
            **shared,
            **settings,
            "name": f"{panel}: {label}",
            "num-server-rounds": rounds if max_rounds is None else min(rounds, max_rounds),
        }
    )


def _stragglers(shared: Mapping[str, Any], max_rounds: int | None) -> Panel:
    k, rounds = 2, 12
    steps = rounds * len(DEFAULT_SITES) // k  # the same number of site updates as sync
    base = {**shared, "network": "world", "model": "mlp", "local-epochs": 1, "local-steps": 0}
    runs: list[tuple[str, dict[str, Any], int]] = [
        ("sync", {"sync": "sync"}, rounds),
        (f"k-sync K={k}", {"sync": "k-sync", "k": k}, steps),
        (f"k-async K={k}", {"sync": "k-async", "k": k}, steps),
        (f"buffered K={k}", {"sync": "buffered", "k": k}, steps),
    ]
    return Panel(
        key="stragglers",
        title="Stragglers: time to 90% when sites compute at random speeds",
        setting="world network, exponential compute times (mean 0.05 s per step), MLP on digits",
        measure=TIME,
        target=0.9,
        x="simulated-time",
        reference="stragglers: sync",
        members=tuple(_member("stragglers", label, base, s, n, max_rounds) for label, s, n in runs),
        note=f"Equal site updates ({rounds} rounds of 4, {steps} steps of {k}); "
        "which tolerant mode comes first changes with the seed",
    )


def _delayed(shared: Mapping[str, Any], max_rounds: int | None) -> Panel:
    period, delay = 10, 2
    base = {
        **shared,
        "network": "world",
        "compute-model": "fixed",
        "step-seconds": 0.01,
        "model": "wide-mlp",
        "local-epochs": 0,
        "local-steps": period,
    }
    dts = {"strategy": "delayed", "delay": delay, "period": period}
    runs: list[tuple[str, dict[str, Any], int]] = [
        # One step per round, averaged: data-parallel SGD, its momentum kept by the server
        # (the sites' is reset every round).
        (
            "sync SGD, 1 step/round",
            {"local-steps": 1, "momentum": 0.0, "server-momentum": 0.9},
            20,
        ),
        (f"local-SGD, {period} steps/round", {}, 10),
        (f"DTS D={delay}", dts, 16),
        (f"DTS D={delay} + top-k 10%", {**dts, "codec": "topk:0.1"}, 16),
    ]
    return Panel(
        key="delayed",
        title="Delayed updates: time to 92% where communication dominates",
        setting="world links, fast computers (0.01 s per local step), "
        "wide MLP (48k parameters) on digits",
        measure=TIME,
        target=0.92,
        x="simulated-time",
        reference=f"delayed: local-SGD, {period} steps/round",
        members=tuple(_member("delayed", label, base, s, n, max_rounds) for label, s, n in runs),
        note="Sync SGD waits for a round trip every step, local-SGD every 10 steps, "
        "DTS for none (an average arrives 2 rounds late)",
    )


def _compression(shared: Mapping[str, Any], max_rounds: int | None) -> Panel:
    rounds, k = 8, 2000
    steps = 2 * rounds  # every compressed method gets twice local-SGD's steps
    base = {
        **shared,
        "network": "world",
        "model": "wide-mlp",
        "local-epochs": 0,
        "local-steps": 10,
    }
    sketch = {"k": k, "sketch-rows": 3}
    runs: list[tuple[str, dict[str, Any], int]] = [
        ("local-SGD, uncompressed", {}, rounds),
        ("top-k 1%", {"codec": "topk:0.01"}, steps),
        ("int8", {"codec": "int8"}, steps),
        (
            f"FetchSGD k={k} 3x1000",
            {"strategy": "fetchsgd", **sketch, "sketch-cols": 1000, "sketch-momentum": 0.9},
            steps,
        ),
        # Two rounds per step (sketches, then the candidates' exact values); step momentum
        # 0, as the sites' own momentum suffices.
        (
            f"Sketched-SGD k={k} 3x2000",
            {"strategy": "sketched-sgd", **sketch, "sketch-cols": 2000, "candidate-factor": 2},
            2 * steps,
        ),
    ]
    return Panel(
        key="compression",
        title="Compression: upload bytes to 90%",
        setting="wide MLP (48k parameters, 192 KB a model) on digits, 10 local steps per round",
        measure=BYTES,
        target=0.9,
        x="bytes",
        reference="compression: local-SGD, uncompressed",
        members=tuple(
            _member("compression", label, base, s, n, max_rounds) for label, s, n in runs
        ),
        note=f"Compressed runs get {steps} steps, local-SGD {rounds}; FetchSGD's edge "
        "(stateless sites, few of many taking part) does not show with 4 sites",
    )


# ================================================================ the verdict
def judge(panel: Panel, summaries: Sequence[RunSummary]) -> Verdict:
    """Read a panel's runs back (summarised at the panel's target) into rows and a verdict.

    ``summaries`` are this panel's runs, matched to its members by name; a member without
    a summary (its run never started) is left out.

    Raises
    ------
    ConfigError
        If a summary was read at another target, or the reference run is missing.
    """
    by_name = {s.name: s for s in summaries}
    wrong = [s.name for s in summaries if not math.isclose(s.target, panel.target)]
    if wrong:
        raise ConfigError(
            f"runs {', '.join(wrong)} were summarised at another target than "
            f"{panel.target:g} (panel {panel.key})"
        )
    if panel.reference not in by_name:
        raise ConfigError(f"panel {panel.key}: its reference run '{panel.reference}' is missing")
    reference_cost = _cost(panel, by_name[panel.reference])
    rows = []
    for member in panel.members:
        summary = by_name.get(member.run_name)
        if summary is None:
            continue
        cost = _cost(panel, summary)
        rows.append(
            Row(
                panel=panel.key,
                name=summary.name,
                run_id=summary.run_id,
                cost=cost,
                versus_reference=_ratio(reference_cost, cost),
                final_accuracy=summary.final_accuracy,
                best_accuracy=summary.best_accuracy,
                rounds=summary.rounds,
                budget=_budget(panel, summary),
            )
        )
    reached = [row for row in rows if row.cost is not None]
    # Ties go to the earlier member: the reference comes first where it may tie.
    winner = min(reached, key=lambda row: row.cost or 0.0, default=None)
    (reference,) = [row for row in rows if row.name == panel.reference]
    factor = None if winner is None or winner is reference else winner.versus_reference
    return Verdict(
        panel=panel,
        rows=tuple(rows),
        winner=winner,
        reference=reference,
        factor=factor,
    )


def _cost(panel: Panel, summary: RunSummary) -> float | None:
    if panel.measure == BYTES:
        return None if summary.bytes_up_to_target is None else float(summary.bytes_up_to_target)
    return summary.time_to_target


def _budget(panel: Panel, summary: RunSummary) -> float | None:
    """What the run spent in all: its simulated seconds, or its training bytes up."""
    if panel.measure == BYTES:
        return float(summary.curve[-1].bytes_up) if summary.curve else None
    return summary.simulated_seconds


def _ratio(reference: float | None, cost: float | None) -> float | None:
    if reference is None or cost is None or cost <= 0:
        return None
    return reference / cost
