"""Render rows as a rich table, JSON or CSV: one small function per format."""

from __future__ import annotations

import csv
import io
import json
import shutil
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text


def make_console(*, stderr: bool = False) -> Console:
    """A console as wide as the terminal, or 160 columns when output is not a terminal.

    Rich falls back to 80 columns when piped, which squeezes the round and site tables
    into unreadable cells.
    """
    width = shutil.get_terminal_size((160, 24)).columns
    return Console(stderr=stderr, highlight=False, soft_wrap=True, width=width)


class OutputFormat(StrEnum):
    """``--format`` choices of the history commands."""

    table = "table"
    json = "json"
    csv = "csv"


def human_bytes(n: float | None) -> str:
    """1536 → '1.5 KiB'."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover


def shorten(text: str | None, limit: int) -> str:
    """One line of at most ``limit`` characters: whitespace collapsed, cut with '…'.

    Failure reasons quote remote errors that run to hundreds of characters; a table cell or
    a progress line shows their start, and JSON/CSV carry them whole.
    """
    line = " ".join((text or "").split())
    return line if len(line) <= limit else line[: max(0, limit - 1)] + "…"


def cell(value: Any) -> str:
    """A short human form of one value for tables."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return " ".join(f"{k}={cell(v)}" for k, v in value.items())
    return str(value)


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    """A rich table with right-aligned numbers.

    Cells are plain text, never markup: a failure reason quoting ``[conv1.weight]`` must show
    its brackets, not vanish as an unknown style.
    """
    out = Table(title=title, title_justify="left", header_style="bold")
    for column in columns:
        out.add_column(column)
    for row in rows:
        out.add_row(*(Text(cell(v)) for v in row))
    return out


def emit(
    console: Console,
    fmt: OutputFormat,
    *,
    title: str,
    records: Sequence[dict[str, Any]],
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
) -> None:
    """Write ``records`` (JSON/CSV: every field) or ``rows`` (table: the chosen columns)."""
    if fmt is OutputFormat.json:
        console.file.write(json.dumps(records, indent=2, default=str) + "\n")
    elif fmt is OutputFormat.csv:
        console.file.write(to_csv(records))
    else:
        console.print(table(title, columns, rows))


def to_csv(records: Sequence[dict[str, Any]]) -> str:
    """CSV with one column per field; nested values as JSON."""
    if not records:
        return ""
    buffer = io.StringIO()
    fieldnames = list(records[0])
    writer = csv.DictWriter(buffer, fieldnames=fieldnames, lineterminator="\n")
    writer.writeheader()
    for record in records:
        writer.writerow(
            {k: json.dumps(v) if isinstance(v, dict | list) else v for k, v in record.items()}
        )
    return buffer.getvalue()
