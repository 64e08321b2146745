"""The Alembic migrations: idempotent, race-safe, identical to ``storage.models``, shippable."""

from __future__ import annotations

import io
import json
import select
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime, timedelta
from fnmatch import fnmatch
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import JSON, column, create_engine, insert, inspect, table, text
from sqlalchemy.engine import Connection, make_url

from flplatform.core.errors import StorageError
from storage import (
    CheckpointInput,
    EvaluationInput,
    LedgerRepository,
    SchemaUpgrade,
    TrafficInput,
)
from storage.migrations import (
    _POSTGRES_LOCK_KEY,
    MIGRATIONS_DIR,
    VERSION_TABLE,
    alembic_config,
    current_revisions,
    head_revision,
)
from storage.models import UInt64, UTCDateTime, metadata
from storage.session import create_ledger_engine
from tests.helpers.ledger_records import T0, evaluation, make_run, record, update
from tests.helpers.ledgers import sqlite_write_lock

REPO_ROOT = Path(__file__).resolve().parents[2]
LEDGER_TABLES = {
    *("runs", "sites", "rounds", "updates", "evaluations", "checkpoints", "run_events"),
    "traffic",
}
TABLES_OF_0001 = {"runs", "sites", "rounds", "updates"}


def test_opening_twice_keeps_data_and_stays_at_head(ledger_url: str) -> None:
    with LedgerRepository.open(ledger_url) as repo:
        make_run(repo)
    with LedgerRepository.open(ledger_url) as repo:
        assert len(repo.list_runs()) == 1
        with repo._engine.connect() as connection:
            assert current_revisions(connection) == {head_revision()}
            # What `alembic current` prints, through our env.py.
            config = alembic_config(connection)
            config.stdout = io.StringIO()
            command.current(config)
        assert f"{head_revision()} (head)" in config.stdout.getvalue()


def test_migrated_schema_matches_the_models(ledger_url: str) -> None:
    with LedgerRepository.open(ledger_url) as repo, repo._engine.connect() as connection:
        context = MigrationContext.configure(
            connection, opts={"version_table": VERSION_TABLE, "compare_type": True}
        )
        assert compare_metadata(context, metadata) == []


def test_every_constraint_and_index_is_named_by_convention(ledger_url: str) -> None:
    with LedgerRepository.open(ledger_url) as repo, repo._engine.connect() as connection:
        inspector = inspect(connection)
        assert set(inspector.get_table_names()) >= LEDGER_TABLES
        names = {
            "fk": {fk["name"] for t in LEDGER_TABLES for fk in inspector.get_foreign_keys(t)},
            "uq": {uq["name"] for t in LEDGER_TABLES for uq in inspector.get_unique_constraints(t)},
            "ix": {ix["name"] for t in LEDGER_TABLES for ix in inspector.get_indexes(t)},
        }
        fks = {
            fk["name"]: fk
            for t in ("updates", "evaluations", "traffic")
            for fk in inspector.get_foreign_keys(t)
        }
        checks = {ck["name"] for ck in inspector.get_check_constraints("evaluations")}
        checks |= {ck["name"] for ck in inspector.get_check_constraints("traffic")}
    assert names["fk"] == {
        "fk_sites_run_id_runs",
        "fk_rounds_run_id_runs",
        "fk_updates_run_id_runs",
        "fk_updates_site_id_sites",
        "fk_evaluations_run_id_runs",
        "fk_evaluations_site_id_sites",
        "fk_checkpoints_run_id_runs",
        "fk_run_events_run_id_runs",
        "fk_traffic_run_id_runs",
        "fk_traffic_site_id_sites",
    }
    assert names["uq"] == {
        "uq_runs_tag",
        "uq_sites_run_id_name",
        "uq_rounds_run_id_round",
        "uq_evaluations_run_id_round_site_id",
        "uq_checkpoints_run_id_round",
    }
    assert {
        "ix_runs_created_at",
        "ix_updates_run_id_round",
        "ix_updates_site_id",
        "ix_evaluations_run_id_round",
        "ix_evaluations_site_id",
        "ix_run_events_run_id",
        "ix_traffic_run_id",
        "ix_traffic_site_id",
    } <= names["ix"]
    assert checks == {"ck_evaluations_status", "ck_traffic_kind"}
    for name in (
        "fk_updates_site_id_sites",
        "fk_evaluations_site_id_sites",
        "fk_traffic_site_id_sites",
        "fk_traffic_run_id_runs",
    ):
        assert fks[name]["options"].get("ondelete") == "CASCADE", name
    assert fks["fk_evaluations_run_id_runs"]["options"].get("ondelete") == "CASCADE"


