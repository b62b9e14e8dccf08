"""The cluster topology, natively: the web server and a Celery worker against PostgreSQL and
Redis, a Ray head and two Ray workers in network namespaces, and a real PPO job submitted through
the REST API whose slots land on more than one Ray node and which completes.

The Celery worker is the job's driver. As in the deployments (docker/compose.yaml, the Kubernetes
worker), it runs on a machine of its own, which is not one of the slots' Ray nodes: a namespace of
its own on the cluster's bridge, and a PID namespace of its own, so that it sees no other node's
processes (Ray finds a driver's node among the processes of its machine). Its command is the
deployments': ``python -m nereus.ray_node``, which joins a node offering no CPU or GPU, then runs
the worker. It reaches PostgreSQL and Redis through relays on the root namespace's address on the
cluster's bridge (``tests/support/netns_service.py``). The web server stays on loopback in the
root namespace, and its start-up check reaches the Ray head through that bridge.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis

from nereus import processes
from tests.support.netns_service import root_gateway, tcp_forwarders
from tests.support.ray_netns import netns_ray_cluster
from tests.support.services import require

pytestmark = [pytest.mark.ray, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
REDIS_DB = 13  # a database of its own: another suite's Celery worker must not take this job
SPEC = {
    "kind": "ppo",
    "num_slots": 3,
    "max_slots": 3,
    "num_steps": 3,
    "batch_size": 16,
    "max_new_tokens": 8,
    "warmup_steps": 5,
}
TERMINAL = {"succeeded", "failed", "cancelled"}
DRIVER = 3  # the worker's namespace: the one after the head's and the two workers'


@pytest.fixture
def postgres_url() -> str:
    url = os.environ.get("DATABASE_URL", "")
    require(url.startswith(("postgres://", "postgresql://")), "DATABASE_URL is not PostgreSQL")
    return url


@pytest.fixture
def scratch_database(postgres_url):
    """A PostgreSQL database of this test's own, dropped afterwards; yields (host, port, url)."""
    parts = urlsplit(postgres_url)
    name = f"nereus_topology_{os.getpid()}"
    admin = parts._replace(path="/postgres").geturl()
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield parts, name
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _env(**values: str) -> dict[str, str]:
    drop = {
        "DATABASE_URL",
        "REDIS_URL",
        "RAY_ADDRESS",
        "MASTER_ADDR",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
        "GLOO_SOCKET_IFNAME",
    }
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(DJANGO_SETTINGS_MODULE="webapp.settings", PYTHONPATH=str(REPO), **values)
    return env


def _manage(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(REPO / "manage.py"), *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, f"manage.py {args[0]} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _http(method: str, url: str, *, token: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{method} {url}: {exc.code} {exc.read().decode()[:2000]}") from None


def _events(base: str, job_id: int, token: str) -> list[dict]:
    events, url = [], f"{base}/api/v1/jobs/{job_id}/events/?limit=500"
    while url:
        page = _http("GET", url, token=token)
        events += page["results"]
        url = page.get("next")
    return events


