"""Durations said in sentences (``flplatform.core.text``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flplatform.core.text import seconds_text


@pytest.mark.parametrize(
    ("seconds", "said"),
    [(600.0, "600"), (10.0, "10"), (15.4, "15"), (2.5, "2.5"), (1.0, "1"), (0.3, "0.3"),
     (0.25, "0.25"), (0.0, "0")],
)  # fmt: skip
def test_seconds_are_whole_from_ten_and_two_digits_below(seconds: float, said: str) -> None:
    assert seconds_text(seconds) == said


@given(st.floats(min_value=1e-3, max_value=1e6))
def test_a_positive_duration_is_never_said_as_zero(seconds: float) -> None:
    said = float(seconds_text(seconds))
    assert said > 0 and abs(said - seconds) <= max(0.5, 0.05 * seconds)