def test_downgrade_to_base_and_back(ledger_url: str) -> None:
    with LedgerRepository.open(ledger_url) as repo:
        with repo._engine.begin() as connection:
            command.downgrade(alembic_config(connection), "base")
        with repo._engine.connect() as connection:
            assert not LEDGER_TABLES & set(inspect(connection).get_table_names())
    with LedgerRepository.open(ledger_url) as repo:
        assert repo.list_runs() == []


def _assert_no_schema_diff(connection: Connection) -> None:
    context = MigrationContext.configure(
        connection, opts={"version_table": VERSION_TABLE, "compare_type": True}
    )
    assert compare_metadata(context, metadata) == []


def _fill_an_0001_ledger(connection: Connection) -> None:
    """Insert a run, a site, a round and an update with the 0001 schema (no ORM models)."""
    runs = table(
        "runs",
        *map(column, ("id", "name", "strategy", "seed", "num_rounds_planned", "status")),
        column("config", JSON),
        column("created_at", UTCDateTime()),
    )
    sites = table(
        "sites",
        *map(column, ("id", "run_id", "name")),
        column("node_id", UInt64()),
        column("profile", JSON),
    )
    rounds = table(
        "rounds",
        *map(column, ("id", "run_id", "round", "model_version", "wall_seconds", "train_loss")),
        *map(column, ("num_applied", "num_dropped", "num_rejected", "bytes_up", "bytes_down")),
        column("metrics", JSON),
        column("started_at", UTCDateTime()),
        column("finished_at", UTCDateTime()),
    )
    updates = table(
        "updates",
        *map(column, ("id", "run_id", "site_id", "round", "dispatched_round")),
        *map(column, ("version_trained_on", "staleness", "bytes_up", "bytes_down", "status")),
        column("dispatched_at", UTCDateTime()),
    )
    when = datetime.fromtimestamp(T0, tz=UTC)
    connection.execute(
        insert(runs).values(
            id=1,
            name="old",
            strategy="fedavg",
            seed=7,
            num_rounds_planned=3,
            status="running",
            config={"lr": 0.1},
            created_at=when,
        )
    )
    connection.execute(
        insert(sites).values(id=1, run_id=1, name="london", node_id=2**64 - 1, profile={})
    )
    connection.execute(
        insert(rounds).values(
            id=1,
            run_id=1,
            round=1,
            model_version=1,
            wall_seconds=2.0,
            train_loss=0.5,
            num_applied=1,
            num_dropped=0,
            num_rejected=0,
            bytes_up=111,
            bytes_down=222,
            metrics={"accuracy": 0.5},
            started_at=when,
            finished_at=when + timedelta(seconds=2),
        )
    )
    connection.execute(
        insert(updates).values(
            id=1,
            run_id=1,
            site_id=1,
            round=1,
            dispatched_round=1,
            version_trained_on=0,
            staleness=0,
            bytes_up=111,
            bytes_down=222,
            status="applied",
            dispatched_at=when,
        )
    )
    if connection.dialect.name == "postgresql":
        # Explicit ids do not advance PostgreSQL's sequences; an application never sets them.
        for name in ("runs", "sites", "rounds", "updates"):
            connection.execute(text(f"SELECT setval(pg_get_serial_sequence('{name}', 'id'), 1)"))


