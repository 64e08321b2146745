"""``flplatform server`` and ``flplatform site`` refuse bad set-ups before starting anything.

Each refusal is one ``error:`` line naming what is wrong and how to put it right, and no
process is started (these tests would hang or leave processes behind otherwise). The
probe a site makes before it starts is tested against real TLS and plain sockets.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flplatform.cli.deploy import INSECURE_SERVER_WARNING, INSECURE_SITE_WARNING
from flplatform.core.errors import ConfigError, RunFailed
from flplatform.deploy.certs import init_certs, make_site_key
from flplatform.deploy.site import KEPT_SITE_LOGS, _watch, plan_site, probe_server, site_log
from flplatform.launch.flower import free_port
from flplatform.launch.processes import ProcessTree
from flplatform.run.run_record import DEPLOYED_EVENT, LAUNCH_KEY
from storage import LedgerRepository
from tests.helpers.cli import invoke, one_error_line
from tests.helpers.resumable_runs import record_run, simulate_config

OWN_APP = Path(__file__).resolve().parents[3] / "examples" / "own_app"


@pytest.fixture
def server_dir(tmp_path: Path) -> Path:
    """A server's certificate directory with london's and ohio's public keys."""
    out = tmp_path / "server"
    init_certs(out)
    for name in ("london", "ohio"):
        key = make_site_key(name, tmp_path / name)
        shutil.copy(key.public_key, out)
        shutil.copy(out / "ca.crt", tmp_path / name)
    return out


@pytest.fixture
def site_file(tmp_path: Path) -> Path:
    path = tmp_path / "london.npz"
    np.savez(path, x=np.zeros((20, 1, 8, 8), np.float32), y=np.arange(20) % 10)
    return path


def address() -> str:
    return f"127.0.0.1:{free_port()}"


def server(*args: str) -> tuple[int, str]:
    result = invoke(["server", *args])
    return result.exit_code, result.output


def site(*args: str) -> tuple[int, str]:
    result = invoke(["site", *args])
    return result.exit_code, result.output


# ====================================================================== server
def test_server_needs_its_sites_unless_it_resumes(server_dir: Path) -> None:
    code, output = server("--certs", str(server_dir), "--address", address())
    assert code == 2
    assert one_error_line(output) == (
        "error: --sites is missing: the sites' names, comma-separated (each NAME.pub in --certs)"
    )


@pytest.fixture
def deployed_ledger(sqlite_ledger: str, tmp_path: Path) -> tuple[str, int, int]:
    """A ledger with a deployed run of london and ohio, and a simulated one: each killed
    after 2 of 4 rounds."""
    config = {**simulate_config("d1"), "sites": "london,ohio"}
    deployed = record_run(sqlite_ledger, tmp_path, config=config, tag="d1", rounds=2)
    simulated = record_run(sqlite_ledger, tmp_path, config=config, tag="s1", rounds=2)
    with LedgerRepository.open(sqlite_ledger) as repo:
        repo.add_event(deployed, DEPLOYED_EVENT, {"sites": ["london", "ohio"], "address": "x:1"})
    return sqlite_ledger, deployed, simulated


