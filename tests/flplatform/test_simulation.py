"""What a failed simulation's message quotes from Flower's output."""

from __future__ import annotations

from flplatform.simulation import telling_line

FLOWER_PANEL = """\
Using SuperLink: local (127.0.0.1:43799)
\x1b[31m╭─ Error ─────────────────────────────────────╮\x1b[0m
│ The Flower App does not meet the project     │
│ structure requirements: 'a/b/c' exceeds the  │
│ maximum directory depth of 10.               │
╰──────────────────────────────────────────────╯
"""


def test_a_flower_error_box_is_quoted_whole_on_one_line() -> None:
    assert telling_line(FLOWER_PANEL) == (
        "The Flower App does not meet the project structure requirements: 'a/b/c' exceeds "
        "the maximum directory depth of 10."
    )


def test_a_traceback_gives_its_exception_line() -> None:
    output = "Traceback (most recent call last):\n  File 'x'\nValueError: bad k\nexiting\n"
    assert telling_line(output) == "ValueError: bad k"


def test_otherwise_the_last_line_mentioning_an_error_then_the_last_line() -> None:
    assert telling_line("start\nan error happened here\nbye\n") == "an error happened here"
    assert telling_line("start\nbye\n") == "bye"
    assert telling_line("") == "no output"