def test_an_0001_ledger_upgrades_keeping_its_rows_and_downgrades_back(ledger_url: str) -> None:
    assert head_revision() == "0008"
    engine = create_ledger_engine(ledger_url)
    try:
        with engine.begin() as connection:
            command.upgrade(alembic_config(connection), "0001")
            _fill_an_0001_ledger(connection)
        with engine.connect() as connection:
            assert current_revisions(connection) == {"0001"}
            assert set(inspect(connection).get_table_names()) >= TABLES_OF_0001
            assert "evaluations" not in inspect(connection).get_table_names()
    finally:
        engine.dispose()

    with LedgerRepository.open(ledger_url) as repo:  # opening upgrades to head
        with repo._engine.connect() as connection:
            assert current_revisions(connection) == {head_revision()}
            _assert_no_schema_diff(connection)
        run = repo.get_run(1)
        assert (run.name, run.config, run.rounds_completed, run.last_metrics) == (
            "old",
            {"lr": 0.1},
            1,
            {"accuracy": 0.5},
        )
        [old_round] = repo.list_rounds(1)
        assert (old_round.bytes_up, old_round.bytes_down) == (111, 222)
        assert (old_round.eval_bytes_up, old_round.eval_bytes_down) == (0, 0)
        assert [(u.site, u.bytes_up, u.status) for u in repo.list_updates(1)] == [
            ("london", 111, "applied")
        ]
        assert repo.list_sites(1)[0].node_id == 2**64 - 1
        assert repo.list_evaluations(1) == []
        [summary] = repo.site_summaries(1)
        assert (summary.updates, summary.bytes_up, summary.evaluations) == (1, 111, 0)

        # The new API works on the upgraded ledger, next to the old rows.
        record(repo, 1, 2, [update("london")], evaluations=[evaluation("london", bytes_up=9)])
        new_run = make_run(repo)
        assert new_run == 2
        [evaluated] = repo.list_evaluations(1)
        assert (evaluated.round, evaluated.site, evaluated.bytes_up) == (2, "london", 9)
        assert [r.eval_bytes_up for r in repo.list_rounds(1)] == [0, 9]
        [summary] = repo.site_summaries(1)
        assert (summary.updates, summary.evaluations, summary.eval_bytes_up) == (2, 1, 9)

        with repo._engine.begin() as connection:
            command.downgrade(alembic_config(connection), "0001")
        with repo._engine.connect() as connection:
            assert current_revisions(connection) == {"0001"}
            tables = set(inspect(connection).get_table_names())
            assert "evaluations" not in tables and tables >= TABLES_OF_0001
            kept = connection.execute(text("SELECT COUNT(*) FROM rounds")).scalar_one()
            assert kept == 2

    with LedgerRepository.open(ledger_url) as repo:  # and back up to head
        with repo._engine.connect() as connection:
            assert current_revisions(connection) == {head_revision()}
            _assert_no_schema_diff(connection)
        assert [r.round for r in repo.list_rounds(1)] == [1, 2]
        assert repo.list_evaluations(1) == []  # a downgrade drops what 0002 added
        record(
            repo,
            1,
            3,
            [],
            evaluations=[
                EvaluationInput(
                    site="london",
                    model_version=3,
                    bytes_up=1,
                    bytes_down=2,
                    status="dropped",
                    dispatched_at=T0,
                )
            ],
        )
        assert [(e.round, e.status) for e in repo.list_evaluations(1)] == [(3, "dropped")]


VIRTUAL_COLUMNS = {
    "runs": {"network", "simulated_seconds"},
    "rounds": {"virtual_started_at", "virtual_finished_at"},
    "updates": {
        "virtual_dispatched_at",
        "virtual_arrived_at",
        "virtual_compute_seconds",
        "transfer_seconds",
    },
}


def _columns(connection: Connection, name: str) -> set[str]:
    return {c["name"] for c in inspect(connection).get_columns(name)}


