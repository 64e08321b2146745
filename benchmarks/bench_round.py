"""The server's cost per reply: byte metering, decoding and aggregation, by the real engine.

Drives the real ``RoundEngine`` with ``LocalSGDAveraging`` and the SQLite ledger over a
replay Grid: a Grid that answers every training message with a fresh reply carrying a
1M-parameter model (built from pre-serialized arrays, so no training and no network;
each reply owns its bytes, as one Flower decoded off the network does, and a site sends
another model each round). The grid returns every ready reply it is asked for, as a
SuperLink does; the engine's own chunked pulling is what bounds memory.

Each run is two rounds; the second is timed (the first also pays the server's one-time
costs: its model-sized float64 memory, kept from round to round). For 10, 100 and 1000
replies per round it reports, as the median of ``--repeat`` runs, the milliseconds per
reply each part of the server takes (exclusive times: a part called inside another counts
for the inner one), the round's fixed costs (the server step) included:

* ``metering``: what every message and reply costs on the wire (``engine/wire.py``);
* ``decoding``: the replies' arrays (and the model, once per version) into NumPy;
* ``aggregation``: the strategy's reading of each update (checks, Δ_n against the
  model) and its weighted sum, and the round's server step (x + η·Δ̄, encoded);
* ``guard``: the update guard (``--guard``: the platform's default one; otherwise off,
  ``RoundEngine``'s own default, which still takes each update's norm);
* ``ledger``: the round's rows written to SQLite;
* ``engine``: the rest of the round's bookkeeping (the replay grid's own work, building
  the replies, is left out, as is the bytes check below).

Goal: metering + decoding + aggregation at most 2 ms per reply of a 1M-parameter model
(``goal_ms_per_1m_params``, for every reply count: ``goal_met``), with the bytes recorded
equal to Flower's own measure (checked on each run's first reply against the slow
reference, ``tests.helpers.fleet_oracle.naive_reply``: every object hashed and
deflated by Flower's own functions). Also: peak memory independent of the number of
replies (streaming aggregation), from a separate run under ``tracemalloc``: it may grow up
to one pull chunk of replies (PULL_CHUNK, 16) and must stay flat beyond that.

Measured on this machine (2 cores, shared with three other sessions' simulations: load
average 1.7 to 2.7 over the runs; 1M parameters, guard off; three invocations of
``--repeat 3``, the median of the nine and their range), in ms per reply:

    replies   metering + decoding + aggregation    before: the whole round, per reply
    10        1.97  (1.78 to 2.41)                  16.6
    100       1.76  (1.42 to 5.38: one disturbed)   12.2
    1000      1.99  (1.57 to 2.84)                  17.7

  The parts at 100 replies (the third invocation, load 2.6): metering 0.19, decoding
  0.06, aggregation 1.31 (per update about 0.23 checking it, 0.55 its Δ_n, 0.44 adding
  it; then the round's step), guard off 0.49 (the norm), ledger 0.10, engine 0.32: the
  server in all 2.49 ms per reply, where metering alone took about 3.8 (hashing and
  deflating every reply) and reading an update 3.2 (np.load's copies, temporaries).
  Goal met in two invocations of three; the second ran beside another session's
  simulation (load 2.4 to 2.6). Bytes equal to Flower's in every run. Peak
  memory 67, 90 and 93 MiB for 10, 100 and 1000 replies (was 61, 115 and 116). With
  ``--guard``: the guard adds about 1.1 ms per reply; it held every update of the first
  round until the round closed (no reference norms yet): 779 MiB at 100 replies. It now
  judges them once it has ``min_reference`` norms (benchmarks/bench_server_memory.py).

``--aggregator`` (default: the platform's, ``centered-clip``; ``LocalSGDAveraging()``'s own
default is ``mean``): centred clipping adds two passes over each update (its offset from
the centre, its norm). Measured 2026-11-29 (load average 1.0, 10 and 100 replies, median
of 3): metering + decoding + aggregation 2.98 and 2.62 ms per reply with ``mean``, 3.47
and 3.60 with ``centered-clip`` (aggregation alone 2.27 against 3.25 at 100 replies); peak
memory 8 MiB more (the centre and the next one, float64). Neither met the 2 ms goal then.
At 10M parameters (``--params 10000000 --repeat 1``, 100 replies): aggregation 23.2 ms per
reply with ``mean``, 30.9 with ``centered-clip``; peak memory 897 and 973 MiB.

``--flower-strategy NAME`` (``FedAvg``, ``QFedAvg``, ``Bulyan``) runs one of Flower's own
strategies under the engine instead (``FlowerStrategyAdapter``: the round's replies kept,
aggregated at its end by the strategy's ``aggregate_train``); its whole time per reply is
``aggregation`` (the adapter decodes in its ``read_update``). It keeps every reply of the
round, so its memory grows with them (the memory goal is not its), and Bulyan's Krum is
quadratic in the replies: replies default to 10 and 100 then. QFedAvg and Bulyan run a
full ``gc.collect()`` for each reply they convert; the adapter hides the process's objects
from those collections. Measured
2026-12-06 (QFedAvg, 1M parameters, 10 and 100 replies, median of 3, load average 2.4 to
4.6): aggregation 10.4 and 9.3 ms per reply; 130.2 and 134.3 before the adapter froze the
heap. At 10M parameters (``--params 10000000 --replies 10 --repeat 1``): 51.8 ms per reply
against 142.9 (the heap walk saved is the same ~90 ms; converting 40 MB is the rest); peak
memory 573 MiB either way (every reply kept). 100 replies at 10M (4 GB of kept replies)
were not run.

    python benchmarks/bench_round.py [--replies 10 100 1000] [--params 1000000] [--repeat 3]
                                     [--guard] [--aggregator mean|centered-clip|...]
                                     [--flower-strategy FedAvg|QFedAvg|Bulyan]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections import defaultdict
from collections.abc import Callable, Iterable
from itertools import count
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp import strategy as flower_strategies
from flwr.supercore.task_identity import TaskIdentity

import flplatform.engine.engine as engine_module
import flplatform.engine.mailbox as mailbox_module
import strategies.local_sgd as local_sgd_module
from flplatform.app.config import RunConfig
from flplatform.core import keys
from flplatform.engine import RoundSummary, Synchrony
from flplatform.engine.engine import PULL_CHUNK, RoundEngine
from flplatform.engine.guard import GuardOptions, UpdateGuard
from flplatform.engine.wire import reply_traffic
from flplatform.run.flower_adapter import FlowerStrategyAdapter
from flplatform.run.ledger import SqlLedger
from storage import LedgerRepository
from strategies.local_sgd import LocalSGDAveraging
from tests.helpers.fleet_oracle import naive_reply

ROUNDS = 2  # the first pays the server's one-time costs (its model-sized memory): not timed
GOAL_MS_PER_1M = 2.0  # metering + decoding + aggregation, per reply of a 1M-parameter model
GOAL_PARTS = ("metering", "decoding", "aggregation")
PARTS = (*GOAL_PARTS, "guard", "ledger", "engine")
# Flower's own strategies, as a user builds them (Bulyan needs 4·1 + 3 = 7 replies or more).
FLOWER_STRATEGIES: dict[str, Callable[[], Any]] = {
    "FedAvg": flower_strategies.FedAvg,
    "QFedAvg": lambda: flower_strategies.QFedAvg(client_learning_rate=0.1),
    "Bulyan": lambda: flower_strategies.Bulyan(num_malicious_nodes=1),
}


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
        self.answered: dict[int, int] = defaultdict(int)  # a site's replies so far

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
        # another model each round: a site never sends the same one twice (a replay)
        payload = self.payloads[(node + self.answered[node]) % len(self.payloads)]
        self.answered[node] += 1
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


class Stopwatch:
    """Exclusive seconds by part: time spent in a timed call inside another timed call
    counts for the inner one only."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._inner: list[float] = []

    def wrap(self, part: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            self._inner.append(0.0)
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                self.seconds[part] += elapsed - self._inner.pop()
                if self._inner:
                    self._inner[-1] += elapsed

        return timed


class Checked:
    """``reply_traffic`` that, for the first reply it meets, compares its answer with the
    slow reference (timed apart, as ``check``: not the server's work)."""

    def __init__(self, watch: Stopwatch) -> None:
        self.timed = watch.wrap("metering", reply_traffic)
        self.reference = watch.wrap("check", naive_reply)
        self.equal: bool | None = None

    def __call__(self, reply: Message) -> Any:
        traffic = self.timed(reply)
        if self.equal is None:
            self.equal = traffic == self.reference(reply)
        return traffic


def instrument(
    watch: Stopwatch, engine: RoundEngine, strategy: Any, grid: Grid
) -> tuple[Checked, list[tuple[Any, str, Any]]]:
    """Time the engine's parts by wrapping what it calls; returns what to put back."""
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, part: str) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, watch.wrap(part, getattr(owner, name)))

    for module in (engine_module, mailbox_module):
        for name in ("measure", "delivery_bytes"):
            if hasattr(module, name):
                patch(module, name, "metering")
    checked = Checked(watch)
    for module in (engine_module, mailbox_module):
        if hasattr(module, "reply_traffic"):
            saved.append((module, "reply_traffic", module.reply_traffic))
            module.reply_traffic = checked  # type: ignore[attr-defined]
    for name in ("record_views",):
        patch(local_sgd_module, name, "decoding")
    for name in ("begin_aggregation", "read_update", "add_update", "finish_aggregation"):
        patch(strategy, name, "aggregation")
    for name in ("consider", "settle", "round_finished"):
        patch(engine.guard, name, "guard")
    patch(engine_module, "fingerprint", "guard")
    for name in ("push_messages", "pull_messages"):
        patch(grid, name, "grid")
    return checked, saved


