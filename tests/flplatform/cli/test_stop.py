"""SIGINT and SIGTERM stop any command with one line and the exit code a shell expects.

A real signal to this process, through the CLI's own error handling; stopping a running
simulation's processes is tested in tests/integration/test_lifecycle.py.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import typer
from typer.testing import CliRunner

from flplatform.cli.errors import handles_errors
from flplatform.core.errors import RunStopped


def command_app(action: str) -> typer.Typer:
    app = typer.Typer()

    @app.command()
    @handles_errors
    def work() -> None:
        if action == "stopped-run":  # what a run raises once its processes are stopped
            raise RunStopped(
                "run 3 stopped by the user (SIGTERM) after 2 of 9 rounds", exit_code=143
            )
        os.kill(os.getpid(), signal.Signals[action])
        time.sleep(60)  # the signal's handler raises here

    return app


@pytest.mark.parametrize(
    ("action", "code", "line"),
    [
        ("SIGTERM", 143, "error: stopped by the user (SIGTERM)"),
        ("SIGINT", 130, "error: stopped by the user (SIGINT)"),
        ("stopped-run", 143, "error: run 3 stopped by the user (SIGTERM) after 2 of 9 rounds"),
    ],
)
@pytest.mark.usefixtures("live_sigint")
def test_a_stopped_command_says_why_in_one_line(action: str, code: int, line: str) -> None:
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    started = time.monotonic()
    result = CliRunner().invoke(command_app(action), [])
    assert time.monotonic() - started < 30  # not after the 60 s sleep
    assert result.exit_code == code
    assert result.output.strip() == line
    assert {s: signal.getsignal(s) for s in handlers} == handlers
