"""``HOST:PORT`` as the deployment commands take it, checked once."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from flplatform.core.errors import ConfigError

# A DNS name: labels of letters, digits and hyphens, not starting or ending with a hyphen.
_HOST_NAME = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)


@dataclass(frozen=True)
class Address:
    """A host (name, IPv4 or IPv6 address, without brackets) and a TCP port."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def is_wildcard(self) -> bool:
        """Whether it means every interface of this machine (a listening address), however
        spelled (``0.0.0.0``, ``::``, ``0::0``)."""
        try:
            return ipaddress.ip_address(self.host).is_unspecified
        except ValueError:  # a host name
            return False


def parse_address(text: str, option: str) -> Address:
    """``HOST:PORT`` or ``[IPv6]:PORT``; ConfigError naming ``option`` otherwise."""
    spelled = text.strip()
    example = f"e.g. {option} 0.0.0.0:9092, {option} server.example.org:9092 or [::1]:9092"
    if spelled.startswith("["):
        host, bracket, rest = spelled[1:].partition("]")
        port_text = rest[1:] if bracket and rest.startswith(":") else ""
    else:
        host, _, port_text = spelled.rpartition(":")
        if ":" in host:  # 2001:db8::1:9092 would be split at a guess
            raise ConfigError(f"{option} {text!r}: an IPv6 address goes in brackets ({example})")
    if not host or not port_text:
        raise ConfigError(f"{option} {text!r} is not HOST:PORT ({example})")
    if not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:
        raise ConfigError(f"{option} {text!r}: the port must be a number from 1 to 65535")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if ":" in host or not _HOST_NAME.fullmatch(host):
            raise ConfigError(
                f"{option} {text!r}: {host!r} is neither an IP address nor a host name ({example})"
            ) from None
    return Address(host=host.rstrip("."), port=int(port_text))
