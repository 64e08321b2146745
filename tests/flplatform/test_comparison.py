"""Plans of the cross-silo comparison: equal site updates, and the optional rows."""

from __future__ import annotations

import pytest

from flplatform.comparison import DEMO_MODES, plan_modes
from flplatform.config import RunConfig
from flplatform.errors import ConfigError


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
