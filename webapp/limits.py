"""Bounds on what a client may send: an HTTP request's body and a websocket message.

``BodyLimitMiddleware`` wraps an ASGI application (``webapp/asgi.py`` wraps both the HTTP and the
websocket stack with it):

- HTTP: a body over ``settings.DATA_UPLOAD_MAX_MEMORY_SIZE`` bytes (``None``: no cap, as in Django)
  is answered 413, in the API's error shape, naming ``body``. A ``Content-Length`` over the cap is
  refused before the application is called or any of the body read; a malformed one (not digits,
  repeated with different values, longer than any real length) gets 400. A body without one
  (chunked) is counted as it arrives: once past the cap the application is told the client went
  away (``http.disconnect``: Django's handler then stops reading and answers nothing) and the 413
  is sent from here. Django itself enforces that setting only for ``request.body`` and forms, not
  for the stream DRF's parser reads, and its ASGI handler spools the whole body to a file before
  any view runs.
- Websocket: a message over ``settings.NEREUS_WS_MAX_MESSAGE_BYTES`` closes the socket with
  ``CLOSE_TOO_LARGE`` instead of reaching the consumer, which then sees a disconnect.

Each cap is read at every connection, so a test's settings override applies.

What this cannot bound by itself: a server may receive a request's whole body before it calls the
application at all. Daphne (Twisted) does, whatever the ``Content-Length``: into a temporary file
past 100 KB, and with no answer until the last byte. The server the project ships,
``nereus/asgi_server.py`` (Daphne with a request class of ours), therefore applies the same cap
while it reads: it answers an over-long ``Content-Length`` with this 413 as soon as the headers
are in, and a chunked body as soon as it passes the cap, and closes the connection instead of
reading on. This middleware stays for any other server and for in-process tests.

The largest legitimate HTTP body is a plan override (``POST /api/v1/jobs/<id>/override/``): the
planner's plan for Llama-3.1-8B on 1,024 H100s is 20 KB of JSON (60 KB indented), and even one
split into 1,024 one-slot units in every model-stage is 0.3 MB indented; a job spec is a few
hundred bytes. Django's default cap, 2.5 MB, is well above both.
"""

from __future__ import annotations

import json

from django.conf import settings

# Close codes of the job websocket mirror HTTP statuses (4401, 4404 in webapp/jobs/consumers.py).
# RFC 6455's 1009 ("message too big") would be the standard one, but an application may not send
# it through Daphne: Autobahn accepts only 1000 and 3000-4999 from it, and anything else raises
# in ``send`` and reaches the client as 1011.
CLOSE_TOO_LARGE = 4413
TOO_LARGE_CODE = "too_large"
WS_MAX_MESSAGE_BYTES_DEFAULT = 64 * 1024  # settings.NEREUS_WS_MAX_MESSAGE_BYTES when unset
# More digits than any real length (and than int() accepts past 4,300) is malformed, not large.
_MAX_LENGTH_DIGITS = 19


def too_large_message(cap: int) -> str:
    return f"the request body is over the limit of {cap} bytes"


def http_max_body_bytes() -> int | None:
    return settings.DATA_UPLOAD_MAX_MEMORY_SIZE


def ws_max_message_bytes() -> int | None:
    return getattr(settings, "NEREUS_WS_MAX_MESSAGE_BYTES", WS_MAX_MESSAGE_BYTES_DEFAULT)


class BodyLimitMiddleware:
    """Refuses HTTP bodies and websocket messages over their caps (see the module's docstring)."""

    def __init__(self, app, *, max_body_bytes=None, max_ws_message_bytes=None):
        # Either cap given here overrides the setting (for an application outside this project's
        # settings); left None, the setting is read at each connection.
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_ws_message_bytes = max_ws_message_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            cap = self.max_body_bytes if self.max_body_bytes is not None else http_max_body_bytes()
            if cap is not None:
                return await self._http(cap, scope, receive, send)
        elif scope["type"] == "websocket":
            cap = self.max_ws_message_bytes
            cap = cap if cap is not None else ws_max_message_bytes()
            if cap is not None:
                return await self._websocket(cap, scope, receive, send)
        return await self.app(scope, receive, send)

    # --- HTTP ---------------------------------------------------------------------------------

    async def _http(self, cap: int, scope, receive, send):
        try:
            declared = _content_length(scope.get("headers") or [])
        except ValueError as exc:
            await _send_error(send, 400, "invalid", "Content-Length", str(exc))
            return None
        if declared is not None and declared > cap:
            await _send_too_large(send, cap)
            return None

        received = 0
        over = False  # the body went past the cap: the application hears a disconnect
        responded = False  # the 413 went out from here: nothing of the application's follows
        started = False  # the application began its response

        async def limited_receive():
            nonlocal received, over, responded
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body") or b"")
                if received > cap:
                    over = True
                    if not started:
                        # Flag first: the application may send no more from this moment on.
                        responded = True
                        await _send_too_large(send, cap)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            nonlocal started
            if responded:
                return  # one response per request, and ours went first
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        return await self.app(scope, limited_receive, guarded_send)

    # --- websocket ----------------------------------------------------------------------------

    async def _websocket(self, cap: int, scope, receive, send):
        closed = False

        async def limited_receive():
            nonlocal closed
            if closed:
                return {"type": "websocket.disconnect", "code": CLOSE_TOO_LARGE}
            message = await receive()
            if message["type"] == "websocket.receive" and _message_size_over(message, cap):
                closed = True
                await send({"type": "websocket.close", "code": CLOSE_TOO_LARGE})
                return {"type": "websocket.disconnect", "code": CLOSE_TOO_LARGE}
            return message

        async def guarded_send(message):
            if closed:
                return  # the socket is closed: a frame (or a second close) has nowhere to go
            await send(message)

        return await self.app(scope, limited_receive, guarded_send)


def _content_length(headers) -> int | None:
    """The declared body length, or None without one; ValueError saying why when malformed."""
    values = [value for name, value in headers if name.lower() == b"content-length"]
    if not values:
        return None
    parts = {part.strip() for value in values for part in value.split(b",")}
    if len(parts) != 1:
        raise ValueError("expected one length, got several")
    (raw,) = parts
    if not (raw.isdigit() and raw.isascii()) or len(raw) > _MAX_LENGTH_DIGITS:
        shown = raw[:20].decode("latin-1")
        raise ValueError(f"expected a number of bytes, got {shown!r}")
    return int(raw)


def _message_size_over(message: dict, cap: int) -> bool:
    data = message.get("bytes")
    if data is not None:
        return len(data) > cap
    text = message.get("text")
    if text is None:
        return False
    # A character is 1 to 4 bytes of UTF-8: encode only when the count alone cannot tell.
    if len(text) > cap:
        return True
    if len(text) * 4 <= cap:
        return False
    return len(text.encode("utf-8", errors="surrogatepass")) > cap


def error_body(code: str, field: str, problem: str) -> bytes:
    """The API's error shape (webapp/api/exceptions.py), naming ``field``, as JSON."""
    return json.dumps(
        {"code": code, "message": f"{field}: {problem}", "fields": {field: [problem]}}
    ).encode()


def too_large_body(cap: int) -> bytes:
    """The 413's body for a request body over ``cap`` bytes (also sent by nereus/asgi_server.py)."""
    return error_body(TOO_LARGE_CODE, "body", too_large_message(cap))


async def _send_too_large(send, cap: int):
    await _send_json(send, 413, too_large_body(cap))


async def _send_error(send, status: int, code: str, field: str, problem: str):
    await _send_json(send, status, error_body(code, field, problem))


async def _send_json(send, status: int, body: bytes):
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
