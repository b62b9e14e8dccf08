"""The database-backed channel layer of the embedded default, in one process and across two."""

import asyncio
import random
import sys
import textwrap

import pytest
from channels.exceptions import ChannelFull
from django.conf import settings
from django.db import OperationalError

from webapp.realtime.layers import DatabaseChannelLayer
from webapp.realtime.models import ChannelMessage

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]


@pytest.fixture
def layer():
    return DatabaseChannelLayer(expiry=30, capacity=3, poll_interval=0.02)


async def test_send_then_receive_in_order(layer):
    channel = await layer.new_channel()
    for n in range(3):
        await layer.send(channel, {"type": "t", "n": n})
    got = [await asyncio.wait_for(layer.receive(channel), 5) for _ in range(3)]
    assert [m["n"] for m in got] == [0, 1, 2]
    assert await ChannelMessage.objects.acount() == 0  # claimed messages are gone


async def test_group_send_reaches_members_only(layer):
    a, b, outsider = [await layer.new_channel() for _ in range(3)]
    await layer.group_add("job-1", a)
    await layer.group_add("job-1", b)
    await layer.group_add("job-2", outsider)
    await layer.group_send("job-1", {"type": "hello"})
    assert (await asyncio.wait_for(layer.receive(a), 5))["type"] == "hello"
    assert (await asyncio.wait_for(layer.receive(b), 5))["type"] == "hello"
    assert not await ChannelMessage.objects.filter(channel=outsider).aexists()
    await layer.group_discard("job-1", b)
    await layer.group_send("job-1", {"type": "again"})
    assert (await asyncio.wait_for(layer.receive(a), 5))["type"] == "again"
    assert not await ChannelMessage.objects.filter(channel=b).aexists()


async def test_full_channel_refuses_send(layer):
    channel = await layer.new_channel()
    for n in range(3):
        await layer.send(channel, {"type": "t", "n": n})
    with pytest.raises(ChannelFull):
        await layer.send(channel, {"type": "t", "n": 3})


async def test_expired_messages_are_not_delivered(layer):
    short = DatabaseChannelLayer(expiry=0, poll_interval=0.02)
    channel = await short.new_channel()
    await short.send(channel, {"type": "stale"})
    await layer.send(channel, {"type": "fresh"})
    assert (await asyncio.wait_for(layer.receive(channel), 5))["type"] == "fresh"


async def test_bad_input_is_refused(layer):
    with pytest.raises(TypeError):
        await layer.send("specific.x!y", ["not", "a", "dict"])
    with pytest.raises(TypeError):
        await layer.send("specific.x!y", {"type": "t", "bad": object()})
    with pytest.raises(TypeError):
        await layer.group_add("bad group name with spaces", "specific.x!y")


async def test_flush_drops_everything(layer):
    channel = await layer.new_channel()
    await layer.group_add("g", channel)
    await layer.send(channel, {"type": "t"})
    await layer.flush()
    assert await ChannelMessage.objects.acount() == 0


async def test_message_sent_by_another_process_is_received(layer):
    """Another OS process shares the layer through the database: what the embedded default needs."""
    channel = await layer.new_channel()
    await layer.group_add("job-42", channel)
    script = textwrap.dedent(
        """
        import django, os, sys
        os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
        django.setup()
        from django.conf import settings
        from django.db import connections
        settings.DATABASES["default"]["NAME"] = sys.argv[1]
        connections["default"].settings_dict["NAME"] = sys.argv[1]
        from asgiref.sync import async_to_sync
        from webapp.realtime.layers import DatabaseChannelLayer
        message = {"type": "from.pid", "pid": os.getpid()}
        async_to_sync(DatabaseChannelLayer().group_send)("job-42", message)
        """
    )
    from django.db import connection

    db_name = connection.settings_dict["NAME"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, db_name, cwd=settings.BASE_DIR
    )
    assert await asyncio.wait_for(proc.wait(), 60) == 0
    message = await asyncio.wait_for(layer.receive(channel), 10)
    assert message["type"] == "from.pid" and message["pid"] == proc.pid


async def test_no_message_is_lost_while_the_receiver_is_busy():
    """Found by review: a queue dropped between receives lost the messages claimed meanwhile."""
    layer = DatabaseChannelLayer(capacity=1000, poll_interval=0.005)
    channel = await layer.new_channel()
    rng = random.Random(7)

    async def sender():
        for n in range(40):
            await layer.send(channel, {"type": "t", "n": n})
            await asyncio.sleep(0.002)

    task = asyncio.create_task(sender())
    got = []
    while len(got) < 40:
        got.append((await asyncio.wait_for(layer.receive(channel), 10))["n"])
        await asyncio.sleep(rng.uniform(0, 0.02))  # a slow handler between receives
    await task
    assert got == list(range(40))


async def test_a_database_error_does_not_stop_delivery(monkeypatch):
    layer = DatabaseChannelLayer(poll_interval=0.01)
    real, calls = layer._claim, {"n": 0}

    def flaky(channels):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OperationalError("database is locked")
        return real(channels)

    monkeypatch.setattr(layer, "_claim", flaky)
    channel = await layer.new_channel()
    await layer.send(channel, {"type": "a"})
    assert (await asyncio.wait_for(layer.receive(channel), 5))["type"] == "a"
    await layer.send(channel, {"type": "b"})
    assert (await asyncio.wait_for(layer.receive(channel), 5))["type"] == "b"
    assert calls["n"] >= 3
