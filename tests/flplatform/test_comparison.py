"""Plans of the cross-silo comparison; summaries and plots of any runs from the ledger."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from flplatform.app.comparison import (
    DEMO_MODES,
    CurvePoint,
    RunSummary,
    accuracy_metric,
    plan_modes,
    plot_runs,
    runs_figure,
    summarize_runs,
)
from flplatform.app.config import RunConfig
from flplatform.core.errors import ConfigError, NotFoundError
from storage import LedgerRepository
from tests.helpers.comparison_ledger import write_comparison_ledger


def test_every_mode_gets_the_same_number_of_site_updates() -> None:
    plans = {p.label: p for p in plan_modes(DEMO_MODES, sites=4, rounds=15, k=2)}
    assert plans["sync"].rounds == 15  # 15 rounds of 4
    assert plans["delayed (D=2)"].rounds == 15
    assert plans["k-sync (K=2)"].rounds == 30  # 30 steps of 2
    assert plans["async"].rounds == 60  # 60 steps of 1


def test_compression_rows_are_valid_runs() -> None:
    plans = plan_modes(["topk", "int8", "fetchsgd", "sketched-sgd"], sites=4, rounds=5, k=2)
    assert [p.label for p in plans] == [
        "local-sgd topk:0.05",
        "local-sgd int8",
        "fetchsgd k=250",
        "sketched-sgd k=250",
    ]
    base = RunConfig()
    for plan in plans:
        config = RunConfig.from_mapping({**base.to_run_config(), **plan.settings})
        assert config.sync == "sync"
    assert [p.rounds for p in plans] == [5, 5, 5, 10]  # Sketched-SGD: two rounds per step
    assert RunConfig.from_mapping({**base.to_run_config(), **plans[2].settings}).k == 250


def test_an_unknown_row_names_what_is_allowed() -> None:
    with pytest.raises(ConfigError, match="allowed: .*delayed, topk, int8, fetchsgd, sketched-sgd"):
        plan_modes(["zip"], sites=4, rounds=5, k=2)


# ================================================================ summaries of any runs
@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The hand-worked ledger, written once: no test writes to it."""
    url = f"sqlite:///{tmp_path_factory.mktemp('comparison') / 'ledger.db'}"
    write_comparison_ledger(url)
    return url


def summaries(url: str, run_ids: list[int], target: float = 0.9) -> list[RunSummary]:
    with LedgerRepository.open(url) as repository:
        return summarize_runs(repository, run_ids, target=target)


def test_a_simulated_run_summarised_by_hand(ledger: str) -> None:
    (run,) = summaries(ledger, [1])
    assert (run.run_id, run.name, run.status, run.seed) == (
        1,
        "stragglers: k-async K=2",
        "finished",
        4,
    )
    assert (run.strategy, run.sync, run.k, run.model, run.codec) == (
        "local-sgd",
        "k-async",
        2,
        "cnn",
        "int8",
    )
    assert (run.accuracy_metric, run.final_accuracy, run.best_accuracy) == ("accuracy", 0.91, 0.92)
    # Round 2 is the first at 0.9: it ends at 25.5 s, after 300 + 200 training bytes up
    # (the evaluation's 30 and the queries' 14 are not training bytes).
    assert (run.clock, run.time_to_target, run.bytes_up_to_target) == ("simulated", 25.5, 500)
    assert (run.rounds, run.simulated_seconds, run.wall_seconds) == (3, 40.0, 50.0)
    assert (run.bytes_up, run.bytes_down) == (844, 5310)  # every byte, as `history runs`
    assert run.mean_staleness == {"london": 1.0, "tokyo": 0.0}
    assert [
        (p.round, p.simulated_seconds, p.bytes_up, p.bytes_down, p.accuracy) for p in run.curve
    ] == [
        (1, 10.0, 300, 2000, 0.5),
        (2, 25.5, 500, 4000, 0.92),
        (3, 40.0, 800, 5000, 0.91),
    ]
    # Wall seconds of training: each round's own second, summed (not since the run was
    # created, which would charge a sweep's start-up to its first run).
    assert [p.wall_seconds for p in run.curve] == pytest.approx([1.0, 2.0, 3.0])


def test_time_and_bytes_to_other_targets(ledger: str) -> None:
    (low,) = summaries(ledger, [1], target=0.5)  # reached exactly, at round 1
    assert (low.time_to_target, low.bytes_up_to_target, low.target) == (10.0, 300, 0.5)
    (high,) = summaries(ledger, [1], target=0.95)  # never
    assert (high.time_to_target, high.bytes_up_to_target) == (None, None)
    assert high.final_accuracy == 0.91