def test_an_0002_ledger_upgrades_to_virtual_time_keeping_its_rows_and_downgrades_back(
    ledger_url: str,
) -> None:
    engine = create_ledger_engine(ledger_url)
    try:
        with engine.begin() as connection:
            command.upgrade(alembic_config(connection), "0002")
            _fill_an_0001_ledger(connection)  # 0002 only added a table; these rows still fit
        with engine.connect() as connection:
            assert current_revisions(connection) == {"0002"}
            for name, added in VIRTUAL_COLUMNS.items():
                assert not added & _columns(connection, name), name
    finally:
        engine.dispose()

    with LedgerRepository.open(ledger_url) as repo:  # opening upgrades to head
        with repo._engine.connect() as connection:
            assert current_revisions(connection) == {head_revision()}
            _assert_no_schema_diff(connection)
        # Every old row is intact and reads as a wall-clock row: NULL virtual times.
        run = repo.get_run(1)
        assert (run.name, run.config, run.rounds_completed) == ("old", {"lr": 0.1}, 1)
        assert (run.network, run.simulated_seconds) == (None, None)
        [old_round] = repo.list_rounds(1)
        assert (old_round.bytes_up, old_round.virtual_started_at) == (111, None)
        assert old_round.virtual_finished_at is None
        [old_update] = repo.list_updates(1)
        assert (old_update.site, old_update.bytes_up, old_update.status) == (
            "london",
            111,
            "applied",
        )
        assert (old_update.virtual_dispatched_at, old_update.virtual_arrived_at) == (None, None)
        assert (old_update.virtual_compute_seconds, old_update.transfer_seconds) == (None, None)
        [summary] = repo.site_summaries(1)
        assert (summary.waiting_clock, summary.virtual_compute_seconds) == ("wall", None)
        assert (summary.staleness_counts, summary.p90_staleness) == ({0: 1}, 0)

        # The new fields work next to the old rows.
        record(
            repo,
            1,
            2,
            [update("london", virtual_dispatched_at=4.0, virtual_arrived_at=6.5)],
            virtual_started_at=4.0,
            virtual_finished_at=6.5,
        )
        repo.finish_run(1, status="finished", finished_at=T0 + 60, simulated_seconds=6.5)
        simulated = make_run(repo, network="lan")
        assert repo.get_run(1).simulated_seconds == 6.5
        assert repo.get_run(simulated).network == "lan"
        assert [r.virtual_finished_at for r in repo.list_rounds(1)] == [None, 6.5]
        [summary] = repo.site_summaries(1)
        assert (summary.waiting_clock, summary.busy_seconds) == ("virtual", 2.5)

        with repo._engine.begin() as connection:
            command.downgrade(alembic_config(connection), "0002")
        with repo._engine.connect() as connection:
            assert current_revisions(connection) == {"0002"}
            for name, added in VIRTUAL_COLUMNS.items():
                assert not added & _columns(connection, name), name
            # Dropping columns must not cascade (SQLite's batch mode would recreate, so drop,
            # the parent tables): every row survives.
            counts = {
                name: connection.execute(text(f"SELECT COUNT(*) FROM {name}")).scalar_one()
                for name in ("runs", "sites", "rounds", "updates")
            }
            assert counts == {"runs": 2, "sites": 1, "rounds": 2, "updates": 2}

    with LedgerRepository.open(ledger_url) as repo:  # and back up to head
        with repo._engine.connect() as connection:
            assert current_revisions(connection) == {head_revision()}
            _assert_no_schema_diff(connection)
        run = repo.get_run(1)
        assert (run.status, run.rounds_completed, run.simulated_seconds) == ("finished", 2, None)
        assert [u.virtual_arrived_at for u in repo.list_updates(1)] == [None, None]
        assert repo.site_summaries(1)[0].waiting_clock == "wall"


DELAY_COLUMNS = {"period", "average_applied", "delay"}


