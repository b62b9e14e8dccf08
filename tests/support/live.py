"""Real service processes for tests: a Daphne web server and a Celery worker on loopback, each
in its own process, sharing one database (SQLite in a temporary directory) like the embedded
default, or Redis when asked."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from nereus import processes

REPO = Path(__file__).resolve().parents[2]
MANAGE = [sys.executable, str(REPO / "manage.py")]


def service_env(var_dir: Path, **overrides: str | None) -> dict[str, str]:
    """Environment of a service process: its own var dir and SQLite file, no Redis, local Ray."""
    env = {
        k: v for k, v in os.environ.items() if k not in {"REDIS_URL", "RAY_ADDRESS", "DATABASE_URL"}
    }
    env.update(
        NEREUS_VAR_DIR=str(var_dir),
        DATABASE_URL=f"sqlite:///{var_dir / 'db.sqlite3'}",
        DJANGO_SETTINGS_MODULE="webapp.settings",
        PYTHONPATH=str(REPO),
    )
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def manage(env: dict[str, str], *args: str, timeout: float = 120) -> str:
    """Run ``manage.py`` in a child process; returns stdout, raises with stderr on failure."""
    done = subprocess.run(
        [*MANAGE, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    if done.returncode:
        raise AssertionError(f"manage.py {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def django_shell(env: dict[str, str], code: str) -> dict:
    """Run Python in a Django-configured child process; its last stdout line is parsed as JSON."""
    out = manage(env, "shell", "--no-imports", "-c", code)
    return json.loads(out.strip().splitlines()[-1])


def create_user_session(env: dict[str, str], username: str = "alice") -> dict:
    """A user and a logged-in session in the service's database: {"user_id", "session"}."""
    return django_shell(
        env,
        f"""
import json
from django.contrib.auth import get_user_model, SESSION_KEY, BACKEND_SESSION_KEY, HASH_SESSION_KEY
from django.contrib.sessions.backends.db import SessionStore
user = get_user_model().objects.create_user(username={username!r}, password="pw-{username}-1234")
store = SessionStore()
store[SESSION_KEY] = str(user.pk)
store[BACKEND_SESSION_KEY] = "django.contrib.auth.backends.ModelBackend"
store[HASH_SESSION_KEY] = user.get_session_auth_hash()
store.save()
print(json.dumps({{"user_id": user.pk, "session": store.session_key}}))
""",
    )


@contextlib.contextmanager
def web_server(env: dict[str, str], log_dir: Path) -> Iterator[str]:
    """A Daphne process serving the ASGI app on a free loopback port; yields its base URL."""
    group = processes.ProcessGroup(log_dir=log_dir)
    port = processes.free_port()
    try:
        group.start("web", processes.asgi_server_argv(host="127.0.0.1", port=port), env=env)
        processes.wait_until(
            lambda: processes.port_in_use(port), timeout_s=60, what="web", group=group
        )
        yield f"http://127.0.0.1:{port}"
    finally:
        left = group.stop(grace_s=5)
        assert not left, f"web server left processes behind: {left}"


@contextlib.contextmanager
def celery_worker(
    env: dict[str, str], log_dir: Path, *, beat: bool = False
) -> Iterator[processes.ProcessGroup]:
    """A Celery worker process (prefork, one child) driving the service's jobs; with ``beat``,
    the maintenance worker too, which runs the periodic schedule (the check for lost job
    drivers)."""
    group = processes.ProcessGroup(log_dir=log_dir)
    try:
        processes.start_celery_workers(group, env, maintenance=beat)
        yield group
    finally:
        left = group.stop(grace_s=10)
        assert not left, f"celery worker left processes behind: {left}"
