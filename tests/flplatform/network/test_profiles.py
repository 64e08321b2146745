"""Transfer times, site profiles, networks and the presets."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flplatform.core.errors import ConfigError
from flplatform.network import (
    PRESETS,
    ComputeModel,
    Network,
    SiteProfile,
    load_network,
    random_speed,
    transfer_seconds,
)


def profile(name: str = "a", **changes: object) -> SiteProfile:
    base = SiteProfile(
        name=name,
        rtt_seconds=0.1,
        uplink_bps=8e6,
        downlink_bps=80e6,
        compute=ComputeModel("fixed", 0.05),
    )
    return replace(base, **changes)  # type: ignore[arg-type]


# ----------------------------------------------------------------------- transfer time
def test_transfer_golden() -> None:
    # 1 MB at 8 Mbit/s is 1 s on the wire, plus half of the 100 ms round trip.
    assert transfer_seconds(1_000_000, bandwidth_bps=8e6, rtt_seconds=0.1) == pytest.approx(1.05)


def test_transfer_world_golden() -> None:
    # A 400 kB model to Tokyo (277 ms, 13 Mbit/s): 0.1385 + 3.2e6 / 13e6 s.
    tokyo = PRESETS["world"].profile_for("tokyo", 3)
    assert tokyo.download_seconds(400_000) == pytest.approx(0.1385 + 3.2 / 13)


def test_infinite_bandwidth_costs_only_latency() -> None:
    assert transfer_seconds(10**12, bandwidth_bps=math.inf, rtt_seconds=0.2) == 0.1


def test_zero_bytes_cost_half_a_round_trip() -> None:
    assert transfer_seconds(0, bandwidth_bps=1e6, rtt_seconds=0.3) == pytest.approx(0.15)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nbytes": -1, "bandwidth_bps": 1e6, "rtt_seconds": 0.1}, "nbytes must be >= 0"),
        ({"nbytes": 1, "bandwidth_bps": 0.0, "rtt_seconds": 0.1}, "bandwidth_bps must be > 0"),
        ({"nbytes": 1, "bandwidth_bps": math.nan, "rtt_seconds": 0.1}, "bandwidth_bps"),
        ({"nbytes": 1, "bandwidth_bps": 1e6, "rtt_seconds": -0.1}, "rtt_seconds must be"),
        ({"nbytes": 1, "bandwidth_bps": 1e6, "rtt_seconds": math.inf}, "rtt_seconds must be"),
    ],
)
def test_transfer_rejects_bad_arguments(kwargs: dict, message: str) -> None:
    nbytes = kwargs.pop("nbytes")
    with pytest.raises(ValueError, match=message):
        transfer_seconds(nbytes, **kwargs)


@given(
    a=st.integers(0, 10**12),
    b=st.integers(0, 10**12),
    bandwidth=st.one_of(st.floats(1.0, 1e12), st.just(math.inf)),
    rtt=st.floats(0.0, 10.0),
)
def test_transfer_is_monotone_in_bytes_and_at_least_half_the_rtt(
    a: int, b: int, bandwidth: float, rtt: float
) -> None:
    small, large = sorted((a, b))
    t_small = transfer_seconds(small, bandwidth_bps=bandwidth, rtt_seconds=rtt)
    t_large = transfer_seconds(large, bandwidth_bps=bandwidth, rtt_seconds=rtt)
    assert rtt / 2 <= t_small <= t_large


@given(nbytes=st.integers(1, 10**10), bandwidth=st.floats(1.0, 1e11), rtt=st.floats(0.0, 1.0))
def test_transfer_halves_on_the_wire_when_the_bandwidth_doubles(
    nbytes: int, bandwidth: float, rtt: float
) -> None:
    slow = transfer_seconds(nbytes, bandwidth_bps=bandwidth, rtt_seconds=rtt) - rtt / 2
    fast = transfer_seconds(nbytes, bandwidth_bps=2 * bandwidth, rtt_seconds=rtt) - rtt / 2
    assert fast == pytest.approx(slow / 2, rel=1e-9)


# ------------------------------------------------------------------------ site profile
def test_upload_and_download_use_their_own_bandwidth() -> None:
    p = profile()
    assert p.upload_seconds(1_000_000) == pytest.approx(0.05 + 1.0)
    assert p.download_seconds(1_000_000) == pytest.approx(0.05 + 0.1)


def test_profile_compute_seconds_uses_its_speed() -> None:
    p = profile(speed=0.5)
    t = p.compute_seconds(steps=4, rng=np.random.default_rng(0), measured=None)
    assert t == pytest.approx(4 * 0.05 / 0.5)


def test_unresolved_random_speed_cannot_compute() -> None:
    with pytest.raises(ValueError, match="Network.profile_for"):
        profile(speed=None).compute_seconds(steps=1, rng=np.random.default_rng(0), measured=None)


def test_valid_profile_has_no_problems() -> None:
    assert profile().problems() == []
    assert profile(speed=None, uplink_bps=math.inf).problems() == []


def test_profile_problems_name_site_key_and_allowed_values() -> None:
    bad = profile(
        "a b",
        rtt_seconds=-0.005,
        uplink_bps=0.0,
        downlink_bps=math.nan,
        speed=0.0,
        availability=1.5,
        compute=ComputeModel("pareto", pareto_shape=1.0),
    )
    assert bad.problems() == [
        "site 'a b': name 'a b' is not allowed; use 1 to 64 letters, digits, '_', '.' or '-', "
        "starting with a letter or digit",
        "site 'a b': rtt_ms must be a finite number >= 0, got -5",
        "site 'a b': uplink_mbps must be > 0 (inf for no transfer cost), got 0",
        "site 'a b': downlink_mbps must be > 0 (inf for no transfer cost), got nan",
        "site 'a b': speed must be a finite number > 0 or 'random', got 0",
        "site 'a b': availability must be in (0, 1], got 1.5",
        "site 'a b': compute.pareto_shape must be a finite number > 1 (the mean is infinite "
        "otherwise), got 1",
    ]


def test_availability_zero_is_refused() -> None:
    assert profile(availability=0.0).problems() == [
        "site 'a': availability must be in (0, 1], got 0"
    ]


def test_to_dict_is_json_ready_with_human_units() -> None:
    d = profile(uplink_bps=math.inf, speed=None).to_dict()
    assert json.loads(json.dumps(d, allow_nan=False)) == d
    assert d["rtt_ms"] == 100.0
    assert d["uplink_mbps"] == "inf" and d["uplink_bps"] == "inf"
    assert d["downlink_mbps"] == 80.0
    assert d["speed"] == "random"
    assert d["compute"]["model"] == "fixed"


# ---------------------------------------------------------------------------- network
def test_network_refuses_invalid_profiles_listing_all() -> None:
    with pytest.raises(ConfigError) as info:
        Network("n", (profile("a", availability=0.0), profile("a", rtt_seconds=-1.0)))
    reason = info.value.reason
    assert reason.startswith("network 'n' has 3 problems: (1) ")
    assert "availability must be in (0, 1]" in reason
    assert "site 'a' appears more than once" in reason
    assert "rtt_ms must be a finite number >= 0" in reason


def test_network_needs_a_profile() -> None:
    with pytest.raises(ConfigError, match="needs at least one site profile"):
        Network("empty", ())


def test_profile_for_by_name_wins_over_index() -> None:
    world = PRESETS["world"]
    # "tokyo" asked for at index 0 still gets Tokyo's link, not London's.
    tokyo = world.profile_for("tokyo", 0)
    assert tokyo.name == "tokyo"
    assert tokyo.rtt_seconds == pytest.approx(0.277)
    assert tokyo.uplink_bps == 13e6


def test_profile_for_cycles_through_the_map_and_renames() -> None:
    world = PRESETS["world"]
    sites = [f"site-{i}" for i in range(8)]
    got = [world.profile_for(s, i) for i, s in enumerate(sites)]
    assert [p.name for p in got] == sites
    assert [p.rtt_seconds * 1000 for p in got] == pytest.approx([140, 35, 183, 277] * 2)
    assert got[4].uplink_bps == world.profiles[0].uplink_bps  # site 4 gets london's link


def test_profile_for_rejects_a_negative_index() -> None:
    with pytest.raises(ValueError, match="index must be >= 0"):
        PRESETS["world"].profile_for("x", -1)


def test_fixed_speeds_are_kept() -> None:
    net = Network("n", (profile(speed=0.25),), seed=3)
    assert net.profile_for("other", 5).speed == 0.25


def test_random_speeds_follow_seed_and_name_and_stay_in_range() -> None:
    world = PRESETS["world"]
    a = [load_network("world", seed=1).profile_for(f"s{i}", i).speed for i in range(200)]
    again = [load_network("world", seed=1).profile_for(f"s{i}", i).speed for i in range(200)]
    other = [load_network("world", seed=2).profile_for(f"s{i}", i).speed for i in range(200)]
    assert a == again
    assert a != other
    assert all(s is not None and 0.5 <= s <= 2.0 for s in a)
    # log2(speed) is uniform on [-1, 1]: mean near 0, both halves used.
    logs = np.log2(np.array(a, dtype=float))
    assert abs(logs.mean()) < 0.15
    assert logs.min() < -0.8 and logs.max() > 0.8
    # The speed belongs to the site name, not to the profile it was mapped onto.
    assert world.profile_for("s0", 0).speed == world.profile_for("s0", 3).speed


def test_random_speeds_are_the_same_in_another_process() -> None:
    names = ["london", "ohio", "california", "tokyo", "lab-7"]
    code = (
        "import json; from flplatform.network import random_speed; "
        f"print(json.dumps([random_speed(42, n) for n in {names!r}]))"
    )
    speeds = []
    for hashseed in ("1", "2"):  # str hashing differs between these processes
        env = {**os.environ, "PYTHONHASHSEED": hashseed}
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
        )
        speeds.append(json.loads(out.stdout))
    here = [random_speed(42, n) for n in names]
    assert speeds[0] == speeds[1] == here


def test_describe_and_to_dict() -> None:
    world = load_network("world", seed=7)
    text = world.describe()
    assert text.splitlines()[0].startswith("network 'world' (seed 7): 4 site profiles")
    assert "tokyo" in text and "277 ms" in text and "13 Mbit/s" in text
    d = world.to_dict()
    assert json.loads(json.dumps(d, allow_nan=False)) == d
    assert [p["name"] for p in d["profiles"]] == ["london", "ohio", "california", "tokyo"]


# ---------------------------------------------------------------------------- presets
EXPECTED_PRESETS: dict[str, list[tuple[str, float, float]]] = {
    # name: [(site, rtt ms, Mbit/s)]
    "world": [
        ("london", 140, 23),
        ("ohio", 35, 63),
        ("california", 183, 17),
        ("tokyo", 277, 13),
    ],
    "datacenter": [("site", 0.002, 100_000)],
    "mobile-4g": [("site", 50, 100)],
    "mobile-5g": [("site", 10, 1_000)],
}


def test_the_four_presets_exist() -> None:
    assert set(PRESETS) == set(EXPECTED_PRESETS)


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS))
def test_every_preset_loads_validates_and_matches_its_figures(name: str) -> None:
    net = load_network(name, seed=11)
    assert net.name == name and net.seed == 11
    assert net.problems() == []
    got = [(p.name, p.rtt_seconds, p.uplink_bps, p.downlink_bps) for p in net.profiles]
    want = [(s, ms / 1000, mbps * 1e6, mbps * 1e6) for s, ms, mbps in EXPECTED_PRESETS[name]]
    assert [g[0] for g in got] == [w[0] for w in want]
    for g, w in zip(got, want, strict=True):
        assert g[1:] == pytest.approx(w[1:], rel=1e-12)
    for p in net.profiles:
        assert p.compute == ComputeModel("exponential", 0.05)
        assert p.speed is None
        assert p.availability == 1.0
    # Every site a run could name resolves to a valid profile with a concrete speed.
    for i in range(6):
        resolved = net.profile_for(f"n{i}", i)
        assert resolved.problems() == []
        assert resolved.speed is not None


def test_world_round_trip_times_order_the_sites() -> None:
    # The server is in Ohio: Ohio is the nearest site, Tokyo the farthest, for any size.
    world = PRESETS["world"]
    times = {p.name: p.upload_seconds(1_000_000) for p in world.profiles}
    assert sorted(times, key=times.__getitem__) == ["ohio", "london", "california", "tokyo"]


def test_presets_cannot_be_mutated() -> None:
    with pytest.raises(TypeError):
        PRESETS["mine"] = PRESETS["world"]  # type: ignore[index]


def test_the_package_imports_neither_flower_nor_torch() -> None:
    code = (
        "import sys, flplatform.network; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('flwr', 'torch', 'ray')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
