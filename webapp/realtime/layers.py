"""A channel layer over the service's own database, for the embedded default (no Redis).

Channels' in-memory layer only reaches consumers of the process that sent, so a Celery worker could
never wake a websocket client of the web process. This layer keeps messages and group memberships
in two tables of the configured database (SQLite in WAL mode by default, PostgreSQL works too), so
every process that shares the database shares the layer.

Receiving is one poller task per process and event loop: it claims, in one transaction, the
messages of every channel that a coroutine of this process is waiting on, and hands each to that
channel's queue. Claiming happens under the database's write lock (SQLite's immediate transactions,
``SELECT ... FOR UPDATE SKIP LOCKED`` on PostgreSQL), so a message reaches exactly one receiver.
Latency is the poll interval (50 ms by default); with REDIS_URL set, channels_redis replaces it.
The job event log in the database stays the source of truth: this layer only makes events arrive
sooner.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from datetime import timedelta

from channels.db import database_sync_to_async
from channels.exceptions import ChannelFull
from channels.layers import BaseChannelLayer
from django.db import DatabaseError, connection, transaction
from django.db.models import Count
from django.utils import timezone

from webapp.realtime.models import ChannelMessage, GroupMembership

logger = logging.getLogger(__name__)

_CLAIM_BATCH = 200
_SWEEP_EVERY_POLLS = 200


class DatabaseChannelLayer(BaseChannelLayer):
    """Channel layer whose messages and groups live in the Django database."""

    extensions = ["groups", "flush"]

    def __init__(
        self,
        expiry: int = 60,
        group_expiry: int = 86400,
        capacity: int = 100,
        channel_capacity=None,
        poll_interval: float = 0.05,
    ):
        super().__init__(expiry=expiry, capacity=capacity, channel_capacity=channel_capacity)
        self.group_expiry = group_expiry
        self.poll_interval = poll_interval
        self.client_prefix = uuid.uuid4().hex
        self._queues: dict[str, asyncio.Queue] = {}
        self._waiting: dict[str, int] = {}
        self._last_wait: dict[str, float] = {}
        self._poller: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._polls = 0

    # --- sending ---------------------------------------------------------------------------

    async def send(self, channel: str, message: dict) -> None:
        """Queue one message on one channel; ChannelFull when the channel is at capacity."""
        if not isinstance(message, dict):
            raise TypeError("a channel message must be a dict")
        self.require_valid_channel_name(channel)
        sent = await database_sync_to_async(self._insert)([channel], _encode(message))
        if not sent:
            raise ChannelFull(channel)

    async def group_send(self, group: str, message: dict) -> None:
        """Queue a message on every live member of a group; full channels miss it, as in Redis."""
        if not isinstance(message, dict):
            raise TypeError("a channel message must be a dict")
        self.require_valid_group_name(group)
        await database_sync_to_async(self._group_insert)(group, _encode(message))

    def _group_insert(self, group: str, body: str) -> int:
        channels = list(
            GroupMembership.objects.filter(group=group, expires__gt=timezone.now()).values_list(
                "channel", flat=True
            )
        )
        return self._insert(channels, body) if channels else 0

    def _insert(self, channels: list[str], body: str) -> int:
        now = timezone.now()
        with transaction.atomic():
            counts = dict(
                ChannelMessage.objects.filter(channel__in=channels, expires__gt=now)
                .values("channel")
                .annotate(n=Count("id"))
                .values_list("channel", "n")
            )
            expires = now + timedelta(seconds=self.expiry)
            rows = [
                ChannelMessage(channel=ch, body=body, expires=expires)
                for ch in channels
                if counts.get(ch, 0) < self.get_capacity(ch)
            ]
            ChannelMessage.objects.bulk_create(rows)
        return len(rows)

    # --- receiving -------------------------------------------------------------------------

    async def new_channel(self, prefix: str = "specific") -> str:
        return f"{prefix}.{self.client_prefix}!{uuid.uuid4().hex}"

    async def receive(self, channel: str) -> dict:
        """Wait for the next message on a channel of this process."""
        self.require_valid_channel_name(channel)
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            # A new event loop (e.g. a fresh async_to_sync): queues of the old one are unusable.
            self._loop, self._queues, self._poller = loop, {}, None
            self._waiting, self._last_wait = {}, {}
        queue = self._queues.setdefault(channel, asyncio.Queue())
        self._waiting[channel] = self._waiting.get(channel, 0) + 1
        if self._poller is None or self._poller.done():
            self._poller = loop.create_task(self._poll_forever())
        try:
            return await queue.get()
        finally:
            self._waiting[channel] -= 1
            self._last_wait[channel] = loop.time()

    def _polled_channels(self, now: float) -> list[str]:
        """Channels with a waiting receiver, queued messages, or a receiver that left recently.

        A queue outlives a finished ``receive`` for ``expiry`` seconds: a message the poller claimed
        in the meantime waits there for the next ``receive`` instead of being lost.
        """
        for channel in list(self._queues):
            idle = self._waiting.get(channel, 0) == 0 and self._queues[channel].empty()
            if idle and now - self._last_wait.get(channel, now) > self.expiry:
                del self._queues[channel]
                self._waiting.pop(channel, None)
                self._last_wait.pop(channel, None)
        return list(self._queues)

    async def _poll_forever(self) -> None:
        loop = asyncio.get_running_loop()
        failures = 0
        while channels := self._polled_channels(loop.time()):
            try:
                batch = await database_sync_to_async(self._claim)(channels)
            except DatabaseError:
                # A locked SQLite file or a database failover: retry, never stop delivering.
                failures += 1
                logger.warning("channel layer poll failed (%d in a row)", failures, exc_info=True)
                await asyncio.sleep(min(5.0, self.poll_interval * 2**failures))
                continue
            failures = 0
            for channel, message in batch:
                self._queues.setdefault(channel, asyncio.Queue()).put_nowait(message)
            if len(batch) < _CLAIM_BATCH:
                await asyncio.sleep(self.poll_interval)

    def _claim(self, channels: list[str]) -> list[tuple[str, dict]]:
        now = timezone.now()
        self._polls += 1
        with transaction.atomic():
            pending = ChannelMessage.objects.filter(channel__in=channels, expires__gt=now).order_by(
                "id"
            )
            if connection.features.has_select_for_update_skip_locked:
                pending = pending.select_for_update(skip_locked=True)
            rows = list(pending.values_list("id", "channel", "body")[:_CLAIM_BATCH])
            if rows:
                ChannelMessage.objects.filter(id__in=[r[0] for r in rows]).delete()
            if self._polls % _SWEEP_EVERY_POLLS == 0:
                self._sweep(now)
        return [(channel, json.loads(body)) for _, channel, body in rows]

    @staticmethod
    def _sweep(now) -> None:
        ChannelMessage.objects.filter(expires__lte=now).delete()
        GroupMembership.objects.filter(expires__lte=now).delete()

    # --- groups ----------------------------------------------------------------------------

    async def group_add(self, group: str, channel: str) -> None:
        self.require_valid_group_name(group)
        self.require_valid_channel_name(channel)
        await database_sync_to_async(self._group_add)(group, channel)

    def _group_add(self, group: str, channel: str) -> None:
        expires = timezone.now() + timedelta(seconds=self.group_expiry)
        GroupMembership.objects.update_or_create(
            group=group, channel=channel, defaults={"expires": expires}
        )

    async def group_discard(self, group: str, channel: str) -> None:
        self.require_valid_group_name(group)
        self.require_valid_channel_name(channel)
        await database_sync_to_async(
            GroupMembership.objects.filter(group=group, channel=channel).delete
        )()

    async def flush(self) -> None:
        """Drop every message and membership (tests and the flush extension)."""

        def _flush() -> None:
            ChannelMessage.objects.all().delete()
            GroupMembership.objects.all().delete()

        await database_sync_to_async(_flush)()


def _encode(message: dict) -> str:
    try:
        return json.dumps(message, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"a channel message must be JSON-serialisable: {exc}") from exc
