"""The cross-silo demo's panels (valid runs that share one federation) and its verdicts,
read from a hand-written ledger through ``comparison.summarize_runs``."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from flplatform.app.comparison import X_AXES, summarize_runs
from flplatform.app.config import DEFAULT_SITES, RunConfig
from flplatform.app.demo import BYTES, PANEL_KEYS, TIME, Panel, build_panels, judge, sweep_members
from flplatform.app.sweep import check_members
from flplatform.cli.demo import headline
from flplatform.core.errors import ConfigError
from storage import LedgerRepository, UpdateInput


# ================================================================ the panels
def test_every_panel_is_valid_runs_that_can_share_one_federation() -> None:
    panels = build_panels(seed=3, db="sqlite:///demo.db")
    assert [p.key for p in panels] == list(PANEL_KEYS)
    members = sweep_members(panels)
    check_members(members)  # same sites and ledger, names unique: one sweep can run them
    names = [m.run_name for m in members]
    assert len(set(names)) == len(names) == 13
    for panel in panels:
        assert panel.x in X_AXES and panel.measure in (TIME, BYTES)
        assert 0 < panel.target <= 1
        assert [m.run_name for m in panel.members].count(panel.reference) == 1
        for member in panel.members:
            assert member.run_name.startswith(f"{panel.key}: ")
            # Each one a RunConfig as the ServerApp reads it back: validated, round-tripped.
            assert RunConfig.from_mapping(member.to_run_config()) == member
            assert (member.sites, member.seed, member.db) == (
                DEFAULT_SITES,
                3,
                "sqlite:///demo.db",
            )
            assert (member.dataset, member.partition, member.alpha) == ("digits", "dirichlet", 1.0)


def test_each_panel_compares_what_its_title_says() -> None:
    stragglers, delayed, compression = build_panels()
    # Equal site updates: 12 rounds of all 4 sites, 24 steps of K = 2.
    assert [(m.sync, m.k, m.num_server_rounds) for m in stragglers.members] == [
        ("sync", 0, 12),  # K not set: sync waits for every site
        ("k-sync", 2, 24),
        ("k-async", 2, 24),
        ("buffered", 2, 24),
    ]
    assert {m.network for m in stragglers.members} == {"world"}
    # Communication dominates: fast fixed compute on the world links, the wide MLP.
    assert {(m.network, m.compute_model, m.step_seconds, m.model) for m in delayed.members} == {
        ("world", "fixed", 0.01, "wide-mlp")
    }
    sgd, local, dts, dts_top_k = delayed.members
    assert (sgd.strategy, sgd.local_steps, sgd.server_momentum) == ("local-sgd", 1, 0.9)
    assert (local.strategy, local.local_steps) == ("local-sgd", 10)
    assert (dts.strategy, dts.delay, dts.codec) == ("delayed", 2, "none")
    assert (dts_top_k.strategy, dts_top_k.delay, dts_top_k.codec) == ("delayed", 2, "topk:0.1")
    assert [(m.strategy, m.codec, m.num_server_rounds) for m in compression.members] == [
        ("local-sgd", "none", 8),
        ("local-sgd", "topk:0.01", 16),
        ("local-sgd", "int8", 16),
        ("fetchsgd", "none", 16),
        ("sketched-sgd", "none", 32),  # two rounds per step
    ]
    assert {m.model for m in compression.members} == {"wide-mlp"}


def test_panels_can_be_chosen_and_their_rounds_capped() -> None:
    (delayed,) = build_panels(keys=("delayed",), max_rounds=3)
    assert [m.num_server_rounds for m in delayed.members] == [3, 3, 3, 3]
    # The demo's order, whatever the order asked for.
    assert [p.key for p in build_panels(keys=("compression", "stragglers"))] == [
        "stragglers",
        "compression",
    ]


@pytest.mark.parametrize(
    ("keys", "max_rounds", "expected"),
    [
        (("bogus",), None, "unknown panel 'bogus'; allowed: stragglers, delayed, compression"),
        ((), None, "choose at least one panel: stragglers, delayed, compression"),
        (("delayed", "delayed"), None, "a panel is listed twice: delayed, delayed"),
        (("delayed",), 0, "max-rounds must be an integer >= 1, got 0"),
        (("x",), -1, "2 problems: unknown panel 'x'"),
    ],
)
def test_what_cannot_be_built_is_refused(
    keys: Sequence[str], max_rounds: int | None, expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(")):
        build_panels(keys=keys, max_rounds=max_rounds)


# ================================================================ verdicts from a ledger
def write_run(
    repo: LedgerRepository,
    name: str,
    curve: Sequence[tuple[float, int, float]],
) -> int:
    """A finished run named ``name``; ``curve``: (simulated end, bytes up, accuracy) per step."""
    t0 = time.time() - 1000
    run_id = repo.create_run(
        name=name, strategy="local-sgd", seed=0, config={}, num_rounds_planned=len(curve)
    )
    repo.add_site(run_id, name="london", node_id=1)
    for step, (simulated, bytes_up, accuracy) in enumerate(curve, start=1):
        repo.record_round(
            run_id,
            round=step,
            model_version=step,
            started_at=t0 + step,
            finished_at=t0 + step + 0.5,
            metrics={"accuracy": accuracy},
            train_loss=0.5,
            virtual_started_at=simulated - 0.1,
            virtual_finished_at=simulated,
            updates=[
                UpdateInput(
                    site="london",
                    dispatched_round=step,
                    version_trained_on=step - 1,
                    staleness=0,
                    bytes_up=bytes_up,
                    bytes_down=10,
                    status="applied",
                    dispatched_at=t0 + step,
                    arrived_at=t0 + step + 0.4,
                )
            ],
        )
    repo.finish_run(run_id, status="finished", simulated_seconds=curve[-1][0])
    return run_id


def verdict_of(panel: Panel, curves: Sequence[Sequence[tuple[float, int, float]]], db: str):
    with LedgerRepository.open(db) as repo:
        ids = [write_run(repo, m.run_name, c) for m, c in zip(panel.members, curves, strict=True)]
        return judge(panel, summarize_runs(repo, ids, target=panel.target)), ids


def test_a_time_panel_ranks_runs_by_simulated_seconds_to_its_target(sqlite_ledger: str) -> None:
    (delayed,) = build_panels(keys=("delayed",))
    assert delayed.target == 0.92
    verdict, ids = verdict_of(
        delayed,
        [
            [(1.0, 5, 0.5), (2.0, 5, 0.8), (3.0, 5, 0.91)],  # sync SGD: never reaches 0.92
            [(1.0, 5, 0.7), (4.0, 5, 0.93)],  # local-SGD, the reference: 4 s
            [(0.5, 5, 0.6), (2.0, 5, 0.95), (2.5, 5, 0.99)],  # DTS: 2 s
            [(1.6, 5, 0.92), (1.8, 5, 0.5)],  # DTS + top-k: 1.6 s (exactly the target)
        ],
        sqlite_ledger,
    )
    sgd, local, dts, dts_top_k = verdict.rows
    assert [r.run_id for r in verdict.rows] == ids
    assert (sgd.cost, sgd.versus_reference, sgd.budget) == (None, None, 3.0)
    assert (local.cost, local.versus_reference) == (4.0, 1.0)
    assert (dts.cost, dts.versus_reference, dts.final_accuracy, dts.best_accuracy) == (
        2.0,
        2.0,
        0.99,
        0.99,
    )
    assert (dts_top_k.cost, dts_top_k.versus_reference, dts_top_k.rounds) == (1.6, 2.5, 2)
    assert verdict.winner is dts_top_k and verdict.reference is local
    assert verdict.factor == pytest.approx(2.5)
    assert verdict.not_reached == (sgd,)
    assert headline(verdict).startswith(
        "DTS D=2 + top-k 10% reached 92% first (1.6 s), 2.5× sooner than "
        "local-SGD, 10 steps/round (4.0 s); not reached: sync SGD, 1 step/round (3.0 s in all)."
    )


def test_a_bytes_panel_counts_upload_bytes_up_to_the_first_step_at_its_target(
    sqlite_ledger: str,
) -> None:
    (compression,) = build_panels(keys=("compression",))
    verdict, _ = verdict_of(
        compression,
        [
            [(1.0, 1000, 0.5), (2.0, 1000, 0.89), (3.0, 1000, 0.9)],  # reference: 3000 bytes
            [(1.0, 100, 0.5), (2.0, 100, 0.95), (3.0, 100, 0.95)],  # top-k: 200
            [(1.0, 250, 0.91)],  # int8: 250
            [(1.0, 50, 0.2), (2.0, 50, 0.3)],  # FetchSGD: not reached
            [(1.0, 3000, 0.9)],  # Sketched-SGD: as much as the reference
        ],
        sqlite_ledger,
    )
    assert [r.cost for r in verdict.rows] == [3000.0, 200.0, 250.0, None, 3000.0]
    assert [r.versus_reference for r in verdict.rows] == [1.0, 15.0, 12.0, None, 1.0]
    assert [r.budget for r in verdict.rows] == [3000.0, 300.0, 250.0, 100.0, 3000.0]
    assert verdict.winner is verdict.rows[1] and verdict.factor == 15.0
    assert headline(verdict).startswith(
        "top-k 1% reached 90% first (200 B), 15.0× fewer bytes than local-SGD, "
        "uncompressed (2.9 KiB); not reached: FetchSGD k=2000 3x1000 (100 B in all)."
    )


def test_a_reference_that_wins_or_misses_the_target_is_said_as_it_is(sqlite_ledger: str) -> None:
    (stragglers,) = build_panels(keys=("stragglers",))
    db = sqlite_ledger
    won, _ = verdict_of(
        stragglers,
        [[(1.0, 5, 0.95)], [(2.0, 5, 0.95)], [(1.0, 5, 0.95)], [(3.0, 5, 0.5)]],
        db,
    )
    assert won.winner is won.reference and won.factor is None  # a tie goes to the reference
    assert headline(won).startswith("sync reached 90% first (1.0 s): no other method beat it here")
    missed, _ = verdict_of(
        stragglers,
        [[(5.0, 5, 0.5)], [(2.0, 5, 0.95)], [(1.0, 5, 0.5)], [(3.0, 5, 0.5)]],
        db,
    )
    assert missed.winner is missed.rows[1] and missed.factor is None
    assert headline(missed).startswith(
        "k-sync K=2 reached 90% first (2.0 s); sync did not reach it (5.0 s in all)"
    )


def test_summaries_read_at_another_target_or_without_the_reference_are_refused(
    sqlite_ledger: str,
) -> None:
    (stragglers,) = build_panels(keys=("stragglers",))
    with LedgerRepository.open(sqlite_ledger) as repo:
        ids = [write_run(repo, m.run_name, [(1.0, 5, 0.95)]) for m in stragglers.members]
        with pytest.raises(ConfigError, match="summarised at another target than 0.9"):
            judge(stragglers, summarize_runs(repo, ids, target=0.5))
        with pytest.raises(ConfigError, match="reference run 'stragglers: sync' is missing"):
            judge(stragglers, summarize_runs(repo, ids[1:], target=0.9))
