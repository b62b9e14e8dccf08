"""GET /healthz: 200 when every dependency the configuration needs answers, 503 naming the rest.
Anyone sees which checks pass; only staff (or the metrics token's bearer) see the details."""

import dataclasses
import json
import urllib.error
import urllib.request

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import OperationalError
from django.test import Client, override_settings

from nereus.processes import free_port
from tests.support import live
from webapp import health


def _closed_port() -> int:
    return free_port()  # bound and released: nothing listens there


METRICS_TOKEN = "health-test-token"


def _get(url: str, token: str | None = METRICS_TOKEN) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=30
        ) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


@pytest.fixture
def staff_client(db) -> Client:
    """A client signed in as a staff user: the one kind of session that sees the details."""
    staff = get_user_model().objects.create_user(username="ops", password="pw-ops-12345")
    staff.is_staff = True
    staff.save()
    client = Client()
    client.force_login(staff)
    return client


@pytest.mark.django_db
def test_healthy_configuration_answers_200(client):
    response = client.get("/healthz")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok" and body["down"] == []
    assert set(body["checks"]) == {"database", "broker", "channel_layer", "ray"}
    assert all(check["ok"] for check in body["checks"].values())


@pytest.mark.django_db
def test_unreachable_redis_names_broker_and_channel_layer(staff_client):
    dead = f"redis://127.0.0.1:{_closed_port()}/0"
    cfg = dataclasses.replace(settings.CONFIG, redis_url=dead)
    layers = {
        "default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [dead]}}
    }
    with override_settings(CONFIG=cfg, CELERY_BROKER_URL=dead, CHANNEL_LAYERS=layers):
        response = staff_client.get("/healthz")
    assert response.status_code == 503
    body = response.json()
    assert body["down"] == ["broker", "channel_layer"]
    assert body["checks"]["database"]["ok"]
    assert "redis" in body["checks"]["broker"]["detail"]


@pytest.mark.django_db
def test_unreachable_ray_cluster_is_named(client):
    with override_settings(NEREUS_RAY_ADDRESS=f"127.0.0.1:{_closed_port()}"):
        response = client.get("/healthz")
    assert response.status_code == 503
    assert response.json()["down"] == ["ray"]


@pytest.mark.django_db
def test_local_ray_is_not_required(staff_client):
    with override_settings(NEREUS_RAY_ADDRESS=None):
        body = staff_client.get("/healthz").json()
    assert body["checks"]["ray"] == {
        "ok": True,
        "required": False,
        "detail": "local instance, started by each job driver",
    }


@pytest.mark.django_db
def test_missing_embedded_broker_queue_is_named(client, tmp_path):
    options = {**settings.CELERY_BROKER_TRANSPORT_OPTIONS, "data_folder_in": str(tmp_path / "gone")}
    cfg = dataclasses.replace(settings.CONFIG, redis_url=None)
    with override_settings(CONFIG=cfg, CELERY_BROKER_TRANSPORT_OPTIONS=options):
        response = client.get("/healthz")
    assert response.status_code == 503
    assert response.json()["down"] == ["broker"]


def test_web_process_with_unreachable_database_answers_503(tmp_path):
    """A real server process whose DATABASE_URL points at a port where no PostgreSQL listens."""
    env = live.service_env(
        tmp_path,
        DATABASE_URL=f"postgresql://nobody@127.0.0.1:{_closed_port()}/x",
        NEREUS_METRICS_TOKEN=METRICS_TOKEN,
    )
    with live.web_server(env, tmp_path / "logs") as url:
        status, body = _get(f"{url}/healthz")
    assert status == 503
    assert "database" in body["down"]
    assert body["checks"]["database"]["detail"].startswith("postgresql:")


def test_web_process_without_migrations_reports_the_channel_layer(tmp_path):
    """The embedded channel layer lives in the database: an unmigrated database cannot carry it."""
    env = live.service_env(tmp_path, NEREUS_METRICS_TOKEN=METRICS_TOKEN)
    with live.web_server(env, tmp_path / "logs") as url:
        status, body = _get(f"{url}/healthz")
    assert status == 503
    assert body["down"] == ["channel_layer"]
    assert body["checks"]["database"]["ok"]


def test_web_process_embedded_default_is_healthy(tmp_path):
    env = live.service_env(tmp_path, NEREUS_METRICS_TOKEN=METRICS_TOKEN)
    live.manage(env, "migrate", "--no-input")
    with live.web_server(env, tmp_path / "logs") as url:
        status, body = _get(f"{url}/healthz")
        anonymous_status, anonymous = _get(f"{url}/healthz", token=None)
        wrong_status, wrong = _get(f"{url}/healthz", token="not-the-token")
    assert status == 200, body
    assert body["checks"]["broker"]["detail"].startswith("filesystem queue")
    assert body["checks"]["channel_layer"]["detail"] == "database layer"
    # without the token: the same verdict, no details
    assert (anonymous_status, wrong_status) == (200, 200)
    for answer in (anonymous, wrong):
        assert answer["status"] == "ok" and answer["down"] == []
        assert all(set(c) == {"ok", "required"} for c in answer["checks"].values()), answer


@pytest.mark.django_db
def test_anonymous_callers_get_no_details(client, monkeypatch, caplog):
    """Paths, the Ray head's address and a driver's error (host, user) are for staff and the log."""
    error = 'connection to server at "db.internal" (10.1.2.3) failed for user "nereus_prod"'

    class Broken:
        def cursor(self):
            raise OperationalError(error)

    monkeypatch.setattr(health, "connections", {"default": Broken()})
    with (
        override_settings(NEREUS_RAY_ADDRESS=f"10.9.8.7:{_closed_port()}"),
        caplog.at_level("WARNING", logger="webapp.health"),
    ):
        response = client.get("/healthz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unavailable" and "database" in body["down"]
    assert body["checks"]["database"] == {"ok": False, "required": True}
    assert all(set(c) == {"ok", "required"} for c in body["checks"].values()), body
    text = response.content.decode()
    for secret in ("10.1.2.3", "nereus_prod", "10.9.8.7", str(settings.CELERY_BROKER_DIR)):
        assert secret not in text
    assert "10.1.2.3" in caplog.text  # the operator still finds the cause in the log


@pytest.mark.django_db
def test_staff_and_metrics_token_see_details(staff_client, client, make_user, monkeypatch):
    with override_settings(NEREUS_RAY_ADDRESS=None):
        staff_body = staff_client.get("/healthz").json()
        plain = make_user("plain")
        client.force_login(plain)  # signed in, not staff: no details
        plain_body = client.get("/healthz").json()
        client.logout()
        monkeypatch.setenv("NEREUS_METRICS_TOKEN", METRICS_TOKEN)
        token_body = client.get("/healthz", HTTP_AUTHORIZATION=f"Bearer {METRICS_TOKEN}").json()
        wrong_body = client.get("/healthz", HTTP_AUTHORIZATION="Bearer guess").json()
    for body in (staff_body, token_body):
        # The broker the run is configured with: Redis in CI, the filesystem queue without it.
        assert body["checks"]["broker"]["detail"].startswith(("filesystem queue", "redis"))
        assert body["checks"]["ray"]["detail"] == "local instance, started by each job driver"
    for body in (plain_body, wrong_body):
        assert all("detail" not in c for c in body["checks"].values()), body


def test_test_run_keeps_var_files_out_of_the_checkout():
    assert settings.VAR_DIR != live.REPO / "var"
