"""Helpers for the job websocket's tests: a signed-in session, and how a socket ends."""

from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY
from django.contrib.sessions.backends.db import SessionStore


def session_for(user) -> str:
    """The key of a new database session signed in as ``user``, as a login makes one."""
    store = SessionStore()
    store[SESSION_KEY] = str(user.pk)
    store[BACKEND_SESSION_KEY] = "django.contrib.auth.backends.ModelBackend"
    store[HASH_SESSION_KEY] = user.get_session_auth_hash()
    store.save()
    return store.session_key


async def closed_with(ws) -> int | None:
    """Frames until the socket closes: the close code, or None if an event got through."""
    while True:
        output = await ws.receive_output(timeout=5)
        if output["type"] == "websocket.close":
            return output.get("code")
        if output["type"] == "websocket.send":
            return None
