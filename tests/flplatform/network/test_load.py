"""Loading networks: presets, TOML files, overrides, and every way a file can be wrong."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flplatform.core.errors import ConfigError
from flplatform.network import (
    PRESETS,
    ComputeModel,
    Network,
    SiteProfile,
    load_network,
)

DATA = Path(__file__).parent / "data"
EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "networks"


def write(tmp_path: Path, text: str, name: str = "net.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def problems_of(spec: str, **kwargs: object) -> list[str]:
    """The numbered problems of one ConfigError, without their numbers."""
    with pytest.raises(ConfigError) as info:
        load_network(spec, **kwargs)  # type: ignore[arg-type]
    reason = info.value.reason
    assert "\n" not in reason  # one line, for the CLI
    return re.split(r"; \(\d+\) ", reason.split(": (1) ", 1)[1])


MINIMAL = """
[sites.a]
rtt_ms = 10
uplink_mbps = 1
downlink_mbps = 2
"""


# ------------------------------------------------------------------------ golden file
GOLDEN_SHIFTED = ComputeModel("shifted-exponential", mean_seconds=0.05, shift_seconds=0.02)
GOLDEN = (
    SiteProfile("london", 0.14, 23e6, 50e6, GOLDEN_SHIFTED, speed=None, availability=0.75),
    SiteProfile(
        "tokyo",
        0.277,
        20e6,
        math.inf,
        # Compute tables merge key by key: the default shift is kept (unused by pareto).
        ComputeModel("pareto", mean_seconds=0.05, shift_seconds=0.02, pareto_shape=2.5),
        speed=0.5,
        availability=1.0,
    ),
    SiteProfile(
        "lab.7",
        0.1,
        20e6,
        50e6,
        ComputeModel("shifted-exponential", mean_seconds=0.1, shift_seconds=0.02),
        speed=None,
        availability=0.75,
    ),
)


def test_golden_file_merges_defaults_key_by_key() -> None:
    net = load_network(str(DATA / "golden.toml"), seed=4)
    assert net.name == "golden" and net.seed == 4
    assert net.profiles == GOLDEN


def test_golden_file_round_trips_through_to_toml(tmp_path: Path) -> None:
    net = load_network(str(DATA / "golden.toml"), seed=4)
    again = load_network(write(tmp_path, net.to_toml()), seed=4)
    assert again == net


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_round_trip_through_to_toml(tmp_path: Path, preset: str) -> None:
    net = load_network(preset, seed=2)
    assert load_network(write(tmp_path, net.to_toml()), seed=2) == net


@settings(max_examples=50, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rtt_ms=st.decimals(0, 10_000, places=4).map(float),
    up_mbps=st.one_of(st.decimals("0.001", 1e6, places=3).map(float), st.just(math.inf)),
    down_mbps=st.decimals("0.001", 1e6, places=3).map(float),
    speed=st.one_of(st.none(), st.floats(0.01, 100.0)),
    availability=st.floats(0.01, 1.0),
    kind=st.sampled_from(["fixed", "exponential", "shifted-exponential", "pareto", "measured"]),
)
def test_any_valid_profile_round_trips_through_to_toml(
    tmp_path: Path,
    rtt_ms: float,
    up_mbps: float,
    down_mbps: float,
    speed: float | None,
    availability: float,
    kind: str,
) -> None:
    # Values as a user writes them (a few decimals) come back exactly.
    site = SiteProfile(
        "s",
        rtt_ms / 1000,
        up_mbps * 1e6,
        down_mbps * 1e6,
        ComputeModel(kind, mean_seconds=0.05, shift_seconds=0.01, pareto_shape=2.0),
        speed=speed,
        availability=availability,
    )
    net = load_network(write(tmp_path, Network("n", (site,)).to_toml()))
    assert net.profiles == (site,)


def test_name_defaults_to_the_file_stem(tmp_path: Path) -> None:
    net = load_network(write(tmp_path, MINIMAL, "my-lab.toml"))
    assert net.name == "my-lab"
    (site,) = net.profiles
    assert site == SiteProfile("a", 0.01, 1e6, 2e6, ComputeModel(), speed=1.0, availability=1.0)


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.toml")))
def test_example_files_load(name: str) -> None:
    net = load_network(str(EXAMPLES / name))
    assert net.problems() == []


def test_the_straggler_example_has_a_pareto_site_and_a_partial_one() -> None:
    net = load_network(str(EXAMPLES / "world-with-straggler.toml"))
    tokyo = net.profile_for("tokyo", 0)
    assert tokyo.compute.kind == "pareto" and tokyo.availability == 0.9
    assert [p.compute.kind for p in net.profiles].count("pareto") == 1


# ------------------------------------------------------------------------ overrides
def test_overrides_replace_every_sites_compute() -> None:
    net = load_network(str(DATA / "golden.toml"), compute_model="fixed", step_seconds=0.2)
    assert {p.compute.kind for p in net.profiles} == {"fixed"}
    assert {p.compute.mean_seconds for p in net.profiles} == {0.2}


def test_overrides_apply_to_presets() -> None:
    net = load_network("world", compute_model="pareto", step_seconds=0.5)
    assert all(p.compute == ComputeModel("pareto", 0.5) for p in net.profiles)
    assert load_network("world", step_seconds=0.0) == PRESETS["world"]  # 0 keeps them


def test_an_override_that_breaks_a_shift_is_reported() -> None:
    # The default shift of 0.02 s is not below the new mean of 0.01 s.
    problems = problems_of(str(DATA / "golden.toml"), step_seconds=0.01)
    assert problems == [
        "sites 'london', 'lab.7': compute.shift_seconds must be < mean_seconds (0.01) for "
        "model 'shifted-exponential', got 0.02 (from [defaults])"
    ]


def test_shifted_override_on_a_preset_is_valid() -> None:
    net = load_network("mobile-4g", compute_model="shifted-exponential")
    assert net.profiles[0].compute.kind == "shifted-exponential"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"compute_model": "gamma"}, "unknown compute model 'gamma'; allowed: fixed, "),
        ({"step_seconds": -1.0}, "step seconds must be a finite number > 0"),
        ({"step_seconds": math.nan}, "step seconds must be a finite number > 0"),
        ({"seed": "1"}, "network seed must be an integer"),
    ],
)
def test_bad_overrides(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_network("world", **kwargs)


# --------------------------------------------------------------------- finding the spec
def test_unknown_preset_names_the_presets() -> None:
    with pytest.raises(ConfigError) as info:
        load_network("wrold")
    assert info.value.reason == (
        "unknown network preset 'wrold'; allowed presets: world, datacenter, mobile-4g, "
        "mobile-5g, or a path to a .toml file"
    )


def test_missing_file(tmp_path: Path) -> None:
    spec = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match=r"network file '.*nope\.toml' does not exist; .*world"):
        load_network(spec)


def test_empty_spec() -> None:
    with pytest.raises(ConfigError, match="no network given; allowed presets: world"):
        load_network("")


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read network file"):
        load_network(str(tmp_path))  # a directory


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'name = "caf\xe9"\n')
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_network(str(path))


def test_invalid_toml_names_the_line(tmp_path: Path) -> None:
    spec = write(tmp_path, "[sites.a]\nrtt_ms = 10\nuplink_mbps = = 3\n")
    with pytest.raises(ConfigError, match=r"is not valid TOML: .*line 3"):
        load_network(spec)


# ------------------------------------------------------------------ problems in a file
@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("name = 'x'\n", "needs at least one [sites.<name>] table"),
        ("sites = 3\n", "needs at least one [sites.<name>] table"),
        (
            "colour = 1\n" + MINIMAL,
            "unknown top-level key 'colour'; allowed: name, defaults, sites",
        ),
        ("name = 7\n" + MINIMAL, "name must be a non-empty string, got 7"),
        ("defaults = 1\n" + MINIMAL, "[defaults] must be a table, got 1"),
        (
            MINIMAL + "rtt = 4\n",
            "site 'a': unknown key 'rtt'; allowed: rtt_ms, uplink_mbps, downlink_mbps, "
            "speed, availability, compute",
        ),
        (
            MINIMAL.replace("rtt_ms = 10", "rtt_ms = -5"),
            "site 'a': rtt_ms must be a finite number >= 0, got -5",
        ),
        (
            MINIMAL.replace("rtt_ms = 10", "rtt_ms = inf"),
            "site 'a': rtt_ms must be a finite number >= 0, got inf",
        ),
        (
            MINIMAL.replace("uplink_mbps = 1", "uplink_mbps = 0"),
            "site 'a': uplink_mbps must be > 0 (inf for no transfer cost), got 0",
        ),
        (
            MINIMAL.replace("downlink_mbps = 2", "downlink_mbps = nan"),
            "site 'a': downlink_mbps must be > 0 (inf for no transfer cost), got nan",
        ),
        (
            MINIMAL.replace("downlink_mbps = 2", "downlink_mbps = 'inf'"),
            "site 'a': downlink_mbps must be a number (write inf unquoted for no transfer "
            "cost), got 'inf'",
        ),
        (
            MINIMAL.replace("rtt_ms = 10", "rtt_ms = '10'"),
            "site 'a': rtt_ms must be a number, got '10'",
        ),
        (MINIMAL + "availability = 0\n", "site 'a': availability must be in (0, 1], got 0"),
        (MINIMAL + "availability = 1.2\n", "site 'a': availability must be in (0, 1], got 1.2"),
        (MINIMAL + "availability = true\n", "site 'a': availability must be a number, got True"),
        (MINIMAL + "speed = 0\n", "site 'a': speed must be a finite number > 0 or 'random', got 0"),
        (
            MINIMAL + "speed = 'fast'\n",
            "site 'a': speed must be a number > 0 or 'random', got 'fast'",
        ),
        (
            MINIMAL.replace("uplink_mbps = 1\n", ""),
            "site 'a': uplink_mbps is missing; set it in [sites.a] or [defaults]",
        ),
        (
            MINIMAL + "compute = { model = 'gamma' }\n",
            "site 'a': compute.model 'gamma' is unknown; allowed: fixed, exponential, "
            "shifted-exponential, pareto, measured",
        ),
        (
            MINIMAL + "compute = { model = 'shifted-exponential', shift_seconds = 0.05 }\n",
            "site 'a': compute.shift_seconds must be < mean_seconds (0.05) for model "
            "'shifted-exponential', got 0.05",
        ),
        (
            MINIMAL + "compute = { model = 'pareto', pareto_shape = 1 }\n",
            "site 'a': compute.pareto_shape must be a finite number > 1 (the mean is infinite "
            "otherwise), got 1",
        ),
        (
            MINIMAL + "compute = { mean_seconds = 0 }\n",
            "site 'a': compute.mean_seconds must be a finite number > 0, got 0",
        ),
        (
            MINIMAL + "compute = { mean = 0.1 }\n",
            "site 'a': unknown key 'compute.mean'; allowed: model, mean_seconds, "
            "shift_seconds, pareto_shape",
        ),
        (MINIMAL + "compute = 'fast'\n", "site 'a': compute must be a table, got 'fast'"),
        (
            MINIMAL + "compute = { model = 3 }\n",
            "site 'a': compute.model must be a string, got 3",
        ),
        ("[sites]\na = 1\n", "site 'a': must be a table ([sites.a]), got 1"),
        (
            MINIMAL.replace("[sites.a]", '[sites."a b"]'),
            "site 'a b': the name is not allowed; use 1 to 64 letters, digits, '_', '.' or "
            "'-', starting with a letter or digit",
        ),
        (
            "[defaults]\nrtt = 1\n" + MINIMAL,
            "[defaults]: unknown key 'rtt'; allowed: rtt_ms, uplink_mbps, downlink_mbps, "
            "speed, availability, compute",
        ),
    ],
)
def test_each_problem_is_named(tmp_path: Path, text: str, problem: str) -> None:
    spec = write(tmp_path, text)
    assert problems_of(spec) == [problem]


def test_several_problems_are_reported_together(tmp_path: Path) -> None:
    spec = write(
        tmp_path,
        """
        colour = "blue"
        [defaults]
        uplink_mbps = 10
        downlink_mbps = 10
        availability = 0
        [defaults.compute]
        mean_seconds = "slow"
        [sites.london]
        rtt_ms = -140
        [sites.tokyo]
        rtt_ms = 277
        uplink_mbps = 0
        speed = -1
        [sites.paris]
        rtt_ms = 20
        availability = 0.5
        [sites.paris.compute]
        model = "pareto"
        pareto_shape = 0.9
        """,
    )
    with pytest.raises(ConfigError) as info:
        load_network(spec)
    reason = info.value.reason
    assert reason.startswith(f"network file '{spec}' has 7 problems: (1) ")
    assert problems_of(spec) == [
        "unknown top-level key 'colour'; allowed: name, defaults, sites",
        "[defaults]: compute.mean_seconds must be a number, got 'slow'",
        "site 'london': rtt_ms must be a finite number >= 0, got -140",
        # One inherited value, reported once for every site that inherits it.
        "sites 'london', 'tokyo': availability must be in (0, 1], got 0 (from [defaults])",
        "site 'tokyo': uplink_mbps must be > 0 (inf for no transfer cost), got 0",
        "site 'tokyo': speed must be a finite number > 0 or 'random', got -1",
        "site 'paris': compute.pareto_shape must be a finite number > 1 (the mean is "
        "infinite otherwise), got 0.9",
    ]


@pytest.mark.parametrize("key", ["rtt_ms", "uplink_mbps", "speed", "availability", "compute"])
@pytest.mark.parametrize("value", ["[1, 2]", "{ x = 1 }", "1979-05-27", "true", '"s"', "nan"])
def test_junk_of_any_toml_type_is_a_config_error(tmp_path: Path, key: str, value: str) -> None:
    lines = [line for line in MINIMAL.splitlines() if not line.startswith(key)]
    spec = write(tmp_path, "\n".join([*lines, f"{key} = {value}", ""]))
    (problem,) = problems_of(spec)
    assert problem.startswith("site 'a': ") and key in problem
