"""Compare runs: plan synchrony modes, summarise any runs from the ledger, plot them.

Planning: every mode trains the same sites on the same data and network; what differs is
when the server aggregates. To compare like with like each mode gets the same number of
site updates: fully sync runs R rounds of P updates, a K mode R·P/K steps of K, async R·P
steps of one, and delayed updates (``delayed``: local-SGD's rounds, but no site waits for
the latest average) R rounds of P.

Summaries and plots are read from the ledger, never from memory, so ``flplatform history``
shows exactly what they say, for any runs (the demo's, a sweep's, a user's own app's). A
run's accuracy is the server's (central evaluation), else the sites' (federated
evaluation), and its time is on its simulated clock when it simulated a network, else on
the wall clock since the run was created.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flplatform.app.config import SKETCHED, RunConfig
from flplatform.core import keys
from flplatform.core.checks import integer, require
from flplatform.core.errors import ConfigError, NotFoundError
from flplatform.engine.synchrony import K_MODES, SYNC_MODES
from flplatform.run.options import DEFAULT_OPTIONS
from storage import LedgerRepository, RunRecord

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# The modes ``plan_modes`` knows (benchmarks/bench_synchrony.py runs them): local-SGD
# averaging (sync) and delayed updates beside it, then Dutta et al.'s table in order. (The
# demo's panels are flplatform/app/demo.py.)
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
# Optional rows: compressed uploads and FetchSGD, each beside local-SGD's bytes. Their k
# suits the 5k-parameter MLP (about 5% of it); on so small a model a sketch is as big as
# the model.
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


@dataclass(frozen=True)
class ModePlan:
    """One mode of a comparison: its label, settings and number of server steps."""

    label: str
    settings: dict[str, Any]  # run-config keys: sync, k, ...
    rounds: int


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


# ================================================================ summaries of any runs
X_AXES = ("simulated-time", "rounds", "bytes")
# The clock of a summary's times: the run's simulated one when it simulated a network.
CLOCK_SIMULATED = "simulated"
CLOCK_WALL = "wall"
# The metrics a run's accuracy is read from, in order of preference: the server's own
# (central evaluation), else the sites' (federated evaluation: a run whose sites standardise
# their features has only theirs).
ACCURACY_METRICS = (keys.ACCURACY, keys.SITE_ACCURACY)
MIB = 1024 * 1024


@dataclass(frozen=True)
class CurvePoint:
    """A run after one server step: when the step ended, what it had cost, its accuracy.

    The bytes are cumulative training bytes, the updates' messages and replies up to and
    including this step (evaluations and site queries are not in them).
    """

    round: int
    simulated_seconds: float | None  # on the simulated clock; None for a wall-clock run
    bytes_up: int
    bytes_down: int
    accuracy: float | None
    # wall seconds of training so far: the steps' own durations summed, so neither a
    # sweep's Flower start-up (charged to its first run otherwise) nor the time a resumed
    # run was down counts
    wall_seconds: float


@dataclass(frozen=True)
class RunSummary:
    """One run as the ledger recorded it: its setup, its accuracy curve and what it cost.

    The setup (``run_setup``) comes from the run's recorded config; a key it lacks (a user's
    own app) is None, and the strategy falls back to the name the run was recorded under.
    ``k`` is None where no K shapes the run: neither a K sync mode nor a sketched strategy
    (whose k is coordinates per step). ``accuracy_metric`` names the metric the accuracies are (see
    ``ACCURACY_METRICS``); None when the run has neither. ``time_to_target`` and the curve's
    times are on ``clock``: the simulated one for a run that simulated a network, else wall
    seconds since the run was created. ``bytes_up_to_target`` is the training bytes up to
    and including the first step whose accuracy reached ``target``. ``bytes_up`` and
    ``bytes_down`` are every byte of the run (queries and evaluations too), as ``history
    runs`` has them.
    """

    run_id: int
    name: str
    status: str
    strategy: str
    sync: str | None
    k: int | None
    model: str | None
    codec: str | None
    seed: int
    target: float
    accuracy_metric: str | None
    final_accuracy: float | None
    best_accuracy: float | None
    clock: str
    time_to_target: float | None
    bytes_up_to_target: int | None
    rounds: int
    simulated_seconds: float | None
    wall_seconds: float | None
    bytes_up: int
    bytes_down: int
    mean_staleness: dict[str, float | None]  # per site, over applied updates
    curve: list[CurvePoint]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, the curve as a list of its points' fields."""
        return asdict(self)

    def seconds(self, point: CurvePoint) -> float | None:
        """When ``point``'s step ended, on this run's clock."""
        return _on_clock(self.clock, point)


def accuracy_metric(metrics: Iterable[Mapping[str, Any]]) -> str | None:
    """The first of ``ACCURACY_METRICS`` that any of ``metrics`` holds a number for."""
    metrics = list(metrics)
    return next(
        (
            name
            for name in ACCURACY_METRICS
            if any(_number(m.get(name)) is not None for m in metrics)
        ),
        None,
    )


