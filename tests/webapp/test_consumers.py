"""The job events websocket, in process: authentication, authorisation, backlog and live events,
bad messages. Runs on the channel layer the settings choose (the database layer by default, Redis
when REDIS_URL is set, as in CI)."""

import asyncio

import pytest
from asgiref.sync import sync_to_async
from channels.auth import AuthMiddlewareStack
from channels.layers import get_channel_layer
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.contrib.auth import get_user_model
from django.utils import timezone

from tests.support.jobs import make_job
from tests.support.websockets import session_for
from webapp.jobs import services
from webapp.jobs.consumers import CLOSE_NOT_FOUND, CLOSE_UNAUTHENTICATED
from webapp.jobs.models import JobEvent
from webapp.jobs.routing import websocket_urlpatterns

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]

APP = AuthMiddlewareStack(URLRouter(websocket_urlpatterns))


@sync_to_async
def _setup():
    users = get_user_model()
    alice = users.objects.create_user(username="alice", password="pw-alice-1234")
    bob = users.objects.create_user(username="bob", password="pw-bob-1234")
    job = make_job(owner=alice)
    return job, session_for(alice), session_for(bob)


@sync_to_async
def _append(job, kind, **data):
    return services.job_event_append(job=job, epoch=job.epoch, kind=kind, data=data).pk


def _communicator(job_id, session=None, after=None):
    path = f"/ws/jobs/{job_id}/" + (f"?after={after}" if after is not None else "")
    headers = [(b"cookie", f"{settings.SESSION_COOKIE_NAME}={session}".encode())] if session else []
    return WebsocketCommunicator(APP, path, headers=headers)


async def test_anonymous_clients_are_refused():
    job, _, _ = await _setup()
    ws = _communicator(job.pk)
    connected, code = await ws.connect()
    assert not connected and code == CLOSE_UNAUTHENTICATED


async def test_other_users_job_is_not_found():
    job, _, bob_session = await _setup()
    ws = _communicator(job.pk, bob_session)
    connected, code = await ws.connect()
    assert not connected and code == CLOSE_NOT_FOUND


async def test_backlog_then_live_events_in_order_without_duplicates():
    job, session, _ = await _setup()
    first = await _append(job, "a", n=1)
    await _append(job, "b", n=2)
    ws = _communicator(job.pk, session, after=first)
    assert (await ws.connect())[0]
    backlog = await ws.receive_json_from(timeout=5)
    assert backlog["event"]["kind"] == "b"  # only what came after the id the client had
    live_id = await _append(job, "c", n=3)
    live = await ws.receive_json_from(timeout=5)
    assert (live["type"], live["event"]["id"], live["event"]["data"]) == (
        "event",
        live_id,
        {"n": 3},
    )
    # resume from the start: everything again, in order, then nothing more
    await ws.send_json_to({"type": "resume", "after": 0})
    again = [(await ws.receive_json_from(timeout=5))["event"]["kind"] for _ in range(3)]
    assert again == ["a", "b", "c"]
    assert await ws.receive_nothing(timeout=0.3)
    await ws.disconnect()


async def test_malformed_messages_get_an_error_frame_and_the_socket_stays_open():
    job, session, _ = await _setup()
    ws = _communicator(job.pk, session)
    assert (await ws.connect())[0]
    await ws.send_to(text_data="{not json")
    assert (await ws.receive_json_from(timeout=5))["code"] == "bad_json"
    await ws.send_to(text_data="[" * 100_000 + "]" * 100_000)  # the decoder's RecursionError
    assert (await ws.receive_json_from(timeout=5))["code"] == "bad_json"
    await ws.send_json_to({"type": "dance"})
    assert (await ws.receive_json_from(timeout=5))["message"] == "type: expected 'resume'"
    await ws.send_to(text_data='{"type": "resume", "after": 0, "after": 99}')  # which one?
    repeated = await ws.receive_json_from(timeout=5)
    assert repeated["code"] == "bad_message" and "'after' is given twice" in repeated["message"]
    await ws.send_json_to({"type": "resume", "after": "yesterday"})
    error = await ws.receive_json_from(timeout=5)
    assert error["code"] == "bad_after" and error["message"].startswith("after:")
    for bad in (-4, 1e999, True, 3.9, 2**64, "-1", "١٢", "9" * 5000):  # the last: was bad_json
        await ws.send_json_to({"type": "resume", "after": bad})
        assert (await ws.receive_json_from(timeout=5))["code"] == "bad_after", bad
    event_id = await _append(job, "still.open")
    assert (await ws.receive_json_from(timeout=5))["event"]["id"] == event_id
    await ws.disconnect()


@pytest.mark.parametrize("after", ["x", "9" * 5000])  # the second killed the consumer
async def test_bad_after_in_the_url_is_reported_and_streams_from_the_start(after):
    job, session, _ = await _setup()
    await _append(job, "a")
    ws = WebsocketCommunicator(
        APP,
        f"/ws/jobs/{job.pk}/?after={after}",
        headers=[(b"cookie", f"{settings.SESSION_COOKIE_NAME}={session}".encode())],
    )
    assert (await ws.connect())[0]
    assert (await ws.receive_json_from(timeout=5))["code"] == "bad_after"
    assert (await ws.receive_json_from(timeout=5))["event"]["kind"] == "a"
    await asyncio.sleep(0)
    await ws.disconnect()


async def test_an_event_that_overtakes_an_earlier_one_does_not_hide_it():
    """Live messages may arrive out of order; the consumer reads the log, so none is skipped."""
    job, session, _ = await _setup()
    ws = _communicator(job.pk, session)
    assert (await ws.connect())[0]
    first = await sync_to_async(
        lambda: JobEvent.objects.create(job=job, epoch=0, kind="a", data={}, at=timezone.now())
    )()
    second = await sync_to_async(
        lambda: JobEvent.objects.create(job=job, epoch=0, kind="b", data={}, at=timezone.now())
    )()
    layer = get_channel_layer()
    await layer.group_send(job.group_name, {"type": "job.event", "event": second.as_message()})
    got = [(await ws.receive_json_from(timeout=5))["event"]["id"] for _ in range(2)]
    await layer.group_send(job.group_name, {"type": "job.event", "event": first.as_message()})
    assert got == [first.pk, second.pk]
    assert await ws.receive_nothing(timeout=0.3)
    await ws.disconnect()


async def test_a_socket_open_longer_than_the_layer_s_group_expiry_still_gets_live_events(
    monkeypatch,
):
    """The layer forgets a group member after ``group_expiry`` (a day by default; 2 s here): a
    page watching a job for days must keep getting its events."""
    monkeypatch.setattr(get_channel_layer(), "group_expiry", 2)
    job, session, _ = await _setup()
    ws = _communicator(job.pk, session)
    assert (await ws.connect())[0]
    await asyncio.sleep(3.5)  # past the expiry of the membership made at connect
    live_id = await _append(job, "late", n=1)
    live = await ws.receive_json_from(timeout=5)
    assert live["event"]["id"] == live_id
    await ws.disconnect()
