"""What a failed simulation's message quotes from Flower's output; its files' permissions."""

from __future__ import annotations

import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from flplatform.simulation import (
    flower_environment,
    forget_snapshots,
    logs_dir,
    private_file,
    telling_line,
    work_home,
)
from strategies.mods.snapshots import state_root

FLOWER_PANEL = """\
Using SuperLink: local (127.0.0.1:43799)
\x1b[31m╭─ Error ─────────────────────────────────────╮\x1b[0m
│ The Flower App does not meet the project     │
│ structure requirements: 'a/b/c' exceeds the  │
│ maximum directory depth of 10.               │
╰──────────────────────────────────────────────╯
"""


def test_a_flower_error_box_is_quoted_whole_on_one_line() -> None:
    assert telling_line(FLOWER_PANEL) == (
        "The Flower App does not meet the project structure requirements: 'a/b/c' exceeds "
        "the maximum directory depth of 10."
    )


def test_a_traceback_gives_its_exception_line() -> None:
    output = "Traceback (most recent call last):\n  File 'x'\nValueError: bad k\nexiting\n"
    assert telling_line(output) == "ValueError: bad k"


def test_otherwise_the_last_line_mentioning_an_error_then_the_last_line() -> None:
    assert telling_line("start\nan error happened here\nbye\n") == "an error happened here"
    assert telling_line("start\nbye\n") == "bye"
    assert telling_line("") == "no output"


def test_the_logs_and_the_files_written_there_are_the_owners_only(tmp_path: Path) -> None:
    # An older flplatform made them readable by everyone; the next run takes that back.
    (tmp_path / "logs").mkdir(mode=0o755)
    old = tmp_path / "logs" / "run.log"
    old.write_text("what the last run said")
    old.chmod(0o644)

    logs = logs_dir(tmp_path)
    with private_file(old) as file:
        file.write(b"this run")
    with private_file(logs / "new.run-config.toml") as file:
        file.write(b"x = 1")

    assert stat.S_IMODE(logs.stat().st_mode) == 0o700
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in logs.iterdir()} == {
        "run.log": 0o600,
        "new.run-config.toml": 0o600,
    }
    assert old.read_text() == "this run"  # written from its start


def test_a_finished_runs_snapshots_are_forgotten_where_its_sites_wrote_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The default set-up: neither variable set; the simulated sites get
    # FLPLATFORM_HOME=./.flplatform from flower_environment and write under it.
    monkeypatch.delenv("FLPLATFORM_SITE_STATE", raising=False)
    monkeypatch.delenv("FLPLATFORM_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    sites_root = state_root({}, flower_environment(work_home()))
    assert sites_root == tmp_path / ".flplatform" / "site-state"
    (sites_root / "run-tag-1" / "london").mkdir(parents=True)
    (sites_root / "run-tag-2" / "london").mkdir(parents=True)

    forget_snapshots(SimpleNamespace(tag="run-tag-1"))  # type: ignore[arg-type]

    assert sorted(p.name for p in sites_root.iterdir()) == ["run-tag-2"]
