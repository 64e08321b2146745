"""The ledger check that every run starts with: the default home is created, a --db is not.

A fresh checkout has no ``.flplatform``: ``make demo`` and ``flplatform simulate`` must
create it rather than fail on the missing directory.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flplatform.app.config import RunConfig
from flplatform.core.errors import StorageError
from flplatform.launch.simulation import check_ledger
from storage import LedgerRepository


def test_default_ledger_home_is_created(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "fresh" / ".flplatform"  # neither directory exists yet
    monkeypatch.setenv("FLPLATFORM_HOME", str(home))
    url = check_ledger(RunConfig())
    assert (home / "ledger.db").is_file()
    with LedgerRepository.open(url) as repository:
        assert repository.list_runs() == []


def test_default_home_under_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FLPLATFORM_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    check_ledger(RunConfig())
    assert (tmp_path / ".flplatform" / "ledger.db").is_file()


def test_missing_directory_of_a_given_db_is_not_created(tmp_path: Path) -> None:
    missing = tmp_path / "typo" / "runs.db"
    with pytest.raises(StorageError, match="does not exist"):
        check_ledger(RunConfig(db=f"sqlite:///{missing}"))
    assert not missing.parent.exists()
