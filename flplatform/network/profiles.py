"""Site profiles and networks: each site's link to the server and how fast it computes.

A :class:`SiteProfile` says how far a site is from the server (round-trip latency, uplink
and downlink bandwidth), how fast it computes (a :class:`ComputeModel` and a relative
speed) and how often it takes part (availability). A :class:`Network` is a named list of
profiles that the virtual clock maps onto the run's sites: by name where a profile has the
site's name, otherwise in turn. A message of ``B`` bytes over a link of bandwidth ``b``
bit/s and round-trip latency ``L`` s takes ``L/2 + 8B/b`` seconds.

This module imports neither Flower nor torch. The built-in networks are in
:mod:`flplatform.network.presets`; a user's network file, its TOML format and
:func:`~flplatform.network.load.load_network` are in :mod:`flplatform.network.load`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from flplatform.core.errors import ConfigError
from flplatform.core.seeding import rng_for
from flplatform.network._values import fmt, is_number, problem_line
from flplatform.network.compute import ComputeModel
from flplatform.network.compute import compute_seconds as _compute_seconds

SITE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
RANDOM_SPEED = "random"  # the TOML (and to_dict) spelling of speed=None
# Seeded random speeds are 2**u with u ~ U(-1, 1): a site is as likely to be twice as slow
# as twice as fast, and the geometric mean speed is 1.
SPEED_RANGE = (0.5, 2.0)


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

    It depends only on ``(seed, site_name)`` (see :func:`flplatform.core.seeding.rng_for`), so
    every process of a run, and a resumed run, gives a site the same speed.
    """
    u = float(rng_for(seed, "speed", site_name).uniform(-1.0, 1.0))
    return min(max(2.0**u, SPEED_RANGE[0]), SPEED_RANGE[1])


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
            raise ConfigError(problem_line(f"network {fmt(self.name)}", problems))

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
        """Return this network in the TOML format ``load_network`` reads (see ``network.load``).

        The seed is not part of the file; pass it to ``load_network``.
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
