"""API latency under 50 concurrent clients, and event delivery latency to a websocket, on loopback.

Starts a real Daphne process (its own var dir and SQLite database, as `make demo` runs it) for
each channel layer: the embedded default (events kept in the database) and Redis when
`REDIS_URL` or 127.0.0.1:6379 answers.

- API: ``--clients`` threads (default 50), each with its own keep-alive-free HTTP connection per
  request, call ``GET /api/v1/jobs/`` and ``GET /api/v1/jobs/<id>/`` with a project token for
  ``--seconds``; latency percentiles and requests per second.
- Events: a separate process appends ``--events`` events to a job's log through the service, one
  every 20 ms, each carrying its wall-clock send time; a websocket client on ``/ws/jobs/<id>/``
  records when each arrives. Both processes share this machine's clock.

    python benchmarks/web_load.py [--clients 50] [--seconds 10] [--events 200]

Prints a table and writes benchmarks/results/web_load.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from websockets.sync.client import connect

from benchmarks import _report
from tests.support import live

SETUP = """
import json
from django.contrib.auth import get_user_model, SESSION_KEY, BACKEND_SESSION_KEY, HASH_SESSION_KEY
from django.contrib.sessions.backends.db import SessionStore
from webapp.projects import services
from tests.support.jobs import make_job
user = get_user_model().objects.create_user(username="bench", password="pw-bench-1234")
project = services.project_create(user=user, name="Bench", slug="bench")
_, token = services.token_create(user=user, project=project, name="load", role="operator")
job = make_job(owner=user, name="load", spec={}, project=project)
store = SessionStore()
store[SESSION_KEY] = str(user.pk)
store[BACKEND_SESSION_KEY] = "django.contrib.auth.backends.ModelBackend"
store[HASH_SESSION_KEY] = user.get_session_auth_hash()
store.save()
print(json.dumps({"token": token, "job": job.pk, "session": store.session_key}))
"""

PRODUCER = """
import time
from webapp.jobs.models import Job
from webapp.jobs.services import job_event_append
job = Job.objects.get(pk={job})
for i in range({count}):
    job_event_append(job=job, epoch=job.epoch, kind="bench", data={{"i": i, "sent_at": time.time()}})
    time.sleep(0.02)
print("{{}}")
"""


def percentiles(samples: list[float]) -> dict:
    ordered = sorted(samples)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3

    return {"n": len(ordered), "p50_ms": at(0.50), "p95_ms": at(0.95), "p99_ms": at(0.99)}


def api_load(base: str, token: str, job: int, clients: int, seconds: float) -> dict:
    latencies: list[float] = []
    errors = 0
    lock = threading.Lock()
    stop = time.monotonic() + seconds
    paths = ["/api/v1/jobs/", f"/api/v1/jobs/{job}/"]
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def client(index: int) -> None:
        nonlocal errors
        n = index
        while time.monotonic() < stop:
            request = urllib.request.Request(
                base + paths[n % 2], headers={"Authorization": f"Bearer {token}"}
            )
            started = time.perf_counter()
            try:
                with opener.open(request, timeout=30) as response:
                    response.read()
                    ok = response.status == 200
            except OSError:
                ok = False
            elapsed = time.perf_counter() - started
            with lock:
                if ok:
                    latencies.append(elapsed)
                else:
                    errors += 1
            n += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    began = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - began
    return {
        **percentiles(latencies),
        "errors": errors,
        "requests_per_s": len(latencies) / wall,
        "clients": clients,
    }


def event_delivery(base: str, env: dict, session: str, job: int, count: int) -> dict:
    url = base.replace("http://", "ws://") + f"/ws/jobs/{job}/?after=0"
    arrivals: list[float] = []
    with connect(
        url,
        origin=base,
        additional_headers={"Cookie": f"sessionid={session}"},
        proxy=None,
        open_timeout=30,
    ) as ws:
        producer = threading.Thread(
            target=live.django_shell, args=(env, PRODUCER.format(job=job, count=count))
        )
        producer.start()
        deadline = time.monotonic() + 60 + count * 0.1
        while len(arrivals) < count and time.monotonic() < deadline:
            frame = json.loads(ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            event = frame.get("event") or {}
            if frame.get("type") == "event" and event.get("kind") == "bench":
                arrivals.append(time.time() - event["data"]["sent_at"])
        producer.join()
    return {**percentiles(arrivals), "lost": count - len(arrivals)}


def redis_url() -> str | None:
    """Redis for the second run: ``REDIS_URL``, else database 15 on loopback if it answers."""
    url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/15"
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port or 6379), timeout=1):
            return url
    except OSError:
        return None


def run_layer(name: str, overrides: dict, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="nereus-web-load-") as tmp:
        env = live.service_env(Path(tmp), **overrides)
        live.manage(env, "migrate", "--no-input")
        made = live.django_shell(env, SETUP)
        with live.web_server(env, Path(tmp) / "logs") as base:
            api = api_load(base, made["token"], made["job"], args.clients, args.seconds)
            events = event_delivery(base, env, made["session"], made["job"], args.events)
    return {"layer": name, "api": api, "events": events}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--events", type=int, default=200)
    args = parser.parse_args()
    layers = [("embedded (database)", {"REDIS_URL": None})]
    redis = redis_url()
    if redis:
        layers.append(("redis", {"REDIS_URL": redis}))
    results = [run_layer(name, overrides, args) for name, overrides in layers]
    rows = []
    for r in results:
        a, e = r["api"], r["events"]
        rows.append(
            [
                r["layer"],
                f"{a['p50_ms']:.0f}/{a['p95_ms']:.0f}/{a['p99_ms']:.0f}",
                f"{a['requests_per_s']:.0f}",
                a["errors"],
                f"{e['p50_ms']:.0f}/{e['p95_ms']:.0f}/{e['p99_ms']:.0f}",
                e["lost"],
            ]
        )
    print(f"{args.clients} API clients for {args.seconds:.0f} s; {args.events} events at 50/s")
    _report.print_table(
        ["channel layer", "API p50/p95/p99 ms", "req/s", "errors", "event p50/p95/p99 ms", "lost"],
        rows,
    )
    path = _report.write("web_load", {"args": vars(args), "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
