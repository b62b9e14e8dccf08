"""The API's JSON parser: DRF's, refusing a body over the cap with a 413 and with a 400 two bodies
DRF lets through to a 500.

- A body over ``settings.DATA_UPLOAD_MAX_MEMORY_SIZE`` bytes (``None``: no cap): 413 ``too_large``
  naming ``body``, read no further than one byte past the cap. Under Daphne the ASGI middleware
  (``webapp/limits.py``) refuses it first; this covers every other way in (WSGI, the test client).
- Too-deep nesting: Python's decoder raises RecursionError on it.
- A lone UTF-16 surrogate (``"\\ud800"``), in a key or a value: JSON's escapes allow it, but no UTF-8
  text holds one, so the first error message or row that echoes it fails to encode.

It is not a subclass of DRF's ``JSONParser`` on purpose: DRF hands a parser of that class
``request.body`` instead of the stream, and Django refuses an oversized ``request.body`` with its
own HTML 400 before any parser runs. Decoding is still DRF's (``_DRF.parse``).
"""

from __future__ import annotations

import io

from django.conf import settings
from rest_framework import parsers, renderers, status
from rest_framework.exceptions import APIException, ParseError

from webapp.limits import TOO_LARGE_CODE, too_large_message

TOO_DEEP = "JSON parse error - nested too deeply"


class BodyTooLarge(APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "body: the request body is too large"
    default_code = TOO_LARGE_CODE
    field = "body"


_DRF = parsers.JSONParser()


class JSONParser(parsers.BaseParser):
    media_type = _DRF.media_type
    renderer_class = renderers.JSONRenderer

    def parse(self, stream, media_type=None, parser_context=None):
        cap = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        if cap is not None:
            raw = stream.read(cap + 1)
            if len(raw) > cap:
                raise BodyTooLarge(f"body: {too_large_message(cap)}")
            stream = io.BytesIO(raw)
        try:
            data = _DRF.parse(stream, media_type, parser_context)
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