def test_an_0003_ledger_upgrades_to_delayed_updates_keeping_its_rows_and_downgrades_back(
    ledger_url: str,
) -> None:
    engine = create_ledger_engine(ledger_url)
    try:
        with engine.begin() as connection:
            command.upgrade(alembic_config(connection), "0003")
            _fill_an_0001_ledger(connection)  # 0002 and 0003 only added; these rows still fit
        with engine.connect() as connection:
            assert current_revisions(connection) == {"0003"}
            assert not DELAY_COLUMNS & _columns(connection, "updates")
    finally:
        engine.dispose()

    with LedgerRepository.open(ledger_url) as repo:  # opening upgrades to head
        with repo._engine.connect() as connection:
            assert current_revisions(connection) == {head_revision()}
            assert _columns(connection, "updates") >= DELAY_COLUMNS
            nullable = {
                c["name"]: c["nullable"] for c in inspect(connection).get_columns("updates")
            }
            assert all(nullable[name] for name in DELAY_COLUMNS)
            _assert_no_schema_diff(connection)
        # The old row is intact and reads as an update of a strategy without delays.
        [old_update] = repo.list_updates(1)
        assert (old_update.site, old_update.bytes_up, old_update.status) == (
            "london",
            111,
            "applied",
        )
        assert (old_update.period, old_update.average_applied, old_update.delay) == (
            None,
            None,
            None,
        )
        assert repo.site_summaries(1)[0].mean_delay is None

        # The new fields work next to the old row.
        record(repo, 1, 2, [update("london", period=3, average_applied=0, delay=2)])
        assert [(u.period, u.average_applied, u.delay) for u in repo.list_updates(1)] == [
            (None, None, None),
            (3, 0, 2),
        ]
        assert repo.site_summaries(1)[0].mean_delay == 2.0

        with repo._engine.begin() as connection:
            command.downgrade(alembic_config(connection), "0003")
        with repo._engine.connect() as connection:
            assert current_revisions(connection) == {"0003"}
            assert not DELAY_COLUMNS & _columns(connection, "updates")
            # Every other column and every row survives the drop (no cascade, no rebuild).
            assert _columns(connection, "updates") >= VIRTUAL_COLUMNS["updates"]
            counts = {
                name: connection.execute(text(f"SELECT COUNT(*) FROM {name}")).scalar_one()
                for name in ("runs", "sites", "rounds", "updates")
            }
            assert counts == {"runs": 1, "sites": 1, "rounds": 2, "updates": 2}

    with LedgerRepository.open(ledger_url) as repo:  # and back up to head
        with repo._engine.connect() as connection:
            assert current_revisions(connection) == {head_revision()}
            _assert_no_schema_diff(connection)
        stored = repo.list_updates(1)
        assert [(u.round, u.delay) for u in stored] == [(1, None), (2, None)]
        assert repo.site_summaries(1)[0].mean_delay is None


RESUME_TABLES = {"checkpoints", "run_events"}


def _row_counts(connection: Connection) -> dict[str, int]:
    return {
        name: connection.execute(text(f"SELECT COUNT(*) FROM {name}")).scalar_one()
        for name in ("runs", "sites", "rounds", "updates", "evaluations")
    }


def test_an_0004_ledger_upgrades_to_checkpoints_keeping_every_row_and_downgrades_back(
    ledger_url: str,
) -> None:
    engine = create_ledger_engine(ledger_url)
    try:
        with engine.begin() as connection:
            command.upgrade(alembic_config(connection), "0004")
            _fill_an_0001_ledger(connection)  # 0002 to 0004 only added; these rows still fit
        with engine.connect() as connection:
            assert current_revisions(connection) == {"0004"}
            assert not RESUME_TABLES & set(inspect(connection).get_table_names())
            before = _row_counts(connection)
            old_rows = {
                name: connection.execute(text(f"SELECT * FROM {name} ORDER BY id")).all()
                for name in ("runs", "sites", "rounds", "updates")
            }
    finally:
        engine.dispose()

    with LedgerRepository.open(ledger_url) as repo:  # opening upgrades to head
        with repo._engine.connect() as connection:
            assert current_revisions(connection) == {head_revision()}
            assert set(inspect(connection).get_table_names()) >= RESUME_TABLES
            assert _row_counts(connection) == before
            # Every old row is there, column for column (runs gained one, NULL: no owner).
            for name, rows in old_rows.items():
                now = connection.execute(text(f"SELECT * FROM {name} ORDER BY id")).all()
                width = len(rows[0])
                assert [tuple(r)[:width] for r in now] == [tuple(r) for r in rows], name
            _assert_no_schema_diff(connection)
        run = repo.get_run(1)
        assert (run.name, run.status, run.rounds_completed, run.owner) == (
            "old",
            "running",
            1,
            None,
        )
        assert repo.list_checkpoints(1) == []
        assert repo.latest_checkpoint(1) is None
        assert repo.list_events(1) == []

        # The new API works next to the old rows: the old run can even be reopened.
        assert repo.reopen_run(1, "host:7").owner == "host:7"
        record(
            repo,
            1,
            2,
            [update("london")],
            checkpoint=CheckpointInput(path="/c/round-000002.npz", size_bytes=3, kept=True),
        )
        assert [c.round for c in repo.list_checkpoints(1)] == [2]
        assert [e.kind for e in repo.list_events(1)] == ["resumed"]

        with repo._engine.begin() as connection:
            command.downgrade(alembic_config(connection), "0004")
        with repo._engine.connect() as connection:
            assert current_revisions(connection) == {"0004"}
            assert not RESUME_TABLES & set(inspect(connection).get_table_names())
            assert "owner" not in _columns(connection, "runs")
            # Dropping the column must not cascade: every row survives the downgrade.
            assert _row_counts(connection) == {**before, "rounds": 2, "updates": 2}

    with LedgerRepository.open(ledger_url) as repo:  # and back up to head
        with repo._engine.connect() as connection:
            assert current_revisions(connection) == {head_revision()}
            _assert_no_schema_diff(connection)
        assert [r.round for r in repo.list_rounds(1)] == [1, 2]
        assert (repo.get_run(1).owner, repo.list_checkpoints(1)) == (None, [])


