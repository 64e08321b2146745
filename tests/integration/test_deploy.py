"""A deployment for real on 127.0.0.1: certificates, `flplatform server`, `flplatform site`s.

The first test as a site administrator would do it: the CA and server certificate, three
site keys, a split of the data, the server, then (while it waits for its sites) every kind of
node that must be refused: an unregistered key, no key, plain text, another deployment's
CA, and a client of the Control API. Then the three sites train a 2-round federation with
TLS and authentication, while a peer on their own address holds 200 connections open
(issue 35's flood: every round applies every site's update). The ledger names the sites
by their registered names, the refused nodes are in it nowhere, each refusal was reported,
and every process is gone; Flower's own `flwr ls`, on the deployment's SuperLink state,
has the run completed.
Each machine (the server, each site) has a home of its own. The ledger is a PostgreSQL
database whose password, given in the URL, must appear in no file and no output. The
ledger's bytes are the wire's: its totals equal Flower's own count of the run's traffic
(`flwr ls`), within 1 % each way, with federated evaluation and the sites' queries. The
second kills the server mid-run, resumes the run on the sites still running, then runs it
again on the same sites, left alone: the resumed run ends with the same model, bit for bit.
The third has a registered site whose SuperNode runs no ClientApp: it is named silent after
the site query's deadline and no round waits for it. The fourth crashes a site's machine
mid-run and starts its site again at once (it waits to be let in, and joins), stops the
server with Ctrl-C and starts the next run on the same sites: every site trains every
round.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy.engine import make_url
from typer.testing import CliRunner

from flplatform.cli.app import app
from flplatform.deploy.gateway import MAX_CONNECTIONS_PER_ADDRESS
from flplatform.launch.flower import flower_environment, free_port
from flplatform.launch.processes import ProcessTree
from flplatform.run.run_record import DEPLOYED_EVENT
from flplatform.run.start import DEPLOYED_QUERY_SECONDS
from storage import LedgerRepository
from tests.helpers.flood import ConnectionFlood
from tests.helpers.processes import Machine, crash, wait_for_text

pytestmark = [pytest.mark.slow, pytest.mark.deploy]
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ROUNDS = 2
HONEST = ("london", "ohio", "tokyo")  # the first test's registered sites


def start_site(
    site: Machine, name: str, address: str, data: Path, tree: ProcessTree, logs: Path
) -> subprocess.Popen[bytes]:
    """`flplatform site NAME` on its machine, with its certs folder and data file."""
    certs = str(site.home / "certs")
    return site.start(
        tree, logs / f"{name}.log", "site", name, "--server", address, "--certs", certs,
        "--data", str(data),
    )  # fmt: skip


def test_a_deployment_with_tls_and_registered_sites(tmp_path: Path, password_database: str) -> None:
    server = Machine(tmp_path / "server")
    sites = {name: Machine(tmp_path / name) for name in (*HONEST, "evil")}
    # ---- certificates: the server's CA, each site's key, the public keys to the server
    certs = server.home / "certs"
    made = server.run("certs", "init", "--out", str(certs))
    assert made.returncode == 0, made.stderr
    for name, site in sites.items():
        made = site.run("certs", "site", name, "--out", str(site.home / "certs"))
        assert made.returncode == 0, made.stderr
        shutil.copy(certs / "ca.crt", site.home / "certs")
        if name != "evil":  # the administrator registers the honest sites only
            shutil.copy(site.home / "certs" / f"{name}.pub", certs)
    stranger_ca = tmp_path / "other-deployment"
    assert server.run("certs", "init", "--out", str(stranger_ca)).returncode == 0
    shutil.copy(sites["london"].home / "certs" / "london.key", stranger_ca)
    # ---- data: the split's site files, one to each site; the test set stays on the server
    split = server.home / "split"
    made = server.run("data", "split", "--out", str(split), "--sites", ",".join(HONEST))
    assert made.returncode == 0, made.stderr
    data = {name: site.home / f"{name}.npz" for name, site in sites.items()}
    for name in HONEST:
        shutil.copy(split / f"{name}.npz", data[name])
    shutil.copy(split / "london.npz", data["evil"])

    port = free_port()
    address = f"127.0.0.1:{port}"
    # The ledger is PostgreSQL (tests/postgres.py), its password given in the URL as a
    # careless administrator would: it must end up in no file and no output.
    ledger = password_database
    password = make_url(ledger).password
    assert password
    logs = tmp_path / "logs"
    logs.mkdir()
    tree = ProcessTree()
    try:
        server_proc = server.start(
            tree, logs / "server.log",
            "server", "--certs", str(certs), "--sites", ",".join(HONEST), "--address", address,
            "--rounds", str(ROUNDS), "--local-epochs", "1", "--dataset", str(split),
            "--partition", "files", "--db", ledger, "--wait-timeout", "180",
            "--fraction-evaluate", "1.0",
        )  # fmt: skip
        wait_for_text(logs / "server.log", "listening for sites", server_proc, tree, 120)

        # ---- refused: a key the server did not register
        evil = sites["evil"].run(
            "site", "evil", "--server", address, "--certs", str(sites["evil"].home / "certs"),
            "--data", str(data["evil"]),
        )  # fmt: skip
        assert evil.returncode == 7, evil.stdout + evil.stderr
        assert "refused by the server" in evil.stderr and "evil.pub is not registered" in (
            evil.stderr
        )
        # ---- refused: another deployment's CA (the site stops before starting its node)
        foreign = sites["london"].run(
            "site", "london", "--server", address, "--certs", str(stranger_ca),
            "--data", str(data["london"]),
        )  # fmt: skip
        assert foreign.returncode == 2
        assert "presented a certificate that" in foreign.stderr
        # ---- refused: a node with no key, and a node speaking plain HTTP (raw SuperNodes)
        flower = flower_environment(tmp_path / "raw")
        # (Its SuperExec outlives it for a while, holding its output: a file, not a pipe.)
        keyless = tree.popen(
            [str(BIN / "flower-supernode"), "--root-certificates", str(certs / "ca.crt"),
             "--superlink", address, "--port", str(free_port())],
            env=flower, stdout=(logs / "keyless.log").open("wb"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        assert keyless.wait(120) != 0
        assert "[code: 2001]" in (logs / "keyless.log").read_text()
        plain = tree.popen(
            [str(BIN / "flower-supernode"), "--insecure", "--superlink", address,
             "--port", str(free_port())],
            env=flower, stdout=(logs / "plain.log").open("wb"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        # ---- refused: the Control API from outside (registering a key of one's own)
        attacker = tmp_path / "attacker"
        attacker.mkdir()
        (attacker / "config.toml").write_text(
            f'[superlink]\ndefault = "x"\n[superlink.x]\naddress = "{address}"\n'
            f'root-certificates = "{certs / "ca.crt"}"\n'
        )
        register = subprocess.run(
            [str(BIN / "flwr"), "supernode", "register",
             str(sites["evil"].home / "certs" / "evil.pub"), "x", "--format", "json"],
            env={**flower, "FLWR_HOME": str(attacker)}, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert json.loads(register.stdout)["success"] is False
        wait_for_text(logs / "server.log", "spoke plain HTTP", server_proc, tree, 60)
        plain.terminate()

        # ---- the sites, while a peer on their address holds 200 connections open (as one
        # behind the sites' NAT could): every round still applies every site's update
        with ConnectionFlood("127.0.0.1", port, certs / "ca.crt", count=200) as flood:
            members = {
                name: start_site(sites[name], name, address, data[name], tree, logs)
                for name in HONEST
            }
            deadline = time.monotonic() + 300
            while server_proc.poll() is None and time.monotonic() < deadline:
                tree.record()
                time.sleep(1)
        output = (logs / "server.log").read_text()
        assert flood.most_held >= MAX_CONNECTIONS_PER_ADDRESS  # it held the address's share
        assert server_proc.returncode == 0, output[-4000:]
        for name, proc in members.items():
            assert proc.poll() is None, (logs / f"{name}.log").read_text()
            proc.send_signal(signal.SIGTERM)  # how a service manager stops a site
        for name, proc in members.items():
            assert proc.wait(30) == 128 + signal.SIGTERM
            assert "stopped by the user (SIGTERM)" in (logs / f"{name}.log").read_text()
        tree.record()
        time.sleep(1)
        assert tree.alive() == [], "processes left behind"
    finally:
        tree.stop()

    # ---- what the server reported
    assert "all 3 sites connected: london, ohio, tokyo" in output
    reported = {
        "unregistered key SHA256:": "its key is not registered",
        "does not trust this server's certificate": "refused 127.0.0.1",
        "it has no registered key": "refused a SuperNode from 127.0.0.1",
        "spoke plain HTTP": "refused 127.0.0.1",
        "POST /v1/control/register-node": "only the Fleet API is served",
        # the flood, in a line a minute: its connections made way for the sites'
        "for a new one: too many connections open": "closed a connection from 127.0.0.1",
    }
    for said, also in reported.items():
        line = next((line for line in output.splitlines() if said in line), "")
        assert also in line, f"no report of {said!r}:\n{output}"
    # ---- what the ledger says
    registry = json.loads(next((server.home / "deployments").glob("*/registry.json")).read_text())
    node_ids = {site["name"]: site["node_id"] for site in registry["sites"]}
    with LedgerRepository.open(ledger) as repository:
        (run,) = repository.list_runs()
        assert run.status == "finished", run.error
        assert password not in json.dumps(run.config)
        assert [r.num_applied for r in repository.list_rounds(run.id)] == [3] * ROUNDS
        recorded = {s.name: s for s in repository.list_sites(run.id)}
        assert set(recorded) == set(HONEST)
        assert {name: s.node_id for name, s in recorded.items()} == node_ids
        assert all("claimed_name" not in s.profile for s in recorded.values())
        assert {u.site for u in repository.list_updates(run.id)} == set(HONEST)
        # marked deployed: `flplatform resume` will not train it on the server's machine
        events = [(e.kind, e.detail) for e in repository.list_events(run.id)]
        deployment = "ca-" + hashlib.sha256((certs / "ca.crt").read_bytes()).hexdigest()[:12]
        detail = {"sites": list(HONEST), "address": address, "deployment": deployment}
        assert events == [(DEPLOYED_EVENT, {**detail, "wait-timeout": 180.0})]
    # ---- Flower's view of the run: its SuperLink started again on the deployment's state
    # (as the next `flplatform server` does; plain, on a port of its own), asked by `flwr ls`
    (state,) = {path.parent for path in (server.home / "deployments").glob("*/superlink.db")}
    flower_home = tmp_path / "flwr-ls"
    flower_home.mkdir()
    link_port = free_port()
    (flower_home / "config.toml").write_text(
        f'[superlink]\ndefault = "x"\n[superlink.x]\naddress = "127.0.0.1:{link_port}"\n'
        "insecure = true\n"
    )
    flower = {**flower_environment(tmp_path / "ls-home"), "FLWR_HOME": str(flower_home)}
    link_tree = ProcessTree()
    try:
        link_tree.popen(
            [str(BIN / "flower-superlink"), "--insecure", "--database", str(state / "superlink.db"),
             "--disable-runtime-dependency-installation", "--host", "127.0.0.1",
             "--port", str(link_port)],
            env=flower, stdout=(logs / "ls-superlink.log").open("wb"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline, listed = time.monotonic() + 60, {}
        while time.monotonic() < deadline:
            answer = subprocess.run(
                [str(BIN / "flwr"), "ls", "x", "--format", "json"],
                env=flower, capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            listed = json.loads(answer.stdout)
            if listed.get("success"):
                break
            time.sleep(1)
        # Flower's own count of the run's traffic (inbound: from the nodes)
        runs = listed.get("runs", [{}])
        answer = subprocess.run(
            [str(BIN / "flwr"), "ls", "x", "--run-id", str(runs[0].get("run-id")),
             "--format", "json"],
            env=flower, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        (counted,) = json.loads(answer.stdout)["runs"]
    finally:
        link_tree.stop()
    # Before, the deployment stopped Flower as soon as the ledger said finished: the
    # SuperLink's state kept the run `running` (`finished:failed` once Flower gave it up).
    assert [r["status"] for r in runs] == ["finished:completed"], listed
    # ---- the ledger's bytes are the wire's: its totals (as a user reads them) against
    # Flower's count, within 1 % each way; training, evaluation and the sites' queries
    shown = CliRunner().invoke(app, ["history", "runs", "--db", ledger, "--format", "json"])
    assert shown.exit_code == 0, shown.output
    (totals,) = json.loads(shown.output)
    traffic = counted["network-traffic"]
    up, down = traffic["inbound-bytes"], traffic["outbound-bytes"]
    print(  # the measured agreement, for the report (pytest -s)
        f"ledger up {totals['bytes_up']} / Flower inbound {up} "
        f"({totals['bytes_up'] / up - 1:+.4%}); ledger down {totals['bytes_down']} / "
        f"Flower outbound {down} ({totals['bytes_down'] / down - 1:+.4%})"
    )
    assert totals["bytes_up"] == pytest.approx(up, rel=0.01)
    assert totals["bytes_down"] == pytest.approx(down, rel=0.01)
    queries = CliRunner().invoke(
        app, ["history", "traffic", "latest", "--db", ledger, "--kind", "query", "-f", "json"]
    )
    assert queries.exit_code == 0, queries.output
    asked = json.loads(queries.output)
    assert sorted(q["site"] for q in asked) == sorted(HONEST)
    assert all(q["messages"] == 1 and q["bytes_up"] > 0 and q["bytes_down"] > 0 for q in asked)
    with LedgerRepository.open(ledger) as repository:  # every site evaluated every round
        evaluated = repository.list_evaluations(run.id)
    assert sorted((e.round, e.site) for e in evaluated) == [
        (r, site) for r in range(1, ROUNDS + 1) for site in sorted(HONEST)
    ]
    # ---- the password: in no output, and in no file of the server's home or the logs
    for path in [*server.home.rglob("*"), *logs.rglob("*")]:
        if path.is_file():
            assert password.encode() not in path.read_bytes(), f"password in {path}"


def committed_rounds(
    ledger: str, count: int, server: subprocess.Popen[bytes], tree: ProcessTree, log: Path
) -> list[Any]:
    """The first run's rounds, once ``count`` of them are committed (the server running
    meanwhile; 300 s at most)."""
    deadline = time.monotonic() + 300
    rounds: list[Any] = []
    while len(rounds) < count and time.monotonic() < deadline:
        tree.record()
        assert server.poll() is None, log.read_text()[-3000:]
        time.sleep(0.5)
        with LedgerRepository.open(ledger) as repository:
            runs = repository.list_runs()
            rounds = repository.list_rounds(runs[0].id) if runs else []
    return rounds


def two_site_deployment(tmp_path: Path) -> tuple[Machine, dict[str, Machine], Path, Path]:
    """The server's CA, london's and ohio's keys registered, the data split and each site's
    file moved to its machine, as the README's steps say; (server, sites, certs, split)."""
    server = Machine(tmp_path / "server")
    sites = {name: Machine(tmp_path / name) for name in ("london", "ohio")}
    certs = server.home / "certs"
    assert server.run("certs", "init", "--out", str(certs)).returncode == 0
    for name, site in sites.items():
        assert site.run("certs", "site", name, "--out", str(site.home / "certs")).returncode == 0
        shutil.copy(certs / "ca.crt", site.home / "certs")
        shutil.copy(site.home / "certs" / f"{name}.pub", certs)
    split = server.home / "split"
    made = server.run("data", "split", "--out", str(split), "--sites", "london,ohio")
    assert made.returncode == 0, made.stderr
    for name, site in sites.items():  # as the split step says: the sites' files leave
        shutil.move(split / f"{name}.npz", site.home / f"{name}.npz")
    return server, sites, certs, split


