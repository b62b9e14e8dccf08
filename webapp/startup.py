"""Start-up checks of the web server and the Celery worker: what ``webapp.config`` cannot see
from the variables alone. ``webapp.config.load`` already refuses a database URL with the wrong
scheme, a missing or weak ``NEREUS_SECRET_KEY`` in production and malformed addresses; here the
processes that serve also refuse a ``RAY_ADDRESS`` that nothing answers at, so that a job fails at
deployment time, not when its driver first tries to join the cluster.

``NEREUS_STARTUP_WAIT_S`` (default 10): how long to keep trying the Ray address (a head that
starts at the same time as the web server gets that long to come up).
"""

from __future__ import annotations

import os
import socket
import sys
import time

from webapp.config import ConfigError

PROBE_TIMEOUT_S = 2.0


def _wait_s(environ) -> float:
    raw = environ.get("NEREUS_STARTUP_WAIT_S") or "10"
    try:
        wait = float(raw)
    except ValueError:
        wait = float("nan")
    if not 0 <= wait <= 3600:
        raise ConfigError("NEREUS_STARTUP_WAIT_S", f"expected seconds in [0, 3600], got {raw!r}")
    return wait


def check_ray_address(address: str | None, *, wait_s: float) -> None:
    """Raise ``ConfigError("RAY_ADDRESS", ...)`` unless a TCP connection to the cluster's address
    (the GCS, or the Ray Client server for ``ray://``) succeeds within ``wait_s`` seconds."""
    if address is None or address in {"auto", "local"}:
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT_S):
                return
        except OSError as exc:
            problem = exc.strerror or str(exc) or type(exc).__name__
        if time.monotonic() >= deadline:
            raise ConfigError(
                "RAY_ADDRESS",
                f"no Ray cluster answers at {address} ({problem}); start the Ray head first, "
                "fix the address, or unset it for a local Ray",
            )
        time.sleep(0.5)


def check(environ=None) -> None:
    """Every start-up check; raises ``ConfigError`` naming the variable at fault."""
    from django.conf import settings

    env = os.environ if environ is None else environ
    check_ray_address(settings.NEREUS_RAY_ADDRESS, wait_s=_wait_s(env))


def check_or_exit(process: str) -> None:
    """Run the checks; on failure, print one line naming the variable and exit with status 2."""
    try:
        check()
    except ConfigError as exc:
        sys.stderr.write(f"nereus: configuration error ({process}): {exc}\n")
        sys.stderr.flush()
        raise SystemExit(2) from None
