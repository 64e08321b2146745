"""Certificates and keys for a cross-silo deployment: a CA, the server's TLS certificate, site keys.

Flower's SuperLink serves TLS with a certificate whose subject alternative names must cover
the address the sites dial (an IP address or a DNS name); each SuperNode trusts the CA that
signed it. With SuperNode authentication every site signs its requests with its own EC key on
a NIST curve (Flower refuses Ed25519 for nodes): the private key in OpenSSH format stays at
the site, the public key — one OpenSSH line — is registered by the server.

Who holds what: the server's directory holds ``ca.crt``, ``ca.key``, ``server.crt``,
``server.key`` and every site's ``NAME.pub``; a site's directory holds ``ca.crt`` and its own
``NAME.key``. A site makes its key pair on its own machine and sends only ``NAME.pub``, so
no private key ever travels. Private keys are written owner-only; nothing is overwritten
unless asked (``force``), and every file of a set is checked before any is written, so a
refusal leaves the directory as it was.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import ipaddress
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from flplatform.core.checks import SITE_NAME
from flplatform.core.errors import ConfigError
from flplatform.core.files import make_private_dirs

DEFAULT_HOSTS = ("127.0.0.1", "localhost", "::1")
LOOPBACK_HOSTS = ("127.0.0.1",)
# P-384: a NIST curve, as Flower's SuperNode authentication requires; used for the TLS keys too.
CURVE = ec.SECP384R1
CA_DAYS = 3650
# Browsers cap server certificates at 825 days; gRPC/HTTP clients do not, but a deployment
# outliving two years should renew its server certificate anyway (`certs init --force`).
SERVER_DAYS = 825
PRIVATE_MODE = 0o600
PUBLIC_MODE = 0o644
# A DNS name: labels of letters, digits and hyphens, not starting or ending with a hyphen.
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS_NAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*\.?")

CA_CERT, CA_KEY = "ca.crt", "ca.key"
SERVER_CERT, SERVER_KEY = "server.crt", "server.key"


@dataclass(frozen=True)
class ServerCerts:
    """The files a TLS SuperLink needs: the CA certificate, its own certificate and key."""

    ca_cert: Path
    server_cert: Path
    server_key: Path

    @classmethod
    def find(cls, directory: Path) -> ServerCerts:
        """The server's files in ``directory``, each checked to parse; ConfigError otherwise."""
        _need_dir(directory, "flplatform certs init --out")
        certs = cls(directory / CA_CERT, directory / SERVER_CERT, directory / SERVER_KEY)
        for path in (certs.ca_cert, certs.server_cert):
            _load_cert(path, made_by=f"flplatform certs init --out {directory}")
        _load_pem_key(certs.server_key, made_by=f"flplatform certs init --out {directory}")
        return certs

    def hosts(self) -> list[str]:
        """The names and addresses the server certificate is valid for (its SANs)."""
        return certificate_hosts(_load_cert(self.server_cert, made_by="flplatform certs init"))

    def covers(self, host: str) -> bool:
        """Whether a site dialling ``host`` will accept the server certificate."""
        return host_matches(host, self.hosts())


@dataclass(frozen=True)
class SiteKey:
    """A site's key pair for SuperNode authentication (the public half may be absent)."""

    name: str
    private_key: Path
    public_key: Path

    @classmethod
    def find(cls, directory: Path, name: str) -> SiteKey:
        """The site's private key ``directory/NAME.key``, checked; ConfigError otherwise."""
        check_site_name(name)
        _need_dir(directory, f"flplatform certs site {name} --out")
        key = cls(name, directory / f"{name}.key", directory / f"{name}.pub")
        made_by = f"flplatform certs site {name} --out {directory}"
        if not key.private_key.is_file():
            raise ConfigError(
                f"no private key for site '{name}': {key.private_key} is missing; "
                f"make it with `{made_by}`"
            )
        try:
            loaded = serialization.load_ssh_private_key(key.private_key.read_bytes(), None)
        except (ValueError, TypeError, OSError) as exc:
            raise ConfigError(
                f"{key.private_key} is not an unencrypted OpenSSH private key ({exc}); "
                f"make a new one with `{made_by} --force`"
            ) from None
        _check_site_curve(loaded, key.private_key)
        return key


def init_certs(
    out: Path, hosts: Sequence[str] = DEFAULT_HOSTS, *, force: bool = False
) -> ServerCerts:
    """Write a new CA and a server certificate valid for ``hosts`` into ``out``.

    ``hosts``: every name or address sites will dial (the server certificate's SANs);
    127.0.0.1 is added when missing.
    Refuses (ConfigError) to overwrite any of the four files unless ``force``.
    """
    # The server's own processes (SuperExec, the Fleet gateway) reach its SuperLink on
    # 127.0.0.1 with this certificate: loopback is always among its names.
    hosts = list(dict.fromkeys([*hosts, *LOOPBACK_HOSTS]))
    names = _check_hosts(hosts)
    certs = ServerCerts(out / CA_CERT, out / SERVER_CERT, out / SERVER_KEY)
    files = (certs.ca_cert, out / CA_KEY, certs.server_cert, certs.server_key)
    _refuse_existing(files, force=force, what="certificates")
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(CURVE())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "flplatform deployment CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # clocks of sites differ a little
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA384())
    )
    server_key = ec.generate_private_key(CURVE())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=SERVER_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA384())
    )
    _make_dir(out)
    pem = serialization.Encoding.PEM
    _write(certs.ca_cert, ca_cert.public_bytes(pem), PUBLIC_MODE)
    _write(out / CA_KEY, _pkcs8(ca_key), PRIVATE_MODE)
    _write(certs.server_cert, server_cert.public_bytes(pem), PUBLIC_MODE)
    _write(certs.server_key, _pkcs8(server_key), PRIVATE_MODE)
    return certs


