"""A job whose worker is lost: its driver's heartbeat goes stale, the periodic check (``jobs.reap``)
hands the job to a new driver with a new epoch, and exactly one copy runs: a driver that was only
slow is fenced off by the epoch, and a broker's redelivery of a task whose driver is alive is
dropped. The last test kills a real Celery worker (SIGKILL to its whole process group) in the
middle of a real PPO job; another worker takes the job over and resumes from its checkpoint."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.test import override_settings
from django.utils import timezone

from nereus import processes
from runtime.events import RuntimeEvent
from tests.support import live
from tests.support.jobs import silence
from webapp.jobs import errors, services
from webapp.jobs.models import FailureReason, Job, JobEvent, JobState
from webapp.projects.models import Role

LOST_S = 6.0


@pytest.fixture
def job(project, member, monkeypatch):
    monkeypatch.setattr(services, "_enqueue_driver", lambda job_id: None)
    owner = member(project, Role.OPERATOR, "owner")
    return services.job_submit(
        user=owner, project=project, name="j", spec={"num_slots": 1, "num_steps": 3}
    )


@pytest.mark.django_db
@override_settings(NEREUS_DRIVER_LOST_S=LOST_S)
def test_a_silent_driver_is_replaced_and_fenced_off(
    job, enqueued, no_live_delivery, django_capture_on_commit_callbacks
):
    _, old = services._claim_driver(job.pk)
    assert services.jobs_reap_lost() == []  # its heartbeat is fresh
    silence(job, LOST_S + 1)
    with django_capture_on_commit_callbacks(execute=True):
        assert services.jobs_reap_lost() == [job.pk]
    job.refresh_from_db()
    assert job.epoch == old + 1 and enqueued == [(job.pk, old + 1)]
    lost = JobEvent.objects.get(job=job, kind="job.driver_lost")
    assert lost.data["epoch"] == old and lost.data["silent_s"] >= LOST_S
    # The old driver, if it was only slow, stops at its next step and can write nothing more.
    assert services._should_stop(job.pk, old)
    with pytest.raises(errors.StaleEpochError):
        services.DatabaseEventSink(job_id=job.pk, epoch=old).emit(
            RuntimeEvent(kind="step.finished", data={"step": 9})
        )
    # The reaper gave the new delivery a grace period: it is not reaped again meanwhile.
    assert services.jobs_reap_lost() == []
    # The new delivery takes the job over; the broker's redelivery of the first task is dropped.
    job_row, new = services._claim_driver(job.pk, epoch=old + 1)
    assert new == old + 2 and job_row.state == JobState.RUNNING
    assert services._claim_driver(job.pk, unless_alive=True) is None
    assert services._claim_driver(job.pk, epoch=old + 1) is None  # a stale delivery
    job.refresh_from_db()
    assert job.epoch == new and job.driver_deliveries == 2


@pytest.mark.django_db
@override_settings(NEREUS_DRIVER_LOST_S=LOST_S)
def test_a_redelivered_task_takes_over_only_a_silent_driver(job):
    _, first = services._claim_driver(job.pk, unless_alive=True)
    assert services._claim_driver(job.pk, unless_alive=True) is None
    silence(job, LOST_S + 1)
    claimed = services._claim_driver(job.pk, unless_alive=True)
    assert claimed is not None and claimed[1] == first + 1


@pytest.mark.django_db
@override_settings(NEREUS_DRIVER_LOST_S=LOST_S, NEREUS_MAX_DRIVER_DELIVERIES=2)
def test_a_job_that_keeps_losing_its_driver_fails(
    job, enqueued, no_live_delivery, django_capture_on_commit_callbacks
):
    services._claim_driver(job.pk)
    for _ in range(2):
        silence(job, LOST_S + 1)
        with django_capture_on_commit_callbacks(execute=True):
            services.jobs_reap_lost()
        services._claim_driver(job.pk, epoch=enqueued[-1][1])
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert job.failure_reason == FailureReason.TOO_MANY_DELIVERIES


@pytest.mark.django_db
@override_settings(NEREUS_DRIVER_LOST_S=LOST_S)
def test_a_cancelling_job_whose_driver_is_lost_ends_cancelled(job, enqueued):
    services._claim_driver(job.pk)
    services.job_cancel(job_id=job.pk)
    silence(job, LOST_S + 1)
    assert services.jobs_reap_lost() == []
    job.refresh_from_db()
    assert job.state == JobState.CANCELLED and enqueued == []


@pytest.mark.django_db(transaction=True)
def test_the_driver_heartbeat_runs_while_its_epoch_is_current(job):
    _, epoch = services._claim_driver(job.pk)
    silence(job, 100)
    with services._Heartbeat(job.pk, epoch, interval_s=0.05):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            job.refresh_from_db()
            if (timezone.now() - job.heartbeat_at).total_seconds() < 5:
                break
            time.sleep(0.05)
    assert (timezone.now() - job.heartbeat_at).total_seconds() < 5
    # Superseded: the heartbeat stops writing.
    Job.objects.filter(pk=job.pk).update(epoch=epoch + 1)
    silence(job, 100)
    with services._Heartbeat(job.pk, epoch, interval_s=0.05):
        time.sleep(0.5)
    job.refresh_from_db()
    assert (timezone.now() - job.heartbeat_at).total_seconds() > 50


@pytest.mark.parametrize("value", ["1", "soon", "nan", "100000"])
def test_a_bad_driver_lost_setting_names_the_variable(value, tmp_path):
    from webapp import config

    with pytest.raises(config.ConfigError, match="NEREUS_DRIVER_LOST_S"):
        config.load({"NEREUS_VAR_DIR": str(tmp_path), "NEREUS_DRIVER_LOST_S": value})


def test_job_directories_default_under_the_var_dir(tmp_path):
    from webapp import config

    loaded = config.load({"NEREUS_VAR_DIR": str(tmp_path), "NEREUS_DRIVER_LOST_S": "30"})
    assert loaded.jobs_dir == tmp_path / "jobs" and loaded.driver_lost_s == 30.0
    shared = config.load({"NEREUS_VAR_DIR": str(tmp_path), "NEREUS_JOBS_DIR": "/mnt/ckpt"})
    assert str(shared.jobs_dir) == "/mnt/ckpt"


# --- a real worker killed mid-job --------------------------------------------------------------

PPO_SPEC = {
    "kind": "ppo",
    "num_slots": 2,
    "max_slots": 2,
    "num_steps": 12,
    "batch_size": 16,
    "max_new_tokens": 8,
    "warmup_steps": 5,
    "checkpoint_every": 2,
    "pace_s": 0.5,
}


def _events(db_path, job_id: int) -> list[dict]:
    with sqlite3.connect(db_path, timeout=30) as db:
        rows = db.execute(
            "SELECT id, epoch, kind, data FROM jobs_jobevent WHERE job_id = ? ORDER BY id",
            (job_id,),
        ).fetchall()
    return [{"id": i, "epoch": e, "kind": k, "data": json.loads(d)} for i, e, k, d in rows]


def _job(db_path, job_id: int) -> dict:
    with sqlite3.connect(db_path, timeout=30) as db:
        state, epoch, detail = db.execute(
            "SELECT state, epoch, failure_detail FROM jobs_job WHERE id = ?", (job_id,)
        ).fetchone()
    return {"state": state, "epoch": epoch, "detail": detail}


def _wait(predicate, *, timeout_s: float, what: str, group=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if group is not None:
            group.check_alive()
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout_s:.0f} s")


@pytest.mark.ray
def test_a_killed_worker_s_job_resumes_on_another_worker_from_its_checkpoint(tmp_path):
    var = tmp_path / "var"
    env = live.service_env(var, NEREUS_DRIVER_LOST_S=str(LOST_S))
    db_path = var / "db.sqlite3"
    live.manage(env, "migrate", "--no-input")
    live.create_user_session(env)
    job_id = live.django_shell(
        env,
        f"""
