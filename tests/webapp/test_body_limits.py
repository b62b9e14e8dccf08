"""What a client may send is bounded: an HTTP body over ``DATA_UPLOAD_MAX_MEMORY_SIZE`` gets a 413
naming ``body`` (through the ASGI application Daphne serves, and through the API's parser on any
other path), a malformed ``Content-Length`` a 400, and a websocket message over
``NEREUS_WS_MAX_MESSAGE_BYTES`` closes the socket. Caps are set small so that tests send kilobytes.
"""

from __future__ import annotations

import json

import pytest
from asgiref.sync import sync_to_async
from asgiref.testing import ApplicationCommunicator
from channels.testing import WebsocketCommunicator

from tests.support.jobs import make_job
from tests.support.websockets import closed_with
from webapp.asgi import application
from webapp.jobs import services
from webapp.jobs.models import Job
from webapp.limits import CLOSE_TOO_LARGE
from webapp.projects.models import Role

JOBS = "/api/v1/jobs/"
CAP = 2_000
# A job the API accepts (201); padded past the cap with whitespace, it is still one, so a 413 can
# only come from the size.
SUBMIT = {"project": "ml", "name": "big", "spec": {"num_slots": 2, "num_steps": 5}}


def _padded(size: int) -> bytes:
    body = json.dumps(SUBMIT).encode()
    return body + b" " * (size - len(body))


def _error(body: bytes) -> dict:
    error = json.loads(body)
    assert set(error) == {"code", "message", "fields"}, error
    return error


def _assert_too_large(status: int, body: bytes, cap: int = CAP) -> None:
    assert status == 413, body
    error = _error(body)
    assert error["code"] == "too_large"
    assert error["message"] == f"body: the request body is over the limit of {cap} bytes"
    assert list(error["fields"]) == ["body"] and error["fields"]["body"], error


# --- HTTP, through the ASGI application -------------------------------------------------------


def _http(path: str, headers: list[tuple[bytes, bytes]]) -> ApplicationCommunicator:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"testserver"), *headers],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }
    return ApplicationCommunicator(application, scope)


async def _response(app: ApplicationCommunicator) -> tuple[int, bytes]:
    """The one response: its status and whole body; nothing may follow it."""
    start = await app.receive_output(timeout=10)
    assert start["type"] == "http.response.start", start
    body = b""
    while True:
        part = await app.receive_output(timeout=10)
        assert part["type"] == "http.response.body", part
        body += part.get("body", b"")
        if not part.get("more_body", False):
            break
    return start["status"], body


def _json_headers(secret: str, length: int | bytes | None) -> list[tuple[bytes, bytes]]:
    headers = [
        (b"content-type", b"application/json"),
        (b"authorization", f"Bearer {secret}".encode()),
    ]
    if length is not None:
        value = length if isinstance(length, bytes) else str(length).encode()
        headers.append((b"content-length", value))
    return headers


@pytest.fixture
def operator_secret(project, token_for):
    return token_for(project, Role.OPERATOR)


