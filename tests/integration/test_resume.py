"""Resume after SIGKILL, for real: ``flplatform simulate`` killed at committed rounds, then
``flplatform resume``, ends with the same global model, bit for bit, and the same ledger
rows (wall times and measured durations aside) as the same seeded run left alone.

Real Flower simulations on the virtual clock. A kill takes the whole command down at once
(its process and every process below it, SIGKILL: what a machine that restarts does), right
after the ledger shows the round it was aimed at; the next resume is killed the same way at a
later round, and the last one runs to the end. The sites die with everything else: they
find their state in their snapshots on disk (``strategies/mods/contract.py``).

Every strategy and mode killed as a fresh run at a round of its own (a delayed pipeline
still filling; FetchSGD right after its first step); the two whose state is most involved
(k-async's updates in flight, streaming's fragments in a delayed pipeline) killed again as
a resume, once the pipeline is full, so that a resumed run's own checkpoints are what the
next resume starts from. The runs left alone are one sweep, each case a member (one Flower
start-up for the five). ``make test-resume`` runs them alone.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, MessageType, Metadata, RecordDict
from flwr.app.message import make_message
from flwr.common.constant import SUPERLINK_NODE_ID
from typer.testing import CliRunner

from flplatform.app.config import RunConfig
from flplatform.cli.app import app
from flplatform.core.ledger_rows import Kind, UpdateColumns, columns
from flplatform.engine.wire import delivery_bytes, reply_traffic
from flplatform.launch.simulation import run_sweep
from storage import LedgerRepository
from tests.helpers.processes import flplatform_cli, kill_after, wait_ok

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds processes in /proc (Linux)"),
]

BASE = {
    "sites": "london,ohio,california",
    "dataset": "digits",
    "local-steps": 3,
    "network": "world",
    "compute-model": "exponential",
    "seed": 7,
}
ROUNDS = 7
# (id, options, kill after these committed rounds); options are run-config keys, given to
# `flplatform simulate` as the options of the same names.
CASES = [
    # two of the three sites a round: a resumed run samples the same sites by name
    (
        "local-sgd-momentum-sync-sampled",
        {"server-momentum": 0.9, "fraction-train": 0.67},
        (2,),
    ),
    (
        "local-sgd-momentum-topk-k-async",
        {"server-momentum": 0.9, "sync": "k-async", "k": 2, "codec": "topk:0.1"},
        (2, 4),
    ),
    # streaming sync: the sites hold the global model and fragments of their steps, the
    # server what each site holds, a fragment's open sums and its momentum (plain delayed
    # updates resume in tests/integration/test_deploy.py)
    (
        "delayed-d2-streaming",
        {
            "strategy": "delayed",
            "delay": 2,
            "fragments": 3,
            "codec": "int4",
            "server-momentum": 0.9,
        },
        (2, 3),
    ),
    ("fetchsgd", {"strategy": "fetchsgd", "k": 200, "sketch-momentum": 0.9}, (1,)),
    ("sketched-sgd", {"strategy": "sketched-sgd", "k": 200, "step-momentum": 0.9}, (3,)),
]
runner = CliRunner()


def _options(options: dict[str, object]) -> list[str]:
    return [item for key, value in options.items() for item in (f"--{key}", str(value))]


def _model(db: str, run_id: int, out: Path) -> dict[str, torch.Tensor]:
    """The run's final model as `flplatform export` writes it."""
    result = runner.invoke(app, ["export", str(run_id), "--db", db, "--out", str(out)])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    return torch.load(out, weights_only=True)


