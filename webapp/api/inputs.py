"""Request bodies taken as JSON says them: every field declared, every value of its JSON type.

DRF's fields convert what they are given (``true`` to 1, ``"3"`` to 3, ``1.5`` to ``"1.5"``), and
a plain serializer drops fields it does not declare, so a misspelt field falls back to its
default without a word (``{"rol": "viewer"}`` made an operator token). The API's write bodies use
these instead, and name the field whose value is refused.
"""

from __future__ import annotations

from rest_framework import serializers

from webapp.validators import NoControlCharacters

UNKNOWN_FIELD = "unknown field"


class StrictInput(serializers.Serializer):
    """A body whose every field is declared: any other is refused by name."""

    def validate(self, attrs):
        unknown = sorted(set(self.initial_data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError({name: [UNKNOWN_FIELD] for name in unknown})
        return attrs


class WholeNumber(serializers.IntegerField):
    """A JSON integer, and only that: not ``true``, ``"3"`` or ``3.0``."""

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


class Number(serializers.FloatField):
    """A JSON number, and only that: not ``true`` or ``"30"``."""

    def to_internal_value(self, data):
        if isinstance(data, bool) or not isinstance(data, int | float):
            self.fail("invalid")
        return super().to_internal_value(data)


class Text(serializers.CharField):
    """A JSON string, and only that: not ``1.5`` or ``true``; without control characters (line
    breaks and tabs only where ``multiline``)."""

    def __init__(self, *, multiline: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.validators.append(NoControlCharacters(multiline=multiline))

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)