def test_a_server_killed_outright_resumes_the_run_on_its_sites(tmp_path: Path) -> None:
    """Issue 35's resume: the server's command SIGKILLed after round 2 (the OOM killer, a
    reboot), the sites left running; `flplatform server --resume` trains the rest on them,
    with the state they kept (DTS: delayed averages, top-k with error feedback), and ends
    as the same run left alone does (run next, on the same sites). The server's machine
    never holds a site's data file (it could train on nothing else than its test set), and
    the rounds it had committed stay as they were."""
    server, sites, certs, split = two_site_deployment(tmp_path)
    ledger = f"sqlite:///{server.home / 'runs.db'}"
    address = f"127.0.0.1:{free_port()}"
    deployment = ("--certs", str(certs), "--address", address, "--db", ledger)
    logs = tmp_path / "logs"
    logs.mkdir()
    run_options = (
        "--sites", "london,ohio", "--rounds", "4", "--local-epochs", "1",
        "--dataset", str(split), "--strategy", "delayed", "--codec", "topk:0.1",
        "--partition", "files", "--wait-timeout", "180",
    )  # fmt: skip
    tree = ProcessTree()
    try:
        first = server.start(tree, logs / "server.log", "server", *deployment, *run_options)
        wait_for_text(logs / "server.log", "listening for sites", first, tree, 120)
        members = {
            name: start_site(site, name, address, site.home / f"{name}.npz", tree, logs)
            for name, site in sites.items()
        }
        before = committed_rounds(ledger, 2, first, tree, logs / "server.log")
        first.kill()  # the command alone: what it started must follow it
        assert first.wait(10) == -signal.SIGKILL

        mlflow = f"sqlite:///{tmp_path / 'mlflow.db'}"
        resumed = server.start(
            tree, logs / "resume.log", "server", *deployment, "--resume", "latest",
            "--wait-timeout", "180", "--mlflow", mlflow, "--experiment", "deployment",
        )  # fmt: skip
        assert resumed.wait(300) == 0, (logs / "resume.log").read_text()[-4000:]
        output = (logs / "resume.log").read_text()
        # The same run again, left alone, on the same sites (they reconnect to the new
        # server): what the resumed run must end as.
        alone = server.start(tree, logs / "alone.log", "server", *deployment, *run_options)
        assert alone.wait(300) == 0, (logs / "alone.log").read_text()[-4000:]
        for name, proc in members.items():
            assert proc.poll() is None, (logs / f"{name}.log").read_text()
            proc.send_signal(signal.SIGTERM)
        for proc in members.values():
            proc.wait(30)
    finally:
        tree.stop()

    resumed_from = int(output.split("from round ", 1)[1].split(" ", 1)[0])
    assert "Resuming run 1 (" in output and len(before) <= resumed_from < 4
    assert "on its 2 sites (london, ohio)" in output
    with LedgerRepository.open(ledger) as repository:
        run, reference = sorted(repository.list_runs(), key=lambda r: r.id)
        rounds = repository.list_rounds(run.id)
        updates = repository.list_updates(run.id)
        events = [e.kind for e in repository.list_events(run.id)]
        reference_rounds = repository.list_rounds(reference.id)
    assert run.status == "finished", run.error
    assert reference.status == "finished", reference.error
    assert [r.num_applied for r in rounds] == [2, 2, 2, 2]
    assert rounds[: len(before)] == before  # committed rounds are not written again
    assert sum(u.status == "applied" for u in updates if u.round > resumed_from) == 2 * (
        4 - resumed_from
    )  # the sites trained the rest
    assert {(u.round, u.site) for u in updates if u.status == "applied"} == {
        (r, s) for r in range(1, 5) for s in ("london", "ohio")
    }
    assert events == [DEPLOYED_EVENT, "resumed", DEPLOYED_EVENT]
    # DTS: each site's delayed periods and top-k residuals outlived the server, on its disk
    assert not [u.reason for u in updates if u.reason and "lost its state" in u.reason]
    # ... so the resumed run ends as the run left alone: the same model, bit for bit, and
    # the same accuracy every round (two sites: their sum does not depend on which
    # replied first).
    models = {
        r.id: server.run("export", str(r.id), "--db", ledger, "--out", str(tmp_path / f"{r.id}.pt"))
        for r in (run, reference)
    }
    assert all(done.returncode == 0 for done in models.values()), models
    resumed_model = torch.load(tmp_path / f"{run.id}.pt", weights_only=True)
    alone_model = torch.load(tmp_path / f"{reference.id}.pt", weights_only=True)
    assert list(resumed_model) == list(alone_model)
    for name, tensor in alone_model.items():
        assert torch.equal(resumed_model[name], tensor), name
    assert [r.metrics["accuracy"] for r in rounds] == [
        r.metrics["accuracy"] for r in reference_rounds
    ]
    # Logged to MLflow as it trained (--mlflow): every round, those before the kill too.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow)
    [logged] = client.search_runs([client.get_experiment_by_name("deployment").experiment_id])
    assert logged.info.status == "FINISHED"
    accuracy = client.get_metric_history(logged.info.run_id, "accuracy")
    assert sorted((m.step, m.value) for m in accuracy) == [
        (r.round, r.metrics["accuracy"]) for r in rounds
    ]
    assert "was logged to MLflow" in output
    # Nothing at the server to train on but its test set: the sites' files are theirs.
    assert not [p for p in server.home.rglob("*.npz") if p.name in ("london.npz", "ohio.npz")]


