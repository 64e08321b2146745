"""The ``flplatform`` command: registers commands; each lives in its own module."""

from __future__ import annotations

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


def main() -> None:
    """Console-script entry point."""
    app()
