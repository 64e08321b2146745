"""The site parts of strategies, by the name a round's config gives them.

The generic ClientApp reads ``site-algorithm`` from the round's config and runs the
matching site part. Each strategy module defines its site part next to its server part;
this registry only maps names to them.
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Context, Message

from clients.site import Site
from flplatform.errors import ConfigError

SiteTrain = Callable[[Message, Context, Site], Message]

_SITE_PARTS: dict[str, SiteTrain] = {}


def register(name: str) -> Callable[[SiteTrain], SiteTrain]:
    """Decorator: make ``fn`` the site part run for ``site-algorithm = name``."""

    def wrap(fn: SiteTrain) -> SiteTrain:
        _SITE_PARTS[name] = fn
        return fn

    return wrap


def site_part(name: str) -> SiteTrain:
    """The site part registered under ``name`` (strategy modules register on import)."""
    try:
        return _SITE_PARTS[name]
    except KeyError:
        allowed = ", ".join(sorted(_SITE_PARTS)) or "none"
        raise ConfigError(
            f"unknown site-algorithm '{name}'; this site knows: {allowed} "
            "(is the site running an older flplatform than the server?)"
        ) from None
