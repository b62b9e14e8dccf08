"""Reachability of the services the configuration needs: the database, the Celery broker, the
channel layer and Ray. Used by ``GET /healthz`` and ``nereus doctor``.

``/healthz`` needs no login (probes call it), so it tells anyone only which checks pass; the
details (paths, addresses, a driver's error) go to the server's log, and into the answer only for a
signed-in staff user or a request carrying the metrics token (``NEREUS_METRICS_TOKEN``)."""

from __future__ import annotations

import dataclasses
import hmac
import logging
import os
import socket
from pathlib import Path

from django.conf import settings
from django.db import connections
from django.db.utils import DatabaseError
from django.http import JsonResponse

from webapp import startup

PROBE_TIMEOUT_S = 2.0

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Check:
    """One dependency's state."""

    name: str
    ok: bool
    required: bool
    detail: str


def check_database() -> Check:
    backend = settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1]
    try:
        with connections["default"].cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except DatabaseError as exc:
        return Check(
            name="database", ok=False, required=True, detail=f"{backend}: {_first_line(exc)}"
        )
    return Check(name="database", ok=True, required=True, detail=backend)


def check_broker() -> Check:
    if settings.CONFIG.redis_url:
        return _check_redis("broker", settings.CELERY_BROKER_URL)
    queue = Path(settings.CELERY_BROKER_TRANSPORT_OPTIONS["data_folder_in"])
    if queue.is_dir() and os.access(queue, os.W_OK):
        return Check(name="broker", ok=True, required=True, detail=f"filesystem queue at {queue}")
    return Check(
        name="broker", ok=False, required=True, detail=f"filesystem queue {queue} is not writable"
    )


def check_channel_layer() -> Check:
    if settings.CONFIG.redis_url:
        return _check_redis(
            "channel_layer", settings.CHANNEL_LAYERS["default"]["CONFIG"]["hosts"][0]
        )
    from webapp.realtime.models import ChannelMessage

    try:
        ChannelMessage.objects.exists()
    except DatabaseError as exc:
        return Check(
            name="channel_layer",
            ok=False,
            required=True,
            detail=f"database layer: {_first_line(exc)}",
        )
    return Check(name="channel_layer", ok=True, required=True, detail="database layer")


def check_ray() -> Check:
    address = settings.NEREUS_RAY_ADDRESS
    if not startup.names_a_cluster(address):
        return Check(
            name="ray", ok=True, required=False, detail="local instance, started by each job driver"
        )
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT_S):
            pass
    except OSError as exc:
        return Check(
            name="ray", ok=False, required=True, detail=f"{address}: {exc.strerror or exc}"
        )
    return Check(name="ray", ok=True, required=True, detail=address)


def _check_redis(name: str, url: str) -> Check:
    import redis

    client = redis.Redis.from_url(
        url, socket_connect_timeout=PROBE_TIMEOUT_S, socket_timeout=PROBE_TIMEOUT_S
    )
    try:
        client.ping()
    except redis.RedisError as exc:
        return Check(name=name, ok=False, required=True, detail=f"redis: {_first_line(exc)}")
    finally:
        client.close()
    return Check(name=name, ok=True, required=True, detail="redis")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def run_checks() -> list[Check]:
    return [check_database(), check_broker(), check_channel_layer(), check_ray()]


def _may_see_details(request) -> bool:
    """A signed-in, active staff user, or the bearer of the metrics token when one is set."""
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated and user.is_active and user.is_staff:
        return True
    token = os.environ.get("NEREUS_METRICS_TOKEN", "")
    given = request.headers.get("Authorization", "")
    return bool(token) and hmac.compare_digest(given.encode(), f"Bearer {token}".encode())


def healthz(request):
    """200 when every dependency the configuration needs answers, 503 naming those that do not."""
    checks = run_checks()
    down = [c.name for c in checks if c.required and not c.ok]
    for c in checks:
        if not c.ok:
            log.warning("health check %s failed: %s", c.name, c.detail)
    details = _may_see_details(request)
    body = {
        "status": "unavailable" if down else "ok",
        "down": down,
        "checks": {
            c.name: {"ok": c.ok, "required": c.required} | ({"detail": c.detail} if details else {})
            for c in checks
        },
    }
    return JsonResponse(body, status=503 if down else 200)
