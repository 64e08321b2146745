from __future__ import annotations
import subprocess, sys
from pathlib import Path
REPO_ROOT = Path(__file__).resolve().parents[2]

def test_old_race(ledger_url: str) -> None:
    script = (
        "import sys\n"
        "from storage import LedgerRepository\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"
        "with LedgerRepository.open(sys.argv[1]) as repo:\n"
        "    repo.create_run(name='r', strategy='s', seed=0, config={}, num_rounds_planned=1)\n"
    )
    processes = [subprocess.Popen([sys.executable, "-c", script, ledger_url], cwd=REPO_ROOT,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in processes:
        assert p.stdout.readline() == "ready\n"
    for p in processes:
        p.stdin.write("go\n"); p.stdin.flush()
    errors = [p.communicate(timeout=90)[1] for p in processes]
    assert [p.returncode for p in processes] == [0, 0], errors