def test_a_ppo_job_submitted_through_the_api_runs_across_ray_nodes(
    scratch_database, redis_url, tmp_path
):
    pg, db_name = scratch_database
    redis = urlsplit(redis_url)
    var_dir = tmp_path / "var"
    logs = tmp_path / "logs"
    credentials = f"{pg.username or 'postgres'}" + (f":{pg.password}" if pg.password else "")
    common = {
        "NEREUS_VAR_DIR": str(var_dir),
        "NEREUS_SECRET_KEY": secrets.token_urlsafe(50),
        "NEREUS_STARTUP_WAIT_S": "30",
    }
    local = _env(
        DATABASE_URL=f"postgresql://{credentials}@127.0.0.1:{pg.port or 5432}/{db_name}",
        REDIS_URL=f"redis://127.0.0.1:{redis.port or 6379}/{REDIS_DB}",
        **common,
    )
    _manage(local, "migrate", "--noinput")
    made = _manage(
        local,
        "shell",
        "--no-imports",
        "-c",
        """
import json
from django.contrib.auth import get_user_model
from webapp.projects import services
user = get_user_model().objects.create_user(username="ops", password="pw-ops-12345678")
project = services.project_create(user=user, name="Cluster", slug="cluster")
_, secret = services.token_create(user=user, project=project, name="ci", role="operator")
print(json.dumps({"token": secret}))
""",
    )
    token = json.loads(made.strip().splitlines()[-1])["token"]
    broker = Redis.from_url(local["REDIS_URL"])
    broker.flushdb()  # nothing queued by an earlier run of this test
    broker.close()

    group = processes.ProcessGroup(log_dir=logs)
    ports = {pg.port or 5432: pg.port or 5432, 6379: redis.port or 6379}
    with (
        netns_ray_cluster(3, spare=1) as cluster,
        root_gateway(cluster) as gateway,
        tcp_forwarders(gateway, ports),
    ):
        try:
            worker_env = cluster.env(
                **common,
                DJANGO_SETTINGS_MODULE="webapp.settings",
                PYTHONPATH=str(REPO),
                DATABASE_URL=f"postgresql://{credentials}@{gateway}:{pg.port or 5432}/{db_name}",
                REDIS_URL=f"redis://{gateway}:6379/{REDIS_DB}",
                RAY_ADDRESS=cluster.ray_address,
                NEREUS_NODE_IP=cluster.address(DRIVER),
            )
            for key in ("MASTER_ADDR", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
                worker_env.pop(key, None)
            group.start(
                "celery",
                [
                    *("ip", "netns", "exec", cluster.namespace(DRIVER)),
                    *("unshare", "--pid", "--fork", "--mount-proc"),
                    *(sys.executable, "-m", "nereus.ray_node"),
                    *processes.celery_worker_argv(concurrency=1),
                ],
                env=worker_env,
                stop_signal=processes.CELERY_STOP_SIGNAL,
            )
            port = processes.free_port()
            web_env = {**local, "RAY_ADDRESS": cluster.ray_address}
            group.start("web", processes.asgi_server_argv(host="127.0.0.1", port=port), env=web_env)
            base = f"http://127.0.0.1:{port}"
            processes.wait_until(
                lambda: processes.http_ok(f"{base}/healthz"),
                timeout_s=90,
                what="web server",
                group=group,
            )
            health = json.loads(urllib.request.urlopen(f"{base}/healthz", timeout=10).read())
            assert health["checks"]["ray"]["ok"], health

            job = _http(
                "POST",
                f"{base}/api/v1/jobs/",
                token=token,
                body={"project": "cluster", "name": "topology", "spec": SPEC},
            )
            deadline = time.monotonic() + 240
            while job["state"] not in TERMINAL:
                group.check_alive()
                assert time.monotonic() < deadline, f"job still {job['state']}"
                time.sleep(1)
                job = _http("GET", f"{base}/api/v1/jobs/{job['id']}/", token=token)
            events = _events(base, job["id"], token)
            metrics = urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
        finally:
            left = group.stop(grace_s=15)  # before the relays and the cluster go
    logs_text = "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in logs.glob("*.log")
    )
    assert not left, f"processes left behind: {left}"
    assert job["state"] == "succeeded", f"{job}\n{logs_text}"

    kinds = [e["kind"] for e in events]
    ready = [e["data"] for e in events if e["kind"] == "slots.ready"]
    assert ready, kinds
    # The cluster's address, as the job's viewers see it (internal addresses are redacted).
    assert ready[0]["ray_address"] == f"<address>:{cluster.ray_address.rpartition(':')[2]}"
    assert ready[0]["nodes"] >= 2, ready
    assert ready[0]["num_slots"] == 3
    steps = [e["data"] for e in events if e["kind"] == "step.finished"]
    assert len(steps) == 3 and all(s["ok"] for s in steps), steps

    # The web process's /metrics counts what the worker in the namespace recorded.
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
    }
    assert samples[("nereus_steps_total", (("mode", "real"), ("ok", "true")))] == 3
    assert samples[("nereus_jobs", (("state", "succeeded"),))] == 1