import json
from django.contrib.auth import get_user_model
from webapp.jobs import services
job = services.job_submit(user=get_user_model().objects.get(username="alice"), name="loss",
                          spec={PPO_SPEC!r})
print(json.dumps(job.pk))
""",
    )
    first = processes.ProcessGroup(log_dir=tmp_path / "worker-1")
    second = processes.ProcessGroup(log_dir=tmp_path / "worker-2")
    try:
        worker, maintenance = processes.start_celery_workers(first, env)

        def past_a_checkpoint():
            steps = [
                e["data"]["step"] for e in _events(db_path, job_id) if e["kind"] == "step.finished"
            ]
            return steps and max(steps) >= 4

        _wait(past_a_checkpoint, timeout_s=240, what="the job never passed step 4", group=first)
        # The machine is lost: the workers, their pool, the beat and the Ray processes, at once.
        for lost in (worker, maintenance):
            os.killpg(lost.popen.pid, signal.SIGKILL)
        for lost in (worker, maintenance):
            lost.popen.wait(timeout=30)
            _wait(
                lambda lost=lost: not processes._group_members(lost.popen.pid),
                timeout_s=30,
                what="the killed worker's processes never went",
            )
        killed_at = _events(db_path, job_id)[-1]["id"]
        assert _job(db_path, job_id)["state"] == "running"

        processes.start_celery_workers(second, env)
        final = _wait(
            lambda: (j := _job(db_path, job_id))["state"] in ("succeeded", "failed") and j,
            timeout_s=300,
            what="the job never finished on the second worker",
            group=second,
        )
    finally:
        left = second.stop(grace_s=10) + first.stop(grace_s=5)
    assert not left, f"processes left behind: {left}"
    assert final["state"] == "succeeded", final["detail"]

    events = _events(db_path, job_id)
    lost = [e for e in events if e["kind"] == "job.driver_lost"]
    assert len(lost) == 1 and lost[0]["id"] > killed_at
    old_epoch = lost[0]["data"]["epoch"]
    new_epoch = final["epoch"]
    assert new_epoch > old_epoch
    # Nothing of the old driver after it was declared lost; the new one resumed from a checkpoint.
    assert all(e["epoch"] <= old_epoch for e in events if e["id"] < lost[0]["id"])
    assert all(e["epoch"] == new_epoch for e in events if e["id"] > lost[0]["id"]), [
        (e["epoch"], e["kind"]) for e in events if e["id"] > lost[0]["id"]
    ]
    resumed = [e for e in events if e["kind"] == "engine.resumed" and e["epoch"] == new_epoch]
    assert resumed, "the new driver did not resume from a checkpoint"
    # PPO's own step counter (``ppo_step``) says which update each step was.
    old_steps = [
        e["data"]["ppo_step"]
        for e in events
        if e["kind"] == "step.finished" and e["epoch"] == old_epoch
    ]
    new_steps = [
        e["data"]["ppo_step"]
        for e in events
        if e["kind"] == "step.finished" and e["epoch"] == new_epoch
    ]
    # Each driver ran its steps once, in order, one after the other (the old one's events all
    # come before the new one's); the new one started from the checkpoint, past step 0 and at
    # most at the step after the old driver's last one, and ran to the end.
    assert old_steps == list(range(len(old_steps))) and max(old_steps) >= 4
    checkpoint = resumed[0]["data"]["step"]
    assert 0 < checkpoint <= max(old_steps) + 1
    assert new_steps == list(range(checkpoint, checkpoint + len(new_steps)))
    assert new_steps[-1] >= PPO_SPEC["num_steps"] - 1


def test_a_lost_driver_is_taken_over_while_every_worker_process_drives_a_job(tmp_path):
    """A job's driver holds its pool process for hours, and a worker whose processes all drive
    jobs takes no other message. The check for lost drivers runs on the maintenance worker, on
    a queue of its own: here the one driver process runs a long (simulated) job, and another
    job whose driver was lost an hour ago is still taken over."""
    var = tmp_path / "var"
    env = live.service_env(var, NEREUS_DRIVER_LOST_S="3")
    db_path = var / "db.sqlite3"
    live.manage(env, "migrate", "--no-input")
    live.create_user_session(env)
    submit = """