def test_an_0005_ledger_upgrades_to_wire_traffic_keeping_every_row_and_downgrades_back(
    ledger_url: str,
) -> None:
    engine = create_ledger_engine(ledger_url)
    try:
        with engine.begin() as connection:
            command.upgrade(alembic_config(connection), "0005")
            _fill_an_0001_ledger(connection)  # 0002 to 0005 only added; these rows still fit
        with engine.connect() as connection:
            assert "traffic" not in inspect(connection).get_table_names()
            before = _row_counts(connection)
    finally:
        engine.dispose()

    with LedgerRepository.open(ledger_url) as repo:  # opening upgrades to head
        with repo._engine.connect() as connection:
            assert current_revisions(connection) == {head_revision()}
            assert _row_counts(connection) == before
            _assert_no_schema_diff(connection)
        # An old run's totals are its old rows' bytes; it has no traffic rows.
        run = repo.get_run(1)
        assert (run.bytes_up, run.bytes_down) == (111, 222)
        assert repo.list_traffic(1) == []
        [summary] = repo.site_summaries(1)
        assert (summary.queries, summary.total_bytes_up, summary.total_bytes_down) == (
            0,
            111,
            222,
        )

        # The new API works next to the old rows.
        repo.add_traffic(
            1,
            [TrafficInput(site="london", kind="query", messages=1, bytes_up=5, bytes_down=7)],
        )
        assert (repo.get_run(1).bytes_up, repo.get_run(1).bytes_down) == (116, 229)

        with repo._engine.begin() as connection:
            command.downgrade(alembic_config(connection), "0005")
        with repo._engine.connect() as connection:
            assert current_revisions(connection) == {"0005"}
            assert "traffic" not in inspect(connection).get_table_names()
            assert _row_counts(connection) == before

    with LedgerRepository.open(ledger_url) as repo:  # and back up to head
        with repo._engine.connect() as connection:
            assert current_revisions(connection) == {head_revision()}
            _assert_no_schema_diff(connection)
        assert repo.list_traffic(1) == []  # a downgrade drops what 0006 added
        assert repo.get_run(1).bytes_up == 111


def test_an_0007_ledger_upgrades_to_update_fragments_keeping_its_rows_and_downgrades_back(
    ledger_url: str,
) -> None:
    engine = create_ledger_engine(ledger_url)
    try:
        with engine.begin() as connection:
            command.upgrade(alembic_config(connection), "0007")
            _fill_an_0001_ledger(connection)  # 0002 to 0007 only added; these rows still fit
        with engine.connect() as connection:
            assert current_revisions(connection) == {"0007"}
            assert "fragment" not in _columns(connection, "updates")
            before = _row_counts(connection)
    finally:
        engine.dispose()

    with LedgerRepository.open(ledger_url) as repo:  # opening upgrades to head
        with repo._engine.connect() as connection:
            assert current_revisions(connection) == {head_revision()}
            [fragment] = [
                c for c in inspect(connection).get_columns("updates") if c["name"] == "fragment"
            ]
            assert fragment["nullable"]
            assert _row_counts(connection) == before
            _assert_no_schema_diff(connection)
        # The old row is intact and reads as an update of the whole model.
        [old_update] = repo.list_updates(1)
        assert (old_update.site, old_update.bytes_up, old_update.fragment) == ("london", 111, None)

        # The new field works next to the old row, 0 (the first fragment) included.
        record(repo, 1, 2, [update("london", fragment=2), update("london", fragment=0)])
        assert [u.fragment for u in repo.list_updates(1)] == [None, 2, 0]

        with repo._engine.begin() as connection:
            command.downgrade(alembic_config(connection), "0007")
        with repo._engine.connect() as connection:
            assert current_revisions(connection) == {"0007"}
            assert "fragment" not in _columns(connection, "updates")
            # Every other column and every row survives the drop (no cascade, no rebuild).
            assert _columns(connection, "updates") >= DELAY_COLUMNS | VIRTUAL_COLUMNS["updates"]
            assert _row_counts(connection) == {**before, "rounds": 2, "updates": 3}

    with LedgerRepository.open(ledger_url) as repo:  # and back up to head
        with repo._engine.connect() as connection:
            assert current_revisions(connection) == {head_revision()}
            _assert_no_schema_diff(connection)
        assert [u.fragment for u in repo.list_updates(1)] == [None, None, None]


