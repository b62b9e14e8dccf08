"""Start-up checks of the web server and the Celery worker: what ``webapp.config`` cannot see
from the variables alone. ``webapp.config.load`` already refuses a database URL with the wrong
scheme, a missing or weak ``NEREUS_SECRET_KEY`` in production and malformed addresses; here the
processes that serve also refuse a ``RAY_ADDRESS`` that nothing answers at, and a Celery worker
that drives jobs refuses to start where no Ray node of that cluster runs on its machine (Ray
attaches a driver to a node of its own machine), so that a job fails at deployment time, not when
its driver first tries to join the cluster.

``NEREUS_STARTUP_WAIT_S`` (default 10): how long to keep trying the Ray address (a head that
starts at the same time as the web server gets that long to come up).
"""

from __future__ import annotations

import importlib
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


def names_a_cluster(address: str | None) -> bool:
    """Whether ``address`` is a cluster to reach: not unset (a local instance per driver), nor
    ``local``, nor ``auto`` (this machine's own node)."""
    return bool(address) and address not in {"auto", "local"}


def check_ray_address(address: str | None, *, wait_s: float) -> None:
    """Raise ``ConfigError("RAY_ADDRESS", ...)`` unless a TCP connection to the cluster's GCS
    succeeds within ``wait_s`` seconds."""
    if not names_a_cluster(address):
        return
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT_S):
                return
        except OSError as exc:
            problem = exc.strerror or str(exc) or type(exc).__name__
        except ValueError as exc:
            # UnicodeError: a host name the IDNA codec refuses (``a..b``), which no retry mends.
            # ``webapp.config.parse_ray_address`` refuses those first; this keeps a traceback out
            # of start-up for an address that came another way.
            raise ConfigError(
                "RAY_ADDRESS", f"{address!r} is not a HOST:PORT to connect to ({exc})"
            ) from None
        if time.monotonic() >= deadline:
            raise ConfigError(
                "RAY_ADDRESS",
                f"no Ray cluster answers at {address} ({problem}); start the Ray head first, "
                "fix the address, or unset it for a local Ray",
            )
        time.sleep(0.5)


def _endpoints(address: str) -> set[tuple[str, int]]:
    """The (IP, port) pairs a ``HOST:PORT`` address names (none if it does not resolve)."""
    host, _, port = address.rpartition(":")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        return set()
    return {(str(info[4][0]), int(port)) for info in infos}


def local_ray_node(address: str) -> bool:
    """Whether a Ray node of the cluster whose GCS is at ``address`` runs on this machine: its
    processes were started with that ``--gcs-address`` (``ray.init`` finds a driver's node the
    same way, among the machine's processes)."""
    import runtime.engine  # noqa: F401 - sets Ray's loopback environment before Ray is imported

    services = importlib.import_module("ray._private.services")  # after it, whatever the sorting
    wanted = _endpoints(address)
    # Not ``find_gcs_addresses``: it keeps its first non-empty answer for the process's life.
    found = services._find_address_from_flag("--gcs-address")
    return any(_endpoints(address) & wanted for address in found)


def check_ray_node(address: str | None, *, wait_s: float) -> None:
    """Raise ``ConfigError("RAY_ADDRESS", ...)`` unless a Ray node of the cluster at ``address``
    runs on this machine within ``wait_s`` seconds (a node started beside the worker may come up
    after the head answers); nothing to check for a local instance or ``auto``."""
    if not names_a_cluster(address):
        return
    deadline = time.monotonic() + wait_s
    while not local_ray_node(address):
        if time.monotonic() < deadline:
            time.sleep(0.5)
            continue
        raise ConfigError(
            "RAY_ADDRESS",
            f"no Ray node of the cluster at {address} runs on this machine, and a job's driver "
            "must run on one (Ray attaches a driver to a node of its own machine): start the "
            "worker as `python -m nereus.ray_node celery ...`, which first joins a node that "
            f"offers the cluster no CPU or GPU, or run `ray start --address={address} "
            "--num-cpus=0 --num-gpus=0` before it",
        )


def check(environ=None, *, drives_jobs: bool = False) -> None:
    """Every start-up check; raises ``ConfigError`` naming the variable at fault.
    ``drives_jobs``: the process is a Celery worker that runs job drivers."""
    from django.conf import settings

    env = os.environ if environ is None else environ
    wait_s = _wait_s(env)
    check_ray_address(settings.NEREUS_RAY_ADDRESS, wait_s=wait_s)
    if drives_jobs:
        check_ray_node(settings.NEREUS_RAY_ADDRESS, wait_s=wait_s)


def check_or_exit(process: str, *, drives_jobs: bool = False) -> None:
    """Run the checks; on failure, print one line naming the variable and exit with status 2."""
    try:
        check(drives_jobs=drives_jobs)
    except ConfigError as exc:
        sys.stderr.write(f"nereus: configuration error ({process}): {exc}\n")
        sys.stderr.flush()
        raise SystemExit(2) from None
