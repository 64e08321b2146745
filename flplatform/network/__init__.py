"""Simulated networks: site profiles, compute-time models, presets and TOML profiles.

Pure configuration and arithmetic for the virtual clock: no Flower, no torch (numpy and the
standard library only). See :mod:`flplatform.network.load` for the TOML format.
"""

from __future__ import annotations

from flplatform.network.compute import COMPUTE_MODELS, ComputeModel, compute_seconds
from flplatform.network.load import load_network
from flplatform.network.presets import PRESETS
from flplatform.network.profiles import (
    SITE_NAME,
    SPEED_RANGE,
    Network,
    SiteProfile,
    random_speed,
    transfer_seconds,
)

__all__ = [
    "COMPUTE_MODELS",
    "PRESETS",
    "SITE_NAME",
    "SPEED_RANGE",
    "ComputeModel",
    "Network",
    "SiteProfile",
    "compute_seconds",
    "load_network",
    "random_speed",
    "transfer_seconds",
]