def make_site_key(name: str, out: Path, *, force: bool = False) -> SiteKey:
    """Write site ``name``'s key pair: ``out/NAME.key`` (OpenSSH, owner-only), ``out/NAME.pub``."""
    check_site_name(name)
    key = SiteKey(name, out / f"{name}.key", out / f"{name}.pub")
    _refuse_existing((key.private_key, key.public_key), force=force, what=f"a key for '{name}'")
    private = ec.generate_private_key(CURVE())
    _make_dir(out)
    _write(
        key.private_key,
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),  # the SuperNode reads it unattended
        ),
        PRIVATE_MODE,
    )
    line = private.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    _write(key.public_key, line + f" {name}\n".encode(), PUBLIC_MODE)
    return key


def site_public_key(directory: Path, name: str) -> Path:
    """The public key the server registers for site ``name`` (``NAME.pub``), checked."""
    check_site_name(name)
    path = directory / f"{name}.pub"
    if not path.is_file():
        raise ConfigError(
            f"no public key for site '{name}': {path} is missing; the site makes it with "
            f"`flplatform certs site {name} --out DIR` and sends you {name}.pub"
        )
    try:
        loaded = serialization.load_ssh_public_key(path.read_bytes())
    except (ValueError, TypeError, OSError, UnsupportedAlgorithm) as exc:
        raise ConfigError(f"{path} is not an OpenSSH public key line ({exc})") from None
    _check_site_curve(loaded, path)
    return path


def fingerprint(public_key: Path) -> str:
    """``SHA256:…`` of an OpenSSH public key file, as ``ssh-keygen -l`` prints it (to compare)."""
    return line_fingerprint(public_key.read_bytes())


def line_fingerprint(line: bytes) -> str:
    """``SHA256:…`` of one OpenSSH public key line: base64 of the SHA-256 of the key blob."""
    blob = base64.b64decode(line.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def check_site_name(name: str) -> str:
    """A site name usable as a file name and a ledger name; ConfigError otherwise."""
    if not SITE_NAME.fullmatch(name):
        raise ConfigError(
            f"site name {name!r} is not allowed: use 1–64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def certificate_hosts(cert: x509.Certificate) -> list[str]:
    """The DNS names and IP addresses of a certificate's subject alternative names."""
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [
        *sans.get_values_for_type(x509.DNSName),
        *(str(ip) for ip in sans.get_values_for_type(x509.IPAddress)),
    ]


def host_matches(host: str, hosts: Sequence[str]) -> bool:
    """Whether ``host`` (as a site dials it) is one of ``hosts`` (IP addresses compared as such)."""
    host = host.strip("[]")
    try:
        wanted = ipaddress.ip_address(host)
    except ValueError:
        return host.lower().rstrip(".") in {h.lower().rstrip(".") for h in hosts}
    for candidate in hosts:
        try:
            if ipaddress.ip_address(candidate) == wanted:
                return True
        except ValueError:
            continue
    return False


# ------------------------------------------------------------------------------ internals
def _check_hosts(hosts: Sequence[str]) -> list[x509.GeneralName]:
    if not hosts:
        raise ConfigError("at least one --host is needed: the name or address sites dial")
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
            continue
        except ValueError:
            pass
        if not _DNS_NAME.fullmatch(host):
            raise ConfigError(
                f"--host {host!r} is neither an IP address nor a DNS name (letters, digits, "
                "hyphens and dots)"
            )
        names.append(x509.DNSName(host.rstrip(".")))
    return names


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=not cert_sign,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _pkcs8(key: ec.EllipticCurvePrivateKey) -> bytes:
    # Unencrypted: the SuperLink reads it unattended; owner-only permissions protect it.
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _check_site_curve(key: object, path: Path) -> None:
    public = key.public_key() if isinstance(key, ec.EllipticCurvePrivateKey) else key
    if not isinstance(public, ec.EllipticCurvePublicKey) or not isinstance(
        public.curve, ec.SECP256R1 | ec.SECP384R1 | ec.SECP521R1
    ):
        raise ConfigError(
            f"{path} is not an EC key on a NIST curve (P-256, P-384, P-521), which Flower's "
            "SuperNode authentication requires; make one with `flplatform certs site`"
        )


def _need_dir(directory: Path, made_by: str) -> None:
    if not directory.is_dir():
        raise ConfigError(
            f"certificate directory {directory} does not exist; "
            f"make it with `{made_by} {directory}`"
        )


def _load_cert(path: Path, *, made_by: str) -> x509.Certificate:
    if not path.is_file():
        raise ConfigError(f"{path} is missing; make it with `{made_by}`")
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except ValueError as exc:
        raise ConfigError(f"{path} is not a PEM certificate ({exc})") from None


def _load_pem_key(path: Path, *, made_by: str) -> None:
    if not path.is_file():
        raise ConfigError(f"{path} is missing; make it with `{made_by}`")
    try:
        serialization.load_pem_private_key(path.read_bytes(), None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{path} is not an unencrypted PEM private key ({exc})") from None


def _refuse_existing(paths: Sequence[Path], *, force: bool, what: str) -> None:
    existing = [p for p in paths if p.exists()]
    if existing and not force:
        listed = ", ".join(str(p) for p in existing)
        raise ConfigError(f"{listed} already exist(s); pass --force to replace {what}")
    for path in existing:
        if not path.is_file():
            raise ConfigError(f"{path} exists and is not a file; remove it first")


def _make_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory")
    make_private_dirs(out)  # it holds private keys; the ones above name the sites


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` with ``mode`` from the first byte (no window with wider permissions)."""
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(descriptor, "wb") as handle:  # mkstemp creates it 0600
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
