"""Rows into the database and records out of it, column by column by name.

The update, evaluation and traffic rows, their SQL tables and their records share their
column names (all declared in ``flplatform.core.ledger_rows``), and so do the run, site and round
models and their records; so one function writes a row and one reads any record, and neither
lists a column.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any, TypeVar

from flplatform.core.ledger_rows import Kind, columns

from .validators import free_text, to_datetime

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

R = TypeVar("R", bound="DataclassInstance")


def row_values(row: object, *, run_id: int, step: int | None, site_id: int) -> dict[str, Any]:
    """Return the values to insert for a validated update, evaluation or traffic row.

    Parameters
    ----------
    row : UpdateInput, EvaluationInput or TrafficInput
        The row, already validated on construction.
    run_id, step, site_id : int
        The keys the ledger adds: the run, the server step that handled the row (``None``
        for a traffic row of no step) and the id of the site the row names.

    Returns
    -------
    dict[str, Any]
        Column name to value: Unix times become aware UTC datetimes and NUL characters in free
        text become U+FFFD (see ``storage.validators.free_text``).

    Raises
    ------
    StorageError
        If a Unix time is finite but out of the range of ``datetime``.
    """
    values: dict[str, Any] = {"run_id": run_id, "site_id": site_id, "round": step}
    for spec, facts in columns(type(row)):
        value = getattr(row, spec.name)
        if facts.kind is Kind.SITE:
            continue  # stored as site_id
        if facts.kind is Kind.WALL_TIME and value is not None:
            value = to_datetime(spec.name, value)
        elif facts.kind is Kind.TEXT:
            value = free_text(value)
        values[spec.name] = value
    return values


def to_record(record_type: type[R], source: object, **computed: Any) -> R:
    """Build a frozen record from a model object or a result row with the same field names.

    Parameters
    ----------
    record_type : type
        The record dataclass, e.g. ``RunRecord``.
    source : object
        An ORM object or a result row's mapping holding every field the record does not get
        from ``computed``.
    **computed : Any
        Fields the source does not hold (a count, a sum, a joined name).

    Returns
    -------
    R
        The record; dicts (config, metrics, profiles) are copied, so the record shares nothing
        with the session.
    """
    values = dict(computed)
    for spec in fields(record_type):
        if spec.name not in computed:
            value = source[spec.name] if isinstance(source, Mapping) else getattr(source, spec.name)
            values[spec.name] = dict(value) if isinstance(value, dict) else value
    return record_type(**values)