def summarize_runs(
    repository: LedgerRepository, run_ids: Sequence[int], *, target: float
) -> list[RunSummary]:
    """Summarise each run from the ledger, in the order given.

    Raises
    ------
    ConfigError
        If ``target`` is not an accuracy in (0, 1].
    NotFoundError
        Naming every run of ``run_ids`` the ledger does not hold.
    """
    if not (isinstance(target, int | float) and 0.0 < target <= 1.0):
        raise ConfigError(f"the target is an accuracy in (0, 1], got {target}")
    records: list[RunRecord] = []
    missing: list[int] = []
    for run_id in run_ids:
        try:
            records.append(repository.get_run(run_id))
        except NotFoundError:
            missing.append(run_id)
    if missing:
        raise NotFoundError(
            f"{_runs(missing)} {'does' if len(missing) == 1 else 'do'} not exist in "
            f"{repository.url}; `flplatform history runs` lists its runs"
        )
    return [_summarize(repository, record, float(target)) for record in records]


@dataclass(frozen=True)
class RunSetup:
    """What a run's recorded config says about its algorithm (see ``RunSummary``)."""

    strategy: str
    sync: str | None
    k: int | None
    model: str | None
    codec: str | None


def run_setup(record: RunRecord) -> RunSetup:
    """The run's strategy, sync mode, K, model and codec, from its recorded config."""
    config = record.config
    sync = _text(config.get("sync"))
    strategy = _text(config.get("strategy")) or record.strategy
    k = config.get("k")
    if k == 0 and sync in K_MODES and strategy not in SKETCHED:
        k = DEFAULT_OPTIONS.k  # 0: not set, start()'s K
    shaped_by_k = sync in K_MODES or strategy in SKETCHED
    return RunSetup(
        strategy=strategy,
        sync=sync,
        k=k if shaped_by_k and isinstance(k, int) and not isinstance(k, bool) else None,
        model=_text(config.get("model")),
        codec=_text(config.get("codec")),
    )


def _summarize(repository: LedgerRepository, record: RunRecord, target: float) -> RunSummary:
    rounds = repository.list_rounds(record.id)
    metric = accuracy_metric(r.metrics for r in rounds)
    curve: list[CurvePoint] = []
    up = down = 0
    wall = 0.0
    for r in rounds:
        up, down = up + r.bytes_up, down + r.bytes_down
        wall += r.wall_seconds
        curve.append(
            CurvePoint(
                round=r.round,
                simulated_seconds=r.virtual_finished_at,
                bytes_up=up,
                bytes_down=down,
                accuracy=None if metric is None else _number(r.metrics.get(metric)),
                wall_seconds=wall,
            )
        )
    simulated = (
        record.network is not None
        or record.simulated_seconds is not None
        or any(p.simulated_seconds is not None for p in curve)
    )
    clock = CLOCK_SIMULATED if simulated else CLOCK_WALL
    accuracies = [p.accuracy for p in curve if p.accuracy is not None]
    reached = next((p for p in curve if p.accuracy is not None and p.accuracy >= target), None)
    return RunSummary(
        run_id=record.id,
        name=record.name,
        status=record.status,
        **asdict(run_setup(record)),
        seed=record.seed,
        target=target,
        accuracy_metric=metric,
        final_accuracy=accuracies[-1] if accuracies else None,
        best_accuracy=max(accuracies) if accuracies else None,
        clock=clock,
        time_to_target=None if reached is None else _on_clock(clock, reached),
        bytes_up_to_target=None if reached is None else reached.bytes_up,
        rounds=len(rounds),
        simulated_seconds=record.simulated_seconds,
        wall_seconds=record.wall_seconds,
        # every byte of the run, its site queries included (the wire's count)
        bytes_up=record.bytes_up,
        bytes_down=record.bytes_down,
        mean_staleness={s.name: s.mean_staleness for s in repository.site_summaries(record.id)},
        curve=curve,
    )


def _on_clock(clock: str, point: CurvePoint) -> float | None:
    return point.simulated_seconds if clock == CLOCK_SIMULATED else point.wall_seconds


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _text(value: Any) -> str | None:
    """A config value as text; None for an absent or empty one."""
    return None if value is None or value == "" else str(value)


# ================================================================ plots
# Ten distinct colours, four line styles and eight markers: each run differs from its
# neighbours in all three, so overlapping curves stay apart on screen and in grey print.
COLOURS = (
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)  # fmt: skip
LINE_STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
MARKERS_PER_LINE = 10  # enough to tell a line by its marker, few enough to keep it a line
LEGEND_WIDTH = 32  # characters per legend line before a run's label wraps


