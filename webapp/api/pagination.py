"""Cursor pagination over ids, newest first; a cursor that cannot be read is a 400 on ``cursor``,
and so is a ``limit`` that is not a whole number from 1 to the largest page (on ``limit``)."""

from __future__ import annotations

from rest_framework import exceptions, serializers
from rest_framework.pagination import CursorPagination

MAX_ID = 2**63 - 1
BAD_CURSOR = "cursor: not a cursor this API gave out"


class IdCursorPagination(CursorPagination):
    ordering = "-id"
    page_size = 50
    page_size_query_param = "limit"
    max_page_size = 200

    def get_page_size(self, request):
        # DRF falls back to the default page for a limit it cannot read (``abc``, ``0``, ``-5``)
        # and cuts one above the largest page down to it; the events endpoint refuses both.
        raw = request.query_params.get(self.page_size_query_param)
        if raw is None:
            return self.page_size
        field = serializers.IntegerField(min_value=1, max_value=self.max_page_size)
        try:
            return field.run_validation(raw)
        except exceptions.ValidationError as exc:
            raise exceptions.ValidationError({self.page_size_query_param: exc.detail}) from None

    def decode_cursor(self, request):
        try:
            cursor = super().decode_cursor(request)
        except exceptions.NotFound:
            raise exceptions.ValidationError({self.cursor_query_param: [BAD_CURSOR]}) from None
        # DRF hands the position to the query as it is; a non-number would fail there with a 500.
        position = cursor.position if cursor is not None else None
        if position is not None and not (
            position.isascii()
            and position.isdigit()
            and len(position) <= len(str(MAX_ID))  # int() refuses past 4,300 digits
            and int(position) <= MAX_ID
        ):
            raise exceptions.ValidationError({self.cursor_query_param: [BAD_CURSOR]})
        return cursor
