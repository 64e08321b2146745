"""Text from elsewhere (a site's error, a name) made safe to show on a terminal; seconds said
as a user reads them."""

from __future__ import annotations

import unicodedata


def printable(text: str) -> str:
    """``text`` with every control character but the line break shown as ``?`` (a tab as a
    space): the escape sequences a hostile site can put in its error (a terminal's title,
    its screen cleared, a hyperlink), C1 controls and carriage returns never reach a
    terminal as what they do."""
    if text.isprintable():
        return text
    return "".join(
        c if c == "\n" or unicodedata.category(c) != "Cc" else " " if c == "\t" else "?"
        for c in text
    )


def seconds_text(seconds: float) -> str:
    """A duration for a sentence, in seconds without the unit: whole from 10 s up (``600``),
    two significant digits below (``2.5``, ``0.3``: a sub-second timeout is not ``0``)."""
    return f"{seconds:.0f}" if seconds >= 10 else f"{seconds:.2g}"
