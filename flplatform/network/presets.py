"""The built-in networks, by name (``--network world``, ``load_network("world")``).

=============  =======================================================================
``world``      london 140 ms/23 Mbit/s, ohio 35 ms/63 Mbit/s, california 183 ms/17 Mbit/s,
               tokyo 277 ms/13 Mbit/s (server in Ohio)
``datacenter`` one template: 0.002 ms, 100 Gbit/s (InfiniBand-like)
``mobile-4g``  one template: 50 ms, 100 Mbit/s
``mobile-5g``  one template: 10 ms, 1 Gbit/s
=============  =======================================================================

Every preset computes with an exponential model of mean 0.05 s per local step, gives each
site a seeded random speed (log-uniform in [0.5, 2]) and availability 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from flplatform.network._values import mbps_to_bps, ms_to_seconds
from flplatform.network.compute import ComputeModel
from flplatform.network.profiles import Network, SiteProfile

_PRESET_COMPUTE = ComputeModel(kind="exponential", mean_seconds=0.05)


def _preset(name: str, sites: list[tuple[str, float, float]]) -> Network:
    """A preset: symmetric links, the shared compute model, random speeds, always available."""
    return Network(
        name=name,
        profiles=tuple(
            SiteProfile(
                name=site,
                rtt_seconds=ms_to_seconds(rtt_ms),
                uplink_bps=mbps_to_bps(mbps),
                downlink_bps=mbps_to_bps(mbps),
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
