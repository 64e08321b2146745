"""Render rows as a rich table, JSON or CSV: one small function per format."""

from __future__ import annotations

import csv
import io
import json
import math
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

from flplatform.core.text import printable

# Columns of a console whose output is not a terminal (and $COLUMNS is unset): every
# table fits them (see ``Column``).
PIPED_WIDTH = 100
# What a spreadsheet reads as the start of a formula in a CSV cell (OWASP, "CSV Injection"):
# a site's error reason "=HYPERLINK(...)" would run when the file is opened.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
# Columns a free-text column keeps before the table drops optional columns to make room.
TEXT_MIN_WIDTH = 16


def make_console(*, stderr: bool = False, width: int | None = None) -> Console:
    """A console as wide as the terminal ($COLUMNS if set), or 100 columns when not a terminal.

    Rich itself falls back to 80 columns when piped. Strings are printed literally, never
    read as markup or emoji codes: what we print quotes paths, run and site names and remote
    errors, where ``[/x]`` would raise and ``:smile:`` turn into a picture. Our own styles go
    in ``Text`` objects.
    """
    if width is None:
        width = shutil.get_terminal_size((PIPED_WIDTH, 24)).columns
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


@dataclass(frozen=True)
class Column:
    """A table column: its header, and how it gives way on a narrow console.

    ``header``: "\n" stacks a long one. ``drop``: 0 keeps the column whatever the width;
    otherwise a table too wide for the console drops columns, the highest ``drop`` first
    (the rightmost of equals), and says under it which (JSON and CSV carry every field).
    ``text``: free text (names, reasons) that wraps at spaces and folds a word too long for
    its width, so nothing is cut; other columns never wrap (a number or size broken over
    two lines reads as two values).
    """

    header: str
    drop: int = 0
    text: bool = False

    @property
    def name(self) -> str:
        """The header on one line."""
        return " ".join(self.header.split())


def fitting_columns(
    columns: Sequence[Column], cells: Sequence[Sequence[str]], width: int
) -> list[int]:
    """Indices of the columns that fit ``width`` console columns, in order (see ``Column``).

    Columns are dropped, highest ``drop`` first, until the rest fit; then any dropped one
    that fits in the room left comes back, the lowest ``drop`` first. A column takes its
    widest header line or cell, a text column at most ``TEXT_MIN_WIDTH`` (it wraps), plus
    three characters of padding and rule; the table one more for its left edge.
    """

    def natural(index: int) -> int:
        lines = [*columns[index].header.split("\n"), *(row[index] for row in cells)]
        widest = max(cell_len(line) for line in lines)
        return min(widest, TEXT_MIN_WIDTH) if columns[index].text else widest

    widths = [natural(index) for index in range(len(columns))]

    def fits(indices: Iterable[int]) -> bool:
        return sum(widths[i] + 3 for i in indices) + 1 <= width

    kept = list(range(len(columns)))
    while not fits(kept):
        droppable = [i for i in kept if columns[i].drop]
        if not droppable:
            break
        kept.remove(max(droppable, key=lambda i: (columns[i].drop, i)))
    # A narrow column dropped on the way may fit in the room a wide one left.
    for index in sorted(set(range(len(columns))) - set(kept), key=lambda i: (columns[i].drop, i)):
        if fits([*kept, index]):
            kept = sorted([*kept, index])
    return kept


def table(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> Table:
    """A rich table of plain-text cells.

    The cells are plain text, never markup, whatever the console: a failure reason quoting
    ``[conv1.weight]`` must show its brackets, and a run named ``[/x]`` must not raise; and
    never a terminal's control sequence (``printable``).
    """
    out = Table(header_style="bold")
    for column in columns:
        out.add_column(
            column.header, overflow="fold" if column.text else "ellipsis", no_wrap=not column.text
        )
    for row in rows:
        out.add_row(*(Text(printable(value)) for value in row))
    return out


def emit(
    console: Console,
    fmt: OutputFormat,
    *,
    title: str,
    records: Sequence[dict[str, Any]],
    columns: Sequence[str | Column],
    rows: Sequence[Sequence[Any]],
) -> None:
    """Write ``records`` (JSON/CSV: every field) or ``rows`` (table: the chosen columns).

    The table fits the console: optional columns it has no room for are dropped and named
    under it (a plain string column is always kept).
    """
    if fmt is OutputFormat.json:
        text = json.dumps(finite(records), indent=2, default=str, allow_nan=False)
        console.file.write(text + "\n")
    elif fmt is OutputFormat.csv:
        console.file.write(to_csv(records))
    else:
        specs = [c if isinstance(c, Column) else Column(c) for c in columns]
        cells = [[cell(value) for value in row] for row in rows]
        kept = fitting_columns(specs, cells, console.width)
        # The title on a line of its own: a table's own wraps at the table's width.
        say(console, title, style="table.title")
        console.print(
            table([specs[i] for i in kept], [[row[i] for i in kept] for row in cells]),
            soft_wrap=False,
        )
        hidden = [column.name for i, column in enumerate(specs) if i not in kept]
        if hidden and rows:  # an empty table hides nothing
            say(
                console,
                f"Not shown at {console.width} columns: {', '.join(hidden)} "
                "(a wider terminal shows them; --format json or csv has every field).",
                style="dim",
            )


def say(console: Console, text: str, *, style: str = "") -> None:
    """Print ``text`` literally, wrapped at the console's width (a table's note, say)."""
    console.print(Text(printable(text), style=style), soft_wrap=False)


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
    Text that a spreadsheet would run as a formula is defused (``defused``); numbers,
    negative ones included, are written as they are.
    """
    records = finite(records)
    if not records:
        return ""
    buffer = io.StringIO()
    fieldnames = list(records[0])
    # "\r\n" (RFC 4180's): Python 3.11 quotes a field holding a character of the line
    # terminator only, and a site named "a\rb" split its row in two under "\n"
    writer = csv.DictWriter(buffer, fieldnames=fieldnames, lineterminator="\r\n")
    writer.writeheader()
    for record in records:
        writer.writerow(
            {
                k: json.dumps(v, allow_nan=False) if isinstance(v, dict | list) else defused(v)
                for k, v in record.items()
            }
        )
    return buffer.getvalue()


def defused(value: Any) -> Any:
    """A CSV cell's value that no spreadsheet runs as a formula: text starting with one of
    ``FORMULA_STARTS`` gets a leading ``'`` (OWASP's advice), which spreadsheets show as
    text; anything else, numbers included, is returned as it is.

    Names, reasons and notes come from sites and users, and a hostile site chooses its error
    reason. Nested values are JSON, which starts with ``{`` or ``[``.
    """
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value
