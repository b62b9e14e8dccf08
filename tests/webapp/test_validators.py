"""What counts as a control character in a name and in a comment (webapp/validators.py)."""

import pytest
from django.core.exceptions import ValidationError

from webapp.validators import NoControlCharacters, control_character


def test_names_hold_no_control_character_comments_keep_their_lines():
    assert control_character("Ünïcode names, emoji 🚀 and spaces") is None
    assert control_character("a\tb") == "U+0009"
    assert control_character("two\nlines") == "U+000A"
    assert control_character("two\r\nlines\tand a tab", multiline=True) is None  # a textarea's
    assert control_character("bell\x07", multiline=True) == "U+0007"
    assert control_character("escape \x1b[2J", multiline=True) == "U+001B"
    assert control_character("del\x7f", multiline=True) == "U+007F"
    assert control_character("c1 \x9b2J", multiline=True) == "U+009B"  # the 8-bit CSI
    assert control_character("txt.exe\u202egnp", multiline=True) == "U+202E"  # shown reversed
    assert control_character("line\u2028break", multiline=True) == "U+2028"
    assert control_character("family 👨\u200d👩\u200d👧") is None  # joiners in emoji stay


def test_the_validator_names_the_character():
    NoControlCharacters(multiline=True)("fine\r\n")
    with pytest.raises(ValidationError, match=r"control characters \(found U\+001B\)"):
        NoControlCharacters()("x\x1b")