def test_a_wall_clock_run_with_the_sites_accuracy(ledger: str) -> None:
    (run,) = summaries(ledger, [2])
    assert (run.accuracy_metric, run.final_accuracy, run.best_accuracy) == (
        "site_accuracy",
        0.95,
        0.95,
    )
    # Wall seconds of training: rounds of 3 s each, round 2 the first at the target.
    assert run.clock == "wall"
    assert run.time_to_target == pytest.approx(6.0)
    assert run.bytes_up_to_target == 100
    assert run.k is None  # sync mode: no K shapes the run
    assert [p.simulated_seconds for p in run.curve] == [None, None]


def test_a_user_s_own_app_and_a_sketched_strategy(ledger: str) -> None:
    own, fetchsgd = summaries(ledger, [3, 4])
    assert (own.strategy, own.sync, own.k, own.model, own.codec) == (
        "MyFedAvg",
        None,
        None,
        None,
        None,
    )
    assert (own.accuracy_metric, own.final_accuracy, own.time_to_target) == (None, None, None)
    assert (fetchsgd.strategy, fetchsgd.k, fetchsgd.rounds, fetchsgd.curve) == (
        "fetchsgd",
        250,
        0,
        [],
    )


def test_summaries_keep_the_order_given_and_serialise(ledger: str) -> None:
    runs = summaries(ledger, [2, 1, 2])
    assert [r.run_id for r in runs] == [2, 1, 2]
    data = json.loads(json.dumps([r.to_dict() for r in runs]))
    assert list(data[1]) == [f.name for f in fields(RunSummary)]
    assert data[1]["curve"][1] == {
        "round": 2,
        "simulated_seconds": 25.5,
        "bytes_up": 500,
        "bytes_down": 4000,
        "accuracy": 0.92,
        "wall_seconds": pytest.approx(2.0),
    }


def test_missing_runs_are_named_together(ledger: str) -> None:
    with pytest.raises(NotFoundError, match="runs 42, 43 do not exist in sqlite"):
        summaries(ledger, [1, 42, 43])
    with pytest.raises(NotFoundError, match="run 42 does not exist"):
        summaries(ledger, [42])


@pytest.mark.parametrize("target", [0.0, -0.1, 1.5, float("nan")])
def test_the_target_is_an_accuracy(ledger: str, target: float) -> None:
    with pytest.raises(ConfigError, match=r"the target is an accuracy in \(0, 1\]"):
        summaries(ledger, [1], target=target)


def test_the_server_s_accuracy_comes_first() -> None:
    assert accuracy_metric([{"site_accuracy": 0.5}, {"accuracy": 0.4}]) == "accuracy"
    assert accuracy_metric([{"accuracy": None, "site_accuracy": 0.5}]) == "site_accuracy"
    assert accuracy_metric([{"loss": 0.1}, {}]) is None


# ================================================================ plots
def lines_of_runs(axes: Any) -> list[Any]:
    return [line for line in axes.get_lines() if not line.get_label().startswith("target")]


def test_one_line_per_run_with_the_target_dashed(ledger: str) -> None:
    runs = summaries(ledger, [1, 2])
    figure = runs_figure(runs, x="rounds", title="Two runs", target=0.9)
    (axes,) = figure.axes
    lines = lines_of_runs(axes)
    assert len(lines) == 2
    assert [list(line.get_xdata()) for line in lines] == [[1, 2, 3], [1, 2]]
    assert [list(line.get_ydata()) for line in lines] == [[0.5, 0.92, 0.91], [0.6, 0.95]]
    (target,) = [line for line in axes.get_lines() if line not in lines]
    assert list(target.get_ydata()) == [0.9, 0.9] and target.get_linestyle() == "--"
    assert axes.get_title() == "Two runs"
    assert axes.get_xlabel() == "round (server step)"
    # One run's accuracy is the sites': the axis says either, the legend which.
    assert axes.get_ylabel() == "accuracy (server's, else the sites')"
    legend = [text.get_text() for text in axes.get_legend().get_texts()]
    assert legend[0] == "stragglers: k-async K=2 (run 1)"
    assert legend[1].replace("\n", " ") == "wine, standardised (run 2) (sites' accuracy)"
    assert legend[2] == "target 0.9"


