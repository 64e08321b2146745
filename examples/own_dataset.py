"""Bring your own data: a .npz with arrays x and y, trained by a simulated federation.

Writes a synthetic 4-class task (Gaussian blobs, 16 features) to ``blobs.npz`` and runs
local-SGD averaging over 3 sites with strong label skew, through the library API that the
CLI uses. The equivalent command line:

    flplatform data split --dataset blobs.npz --out sites/ --sites 3   # per-site files
    flplatform simulate --dataset blobs.npz --sites 3 --alpha 0.2 --rounds 10

Run it from the repository root: ``.venv/bin/python examples/own_dataset.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from flplatform.app.config import RunConfig
from flplatform.launch.flower import work_home
from flplatform.launch.simulation import run_simulation
from storage import LedgerRepository


def write_blobs(path: Path, *, n: int = 2000, classes: int = 4, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=3.0, size=(classes, 16))
    y = rng.integers(classes, size=n)
    x = (centres[y] + rng.normal(size=(n, 16))).astype(np.float32)
    np.savez(path, x=x, y=y)


def main() -> None:
    data = work_home() / "blobs.npz"
    write_blobs(data)
    config = RunConfig.from_mapping(
        {"dataset": str(data), "sites": "a,b,c", "alpha": 0.2, "num-server-rounds": 10}
    )
    record = run_simulation(config)
    with LedgerRepository.open() as repo:
        for r in repo.list_rounds(record.id):
            print(
                f"round {r.round:2d}  accuracy {r.metrics['accuracy']:.3f}  bytes up {r.bytes_up}"
            )
    print(f"run {record.id}: {record.status}; see `flplatform history sites {record.id}`")


if __name__ == "__main__":
    main()
