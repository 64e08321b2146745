"""The ``flplatform`` command: registers commands; each lives in its own module."""

from __future__ import annotations

import inspect

import typer

from flplatform.cli import (
    certs,
    data,
    demo,
    deploy,
    export,
    history,
    plot,
    resume,
    run,
    simulate,
    tracking,
)

app = typer.Typer(
    name="flplatform",
    help="Communication-efficient cross-silo federated learning on Flower.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("simulate")(simulate.simulate)
app.command("run")(run.run)
app.command("resume")(resume.resume)
app.command("export")(export.export)
app.command("plot")(plot.plot)
app.command("server")(deploy.server)
app.command("site")(deploy.site)
app.add_typer(demo.demo_app, name="demo")
app.add_typer(data.app, name="data")
history.app.command("export")(tracking.export_runs)
app.add_typer(history.app, name="history")
app.add_typer(certs.app, name="certs")


def reflow_help(commands: typer.Typer) -> None:
    """Give every command of ``commands`` (its groups' too) its docstring as help with each
    paragraph on one line, for the terminal to wrap.

    Typer's rich help keeps a docstring's line breaks in the command lists and in every
    paragraph after the first, so a description broke where the source line did
    ("with lists, a / sweep of runs") whatever the terminal's width.
    """
    for command in commands.registered_commands:
        text = command.help or inspect.getdoc(command.callback) or ""
        command.help = "\n\n".join(" ".join(p.split()) for p in text.split("\n\n"))
    for group in commands.registered_groups:
        if group.typer_instance is not None:
            reflow_help(group.typer_instance)


reflow_help(app)


def main() -> None:
    """Console-script entry point."""
    app()