def test_bytes_are_mebibytes_and_time_is_each_run_s_clock(ledger: str) -> None:
    (simulated,) = summaries(ledger, [1])
    axes = runs_figure([simulated], x="bytes", title="t").axes[0]
    assert list(lines_of_runs(axes)[0].get_xdata()) == pytest.approx(
        [300 / 2**20, 500 / 2**20, 800 / 2**20]
    )
    assert axes.get_xlabel() == "training bytes uploaded by the sites, cumulative (MiB)"
    axes = runs_figure([simulated], x="simulated-time", title="t").axes[0]
    assert list(lines_of_runs(axes)[0].get_xdata()) == [10.0, 25.5, 40.0]
    assert axes.get_xlabel() == "simulated time (s)"
    (wall,) = summaries(ledger, [2])
    axes = runs_figure([wall], x="simulated-time", title="t").axes[0]
    assert list(lines_of_runs(axes)[0].get_xdata()) == pytest.approx([3.0, 6.0])
    assert axes.get_xlabel() == "wall-clock training time (s)"
    assert axes.get_ylabel() == "accuracy (sites' federated evaluation)"


def test_many_runs_stay_apart_and_the_legend_clear_of_them() -> None:
    curve = [CurvePoint(r, 10.0 * r, 1000 * r, 1000 * r, 0.9, 1.0 * r) for r in range(1, 31)]
    blank: dict[str, Any] = {f.name: None for f in fields(RunSummary)}
    runs = [
        RunSummary(
            **blank
            | {"run_id": i, "name": f"identical run number {i}", "clock": "simulated"}
            | {"accuracy_metric": "accuracy", "curve": curve}
        )
        for i in range(1, 9)
    ]
    figure = runs_figure(runs, x="simulated-time", title="Eight equal curves", target=0.8)
    (axes,) = figure.axes
    lines = lines_of_runs(axes)
    assert len(lines) == 8
    # Identical curves: each has its own colour and marker, and neighbours' styles differ.
    colours = [line.get_color() for line in lines]
    markers = [line.get_marker() for line in lines]
    styles = [line.get_linestyle() for line in lines]
    assert len(set(colours)) == 8 and len(set(markers)) == 8
    assert all(a != b for a, b in zip(styles, styles[1:], strict=False))
    # Markers on different steps, so they do not sit on one another either.
    assert len({line.get_markevery() for line in lines}) > 1
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    legend = axes.get_legend().get_window_extent(renderer)
    plot_area = axes.get_window_extent(renderer)
    assert legend.x0 >= plot_area.x1  # beside the axes, never over a curve
    assert figure.bbox.contains(legend.x1 - 1, legend.y0 + 1)  # and inside the picture


def test_plot_runs_writes_a_png(ledger: str, tmp_path: Path) -> None:
    out = plot_runs(summaries(ledger, [1]), tmp_path / "plots" / "a.png", x="rounds", title="t")
    assert out == tmp_path / "plots" / "a.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_what_cannot_be_plotted_is_refused(ledger: str, tmp_path: Path) -> None:
    runs = summaries(ledger, [1, 2, 3])
    with pytest.raises(ConfigError, match="one of simulated-time, rounds, bytes, got 'time'"):
        runs_figure(runs[:1], x="time", title="t")
    with pytest.raises(ConfigError, match="run 3 recorded no accuracy"):
        runs_figure(runs, x="rounds", title="t")
    with pytest.raises(ConfigError, match="run 2 ran on the wall clock and the others on a simul"):
        runs_figure(runs[:2], x="simulated-time", title="t")
    with pytest.raises(ConfigError, match="must end in .png"):
        plot_runs(runs[:1], tmp_path / "a.jpg", x="rounds", title="t")
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="cannot write the plot to"):
        plot_runs(runs[:1], blocker / "a.png", x="rounds", title="t")
    assert not (tmp_path / "a.jpg").exists()


def test_titles_and_run_names_are_drawn_as_written(ledger: str, tmp_path: Path) -> None:
    # "$...$" would be typeset as maths (and an odd "$\bogus{" raise): they are the user's text.
    runs = summaries(ledger, [1])
    runs = [replace(runs[0], name="cost $5 vs $10 $\\bogus{")]
    figure = runs_figure(runs, x="rounds", title="a $\\bogus{ title $", target=None)
    (axes,) = figure.axes
    assert axes.title.get_parse_math() is False
    assert all(text.get_parse_math() is False for text in axes.get_legend().get_texts())
    plot_runs(runs, tmp_path / "plot.png", x="rounds", title="a $\\bogus{ title $")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
