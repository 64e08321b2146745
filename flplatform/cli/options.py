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
        for f in fields(RunConfig):
            about = option_of(f)
            name = about.cli or f.name
            if about.cli is None or (only is not None and name not in only):
                continue
            if name in declared:
                params.append(declared.pop(name).replace(kind=inspect.Parameter.KEYWORD_ONLY))
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
                    annotation=Annotated[kind, typer.Option(help=text)],
                )
            )
        leading = [p for p in declared.values() if p.kind is not p.KEYWORD_ONLY]
        trailing = [p for p in declared.values() if p.kind is p.KEYWORD_ONLY]
        command.__signature__ = own.replace(parameters=[*leading, *params, *trailing])  # type: ignore[attr-defined]
        return command

    return decorate


def config_values(options: Mapping[str, Any]) -> dict[str, Any]:
    """CLI values by parameter name → run-config keys (kebab-case); None: not given."""
    out: dict[str, Any] = {}
    for f in fields(RunConfig):
        name = cli_name(f.name)
        if name in options and options[name] is not None:
            out[f.name.replace("_", "-")] = options[name]
    return out


_FIELDS = {f.name: f for f in fields(RunConfig)}