def _id_bytes_slack() -> int:
    """How far a message's metered size can move with its Flower ids alone.

    A run's id and its sites' node ids are random 64-bit numbers, sent as varints of 1 to 10
    bytes, several times in each message (the request's node, the metadata, the message's
    own object): two runs of the same seed differ by this many bytes per message at most,
    and their simulated transfer times by as little (a byte is 0.6 us at 13 Mbit/s). Measured
    with the engine's own counters on the shortest and the longest ids; two more bytes for
    a length prefix or the object header's decimal length that the ids push over a boundary.
    """
    content = RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(8, np.float32))})})

    def metadata(src: int, dst: int, run: int) -> Metadata:
        return Metadata(
            run_id=run,
            message_id="",
            src_node_id=src,
            dst_node_id=dst,
            reply_to_message_id="r" * 64,
            group_id="1",
            created_at=1.0,
            ttl=60.0,
            message_type=MessageType.TRAIN,
        )

    def sizes(ids: int) -> tuple[int, int]:
        reply = make_message(metadata=metadata(ids, SUPERLINK_NODE_ID, ids), content=content)
        instruction = metadata(SUPERLINK_NODE_ID, ids, ids)
        traffic = reply_traffic(reply)
        delivered = delivery_bytes(make_message(metadata=instruction, content=content))
        return traffic.up + traffic.down, delivered

    shortest, longest = sizes(2), sizes(2**64 - 1)
    return max(b - a for a, b in zip(shortest, longest, strict=True)) + 2


BYTES_SLACK_PER_MESSAGE = _id_bytes_slack()
SIMULATED_SECONDS_SLACK = 1e-3
SIMULATED = {"virtual_started_at", "virtual_finished_at"} | {
    f.name for f, c in columns(UpdateColumns) if c.kind is Kind.SECONDS
}


def _assert_same_rows(resumed_rows: list[dict], reference_rows: list[dict]) -> None:
    """Row by row equal, except sizes and simulated times, which may differ by the node
    ids' lengths."""
    assert len(resumed_rows) == len(reference_rows)
    for resumed, reference in zip(resumed_rows, reference_rows, strict=True):
        sizes = [k for k in reference if k.startswith(("bytes", "eval_bytes"))]
        slack = BYTES_SLACK_PER_MESSAGE * _messages(reference, reference_rows)
        for key in sizes:
            assert abs(resumed[key] - reference[key]) <= slack, (key, resumed, reference)
        times = [k for k in reference if k in SIMULATED and reference[k] is not None]
        for key in times:
            assert resumed[key] == pytest.approx(reference[key], abs=SIMULATED_SECONDS_SLACK)
        same = {k: v for k, v in resumed.items() if k not in sizes and k not in times}
        assert same == {k: v for k, v in reference.items() if k not in sizes and k not in times}


def _messages(row: dict, rows: list[dict]) -> int:
    """Messages each way behind ``row``'s sizes: one for an update; for a round, its
    updates and an evaluation from each site."""
    if "site" in row:
        return 1
    updates = sum(1 for r in rows if "site" in r and r["round"] == row["round"])
    return updates + len({r["site"] for r in rows if "site" in r})


def _rows(db: str, run_id: int) -> list[dict]:
    """The run's rounds and updates without wall times, measured durations or row ids."""
    skip = {"id", "run_id", "site_id", "started_at", "finished_at", "wall_seconds"}
    skip |= {f.name for f, c in columns(UpdateColumns) if c.kind in (Kind.WALL_TIME, Kind.DURATION)}
    with LedgerRepository.open(db) as repository:
        rounds = [
            {f.name: getattr(r, f.name) for f in fields(r) if f.name not in skip}
            for r in repository.list_rounds(run_id)
        ]
        updates = [
            {f.name: getattr(u, f.name) for f in fields(u) if f.name not in skip}
            for u in repository.list_updates(run_id)
        ]
    key = lambda u: (u["round"], u["site"], u.get("model_version"), u["status"])  # noqa: E731
    return rounds + sorted(updates, key=lambda u: repr(key(u)))


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, int]]:
    """Every case's run left alone: its ledger, and each case's run id there.

    One sweep (one Flower start-up), each case a member run as it would run alone: the
    members train on the same data, so their messages carry what a lone run's carry, and
    each is compared with its resumed run bit for bit, bytes included.
    """
    home = tmp_path_factory.mktemp("references")
    db = f"sqlite:///{home / 'reference.db'}"
    members = [
        RunConfig.from_mapping(
            {**BASE, **options, "num-server-rounds": ROUNDS, "db": db, "name": name}
        )
        for name, options, _ in CASES
    ]
    with pytest.MonkeyPatch.context() as patch:  # its own home, as flplatform_home gives
        patch.setenv("FLPLATFORM_HOME", str(home))
        patch.setenv("FLWR_HOME", str(home / "flwr"))
        patch.setenv("FLPLATFORM_SITE_STATE", str(home / "site-state"))
        records = run_sweep(members)
    return db, {record.name: record.id for record in records}


