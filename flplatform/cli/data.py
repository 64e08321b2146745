"""``flplatform data split``: per-site data files for a real deployment."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from clients.catalog import BUILTIN_DATASETS
from flplatform.cli.errors import handles_errors
from flplatform.cli.render import make_console
from flplatform.cli.simulate import site_names

app = typer.Typer(help="Prepare site data.")
console = make_console()


@app.command("split")
@handles_errors
def split(
    out: Annotated[Path, typer.Option(help="Directory to write <site>.npz files into.")],
    dataset: Annotated[
        str, typer.Option(help=f"{', '.join(BUILTIN_DATASETS)}, or a .npz path.")
    ] = "digits",
    sites: Annotated[str, typer.Option(help="Number of sites, or comma-separated names.")] = "4",
    partition: Annotated[str, typer.Option(help="iid or dirichlet.")] = "dirichlet",
    alpha: Annotated[float, typer.Option(help="Dirichlet α (> 0).")] = 0.5,
    seed: Annotated[int, typer.Option(help="Seed of the split.")] = 0,
    overwrite: Annotated[bool, typer.Option(help="Replace existing files.")] = False,
) -> None:
    """Split a dataset into one file per site (plus test.npz for central evaluation).

    Each site then reads only its own file (`flplatform site NAME --server … --data
    NAME.npz`); the server needs only test.npz and manifest.json (`--dataset OUT
    --partition files`).
    """
    from clients.site_files import write_site_files

    manifest = write_site_files(
        dataset,
        out,
        sites=site_names(sites),
        scheme=partition,
        alpha=alpha,
        seed=seed,
        overwrite=overwrite,
    )
    for line in manifest.describe():
        console.print(line)
    console.print(
        "Copy each <site>.npz to its site (`flplatform site NAME --server … --data NAME.npz`) "
        "and delete "
        f"it here: a site's data should not stay on the server, which needs only {out}"
        "/test.npz and manifest.json (`--dataset "
        f"{out} --partition files`)."
    )
