"""The web server the project ships: Daphne, refusing an oversize request body while it reads it.

Run it as Daphne's command line (``python -m nereus.asgi_server -b HOST -p PORT
webapp.asgi:application``, the same options): ``nereus/processes.py`` and the Docker and
Kubernetes commands start the web server this way.

Why not plain Daphne: Twisted reads a request's whole body (into a temporary file past 100 KB)
before Daphne calls the ASGI application, so ``BodyLimitMiddleware`` (``webapp/limits.py``) could
answer an oversize upload only after all of it had arrived, and a ``Content-Length`` the client
never sends the bytes of not at all. Here the same cap, ``settings.DATA_UPLOAD_MAX_MEMORY_SIZE``
(``None``: no cap; read at each request), is applied by the request object Twisted feeds while
it reads:

- ``gotLength``, called once the headers are in: a ``Content-Length`` over the cap is answered at
  once, before any of the body is read;
- ``handleContentChunk``, called with each piece of body read: a body without a length
  (chunked) is answered as soon as what arrived passes the cap.

The answer is the middleware's 413 (``webapp.limits.too_large_body``: ``too_large`` naming
``body``) with ``Connection: close``; the request never reaches the application. The server then
half-closes the connection (FIN after the 413) and closes it fully once the client has sent
nothing for ``LINGER_S`` (``LINGER_MAX_S`` at most), or when the client does; what the client
still sends meanwhile is dropped as it arrives, never stored.
Closing at once would leave unread data in the socket, and the kernel answers that with a RST,
which can destroy the 413 before a client still uploading reads it (Go's net/http waits the same
way).

A websocket handshake has no body, so it passes untouched and Daphne upgrades it as before.
Twisted itself still answers a malformed ``Content-Length`` (not digits, two of them, one with
``Transfer-Encoding``) with a bare 400 before any request object sees it. HTTP/2 (only over TLS,
which this service does not terminate) is left to the middleware.

How Daphne is extended: ``CommandLineInterface.server_class`` is Daphne's hook for its server;
the request class is chosen by its ``HTTPFactory.buildProtocol``, which ``BodyLimitHTTPFactory``
overrides. ``Server.run`` builds its factory inline (``self.http_factory = HTTPFactory(self)``)
with no parameter for the class, so ``BodyLimitServer`` puts its own in place where that
attribute is set, and refuses to start if Daphne no longer sets it that way.
"""

# Daphne's server module installs Twisted's asyncio reactor when imported: it must come before
# anything imports twisted.internet.reactor.
import daphne.server  # isort:skip  # noqa: F401

import logging
import sys

from daphne.cli import CommandLineInterface
from daphne.http_protocol import HTTPFactory, WebRequest
from daphne.server import Server
from twisted.internet import reactor
from twisted.web import http

from webapp.limits import http_max_body_bytes, too_large_body

logger = logging.getLogger("nereus.asgi_server")  # not "__main__" under -m

# A refused connection stays open, half-closed, while the client still sends (what it sends is
# dropped), so that the 413 reaches a client that reads only once its upload is done: until
# LINGER_S pass with nothing received, and LINGER_MAX_S at most (as nginx's lingering close).
LINGER_S = 0.5
LINGER_MAX_S = 10.0


def too_large_response(cap: int, server_name: str = "") -> bytes:
    """The whole HTTP/1.1 413 response for a body over ``cap`` bytes, closing the connection."""
    body = too_large_body(cap)
    head = [
        b"HTTP/1.1 %d %s" % (http.REQUEST_ENTITY_TOO_LARGE, http.RESPONSES[413]),
        b"Content-Type: application/json",
        b"Content-Length: %d" % len(body),
        b"Connection: close",
    ]
    if server_name:
        head.append(b"Server: " + server_name.encode())
    return b"\r\n".join(head) + b"\r\n\r\n" + body


