"""CLI options made from the options table (``RunConfig``'s fields, flplatform/app/config.py).

``@table_options()`` gives a command one option per run option, with the table's type,
default and help, in the table's order; the command takes them as ``**options`` and turns
them back into run-config keys with :func:`config_values`. A parameter the command declares
itself (``--sites`` parses a count, ``--db`` defaults to None) replaces the table's.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import fields
from typing import Annotated, Any, TypeVar

import typer

from flplatform.app.config import RunConfig
from flplatform.app.config_rules import option_of

F = TypeVar("F", bound=Callable[..., Any])
# What the help of an option that takes several values adds.
LISTED_HELP = "Several, comma-separated: a sweep, one run per combination in one start-up."
# The help's panels: each opens at its field of the table and holds the fields after it
# (the table's own sections), so that ~55 options can be scanned.
PANELS = {
    "strategy": "Algorithm",
    "dataset": "Data and model",
    "local_steps": "Sites' training",
    "server_lr": "Server step",
    "sites": "Federation and ledger",
    "checkpoint_every": "Checkpoints, resume and stopping",
    "k": "Synchrony",
    "network": "Simulated network",
    "delay": "Delayed updates",
    "codec": "Compression",
    "update_norm_ratio": "Guard and robust aggregation",
    "sketch_rows": "Sketches (FetchSGD, Sketched-SGD)",
}


def cli_name(field_name: str) -> str:
    """A run option's parameter name on the CLI (``num_server_rounds`` → ``rounds``)."""
    return option_of(_FIELDS[field_name]).cli or field_name


def table_options(
    *,
    only: Collection[str] | None = None,
    optional: bool = False,
    helps: Mapping[str, str] | None = None,
    listed: Collection[str] = (),
) -> Callable[[F], F]:
    """Give a ``command(..., **options)`` the table's options as typer options.

    Parameters
    ----------
    only : collection of str, optional
        The CLI names to give (default: every option the table puts on the CLI).
    optional : bool
        Each option defaults to None (not given) instead of the table's default.
    helps : mapping, optional
        A command's own help for some options, by CLI name.
    listed : collection of str
        CLI names of options that take several values, comma-separated: text, whatever
        their type, with a default written as text (the command splits and checks them).
    """

    def decorate(command: F) -> F:
        own = inspect.signature(command, eval_str=True)  # the command's own annotations
        declared = {name: p for name, p in own.parameters.items() if p.kind is not p.VAR_KEYWORD}
        types = typing.get_type_hints(RunConfig)
        params: list[inspect.Parameter] = []
        panel = None
        for f in fields(RunConfig):
            panel = PANELS.get(f.name, panel)
            about = option_of(f)
            name = about.cli or f.name
            if about.cli is None or (only is not None and name not in only):
                continue
            if name in declared:
                param = declared.pop(name)
                _put_in_panel(param, panel)
                params.append(param.replace(kind=inspect.Parameter.KEYWORD_ONLY))
                continue
            kind = types[f.name]
            default = f.default
            text = (helps or {}).get(name, about.help)
            if name in listed:
                kind, default = str, str(default)
                text += f" {LISTED_HELP}"
            if optional:
                kind = kind | None
            params.append(
                inspect.Parameter(
                    name,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=None if optional else default,
                    annotation=Annotated[kind, typer.Option(help=text, rich_help_panel=panel)],
                )
            )
        leading = [p for p in declared.values() if p.kind is not p.KEYWORD_ONLY]
        trailing = [p for p in declared.values() if p.kind is p.KEYWORD_ONLY]
        command.__signature__ = own.replace(parameters=[*leading, *params, *trailing])  # type: ignore[attr-defined]
        return command

    return decorate


def _put_in_panel(param: inspect.Parameter, panel: str | None) -> None:
    """A command's own declaration of a table option goes in the option's panel too."""
    for info in getattr(param.annotation, "__metadata__", ()):
        if isinstance(info, typer.models.OptionInfo) and info.rich_help_panel is None:
            info.rich_help_panel = panel


def config_values(options: Mapping[str, Any]) -> dict[str, Any]:
    """CLI values by parameter name → run-config keys (kebab-case); None: not given."""
    out: dict[str, Any] = {}
    for f in fields(RunConfig):
        name = cli_name(f.name)
        if name in options and options[name] is not None:
            out[f.name.replace("_", "-")] = options[name]
    return out


_FIELDS = {f.name: f for f in fields(RunConfig)}
