"""Websocket authentication: the browser's session, or a project API token for other clients.

Browsers send their session cookie; a CI client (``nereus watch``) or any other program sends
``Authorization: Bearer <token>`` with the upgrade request, as it does to the REST API. A token
narrows what the socket may see to the token's project, exactly as it does over REST; an unknown
or revoked token leaves the connection anonymous, and the consumer refuses it.
"""

from __future__ import annotations

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.middleware import BaseMiddleware
from channels.routing import URLRouter
from django.contrib.auth.models import AnonymousUser

from webapp.projects import errors as project_errors
from webapp.projects import services as project_services


@database_sync_to_async
def _token(secret: str):
    try:
        return project_services.token_authenticate(secret)
    except project_errors.NotFoundError:
        return None


class BearerTokenMiddleware(BaseMiddleware):
    """Sets ``scope["user"]`` and ``scope["token"]`` from an ``Authorization: Bearer`` header."""

    async def __call__(self, scope, receive, send):
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        parts = header.split()
        if parts and parts[0].lower() == b"bearer":
            token = None
            if len(parts) == 2:
                try:
                    token = await _token(parts[1].decode("ascii"))
                except UnicodeDecodeError:
                    token = None
            user = token.user if token is not None else AnonymousUser()
            scope = {**scope, "user": user, "token": token}
        return await super().__call__(scope, receive, send)


def websocket_application(routes):
    """The websocket stack: session first, a bearer token over it when one is sent."""
    return AuthMiddlewareStack(BearerTokenMiddleware(URLRouter(routes)))