@pytest.fixture
def small_cap(settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = CAP


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_a_content_length_over_the_cap_is_refused_before_any_of_the_body_is_read(
    small_cap, operator_secret
):
    # No body is ever sent: the answer can only come from the declared length, and the Django
    # handler, which waits for the body before anything else, was never reached.
    app = _http(JOBS, _json_headers(operator_secret, 10**9))
    status, body = await _response(app)
    _assert_too_large(status, body)
    await app.wait(timeout=5)
    assert await app.receive_nothing(timeout=0.1)
    assert await sync_to_async(Job.objects.count)() == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_a_chunked_body_is_refused_once_it_passes_the_cap_with_one_response(
    small_cap, operator_secret
):
    app = _http(JOBS, _json_headers(operator_secret, None))
    body = _padded(4 * CAP)
    chunk = CAP // 2
    # Up to the cap: the application is still reading, nothing is answered.
    for at in range(0, CAP, chunk):
        await app.send_input(
            {"type": "http.request", "body": body[at : at + chunk], "more_body": True}
        )
    assert await app.receive_nothing(timeout=0.2)
    # One chunk past it: a 413 while the client is still sending, its last chunk never awaited.
    await app.send_input(
        {"type": "http.request", "body": body[CAP : CAP + chunk], "more_body": True}
    )
    status, answer = await _response(app)
    _assert_too_large(status, answer)
    await app.wait(timeout=5)  # the application gave up the request...
    assert await app.receive_nothing(timeout=0.1)  # ...and answered nothing of its own
    assert await sync_to_async(Job.objects.count)() == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_a_body_under_the_cap_is_served(
    small_cap, operator_secret, enqueued, no_live_delivery
):
    body = _padded(CAP)  # at the cap exactly: allowed
    app = _http(JOBS, _json_headers(operator_secret, len(body)))
    await app.send_input({"type": "http.request", "body": body[:100], "more_body": True})
    await app.send_input({"type": "http.request", "body": body[100:], "more_body": False})
    status, answer = await _response(app)
    assert status == 201, answer
    assert json.loads(answer)["name"] == "big"
    assert await sync_to_async(Job.objects.count)() == 1
    await app.send_input({"type": "http.disconnect"})
    await app.wait(timeout=5)


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
@pytest.mark.parametrize("length", [b"abc", b"-1", b"12.5", b"", b"9" * 30, b"10, 20"])
async def test_a_malformed_content_length_is_a_400_naming_it(small_cap, operator_secret, length):
    app = _http(JOBS, _json_headers(operator_secret, length))
    status, body = await _response(app)
    assert status == 400, body
    error = _error(body)
    assert error["code"] == "invalid"
    assert error["message"].startswith("Content-Length: ")
    assert list(error["fields"]) == ["Content-Length"], error
    await app.wait(timeout=5)
    assert await sync_to_async(Job.objects.count)() == 0


# --- HTTP, through the API's parser (WSGI, the test client: no ASGI middleware) ----------------


@pytest.mark.django_db
def test_the_parser_refuses_a_body_over_the_cap_with_a_413(settings, api, operator_secret):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = CAP
    client = api(secret=operator_secret)
    response = client.post(JOBS, _padded(CAP + 1), content_type="application/json")
    _assert_too_large(response.status_code, response.content)
    assert Job.objects.count() == 0


@pytest.mark.django_db
def test_the_parser_takes_a_body_at_the_cap(settings, api, operator_secret, enqueued):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = CAP
    client = api(secret=operator_secret)
    response = client.post(JOBS, _padded(CAP), content_type="application/json")
    assert response.status_code == 201, response.content
    assert Job.objects.count() == 1


# --- websocket, through the ASGI application --------------------------------------------------


@sync_to_async
def _watched_job(member, project):
    from webapp.projects import services as project_services

    admin = member(project, Role.ADMIN, "ws-admin")
    job = make_job(owner=admin, project=project)
    services.job_event_append(job=job, epoch=job.epoch, kind="step.finished", data={"step": 0})
    _, secret = project_services.token_create(
        user=admin, project=project, name="ws", role=Role.VIEWER
    )
    return job, secret


async def _socket(member, project):
    job, secret = await _watched_job(member, project)
    ws = WebsocketCommunicator(
        application,
        f"/ws/jobs/{job.pk}/",
        headers=[
            (b"host", b"localhost"),
            (b"origin", b"http://localhost"),
            (b"authorization", f"Bearer {secret}".encode()),
        ],
    )
    connected, code = await ws.connect()
    assert connected, code
    assert (await ws.receive_json_from(timeout=5))["event"]["kind"] == "step.finished"
    return ws


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
@pytest.mark.parametrize("frame", ["text", "bytes"])
async def test_a_websocket_message_over_the_cap_closes_the_socket(settings, member, project, frame):
    settings.NEREUS_WS_MAX_MESSAGE_BYTES = 1024
    ws = await _socket(member, project)
    # A resume the consumer would answer, but too long.
    # Under the cap in characters, over it in bytes of UTF-8: the cap is on bytes.
    message = json.dumps({"type": "resume", "after": 0, "pad": "é" * 600}, ensure_ascii=False)
    assert len(message) < 1024 < len(message.encode())
    if frame == "text":
        await ws.send_to(text_data=message)
    else:
        await ws.send_to(bytes_data=message.encode())
    assert await closed_with(ws) == CLOSE_TOO_LARGE
    await ws.wait(timeout=5)  # the consumer saw the disconnect and ended


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_a_small_resume_message_is_still_answered(settings, member, project):
    settings.NEREUS_WS_MAX_MESSAGE_BYTES = 1024
    ws = await _socket(member, project)
    await ws.send_json_to({"type": "resume", "after": 0})
    again = await ws.receive_json_from(timeout=5)
    assert again["type"] == "event" and again["event"]["kind"] == "step.finished"
    await ws.disconnect()
