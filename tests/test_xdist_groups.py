"""`make test`'s workers keep an xdist_group together (pytest-xdist's ``--dist loadgroup``).

The hostile suite runs its sweep once for the module, as the resume tests their runs
left alone, and the tests that share one carry one ``xdist_group``: spread over workers,
each worker would run it again. Grouping rests on pytest letting pytest-xdist rename a
test's node id, which pytest 9.2 stopped (pyproject.toml's dev extra pins below it); this
runs two grouped tests on two workers, as `make test` runs the suite, and checks they
shared one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

GROUPED = """
import os

import pytest


@pytest.mark.xdist_group("together")
@pytest.mark.parametrize("n", range(4))
def test_grouped(n):
    with open(os.environ["WORKERS_FILE"], "a") as seen:
        seen.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""


def test_an_xdist_group_runs_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not this project's configuration
    seen = tmp_path / "workers.txt"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p"]
        + ["no:cacheprovider", "test_grouped.py"],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "WORKERS_FILE": str(seen)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:]
    workers = seen.read_text().split()
    assert len(workers) == 4
    assert len(set(workers)) == 1, (
        f"the group's tests ran on {sorted(set(workers))}: pytest-xdist's loadgroup does not "
        f"group under pytest {__import__('pytest').__version__}; install the pytest that "
        "pyproject.toml's dev extra pins"
    )
