"""Strings from a snapshot, made safe to show on a terminal.

Frame names, file names, annotations, allocator settings and dict keys come from a file that
anyone may have written. Printed verbatim, ``\\x1b[2J`` clears the user's screen, ``\\x1b]0;...``
retitles the terminal and a bidi override reorders what the eye reads. Every such string is
passed through ``printable`` before it reaches a terminal: control characters (C0, DEL, C1), line
and paragraph separators and bidi controls become visible escapes (``\\x1b``, ``\\u202e``). Rich
markup is never interpreted either: the consoles are built with ``markup=False``.
"""

from __future__ import annotations

import re

# C0 controls (newline and tab included: one string is one line), DEL, C1 controls, the Unicode
# line/paragraph separators and the bidirectional-text controls (the "Trojan Source" set).
UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")
MAX_SHOWN_CHARS = 2000  # longer than any real frame name; a 10 MB one would flood the screen


def escape_char(match: re.Match[str]) -> str:
    """A matched character as its visible escape: ``\\x1b``, ``\\u202e`` (``UNPRINTABLE.sub``'s
    replacement, for other writers of snapshot text such as the CSV export)."""
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: object, limit: int = MAX_SHOWN_CHARS) -> str:
    """``text`` as one visible line: controls escaped, cut in the middle past ``limit`` chars."""
    shown = UNPRINTABLE.sub(escape_char, str(text))
    if len(shown) > limit:
        half = limit // 2
        shown = f"{shown[:half]}…[{len(shown) - 2 * half:,} chars]…{shown[-half:]}"
    return shown
