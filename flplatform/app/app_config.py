"""``[tool.flwr.app.config]`` written from the options table (``RunConfig``'s fields).

Flower reads a Flower app's run-config keys from its static ``pyproject.toml``, so the
table is written there: ``python -m flplatform.app.app_config [pyproject.toml ...]`` rewrites
the table of each file (default: ``pyproject.toml``), keeping the values a file sets (an
example app's own choices). ``tests/flplatform/test_config.py`` fails when they disagree.
"""

from __future__ import annotations

import sys
import textwrap
import tomllib
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from flplatform.app.config import RunConfig, option_keys
from flplatform.app.config_rules import option_of


def app_config_table(values: Mapping[str, Any] | None = None) -> str:
    """``[tool.flwr.app.config]`` as TOML: every option, its help above it.

    ``values``: the keys whose value differs from the default (an example app's own).
    """
    given = dict(values or {})
    lines = [
        "[tool.flwr.app.config]",
        "# Written from the options table, RunConfig in flplatform/app/config.py, by",
        "# `python -m flplatform.app.app_config <pyproject.toml>`: edit the table there, not here.",
        "# Flower reads this file, and refuses a run-config key that is not declared in it.",
    ]
    for f in fields(RunConfig):
        key = f.name.replace("_", "-")
        about = option_of(f)
        used = f" Strategies: {', '.join(about.strategies)}." if about.strategies else ""
        lines += textwrap.wrap(
            about.help + used, width=98, initial_indent="# ", subsequent_indent="# "
        )
        lines.append(f"{key} = {_toml(given.get(key, f.default))}")
    return "\n".join(lines) + "\n"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, tuple):
        value = ",".join(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def rewrite_app_config(path: Path) -> str:
    """``path``'s text with its ``[tool.flwr.app.config]`` table written from the table.

    Values the file already sets for known keys are kept (an example's own choices).
    """
    text = path.read_text()
    current = tomllib.loads(text).get("tool", {}).get("flwr", {}).get("app", {}).get("config", {})
    lines = text.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.strip() == "[tool.flwr.app.config]")
    end = next(
        (i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("[")),
        len(lines),
    )
    while end > start + 1 and not lines[end - 1].strip():
        end -= 1  # keep the blank lines before the next table
    known = set(option_keys())
    kept = {key: value for key, value in current.items() if key in known}
    return "".join(lines[:start]) + app_config_table(kept) + "".join(lines[end:])


def main(paths: list[str]) -> None:
    """Rewrite the ``[tool.flwr.app.config]`` table of each file."""
    for arg in paths or ["pyproject.toml"]:
        target = Path(arg)
        target.write_text(rewrite_app_config(target))
        print(f"wrote [tool.flwr.app.config] of {target}")


if __name__ == "__main__":
    main(sys.argv[1:])