@pytest.mark.parametrize(
    "case,kills",
    [
        # on one pytest-xdist worker (`--dist loadgroup`), so that the references run once
        pytest.param(
            name, k, id=name, marks=[pytest.mark.resume, pytest.mark.xdist_group("resume")]
        )
        for name, _, k in CASES
    ],
)
@pytest.mark.usefixtures("flplatform_home")
def test_a_run_killed_and_resumed_ends_bit_for_bit_as_the_uninterrupted_run(
    tmp_path: Path,
    case: str,
    kills: tuple[int, ...],
    references: tuple[str, dict[str, int]],
) -> None:
    options = next(o for name, o, _ in CASES if name == case)
    log = tmp_path / "output.txt"
    args = ["simulate", *_options({**BASE, **options}), "--rounds", str(ROUNDS)]
    reference_db, reference_ids = references
    reference_id = reference_ids[case]

    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    LedgerRepository.open(db).close()  # created first, so that both processes find it
    run_id = kill_after(flplatform_cli([*args, "--db", db], tmp_path, log), db, None, kills[0])
    for resumes, rounds in enumerate(kills[1:], start=1):
        cli = flplatform_cli(["resume", str(run_id), "--db", db], tmp_path, log)
        kill_after(cli, db, run_id, rounds, resumes=resumes)
    wait_ok(flplatform_cli(["resume", str(run_id), "--db", db], tmp_path, log), log)

    resumed_model = _model(db, run_id, tmp_path / "resumed.pt")
    reference_model = _model(reference_db, reference_id, tmp_path / "reference.pt")
    assert list(resumed_model) == list(reference_model)
    for name, tensor in reference_model.items():
        assert torch.equal(resumed_model[name], tensor), name
    assert np.isfinite(sum(float(t.float().sum()) for t in reference_model.values()))

    resumed_rows, reference_rows = _rows(db, run_id), _rows(reference_db, reference_id)
    _assert_same_rows(resumed_rows, reference_rows)
    with LedgerRepository.open(db) as repository:
        run = repository.get_run(run_id)
        events = repository.list_events(run_id)
    assert run.status == "finished"
    assert sum(e.kind == "resumed" for e in events) == len(kills)


@pytest.mark.resume
@pytest.mark.xdist_group("resume")  # the references' worker
def test_streaming_sync_sends_one_fragment_each_way_per_period(
    references: tuple[str, dict[str, int]],
) -> None:
    """The streaming member left alone (F = 3, D = 2, int4, momentum), in the ledger: each
    update carries its period's fragment, and after first contact a site is sent only the
    fragment that changed since the version it holds."""
    db, ids = references
    run_id = ids["delayed-d2-streaming"]
    with LedgerRepository.open(db) as repository:
        updates = repository.list_updates(run_id)
    assert updates and all(u.status == "applied" for u in updates)
    assert all(u.fragment == (u.period - 1) % 3 for u in updates)
    down = {u.period: max(v.bytes_down for v in updates if v.period == u.period) for u in updates}
    first = down[1]  # the whole model
    # periods 2 and 3 are sent version 0 again: nothing changed; period q ≥ 4 the fragment
    # round q − 3 changed: over periods 4 to 6 each of the MLP's fragments once (the first,
    # its 64 × hidden weight, is most of the model), about one model in all
    assert down[2] < first / 10 and down[3] < first / 10
    assert sum(down[q] for q in (4, 5, 6)) < 1.3 * first
    assert down[5] < first / 2 and down[6] < first / 2
    # uploads: one fragment in 4 bits, far below a float32 model
    assert max(u.bytes_up for u in updates) < first / 4
    shown = runner.invoke(app, ["history", "updates", str(run_id), "--db", db, "--format", "json"])
    assert shown.exit_code == 0, shown.output
    assert sorted({row["fragment"] for row in json.loads(shown.output)}) == [0, 1, 2]


