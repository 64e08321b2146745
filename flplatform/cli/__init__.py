"""The flplatform command line (Typer + rich)."""

from __future__ import annotations

import sys


def main() -> None:
    """Console-script entry point: the CLI, or one line if the installed Flower lacks an
    internal flplatform needs (it is found while the CLI's modules are imported, before
    the CLI's own error handling is there)."""
    from flplatform.core.errors import FlowerVersionError

    try:
        from flplatform.cli.app import main as run_cli
    except FlowerVersionError as exc:
        print(f"error: {exc}", file=sys.stderr)  # as the CLI says every refusal
        raise SystemExit(1) from None
    run_cli()