def measure(
    num_replies: int,
    shapes: dict[str, tuple[int, ...]],
    workdir: Path,
    *,
    guard: bool,
    memory: bool,
    aggregator: str = "mean",
    flower: str | None = None,
) -> dict[str, Any]:
    """One round with ``num_replies`` replies: its parts' times, or (``memory``) its peak
    memory under tracemalloc."""
    grid = ReplayGrid(num_replies, shapes)
    repo = LedgerRepository.open(
        f"sqlite:///{workdir / f'bench-{num_replies}-{time.time_ns()}.db'}"
    )
    run_id = repo.create_run(
        name="bench", strategy="local-sgd", seed=0, config={}, num_rounds_planned=1
    )
    watch = Stopwatch()
    ledger = SqlLedger(repo, run_id)
    ledger.record_round = watch.wrap("ledger", ledger.record_round)  # type: ignore[method-assign]
    strategy: Any = (
        FlowerStrategyAdapter(FLOWER_STRATEGIES[flower]())
        if flower
        else LocalSGDAveraging(aggregator=aggregator)
    )
    engine = RoundEngine(
        grid,
        strategy,
        policy=Synchrony("sync"),
        ledger=ledger,
        required_sites=num_replies,
        poll_interval=0.0,
        guard=UpdateGuard(GuardOptions() if guard else GuardOptions.off()),
    )
    rng = np.random.default_rng(1)
    initial = ArrayRecord(
        {k: Array(rng.normal(size=s).astype(np.float32)) for k, s in shapes.items()}
    )
    engine.discover_sites()
    summaries: list[RoundSummary] = []
    warm: list[tuple[float, dict[str, float]]] = []  # when round 1 ended, and its parts

    def finished(summary: RoundSummary) -> None:
        summaries.append(summary)
        warm.append((time.perf_counter(), dict(watch.seconds)))

    engine.on_round = finished
    engine.discover_sites = lambda: engine.sites  # type: ignore[method-assign]

    checked, saved = instrument(watch, engine, strategy, grid) if not memory else (None, [])
    try:
        if memory:
            tracemalloc.start()
            baseline = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
        engine.run(initial, num_rounds=ROUNDS)
        ended = time.perf_counter()
        if memory:
            peak = tracemalloc.get_traced_memory()[1] - baseline
            tracemalloc.stop()
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
        repo.close()

    assert len(summaries) == ROUNDS
    for summary in summaries:
        assert all(u.status == "applied" for u in summary.updates), "every reply is applied"
    if memory:
        return {"peak_memory_mib": round(peak / 2**20, 1)}
    # the last round's share: everything after the one before it ended
    started, before = warm[-2]
    seconds = ended - started
    parts = {part: total - before.get(part, 0.0) for part, total in watch.seconds.items()}
    # Not the server's work: the replay grid's (building replies) and the bytes check's.
    server = seconds - parts.pop("grid", 0.0) - parts.pop("check", 0.0)
    parts["engine"] = server - sum(parts.get(p, 0.0) for p in PARTS if p != "engine")
    return {
        "round_seconds": seconds,
        "server_seconds": server,
        "parts": {p: parts.get(p, 0.0) for p in PARTS},
        "bytes_up_per_reply": summary.bytes_up // num_replies,
        "bytes_equal_flower_reference": checked.equal if checked is not None else None,
    }