def test_opening_says_which_upgrade_it_made_to_an_older_ledger(ledger_url: str) -> None:
    with LedgerRepository.open(ledger_url) as repo:  # a new ledger is created, not upgraded
        assert repo.schema_upgrade is None
        with repo._engine.begin() as connection:
            command.downgrade(alembic_config(connection), "0007")

    with LedgerRepository.open(ledger_url, create=False) as repo:
        assert repo.schema_upgrade == SchemaUpgrade(old="0007", new=head_revision())
    with LedgerRepository.open(ledger_url, create=False) as repo:
        assert repo.schema_upgrade is None


def test_a_schema_from_a_newer_flplatform_is_refused(ledger_url: str) -> None:
    with LedgerRepository.open(ledger_url) as repo, repo._engine.begin() as connection:
        connection.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = 'f00dcafe'"))

    with pytest.raises(StorageError, match="revision f00dcafe, which this flplatform does not"):
        LedgerRepository.open(ledger_url)


# A racer imports once, then for every line ``[url, start]`` on stdin sleeps until the wall
# clock reaches ``start`` (so all racers set off together, which a line written to each in turn
# would not achieve), opens the ledger, records one run and answers "ok" or the error.
_RACER = """
import json, sys, time
from storage import LedgerRepository
print("ready", flush=True)
for line in sys.stdin:
    url, start = json.loads(line)
    time.sleep(max(0.0, start - time.time()))
    try:
        with LedgerRepository.open(url) as repo:
            repo.create_run(name="r", strategy="s", seed=0, config={}, num_rounds_planned=1)
    except Exception as exc:
        print("error:", " ".join(str(exc).split()), flush=True)
    else:
        print("ok", flush=True)
"""
RACERS = 5
FREE_RACES = 4  # on new databases, nothing else holding them
BLOCKED_RACES = 2  # on new databases that another process is busy creating
HOLD_S = 0.3


@contextmanager
def _held_as_while_being_created(url: str) -> Iterator[None]:
    """Hold the lock that a process creating the ledger at ``url`` holds meanwhile.

    On SQLite that is the write lock of the still-empty file, as while the creator switches
    it to WAL (whoever lost that race used to fail at once with "database is locked", the
    busy timeout notwithstanding); on PostgreSQL the migration's advisory lock.
    """
    if make_url(url).get_backend_name() == "sqlite":
        with sqlite_write_lock(make_url(url).database or ""):
            yield
        return
    engine = create_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(
                text("SELECT pg_advisory_xact_lock(:key)"), {"key": _POSTGRES_LOCK_KEY}
            )
            yield
    finally:
        engine.dispose()


def _answer(racer: subprocess.Popen[str], timeout: float = 90) -> str:
    """The racer's next line ("ready", "ok" or "error: ..."); a hung racer is killed."""
    assert racer.stdout is not None
    # A racer writes one line per line it is sent, so nothing is left buffered between calls.
    if not select.select([racer.stdout], [], [], timeout)[0]:
        racer.kill()
        return f"no answer within {timeout} s"
    return racer.stdout.readline().strip() or "the racer died"


