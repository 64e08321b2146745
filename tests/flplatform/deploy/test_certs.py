"""The deployment's certificates and keys, checked by parsing them and by a real TLS handshake."""

from __future__ import annotations

import ipaddress
import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from flplatform.core.errors import ConfigError
from flplatform.deploy.certs import (
    DEFAULT_HOSTS,
    ServerCerts,
    SiteKey,
    fingerprint,
    host_matches,
    init_certs,
    make_site_key,
    site_public_key,
)
from tests.helpers.cli import invoke, one_error_line


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def load_cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def sans(cert: x509.Certificate) -> tuple[set[str], set[str]]:
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return (
        set(ext.get_values_for_type(x509.DNSName)),
        {str(ip) for ip in ext.get_values_for_type(x509.IPAddress)},
    )


def test_init_writes_a_ca_and_a_server_certificate_for_the_default_hosts(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    out = shared / "deploy" / "certs"
    certs = init_certs(out)
    ca, server = load_cert(certs.ca_cert), load_cert(certs.server_cert)
    assert sans(server) == ({"localhost"}, {"127.0.0.1", "::1"})
    assert set(DEFAULT_HOSTS) == {"127.0.0.1", "localhost", "::1"}
    server.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    usage = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in usage
    for key_file in (out / "ca.key", certs.server_key):
        key = serialization.load_pem_private_key(key_file.read_bytes(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        assert isinstance(key.curve, ec.SECP384R1)
        assert mode(key_file) == 0o600
    assert mode(certs.ca_cert) == mode(certs.server_cert) == 0o644
    # created here, every one: it holds private keys, and the ones above name it
    assert mode(out) == mode(out.parent) == 0o700
    assert mode(shared) == 0o755  # an existing directory keeps its mode


def test_init_covers_the_given_names_and_addresses(tmp_path: Path) -> None:
    certs = init_certs(tmp_path, ["server.example.org", "10.0.0.7", "[2001:db8::1]"])
    assert sans(load_cert(certs.server_cert)) == (
        {"server.example.org"},
        {"10.0.0.7", "2001:db8::1", "127.0.0.1"},  # loopback added: the server's own dial
    )
    assert certs.covers("10.0.0.7") and certs.covers("SERVER.example.org")
    assert certs.covers("2001:db8:0::1") and not certs.covers("192.0.2.1")
    assert ServerCerts.find(tmp_path) == certs


@pytest.mark.parametrize("host", ["bad host", "-leading.example", "a..b", "x" * 300])
def test_init_refuses_a_host_that_is_no_name_or_address(tmp_path: Path, host: str) -> None:
    with pytest.raises(ConfigError, match="neither an IP address nor a DNS name"):
        init_certs(tmp_path / "certs", ["localhost", host])
    assert not (tmp_path / "certs").exists()


def test_nothing_is_overwritten_without_force(tmp_path: Path) -> None:
    certs = init_certs(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ConfigError, match="already exist.*--force"):
        init_certs(tmp_path)
    assert {p: p.read_bytes() for p in tmp_path.iterdir()} == before
    init_certs(tmp_path, force=True)
    assert certs.ca_cert.read_bytes() != before[certs.ca_cert]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in before)


def test_site_key_is_a_p384_openssh_pair_as_flower_needs(tmp_path: Path) -> None:
    key = make_site_key("london", tmp_path)
    private = serialization.load_ssh_private_key(key.private_key.read_bytes(), None)
    public = serialization.load_ssh_public_key(key.public_key.read_bytes())
    assert isinstance(private, ec.EllipticCurvePrivateKey)
    assert isinstance(private.curve, ec.SECP384R1)
    assert public == private.public_key()
    assert key.public_key.read_text().startswith("ecdsa-sha2-nistp384 ")
    assert key.public_key.read_text().rstrip().endswith(" london")
    assert mode(key.private_key) == 0o600 and mode(key.public_key) == 0o644
    assert SiteKey.find(tmp_path, "london") == key
    assert site_public_key(tmp_path, "london") == key.public_key
    assert fingerprint(key.public_key).startswith("SHA256:")
    with pytest.raises(ConfigError, match="already exist"):
        make_site_key("london", tmp_path)
    assert serialization.load_ssh_private_key(key.private_key.read_bytes(), None) is not None


def test_fingerprint_is_ssh_keygens_by_hand(tmp_path: Path) -> None:
    # ssh-keygen -l prints base64(sha256(key blob)) without padding.
    import base64
    import hashlib

    key = make_site_key("ohio", tmp_path)
    blob = base64.b64decode(key.public_key.read_text().split()[1])
    digest = base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")
    assert fingerprint(key.public_key) == f"SHA256:{digest}"


@pytest.mark.parametrize("name", ["../etc", "", "a b", "-x", "x" * 65])
def test_site_names_that_are_not_plain_file_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match="site name"):
        make_site_key(name, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_finding_missing_or_wrong_files_names_the_command_that_makes_them(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="flplatform certs init --out"):
        ServerCerts.find(tmp_path / "nowhere")
    init_certs(tmp_path)
    (tmp_path / "server.key").unlink()
    with pytest.raises(ConfigError, match="server.key is missing"):
        ServerCerts.find(tmp_path)
    with pytest.raises(ConfigError, match="london.pub is missing.*certs site london"):
        site_public_key(tmp_path, "london")
    with pytest.raises(ConfigError, match="flplatform certs site tokyo"):
        SiteKey.find(tmp_path, "tokyo")
    # An Ed25519 key, which Flower refuses for nodes, is refused here first.
    from cryptography.hazmat.primitives.asymmetric import ed25519

    line = (
        ed25519.Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    )
    (tmp_path / "tokyo.pub").write_bytes(line)
    with pytest.raises(ConfigError, match="NIST curve"):
        site_public_key(tmp_path, "tokyo")


def test_host_matching_compares_addresses_as_addresses() -> None:
    assert host_matches("[::1]", ["::1"])
    assert host_matches("localhost.", ["LOCALHOST"])
    assert not host_matches("127.0.0.2", ["127.0.0.1", "localhost"])
    assert ipaddress.ip_address("::1")  # the form a site dials for IPv6 loopback


def _serve_once(certs: ServerCerts) -> tuple[int, threading.Thread]:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs.server_cert, certs.server_key)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        with listener:
            listener.settimeout(10)
            connection, _ = listener.accept()
            try:
                with context.wrap_socket(connection, server_side=True) as tls:
                    tls.sendall(b"ok")
            except (ssl.SSLError, OSError):
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return port, thread


@pytest.mark.parametrize("dial", ["127.0.0.1", "localhost"])
def test_a_client_trusting_the_ca_completes_a_tls_handshake(tmp_path: Path, dial: str) -> None:
    certs = init_certs(tmp_path)
    port, thread = _serve_once(certs)
    client = ssl.create_default_context(cafile=str(certs.ca_cert))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        client.wrap_socket(raw, server_hostname=dial) as tls,
    ):
        assert tls.recv(2) == b"ok"
    thread.join(10)


