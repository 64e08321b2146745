"""Server-side cost of one round without training: aggregation + ledger writes.

Drives the real ``RoundEngine`` with ``LocalSGDAveraging`` and the SQLite ledger over a
replay Grid: a Grid that answers every training message with a fresh reply carrying a
1M-parameter model (built from pre-serialized arrays, so no training and no network).
The grid returns every ready reply it is asked for, as a SuperLink does; the engine's own
chunked pulling is what bounds memory. For 10, 100 and 1000
replies it reports the round's wall time split into aggregation and ledger writes, and
the peak of Python-tracked memory (NumPy buffers included) during the round.

Goal: peak memory independent of the number of replies (streaming aggregation): it may
grow up to one pull chunk of replies (PULL_CHUNK, 16) and must stay flat beyond that.

    python benchmarks/bench_round.py [--replies 10 100 1000] [--params 1000000]
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterable
from itertools import count
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from flplatform import keys
from flplatform.engine import RoundEngine, RoundSummary, Synchrony
from flplatform.engine.engine import PULL_CHUNK
from flplatform.ledger import SqlLedger
from storage import LedgerRepository
from strategies.local_sgd import LocalSGDAveraging


def model_shapes(num_params: int) -> dict[str, tuple[int, ...]]:
    """Four tensors, like a small MLP, totalling ``num_params``."""
    hidden = 1000
    first = num_params // 2 // hidden
    second = (num_params - first * hidden - 2 * hidden) // hidden
    shapes = {"fc1.weight": (hidden, first), "fc1.bias": (hidden,), "fc2.weight": (second, hidden)}
    shapes["fc2.bias"] = (num_params - sum(int(np.prod(s)) for s in shapes.values()),)
    return shapes


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


class ReplayGrid(Grid):
    """Answers TRAIN messages with trained-looking models, QUERY messages with a site name."""

    def __init__(self, num_nodes: int, shapes: dict[str, tuple[int, ...]]) -> None:
        self.nodes = list(range(1, num_nodes + 1))
        rng = np.random.default_rng(0)
        # Eight distinct serialized models; each reply wraps one in fresh Flower objects,
        # so hashing and deflating cost what they cost for a reply off the network.
        self.payloads = [
            {k: npy_bytes(rng.normal(size=s).astype(np.float32)) for k, s in shapes.items()}
            for _ in range(8)
        ]
        self.shapes = shapes
        self.pending: dict[str, Message] = {}
        self.ids = count()

    def set_run(self, run) -> None:  # noqa: ANN001
        pass

    @property
    def run(self):  # noqa: ANN201
        raise AttributeError("no run")

    def create_message(self, *args, **kwargs) -> Message:  # noqa: ANN002, ANN003
        raise AssertionError("the engine builds its own messages")

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            message_id = f"m{next(self.ids)}"
            msg.metadata.__dict__["_message_id"] = message_id
            self.pending[message_id] = msg
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = []
        for message_id in message_ids:
            msg = self.pending.pop(message_id)
            replies.append(self._reply(msg, message_id))
        return replies

    def send_and_receive(self, messages, *, timeout=None):  # noqa: ANN001, ANN201
        raise AssertionError("the engine never uses send_and_receive")

    def _reply(self, msg: Message, message_id: str) -> Message:
        node = msg.metadata.dst_node_id
        msg.metadata.__dict__["_message_id"] = message_id
        if msg.metadata.message_type == "query":
            info = ConfigRecord({keys.SITE_NAME: f"site-{node}", keys.NUM_EXAMPLES: 100})
            return Message(RecordDict({keys.SITE_INFO: info}), reply_to=msg)
        payload = self.payloads[node % len(self.payloads)]
        arrays = ArrayRecord(
            {
                # Each reply owns its bytes, as one decoded off the network does.
                k: Array(
                    dtype="float32",
                    shape=self.shapes[k],
                    stype="numpy.ndarray",
                    data=bytes(bytearray(data)),
                )
                for k, data in payload.items()
            }
        )
        metrics = MetricRecord({keys.NUM_EXAMPLES: 100 + node, keys.TRAIN_LOSS: 0.5})
        return Message(RecordDict({keys.ARRAYS: arrays, keys.METRICS: metrics}), reply_to=msg)


class TimedLedger(SqlLedger):
    """The SQL ledger, timing its round writes."""

    seconds = 0.0

    def record_round(self, summary: RoundSummary) -> None:
        started = time.perf_counter()
        super().record_round(summary)
        self.seconds += time.perf_counter() - started


def measure(num_replies: int, shapes: dict[str, tuple[int, ...]], workdir: Path) -> dict:
    grid = ReplayGrid(num_replies, shapes)
    repo = LedgerRepository.open(f"sqlite:///{workdir / f'bench-{num_replies}.db'}")
    run_id = repo.create_run(
        name="bench", strategy="local-sgd", seed=0, config={}, num_rounds_planned=1
    )
    ledger = TimedLedger(repo, run_id)
    engine = RoundEngine(
        grid,
        LocalSGDAveraging(),
        policy=Synchrony("sync"),
        ledger=ledger,
        required_sites=num_replies,
        poll_interval=0.0,
    )
    rng = np.random.default_rng(1)
    initial = ArrayRecord(
        {k: Array(rng.normal(size=s).astype(np.float32)) for k, s in shapes.items()}
    )
    engine.discover_sites()
    summaries: list[RoundSummary] = []
    engine.on_round = summaries.append
    engine.discover_sites = lambda: engine.sites  # type: ignore[method-assign]

    tracemalloc.start()
    baseline = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    started = time.perf_counter()
    engine.run(initial, num_rounds=1)
    seconds = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1] - baseline
    tracemalloc.stop()
    repo.close()

    (summary,) = summaries
    assert all(u.status == "applied" for u in summary.updates), "every reply must be applied"
    return {
        "replies": num_replies,
        "round_seconds": round(seconds, 4),
        "aggregation_seconds": round(seconds - ledger.seconds, 4),
        "ledger_seconds": round(ledger.seconds, 4),
        "ms_per_reply": round(1000 * seconds / num_replies, 3),
        "peak_memory_mib": round(peak / 2**20, 1),
        "bytes_up_per_reply": summary.bytes_up // num_replies,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replies", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--params", type=int, default=1_000_000)
    args = parser.parse_args()
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
    shapes = model_shapes(args.params)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.replies:
            results.append(measure(n, shapes, Path(tmp)))
            print(json.dumps(results[-1]), file=sys.stderr)
    model_mib = 4 * sum(int(np.prod(s)) for s in shapes.values()) / 2**20
    peaks = [r["peak_memory_mib"] for r in results]
    print(
        json.dumps(
            {
                "benchmark": "server_round_without_training",
                "model_parameters": args.params,
                "model_mib": round(model_mib, 2),
                "machine": {
                    "python": platform.python_version(),
                    "cpus": __import__("os").cpu_count(),
                },
                "results": results,
                "goal": "peak memory flat once replies exceed one pull chunk",
                "pull_chunk": PULL_CHUNK,
                "peak_memory_ratio_max_over_min": round(max(peaks) / min(peaks), 2),
                "peak_memory_ratio_beyond_one_chunk": round(max(beyond) / min(beyond), 2)
                if (beyond := [r["peak_memory_mib"] for r in results if r["replies"] > PULL_CHUNK])
                else None,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
