"""The API's JSON parser: DRF's, refusing a body over the cap with a 413 and with a 400 two bodies
DRF lets through to a 500.

- A body over ``settings.DATA_UPLOAD_MAX_MEMORY_SIZE`` bytes (``None``: no cap): 413 ``too_large``
  naming ``body``, read no further than one byte past the cap. Under Daphne the ASGI middleware
  (``webapp/limits.py``) refuses it first; this covers every other way in (WSGI, the test client).
- Too-deep nesting: Python's decoder raises RecursionError on it.
- A lone UTF-16 surrogate (``"\\ud800"``), in a key or a value: JSON's escapes allow it, but no UTF-8
  text holds one, so the first error message or row that echoes it fails to encode.

A key given twice in one object, at any depth, is a 400 naming its path (``spec.policy.gamma``) in
``fields``: ``json`` keeps the last one without a word, so ``{"slots": 2, "slots": 3}`` would act
on 3. The catalog loader refuses one too, as do trace files and the CLI
(``runtime.events.unique_keys``).

It is not a subclass of DRF's ``JSONParser`` on purpose: DRF hands a parser of that class
``request.body`` instead of the stream, and Django refuses an oversized ``request.body`` with its
own HTML 400 before any parser runs. Decoding is DRF's (its charset check, its ``STRICT_JSON``
refusal of NaN and Infinity, its ``JSON parse error - …`` messages), with a hook on each object.

``ContentNegotiation`` answers an unknown ``?format=`` (or format suffix) with a 400 naming
``format`` and the formats the view has, where DRF raises a bare Http404.
"""

from __future__ import annotations

import codecs
import io

from django.conf import settings
from rest_framework import parsers, renderers, status
from rest_framework.exceptions import APIException, ParseError, ValidationError
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.utils import json

from webapp.limits import TOO_LARGE_CODE, too_large_message

TOO_DEEP = "JSON parse error - nested too deeply"


class BodyTooLarge(APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "body: the request body is too large"
    default_code = TOO_LARGE_CODE
    field = "body"


class RepeatedKeyError(ParseError):
    """A key given twice in one object; ``field`` is its dotted path."""

    def __init__(self, path: str, key: str):
        super().__init__(f"{path}: {key!r} is given twice in one object")
        self.field = path


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
        encoding = parsers.get_encoding(parser_context or {})  # DRF's: text codecs only
        repeats: list[_Repeats] = []
        try:
            data = json.load(
                codecs.getreader(encoding)(stream),
                parse_constant=json.strict_constant if _DRF.strict else None,
                object_pairs_hook=lambda pairs: _object(pairs, repeats),
            )
        except RecursionError:
            raise ParseError(TOO_DEEP) from None
        except ValueError as exc:  # as DRF words it (UnicodeDecodeError is one too)
            raise ParseError(f"JSON parse error - {exc}") from None
        where = _lone_surrogate(data, "body")
        if where is not None:
            raise ParseError(f"JSON parse error - {where}: a lone surrogate is not text")
        if repeats:  # after the surrogates: a path holding one could not be echoed
            raise RepeatedKeyError(*_repeated_key(data))
        return data


class _Repeats(dict):
    """A decoded JSON object that gave ``repeated`` twice: marked, not raised, so that the walk
    after the decoder can name the key's path."""

    __slots__ = ("repeated",)


def _object(pairs: list[tuple[str, object]], repeats: list[_Repeats]) -> dict:
    """``object_pairs_hook``: a plain dict, or a ``_Repeats`` (appended to ``repeats`` too) for
    an object giving a key twice."""
    out = dict(pairs)
    if len(out) == len(pairs):
        return out
    seen = set()
    for key, _ in pairs:
        if key in seen:
            break
        seen.add(key)
    marked = _Repeats(out)
    marked.repeated = key
    repeats.append(marked)
    return marked


def _repeated_key(value) -> tuple[str, str]:
    """(dotted path, key) of the first key given twice, in the body's order (there is one)."""
    stack = [(value, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, _Repeats):
            return (f"{path}.{value.repeated}" if path else value.repeated), value.repeated
        items = value.items() if isinstance(value, dict) else enumerate(value)
        stack.extend(
            reversed(  # popped first to last
                [
                    (item, f"{path}.{key}" if path else str(key))
                    for key, item in items
                    if isinstance(item, dict | list)
                ]
            )
        )
    raise AssertionError("no repeated key in the body")  # unreachable: the hook found one


class ContentNegotiation(DefaultContentNegotiation):
    """DRF's, with an unknown format a 400 naming ``format`` (DRF raises a bare Http404)."""

    def filter_renderers(self, renderers, format):
        kept = [renderer for renderer in renderers if renderer.format == format]
        if not kept:
            known = ", ".join(dict.fromkeys(renderer.format for renderer in renderers))
            shown = repr(format) if len(format) <= 40 else f"{format[:40]!r}…"
            raise ValidationError({"format": [f"{shown} is not a format here; one of: {known}"]})
        return kept


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