def runs_figure(
    summaries: Sequence[RunSummary], *, x: str, title: str, target: float | None = None
) -> Figure:
    """Accuracy against ``x`` (one of ``X_AXES``), one line per run; see ``plot_runs``.

    Raises
    ------
    ConfigError
        If ``x`` is unknown, there is no run, a run has no accuracy, or (``x`` =
        simulated-time) some runs simulated a network and others ran on the wall clock.
    """
    from matplotlib.figure import Figure  # not pyplot: no global figures, no GUI backend

    if x not in X_AXES:
        raise ConfigError(f"the x axis is one of {', '.join(X_AXES)}, got '{x}'")
    if not summaries:
        raise ConfigError("there is no run to plot")
    without = [s.run_id for s in summaries if s.accuracy_metric is None]
    if without:
        raise ConfigError(
            f"{_runs(without)} recorded no accuracy (neither the server's evaluation nor the "
            "sites'): there is no curve to plot"
        )
    x_label = {
        "rounds": "round (server step)",
        "bytes": "training bytes uploaded by the sites, cumulative (MiB)",
    }.get(x) or _time_label(summaries)
    metrics = {s.accuracy_metric for s in summaries}

    fig = Figure(figsize=(10, 5), dpi=120, layout="constrained")
    ax = fig.add_subplot()
    for index, summary in enumerate(summaries):
        points = [
            (value, p.accuracy)
            for p in summary.curve
            if p.accuracy is not None and (value := _x_value(summary, p, x)) is not None
        ]
        step = max(1, math.ceil(len(points) / MARKERS_PER_LINE))
        label = f"{summary.name} (run {summary.run_id})"
        if len(metrics) > 1 and summary.accuracy_metric == keys.SITE_ACCURACY:
            label += " (sites' accuracy)"
        ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            color=COLOURS[index % len(COLOURS)],
            linestyle=LINE_STYLES[index % len(LINE_STYLES)],
            marker=MARKERS[index % len(MARKERS)],
            markevery=(index % step, step),  # neighbours' markers fall on different steps
            markersize=4.5,
            linewidth=1.6,
            label=textwrap.fill(label, LEGEND_WIDTH),
        )
    if target is not None:
        ax.axhline(
            target, color="black", linestyle=(0, (6, 4)), linewidth=0.9, label=f"target {target:g}"
        )
    # Titles and run names are the user's text: drawn as written, never read as mathtext
    # (a "$" pair would be typeset, an odd one raise).
    ax.set_title(title, parse_math=False)
    ax.set_xlabel(x_label)
    ax.set_ylabel(
        "test accuracy (server)"
        if metrics == {keys.ACCURACY}
        else "accuracy (sites' federated evaluation)"
        if metrics == {keys.SITE_ACCURACY}
        else "accuracy (server's, else the sites')"
    )
    ax.grid(True, alpha=0.3)
    # Beside the axes, never over a curve.
    legend = ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8)
    for text in legend.get_texts():
        text.set_parse_math(False)
    return fig


def plot_runs(
    summaries: Sequence[RunSummary],
    out: Path,
    *,
    x: str,
    title: str,
    target: float | None = None,
) -> Path:
    """Write one PNG of accuracy against ``x``, one line per run; return its path.

    ``x``: ``simulated-time`` (seconds on the runs' simulated clock, or on the wall clock
    when none of them simulated a network), ``rounds`` (server steps) or ``bytes``
    (cumulative training bytes up, in MiB). Each run has its own colour, line style and
    marker, so no line hides another; the legend sits beside the axes, clear of the curves;
    ``target`` is a dashed line.

    Raises
    ------
    ConfigError
        As ``runs_figure``; or if ``out`` is not a .png path or cannot be written.
    """
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise ConfigError(f"the plot is a PNG file: '{out}' must end in .png")
    figure = runs_figure(summaries, x=x, title=title, target=target)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(out, format="png")
    except OSError as exc:
        raise ConfigError(f"cannot write the plot to '{out}': {exc.strerror or exc}") from None
    return out


def _x_value(summary: RunSummary, point: CurvePoint, x: str) -> float | None:
    if x == "rounds":
        return point.round
    if x == "bytes":
        return point.bytes_up / MIB
    return summary.seconds(point)


def _time_label(summaries: Sequence[RunSummary]) -> str:
    """The time axis's label: one clock for every run, or ``ConfigError``."""
    clocks = {s.clock for s in summaries}
    if clocks == {CLOCK_SIMULATED}:
        return "simulated time (s)"
    if clocks == {CLOCK_WALL}:
        return "wall-clock training time (s)"
    wall = [s.run_id for s in summaries if s.clock == CLOCK_WALL]
    raise ConfigError(
        f"{_runs(wall)} ran on the wall clock and the others on a simulated one: their times "
        "cannot share an axis; plot them by rounds or bytes, or apart"
    )


def _runs(run_ids: Sequence[int]) -> str:
    """'run 3' or 'runs 3, 5'."""
    return f"run{'s' if len(run_ids) > 1 else ''} {', '.join(str(i) for i in run_ids)}"
