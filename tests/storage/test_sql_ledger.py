"""``SqlLedger``: each round committed with its checkpoint file, then retention."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flplatform.core.checkpoint import CheckpointError
from flplatform.core.errors import ConfigError, NotFoundError, StorageError
from flplatform.engine.events import RoundSummary, SiteInfo
from flplatform.run.ledger import (
    SqlLedger,
    load_checkpoint,
    process_owner,
    run_checkpoint_directory,
)
from storage import LedgerRepository, ledger_id
from tests.helpers.ledger_records import T0, make_run


def summary(step: int) -> RoundSummary:
    return RoundSummary(
        server_round=step,
        model_version=step,
        started_at=T0 + step,
        finished_at=T0 + step + 0.5,
        metrics={"accuracy": step / 10},
        train_loss=None,
        updates=(),
    )


def state(step: int) -> dict[str, Any]:
    return {"kind": "test", "server_round": step, "w": np.full(3, step, dtype=np.float32)}


@pytest.fixture
def repo(sqlite_ledger: str) -> Any:
    with LedgerRepository.open(sqlite_ledger) as repository:
        yield repository


def files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_retention_keeps_every_nth_up_to_the_limit_plus_the_last_and_the_final(
    repo: LedgerRepository, tmp_path: Path
) -> None:
    run_id = make_run(repo)
    ledger = SqlLedger(
        repo, run_id, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=2, keep_checkpoints=2
    )
    after: dict[int, list[tuple[int, bool]]] = {}
    for step in range(1, 8):
        ledger.record_round(summary(step), state(step))
        after[step] = [(c.round, c.kept) for c in repo.list_checkpoints(run_id)]
        # Every row names a file that is there, and only those files are there.
        assert files(ledger.directory) == [f"round-{r:06d}.npz" for r, _ in after[step]]

    assert after == {
        1: [(1, False)],
        2: [(2, True)],
        3: [(2, True), (3, False)],
        4: [(2, True), (4, True)],
        5: [(2, True), (4, True), (5, False)],
        6: [(4, True), (6, True)],
        7: [(4, True), (6, True), (7, False)],
    }
    final = ledger.finish()
    assert final is not None and (final.round, final.kept) == (7, True)
    assert [(c.round, c.kept) for c in repo.list_checkpoints(run_id)] == [
        (4, True),
        (6, True),
        (7, True),
    ]
    record, loaded = load_checkpoint(repo, run_id)
    assert record.round == 7 and loaded["server_round"] == 7
    assert np.array_equal(loaded["w"], state(7)["w"])
    assert record.size_bytes == os.path.getsize(record.path)
    assert stat.S_IMODE(os.stat(record.path).st_mode) == 0o600
    assert load_checkpoint(repo, run_id, 4)[1]["server_round"] == 4


def test_keep_one_keeps_the_last_periodic_checkpoint_and_the_resume_point(
    repo: LedgerRepository, tmp_path: Path
) -> None:
    run_id = make_run(repo)
    ledger = SqlLedger(
        repo, run_id, checkpoint_dir=tmp_path, checkpoint_every=2, keep_checkpoints=1
    )
    for step in (1, 2, 3, 4, 5):
        ledger.record_round(summary(step), state(step))
    assert [c.round for c in repo.list_checkpoints(run_id)] == [4, 5]
    assert files(ledger.directory) == ["round-000004.npz", "round-000005.npz"]


def test_checkpoint_every_zero_keeps_only_the_resume_point_and_the_final_model(
    repo: LedgerRepository, tmp_path: Path
) -> None:
    run_id = make_run(repo)
    ledger = SqlLedger(repo, run_id, checkpoint_dir=tmp_path, checkpoint_every=0)
    for step in (1, 2, 3, 4, 5, 6):
        ledger.record_round(summary(step), state(step))
        assert [(c.round, c.kept) for c in repo.list_checkpoints(run_id)] == [(step, False)]
    final = ledger.finish()
    assert final is not None and (final.round, final.kept) == (6, True)
    assert files(ledger.directory) == ["round-000006.npz"]


def test_a_resumed_run_deletes_the_resume_point_once_it_has_a_newer_one(
    repo: LedgerRepository, tmp_path: Path
) -> None:
    run_id = make_run(repo)
    first = SqlLedger(repo, run_id, checkpoint_dir=tmp_path, checkpoint_every=5)
    for step in (1, 2, 3):
        first.record_round(summary(step), state(step))
    # The process dies; another one reopens the run and goes on from round 3's checkpoint.
    repo.reopen_run(run_id, "host:2")
    second = SqlLedger(repo, run_id, checkpoint_dir=tmp_path, checkpoint_every=5)
    assert load_checkpoint(repo, run_id)[0].round == 3
    second.record_round(summary(4), state(4))
    assert [c.round for c in repo.list_checkpoints(run_id)] == [4]
    assert files(second.directory) == ["round-000004.npz"]


def test_rounds_without_state_have_no_checkpoint(repo: LedgerRepository, tmp_path: Path) -> None:
    run_id = make_run(repo)
    ledger = SqlLedger(repo, run_id, checkpoint_dir=tmp_path)
    ledger.record_round(summary(1))
    assert [r.round for r in repo.list_rounds(run_id)] == [1]
    assert repo.list_checkpoints(run_id) == [] and ledger.finish() is None
    assert not ledger.directory.exists()


def test_a_round_that_is_not_committed_leaves_no_file(
    repo: LedgerRepository, tmp_path: Path
) -> None:
    run_id = make_run(repo)
    ledger = SqlLedger(repo, run_id, checkpoint_dir=tmp_path)
    bad = RoundSummary(**{**summary(1).__dict__, "finished_at": T0 - 100})  # before its start

    with pytest.raises(StorageError, match="before started_at"):
        ledger.record_round(bad, state(1))

    assert repo.list_rounds(run_id) == [] and repo.list_checkpoints(run_id) == []
    assert files(ledger.directory) == []


def test_a_state_that_cannot_be_saved_records_nothing(
    repo: LedgerRepository, tmp_path: Path
) -> None:
    run_id = make_run(repo)
    ledger = SqlLedger(repo, run_id, checkpoint_dir=tmp_path)
    with pytest.raises(CheckpointError, match="object is not checkpoint data"):
        ledger.record_round(summary(1), {"x": object()})
    assert repo.list_rounds(run_id) == [] and files(ledger.directory) == []


def test_a_round_recorded_twice_leaves_its_checkpoint_as_it_was(
    repo: LedgerRepository, tmp_path: Path
) -> None:
    run_id = make_run(repo)
    ledger = SqlLedger(repo, run_id, checkpoint_dir=tmp_path)
    ledger.record_round(summary(1), state(1))
    path = Path(repo.list_checkpoints(run_id)[0].path)
    before = path.read_bytes()

    with pytest.raises(StorageError, match="already recorded"):
        ledger.record_round(summary(1), state(99))

    assert path.read_bytes() == before
    assert load_checkpoint(repo, run_id)[1]["server_round"] == 1


def test_checkpoints_go_under_the_home_by_ledger_and_run(
    repo: LedgerRepository, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLPLATFORM_HOME", str(tmp_path / "home"))
    run_id = make_run(repo)
    ledger = SqlLedger(repo, run_id)
    ledger.record_round(summary(1), state(1))
    expected = tmp_path / "home" / "checkpoints" / repo.ledger_id / f"run-{run_id}"
    assert ledger.directory == expected == run_checkpoint_directory(repo, run_id)
    assert files(expected) == ["round-000001.npz"]
    assert repo.ledger_id.startswith("sqlite-ledger-")


def test_the_ledger_id_names_the_database_never_its_password() -> None:
    alice = ledger_id("postgresql+psycopg://alice:s3cret@db.example:5432/fl")
    bob = ledger_id("postgresql+psycopg://bob:other@db.example:5432/fl")
    elsewhere = ledger_id("postgresql+psycopg://alice:s3cret@db.example:5432/fl2")
    assert alice == bob != elsewhere
    assert "s3cret" not in alice and "alice" not in alice
    assert alice.startswith("postgresql-fl-")
    assert ledger_id("sqlite:////a/ledger.db") != ledger_id("sqlite:////b/ledger.db")


def sqlite_url(path: Path | str) -> str:
    return f"sqlite:///{path}"


def test_one_sqlite_file_is_one_ledger_whatever_links_lead_to_it(tmp_path: Path) -> None:
    real = tmp_path / "real"
    (real / "sub").mkdir(parents=True)
    (real / "ledger.db").touch()
    (tmp_path / "link.db").symlink_to(real / "ledger.db")  # a link to the file
    (tmp_path / "dir-link").symlink_to(real)  # a link to its directory
    (tmp_path / "sub-link").symlink_to(real / "sub")  # ".." from here is real/, not tmp_path
    its_id = ledger_id(sqlite_url(real / "ledger.db"))
    assert ledger_id(sqlite_url(tmp_path / "link.db")) == its_id
    assert ledger_id(sqlite_url(tmp_path / "dir-link" / "ledger.db")) == its_id
    assert ledger_id(f"sqlite:///{tmp_path}/sub-link/../ledger.db") == its_id
    # a ledger not created yet: the id it will keep once it is
    assert ledger_id(sqlite_url(tmp_path / "dir-link" / "new.db")) == ledger_id(
        sqlite_url(real / "new.db")
    )


def old_ledger_id(backend: str, database: str, readable: str) -> str:
    """The id as it was made before links were resolved: the path hashed as given."""
    location = "\x00".join((backend, "", "", database))
    return f"{backend}-{readable}-{hashlib.sha256(location.encode()).hexdigest()[:12]}"


def test_a_path_without_links_and_in_memory_or_uri_ledgers_keep_their_ids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = tmp_path.resolve()  # no link on the way (checkpoint directories must not move)
    assert ledger_id(sqlite_url(real / "ledger.db")) == old_ledger_id(
        "sqlite", str(real / "ledger.db"), "ledger"
    )
    assert ledger_id("sqlite://") == old_ledger_id("sqlite", "", "memory")
    assert ledger_id("sqlite:///:memory:") == old_ledger_id("sqlite", ":memory:", "memory")
    # a file: URI is SQLite's to read (its query may name another file): taken as given
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere.db").touch()
    Path("file:x.db").symlink_to(tmp_path / "elsewhere.db")
    assert ledger_id("sqlite:///file:x.db?uri=true") == old_ledger_id(
        "sqlite", "file:x.db", "file_x"
    )


def test_a_run_resumed_through_a_link_keeps_its_checkpoints_in_one_directory(
    sqlite_ledger: str, tmp_path: Path
) -> None:
    ledger_file = tmp_path / "ledger.db"
    (tmp_path / "link.db").symlink_to(ledger_file)
    root = tmp_path / "ckpt"
    kept = {"checkpoint_dir": root, "checkpoint_every": 1, "keep_checkpoints": 5}
    with LedgerRepository.open(sqlite_url(ledger_file)) as first:
        run_id = make_run(first)
        SqlLedger(first, run_id, **kept).record_round(summary(1), state(1))
    with LedgerRepository.open(sqlite_url(tmp_path / "link.db")) as through_link:
        resumed = SqlLedger(through_link, run_id, **kept)
        resumed.record_round(summary(2), state(2))
        assert resumed.directory == run_checkpoint_directory(first, run_id, root)
    assert [p.relative_to(root).parent for p in root.rglob("*.npz")] == [
        Path(first.ledger_id) / f"run-{run_id}"
    ] * 2


def test_load_checkpoint_says_which_rounds_have_one(repo: LedgerRepository, tmp_path: Path) -> None:
    run_id = make_run(repo)
    with pytest.raises(NotFoundError, match=f"run {run_id} has no checkpoints"):
        load_checkpoint(repo, run_id)
    ledger = SqlLedger(repo, run_id, checkpoint_dir=tmp_path, checkpoint_every=2)
    for step in (1, 2, 3):
        ledger.record_round(summary(step), state(step))
    with pytest.raises(NotFoundError, match="no checkpoint of round 1; .* rounds 2, 3"):
        load_checkpoint(repo, run_id, 1)
    Path(repo.list_checkpoints(run_id)[-1].path).unlink()
    with pytest.raises(CheckpointError, match="round 3 of run .* does not exist"):
        load_checkpoint(repo, run_id)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"checkpoint_every": -1}, r"checkpoint-every must be an integer >= 0 \(0: keep only"),
        ({"checkpoint_every": 1.5}, "checkpoint-every must be an integer"),
        ({"keep_checkpoints": 0}, "keep-checkpoints must be an integer >= 1, got 0"),
        ({"keep_checkpoints": -1}, "keep-checkpoints must be an integer >= 1"),
    ],
)
def test_retention_options_are_checked(
    repo: LedgerRepository, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        SqlLedger(repo, make_run(repo), **options)


def test_sites_that_rejoin_keep_their_row(repo: LedgerRepository, tmp_path: Path) -> None:
    run_id = make_run(repo)
    ledger = SqlLedger(repo, run_id, checkpoint_dir=tmp_path)
    ledger.add_site(SiteInfo(node_id=5, name="london", partition_id=0), {})
    ledger.add_site(SiteInfo(node_id=77, name="london", partition_id=0), {})
    assert [(s.name, s.node_id) for s in repo.list_sites(run_id)] == [("london", 77)]
    host, pid = process_owner().rsplit(":", 1)
    assert host and int(pid) == os.getpid()