import json
from datetime import timedelta
from django.contrib.auth import get_user_model
from django.utils import timezone
from webapp.jobs import services
from webapp.jobs.models import Job, JobState
from webapp.projects.services import project_personal_for
alice = get_user_model().objects.get(username="alice")
spec = {"kind": "ppo-sim", "gpus": 16, "num_steps": 400, "trace": "growth", "pace_s": 1.0}
"""
    busy = live.django_shell(
        env,
        submit + 'print(json.dumps(services.job_submit(user=alice, name="busy", spec=spec).pk))',
    )
    group = processes.ProcessGroup(log_dir=tmp_path / "logs")
    try:
        processes.start_celery_workers(group, env)
        _wait(
            lambda: _job(db_path, busy)["state"] == "running",
            timeout_s=120,
            what="the long job never started",
            group=group,
        )
        # A job whose driver died with its machine an hour ago (a row as a lost driver leaves it).
        lost = live.django_shell(
            env,
            submit
            + """
job = Job.objects.create(name="lost", owner=alice, project=project_personal_for(alice),
                         spec=spec, state=JobState.RUNNING, epoch=1,
                         heartbeat_at=timezone.now() - timedelta(hours=1))
print(json.dumps(job.pk))
""",
        )
        _wait(
            lambda: any(e["kind"] == "job.driver_lost" for e in _events(db_path, lost)),
            timeout_s=60,
            what="the lost driver was never taken over while the worker's one process was busy",
            group=group,
        )
        assert _job(db_path, busy)["state"] == "running"  # the busy driver was left alone
        # ``nereus doctor`` finds a worker on each queue.
        doctor = subprocess.run(
            [str(Path(sys.executable).with_name("nereus")), "doctor", "--json"],
            env=env,
            cwd=live.REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        (workers,) = [f for f in json.loads(doctor.stdout) if f["name"] == "workers"]
        assert workers["status"] == "ok", workers
        assert "celery: worker@" in workers["detail"]
        assert "nereus.maintenance: maintenance@" in workers["detail"]
    finally:
        left = group.stop(grace_s=10)
    assert not left, f"processes left behind: {left}"