SILENT_WAIT = 90  # s: --wait-timeout, for a site to connect and then to answer


def test_a_site_that_runs_no_clientapp_is_named_and_no_round_waits_for_it(tmp_path: Path) -> None:
    """Issue 35's silent site: a registered SuperNode that takes the run's messages and
    never runs a ClientApp for them (here: Flower's "process" isolation with no ClientApp
    process beside it; after a server stop, a stale SuperNode). The server names it once
    the site query's deadline passes (60 s on a deployment), waits for it as long as for a
    site to connect (--wait-timeout), then trains on the other site: no round waits for
    it, and the ledger says why it trained nothing."""
    server, sites, certs, split = two_site_deployment(tmp_path)
    ledger = f"sqlite:///{server.home / 'runs.db'}"
    address = f"127.0.0.1:{free_port()}"
    logs = tmp_path / "logs"
    logs.mkdir()
    tree = ProcessTree()
    try:
        run = server.start(
            tree, logs / "server.log", "server", "--certs", str(certs), "--address", address,
            "--db", ledger, "--sites", "london,ohio", "--rounds", "1", "--local-epochs", "1",
            "--fraction-evaluate", "0", "--dataset", str(split), "--partition", "files",
            "--wait-timeout", str(SILENT_WAIT),
        )  # fmt: skip
        wait_for_text(logs / "server.log", "listening for sites", run, tree, 120)
        london = start_site(
            sites["london"], "london", address, sites["london"].home / "london.npz", tree, logs
        )
        ohio = sites["ohio"]
        tree.popen(
            [
                str(BIN / "flower-supernode"),
                *("--root-certificates", str(ohio.home / "certs" / "ca.crt")),
                *("--auth-supernode-private-key", str(ohio.home / "certs" / "ohio.key")),
                *("--superlink", address, "--isolation", "process"),
                *("--node-config", f'data-path="{ohio.home / "ohio.npz"}" site-name="ohio"'),
            ],
            env=ohio.env,
            cwd=str(ohio.home),
            stdout=(logs / "ohio.log").open("wb"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        assert run.wait(400) == 0, (logs / "server.log").read_text()[-4000:]
        assert london.poll() is None, (logs / "london.log").read_text()
    finally:
        tree.stop()

    output = (logs / "server.log").read_text()
    assert "at start-up: site ohio is silent: its SuperNode is connected but did not answer" in (
        output
    )
    assert "the first round waits for it up to" in output  # then it starts without ohio
    with LedgerRepository.open(ledger) as repository:
        [record] = repository.list_runs()
        rounds = repository.list_rounds(record.id)
        updates = repository.list_updates(record.id)
        events = [(e.kind, e.detail) for e in repository.list_events(record.id)]
    assert record.status == "finished", record.error
    assert [r.num_applied for r in rounds] == [1]
    assert {u.site for u in updates} == {"london"}  # ohio was sent no work at all
    silent = [d for kind, d in events if kind == "site-silent"]
    # the deployment's deadline, not the 300 s the start waited before; then the start
    # waited for it until its --wait-timeout
    assert [(d["site"], d["waited"]) for d in silent] == [("ohio", 60.0)]
    assert 0 < silent[0]["start_wait"] <= SILENT_WAIT - 60
    # ... and a user reading the run's rounds sees who trained, who did not and why
    shown = CliRunner().invoke(app, ["history", "rounds", "latest", "--db", ledger, "-f", "json"])
    assert shown.exit_code == 0, shown.output
    [row] = json.loads(shown.output)
    assert row["trained"] == ["london"]
    assert row["not_trained"] == {"ohio": "away: silent at start-up"}


def test_after_a_server_stopped_with_ctrl_c_the_next_run_trains_on_every_site(
    tmp_path: Path,
) -> None:
    """Issue 35's restarts: a site's machine crashed mid-run and its site started again at
    once, then the server stopped with SIGINT (Ctrl-C), the sites left running, and the
    next run started at once, while the SuperLink still counts the crashed SuperNode.
    Before, a site restarted within a minute of a crash was refused and exited; a site
    took the new run's messages and never trained, every round waiting out its 600 s
    timeout; and the new run started without the restarted site. Now the restarted site
    waits until it is let in, the new run starts once every site has answered it, and
    every site trains every round, no round waiting for a silent site longer than the
    site query's deadline (DEPLOYED_QUERY_SECONDS)."""
    server, sites, certs, split = two_site_deployment(tmp_path)
    ledger = f"sqlite:///{server.home / 'runs.db'}"
    address = f"127.0.0.1:{free_port()}"
    logs = tmp_path / "logs"
    logs.mkdir()
    options = (
        "--certs", str(certs), "--address", address, "--db", ledger, "--sites", "london,ohio",
        "--local-epochs", "1", "--fraction-evaluate", "0", "--dataset", str(split),
        "--partition", "files", "--wait-timeout", "180",
    )  # fmt: skip
    tree = ProcessTree()
    try:
        first = server.start(tree, logs / "first.log", "server", *options, "--rounds", "20")
        wait_for_text(logs / "first.log", "listening for sites", first, tree, 120)
        members = {
            name: start_site(site, name, address, site.home / f"{name}.npz", tree, logs)
            for name, site in sites.items()
        }
        committed_rounds(ledger, 1, first, tree, logs / "first.log")
        # ohio's machine crashes (its site, SuperNode and ClientApp at once) and its site
        # is started again at once, while the SuperLink still counts its old node online
        crash(members["ohio"])
        restarts = logs / "restarted"
        restarts.mkdir()
        members["ohio"] = start_site(
            sites["ohio"], "ohio", address, sites["ohio"].home / "ohio.npz", tree, restarts
        )
        first.send_signal(signal.SIGINT)  # Ctrl-C at the server's terminal
        assert first.wait(60) == 130, (logs / "first.log").read_text()[-3000:]

        started = time.monotonic()
        second = server.start(tree, logs / "second.log", "server", *options, "--rounds", "2")
        assert second.wait(400) == 0, (logs / "second.log").read_text()[-4000:]
        took = time.monotonic() - started
        # held off until the old node's heartbeat lapsed, it waited and joined; not exited
        assert "as node" in (restarts / "ohio.log").read_text()
        for name, proc in members.items():
            log = restarts / "ohio.log" if name == "ohio" else logs / f"{name}.log"
            assert proc.poll() is None, log.read_text()
    finally:
        tree.stop()

    with LedgerRepository.open(ledger) as repository:
        stopped, after = sorted(repository.list_runs(), key=lambda r: r.id)
        rounds = repository.list_rounds(after.id)
        updates = repository.list_updates(after.id)
    assert stopped.status == "failed" and "SIGINT" in (stopped.error or "")
    assert after.status == "finished", after.error
    assert [r.num_applied for r in rounds] == [2, 2]  # both sites, every round
    assert {(u.round, u.site) for u in updates if u.status == "applied"} == {
        (r, s) for r in (1, 2) for s in ("london", "ohio")
    }
    assert all(r.wall_seconds < DEPLOYED_QUERY_SECONDS for r in rounds), [
        r.wall_seconds for r in rounds
    ]
    assert took < 300  # the start, the sites' reconnection and two rounds; not a timeout
