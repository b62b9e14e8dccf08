"""GET /healthz: 200 when every dependency the configuration needs answers, 503 naming the rest."""

import dataclasses
import json
import urllib.error
import urllib.request

import pytest
from django.conf import settings
from django.test import override_settings

from nereus.processes import free_port
from tests.support import live


def _closed_port() -> int:
    return free_port()  # bound and released: nothing listens there


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


@pytest.mark.django_db
def test_healthy_configuration_answers_200(client):
    response = client.get("/healthz")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok" and body["down"] == []
    assert set(body["checks"]) == {"database", "broker", "channel_layer", "ray"}
    assert all(check["ok"] for check in body["checks"].values())


@pytest.mark.django_db
def test_unreachable_redis_names_broker_and_channel_layer(client):
    dead = f"redis://127.0.0.1:{_closed_port()}/0"
    cfg = dataclasses.replace(settings.CONFIG, redis_url=dead)
    layers = {
        "default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [dead]}}
    }
    with override_settings(CONFIG=cfg, CELERY_BROKER_URL=dead, CHANNEL_LAYERS=layers):
        response = client.get("/healthz")
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
def test_local_ray_is_not_required(client):
    with override_settings(NEREUS_RAY_ADDRESS=None):
        body = client.get("/healthz").json()
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
        tmp_path, DATABASE_URL=f"postgresql://nobody@127.0.0.1:{_closed_port()}/x"
    )
    with live.web_server(env, tmp_path / "logs") as url:
        status, body = _get(f"{url}/healthz")
    assert status == 503
    assert "database" in body["down"]
    assert body["checks"]["database"]["detail"].startswith("postgresql:")


def test_web_process_without_migrations_reports_the_channel_layer(tmp_path):
    """The embedded channel layer lives in the database: an unmigrated database cannot carry it."""
    env = live.service_env(tmp_path)
    with live.web_server(env, tmp_path / "logs") as url:
        status, body = _get(f"{url}/healthz")
    assert status == 503
    assert body["down"] == ["channel_layer"]
    assert body["checks"]["database"]["ok"]


def test_web_process_embedded_default_is_healthy(tmp_path):
    env = live.service_env(tmp_path)
    live.manage(env, "migrate", "--no-input")
    with live.web_server(env, tmp_path / "logs") as url:
        status, body = _get(f"{url}/healthz")
    assert status == 200, body
    assert body["checks"]["broker"]["detail"].startswith("filesystem queue")
    assert body["checks"]["channel_layer"]["detail"] == "database layer"


def test_test_run_keeps_var_files_out_of_the_checkout():
    assert settings.VAR_DIR != live.REPO / "var"
