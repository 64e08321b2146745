"""Site network profiles, the built-in presets, and user profiles in TOML.

A :class:`SiteProfile` says how far a site is from the server (round-trip latency, uplink
and downlink bandwidth), how fast it computes (a :class:`ComputeModel` and a relative
speed) and how often it takes part (availability). A :class:`Network` is a named list of
profiles that the virtual clock maps onto the run's sites: by name where a profile has the
site's name, otherwise in turn. A message of ``B`` bytes over a link of bandwidth ``b``
bit/s and round-trip latency ``L`` s takes ``L/2 + 8B/b`` seconds.

This module imports neither Flower nor torch.

Presets
-------
=============  =======================================================================
``world``      london 140 ms/23 Mbit/s, ohio 35 ms/63 Mbit/s, california 183 ms/17 Mbit/s,
               tokyo 277 ms/13 Mbit/s (server in Ohio)
``datacenter`` one template: 0.002 ms, 100 Gbit/s (InfiniBand-like)
``mobile-4g``  one template: 50 ms, 100 Mbit/s
``mobile-5g``  one template: 10 ms, 1 Gbit/s
=============  =======================================================================

Every preset computes with an exponential model of mean 0.05 s per local step, gives each
site a seeded random speed (log-uniform in [0.5, 2]) and availability 1.

TOML format
-----------
::

    name = "two-labs"            # optional; default: the file's stem
    [defaults]                   # optional; any site key
    rtt_ms = 100.0               # round-trip latency, finite, >= 0
    uplink_mbps = 20.0           # site -> server, Mbit/s (10^6 bit/s), > 0; inf: free
    downlink_mbps = 50.0         # server -> site, Mbit/s, > 0; inf: free
    speed = 1.0                  # relative speed > 0 (2 = twice as fast), or "random"
    availability = 1.0           # chance the site takes part when offered work, (0, 1]
    [defaults.compute]
    model = "shifted-exponential"  # fixed | exponential | shifted-exponential | pareto | measured
    mean_seconds = 0.05          # mean seconds per local step, > 0
    shift_seconds = 0.02         # shifted-exponential: the least time, 0 <= shift < mean
    pareto_shape = 3.0           # pareto: tail index > 1
    [sites.london]               # at least one site
    rtt_ms = 140
    uplink_mbps = 23
    [sites.tokyo]
    rtt_ms = 277
    speed = 0.5
    [sites.tokyo.compute]
    model = "pareto"

A site's keys override ``[defaults]``; compute tables merge key by key. ``rtt_ms``,
``uplink_mbps`` and ``downlink_mbps`` must be given (per site or in ``[defaults]``);
``speed`` defaults to 1, ``availability`` to 1 and the compute model to exponential with
mean 0.05 s. Site names match ``^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$``. Every problem in a
file (unknown keys, wrong types, out-of-range values) is reported in one ``ConfigError``.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from flplatform.errors import ConfigError
from flplatform.network._values import fmt, is_number
from flplatform.network.compute import COMPUTE_MODELS, ComputeModel
from flplatform.network.compute import compute_seconds as _compute_seconds
from flplatform.seeding import rng_for

SITE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
RANDOM_SPEED = "random"  # the TOML (and to_dict) spelling of speed=None
# Seeded random speeds are 2**u with u ~ U(-1, 1): a site is as likely to be twice as slow
# as twice as fast, and the geometric mean speed is 1.
SPEED_RANGE = (0.5, 2.0)

TOP_KEYS = ("name", "defaults", "sites")
SITE_KEYS = ("rtt_ms", "uplink_mbps", "downlink_mbps", "speed", "availability", "compute")
COMPUTE_KEYS = ("model", "mean_seconds", "shift_seconds", "pareto_shape")
REQUIRED_SITE_KEYS = ("rtt_ms", "uplink_mbps", "downlink_mbps")


def transfer_seconds(nbytes: int, *, bandwidth_bps: float, rtt_seconds: float) -> float:
    """Return the seconds one message of ``nbytes`` bytes takes over a link.

    ``rtt_seconds / 2 + 8 * nbytes / bandwidth_bps``: half a round trip of latency plus the
    serialization time. An infinite bandwidth costs only the latency.

    Raises
    ------
    ValueError
        If ``nbytes < 0``, the bandwidth is not > 0, or the RTT is not finite and >= 0.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if not bandwidth_bps > 0:  # also rejects NaN
        raise ValueError(
            f"bandwidth_bps must be > 0 (inf for no transfer cost), got {bandwidth_bps}"
        )
    if not (math.isfinite(rtt_seconds) and rtt_seconds >= 0):
        raise ValueError(f"rtt_seconds must be a finite number >= 0, got {rtt_seconds}")
    if math.isinf(bandwidth_bps):
        return rtt_seconds / 2.0
    return rtt_seconds / 2.0 + 8.0 * nbytes / bandwidth_bps


