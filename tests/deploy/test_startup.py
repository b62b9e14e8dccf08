"""Bad configuration stops the web server and the Celery worker at start-up, with a line naming
the setting at fault: not later, mid-job."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from nereus import processes
from webapp import startup
from webapp.config import ConfigError

REPO = Path(__file__).resolve().parents[2]
GOOD_KEY = "k" * 20 + "0123456789abcdefghijklmnopqrstuvwxyz"


def _env(tmp_path: Path, **values: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DATABASE_URL", "REDIS_URL", "RAY_ADDRESS"} and not k.startswith("NEREUS_")
    }
    env.update(
        DJANGO_SETTINGS_MODULE="webapp.settings",
        PYTHONPATH=str(REPO),
        NEREUS_VAR_DIR=str(tmp_path / "var"),
        DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}",
        NEREUS_STARTUP_WAIT_S="0",
    )
    env.update(values)
    return env


def _start(kind: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Start the web server or a Celery worker; a correct one keeps running (and times out)."""
    argv = (
        processes.asgi_server_argv(host="127.0.0.1", port=processes.free_port())
        if kind == "web"
        else processes.celery_worker_argv(concurrency=1)
    )
    try:
        return subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the {kind} process started despite the bad setting") from exc


def _closed_port() -> int:
    return processes.free_port()  # bound and released: nothing listens there


@pytest.mark.parametrize(
    ("kind", "values", "setting"),
    [
        (
            "web",
            {"NEREUS_PRODUCTION": "1", "NEREUS_ALLOWED_HOSTS": "x.example"},
            "NEREUS_SECRET_KEY",
        ),
        ("celery", {"DATABASE_URL": "mysql://db.example/nereus"}, "DATABASE_URL"),
        ("web", {"RAY_ADDRESS": "127.0.0.1:{port}"}, "RAY_ADDRESS"),
        ("celery", {"RAY_ADDRESS": "127.0.0.1:{port}"}, "RAY_ADDRESS"),
        ("web", {"RAY_ADDRESS": "a..b:6379"}, "RAY_ADDRESS"),  # was a UnicodeError traceback
    ],
    ids=[
        "web-missing-secret",
        "celery-database-scheme",
        "web-ray-down",
        "celery-ray-down",
        "web-ray-host-label",
    ],
)
def test_bad_configuration_fails_at_start_up_naming_the_setting(tmp_path, kind, values, setting):
    values = {k: v.format(port=_closed_port()) for k, v in values.items()}
    if setting != "NEREUS_SECRET_KEY":
        values.setdefault("NEREUS_SECRET_KEY", GOOD_KEY)
    done = _start(kind, _env(tmp_path, **values))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "configuration error" in line]
    assert lines, done.stderr[-3000:]
    assert setting in lines[0], lines


def test_the_ray_check_passes_once_something_answers_and_names_the_address_otherwise():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        startup.check_ray_address(address, wait_s=0)
    startup.check_ray_address(None, wait_s=0)  # a local Ray: nothing to reach
    with pytest.raises(ConfigError) as failed:
        startup.check_ray_address(address, wait_s=0)
    assert failed.value.variable == "RAY_ADDRESS" and address in str(failed.value)


@pytest.mark.parametrize("address", ["a..b:6379", "a" * 64 + ".example:6379"])
def test_an_address_the_socket_cannot_encode_is_named_not_a_traceback(address):
    """Found by review: the IDNA codec refuses an empty or over-long host label with
    UnicodeError, which escaped the probe (it caught OSError only). ``webapp.config`` refuses
    such an address first; the probe still names it if one comes another way."""
    with pytest.raises(ConfigError) as failed:
        startup.check_ray_address(address, wait_s=0)
    assert failed.value.variable == "RAY_ADDRESS" and address in str(failed.value)


def test_a_worker_that_drives_jobs_needs_a_ray_node_of_the_cluster_on_its_machine():
    """Ray attaches a driver to a node of its own machine: a GCS that answers is not enough.
    Here something answers at the address but no raylet of that cluster runs on this machine
    (the deployments' node, started by nereus.ray_node, is tested in test_topology.py)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        startup.check_ray_address(address, wait_s=0)
        assert not startup.local_ray_node(address)
        with pytest.raises(ConfigError) as failed:
            startup.check_ray_node(address, wait_s=0)
    assert failed.value.variable == "RAY_ADDRESS"
    assert "python -m nereus.ray_node" in str(failed.value) and address in str(failed.value)
    startup.check_ray_node(None, wait_s=0)  # a local Ray per driver: nothing to join
    startup.check_ray_node("auto", wait_s=0)


def test_a_bad_wait_is_itself_named():
    with pytest.raises(ConfigError) as failed:
        startup._wait_s({"NEREUS_STARTUP_WAIT_S": "soon"})
    assert failed.value.variable == "NEREUS_STARTUP_WAIT_S"