@pytest.mark.resume
@pytest.mark.usefixtures("flplatform_home")
def test_sites_that_lost_their_snapshots_are_resynced_and_the_run_finishes(
    tmp_path: Path, site_state_dir: Path
) -> None:
    log = tmp_path / "output.txt"
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    LedgerRepository.open(db).close()
    args = ["simulate", *_options({**BASE, "strategy": "delayed", "delay": 2}), "--rounds", "5"]
    run_id = kill_after(flplatform_cli([*args, "--db", db], tmp_path, log), db, None, 2)
    assert any(site_state_dir.iterdir())  # the sites kept snapshots, under the test's dir
    shutil.rmtree(site_state_dir)  # a site machine that lost its disk

    wait_ok(flplatform_cli(["resume", str(run_id), "--db", db], tmp_path, log), log)

    with LedgerRepository.open(db) as repository:
        run = repository.get_run(run_id)
        after = [u for u in repository.list_updates(run_id) if u.round > 2]
    assert run.status == "finished" and run.rounds_completed == 5
    resynced = {u.site for u in after if u.reason and "lost its state" in u.reason}
    assert resynced, [u.reason for u in after]


@pytest.mark.resume
@pytest.mark.usefixtures("flplatform_home")
def test_a_run_of_an_own_app_killed_and_resumed_ends_as_the_uninterrupted_run(
    tmp_path: Path,
) -> None:
    # `flplatform run APP_DIR`: resume launches the recorded app directory and options again.
    app_dir = tmp_path / "own_app"
    shutil.copytree(
        ROOT / "examples" / "own_app", app_dir, ignore=shutil.ignore_patterns("__pycache__")
    )
    log = tmp_path / "output.txt"
    args = ["run", str(app_dir), "--sites", "2", "--rounds", "5", "--seed", "3"]
    args += ["--network", "world", "--checkpoint-every", "2"]
    reference_db = f"sqlite:///{tmp_path / 'reference.db'}"
    wait_ok(flplatform_cli([*args, "--db", reference_db], tmp_path, log), log)

    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    LedgerRepository.open(db).close()
    run_id = kill_after(flplatform_cli([*args, "--db", db], tmp_path, log), db, None, 2)
    wait_ok(flplatform_cli(["resume", str(run_id), "--db", db], tmp_path, log), log)

    with LedgerRepository.open(reference_db) as repository:
        [reference] = repository.list_runs()
    with LedgerRepository.open(db) as repository:
        run = repository.get_run(run_id)
        events = repository.list_events(run_id)
        kept = [c.round for c in repository.list_checkpoints(run_id)]
    assert run.status == "finished" and [e.kind for e in events] == ["resumed"]
    assert 2 in kept and 4 in kept  # --checkpoint-every reached the app's start()
    resumed_model = _model(db, run_id, tmp_path / "resumed.pt")
    reference_model = _model(reference_db, reference.id, tmp_path / "reference.pt")
    assert list(resumed_model) == list(reference_model)
    for name, tensor in reference_model.items():
        assert torch.equal(resumed_model[name], tensor), name
    resumed_rows, reference_rows = _rows(db, run_id), _rows(reference_db, reference.id)
    _assert_same_rows(resumed_rows, reference_rows)
