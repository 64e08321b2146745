"""The ``flplatform`` CLI run in-process, as the tests call it.

``invoke`` fails the test on a traceback or on an exception other than the command's exit;
``one_error_line`` is the single ``error:`` line a refusal prints; ``read_table`` reads a rich
table back into its header and rows.
"""

from __future__ import annotations

from click.testing import Result
from typer.testing import CliRunner

from flplatform.cli.app import app

runner = CliRunner()


def invoke(args: list[str]) -> Result:
    """``flplatform ARGS``; never a traceback, and no exception but the command's exit."""
    result = runner.invoke(app, args)
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result


def output_of(*args: str) -> str:
    """What ``flplatform ARGS`` printed, the command having succeeded (exit code 0)."""
    result = invoke(list(args))
    assert result.exit_code == 0, result.output
    return result.output


def one_error_line(output: str) -> str:
    """The one line of ``output`` that starts with ``error:`` (there must be exactly one)."""
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, output
    return lines[0]


def read_table(output: str) -> tuple[list[str], dict[str, list[str]]]:
    """A rich table's header (each column's wrapped header lines joined) and its body rows,
    keyed by their first cell."""
    header: list[str] = []
    rows: dict[str, list[str]] = {}
    for line in output.splitlines():
        if line.startswith("┃"):
            parts = [part.strip() for part in line.split("┃")[1:-1]]
            header = [
                " ".join(filter(None, pair))
                for pair in zip(header or [""] * len(parts), parts, strict=True)
            ]
        elif line.startswith("│"):
            cells = [cell.strip() for cell in line.split("│")[1:-1]]
            rows[cells[0]] = cells
    return header, rows
