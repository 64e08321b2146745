"""Text from elsewhere (a site's error, a name) made safe to show on a terminal."""

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
