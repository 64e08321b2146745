"""Checks on what a site sends back, before any of it touches the global model.

NumPy checks, and ``reply_parts`` for Flower's reply records. A malformed or hostile
reply raises ``UpdateRejected`` with a reason that goes into the ledger; the round goes on
with the other sites.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord

from flplatform.core import keys
from flplatform.core.errors import UpdateRejected

# A site claiming more examples than this is treated as hostile: its weight would swamp
# every other site's. Far above any real cross-silo dataset.
MAX_EXAMPLES = 10**12


def reply_parts(reply: Message) -> tuple[ArrayRecord, MetricRecord]:
    """A site's reply as its arrays and metrics records; ``UpdateRejected`` if it is not."""
    content = reply.content
    if keys.ARRAYS not in content or keys.METRICS not in content:
        raise UpdateRejected(
            f"reply must hold '{keys.ARRAYS}' and '{keys.METRICS}' records, "
            f"got {sorted(content.keys())}"
        )
    record, metrics = content[keys.ARRAYS], content[keys.METRICS]
    if not isinstance(metrics, MetricRecord) or not isinstance(record, ArrayRecord):
        raise UpdateRejected(
            f"reply's '{keys.ARRAYS}' must be an ArrayRecord and '{keys.METRICS}' a "
            f"MetricRecord, got {type(record).__name__} and {type(metrics).__name__}"
        )
    return record, metrics


def check_arrays(received: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray]) -> None:
    """Require the same array names, shapes and dtypes as ``expected``, and finite values."""
    missing = [k for k in expected if k not in received]
    if missing:
        raise UpdateRejected(f"missing arrays: {', '.join(missing[:5])}")
    extra = [k for k in received if k not in expected]
    if extra:
        raise UpdateRejected(f"unexpected arrays: {', '.join(extra[:5])}")
    for key, ref in expected.items():
        got = received[key]
        if got.shape != ref.shape:
            raise UpdateRejected(
                f"array '{key}' has shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
            )
        if got.dtype != ref.dtype:
            raise UpdateRejected(f"array '{key}' has dtype {got.dtype}, expected {ref.dtype}")
        if np.issubdtype(got.dtype, np.inexact) and not np.isfinite(got).all():
            raise UpdateRejected(f"array '{key}' contains NaN or Inf")


def check_num_examples(value: Any) -> int:
    """Return a valid example count (an integer in [1, MAX_EXAMPLES]) or reject."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UpdateRejected(f"num-examples must be a positive integer, got {value!r}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise UpdateRejected(f"num-examples must be a positive integer, got {value!r}")
    count = int(value)
    if not 1 <= count <= MAX_EXAMPLES:
        raise UpdateRejected(f"num-examples must be in [1, {MAX_EXAMPLES}], got {count}")
    return count
