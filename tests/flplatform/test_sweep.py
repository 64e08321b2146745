"""Sweeps: expanding lists of values into runs, what runs may share a federation, and how
the members travel to the ServerApp in one Flower run config."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flplatform.app.config import RunConfig
from flplatform.app.sweep import (
    SWEEP_KEY,
    Sweep,
    check_members,
    expand,
    expand_values,
    sweep_app_keys,
    sweep_members,
    sweep_run_config,
)
from flplatform.core.errors import ConfigError
from flplatform.engine.synchrony import SYNC_MODES

BASE = RunConfig.from_mapping({"sites": "a,b,c", "num-server-rounds": 2, "local-steps": 1})


# ===================================================================== expand
def test_expand_is_the_product_in_the_given_key_order_named_by_the_swept_values() -> None:
    sweep = expand(BASE, {"sync": ["sync", "k-async"], "seed": [1, 2], "k": [3]})
    assert [(m.sync, m.seed, m.k) for m in sweep.members] == [
        ("sync", 1, 3),
        ("sync", 2, 3),
        ("k-async", 1, 3),
        ("k-async", 2, 3),
    ]
    # Only the keys listed with several values name a member; the base name leads.
    assert [m.name for m in sweep.members] == [
        "local-sgd-digits sync=sync seed=1",
        "local-sgd-digits sync=sync seed=2",
        "local-sgd-digits sync=k-async seed=1",
        "local-sgd-digits sync=k-async seed=2",
    ]
    assert sweep.skipped == ()
    # Everything else is the base's.
    assert all(m.sites == BASE.sites and m.num_server_rounds == 2 for m in sweep.members)


def test_a_given_name_leads_and_a_swept_strategy_leaves_the_default_name() -> None:
    named = RunConfig.from_mapping({**BASE.to_run_config(), "name": "mytest"})
    sweep = expand(named, {"sync": ["k-async"], "k": [2, 3], "seed": [1]})
    assert [m.name for m in sweep.members] == ["mytest k=2", "mytest k=3"]
    sweep = expand(BASE, {"strategy": ["fedavg", "delayed"]})
    # Aliases are named by what runs.
    assert [m.name for m in sweep.members] == [
        "digits strategy=local-sgd",
        "digits strategy=delayed",
    ]


def test_a_combination_the_config_refuses_is_skipped_with_its_reason() -> None:
    sweep = expand(BASE, {"strategy": ["local-sgd", "delayed"], "sync": ["sync", "k-async"]})
    assert [(m.strategy, m.sync) for m in sweep.members] == [
        ("local-sgd", "sync"),
        ("local-sgd", "k-async"),
        ("delayed", "sync"),
    ]
    [(combination, reason)] = sweep.skipped
    assert combination == {"strategy": "delayed", "sync": "k-async"}
    assert "runs with sync mode 'sync' only" in reason


def test_k_in_a_mode_without_k_is_the_same_run_and_is_skipped() -> None:
    sweep = expand(BASE, {"sync": ["sync", "k-async"], "k": [1, 2]})
    assert [(m.sync, m.k) for m in sweep.members] == [
        ("sync", 1),
        ("k-async", 1),
        ("k-async", 2),
    ]
    [(combination, reason)] = sweep.skipped
    assert combination == {"sync": "sync", "k": 2}
    assert "the same run as 'local-sgd-digits sync=sync k=1'" in reason


@pytest.mark.parametrize(
    "values,says",
    [
        (
            {"sync": ["sync", "nosuch"]},
            "sync nosuch cannot run in any combination: unknown sync 'nosuch'; allowed: sync,",
        ),
        ({"k": [2, "x"]}, "k x cannot run in any combination: k must be an integer"),
        # Three sites: K = 4 waits for more sites than there are.
        ({"sync": ["k-async"], "k": [2, 4]}, "k 4 cannot run in any combination: k 4 is more"),
        (
            {"sync": ["nosuch", "other"]},
            "no combination of the sweep can run: unknown sync 'nosuch'",
        ),
        ({"seed": [1, 1]}, "seed lists 1 more than once"),
        ({"seed": []}, "seed lists no value"),
        ({"sites": ["a", "b"]}, "'sites' cannot be swept"),
        ({"colour": ["red"]}, "unknown option 'colour' to sweep"),
    ],
)
def test_a_sweep_that_cannot_run_as_listed_is_refused_saying_why(
    values: dict[str, list[object]], says: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        expand(BASE, values)
    assert says in raised.value.reason


def test_an_invalid_base_is_refused_in_every_combination() -> None:
    with pytest.raises(ConfigError) as raised:
        expand_values({**BASE.to_run_config(), "lr": -1}, {"seed": [0, 1]})
    assert raised.value.reason.startswith("no combination of the sweep can run: lr must be")


# Values drawn for the property below: valid and invalid ones, of the sweepable keys.
VALUES = {
    "strategy": ["local-sgd", "delayed", "fedavg", "fetchsgd", "nosuch"],
    "sync": [*SYNC_MODES, "nosuch"],
    "k": [1, 2, 3, 4, 0],
    "seed": [0, 1, 7],
    "codec": ["none", "int8", "topk:0.1", "bogus"],
    "delay": [0, 1, 2],
}


@st.composite
def value_lists(draw: st.DrawFn) -> dict[str, list[object]]:
    keys = draw(st.lists(st.sampled_from(list(VALUES)), min_size=1, max_size=3, unique=True))
    return {
        key: draw(st.lists(st.sampled_from(VALUES[key]), min_size=1, max_size=3, unique=True))
        for key in keys
    }


@settings(max_examples=60, deadline=None)
@given(value_lists())
def test_every_combination_is_a_valid_member_or_skipped_with_a_reason(
    values: dict[str, list[object]],
) -> None:
    try:
        sweep = expand(BASE, values)
    except ConfigError as exc:
        # Refused only when no combination runs or a listed value is in none.
        assert "no combination" in exc.reason or "cannot run in any combination" in exc.reason
        return
    combinations = list(itertools.product(*values.values()))
    assert len(sweep.members) + len(sweep.skipped) == len(combinations)
    for member in sweep.members:
        assert RunConfig.from_mapping(member.to_run_config()) == member  # valid as it is
        assert member.sites == BASE.sites
    assert len({m.name for m in sweep.members}) == len(sweep.members)
    for combination, reason in sweep.skipped:
        assert set(combination) == set(values) and reason
    # The members, in order, are the combinations that were not skipped.
    kept = [c for c in combinations if dict(zip(values, c, strict=True)) not in _skipped(sweep)]
    for member, combination in zip(sweep.members, kept, strict=True):
        canonical = RunConfig.from_mapping(
            {**BASE.to_run_config(), **dict(zip(values, combination, strict=True))}
        ).to_run_config()
        assert all(member.to_run_config()[key] == canonical[key] for key in values)


def _skipped(sweep: Sweep) -> list[dict[str, object]]:
    return [combination for combination, _ in sweep.skipped]


# ============================================================== check_members
def test_members_must_share_their_sites_and_ledger_and_have_unique_names() -> None:
    one = RunConfig.from_mapping({**BASE.to_run_config(), "name": "one"})
    other_sites = RunConfig.from_mapping({**BASE.to_run_config(), "sites": "a,b", "name": "x"})
    other_ledger = RunConfig.from_mapping({**BASE.to_run_config(), "db": "sqlite:///x.db"})
    with pytest.raises(ConfigError) as raised:
        check_members([one, other_sites, other_ledger, one])
    reason = raised.value.reason
    assert "run 'x' has sites a,b, run 'one' a,b,c: the runs of a sweep share their sites" in reason
    assert "run 'local-sgd-digits' is recorded in another ledger" in reason
    assert "run names must be unique in a sweep; repeated: one" in reason
    with pytest.raises(ConfigError, match="a sweep needs at least one run"):
        check_members([])


def test_members_may_differ_in_anything_but_sites_and_ledger() -> None:
    mnist = RunConfig.from_mapping(
        {**BASE.to_run_config(), "dataset": "mnist5k", "model": "cnn", "num-server-rounds": 5}
    )
    check_members([BASE, RunConfig.from_mapping({**mnist.to_run_config(), "name": "cnn"})])


# ============================================================ the Flower run config
def _tagged(members: tuple[RunConfig, ...]) -> list[RunConfig]:
    return [
        RunConfig.from_mapping({**m.to_run_config(), "run-tag": f"tag-{i}"})
        for i, m in enumerate(members)
    ]


def test_members_travel_as_the_first_ones_options_and_each_ones_differences() -> None:
    members = _tagged(expand(BASE, {"sync": ["sync", "k-async"], "lr": [0.1, 0.05]}).members)
    run_config = sweep_run_config(members)
    # The run config is the first member's (Flower checks its keys), with the list.
    assert {**run_config, SWEEP_KEY: ""} == members[0].to_run_config()
    listed = json.loads(str(run_config[SWEEP_KEY]))
    assert listed[0] == {"run-tag": "tag-0", "name": members[0].name}
    assert listed[3] == {
        "sync": "k-async",
        "lr": 0.05,
        "run-tag": "tag-3",
        "name": members[3].name,
    }
    assert sweep_members(run_config) == members
    # A single run's config holds no sweep.
    assert sweep_members(BASE.to_run_config()) == []


@settings(max_examples=30, deadline=None)
@given(value_lists())
def test_any_sweep_reads_back_as_its_members(values: dict[str, list[object]]) -> None:
    try:
        members = _tagged(expand(BASE, values).members)
    except ConfigError:
        return
    assert sweep_members(sweep_run_config(members)) == members


def test_the_app_own_keys_stay_beside_a_sweep() -> None:
    members = _tagged(expand(BASE, {"seed": [1, 2]}).members)
    run_config = {**sweep_run_config(members), "learning-rate": 0.3}
    assert sweep_members(run_config) == members
    assert sweep_app_keys(run_config) == [{}, {}]
    # Each member's own values of the app's keys, beside its options.
    listed = json.loads(str(run_config[SWEEP_KEY]))
    listed[1]["attack.kind"] = "huge"
    own = {**run_config, SWEEP_KEY: json.dumps(listed)}
    assert sweep_members(own) == members
    assert sweep_app_keys(own) == [{}, {"attack.kind": "huge"}]
    assert sweep_app_keys(BASE.to_run_config()) == []


@pytest.mark.parametrize(
    "text,says",
    [
        ("[{", "must be a JSON list of each run's options; it is not JSON"),
        ('{"seed": 1}', "must be a JSON list of objects"),
        ('[{"seed": "x"}]', "seed must be an integer"),
        ('[{}, {"attack.kind": ["huge"]}]', "run 2's 'attack.kind' is list; a run-config value"),
    ],
)
def test_a_malformed_sweep_is_a_config_error(text: str, says: str) -> None:
    with pytest.raises(ConfigError) as raised:
        sweep_members({**BASE.to_run_config(), SWEEP_KEY: text})
    assert says in raised.value.reason
