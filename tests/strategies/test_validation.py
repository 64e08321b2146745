"""Malformed or hostile updates are rejected with a reason, never applied."""

from __future__ import annotations

import numpy as np
import pytest

from flplatform.core.errors import UpdateRejected
from flplatform.core.reply_checks import MAX_EXAMPLES, check_arrays, check_num_examples

EXPECTED = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}


def test_well_formed_arrays_pass() -> None:
    check_arrays({"w": np.ones((2, 3), np.float32), "b": np.ones(3, np.float32)}, EXPECTED)


@pytest.mark.parametrize(
    ("received", "reason"),
    [
        ({"w": np.ones((2, 3), np.float32)}, "missing arrays: b"),
        ({**EXPECTED, "evil": np.ones(1, np.float32)}, "unexpected arrays: evil"),
        ({"w": np.ones((3, 2), np.float32), "b": np.ones(3, np.float32)}, "shape (3, 2)"),
        ({"w": np.ones((2, 3), np.float64), "b": np.ones(3, np.float32)}, "dtype float64"),
        ({"w": np.full((2, 3), np.nan, np.float32), "b": np.ones(3, np.float32)}, "NaN or Inf"),
        (
            {"w": np.ones((2, 3), np.float32), "b": np.array([1, np.inf, 0], np.float32)},
            "NaN or Inf",
        ),
    ],
)
def test_malformed_arrays_are_rejected_with_reason(received, reason: str) -> None:
    with pytest.raises(UpdateRejected, match=reason.replace("(", r"\(").replace(")", r"\)")):
        check_arrays(received, EXPECTED)


@pytest.mark.parametrize(
    "value", [0, -3, 1.5, float("nan"), float("inf"), "12", None, True, MAX_EXAMPLES + 1]
)
def test_bad_example_counts_are_rejected(value) -> None:
    with pytest.raises(UpdateRejected, match="num-examples"):
        check_num_examples(value)


def test_good_example_counts_pass() -> None:
    assert check_num_examples(7) == 7
    assert check_num_examples(7.0) == 7