@pytest.fixture
def sites_never_come(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """``flplatform server``'s deployment stubbed: what it was asked to run (plan, run,
    follow), each time, is listed; its sites never come."""
    from flplatform.cli import deploy as deploy_cli

    started: list[Any] = []

    def never(plan: Any, run: Any, follow: Any, **_: Any) -> None:
        started.append((plan, run, follow))
        raise RunFailed("sites did not connect within 1 s: london, ohio")

    monkeypatch.setattr(deploy_cli, "run_deployment", never)
    return started


@pytest.mark.parametrize(
    "given,said",
    [
        (
            ["--rounds", "9", "--lr", "0.5"],
            "error: --lr, --rounds: a resumed run keeps its own options; with --resume give "
            "the deployment's (--certs, --address, --wait-timeout, --insecure), --db and at "
            "most --round-timeout",
        ),
        (
            ["--sites", "london,tokyo"],
            "error: --sites london,tokyo: run {deployed} trained on london,ohio; give those, "
            "or leave --sites out",
        ),
        (
            ["--resume", "{simulated}"],
            "error: run {simulated} did not train on a deployment's sites (a simulation on the "
            "machine that started it): resume it there with `flplatform resume {simulated}`",
        ),
    ],
    ids=["options", "other-sites", "simulated-run"],
)
def test_server_resume_refuses_before_anything_starts(
    server_dir: Path, deployed_ledger: tuple[str, int, int], given: list[str], said: str
) -> None:
    url, deployed, simulated = deployed_ledger
    run = {"deployed": deployed, "simulated": simulated}
    args = ["--resume", str(deployed), *(item.format(**run) for item in given)]
    code, output = server("--certs", str(server_dir), "--address", address(), "--db", url, *args)
    assert code == 2, output
    assert one_error_line(output) == said.format(**run)
    with LedgerRepository.open(url) as repo:  # neither run touched
        assert [repo.get_run(r).status for r in (deployed, simulated)] == ["running"] * 2
        assert [e.kind for e in repo.list_events(deployed)] == [DEPLOYED_EVENT]


def test_server_resume_latest_is_the_newest_deployed_run_not_finished(
    server_dir: Path, deployed_ledger: tuple[str, int, int]
) -> None:
    url, deployed, _ = deployed_ledger  # a simulated run came after it
    common = ("--certs", str(server_dir), "--address", address(), "--db", url, "--resume")
    code, output = server(*common, "latest", "--sites", "london,tokyo")
    assert (code, one_error_line(output)) == (
        2,
        f"error: --sites london,tokyo: run {deployed} trained on london,ohio; give those, or "
        "leave --sites out",
    )
    with LedgerRepository.open(url) as repo:
        repo.finish_run(deployed, status="finished")
    code, output = server(*common, "latest")
    assert code == 2
    assert one_error_line(output).startswith("error: no deployed run to resume in the ledger ")


def test_server_resume_of_another_deployments_run_is_refused(
    server_dir: Path, deployed_ledger: tuple[str, int, int]
) -> None:
    url, deployed, _ = deployed_ledger
    with LedgerRepository.open(url) as repo:  # it ran on another CA's deployment since
        repo.add_event(
            deployed, DEPLOYED_EVENT, {"sites": ["london", "ohio"], "deployment": "ca-0ther"}
        )
    code, output = server(
        "--certs", str(server_dir), "--address", address(), "--db", url, "--resume", "latest"
    )
    assert code == 2
    assert one_error_line(output).startswith(
        f"error: run {deployed} trained on another deployment (ca-0ther; this one is ca-"
    )
    with LedgerRepository.open(url) as repo:
        assert repo.get_run(deployed).status == "running"


def test_server_resume_plans_the_run_and_fails_it_if_it_cannot_start(
    server_dir: Path, deployed_ledger: tuple[str, int, int], sites_never_come: list[Any]
) -> None:
    """What reaches the deployment: the run's own options and tag, set to resume; when
    the resume stops before its ServerApp could (its sites never came), the run it
    reopened is failed with the reason, not left running."""
    url, deployed, _ = deployed_ledger
    code, output = server(
        "--certs", str(server_dir), "--address", address(), "--db", url, "--resume",
        str(deployed), "--round-timeout", "30",
    )  # fmt: skip
    assert code == RunFailed.exit_code, output
    assert f"Resuming run {deployed} (r) from round 2 of 4, on its 2 sites (london, ohio)" in (
        output
    )
    [(plan, run, follow)] = sites_never_come
    assert plan.sites == ("london", "ohio")
    assert {k: run.run_config[k] for k in ("resume-run", "run-tag", "sites", "round-timeout")} == {
        "resume-run": deployed,
        "run-tag": "d1",
        "sites": "london,ohio",
        "round-timeout": 30.0,
    }
    assert run.logs.startswith("d1.resumed-")  # the logs of the start that died are kept
    assert (follow.run_tag, follow.resume_run) == ("d1", deployed)
    with LedgerRepository.open(url) as repo:
        record = repo.get_run(deployed)
    assert (record.status, record.error) == (
        "failed",
        "sites did not connect within 1 s: london, ohio",
    )


def test_server_resume_of_a_finished_or_own_app_run_is_one_line(
    server_dir: Path, deployed_ledger: tuple[str, int, int], tmp_path: Path
) -> None:
    url, deployed, _ = deployed_ledger
    app_run = record_run(
        url, tmp_path, config={**simulate_config("a1"), LAUNCH_KEY: {}}, tag="a1", rounds=1
    )
    with LedgerRepository.open(url) as repo:
        repo.add_event(app_run, DEPLOYED_EVENT, {"sites": ["london", "ohio"], "address": "x:1"})
        repo.finish_run(deployed, status="finished")
    common = ("--certs", str(server_dir), "--address", address(), "--db", url, "--resume")
    code, output = server(*common, str(deployed))
    assert (code, one_error_line(output)) == (
        2,
        f"error: run {deployed} finished; there is nothing to resume",
    )
    code, output = server(*common, str(app_run))
    assert (code, one_error_line(output)) == (
        2,
        f"error: run {app_run}'s recorded launch ('flplatform-run' in its config) names no app "
        "directory; it cannot be launched again",
    )


def test_server_resume_of_an_own_app_run_launches_the_app_again_on_its_sites(
    server_dir: Path, sqlite_ledger: str, tmp_path: Path, sites_never_come: list[Any]
) -> None:
    """A run of `flplatform server --app DIR` resumes as `flplatform resume` resumes a
    `flplatform run`: the recorded app directory and options, planned again, to continue
    the run (its tag, resume_run for start()) on the sites it trained on."""
    app_dir = tmp_path / "own_app"
    shutil.copytree(OWN_APP, app_dir, ignore=shutil.ignore_patterns("__pycache__"))
    launch = {
        "app": str(app_dir),
        "cwd": str(tmp_path),
        "options": {"sites": ["london", "ohio"], "rounds": 4, "run_config": ["learning-rate=0.2"]},
    }
    config = {"sites": "london,ohio", "learning-rate": 0.2, LAUNCH_KEY: launch}
    app_run = record_run(sqlite_ledger, tmp_path, config=config, tag="a1", rounds=2)
    with LedgerRepository.open(sqlite_ledger) as repo:
        repo.add_event(app_run, DEPLOYED_EVENT, {"sites": ["london", "ohio"], "address": "x:1"})
    code, output = server(
        "--certs", str(server_dir), "--address", address(), "--db", sqlite_ledger, "--resume",
        "latest",
    )  # fmt: skip
    assert code == RunFailed.exit_code, output
    assert f"Resuming run {app_run} (r) from round 2 of 4, on its 2 sites (london, ohio)" in (
        output
    )
    [(plan, run, follow)] = sites_never_come
    assert plan.sites == ("london", "ohio")
    assert run.app_dir == app_dir and run.tag == "a1" and run.logs.startswith("a1.resumed-")
    assert run.run_config["learning-rate"] == 0.2 and run.run_config["num-server-rounds"] == 4
    options = json.loads(run.extra_env["FLPLATFORM_OPTIONS"])  # what start() is given
    assert (options["resume_run"], options["tag"], options["required_sites"]) == (app_run, "a1", 2)
    assert (follow.run_tag, follow.db) == ("a1", sqlite_ledger)
    with LedgerRepository.open(sqlite_ledger) as repo:
        assert repo.get_run(app_run).status == "failed"  # reopened, then failed with the reason
    # Its app directory gone: one line, and the run left as it was.
    shutil.rmtree(app_dir)
    code, output = server(
        "--certs", str(server_dir), "--address", address(), "--db", sqlite_ledger, "--resume",
        str(app_run),
    )  # fmt: skip
    assert code == 2 and "own_app" in one_error_line(output), output
    with LedgerRepository.open(sqlite_ledger) as repo:
        assert repo.get_run(app_run).error == "sites did not connect within 1 s: london, ohio"


def test_server_without_certs_names_certs_init_and_insecure() -> None:
    code, output = server("--sites", "london,ohio", "--address", address())
    assert code == 2
    line = one_error_line(output)
    assert "flplatform certs init --out DIR" in line and "--insecure" in line


def test_server_with_a_missing_certs_dir_names_the_command(tmp_path: Path) -> None:
    code, output = server("--sites", "london", "--certs", str(tmp_path / "nowhere"))
    assert code == 2
    assert "flplatform certs init --out" in one_error_line(output)


def test_server_missing_a_sites_public_key_names_certs_site(server_dir: Path) -> None:
    code, output = server(
        "--sites", "london,ohio,tokyo", "--certs", str(server_dir), "--address", address()
    )
    assert code == 2
    line = one_error_line(output)
    assert "tokyo.pub is missing" in line and "flplatform certs site tokyo" in line


def test_two_sites_with_one_key_are_refused(server_dir: Path) -> None:
    shutil.copy(server_dir / "london.pub", server_dir / "paris.pub")
    code, output = server(
        "--sites", "london,paris", "--certs", str(server_dir), "--address", address()
    )
    assert code == 2
    assert "london and paris have the same public key" in one_error_line(output)


@pytest.mark.parametrize(
    "sites, says",
    [
        ("london,london", "london more than once"),
        ("2", "not a count"),
        (",", "needs the sites' names"),
        ("lon don", "not allowed"),
    ],
)
def test_bad_site_lists_are_refused(server_dir: Path, sites: str, says: str) -> None:
    code, output = server("--sites", sites, "--certs", str(server_dir), "--address", address())
    assert code == 2
    assert says in one_error_line(output)


@pytest.mark.parametrize(
    "spelled, says",
    [
        ("nonsense", "is not HOST:PORT"),
        ("127.0.0.1:0", "from 1 to 65535"),
        ("127.0.0.1:http", "from 1 to 65535"),
        ("bad_host:9092", "neither an IP address nor a host name"),
        ("10.255.255.1:9092", "would refuse"),  # not in the certificate
        ("2001:db8::1:9092", "goes in brackets"),  # host and port would be a guess
        ("127.0.0.1:\u0669\u0660\u0669\u0662", "from 1 to 65535"),  # Arabic-Indic 9092
    ],
)
def test_bad_addresses_are_refused(server_dir: Path, spelled: str, says: str) -> None:
    code, output = server("--sites", "london", "--certs", str(server_dir), "--address", spelled)
    assert code == 2
    assert says in one_error_line(output)


def test_an_address_in_use_is_refused_before_anything_starts(server_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, output = server(
            "--sites", "london", "--certs", str(server_dir), "--address", f"127.0.0.1:{port}"
        )
    assert code == 2
    assert "cannot listen there" in one_error_line(output)


def _reissue_server_cert(out: Path, host: str) -> None:
    """Replace server.crt by one valid for ``host`` only, signed by the same CA (as a
    deployment's own PKI might make it: ``certs init`` always adds 127.0.0.1)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((out / "ca.key").read_bytes(), None)
    key = serialization.load_pem_private_key((out / "server.key").read_bytes(), None)
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, host)]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())  # type: ignore[arg-type]
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
        .sign(ca_key, hashes.SHA384())  # type: ignore[arg-type]
    )
    (out / "server.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def test_a_certificate_not_valid_on_loopback_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "server"
    init_certs(out, ["fl.example.org"])
    _reissue_server_cert(out, "fl.example.org")
    shutil.copy(make_site_key("london", tmp_path / "london").public_key, out)
    code, output = server("--sites", "london", "--certs", str(out), "--address", address())
    assert code == 2
    line = one_error_line(output)
    assert "not valid for 127.0.0.1" in line and "--host 127.0.0.1 --host fl.example.org" in line


def test_insecure_server_warns_what_it_allows_and_refuses_certs(server_dir: Path) -> None:
    code, output = server(
        "--sites", "london", "--insecure", "--certs", str(server_dir), "--address", address()
    )
    assert code == 2
    assert "drop --certs" in one_error_line(output)
    where = output.split("Anyone who can reach ")[1].split(" ")[0]
    assert "warning: " + INSECURE_SERVER_WARNING.format(address=where) in " ".join(output.split())
    assert "join this federation under any name" in output


def test_insecure_server_still_checks_its_address() -> None:
    code, output = server("--sites", "london", "--insecure", "--address", "nowhere")
    assert code == 2
    assert "warning: --insecure: no TLS and no site authentication" in output
    assert "is not HOST:PORT" in one_error_line(output)


def test_built_in_options_are_refused_with_an_app(tmp_path: Path) -> None:
    code, output = server(
        "--sites", "london", "--insecure", "--address", address(),
        "--app", str(tmp_path), "--lr", "0.5",
    )  # fmt: skip
    assert code == 2
    assert "--lr: options of the built-in task" in one_error_line(output)


@pytest.mark.parametrize(
    "item, says", [("sites=a,b", "use --sites"), ("num-server-rounds=x", "must be an integer")]
)
def test_run_config_items_are_checked(item: str, says: str) -> None:
    code, output = server("--sites", "london", "--insecure", "--address", address(), "-c", item)
    assert code == 2
    assert says in one_error_line(output)


def test_wait_timeout_must_be_positive(server_dir: Path) -> None:
    code, output = server(
        "--sites", "london", "--certs", str(server_dir), "--address", address(),
        "--wait-timeout", "0",
    )  # fmt: skip
    assert code == 2
    assert "--wait-timeout" in one_error_line(output)


# ====================================================================== site
def test_site_without_certs_names_certs_site_and_insecure(site_file: Path) -> None:
    code, output = site("london", "--server", "127.0.0.1:9092", "--data", str(site_file))
    assert code == 2
    line = one_error_line(output)
    assert "flplatform certs site london --out DIR" in line and "--insecure" in line


def test_site_missing_its_key_names_the_command(
    tmp_path: Path, server_dir: Path, site_file: Path
) -> None:
    code, output = site(
        "tokyo", "--server", "127.0.0.1:9092", "--certs", str(tmp_path / "london"),
        "--data", str(site_file),
    )  # fmt: skip
    assert code == 2
    assert "flplatform certs site tokyo" in one_error_line(output)


def test_site_missing_the_ca_certificate_says_who_sends_it(tmp_path: Path, site_file: Path) -> None:
    make_site_key("london", tmp_path / "keys")
    code, output = site(
        "london", "--server", "127.0.0.1:9092", "--certs", str(tmp_path / "keys"),
        "--data", str(site_file),
    )  # fmt: skip
    assert code == 2
    assert "ca.crt is missing: the server's administrator sends it" in one_error_line(output)


@pytest.mark.parametrize(
    "server_address, says",
    [
        ("0.0.0.0:9092", "not a listening address"),
        ("[0::0]:9092", "not a listening address"),  # every interface, however spelled
        ("9092", "is not HOST:PORT"),
    ],
)
def test_site_needs_the_servers_reachable_address(
    tmp_path: Path, server_dir: Path, site_file: Path, server_address: str, says: str
) -> None:
    code, output = site(
        "london", "--server", server_address, "--certs", str(tmp_path / "london"),
        "--data", str(site_file),
    )  # fmt: skip
    assert code == 2
    assert says in one_error_line(output)


def test_site_data_must_be_its_own_site_file(tmp_path: Path, server_dir: Path) -> None:
    split = invoke(["data", "split", "--out", str(tmp_path / "split"), "--sites", "london,ohio"])
    assert split.exit_code == 0, split.output
    certs = ["--server", "127.0.0.1:9092", "--certs", str(tmp_path / "london")]
    for data, code, says in [
        (tmp_path / "split" / "ohio.npz", 2, "is site 'ohio''s file in its split"),
        (tmp_path / "split" / "test.npz", 2, "held-out test set"),
        (tmp_path / "split", 2, "is a directory"),
        (tmp_path / "nowhere.npz", 3, "nowhere.npz"),
    ]:
        exit_code, output = site("london", *certs, "--data", str(data))
        assert exit_code == code, output
        assert says in one_error_line(output)


def test_insecure_site_warns_and_refuses_certs(tmp_path: Path, site_file: Path) -> None:
    code, output = site(
        "london", "--server", "127.0.0.1:9092", "--insecure", "--certs", str(tmp_path),
        "--data", str(site_file),
    )  # fmt: skip
    assert code == 2
    assert "warning: " + INSECURE_SITE_WARNING in " ".join(output.split())
    assert "drop --certs" in one_error_line(output)


# ====================================================================== the probe
def serve_once(listener: socket.socket, context: ssl.SSLContext | None) -> None:
    """Accept one connection; with ``context``, attempt a TLS handshake on it."""
    conn, _ = listener.accept()
    with conn:
        if context is not None:
            try:
                with context.wrap_socket(conn, server_side=True):
                    pass
            except (ssl.SSLError, OSError):
                pass
        else:  # a plain HTTP server answers a TLS hello as a malformed request
            conn.recv(1024)
            conn.sendall(b"HTTP/1.0 400 Bad request version\r\n\r\n")


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock


def tls_server(server_dir: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(server_dir / "server.crt", server_dir / "server.key")
    return context


def probe(
    listener: socket.socket, context: ssl.SSLContext | None, certs: Path | None, site_file: Path
) -> str | None:
    thread = threading.Thread(target=serve_once, args=(listener, context), daemon=True)
    thread.start()
    port = listener.getsockname()[1]
    plan = plan_site(
        "london",
        server=f"127.0.0.1:{port}",
        certs_dir=certs,
        data=site_file,
        insecure=certs is None,
    )
    try:
        return probe_server(plan)
    finally:
        thread.join(5)


def test_probe_accepts_the_deployments_server(
    tmp_path: Path, server_dir: Path, listener: socket.socket, site_file: Path
) -> None:
    assert probe(listener, tls_server(server_dir), tmp_path / "london", site_file) is None


def test_probe_refuses_a_server_of_another_ca(
    tmp_path: Path, server_dir: Path, listener: socket.socket, site_file: Path
) -> None:
    other = tmp_path / "other"
    init_certs(other)
    with pytest.raises(ConfigError, match="does not accept .* this deployment's ca.crt"):
        probe(listener, tls_server(other), tmp_path / "london", site_file)


def test_probe_refuses_a_server_without_tls(
    tmp_path: Path, server_dir: Path, listener: socket.socket, site_file: Path
) -> None:
    with pytest.raises(ConfigError, match="does not speak TLS"):
        probe(listener, None, tmp_path / "london", site_file)


def test_insecure_probe_refuses_a_tls_server(
    server_dir: Path, listener: socket.socket, site_file: Path
) -> None:
    with pytest.raises(ConfigError, match="speaks TLS: a site connects to it with --certs"):
        probe(listener, tls_server(server_dir), None, site_file)


def test_probe_of_an_unreachable_server_is_a_note(tmp_path: Path, site_file: Path) -> None:
    make_site_key("london", tmp_path / "keys")
    shutil.copy(init_certs(tmp_path / "server").ca_cert, tmp_path / "keys")
    plan = plan_site(
        "london",
        server=f"127.0.0.1:{free_port()}",
        certs_dir=tmp_path / "keys",
        data=site_file,
        insecure=False,
    )
    note = probe_server(plan)
    assert note is not None and "not reachable now" in note


# ----------------------------------------------------------- what the site says
# Flower 1.42's SuperNode log (coloured) of a site restarted soon after a crash: refused
# as active already (told to retry) until the dead SuperNode's heartbeat lapsed, then
# joined; later it lost the server and got it back.
_C = "\x1b[93mWARNING \x1b[0m:   "
_I = "\x1b[92mINFO \x1b[0m:      "
RESTARTED_SITE_LOG = [
    f"{_I}Starting Flower SuperNode",
    f"{_C}Connection attempt failed, retrying in 0.15 seconds",
    f"{_C}Connection attempt failed, retrying in 18.69 seconds",
    f"{_I}Connection successful after 52.68 seconds and 9 tries.",
    f"{_I}SuperNode ID: 3650004933250582873",
    f"{_I}[RUN 6067156974662529844, ROUND 17]",
    f"{_C}Connection attempt failed, retrying in 1.20 seconds",
    f"{_I}Connection successful after 3.10 seconds and 2 tries.",
    f"{_I}[RUN 6067156974662529844, ROUND 18]",
]


def test_a_site_keeps_its_last_logs_and_no_other_sites(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    # Eight earlier starts of london (pid 100 the oldest), one of london2, one of ohio.
    starts = [logs / f"site-london.supernode.{100 + i}.log" for i in range(8)]
    others = [logs / "site-london2.supernode.7.log", logs / "site-ohio.supernode.1.log"]
    for age, path in enumerate(reversed([*starts, *others])):
        path.write_text("a SuperNode's output\n")
        os.utime(path, (1e9 - age, 1e9 - age))
    os.utime(others[0], (1.0, 1.0))  # older than all of london's: not london's to remove

    log = site_log(tmp_path, "london")

    assert log == logs / f"site-london.supernode.{os.getpid()}.log"
    left = sorted(p.name for p in logs.iterdir())
    kept = [p.name for p in starts[-(KEPT_SITE_LOGS - 1) :]]  # the newest, with this one's
    assert left == sorted([*kept, *(p.name for p in others)])


def test_a_site_says_it_waits_to_join_then_joins_and_later_reconnects(
    tmp_path: Path, site_file: Path
) -> None:
    plan = plan_site(
        "london", server="127.0.0.1:9094", certs_dir=None, data=site_file, insecure=True
    )
    log = tmp_path / "supernode.log"
    log.write_text("\n".join(RESTARTED_SITE_LOG) + "\n")
    said: list[str] = []
    with ProcessTree() as tree:
        node = tree.popen([sys.executable, "-c", "pass"])  # a SuperNode that has exited
        node.wait()
        ended = _watch(node, tree, log, plan, said.append)
    assert (ended.code, ended.joined, ended.stalled) == (0, True, False)
    assert ended.output == log.read_text()
    assert said == [
        "cannot join 127.0.0.1:9094 yet; retrying until it lets london in",
        "connected to 127.0.0.1:9094 as node 3650004933250582873",
        "serving run 6067156974662529844",
        "lost the server 127.0.0.1:9094; retrying until it is back",
        "reconnected to 127.0.0.1:9094",
    ]


# A stand-in for flower-supernode: each start takes the next word of a script (in the
# file named by FAKE_SUPERNODE_SCRIPT) — "gives-up" exits with Flower's connection
# error, "joins" listens on its --port, says its node id, then gives up too, "stalls"
# joins, meets a TLS error and runs on serving nothing, "refused" exits with the server's
# refusal of the key. As Flower's, its status is 1 on an error,
# its exit code printed.
FAKE_SUPERNODE = """
import os, socket, sys, time
script = os.environ["FAKE_SUPERNODE_SCRIPT"]
steps = open(script).read().split()
open(script, "w").write(" ".join(steps[1:]))
step = steps[0]
if step in ("joins", "stalls"):
    port = int(sys.argv[sys.argv.index("--port") + 1])
    listening = socket.create_server(("127.0.0.1", port))
    print("INFO :      SuperNode ID: 42", flush=True)
    time.sleep(1.0)
if step == "stalls":  # as Flower's does after a TLS error: gives the request up, runs on
    print("ERROR :     SSL/TLS handshake error detected.", flush=True)
    time.sleep(600)
if step == "refused":
    print("ERROR :     Exit Code: 305 ... [code: 2004] node activation failed", flush=True)
elif step == "plain-server":  # the server started again with --insecure
    print("ERROR :     [SSL: WRONG_VERSION_NUMBER] wrong version number", flush=True)
    print("ERROR :     Exit Code: 305", flush=True)
else:
    print("ERROR :     SSL/TLS handshake error detected.", flush=True)
    print("ERROR :     Exit Code: 305", flush=True)
sys.exit(1)
"""


def fake_supernode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steps: str) -> Path:
    """`flplatform site` starts FAKE_SUPERNODE, taking ``steps`` one start at a time, and
    waits 0.1 s before its first restart; the script's file."""
    import flplatform.deploy.site as site

    fake = tmp_path / "flower-supernode"
    fake.write_text(f"#!{sys.executable}\n{FAKE_SUPERNODE}")
    fake.chmod(0o755)
    script = tmp_path / "script"
    script.write_text(steps)
    monkeypatch.setenv("FAKE_SUPERNODE_SCRIPT", str(script))
    monkeypatch.setattr(site, "flower_command", lambda name: str(fake))
    monkeypatch.setattr(site, "RESTART_SECONDS", 0.1)
    return script


@pytest.mark.parametrize("earlier_log", [False, True], ids=["", "a-log-left-at-this-pid"])
def test_a_site_whose_supernode_gave_up_connecting_starts_it_again(
    tmp_path: Path, site_file: Path, monkeypatch: pytest.MonkeyPatch, earlier_log: bool
) -> None:
    """Issue 35: Flower's SuperNode exits on any TLS error, a connection the server's
    gateway closed in its handshake among them (a flood from the site's address); the
    site starts it again, waiting longer each time it did not join, until one is refused
    for good. A log of this name left by an earlier process (the same pid, in a container)
    is written afresh and read from its start."""
    import flplatform.deploy.site as site

    if earlier_log:
        logs = tmp_path / "home" / "logs"
        logs.mkdir(parents=True)
        (logs / f"site-london.supernode.{os.getpid()}.log").write_text("x" * 20_000 + "\n")

    script = fake_supernode(tmp_path, monkeypatch, "gives-up gives-up joins refused")
    plan = plan_site(
        "london", server="127.0.0.1:9094", certs_dir=None, data=site_file, insecure=True
    )
    said: list[str] = []
    with pytest.raises(RunFailed) as failed:
        site.run_site(plan, home=tmp_path / "home", say=said.append)

    gave_up = "a connection to 127.0.0.1:9094 failed and the SuperNode gave up"
    assert [line.split(" (")[0] for line in said] == [
        gave_up,
        gave_up,
        "connected to 127.0.0.1:9094 as node 42",
        gave_up,
    ]
    # waiting longer each time it did not join; from the start again once it had
    assert [line.rsplit("in ", 1)[1] for line in said if line.startswith(gave_up)] == [
        "0.1 s",
        "0.2 s",
        "0.1 s",
    ]
    assert "refused by the server: it does not accept london's key" in str(failed.value)
    [log] = (tmp_path / "home").rglob("site-london.supernode.*.log")
    assert log.read_text().count("Exit Code: 305") == 4  # every start's output, kept
    assert script.read_text() == ""  # four starts


def test_a_site_whose_supernode_stalled_after_a_tls_error_starts_it_again(
    tmp_path: Path, site_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 35's hang: a joined SuperNode whose request met a TLS error (a connection the
    gateway closed in its handshake) gives that request up and serves nothing more while
    it runs on; the site stops it and starts it again."""
    import flplatform.deploy.site as site

    fake_supernode(tmp_path, monkeypatch, "stalls refused")
    monkeypatch.setattr(site, "STALL_SECONDS", 1.0)
    plan = plan_site(
        "london", server="127.0.0.1:9094", certs_dir=None, data=site_file, insecure=True
    )
    said: list[str] = []
    started = time.monotonic()
    with pytest.raises(RunFailed, match="does not accept london's key"):
        site.run_site(plan, home=tmp_path / "home", say=said.append)
    assert said == [
        "connected to 127.0.0.1:9094 as node 42",
        "the SuperNode stopped serving after a TLS error on a connection to 127.0.0.1:9094; "
        "starting it again in 0.1 s",
    ]
    assert time.monotonic() - started < 60  # not the stalled one's 600 s


def test_a_site_whose_server_stopped_speaking_tls_exits_with_the_reason(
    tmp_path: Path, site_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server started again with --insecure: no restart would get through; the site
    exits at once, saying why."""
    import flplatform.deploy.site as site

    script = fake_supernode(tmp_path, monkeypatch, "plain-server gives-up")
    plan = plan_site(
        "london", server="127.0.0.1:9094", certs_dir=None, data=site_file, insecure=True
    )
    said: list[str] = []
    with pytest.raises(RunFailed, match="does not speak TLS"):
        site.run_site(plan, home=tmp_path / "home", say=said.append)
    assert said == [] and script.read_text() == "gives-up"  # one start only