def test_a_client_trusting_another_ca_refuses_the_server(tmp_path: Path) -> None:
    certs = init_certs(tmp_path / "ours")
    other = init_certs(tmp_path / "theirs")
    port, thread = _serve_once(certs)
    client = ssl.create_default_context(cafile=str(other.ca_cert))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        pytest.raises(ssl.SSLCertVerificationError),
    ):
        client.wrap_socket(raw, server_hostname="127.0.0.1")
    thread.join(10)


def test_cli_writes_the_files_and_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    hosts = ["--host", "10.1.2.3", "--host", "hub.example"]
    result = invoke(["certs", "init", "--out", str(out), *hosts])
    assert result.exit_code == 0, result.output
    assert "valid for: hub.example, 10.1.2.3, 127.0.0.1" in result.output
    assert sans(load_cert(out / "server.crt")) == ({"hub.example"}, {"10.1.2.3", "127.0.0.1"})
    result = invoke(["certs", "site", "london", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert fingerprint(out / "london.pub") in result.output
    again = invoke(["certs", "site", "london", "--out", str(out)])
    assert again.exit_code == 2
    assert "--force" in one_error_line(again.output)
    assert invoke(["certs", "site", "london", "--out", str(out), "--force"]).exit_code == 0
    bad = invoke(["certs", "init", "--out", str(tmp_path / "x"), "--host", "[/bold]"])
    assert bad.exit_code == 2
    assert "'[/bold]'" in one_error_line(bad.output)  # printed literally, no markup error
