"""In production (``NEREUS_PRODUCTION=1``, ``ALLOWED_HOSTS`` the public name, HTTPS redirect),
``/healthz`` and ``/metrics`` answer the callers that name the pod by its address: the kubelet's
probe (the pod IP), the container ``HEALTHCHECK`` (127.0.0.1) and Prometheus' pod scrape, over
plain HTTP. Every other path still refuses such a Host."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.deploy.test_startup import GOOD_KEY, REPO, _env

SCRIPT = """
import json, django
django.setup()
from django.test import Client
client = Client()
out = {}
for name, path, host in [
    ("health_pod_ip", "/healthz", "10.1.2.3:8000"),
    ("health_loopback", "/healthz", "127.0.0.1:8000"),
    ("metrics_pod_ip", "/metrics", "10.1.2.3:8000"),
    ("metrics_public_http", "/metrics", "nereus.example.com"),
    ("login_pod_ip", "/login/", "10.1.2.3:8000"),
    ("login_public_http", "/login/", "nereus.example.com"),
]:
    response = client.get(path, HTTP_HOST=host)
    out[name] = {"status": response.status_code, "body": response.content[:2000].decode()}
print(json.dumps(out))
"""


def _probe(tmp_path, **values: str) -> dict:
    env = _env(
        tmp_path,
        NEREUS_PRODUCTION="1",
        NEREUS_ALLOWED_HOSTS="nereus.example.com",
        NEREUS_SECRET_KEY=GOOD_KEY,
        **values,
    )
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_probes_answer_by_address_over_http_in_production_and_pages_do_not(tmp_path):
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "-v", "0"],
        env=_env(tmp_path, NEREUS_SECRET_KEY=GOOD_KEY),
        cwd=REPO,
        check=True,
        timeout=300,
    )
    out = _probe(tmp_path)
    for name in ("health_pod_ip", "health_loopback"):
        assert out[name]["status"] == 200, out[name]
        body = json.loads(out[name]["body"])
        assert body["status"] == "ok" and body["checks"]["database"]["ok"] is True
        assert all("detail" not in check for check in body["checks"].values())  # anonymous
    assert out["metrics_pod_ip"]["status"] == 200
    assert "nereus_http_request_duration_seconds" in out["metrics_pod_ip"]["body"]
    assert out["metrics_public_http"]["status"] == 200  # not redirected to https
    # Pages keep production's rules: an unknown Host is refused, plain HTTP redirected.
    assert out["login_pod_ip"]["status"] == 400
    assert out["login_public_http"]["status"] == 301


def test_the_metrics_token_is_still_required_from_a_pod_address(tmp_path):
    out = _probe(tmp_path, NEREUS_METRICS_TOKEN="t" * 32)
    assert out["metrics_pod_ip"]["status"] == 401
    assert out["metrics_public_http"]["status"] == 401
