"""Turn domain errors into one clear line and an exit code: users never see a traceback."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import typer
from rich.console import Console
from rich.text import Text

from flplatform.core.errors import FLPlatformError
from flplatform.launch.processes import StopRequested, stop_signals

P = ParamSpec("P")
R = TypeVar("R")

# Literal: messages quote paths, names and remote errors (``[tool.flwr.app]``, ``[/x]``,
# ``:smile:``), which rich would read as markup or emoji codes.
stderr = Console(
    stderr=True, highlight=False, soft_wrap=True, width=1000, markup=False, emoji=False
)


def fail(message: str, code: int) -> typer.Exit:
    """Print ``error: message`` on stderr and return the Exit to raise."""
    stderr.print(Text.assemble(("error:", "bold red"), " ", message))
    return typer.Exit(code)


def handles_errors(command: Callable[P, R]) -> Callable[P, R]:
    """Wrap a CLI command: domain errors → one line + their exit code; bugs → one line + 70.

    SIGINT (Ctrl-C) and SIGTERM stop the command the same way (``stop_signals``): a run
    stops every process it started and records why (``RunStopped``), and the command
    exits with 130 or 143, as a shell reports a process the signal ended.
    Set FLPLATFORM_DEBUG=1 to see the traceback of an unexpected error.
    """

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            with stop_signals():
                return command(*args, **kwargs)
        except FLPlatformError as exc:
            raise fail(exc.reason, exc.exit_code) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except StopRequested as exc:
            raise fail(f"stopped by the user ({exc.name})", exc.exit_code) from None
        except KeyboardInterrupt:
            raise fail("stopped by the user (SIGINT)", 130) from None
        except Exception as exc:
            if os.environ.get("FLPLATFORM_DEBUG"):
                raise
            raise fail(
                f"unexpected {type(exc).__name__}: {exc} (set FLPLATFORM_DEBUG=1 for details)",
                70,
            ) from None

    return wrapper
