"""Cursor pagination over ids, newest first; a cursor that cannot be read is a 400 on ``cursor``."""

from __future__ import annotations

from rest_framework import exceptions
from rest_framework.pagination import CursorPagination

MAX_ID = 2**63 - 1
BAD_CURSOR = "cursor: not a cursor this API gave out"


class IdCursorPagination(CursorPagination):
    ordering = "-id"
    page_size = 50
    page_size_query_param = "limit"
    max_page_size = 200

    def decode_cursor(self, request):
        try:
            cursor = super().decode_cursor(request)
        except exceptions.NotFound:
            raise exceptions.ValidationError({self.cursor_query_param: [BAD_CURSOR]}) from None
        # DRF hands the position to the query as it is; a non-number would fail there with a 500.
        position = cursor.position if cursor is not None else None
        if position is not None and not (
            position.isascii() and position.isdigit() and int(position) <= MAX_ID
        ):
            raise exceptions.ValidationError({self.cursor_query_param: [BAD_CURSOR]})
        return cursor
