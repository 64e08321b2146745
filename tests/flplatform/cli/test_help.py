"""``--help`` that reads: descriptions wrap where the terminal ends, never where a line of
source did (issue 33: "with lists, a / sweep of runs in one start-up")."""

from __future__ import annotations

import inspect

import pytest
import typer
from typer.testing import CliRunner

from flplatform.cli.app import app

runner = CliRunner()
WIDE = "2000"  # columns: every paragraph of ours fits on one line


def _commands(group: typer.Typer, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = [(*prefix, c.name or c.callback.__name__) for c in group.registered_commands]
    for sub in group.registered_groups:
        assert sub.typer_instance is not None and sub.name
        found += _commands(sub.typer_instance, (*prefix, sub.name))
    return found


COMMANDS = _commands(app)
GROUPS = [()] + [(g.name,) for g in app.registered_groups if g.name]


def _help(monkeypatch: pytest.MonkeyPatch, *words: str) -> list[str]:
    monkeypatch.setenv("COLUMNS", WIDE)
    result = runner.invoke(app, [*words, "--help"])
    assert result.exit_code == 0, result.output
    return result.output.splitlines()


def _panel(lines: list[str], title: str) -> list[str]:
    """The rows inside the box titled ``title``, without the box's edges."""
    start = next(i for i, line in enumerate(lines) if line.startswith(f"╭─ {title} "))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("╰"))
    return [line.strip("│ ").rstrip() for line in lines[start + 1 : end]]


@pytest.mark.parametrize("group", GROUPS, ids=lambda g: " ".join(g) or "flplatform")
def test_each_command_of_a_list_is_one_line_on_a_wide_terminal(
    monkeypatch: pytest.MonkeyPatch, group: tuple[str, ...]
) -> None:
    rows = _panel(_help(monkeypatch, *group), "Commands")
    listed = [c[-1] for c in COMMANDS if c[:-1] == group]
    listed += [g.name for g in app.registered_groups if not group and g.name]
    assert sorted(row.split()[0] for row in rows) == sorted(listed)  # no continuation rows
    # ... and each says its whole first paragraph, the sentence unbroken
    for row in rows:
        name, description = row.split(maxsplit=1)
        assert description.endswith((".", ")")), row


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_each_paragraph_of_a_commands_help_is_one_line_on_a_wide_terminal(
    monkeypatch: pytest.MonkeyPatch, command: tuple[str, ...]
) -> None:
    lines = _help(monkeypatch, *command)
    usage = next(i for i, line in enumerate(lines) if line.strip().startswith("Usage:"))
    first_panel = next(i for i, line in enumerate(lines) if line.startswith("╭"))
    shown = [line.strip() for line in lines[usage + 1 : first_panel]]
    paragraphs = [line for line in shown if line]
    callback = _callback(command)
    written = [p for p in (inspect.getdoc(callback) or "").split("\n\n") if p.strip()]
    assert len(paragraphs) == len(written)  # not one line more: none broke
    for line, source in zip(paragraphs, written, strict=True):
        assert line.split() == source.split()


def _callback(command: tuple[str, ...]) -> object:
    group = app
    for name in command[:-1]:
        group = next(g.typer_instance for g in group.registered_groups if g.name == name)
    return next(c.callback for c in group.registered_commands if c.name == command[-1])
