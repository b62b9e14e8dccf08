"""``make demo``: the whole service on one machine, with a real PPO job running.

Starts a Ray head on loopback, a Celery worker that drives jobs on it (and runs the periodic check
for lost drivers), and the ASGI server; creates a demo user (its password printed once); submits
a PPO job on CPU slots; and stops everything on Ctrl-C.

The demo job's scenario: the reward favours longer answers, so the response length grows (drift
triggers); the cluster takes a slot away (the controller's urgent transition runs at once) and
later gives one back; approval is ``manual_above`` a small predicted transition cost, so plan
changes that are not urgent wait for a person on the job's page.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import sys
import time

from nereus import processes

DEMO_USER = "demo"
DEMO_REVOKE_AT = 4
DEMO_GRANT_AT = 10
DEMO_APPROVAL_ABOVE_S = 0.1
"""Transitions predicted to cost more than this wait for approval (the urgent one never does)."""
DEMO_POLICY = {
    "approval": "manual_above",
    "approval_above_s": DEMO_APPROVAL_ABOVE_S,
    # Admit any plan predicted faster (not the payback rule), so that the plan change after the
    # grant is proposed and a person sees it; step-time noise on shared CPUs triggers less.
    "admission": "always_faster",
    "thresholds": {"step_time": 1.5, "efficiency": 1.5},
}


def demo_spec(*, num_steps: int, num_slots: int) -> dict:
    """The demo PPO job: response length grows (reward ``length``), a slot is revoked and one is
    granted, and plan changes above a small cost wait for approval."""
    spec = {
        "kind": "ppo",
        "model": "tiny-sft",
        "tasks": "copy",
        "reward": "length",
        "num_slots": num_slots,
        "max_slots": num_slots + 1,
        "num_steps": num_steps,
        "batch_size": 16,
        "max_new_tokens": 24,
        "warmup_steps": 20,
        "checkpoint_every": 5,
        "pace_s": 1.0,
        "policy": DEMO_POLICY,
    }
    if num_steps > DEMO_REVOKE_AT and num_slots >= 2:
        spec["revoke_at_step"] = DEMO_REVOKE_AT
    if num_steps > DEMO_GRANT_AT:
        spec["grant_at_step"] = DEMO_GRANT_AT
    return spec


def _ensure_demo_user() -> str | None:
    """Create the demo user; returns its new password, or None if it already existed."""
    from django.contrib.auth import get_user_model

    users = get_user_model()
    if users.objects.filter(username=DEMO_USER).exists():
        return None
    password = secrets.token_urlsafe(12)
    users.objects.create_user(username=DEMO_USER, password=password, email="demo@localhost")
    return password


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def run_demo(*, host: str, port: int, num_steps: int, num_slots: int) -> int:
    """Run the demo until interrupted; returns the exit code."""
    started = time.monotonic()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    import django

    django.setup()
    from django.conf import settings
    from django.core.management import call_command

    try:
        taken = processes.port_in_use(port, host)
    except (socket.gaierror, UnicodeError) as exc:  # UnicodeError: a name IDNA cannot encode
        print(f"nereus demo: --host: cannot serve on {host!r} ({exc})", file=sys.stderr)
        return 2
    if taken:
        print(
            f"nereus demo: port {port} on {host} is taken; set NEREUS_DEMO_PORT to another port",
            file=sys.stderr,
        )
        return 2
    call_command("migrate", interactive=False, verbosity=0)
    password = _ensure_demo_user()

    # Explicit: a shell that starts us in the background would otherwise leave SIGINT ignored.
    signal.signal(signal.SIGINT, _raise_interrupt)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    group = processes.ProcessGroup(log_dir=settings.VAR_DIR / "logs")
    try:
        ray_port = processes.free_port()
        # Enough CPU resources for the job's slot pool (its placement group reserves one CPU per
        # slot, spare slots included), whatever the machine's core count.
        num_cpus = max(8, 2 * (os.cpu_count() or 2), num_slots + 4)
        group.start(
            "ray-head",
            processes.ray_head_argv(ray_port, num_cpus=num_cpus),
            env={**os.environ, **processes.ray_head_env(settings.VAR_DIR)},
        )
        # The worker checks RAY_ADDRESS when it starts: the head must answer first.
        processes.wait_until(
            lambda: processes.port_in_use(ray_port), timeout_s=120, what="Ray head", group=group
        )
        child_env = {
            **os.environ,
            "RAY_ADDRESS": f"127.0.0.1:{ray_port}",
            **processes.ray_head_env(settings.VAR_DIR),
        }
        processes.start_celery_workers(group, child_env, concurrency=2)
        group.start("web", processes.asgi_server_argv(host=host, port=port), env=child_env)
        url = f"http://{'[' + host.strip('[]') + ']' if ':' in host else host}:{port}/"
        processes.wait_until(
            lambda: processes.http_ok(url + "healthz"),
            timeout_s=120,
            what="web server",
            group=group,
        )
        job = _submit_demo_job(num_steps=num_steps, num_slots=num_slots)
        print(f"\nNereus is running at {url}  (ready in {time.monotonic() - started:.1f} s)")
        if password:
            print(f"  sign in as {DEMO_USER!r} with password {password!r} (shown only this once)")
        else:
            print(
                f"  sign in as {DEMO_USER!r} (password shown when it was created; "
                f"`python manage.py changepassword {DEMO_USER}` sets a new one)"
            )
        print(f"  demo job: {url}jobs/{job.pk}/")
        print(f"  logs: {settings.VAR_DIR / 'logs'}   Ctrl-C stops everything.\n", flush=True)
        while True:
            group.check_alive()
            time.sleep(1)
    except KeyboardInterrupt:
        print("\nstopping…", flush=True)
        return_code = 0
    except Exception as exc:  # a child died or never came up: say which, then clean up
        print(f"nereus demo: {exc}", file=sys.stderr)
        return_code = 1
    finally:
        # A second Ctrl-C or SIGTERM must not abort the clean-up half way.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stopping = time.monotonic()
        left = group.stop()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        took = time.monotonic() - stopping
        summary = "no process left behind" if not left else f"still running: {left}"
        print(f"stopped in {took:.1f} s: {summary}", flush=True)
    return return_code


def _submit_demo_job(*, num_steps: int, num_slots: int):
    from django.contrib.auth import get_user_model

    from webapp.jobs import services

    user = get_user_model().objects.get(username=DEMO_USER)
    # The embedded broker's URL (filesystem://) has no host, which kombu warns of on every
    # connection: not news to someone starting the demo.
    logging.getLogger("kombu.connection").setLevel(logging.ERROR)
    return services.job_submit(
        user=user,
        name="demo: PPO on CPU slots (length grows, a slot revoked and one granted)",
        spec=demo_spec(num_steps=num_steps, num_slots=num_slots),
    )