def test_processes_racing_to_create_a_new_ledger_all_succeed(
    new_ledger_urls: Callable[[], str],
) -> None:
    # RACERS processes set off together to open (creating and migrating) the same new ledger
    # and record a run in it: FREE_RACES times on their own, BLOCKED_RACES times while a lock is
    # held as by a creator midway, released HOLD_S after they set off, then once on a ledger
    # that exists. Every one of them must succeed every time.
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER],
            cwd=REPO_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(RACERS)
    ]
    free = [new_ledger_urls() for _ in range(FREE_RACES)]
    blocked = [new_ledger_urls() for _ in range(BLOCKED_RACES)]
    failures: list[str] = []
    try:
        for racer in racers:
            assert _answer(racer) == "ready"
        rounds = [
            *(("new ledger", url) for url in free),
            *(("new ledger, held locked", url) for url in blocked),
            ("existing ledger", free[0]),
        ]
        for number, (kind, url) in enumerate(rounds):
            with ExitStack() as stack:
                if url in blocked:
                    stack.enter_context(_held_as_while_being_created(url))
                start = time.time() + 0.05
                for racer in racers:
                    assert racer.stdin is not None
                    racer.stdin.write(json.dumps([url, start]) + "\n")
                    racer.stdin.flush()
                if url in blocked:
                    time.sleep(max(0.0, start + HOLD_S - time.time()))
            for racer in racers:
                answer = _answer(racer)
                if answer != "ok":
                    failures.append(f"round {number} ({kind}): {answer}")
    finally:
        for racer in racers:
            if racer.stdin is not None:
                racer.stdin.close()
        for racer in racers:
            racer.wait(timeout=90)

    assert not failures, "\n".join(failures)
    assert [racer.returncode for racer in racers] == [0] * RACERS
    for url in [*free, *blocked]:
        with LedgerRepository.open(url) as repo:
            assert len(repo.list_runs()) == (2 if url == free[0] else 1) * RACERS
            with repo._engine.connect() as connection:
                assert current_revisions(connection) == {head_revision()}


def test_every_migration_file_would_ship_in_a_wheel() -> None:
    """Files under migrations/ are in a package (have __init__.py) or match package-data."""
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["storage"]
    package_root = MIGRATIONS_DIR.parent
    files = [
        path
        for path in MIGRATIONS_DIR.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    ]
    assert {
        "env.py",
        "script.py.mako",
        "alembic.ini",
        "0001_initial.py",
        "0002_evaluations.py",
        "0003_virtual_time.py",
        "0004_delayed_updates.py",
        "0005_checkpoints.py",
        "0006_traffic.py",
        "0007_forget_passwords.py",
        "0008_update_fragment.py",
    } <= {f.name for f in files}
    for path in files:
        in_package = path.suffix == ".py" and (path.parent / "__init__.py").exists()
        relative = path.relative_to(package_root).as_posix()
        assert in_package or any(fnmatch(relative, p) for p in patterns), relative


def test_passwords_kept_in_old_runs_options_are_forgotten(ledger_url: str) -> None:
    secret = "s3cr!t-word"
    urls = {
        1: f"postgresql+psycopg://alice:{secret}@db.example:5433/ledger",
        2: f"postgresql+psycopg://alice@db.example/ledger?password={secret}&sslmode=require",
        3: "sqlite:////var/ledger.db",
        4: "",  # the default ledger (`simulate` without --db)
    }
    runs = table("runs", column("id"), column("config", JSON))
    engine = create_ledger_engine(ledger_url)
    try:
        with engine.begin() as connection:
            command.upgrade(alembic_config(connection), "0006")
            _fill_an_0001_ledger(connection)  # run 1
            for run_id in (2, 3, 4):
                connection.execute(
                    text(
                        "INSERT INTO runs (id, name, strategy, seed, num_rounds_planned, status, "
                        "config, created_at) SELECT :id, name, strategy, seed, "
                        "num_rounds_planned, status, config, created_at FROM runs WHERE id = 1"
                    ),
                    {"id": run_id},
                )
            for run_id, url in urls.items():
                connection.execute(
                    runs.update().where(runs.c.id == run_id).values(config={"lr": 0.1, "db": url})
                )
    finally:
        engine.dispose()

    with LedgerRepository.open(ledger_url) as repo:  # opening upgrades to head
        configs = {run_id: repo.get_run(run_id).config for run_id in urls}
    assert configs == {
        1: {"lr": 0.1, "db": "postgresql+psycopg://alice@db.example:5433/ledger"},
        2: {"lr": 0.1, "db": "postgresql+psycopg://alice@db.example/ledger?sslmode=require"},
        3: {"lr": 0.1, "db": "sqlite:////var/ledger.db"},  # no password: untouched
        4: {"lr": 0.1, "db": ""},  # was "<not a database URL: removed>"
    }
    assert secret not in repr(configs)
