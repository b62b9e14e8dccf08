"""The web server the project ships (``processes.asgi_server_argv``: Daphne through
``nereus/asgi_server.py``) refuses an oversize body while it reads it, not after: a
``Content-Length`` over ``DATA_UPLOAD_MAX_MEMORY_SIZE`` is answered 413 from the headers alone,
a chunked body as soon as it passes the cap, and the connection is closed. Plain Daphne read the
whole body first, and never answered a length whose bytes did not come.

One real server process on loopback (SQLite, migrated), spoken to over raw sockets; the cap is
the real one (2.5 MB), so the chunked test sends that much.
"""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import time
from collections.abc import Iterator

import pytest
from django.conf import settings

from tests.support import live

JOBS = "/api/v1/jobs/"
KEY = "dGhlIHNhbXBsZSBub25jZQ=="  # RFC 6455's example handshake key
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
TIMEOUT_S = 10  # per socket operation: an answer that waits for a body never sent fails here


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[dict]:
    """The web server, with a user signed in and a job of theirs to watch over a websocket."""
    tmp = tmp_path_factory.mktemp("server-body-limit")
    env = live.service_env(tmp)
    live.manage(env, "migrate", "--no-input")
    made = live.django_shell(
        env,
        """
import json
from django.contrib.auth import get_user_model, SESSION_KEY, BACKEND_SESSION_KEY, HASH_SESSION_KEY
from django.contrib.sessions.backends.db import SessionStore
from tests.support.jobs import make_job
user = get_user_model().objects.create_user(username="alice", password="pw-alice-1234")
store = SessionStore()
store[SESSION_KEY] = str(user.pk)
store[BACKEND_SESSION_KEY] = "django.contrib.auth.backends.ModelBackend"
store[HASH_SESSION_KEY] = user.get_session_auth_hash()
store.save()
job = make_job(owner=user, name="watched", spec={})
print(json.dumps({"session": store.session_key, "job": job.pk}))
""",
    )
    with live.web_server(env, tmp / "logs") as url:
        yield {"url": url, "port": int(url.rsplit(":", 1)[1]), **made}


def _connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server["port"]), timeout=TIMEOUT_S)


def _head(method: str, path: str, *headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers["content-length"])
    assert len(body) == length, raw  # one response, whole, and nothing after it
    return int(status_line.split()[1]), headers, body


def _assert_too_large(raw: bytes) -> None:
    status, headers, body = _parse(raw)
    assert status == 413, raw
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    cap = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    error = json.loads(body)
    assert error["code"] == "too_large"
    assert error["message"] == f"body: the request body is over the limit of {cap} bytes"
    assert list(error["fields"]) == ["body"] and error["fields"]["body"], error


@pytest.mark.parametrize("expect_continue", [False, True], ids=["plain", "expect-100-continue"])
def test_a_content_length_over_the_cap_is_answered_from_the_headers(server, expect_continue):
    # Not one byte of the body is sent: the 413 can only come from the declared length.
    length = 50 * settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    extra = ["Expect: 100-continue"] if expect_continue else []
    with _connect(server) as sock:
        sock.sendall(
            _head(
                "POST",
                JOBS,
                "Content-Type: application/json",
                f"Content-Length: {length}",
                *extra,
            )
        )
        raw = _read_until_closed(sock)
    # A client that asked to be told before sending gets the refusal, not "100 Continue".
    _assert_too_large(raw)


def test_a_client_that_reads_only_after_uploading_still_gets_the_413(server):
    """Found by review: the server closed a refused connection a fixed half second after its 413,
    and a client still uploading then had unread data reset away. It now waits while the client
    sends (dropping what comes), so the 413 is there to read once the upload is done."""
    from nereus.asgi_server import LINGER_S

    piece = b"x" * 16384
    with _connect(server) as sock:
        sock.sendall(
            _head("POST", JOBS, "Content-Type: application/json", "Content-Length: 10000000")
        )
        deadline = time.monotonic() + 3 * LINGER_S  # sending for longer than one linger
        while time.monotonic() < deadline:
            sock.sendall(piece)
            time.sleep(LINGER_S / 10)
        _assert_too_large(_read_until_closed(sock))


def test_an_absurd_content_length_is_answered_not_awaited(server):
    with _connect(server) as sock:
        sock.sendall(
            _head("POST", JOBS, "Content-Type: application/json", f"Content-Length: {10**23}")
        )
        _assert_too_large(_read_until_closed(sock))


def test_a_chunked_body_is_refused_once_past_the_cap_before_its_end(server):
    cap = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    piece = b"x" * 65536
    with _connect(server) as sock:
        sock.sendall(
            _head("POST", JOBS, "Content-Type: application/json", "Transfer-Encoding: chunked")
        )
        sent = 0
        while sent <= cap:
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            sent += len(piece)
        # The body never ends (no last chunk): the answer comes from what was counted, and the
        # server closes the connection after it.
        _assert_too_large(_read_until_closed(sock))


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_small_request_is_served_as_before(server, framing):
    body = json.dumps({"name": "small", "spec": {}}).encode()
    if framing == "chunked":
        headers, payload = (
            ["Transfer-Encoding: chunked"],
            b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body),
        )
    else:
        headers, payload = [f"Content-Length: {len(body)}"], body
    with _connect(server) as sock:
        sock.sendall(
            _head("POST", JOBS, "Content-Type: application/json", "Connection: close", *headers)
            + payload
        )
        status, _, answer = _parse(_read_until_closed(sock))
    # Read whole and handed to the API, which wants credentials.
    assert status == 401, answer
    assert json.loads(answer)["code"] == "not_authenticated"


def test_health_is_served(server):
    with _connect(server) as sock:
        sock.sendall(_head("GET", "/healthz", "Connection: close"))
        status, _, answer = _parse(_read_until_closed(sock))
    assert status == 200, answer


def test_a_websocket_handshake_still_upgrades(server):
    origin = server["url"]
    with _connect(server) as sock:
        sock.sendall(
            _head(
                "GET",
                f"/ws/jobs/{server['job']}/",
                "Upgrade: websocket",
                "Connection: Upgrade",
                f"Sec-WebSocket-Key: {KEY}",
                "Sec-WebSocket-Version: 13",
                f"Origin: {origin}",
                f"Cookie: sessionid={server['session']}",
            )
        )
        raw = b""
        while b"\r\n\r\n" not in raw:
            chunk = sock.recv(4096)
            assert chunk, raw
            raw += chunk
    assert raw.startswith(b"HTTP/1.1 101 "), raw
    accept = base64.b64encode(hashlib.sha1((KEY + WS_GUID).encode()).digest())
    assert b"\r\nsec-websocket-accept: " + accept.lower() + b"\r\n" in raw.lower(), raw
