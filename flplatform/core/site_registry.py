"""Which node is which site: the node ids ``flplatform server`` registered, by site name.

With SuperNode authentication a node can only join under a public key the server
registered, and Flower gives each registered key its own node id. ``flplatform server``
writes what it registered into a registry file and hands its path to the ServerApp in
``FLPLATFORM_SITE_REGISTRY``; site discovery (``flplatform.engine.discovery``) then names
each node by its registered name, whatever the site claims. Node ids persist in the
SuperLink's database, so a site keeps its name (and its snapshots, and its place in a
resumed run) across restarts of the server.

No Flower or cryptography imports: the ServerApp reads this on every discovery.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from flplatform.core.errors import ConfigError

REGISTRY_ENV = "FLPLATFORM_SITE_REGISTRY"
_FORMAT = "flplatform-site-registry"
_VERSION = 1


@dataclass(frozen=True)
class RegisteredSite:
    """One site's registration: its name, the node id Flower gave its key, the key's hash."""

    name: str
    node_id: int
    fingerprint: str  # ``SHA256:…`` of its OpenSSH public key, as ``ssh-keygen -l`` shows


@dataclass(frozen=True)
class SiteRegistry:
    """The registered sites of one deployment."""

    sites: tuple[RegisteredSite, ...] = ()

    def __post_init__(self) -> None:
        for attribute in ("name", "node_id"):
            values = [getattr(s, attribute) for s in self.sites]
            if len(set(values)) != len(values):
                raise ConfigError(f"site registry: a {attribute.replace('_', ' ')} appears twice")

    def name_of(self, node_id: int) -> str | None:
        """The registered name of ``node_id``, or None when it was not registered."""
        return next((s.name for s in self.sites if s.node_id == node_id), None)

    def site(self, name: str) -> RegisteredSite | None:
        """The registration of site ``name``, or None."""
        return next((s for s in self.sites if s.name == name), None)

    def with_site(self, site: RegisteredSite) -> SiteRegistry:
        """This registry with ``site`` added, replacing any entry of the same name."""
        return SiteRegistry(tuple(s for s in self.sites if s.name != site.name) + (site,))

    def only(self, names: Iterable[str]) -> SiteRegistry:
        """The entries of ``names``, in that order (names not registered are skipped)."""
        return SiteRegistry(tuple(s for n in names if (s := self.site(n)) is not None))

    # ------------------------------------------------------------------ the file
    def write(self, path: Path) -> None:
        """Write the registry to ``path`` (aside, then renamed: a reader never sees half)."""
        text = json.dumps(
            {
                "format": _FORMAT,
                "version": _VERSION,
                "sites": [
                    {"name": s.name, "node_id": s.node_id, "fingerprint": s.fingerprint}
                    for s in self.sites
                ],
            },
            indent=2,
        )
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(descriptor, "w") as handle:
                handle.write(text + "\n")
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    @classmethod
    def read(cls, path: Path) -> SiteRegistry:
        """Read a registry file; ConfigError naming the file when it is not one."""
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"site registry {path} does not exist") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read the site registry {path}: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise ConfigError(f"{path} is not a site registry (written by flplatform server)")
        try:
            return cls(tuple(_entry(item) for item in data["sites"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"site registry {path} is malformed ({exc})") from None

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> SiteRegistry | None:
        """The registry ``FLPLATFORM_SITE_REGISTRY`` names, or None when it is unset."""
        path = (os.environ if environ is None else environ).get(REGISTRY_ENV, "").strip()
        return cls.read(Path(path)) if path else None


def _entry(item: object) -> RegisteredSite:
    if not isinstance(item, dict):
        raise TypeError("each site must be an object")
    name, node_id, fingerprint = item["name"], item["node_id"], item["fingerprint"]
    if not isinstance(name, str) or not name:
        raise ValueError(f"site name {name!r} is not a text")
    if isinstance(node_id, bool) or not isinstance(node_id, int) or node_id < 0:
        raise ValueError(f"node id {node_id!r} of {name} is not a non-negative integer")
    return RegisteredSite(name=name, node_id=node_id, fingerprint=str(fingerprint))
