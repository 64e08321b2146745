"""A real deployment on 127.0.0.1: a SuperLink, two SuperNodes reading their own files."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flplatform.cli.app import app
from flplatform.launch.flower import flower_environment
from storage import LedgerRepository
from tests.helpers.processes import start_flower_server, supernode

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_sites_read_only_their_own_files(tmp_path: Path, flplatform_home: Path) -> None:
    split = CliRunner().invoke(
        app, ["data", "split", "--out", str(tmp_path / "sites"), "--sites", "london,tokyo"]
    )
    assert split.exit_code == 0, split.output

    env = flower_environment(flplatform_home)
    processes: list[subprocess.Popen[bytes]] = []
    try:
        superlink, link_port = start_flower_server(
            [
                str(BIN / "flower-superlink"),
                "--insecure",
                "--disable-runtime-dependency-installation",
                "--host",
                "127.0.0.1",
            ],
            env=env,
            log=tmp_path / "superlink.log",
        )
        processes.append(superlink)
        (flplatform_home / "flwr" / "config.toml").write_text(
            f'[superlink]\ndefault = "lab"\n[superlink.lab]\n'
            f'address = "127.0.0.1:{link_port}"\ninsecure = true\n'
        )
        for site in ("london", "tokyo"):
            node_config = f'data-path="{tmp_path / "sites" / f"{site}.npz"}" site-name="{site}"'
            node, _ = start_flower_server(
                supernode(link_port, node_config),
                env=env,
                log=tmp_path / f"{site}.log",
            )
            processes.append(node)
        done = subprocess.run(
            [
                str(BIN / "flwr"),
                "run",
                str(ROOT),
                "lab",
                "--stream",
                "-c",
                "num-server-rounds=2 local-epochs=1 min-sites=2 sites='london,tokyo'",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        for proc in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    with LedgerRepository.open(f"sqlite:///{flplatform_home / 'ledger.db'}") as repo:
        (run,) = repo.list_runs()
        assert run.status == "finished"
        sites = {s.name: s for s in repo.list_sites(run.id)}
        assert set(sites) == {"london", "tokyo"}
        # Each site trained on its own file (less its 10% local validation slice).
        import numpy as np

        for name, site in sites.items():
            n = len(np.load(tmp_path / "sites" / f"{name}.npz")["y"])
            assert site.num_examples == n - int(n * 0.1)
        assert [r.num_applied for r in repo.list_rounds(run.id)] == [2, 2]
