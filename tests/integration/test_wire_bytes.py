"""The ledger's bytes are the wire's: a real deployment on 127.0.0.1, raw Flower commands.

A SuperLink with a database (insecure mode), two SuperNodes, ``flwr run`` of flplatform's
app for three rounds with federated evaluation; then the run's totals in the ledger
(``flplatform history runs --format json``) are compared with Flower's own count of the
run's traffic (``flwr ls --run-id N --format json``): within 1 %, each way. Rounds are
slow (a SuperNode polls every 3 s and starts a ClientApp process per message), so this
runs with ``make test-deploy`` (``-m deploy``), not in the default suite.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from flplatform.cli.app import app
from flplatform.launch.flower import flower_environment
from flplatform.launch.processes import ProcessTree
from tests.helpers.processes import start_flower_server, supernode

pytestmark = [pytest.mark.deploy, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CONNECTION = "wire"
ROUNDS = 3
RUN_TIMEOUT = 420  # seconds: 3 rounds of training and evaluation at ~20 s per exchange
TOLERANCE = 0.01  # the bound; the documented gaps are far below it


def flwr_json(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    """A ``flwr`` command's JSON output (``--format json``), or the test fails with it."""
    done = subprocess.run(
        [str(BIN / "flwr"), *args, "--format", "json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    data: dict[str, Any] = json.loads(done.stdout[done.stdout.index("{") :])
    assert data.get("success"), data
    return data


def test_ledger_totals_agree_with_flowers_traffic_count(
    tmp_path: Path, flplatform_home: Path
) -> None:
    env = flower_environment(flplatform_home)  # FLWR_HOME is flplatform_home/flwr
    flwr_home = Path(env["FLWR_HOME"])
    flwr_home.mkdir(parents=True, exist_ok=True)
    logs = tmp_path / "logs"
    logs.mkdir()

    def log(name: str) -> Any:
        return (logs / f"{name}.log").open("wb")

    with ProcessTree() as tree:
        try:
            _, link_port = start_flower_server(
                [
                    str(BIN / "flower-superlink"),
                    "--insecure",
                    "--database",
                    str(tmp_path / "superlink.db"),
                    "--disable-runtime-dependency-installation",
                    "--host",
                    "127.0.0.1",
                ],
                env=env,
                log=logs / "superlink.log",
                tree=tree,
            )
            (flwr_home / "config.toml").write_text(
                f'[superlink]\ndefault = "{CONNECTION}"\n[superlink.{CONNECTION}]\n'
                f'address = "127.0.0.1:{link_port}"\ninsecure = true\n'
            )
            for partition in range(2):
                start_flower_server(
                    supernode(link_port, f"partition-id={partition} num-partitions=2"),
                    env=env,
                    log=logs / f"supernode-{partition}.log",
                    tree=tree,
                )
            config = (
                f"num-server-rounds={ROUNDS} local-epochs=1 min-sites=2 "
                "sites='london,tokyo' fraction-evaluate=1.0"
            )
            run = tree.popen(
                [str(BIN / "flwr"), "run", str(ROOT), CONNECTION, "--stream", "-c", config],
                env=env,
                stdout=log("flwr-run"),
                stderr=subprocess.STDOUT,
            )
            deadline = time.monotonic() + RUN_TIMEOUT
            while run.poll() is None and time.monotonic() < deadline:
                tree.record()
                time.sleep(1.0)
            output = (logs / "flwr-run.log").read_text(errors="replace")
            assert run.returncode == 0, output[-4000:]

            # ---- Flower's count of the run's traffic (inbound: from the nodes)
            (listed,) = flwr_json(["ls", CONNECTION], env)["runs"]
            (flower,) = flwr_json(["ls", CONNECTION, "--run-id", listed["run-id"]], env)["runs"]
            assert flower["status"].startswith("finished"), flower
        finally:
            left = tree.stop()
        assert left == [], f"processes still running: {left}"

    # ---- the ledger's totals, as a user reads them
    db = f"sqlite:///{flplatform_home / 'ledger.db'}"
    shown = CliRunner().invoke(app, ["history", "runs", "--db", db, "--format", "json"])
    assert shown.exit_code == 0, shown.output
    (ledger,) = json.loads(shown.output)
    assert (ledger["status"], ledger["rounds_completed"]) == ("finished", ROUNDS)
    traffic = flower["network-traffic"]
    up, down = traffic["inbound-bytes"], traffic["outbound-bytes"]
    print(  # the measured agreement, for the report (pytest -s)
        f"ledger up {ledger['bytes_up']} / Flower inbound {up} "
        f"({ledger['bytes_up'] / up - 1:+.4%}); ledger down {ledger['bytes_down']} / "
        f"Flower outbound {down} ({ledger['bytes_down'] / down - 1:+.4%})"
    )
    assert ledger["bytes_up"] == pytest.approx(up, rel=TOLERANCE)
    assert ledger["bytes_down"] == pytest.approx(down, rel=TOLERANCE)

    # The site-information queries are in the ledger as their own traffic, one per site.
    rows = CliRunner().invoke(
        app, ["history", "traffic", "latest", "--db", db, "--kind", "query", "-f", "json"]
    )
    assert rows.exit_code == 0, rows.output
    queries = json.loads(rows.output)
    assert sorted(q["site"] for q in queries) == ["london", "tokyo"]
    assert all(q["messages"] == 1 and q["bytes_up"] > 0 and q["bytes_down"] > 0 for q in queries)