def random_speed(seed: int, site_name: str) -> float:
    """Return the seeded random relative speed of ``site_name``, log-uniform in [0.5, 2].

    It depends only on ``(seed, site_name)`` (see :func:`flplatform.seeding.rng_for`), so
    every process of a run, and a resumed run, gives a site the same speed.
    """
    u = float(rng_for(seed, "speed", site_name).uniform(-1.0, 1.0))
    return min(max(2.0**u, SPEED_RANGE[0]), SPEED_RANGE[1])


# Unit conversions in one place, so presets and files give bit-identical floats.
def _ms_to_seconds(ms: float) -> float:
    return ms / 1000.0


def _mbps_to_bps(mbps: float) -> float:
    return mbps * 1e6


def _human(value: float) -> float:
    # 127.535 ms / 1000 * 1000 is 127.53500000000001; 12 significant digits undo that, so
    # files, JSON and to_toml() show (and reload) the value that was written.
    return value if math.isinf(value) else float(f"{value:.12g}")


def _json_rate(bps: float) -> float | str:
    # JSON has no infinity; "inf" is unambiguous where None would read as "unset".
    return "inf" if math.isinf(bps) else _human(bps / 1e6)


@dataclass(frozen=True)
class SiteProfile:
    """One site's link to the server and its compute behaviour.

    Constructing a profile does not validate it; :meth:`problems` lists what is wrong and
    :class:`Network` refuses invalid profiles.

    Parameters
    ----------
    name : str
        Site name, ``^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$``.
    rtt_seconds : float
        Round-trip latency to the server, finite and >= 0.
    uplink_bps, downlink_bps : float
        Bandwidth site -> server and server -> site in bit/s, > 0; ``math.inf`` is free.
    compute : ComputeModel
        Seconds per local step before the speed factor.
    speed : float or None
        Relative speed (> 0; 2 computes twice as fast). ``None`` means a seeded random
        speed, resolved per site by :meth:`Network.profile_for`.
    availability : float
        Chance the site takes part when offered work, in (0, 1].
    """

    name: str
    rtt_seconds: float
    uplink_bps: float
    downlink_bps: float
    compute: ComputeModel
    speed: float | None = 1.0
    availability: float = 1.0

    # ------------------------------------------------------------------ timing
    def upload_seconds(self, nbytes: int) -> float:
        """Seconds to send ``nbytes`` from the site to the server."""
        return transfer_seconds(nbytes, bandwidth_bps=self.uplink_bps, rtt_seconds=self.rtt_seconds)

    def download_seconds(self, nbytes: int) -> float:
        """Seconds to send ``nbytes`` from the server to the site."""
        return transfer_seconds(
            nbytes, bandwidth_bps=self.downlink_bps, rtt_seconds=self.rtt_seconds
        )

    def compute_seconds(
        self, *, steps: int, rng: np.random.Generator, measured: float | None
    ) -> float | None:
        """Simulated compute time of one update; see :func:`compute.compute_seconds`.

        Raises
        ------
        ValueError
            If the speed is still ``None``: take the profile from :meth:`Network.profile_for`.
        """
        if self.speed is None:
            raise ValueError(
                f"site {self.name!r} has an unresolved random speed; "
                "take its profile from Network.profile_for"
            )
        return _compute_seconds(
            self.compute, steps=steps, speed=self.speed, rng=rng, measured=measured
        )

    # --------------------------------------------------------------- validation
    def keyed_problems(self) -> list[tuple[str, str]]:
        """Return every problem as ``(key, message)`` with the TOML keys.

        Keys are ``name``, ``rtt_ms``, ``uplink_mbps``, ``downlink_mbps``, ``speed``,
        ``availability`` and ``compute.<key>``; values in messages use the TOML units.
        """
        out: list[tuple[str, str]] = []
        if not (isinstance(self.name, str) and SITE_NAME.match(self.name)):
            out.append(
                (
                    "name",
                    f"{fmt(self.name)} is not allowed; use 1 to 64 letters, digits, '_', '.' "
                    "or '-', starting with a letter or digit",
                )
            )
        rtt = self.rtt_seconds
        if not (is_number(rtt) and math.isfinite(rtt) and rtt >= 0):
            shown = fmt(rtt * 1000.0) if is_number(rtt) else fmt(rtt)
            out.append(("rtt_ms", f"must be a finite number >= 0, got {shown}"))
        for key, bps in (("uplink_mbps", self.uplink_bps), ("downlink_mbps", self.downlink_bps)):
            if not (is_number(bps) and bps > 0):  # NaN fails too
                shown = fmt(bps / 1e6) if is_number(bps) else fmt(bps)
                out.append((key, f"must be > 0 (inf for no transfer cost), got {shown}"))
        speed = self.speed
        if speed is not None and not (is_number(speed) and math.isfinite(speed) and speed > 0):
            out.append(
                ("speed", f"must be a finite number > 0 or {RANDOM_SPEED!r}, got {fmt(speed)}")
            )
        avail = self.availability
        if not (is_number(avail) and 0.0 < avail <= 1.0):
            out.append(("availability", f"must be in (0, 1], got {fmt(avail)}"))
        if isinstance(self.compute, ComputeModel):
            out.extend((f"compute.{key}", msg) for key, msg in self.compute.keyed_problems())
        else:
            out.append(("compute", f"must be a ComputeModel, got {fmt(self.compute)}"))
        return out

    def problems(self) -> list[str]:
        """Return one message per invalid field, naming the site, the key and what is allowed."""
        return [f"site {fmt(self.name)}: {key} {msg}" for key, msg in self.keyed_problems()]

    # ---------------------------------------------------------------- rendering
    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict in SI units and in the TOML's human units.

        Infinite bandwidths are the string ``"inf"``; a random speed is ``"random"``.
        """
        return {
            "name": self.name,
            "rtt_seconds": self.rtt_seconds,
            "rtt_ms": _human(self.rtt_seconds * 1000.0),
            "uplink_bps": "inf" if math.isinf(self.uplink_bps) else self.uplink_bps,
            "downlink_bps": "inf" if math.isinf(self.downlink_bps) else self.downlink_bps,
            "uplink_mbps": _json_rate(self.uplink_bps),
            "downlink_mbps": _json_rate(self.downlink_bps),
            "speed": RANDOM_SPEED if self.speed is None else self.speed,
            "availability": self.availability,
            "compute": self.compute.to_dict(),
        }

    def describe(self) -> str:
        """Return one human-readable line for this profile."""
        speed = RANDOM_SPEED if self.speed is None else f"{self.speed:.3g}x"
        return (
            f"{self.name:<12} rtt {fmt(_human(self.rtt_seconds * 1000.0))} ms, "
            f"up {_rate(self.uplink_bps)}, down {_rate(self.downlink_bps)}, "
            f"compute {self.compute.describe()}, speed {speed}, "
            f"availability {fmt(self.availability)}"
        )


def _rate(bps: float) -> str:
    if math.isinf(bps):
        return "unlimited"
    if bps >= 1e9:
        return f"{fmt(_human(bps / 1e9))} Gbit/s"
    return f"{fmt(_human(bps / 1e6))} Mbit/s"


@dataclass(frozen=True)
class Network:
    """A named set of site profiles, assigned to a run's sites by name or in turn.

    Building a network validates it: every profile, at least one of them, unique names.

    Parameters
    ----------
    name : str
        Preset name or the file's ``name`` (default: its stem).
    profiles : tuple of SiteProfile
        In order; unnamed sites take them in turn (see :meth:`profile_for`).
    seed : int
        Seeds the random speeds of profiles whose speed is ``None``.

    Raises
    ------
    ConfigError
        Listing every problem, if the network is invalid.
    """

    name: str
    profiles: tuple[SiteProfile, ...]
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "profiles", tuple(self.profiles))
        problems = self.problems()
        if problems:
            raise ConfigError(_problem_line(f"network {fmt(self.name)}", problems))

    def problems(self) -> list[str]:
        """Return every problem of the network and its profiles; [] if valid."""
        out: list[str] = []
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            out.append(f"seed must be an integer, got {fmt(self.seed)}")
        if not self.profiles:
            out.append("needs at least one site profile")
        seen: set[str] = set()
        for profile in self.profiles:
            if not isinstance(profile, SiteProfile):
                out.append(f"profiles must be SiteProfile objects, got {fmt(profile)}")
                continue
            if profile.name in seen:
                out.append(f"site {fmt(profile.name)} appears more than once")
            seen.add(profile.name)
            out.extend(profile.problems())
        return out

    def profile_for(self, site_name: str, index: int) -> SiteProfile:
        """Return the profile of the run's ``index``-th site, named ``site_name``.

        The profile named ``site_name`` if there is one, otherwise the profile at
        ``index % len(profiles)`` (8 sites on the 4-site ``world`` cycle through its map:
        site 4 gets london's link), renamed to ``site_name``. A random speed (``None``) is
        resolved by :func:`random_speed` from ``(seed, site_name)``.

        Raises
        ------
        ValueError
            If ``index < 0``.
        """
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        named = [p for p in self.profiles if p.name == site_name]
        profile = named[0] if named else self.profiles[index % len(self.profiles)]
        if profile.name != site_name:
            profile = replace(profile, name=site_name)
        if profile.speed is None:
            profile = replace(profile, speed=random_speed(self.seed, site_name))
        return profile

    # ---------------------------------------------------------------- rendering
    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict: name, seed and each profile's :meth:`SiteProfile.to_dict`."""
        return {
            "name": self.name,
            "seed": self.seed,
            "profiles": [p.to_dict() for p in self.profiles],
        }

    def describe(self) -> str:
        """Return a few human-readable lines: the network, then one line per profile."""
        head = (
            f"network {self.name!r} (seed {self.seed}): {len(self.profiles)} site "
            f"profile{'s' if len(self.profiles) != 1 else ''}, given to sites by name, "
            "otherwise in turn"
        )
        return "\n".join([head, *(f"  {p.describe()}" for p in self.profiles)])

    def to_toml(self) -> str:
        """Return this network in the TOML format :func:`load_network` reads.

        The seed is not part of the file; pass it to :func:`load_network`.
        """
        lines = [f"name = {json.dumps(self.name)}"]
        for p in self.profiles:
            site = json.dumps(p.name)  # quoted, so names with '.' stay one key
            speed: float | str = RANDOM_SPEED if p.speed is None else p.speed
            lines += [
                "",
                f"[sites.{site}]",
                f"rtt_ms = {_toml_value(_human(p.rtt_seconds * 1000.0))}",
                f"uplink_mbps = {_toml_value(_human(p.uplink_bps / 1e6))}",
                f"downlink_mbps = {_toml_value(_human(p.downlink_bps / 1e6))}",
                f"speed = {_toml_value(speed)}",
                f"availability = {_toml_value(p.availability)}",
                "",
                f"[sites.{site}.compute]",
                *(f"{key} = {_toml_value(v)}" for key, v in p.compute.to_dict().items()),
            ]
        return "\n".join(lines) + "\n"


def _toml_value(value: float | str) -> str:
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic-string escapes
    return repr(float(value))  # repr gives 'inf', and round-trips every finite float


def _problem_line(subject: str, problems: list[str]) -> str:
    """One line listing every problem; numbered, since messages contain ';' themselves."""
    n = len(problems)
    listed = "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
    return f"{subject} has {n} problem{'s' if n != 1 else ''}: {listed}"


# ------------------------------------------------------------------------------- presets
_PRESET_COMPUTE = ComputeModel(kind="exponential", mean_seconds=0.05)


def _preset(name: str, sites: list[tuple[str, float, float]]) -> Network:
    """A preset: symmetric links, the shared compute model, random speeds, always available."""
    return Network(
        name=name,
        profiles=tuple(
            SiteProfile(
                name=site,
                rtt_seconds=_ms_to_seconds(rtt_ms),
                uplink_bps=_mbps_to_bps(mbps),
                downlink_bps=_mbps_to_bps(mbps),
                compute=_PRESET_COMPUTE,
                speed=None,
                availability=1.0,
            )
            for site, rtt_ms, mbps in sites
        ),
    )


PRESETS: Mapping[str, Network] = MappingProxyType(
    {
        # Derived from the DTS paper's map, whose links read 140 ms, 183 ms/23 Mbit/s, 35 ms,
        # 17 Mbit/s, 63 Mbit/s and 277 ms/13 Mbit/s, with the server in Ohio: the Ohio site
        # is the near one (35 ms, 63 Mbit/s), Tokyo the far one (277 ms, 13 Mbit/s). Listed
        # in the order of config.DEFAULT_SITES so the default run maps one to one, and a
        # ninth site cycles back to London.
        "world": _preset(
            "world",
            [
                ("london", 140.0, 23.0),
                ("ohio", 35.0, 63.0),
                ("california", 183.0, 17.0),
                ("tokyo", 277.0, 13.0),
            ],
        ),
        # InfiniBand-like: 2 microseconds, 100 Gbit/s; one template every site shares.
        "datacenter": _preset("datacenter", [("site", 0.002, 100_000.0)]),
        "mobile-4g": _preset("mobile-4g", [("site", 50.0, 100.0)]),
        "mobile-5g": _preset("mobile-5g", [("site", 10.0, 1_000.0)]),
    }
)


# ----------------------------------------------------------------------------- loading
def load_network(
    spec: str, *, seed: int = 0, compute_model: str = "", step_seconds: float = 0.0
) -> Network:
    """Return the network named by a preset or described by a TOML file.

    Parameters
    ----------
    spec : str
        A preset name (:data:`PRESETS`) or a path to a TOML file; a preset wins over a file
        of the same name (write ``./world`` for the file).
    seed : int
        Seeds the random site speeds.
    compute_model : str
        If non-empty, every site's compute model kind (one of :data:`COMPUTE_MODELS`).
    step_seconds : float
        If > 0, every site's mean seconds per local step; 0 keeps the profiles' own.

    Raises
    ------
    ConfigError
        For an unknown preset or missing file (naming the presets), an unreadable file,
        invalid TOML (with its line), or, in one error, every unknown key, wrong type and
        out-of-range value of the file, each naming the site and key.
    """
    if not isinstance(seed, int | np.integer) or isinstance(seed, bool):
        raise ConfigError(f"network seed must be an integer, got {fmt(seed)}")
    seed = int(seed)
    if compute_model and compute_model not in COMPUTE_MODELS:
        raise ConfigError(
            f"unknown compute model {compute_model!r}; allowed: {', '.join(COMPUTE_MODELS)}"
        )
    if not (is_number(step_seconds) and math.isfinite(step_seconds) and step_seconds >= 0):
        raise ConfigError(
            f"step seconds must be a finite number > 0 (or 0 to keep the profiles' own), "
            f"got {fmt(step_seconds)}"
        )
    overrides = _Overrides(compute_model, float(step_seconds))

    if spec in PRESETS:
        preset = PRESETS[spec]
        profiles = tuple(replace(p, compute=overrides.apply(p.compute)) for p in preset.profiles)
        return Network(name=preset.name, profiles=profiles, seed=seed)

    presets = ", ".join(PRESETS)
    if not spec:
        raise ConfigError(
            f"no network given; allowed presets: {presets}, or a path to a .toml file"
        )
    path = Path(spec)
    if not path.exists():
        if path.suffix == ".toml" or len(path.parts) > 1:
            raise ConfigError(
                f"network file '{spec}' does not exist; give an existing .toml file or a "
                f"preset: {presets}"
            )
        raise ConfigError(
            f"unknown network preset '{spec}'; allowed presets: {presets}, "
            "or a path to a .toml file"
        )
    try:
        with path.open("rb") as f:
            document = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"network file '{spec}' is not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"network file '{spec}' is not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(f"cannot read network file '{spec}': {exc.strerror or exc}") from None
    return _FileParser(path.stem, overrides).parse(
        document, subject=f"network file '{spec}'", seed=seed
    )


@dataclass(frozen=True)
class _Overrides:
    """The run's compute overrides, applied to every site after its file values."""

    compute_model: str
    step_seconds: float

    def apply(self, compute: ComputeModel) -> ComputeModel:
        if self.compute_model:
            compute = replace(compute, kind=self.compute_model)
        if self.step_seconds > 0:
            compute = replace(compute, mean_seconds=self.step_seconds)
        return compute

    def origin(self, key: str) -> str | None:
        """Name the override that set ``key`` (a ``compute.<key>``), if any."""
        if key == "compute.model" and self.compute_model:
            return "the compute_model override"
        if key == "compute.mean_seconds" and self.step_seconds > 0:
            return "the step_seconds override"
        return None


# What a value must be, per key: "number" (int or float, never bool), "speed" (a number or
# "random"), "string".
_SITE_TYPES = {
    "rtt_ms": "number",
    "uplink_mbps": "number",
    "downlink_mbps": "number",
    "speed": "speed",
    "availability": "number",
}
_COMPUTE_TYPES = {
    "model": "string",
    "mean_seconds": "number",
    "shift_seconds": "number",
    "pareto_shape": "number",
}
# Stand-ins for values that are missing or mistyped: they build a profile whose other
# fields can still be checked, and their own (already reported) problems are dropped.
_PLACEHOLDERS: dict[str, Any] = {
    "rtt_ms": 0.0,
    "uplink_mbps": math.inf,
    "downlink_mbps": math.inf,
    "speed": 1.0,
    "availability": 1.0,
}


def _type_problem(kind: str, value: Any) -> str | None:
    if kind == "number" and not is_number(value):
        hint = " (write inf unquoted for no transfer cost)" if value == "inf" else ""
        return f"must be a number{hint}, got {fmt(value)}"
    if kind == "speed" and not (is_number(value) or value == RANDOM_SPEED):
        return f"must be a number > 0 or {RANDOM_SPEED!r}, got {fmt(value)}"
    if kind == "string" and not isinstance(value, str):
        return f"must be a string, got {fmt(value)}"
    return None


@dataclass
class _Layer:
    """One table's well-typed values (keys flat: ``rtt_ms``, ``compute.model``) and the
    keys it set with the wrong type."""

    values: dict[str, Any]
    broken: set[str]

    def sets(self, key: str) -> bool:
        return key in self.values or key in self.broken


class _FileParser:
    """Turns a parsed TOML document into a Network, collecting every problem first."""

    def __init__(self, stem: str, overrides: _Overrides) -> None:
        self.stem = stem
        self.overrides = overrides
        # (site name or None for file-level, message); site problems are grouped on output.
        self.found: list[tuple[str | None, str]] = []

    def problem(self, site: str | None, message: str) -> None:
        self.found.append((site, message))

    def parse(self, doc: dict[str, Any], *, subject: str, seed: int) -> Network:
        for key in doc:
            if key not in TOP_KEYS:
                self.problem(None, f"unknown top-level key {key!r}; allowed: {', '.join(TOP_KEYS)}")
        name = doc.get("name", self.stem)
        if not (isinstance(name, str) and name.strip()):
            self.problem(None, f"name must be a non-empty string, got {fmt(name)}")
            name = self.stem

        raw_defaults = doc.get("defaults", {})
        if isinstance(raw_defaults, dict):
            defaults = self.layer(raw_defaults, None, "[defaults]")
        else:
            self.problem(None, f"[defaults] must be a table, got {fmt(raw_defaults)}")
            defaults = _Layer({}, set())

        sites = doc.get("sites")
        profiles: list[SiteProfile] = []
        if not isinstance(sites, dict) or not sites:
            self.problem(None, "needs at least one [sites.<name>] table")
        else:
            for site_name, raw in sites.items():
                if not isinstance(raw, dict):
                    self.problem(
                        site_name, f"must be a table ([sites.{site_name}]), got {fmt(raw)}"
                    )
                    continue
                profiles.append(self.site(site_name, self.layer(raw, site_name, None), defaults))

        if self.found:
            raise ConfigError(_problem_line(subject, self.rendered()))
        return Network(name=name, profiles=tuple(profiles), seed=seed)

    def layer(self, table: dict[str, Any], site: str | None, where: str | None) -> _Layer:
        """Type-check one [defaults] or [sites.x] table; ``where`` prefixes [defaults]."""

        def report(message: str) -> None:
            self.problem(site, f"{where}: {message}" if where else message)

        values: dict[str, Any] = {}
        broken: set[str] = set()
        for key, value in table.items():
            if key == "compute":
                if not isinstance(value, dict):
                    report(f"compute must be a table, got {fmt(value)}")
                    broken.update(f"compute.{k}" for k in COMPUTE_KEYS)
                    continue
                for ckey, cvalue in value.items():
                    if ckey not in _COMPUTE_TYPES:
                        report(f"unknown key 'compute.{ckey}'; allowed: {', '.join(COMPUTE_KEYS)}")
                    elif (msg := _type_problem(_COMPUTE_TYPES[ckey], cvalue)) is not None:
                        report(f"compute.{ckey} {msg}")
                        broken.add(f"compute.{ckey}")
                    else:
                        values[f"compute.{ckey}"] = cvalue
            elif key not in _SITE_TYPES:
                report(f"unknown key {key!r}; allowed: {', '.join(SITE_KEYS)}")
            elif (msg := _type_problem(_SITE_TYPES[key], value)) is not None:
                report(f"{key} {msg}")
                broken.add(key)
            else:
                values[key] = value
        return _Layer(values, broken)

    def site(self, name: str, own: _Layer, defaults: _Layer) -> SiteProfile:
        """Merge a site over the defaults, build its profile and record its value problems."""
        if not SITE_NAME.match(name):
            self.problem(
                name,
                "the name is not allowed; use 1 to 64 letters, digits, '_', '.' or '-', "
                "starting with a letter or digit",
            )
        merged: dict[str, Any] = {}
        origin: dict[str, str] = {}
        # Keys whose problem is already reported (a wrong type) or reported here (missing).
        silenced: set[str] = set()
        for key in [*_SITE_TYPES, *(f"compute.{k}" for k in COMPUTE_KEYS)]:
            if own.sets(key):
                layer, origin[key] = own, "site"
            elif defaults.sets(key):
                layer, origin[key] = defaults, "[defaults]"
            else:
                if key in REQUIRED_SITE_KEYS:
                    self.problem(name, f"{key} is missing; set it in [sites.{name}] or [defaults]")
                    silenced.add(key)
                continue
            if key in layer.broken:
                silenced.add(key)
            else:
                merged[key] = layer.values[key]
        for key, placeholder in _PLACEHOLDERS.items():
            merged.setdefault(key, placeholder)

        base = ComputeModel()
        compute = ComputeModel(
            kind=merged.get("compute.model", base.kind),
            mean_seconds=merged.get("compute.mean_seconds", base.mean_seconds),
            shift_seconds=merged.get("compute.shift_seconds", base.shift_seconds),
            pareto_shape=merged.get("compute.pareto_shape", base.pareto_shape),
        )
        speed = merged["speed"]
        profile = SiteProfile(
            name=name,
            rtt_seconds=_ms_to_seconds(merged["rtt_ms"]),
            uplink_bps=_mbps_to_bps(merged["uplink_mbps"]),
            downlink_bps=_mbps_to_bps(merged["downlink_mbps"]),
            compute=self.overrides.apply(compute),
            speed=None if speed == RANDOM_SPEED else float(speed),
            availability=float(merged["availability"]),
        )
        for key, message in profile.keyed_problems():
            if key == "name" or key in silenced:
                continue  # the name was checked above, with the file's wording
            source = self.overrides.origin(key) or origin.get(key)
            note = "" if source in (None, "site") else f" (from {source})"
            self.problem(name, f"{key} {message}{note}")
        return profile

    def rendered(self) -> list[str]:
        """File-level problems first, then site problems, identical ones grouped."""
        out = [message for site, message in self.found if site is None]
        by_message: dict[str, list[str]] = {}
        for site, message in self.found:
            if site is not None:
                by_message.setdefault(message, []).append(site)
        for message, sites in by_message.items():
            names = ", ".join(repr(s) for s in sites)
            out.append(f"site{'s' if len(sites) > 1 else ''} {names}: {message}")
        return out
