"""Arrays that training sets rather than learns: sent exactly, never sketched or compressed.

A model's state dict holds, beside its weights, buffers: a BatchNorm's ``running_mean``
and ``running_var`` (moving averages of batch statistics), its integer
``num_batches_tracked``, integer and bool arrays in general. Recovered from a count sketch
they go wrong. An estimate carries the noise of every coordinate that shares its buckets,
so a recovered variance can turn negative, and the BatchNorm that divides by its square
root then makes every prediction NaN. FetchSGD's 100-site benchmark fell to chance
accuracy for pairs of rounds this way: its final model held a ``running_var`` of −0.0007.

So FetchSGD leaves them out of the sketch. Each site sends their trained values whole
beside its table (a few thousand numbers for a ResNet's BatchNorms), and the server sets
them to the example-weighted mean of the sites' values, as FedAvg would. It never picks
their coordinates from the sketch. The codecs (``strategies.codecs``: top-k, int8) leave
them out of what they compress in the same way: their deltas travel exactly beside it.

Which arrays: :func:`averaged_arrays`, from the model's names and dtypes, and the arrays
the user names (``averaged-arrays``: buffers the rule cannot see by their name, such as a
running class distribution; :func:`named_arrays` matches the names or patterns against
the model). FetchSGD's server applies it and names them in every training message; a
codec applies it to the update's layout on both sides, and a server whose user named
arrays names them in its training messages too, which the codec mod follows. On the wire
they travel concatenated (:func:`pack`): every Flower array costs several hundred bytes of
framing, more than a BatchNorm's statistics themselves. No Flower imports.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from fnmatch import fnmatchcase
from typing import Any

import numpy as np

from flplatform.core.errors import ConfigError

# + a carrier dtype's name ("float32", "float64"): the averaged arrays in that dtype,
# concatenated (``pack``), as an upload's wire array
AVERAGED = "averaged/"

# PyTorch's norm layers (BatchNorm*, InstanceNorm* tracking running statistics) name
# their float buffers so; their integer counter is caught by its dtype.
RUNNING_STATISTICS = ("running_mean", "running_var")


def judged_changes(
    changes: Mapping[str, np.ndarray], dtypes: Mapping[str, np.dtype[Any]]
) -> list[np.ndarray]:
    """What the update guard judges of an update's changes to its averaged arrays (name →
    change, in any carrier dtype): those of the float arrays (running statistics). An
    integer counter's change is the number of steps a site took, which follows the size
    of its data, not its honesty: a site with a hundred times the median's batches would
    have been rejected for it."""
    return [change for name, change in changes.items() if np.dtype(dtypes[name]).kind == "f"]


def averaged_arrays(
    dtypes: Mapping[str, np.dtype[Any]], named: Iterable[str] = ()
) -> tuple[str, ...]:
    """Names of a model's arrays (name → dtype) that are averaged whole, in its order.

    Integer and bool arrays (counters, masks), float arrays whose name ends in
    ``running_mean`` or ``running_var`` (a norm layer's running statistics), and the
    ``named`` ones (exact names; see :func:`named_arrays`).
    """
    named = frozenset(named)
    return tuple(
        name
        for name, dtype in dtypes.items()
        if np.dtype(dtype).kind != "f"
        or name.rsplit(".", 1)[-1] in RUNNING_STATISTICS
        or name in named
    )


def averaged_of(model: Mapping[str, np.ndarray], named: Iterable[str] = ()) -> tuple[str, ...]:
    """:func:`averaged_arrays` of a model's arrays (name → array)."""
    return averaged_arrays({name: value.dtype for name, value in model.items()}, named)


def named_arrays(patterns: Sequence[str], names: Iterable[str]) -> tuple[str, ...]:
    """The model's arrays (``names``, in their order) that ``patterns`` name: exact names
    or shell-style patterns (``*.class_prior``), case-sensitive.

    Raises
    ------
    ConfigError
        If a pattern matches no array: a misspelt buffer would otherwise be compressed
        without a word. The message lists the model's arrays.
    """
    names = list(names)

    def matches(name: str, pattern: str) -> bool:  # an exact name may hold "[0]"
        return name == pattern or fnmatchcase(name, pattern)

    unmatched = [p for p in patterns if not any(matches(n, p) for n in names)]
    if unmatched:
        shown = ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
        raise ConfigError(
            f"averaged-arrays {', '.join(repr(p) for p in unmatched)} matches no array of the "
            f"model; its arrays: {shown}"
        )
    return tuple(n for n in names if any(matches(n, p) for p in patterns))


def split_names(text: str) -> tuple[str, ...]:
    """``averaged-arrays`` as a run config gives it: names or patterns, comma-separated."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def names_problem(patterns: object) -> str | None:
    """What is wrong with ``averaged-arrays`` given to a strategy (a sequence of names)."""
    if isinstance(patterns, str) or not isinstance(patterns, Sequence):
        return (
            "averaged-arrays must be a list of array names or patterns "
            f"(e.g. ['class_prior', '*.counts']), got {patterns!r:.80}"
        )
    bad = [
        p for p in patterns if not isinstance(p, str) or not p.strip() or p != p.strip() or "," in p
    ]
    if bad:
        return (
            "averaged-arrays must hold non-empty names without commas or surrounding "
            f"spaces, got {bad!r:.80}"
        )
    return None


def carrier(dtype: np.dtype[Any]) -> type[np.floating[Any]]:
    """The float type an averaged array travels in: float32 for float16 and float32 arrays,
    float64 (exact for integers up to 2^53) for the rest."""
    dtype = np.dtype(dtype)
    return np.float32 if dtype.kind == "f" and dtype.itemsize <= 4 else np.float64


def pack(arrays: Mapping[str, np.ndarray], names: Sequence[str]) -> dict[str, np.ndarray]:
    """The ``names`` arrays flattened and concatenated, in order, one vector per carrier:
    wire key (``averaged/float32``, ``averaged/float64``) → vector; a carrier no array
    uses is left out."""
    parts: dict[type[np.floating[Any]], list[np.ndarray]] = {}
    for name in names:
        value = np.asarray(arrays[name])
        parts.setdefault(carrier(value.dtype), []).append(value.reshape(-1))
    return {
        _key(kind): np.concatenate(pieces).astype(kind, copy=False)
        for kind, pieces in parts.items()
    }


def packed_keys(
    dtypes: Mapping[str, np.dtype[Any]], sizes: Mapping[str, int], names: Sequence[str]
) -> dict[str, int]:
    """The wire key of each vector :func:`pack` makes of ``names`` → its length."""
    out: dict[str, int] = {}
    for name in names:
        key = _key(carrier(dtypes[name]))
        out[key] = out.get(key, 0) + sizes[name]
    return out


def unpack(
    packed: Mapping[str, np.ndarray],
    dtypes: Mapping[str, np.dtype[Any]],
    sizes: Mapping[str, int],
    names: Sequence[str],
) -> dict[str, np.ndarray]:
    """Each of ``names`` as a flat float64 piece of the vectors :func:`pack` made (their
    lengths already checked against :func:`packed_keys`)."""
    at: dict[str, int] = {}
    out = {}
    for name in names:
        key = _key(carrier(dtypes[name]))
        start = at.get(key, 0)
        at[key] = start + sizes[name]
        out[name] = packed[key][start : at[key]].astype(np.float64)
    return out


def _key(kind: type[np.floating[Any]]) -> str:
    return AVERAGED + np.dtype(kind).name
