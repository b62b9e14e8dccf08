"""The event path across real processes: a worker process writes, a browser-like websocket client
of the web process receives. Run for the embedded default (no Redis: filesystem broker, database
channel layer) and for Redis; each service runs in its own OS process on loopback."""

from __future__ import annotations

import json
import time
from urllib.parse import urlsplit

import pytest
import redis
from websockets.sync.client import connect

from tests.support import live

TEST_REDIS_DB = 15  # the suite's own Redis database, flushed before each use


@pytest.fixture(params=["embedded", "redis"])
def env(request, tmp_path):
    """A migrated service environment with a user, a session and a pending job."""
    overrides: dict[str, str | None] = {}
    if request.param == "redis":
        base = request.getfixturevalue("redis_url")
        parts = urlsplit(base)
        url = f"{parts.scheme}://{parts.netloc}/{TEST_REDIS_DB}"
        redis.Redis.from_url(url).flushdb()
        overrides["REDIS_URL"] = url
    service_env = live.service_env(tmp_path, **overrides)
    live.manage(service_env, "migrate", "--no-input")
    service_env["_SESSION"] = live.create_user_session(service_env)["session"]
    return service_env


def _websocket(base_url: str, job_id: int, session: str, after: int = 0):
    ws_url = base_url.replace("http://", "ws://") + f"/ws/jobs/{job_id}/?after={after}"
    return connect(
        ws_url,
        origin=base_url,
        additional_headers={"Cookie": f"sessionid={session}"},
        proxy=None,
        open_timeout=30,
    )


def _events_until(ws, predicate, *, timeout_s: float) -> list[dict]:
    events, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        frame = json.loads(ws.recv(timeout=max(0.1, deadline - time.monotonic())))
        assert frame["type"] == "event", frame
        events.append(frame["event"])
        if predicate(frame["event"]):
            return events
    raise AssertionError(
        f"condition not met within {timeout_s} s; got {[e['kind'] for e in events]}"
    )


def test_event_written_by_another_process_reaches_the_websocket(env, tmp_path, request):
    job_id = live.django_shell(
        env,
        """
import json
from django.contrib.auth import get_user_model
from tests.support.jobs import make_job
job = make_job(owner=get_user_model().objects.get(username="alice"), name="x", spec={})
print(json.dumps(job.pk))
""",
    )
    with (
        live.web_server(env, tmp_path / "logs") as url,
        _websocket(url, job_id, env["_SESSION"]) as ws,
    ):
        if "REDIS_URL" in env:
            # Idle longer than redis-py 8's default 5 s read timeout, which used to drop the socket.
            time.sleep(6)
        # A separate worker process appends three events, each in its own transaction.
        live.django_shell(
            env,
            f"""
import json
from webapp.jobs import services
from webapp.jobs.models import Job
job = Job.objects.get(pk={job_id})
for n in range(3):
    services.job_event_append(job=job, epoch=0, kind="probe", data={{"n": n}})
print(json.dumps(True))
""",
        )
        events = _events_until(ws, lambda e: e["data"].get("n") == 2, timeout_s=30)
    assert [e["data"]["n"] for e in events] == [0, 1, 2]
    assert events[0]["id"] < events[1]["id"] < events[2]["id"]
    # A client that reconnects with the id it has gets the rest from the log: nothing is lost.
    with (
        live.web_server(env, tmp_path / "logs2") as url,
        _websocket(url, job_id, env["_SESSION"], after=events[0]["id"]) as ws,
    ):
        rest = _events_until(ws, lambda e: e["data"].get("n") == 2, timeout_s=30)
    assert [e["id"] for e in rest] == [events[1]["id"], events[2]["id"]]


@pytest.mark.ray
def test_celery_worker_drives_a_real_job_and_the_websocket_sees_it(env, tmp_path):
    """Submit through the service; a Celery worker process runs the driver on a local Ray instance
    with two CPU slots (gloo); every step reaches the websocket client of the web process."""
    num_steps = 4
    with (
        live.web_server(env, tmp_path / "web") as url,
        live.celery_worker(env, tmp_path / "celery"),
    ):
        job_id = live.django_shell(
            env,
            f"""
import json
from django.contrib.auth import get_user_model
from webapp.jobs import services
job = services.job_submit(user=get_user_model().objects.get(username="alice"), name="e2e",
                          spec={{"num_slots": 2, "num_steps": {num_steps}}})
print(json.dumps(job.pk))
""",
        )
        with _websocket(url, job_id, env["_SESSION"]) as ws:
            events = _events_until(
                ws,
                lambda e: (
                    e["kind"] == "job.state" and e["data"]["state"] in {"succeeded", "failed"}
                ),
                timeout_s=240,
            )
    kinds = [e["kind"] for e in events]
    final = live.django_shell(
        env,
        f"""
import json
from webapp.jobs.models import Job
job = Job.objects.get(pk={job_id})
print(json.dumps({{"state": job.state, "detail": job.failure_detail, "epoch": job.epoch}}))
""",
    )
    assert final["state"] == "succeeded", final
    assert final["epoch"] == 1
    assert kinds.count("step.finished") == num_steps
    ready = next(e for e in events if e["kind"] == "slots.ready")["data"]
    assert ready["backend"] == "gloo" and ready["num_slots"] == 2
    assert next(e for e in events if e["kind"] == "replicas.verified")["data"]["identical"] is True
    ids = [e["id"] for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
