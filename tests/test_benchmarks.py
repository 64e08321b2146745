"""Every benchmark script still imports: they run rarely, by hand, and a renamed library
name would break one unseen (bench_hostile did)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_every_benchmark_script_imports() -> None:
    names = sorted(p.stem for p in BENCHMARKS.glob("bench_*.py"))
    assert len(names) >= 10
    code = "import importlib\n" + "".join(f"importlib.import_module({n!r})\n" for n in names)
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=BENCHMARKS,
        env={"PYTHONPATH": f"{BENCHMARKS}:{BENCHMARKS.parent}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
