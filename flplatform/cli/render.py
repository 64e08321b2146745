"""Render rows as a rich table, JSON or CSV: one small function per format."""

from __future__ import annotations

import csv
import io
import json
import math
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
    into unreadable cells. Strings are printed literally, never read as markup or emoji
    codes: what we print quotes paths, run and site names and remote errors, where ``[/x]``
    would raise and ``:smile:`` turn into a picture. Our own styles go in ``Text`` objects.
    """
    width = shutil.get_terminal_size((160, 24)).columns
    return Console(
        stderr=stderr, highlight=False, soft_wrap=True, width=width, markup=False, emoji=False
    )


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

    The title and cells are plain text, never markup, whatever the console: a failure reason
    quoting ``[conv1.weight]`` must show its brackets, and a run named ``[/x]`` must not
    raise.
    """
    out = Table(title=Text(title, style="table.title"), title_justify="left", header_style="bold")
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
        text = json.dumps(finite(records), indent=2, default=str, allow_nan=False)
        console.file.write(text + "\n")
    elif fmt is OutputFormat.csv:
        console.file.write(to_csv(records))
    else:
        console.print(table(title, columns, rows))


def finite(value: Any) -> Any:
    """``value`` with every infinite or NaN float, nested ones too, replaced by None.

    JSON has no Infinity or NaN (``json.dumps`` writes them anyway, and strict parsers
    refuse the result), yet a ledger can hold one: a sum of huge reported compute times
    overflows, and older ledgers kept non-finite metrics. It is no measurement either way.
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value


def to_csv(records: Sequence[dict[str, Any]]) -> str:
    """CSV with one column per field; nested values as JSON.

    A non-finite number is an empty cell (null inside nested JSON), as JSON output has it.
    """
    records = finite(records)
    if not records:
        return ""
    buffer = io.StringIO()
    fieldnames = list(records[0])
    writer = csv.DictWriter(buffer, fieldnames=fieldnames, lineterminator="\n")
    writer.writeheader()
    for record in records:
        writer.writerow(
            {
                k: json.dumps(v, allow_nan=False) if isinstance(v, dict | list) else v
                for k, v in record.items()
            }
        )
    return buffer.getvalue()
