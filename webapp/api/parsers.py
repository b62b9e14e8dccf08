"""The API's JSON parser: DRF's, refusing with a 400 two bodies it lets through to a 500.

- Too-deep nesting: Python's decoder raises RecursionError on it.
- A lone UTF-16 surrogate (``"\\ud800"``), in a key or a value: JSON's escapes allow it, but no UTF-8
  text holds one, so the first error message or row that echoes it fails to encode.
"""

from __future__ import annotations

from rest_framework import parsers
from rest_framework.exceptions import ParseError

TOO_DEEP = "JSON parse error - nested too deeply"


class JSONParser(parsers.JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError(TOO_DEEP) from None
        where = _lone_surrogate(data, "body")
        if where is not None:
            raise ParseError(f"JSON parse error - {where}: a lone surrogate is not text")
        return data


def _lone_surrogate(value, path: str) -> str | None:
    """The path of the first key or string holding a lone surrogate, or None."""
    stack = [(value, path)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not _is_text(value):
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                if not _is_text(key):
                    return f"{path} (a key)"
                stack.append((item, f"{path}.{key}"))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))
    return None


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
