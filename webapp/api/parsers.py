"""The API's JSON parser: DRF's, refusing too-deep nesting with a 400 as it refuses any other
malformed body (Python's decoder raises RecursionError on it, which DRF lets through as a 500)."""

from __future__ import annotations

from rest_framework import parsers
from rest_framework.exceptions import ParseError

TOO_DEEP = "JSON parse error - nested too deeply"


class JSONParser(parsers.JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError(TOO_DEEP) from None