def summarize(num_replies: int, runs: list[dict[str, Any]], params: int, peak: float) -> dict:
    """The median run's numbers per reply, in ms and in ms per 1M parameters."""
    per_reply = 1000 / num_replies
    per_1m = 1_000_000 / params
    goal = [per_reply * sum(r["parts"][p] for p in GOAL_PARTS) * per_1m for r in runs]
    return {
        "replies": num_replies,
        "runs": len(runs),
        "round_seconds": round(statistics.median(r["round_seconds"] for r in runs), 4),
        "ms_per_reply": {
            **{
                p: round(statistics.median(per_reply * r["parts"][p] for r in runs), 3)
                for p in PARTS
            },
            "server_total": round(
                statistics.median(per_reply * r["server_seconds"] for r in runs), 3
            ),
        },
        "goal_ms_per_1m_params": round(statistics.median(goal), 3),
        "goal_ms_per_1m_params_runs": [round(g, 3) for g in goal],
        "peak_memory_mib": peak,
        "bytes_up_per_reply": runs[0]["bytes_up_per_reply"],
        "bytes_equal_flower_reference": all(r["bytes_equal_flower_reference"] for r in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--replies",
        type=int,
        nargs="+",
        help="per round (default 10 100 1000; 10 100 with --flower-strategy)",
    )
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per reply count")
    parser.add_argument(
        "--guard", action="store_true", help="the platform's default update guard (off: none)"
    )
    parser.add_argument(
        "--aggregator",
        default=RunConfig().aggregator,
        help="local-SGD's (default: the platform's, %(default)s)",
    )
    parser.add_argument(
        "--flower-strategy",
        choices=sorted(FLOWER_STRATEGIES),
        help="one of Flower's own strategies instead of local-SGD averaging",
    )
    args = parser.parse_args()
    replies = args.replies or ([10, 100] if args.flower_strategy else [10, 100, 1000])
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
    shapes = model_shapes(args.params)
    load_before = os.getloadavg()
    agg = args.aggregator
    chosen = {"guard": args.guard, "aggregator": agg, "flower": args.flower_strategy}
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in replies:
            runs = [
                measure(n, shapes, Path(tmp), memory=False, **chosen) for _ in range(args.repeat)
            ]
            peak = measure(n, shapes, Path(tmp), memory=True, **chosen)
            results.append(summarize(n, runs, args.params, peak["peak_memory_mib"]))
            print(json.dumps(results[-1]), file=sys.stderr)
    model_mib = 4 * sum(int(np.prod(s)) for s in shapes.values()) / 2**20
    peaks = [r["peak_memory_mib"] for r in results]
    beyond = [r["peak_memory_mib"] for r in results if r["replies"] > PULL_CHUNK]
    print(
        json.dumps(
            {
                "benchmark": "server_cost_per_reply",
                "model_parameters": args.params,
                "model_mib": round(model_mib, 2),
                "guard": "platform default" if args.guard else "off",
                "aggregator": None if args.flower_strategy else agg,
                "flower_strategy": args.flower_strategy,
                "machine": {
                    "python": platform.python_version(),
                    "cpus": os.cpu_count(),
                    "load_average_before": [round(x, 2) for x in load_before],
                    "load_average_after": [round(x, 2) for x in os.getloadavg()],
                },
                "results": results,
                "goal": f"metering + decoding + aggregation <= {GOAL_MS_PER_1M} ms per reply "
                "of a 1M-parameter model, bytes equal to Flower's measure",
                "goal_met": all(r["goal_ms_per_1m_params"] <= GOAL_MS_PER_1M for r in results)
                and all(r["bytes_equal_flower_reference"] for r in results),
                "memory_goal": None
                if args.flower_strategy
                else "peak memory flat once replies exceed one pull chunk",
                "pull_chunk": PULL_CHUNK,
                "peak_memory_ratio_max_over_min": round(max(peaks) / min(peaks), 2),
                "peak_memory_ratio_beyond_one_chunk": round(max(beyond) / min(beyond), 2)
                if beyond
                else None,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
