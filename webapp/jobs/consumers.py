"""Websocket: ``/ws/jobs/<id>/`` streams a job's events live.

A client connects with ``?after=<last id>`` (or sends ``{"type": "resume", "after": N}``) and first
receives every stored event after that id, then live ones; ids only increase and duplicates are
dropped, so a client that reconnects misses nothing and sees nothing twice.

Who may see the job is checked again before every read of the log, not only at connect: a revoked
token, a deactivated user, a member removed from the project or a browser session that was logged
out (or whose password changed since) gets the socket closed (4404) at the next event instead of
streaming on, as the REST API stops answering them at the next request.
"""

from __future__ import annotations

import asyncio
import json
from importlib import import_module
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.contrib.auth import HASH_SESSION_KEY, SESSION_KEY, get_user_model
from django.utils.crypto import constant_time_compare

from runtime.events import RepeatedKeyError, unique_keys
from webapp.jobs import selectors
from webapp.projects.models import ApiToken

CLOSE_UNAUTHENTICATED = 4401
CLOSE_NOT_FOUND = 4404
BACKLOG_PAGE = 500


class ClientError(Exception):
    """A problem with what the client sent; reported as an error frame, the socket stays open."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class JobEventsConsumer(AsyncJsonWebsocketConsumer):
    # --- socket events ---------------------------------------------------------------------

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        self.job = await self._get_job(
            user, self.scope["url_route"]["kwargs"]["job_id"], self.scope.get("token")
        )
        if self.job is None:
            await self.close(code=CLOSE_NOT_FOUND)
            return
        # A session-authenticated socket lives only as long as the session that opened it: remember
        # which one it was and the password hash it was verified against, to check before each read.
        self.session_key = self.session_hash = None
        if self.scope.get("token") is None:
            session = self.scope.get("session")
            self.session_key = getattr(session, "session_key", None)
            self.session_hash = user.get_session_auth_hash()
            if not self.session_key:  # authenticated, yet by no session we could check again
                await self.close(code=CLOSE_UNAUTHENTICATED)
                return
        self.last_id = 0
        await self.channel_layer.group_add(self.job.group_name, self.channel_name)
        self._renewing = asyncio.ensure_future(self._renew_group())
        await self.accept()
        try:
            query = parse_qs(self.scope.get("query_string", b"").decode("utf-8", errors="replace"))
            after = _parse_after(query.get("after", ["0"])[0])
        except ClientError as exc:
            await self._send_error(exc)
            after = 0
        await self._send_backlog(after)

    async def disconnect(self, code: int) -> None:
        renewing = getattr(self, "_renewing", None)
        if renewing is not None:
            renewing.cancel()
        job = getattr(self, "job", None)
        if job is not None:
            await self.channel_layer.group_discard(job.group_name, self.channel_name)

    async def _renew_group(self) -> None:
        """A channel layer forgets a group member after its ``group_expiry`` (a day by
        default), and a page watching a job that runs for days would go quiet: the socket
        joins its group again well before then, for as long as it is open."""
        every = max(1.0, getattr(self.channel_layer, "group_expiry", 86400) / 4)
        while True:
            await asyncio.sleep(every)
            await self.channel_layer.group_add(self.job.group_name, self.channel_name)

    async def receive_json(self, content, **kwargs) -> None:
        try:
            if not isinstance(content, dict) or content.get("type") != "resume":
                raise ClientError("bad_message", "type: expected 'resume'")
            await self._send_backlog(_parse_after(content.get("after", 0)))
        except ClientError as exc:
            await self._send_error(exc)

    @classmethod
    async def decode_json(cls, text_data):
        try:  # a key given twice is refused, as everywhere input is read
            return json.loads(text_data, object_pairs_hook=unique_keys)
        except RecursionError:  # nested too deeply for the decoder: as malformed as any other
            raise ValueError("nested too deeply") from None

    async def receive(self, text_data=None, bytes_data=None, **kwargs) -> None:
        try:
            await super().receive(text_data=text_data, bytes_data=bytes_data, **kwargs)
        except RepeatedKeyError as exc:
            await self._send_error(ClientError("bad_message", f"message: {exc}"))
        except ValueError:
            await self._send_error(ClientError("bad_json", "message: not valid JSON"))

    # --- command helpers -------------------------------------------------------------------

    async def _send_backlog(self, after: int) -> None:
        # The client says what it has: resend everything after that, even if sent before.
        self.last_id = after
        cursor = after
        while True:
            events = await self._events_since(cursor)
            if events is None:  # the caller may no longer see this job
                await self.close(code=CLOSE_NOT_FOUND)
                return
            for event in events:
                await self._deliver(event)
            if len(events) < BACKLOG_PAGE:
                return
            cursor = events[-1]["id"]

    async def _deliver(self, event: dict) -> None:
        if event["id"] <= self.last_id:
            return
        self.last_id = event["id"]
        await self.send_json({"type": "event", "event": event})

    async def _send_error(self, exc: ClientError) -> None:
        await self.send_json({"type": "error", "code": exc.code, "message": str(exc)})

    @database_sync_to_async
    def _get_job(self, user, job_id: int, token=None):
        return selectors.jobs_visible_to(user, token=token).filter(pk=job_id).first()

    @database_sync_to_async
    def _events_since(self, after: int) -> list[dict] | None:
        """The next page of events, or None when the caller may no longer see the job."""
        if not self._still_visible():
            return None
        return [
            e.as_message()
            for e in selectors.job_events_since(job=self.job, after_id=after, limit=BACKLOG_PAGE)
        ]

    def _still_visible(self) -> bool:
        user, token = self.scope["user"], self.scope.get("token")
        current = get_user_model().objects.filter(pk=user.pk, is_active=True).first()
        if current is None:
            return False
        if token is None and not self._session_still_valid(current):
            return False
        if (
            token is not None
            and not ApiToken.objects.filter(pk=token.pk, revoked_at__isnull=True).exists()
        ):
            return False
        return selectors.jobs_visible_to(user, token=token).filter(pk=self.job.pk).exists()

    def _session_still_valid(self, current) -> bool:
        """The session that opened the socket still exists (not logged out, not expired), still
        belongs to this user and was not invalidated by a password change: what an HTTP request
        with that cookie needs to stay logged in."""
        data = import_module(settings.SESSION_ENGINE).SessionStore(session_key=self.session_key)
        data = data.load()
        stored_hash = data.get(HASH_SESSION_KEY)
        return (
            str(data.get(SESSION_KEY)) == current._meta.pk.value_to_string(current)
            and isinstance(stored_hash, str)
            and constant_time_compare(stored_hash, self.session_hash)
            and constant_time_compare(current.get_session_auth_hash(), self.session_hash)
        )

    # --- channel-layer handlers ------------------------------------------------------------

    async def job_event(self, message: dict) -> None:
        # Live messages from different writers can arrive out of order, but a job's events commit in
        # id order (each append holds the job's row lock), so the log is read from the last id sent:
        # an event that overtook an earlier one can never make the client skip it.
        if message["event"]["id"] > self.last_id:
            await self._send_backlog(self.last_id)


_MAX_ID = 2**63 - 1


def _parse_after(value) -> int:
    """An event id: a whole number (or its digits, from a URL) in [0, 2**63)."""
    given = value
    # More digits than any id has are refused before int(), which raises past 4,300 of them.
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 19:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_ID:
        shown = repr(given)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise ClientError("bad_after", f"after: expected a non-negative event id, got {shown}")
    return value
