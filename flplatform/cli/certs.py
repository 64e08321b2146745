"""``flplatform certs init`` and ``flplatform certs site``: the files of a secure deployment.

A thin layer over flplatform/deploy/certs.py, which says what each file is for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from flplatform.cli.errors import handles_errors
from flplatform.cli.render import make_console
from flplatform.deploy.certs import CA_KEY, DEFAULT_HOSTS, fingerprint, init_certs, make_site_key

app = typer.Typer(
    help="Certificates and site keys for `flplatform server` and `flplatform site`.",
    no_args_is_help=True,
)
console = make_console()

ForceOption = Annotated[
    bool, typer.Option("--force", help="Replace existing files (never overwritten otherwise).")
]
OutOption = Annotated[
    Path, typer.Option("--out", "-o", help="Directory to write into (created owner-only).")
]


@app.command("init")
@handles_errors
def init(
    out: OutOption,
    host: Annotated[
        list[str] | None,
        typer.Option(
            "--host",
            help="A name or IP address sites dial to reach the server (repeatable; "
            f"default: {', '.join(DEFAULT_HOSTS)}).",
        ),
    ] = None,
    force: ForceOption = False,
) -> None:
    """Make a CA and the server's TLS certificate (run once, on the server's machine).

    Writes ca.crt (give it to every site), ca.key (keep it; owner-only), server.crt and
    server.key (owner-only). The certificate is valid only for the --host names and
    addresses: list every one the sites will dial.
    """
    hosts = tuple(host) if host else DEFAULT_HOSTS
    certs = init_certs(out, hosts, force=force)
    console.print(
        Text.assemble(
            "Wrote ",
            (str(certs.ca_cert), "bold"),
            f", {out / CA_KEY}, {certs.server_cert} and {certs.server_key}\n",
            f"The server certificate is valid for: {', '.join(certs.hosts())}\n",
            "Give ca.crt to every site; keep ca.key and server.key on this machine only.",
        )
    )


@app.command("site")
@handles_errors
def site(
    name: Annotated[str, typer.Argument(help="The site's name, as the server's --sites has it.")],
    out: OutOption,
    force: ForceOption = False,
) -> None:
    """Make a site's key pair for SuperNode authentication (run it on the site's machine).

    Writes NAME.key (the private key, owner-only: it never leaves the site) and NAME.pub
    (send it to the server's administrator, who puts it in the server's certificate
    directory). Compare the fingerprint printed here with the one the administrator sees.
    """
    key = make_site_key(name, out, force=force)
    console.print(
        Text.assemble(
            "Wrote ",
            (str(key.private_key), "bold"),
            " (private: keep it here) and ",
            (str(key.public_key), "bold"),
            f" (send it to the server's administrator)\nFingerprint: {fingerprint(key.public_key)}",
        )
    )
