"""Loading a network: a preset by name, or a user's profile file in TOML.

:func:`load_network` takes a preset name (:data:`~flplatform.network.presets.PRESETS`) or
the path of a file in the format below, applies the run's compute overrides, and returns a
validated :class:`~flplatform.network.profiles.Network`.

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

import math
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from flplatform.core.errors import ConfigError
from flplatform.network._values import fmt, is_number, mbps_to_bps, ms_to_seconds, problem_line
from flplatform.network.compute import COMPUTE_MODELS, ComputeModel
from flplatform.network.presets import PRESETS
from flplatform.network.profiles import RANDOM_SPEED, SITE_NAME, Network, SiteProfile

TOP_KEYS = ("name", "defaults", "sites")
SITE_KEYS = ("rtt_ms", "uplink_mbps", "downlink_mbps", "speed", "availability", "compute")
COMPUTE_KEYS = ("model", "mean_seconds", "shift_seconds", "pareto_shape")
REQUIRED_SITE_KEYS = ("rtt_ms", "uplink_mbps", "downlink_mbps")


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
            raise ConfigError(problem_line(subject, self.rendered()))
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
            rtt_seconds=ms_to_seconds(merged["rtt_ms"]),
            uplink_bps=mbps_to_bps(merged["uplink_mbps"]),
            downlink_bps=mbps_to_bps(merged["downlink_mbps"]),
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