class BodyLimitRequest(WebRequest):
    """Daphne's request, answering 413 as soon as its body is known to be over the cap."""

    _cap: int | None = None
    _received = 0  # bytes of body read so far
    _refused = False
    _closing = None  # the delayed full close of a refused connection
    _linger_until = 0.0  # the latest that close may come (reactor seconds)

    def gotLength(self, length):  # noqa: N802 (Twisted)
        # HTTP/1.x only: the answer is written to the connection as is (HTTP/2 is TLS only here).
        if isinstance(self.channel, http.HTTPChannel):
            self._cap = http_max_body_bytes()
        if self._cap is not None and length is not None and length > self._cap:
            self._refuse()
        else:
            super().gotLength(length)

    def handleContentChunk(self, data):  # noqa: N802 (Twisted)
        if self._refused:
            return  # what was read with the data that passed the cap
        self._received += len(data)
        if self._cap is not None and self._received > self._cap:
            self._refuse()
        else:
            super().handleContentChunk(data)

    def requestReceived(self, command, path, version):  # noqa: N802 (Twisted)
        # A refused body that the client finished anyway is not processed.
        if not self._refused:
            super().requestReceived(command, path, version)

    def connectionLost(self, reason):  # noqa: N802 (Twisted)
        if self._closing is not None and self._closing.active():
            self._closing.cancel()
        super().connectionLost(reason)

    def _refuse(self):
        self._refused = True
        channel, transport = self.channel, self.channel.transport
        # Twisted answers "Expect: 100-continue" right after gotLength; the 413 answers it instead.
        self.requestHeaders.removeHeader(b"Expect")
        transport.write(too_large_response(self._cap, self.server.server_name))
        logger.info(
            "refused a request body over %d bytes from %s",
            self._cap,
            getattr(self.client, "host", self.client),
        )
        # Whatever arrives from now on is dropped: the channel's parser is bypassed (Twisted's
        # HTTPChannel swaps its own dataReceived the same way to drop data after a last request).
        channel.dataReceived = self._discard
        lose_write = getattr(transport, "loseWriteConnection", None)
        if lose_write is None:
            channel.loseConnection()
            return
        lose_write()
        self._linger_until = reactor.seconds() + LINGER_MAX_S
        self._closing = reactor.callLater(LINGER_S, channel.loseConnection)

    def _discard(self, data: bytes) -> None:
        """What a refused connection still receives: dropped, and the close waits LINGER_S more
        (until LINGER_MAX_S after the refusal)."""
        closing = self._closing
        if closing is not None and closing.active():
            closing.reset(max(0.0, min(LINGER_S, self._linger_until - reactor.seconds())))


class BodyLimitHTTPFactory(HTTPFactory):
    """Daphne's HTTP factory, its connections making ``BodyLimitRequest``s."""

    def buildProtocol(self, addr):  # noqa: N802 (Twisted)
        protocol = super().buildProtocol(addr)
        protocol.requestFactory = BodyLimitRequest
        return protocol


class BodyLimitServer(Server):
    """Daphne's server, serving HTTP through ``BodyLimitHTTPFactory``."""

    def __init__(self, *args, ready_callable=None, **kwargs):
        def ready():
            # Called by run() once it listens, before it serves anything.
            if not isinstance(self.__dict__.get("_http_factory"), BodyLimitHTTPFactory):
                raise RuntimeError(
                    "Daphne did not build its HTTP factory through BodyLimitServer.http_factory:"
                    " request bodies would not be capped"
                )
            if ready_callable is not None:
                ready_callable()

        super().__init__(*args, ready_callable=ready, **kwargs)

    @property
    def http_factory(self):
        return self._http_factory

    @http_factory.setter
    def http_factory(self, factory):
        # run() assigns Daphne's factory here and listens with it straight after.
        if not isinstance(factory, BodyLimitHTTPFactory):
            factory = BodyLimitHTTPFactory(self)
        self._http_factory = factory


class BodyLimitCommandLineInterface(CommandLineInterface):
    description = "Nereus's HTTP/WebSocket server (Daphne, with request bodies capped)"
    server_class = BodyLimitServer


def main(argv: list[str] | None = None) -> None:
    BodyLimitCommandLineInterface().run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
