"""``UpdateInput`` validation and the records' JSON form (no database needed)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flplatform.core.errors import StorageError
from storage import (
    EVALUATION_DROPPED,
    EVALUATION_EVALUATED,
    EVALUATION_STATUSES,
    UPDATE_STATUSES,
    EvaluationRecord,
    RoundRecord,
    SiteSummary,
)
from tests.helpers.ledger_records import evaluation, update

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("status", "lost", "'status' is 'lost'; allowed: applied, buffered"),
        ("site", "", "'site' must be a non-empty name"),
        ("bytes_up", -1, "'bytes_up' must be between 0 and"),
        ("bytes_down", 2**63, "'bytes_down' must be between 0 and"),
        ("bytes_up", True, "'bytes_up' must be an integer"),
        ("bytes_up", 1.0, "'bytes_up' must be an integer"),
        ("staleness", -1, "'staleness' must be between 0 and"),
        ("staleness", 2**31, "'staleness' must be between 0 and 2147483647"),
        ("dispatched_round", "3", "'dispatched_round' must be an integer"),
        ("num_examples", -5, "'num_examples' must be between 0 and"),
        ("dispatched_at", math.nan, "'dispatched_at' must be a finite unix time"),
        ("dispatched_at", None, "'dispatched_at' must be a number, got NoneType"),
        ("arrived_at", math.inf, "'arrived_at' must be a finite unix time"),
        ("compute_seconds", -0.5, "'compute_seconds' must be >= 0"),
        ("train_loss", "low", "'train_loss' must be a number or None"),
        ("reason", 404, "'reason' must be a string or None"),
    ],
)
def test_update_input_names_the_bad_field(field: str, value: Any, message: str) -> None:
    with pytest.raises(StorageError, match=message):
        update(**{"site": "a", field: value})


VIRTUAL_FIELDS = (
    "virtual_dispatched_at",
    "virtual_arrived_at",
    "virtual_compute_seconds",
    "transfer_seconds",
)


@pytest.mark.parametrize("field", VIRTUAL_FIELDS)
@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (-1.0, "got -1.0"),
        (-1, "got -1.0"),
        (math.nan, "got nan"),
        (-math.inf, "got -inf"),
        (math.inf, "got inf"),
        ("3", "got str '3'"),
        (True, "got bool True"),
        ([1.0], r"got list \[1.0\]"),
    ],
)
def test_update_input_refuses_bad_virtual_times(field: str, value: Any, shown: str) -> None:
    with pytest.raises(
        StorageError,
        match=f"update field '{field}' must be None or a finite number of seconds >= 0, {shown}",
    ):
        update("a", **{field: value})


def test_update_input_normalises_virtual_times() -> None:
    assert all(getattr(update("a"), name) is None for name in VIRTUAL_FIELDS)
    given = update(
        "a",
        virtual_dispatched_at=np.float32(0.5),
        virtual_arrived_at=np.int64(3),
        virtual_compute_seconds=0,
        transfer_seconds=np.float64(1.25),
    )
    values = [getattr(given, name) for name in VIRTUAL_FIELDS]
    assert values == [0.5, 3.0, 0.0, 1.25]
    assert all(type(v) is float for v in values)
    # Arrival equal to dispatch is fine (an instant reply); before it is not.
    assert update("a", virtual_dispatched_at=2.0, virtual_arrived_at=2.0).virtual_arrived_at == 2.0
    with pytest.raises(StorageError, match=r"'virtual_arrived_at' \(1.0\) is before"):
        update("a", virtual_dispatched_at=2.0, virtual_arrived_at=1.0)


DELAY_FIELDS = ("period", "average_applied", "delay")


@pytest.mark.parametrize("field", DELAY_FIELDS)
@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-1, "must be between 0 and 2147483647, got -1"),
        (2**31, "must be between 0 and 2147483647, got 2147483648"),
        (np.int64(-3), "must be between 0 and 2147483647, got -3"),
        (1.0, "must be an integer, got float 1.0"),
        ("2", "must be an integer, got str '2'"),
        (True, "must be an integer, got bool True"),
    ],
)
def test_update_input_refuses_bad_delay_fields(field: str, value: Any, message: str) -> None:
    with pytest.raises(StorageError, match=f"update field '{field}' {message}"):
        update("a", **{field: value})


def test_update_input_normalises_delay_fields() -> None:
    assert all(getattr(update("a"), name) is None for name in DELAY_FIELDS)
    given = update("a", period=np.int32(5), average_applied=np.int64(2), delay=2)
    values = [getattr(given, name) for name in DELAY_FIELDS]
    assert values == [5, 2, 2]
    assert all(type(v) is int for v in values)
    # 0 is a valid value everywhere (the first period, the initial average, local SGD).
    zeros = update("a", period=0, average_applied=0, delay=0)
    assert [getattr(zeros, name) for name in DELAY_FIELDS] == [0, 0, 0]


def test_update_input_checks_and_normalises_the_fragment() -> None:
    assert update("a").fragment is None
    given = update("a", fragment=np.int64(2))
    assert given.fragment == 2 and type(given.fragment) is int
    assert update("a", fragment=0).fragment == 0  # the first fragment
    with pytest.raises(StorageError, match="update field 'fragment' must be between 0 and"):
        update("a", fragment=-1)
    with pytest.raises(StorageError, match="update field 'fragment' must be an integer"):
        update("a", fragment=1.0)


def test_site_summary_serialises_staleness_counts_as_integer_pairs() -> None:
    summary = SiteSummary(
        site_id=1,
        name="a",
        node_id=1,
        partition_id=None,
        num_examples=None,
        updates=3,
        applied=3,
        buffered=0,
        cancelled=0,
        dropped=0,
        rejected=0,
        mean_staleness=1.0,
        max_staleness=2,
        bytes_up=0,
        bytes_down=0,
        compute_seconds=0.0,
        mean_train_loss=None,
        staleness_counts={2: 1, 0: 1, 1: 1},
        p90_staleness=2,
        waiting_seconds=1.5,
        waiting_clock="virtual",
    )
    data = summary.to_dict()
    assert data["staleness_counts"] == [[0, 1], [1, 1], [2, 1]]
    assert json.loads(json.dumps(data)) == data  # integer keys survive JSON as pairs
    assert (data["waiting_clock"], data["waiting_seconds"], data["p90_staleness"]) == (
        "virtual",
        1.5,
        2,
    )
    data["staleness_counts"].append([9, 9])
    assert summary.staleness_counts == {2: 1, 0: 1, 1: 1}


def test_update_input_accepts_every_status_and_converts_numpy_scalars() -> None:
    for status in UPDATE_STATUSES:
        assert update("a", status).status == status
    numpy_fields: dict[str, Any] = {
        "bytes_up": np.int64(5),
        "staleness": np.int32(2),
        "train_loss": np.float32(0.5),
        "dispatched_at": np.float64(10.0),
    }
    converted = update("a", **numpy_fields)
    assert (converted.bytes_up, converted.staleness, converted.train_loss) == (5, 2, 0.5)
    assert type(converted.bytes_up) is int and type(converted.train_loss) is float
    assert type(converted.dispatched_at) is float


def test_update_input_is_frozen() -> None:
    with pytest.raises(AttributeError):
        update("a").status = "dropped"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("status", "applied", "'status' is 'applied'; allowed: evaluated, dropped"),
        ("site", " ", "evaluation field 'site' must be a non-empty name"),
        ("model_version", -1, "'model_version' must be between 0 and 2147483647"),
        ("model_version", 2**31, "'model_version' must be between 0 and 2147483647"),
        ("bytes_up", -1, "'bytes_up' must be between 0 and"),
        ("bytes_down", 2**63, "'bytes_down' must be between 0 and"),
        ("bytes_down", 2.0, "'bytes_down' must be an integer"),
        ("bytes_up", False, "'bytes_up' must be an integer"),
        ("num_examples", -1, "'num_examples' must be between 0 and"),
        ("dispatched_at", math.inf, "'dispatched_at' must be a finite unix time"),
        ("dispatched_at", None, "'dispatched_at' must be a number, got NoneType"),
        ("arrived_at", math.nan, "'arrived_at' must be a finite unix time"),
        ("loss", "low", "'loss' must be a number or None"),
        ("accuracy", True, "'accuracy' must be a number or None"),
        ("reason", b"late", "'reason' must be a string or None"),
    ],
)
def test_evaluation_input_names_the_bad_field(field: str, value: Any, message: str) -> None:
    with pytest.raises(StorageError, match=message):
        evaluation(**{"site": "a", field: value})


def test_evaluation_input_normalises_values() -> None:
    assert EVALUATION_STATUSES == (EVALUATION_EVALUATED, EVALUATION_DROPPED)
    assert EVALUATION_STATUSES == ("evaluated", "dropped")
    for status in EVALUATION_STATUSES:
        assert evaluation("a", status).status == status
    numpy_fields: dict[str, Any] = {
        "bytes_up": np.int64(5),
        "model_version": np.int32(2),
        "loss": np.float32(0.5),
        "accuracy": np.float64(math.nan),
        "dispatched_at": np.float64(10.0),
    }
    converted = evaluation("a", **numpy_fields)
    assert (converted.bytes_up, converted.model_version, converted.loss) == (5, 2, 0.5)
    assert converted.accuracy is None  # non-finite becomes None
    assert evaluation("a", loss=math.inf, accuracy=-math.inf).loss is None
    assert type(converted.bytes_up) is int and type(converted.model_version) is int
    assert type(converted.loss) is float and type(converted.dispatched_at) is float
    with pytest.raises(AttributeError):
        converted.status = "dropped"  # type: ignore[misc]


def test_evaluation_records_serialise_with_the_site_name() -> None:
    when = datetime(2026, 1, 2, tzinfo=UTC)
    record = EvaluationRecord(
        id=1,
        run_id=2,
        site_id=3,
        site="london",
        round=4,
        model_version=3,
        bytes_up=10,
        bytes_down=20,
        status="evaluated",
        reason=None,
        num_examples=5,
        loss=0.5,
        accuracy=0.75,
        dispatched_at=when,
        arrived_at=None,
    )
    data = record.to_dict()
    assert (data["site"], data["dispatched_at"], data["arrived_at"]) == (
        "london",
        "2026-01-02T00:00:00+00:00",
        None,
    )
    rnd = RoundRecord(
        id=1,
        run_id=2,
        round=1,
        model_version=1,
        started_at=when,
        finished_at=when,
        wall_seconds=0.0,
        metrics={},
        train_loss=None,
        num_applied=0,
        num_dropped=0,
        num_rejected=0,
        bytes_up=0,
        bytes_down=0,
    )
    assert (rnd.to_dict()["eval_bytes_up"], rnd.to_dict()["eval_bytes_down"]) == (0, 0)


def test_to_dict_gives_iso_datetimes_and_copies() -> None:
    summary = SiteSummary(
        site_id=1,
        name="a",
        node_id=2**64 - 1,
        partition_id=None,
        num_examples=3,
        updates=0,
        applied=0,
        buffered=0,
        cancelled=0,
        dropped=0,
        rejected=0,
        mean_staleness=None,
        max_staleness=None,
        bytes_up=0,
        bytes_down=0,
        compute_seconds=0.0,
        mean_train_loss=None,
    )
    assert summary.to_dict()["node_id"] == 2**64 - 1
    # Fields added with migration 0003 default to "nothing recorded".
    assert {
        "staleness_counts": [],
        "p90_staleness": None,
        "waiting_seconds": 0.0,
        "busy_seconds": 0.0,
        "waiting_clock": "wall",
        "virtual_compute_seconds": None,
        "transfer_seconds": None,
        "mean_delay": None,  # added with migration 0004
    }.items() <= summary.to_dict().items()
    assert {"evaluations": 0, "eval_bytes_up": 0, "eval_bytes_down": 0}.items() <= (
        summary.to_dict().items()
    )

    from storage import RunRecord

    when = datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=UTC)
    run = RunRecord(
        id=1,
        tag=None,
        name="n",
        strategy="s",
        seed=0,
        config={"a": {"b": [1]}},
        num_rounds_planned=1,
        status="running",
        error=None,
        created_at=when,
        finished_at=None,
        wall_seconds=None,
        final_metrics=None,
    )
    data = run.to_dict()
    assert data["created_at"] == "2026-01-02T03:04:05.000006+00:00"
    data["config"]["a"]["b"].append(2)
    assert run.config == {"a": {"b": [1]}}


def test_storage_imports_neither_flower_nor_torch() -> None:
    code = (
        "import sys, storage\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'flwr', 'torch'})\n"
        "sys.exit(', '.join(heavy) or None)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, f"storage imported: {done.stderr.strip()}"
