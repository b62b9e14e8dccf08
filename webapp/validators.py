"""Words people type (names, comments, reasons): refused when they hold control characters.

Such a character has no place in a name or a comment, and printed on a terminal or into a CI log
it can move the cursor, retitle the window or start a line that looks like the service's own
(``nereus`` escapes what it prints anyway: old rows, and data from other paths, may hold them).
Multi-line text (a comment, a reason) may hold line breaks and tabs; a name holds neither.
Bidirectional overrides are refused too: they make a terminal show text in another order.
"""

from __future__ import annotations

import re

from django.core.exceptions import ValidationError
from django.utils.deconstruct import deconstructible

# Also the characters that reorder or break what a terminal shows: bidirectional overrides and
# isolates (U+202A-U+202E, U+2066-U+2069), and the line and paragraph separators (U+2028-U+2029).
_SHOWN_WRONG = "\u2028\u2029\u202a-\u202e\u2066-\u2069"
_ONE_LINE = re.compile(f"[\\x00-\\x1f\\x7f-\\x9f{_SHOWN_WRONG}]")
_MULTILINE = re.compile(f"[\\x00-\\x08\\x0b\\x0c\\x0e-\\x1f\\x7f-\\x9f{_SHOWN_WRONG}]")  # \t \n \r


def control_character(value: str, *, multiline: bool = False) -> str | None:
    """The first control character of ``value`` that is not allowed there, as ``U+XXXX``."""
    found = (_MULTILINE if multiline else _ONE_LINE).search(value)
    return None if found is None else f"U+{ord(found.group()):04X}"


@deconstructible
class NoControlCharacters:
    """A Django validator (forms, DRF fields, services)."""

    def __init__(self, *, multiline: bool = False):
        self.multiline = multiline

    def __call__(self, value) -> None:
        if isinstance(value, str) and (char := control_character(value, multiline=self.multiline)):
            raise ValidationError(
                f"must not hold control characters (found {char})", code="control_character"
            )

    def __eq__(self, other) -> bool:
        return isinstance(other, NoControlCharacters) and other.multiline == self.multiline
