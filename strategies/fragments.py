"""Streaming sync's fragments: which of the model's arrays each round syncs (pure maths).

Douillard et al., "Streaming DiLoCo with overlapping communication" (2025). The model's
arrays are split into F fragments, by array, in the model's own key order, as balanced by
size as a contiguous split allows (the largest fragment as small as it can be: that is the
peak a round sends). Round r syncs fragment (r − 1) mod F, so every fragment is synced once
every F rounds, and a round's peak traffic is one fragment instead of the whole model.

No Flower and no torch: a model is an ordered mapping of names to array sizes.
"""

from __future__ import annotations

from collections.abc import Sequence

from flplatform.core.errors import ConfigError

Fragments = tuple[tuple[str, ...], ...]


def split_fragments(sizes: Sequence[tuple[str, int]], count: int) -> Fragments:
    """Split the arrays (``(name, values)`` in the model's order) into ``count`` non-empty
    runs of consecutive arrays whose largest total is the smallest possible.

    Among the splits that reach it, cuts come as late as the largest fragment allows
    (the greedy packing), except where each remaining array must become its own fragment.
    ``ConfigError`` when there are fewer arrays than fragments.
    """
    names = [name for name, _ in sizes]
    values = [int(size) for _, size in sizes]
    if count < 1:
        raise ConfigError(f"fragments must be >= 1, got {count}")
    if len(values) < count:
        raise ConfigError(
            f"fragments = {count}, but the model has {len(values)} arrays: a fragment is "
            f"one array or more, so use at most {len(values)} fragments"
        )
    if any(v < 0 for v in values):
        raise ValueError(f"array sizes must be >= 0, got {values}")
    low, high = max(values), sum(values)
    while low < high:  # the smallest cap a greedy packing fits into count fragments
        cap = (low + high) // 2
        if _greedy_count(values, cap) <= count:
            high = cap
        else:
            low = cap + 1
    return _split_at(names, values, low, count)


def _greedy_count(values: Sequence[int], cap: int) -> int:
    """Fragments a left-to-right packing under ``cap`` needs (each value <= cap)."""
    parts, total = 1, 0
    for value in values:
        if total + value > cap:
            parts, total = parts + 1, 0
        total += value
    return parts


def _split_at(names: list[str], values: list[int], cap: int, count: int) -> Fragments:
    """The greedy packing under ``cap``, cutting early only where the arrays left are
    exactly as many as the fragments left (so there are ``count``, none empty)."""
    fragments: list[tuple[str, ...]] = []
    current: list[str] = []
    total = 0
    for index, (name, value) in enumerate(zip(names, values, strict=True)):
        # besides the open fragment, as many fragments are owed as arrays are left
        owed = count - len(fragments) - 1 == len(names) - index
        if current and (total + value > cap or owed):
            fragments.append(tuple(current))
            current, total = [], 0
        current.append(name)
        total += value
    fragments.append(tuple(current))
    return tuple(fragments)


def fragment_of_round(server_round: int, count: int) -> int:
    """The fragment round ``server_round`` (from 1) syncs: (r − 1) mod F."""
    return (server_round - 1) % count


def changed_since(held: int, version: int, count: int) -> list[int]:
    """The fragments versions ``held`` + 1 … ``version`` changed, in order: what a site
    holding global version ``held`` lacks of version ``version`` (version v is made by
    round v)."""
    if version - held >= count:
        return list(range(count))
    return sorted({fragment_of_round(v, count) for v in range(held + 1, version + 1)})
