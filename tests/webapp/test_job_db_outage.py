"""A real PostgreSQL database drops every connection (a restart, a failover) while a job runs; it
is back at once. The driver's next event write fails inside its transaction: it writes again on a
new connection and the job goes on (or, with no pause left, it stops and leaves the job to a new
driver: the job never fails for it). The heartbeat thread opens a new connection too, so a live
driver does not look lost. Only this test database's connections are dropped.

PostgreSQL only (SQLite has no connections to drop): skipped locally without it, failed in CI,
whose DATABASE_URL is PostgreSQL; an unreachable PostgreSQL fails the tests loudly."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.test import override_settings
from django.utils import timezone

from runtime.engine import sim
from tests.support.services import require
from tests.support.waiting import wait_until
from webapp.jobs import services
from webapp.jobs.models import FailureReason, Job, JobEvent, JobState
from webapp.projects.models import Role

pytestmark = pytest.mark.django_db(transaction=True)

SPEC = {"kind": "ppo-sim", "gpus": 16, "num_steps": 4, "trace": "growth", "pace_s": 0.0}
WAIT_S = 30.0


@pytest.fixture(autouse=True)
def postgres():
    # SQLite has no connections to drop.
    require(connection.vendor == "postgresql", "the database is not PostgreSQL")


def _drop_other_connections() -> list[int]:
    """What a database restart does to this test database's connections, but ours; returns
    once they are gone."""
    with connection.cursor() as cursor:
        # In the select list, not the WHERE clause: only the rows that pass it are terminated.
        cursor.execute(
            "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        pids = [pid for pid, terminated in cursor.fetchall() if terminated]
        _wait(lambda: not _alive(cursor, pids), "the dropped connections never went")
    return pids


def _alive(cursor, pids: list[int]) -> bool:
    cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", [pids])
    return cursor.fetchone()[0] > 0


def _wait(predicate, what: str, timeout_s: float = WAIT_S):
    return wait_until(predicate, what, timeout_s=timeout_s)


@pytest.fixture
def gated_job(project, member, monkeypatch):
    """A simulated job whose second step waits for ``go`` (``in_step`` says it is there), and
    its driver in a thread (``run(epoch=None)``; its result in ``result``)."""
    monkeypatch.setattr(services, "_enqueue_driver", lambda job_id, epoch=None: None)
    in_step, go, calls = threading.Event(), threading.Event(), []
    real_step = sim.SimulatedEngine.step

    def gated_step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            in_step.set()
            go.wait(WAIT_S)
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(sim.SimulatedEngine, "step", gated_step)
    owner = member(project, Role.OPERATOR, "owner")
    job = services.job_submit(user=owner, project=project, name="sim", spec=SPEC)
    result: dict = {}

    def run(epoch=None) -> threading.Thread:
        def drive():
            try:
                result["state"] = services.job_drive(job_id=job.pk, epoch=epoch)
            except Exception as exc:  # the test reports it
                result["error"] = repr(exc)
            finally:
                connection.close()

        thread = threading.Thread(target=drive)
        thread.start()
        return thread

    yield job, run, in_step, go, result
    go.set()


@override_settings(NEREUS_DRIVER_LOST_S=600, NEREUS_DB_RETRY_S=(0.05, 0.1, 0.2, 0.4))
def test_a_dropped_connection_mid_step_does_not_fail_the_job(gated_job):
    job, run, in_step, go, result = gated_job
    driver = run()
    assert in_step.wait(WAIT_S), "the driver never reached its second step"
    assert _drop_other_connections(), "the driver had no connection to drop"
    go.set()  # the step ends; its event is written on a dead connection first
    driver.join(WAIT_S)
    assert not driver.is_alive()
    job.refresh_from_db()
    assert result == {"state": JobState.SUCCEEDED}, (result, job.failure_detail)
    assert job.epoch == 1  # one driver did it all
    steps = JobEvent.objects.filter(job=job, kind="step.finished").values_list("data__step")
    assert sorted(s for (s,) in steps) == list(range(SPEC["num_steps"]))


@override_settings(NEREUS_DRIVER_LOST_S=600, NEREUS_DB_RETRY_S=())
def test_a_driver_that_cannot_write_leaves_the_job_to_a_new_driver(gated_job):
    job, run, in_step, go, result = gated_job
    driver = run()
    assert in_step.wait(WAIT_S), "the driver never reached its second step"
    _drop_other_connections()
    go.set()
    driver.join(WAIT_S)
    assert not driver.is_alive()
    job.refresh_from_db()
    assert "error" not in result, result
    assert job.state == JobState.RUNNING, (job.state, job.failure_detail)
    assert job.failure_reason == FailureReason.NONE and job.epoch == 1
    # Its heartbeat stopped: the periodic check hands the job to a new driver, which ends it.
    later = timezone.now() + timedelta(seconds=601)
    assert services.jobs_reap_lost(now=later) == [job.pk]
    job.refresh_from_db()
    run(epoch=job.epoch).join(WAIT_S)
    job.refresh_from_db()
    assert result["state"] == job.state == JobState.SUCCEEDED, job.failure_detail


@override_settings(NEREUS_DRIVER_LOST_S=2.0)
def test_the_heartbeat_reconnects_after_its_connection_is_dropped(project, member, monkeypatch):
    monkeypatch.setattr(services, "_enqueue_driver", lambda job_id, epoch=None: None)
    owner = member(project, Role.OPERATOR, "owner")
    job = services.job_submit(user=owner, project=project, name="j", spec=SPEC)
    _, epoch = services._claim_driver(job.pk)

    def heartbeat_age_s() -> float:
        beat = Job.objects.values_list("heartbeat_at", flat=True).get(pk=job.pk)
        return (timezone.now() - beat).total_seconds()

    def silence() -> None:
        Job.objects.filter(pk=job.pk).update(heartbeat_at=timezone.now() - timedelta(hours=1))

    silence()
    with services._Heartbeat(job.pk, epoch, interval_s=0.05):
        _wait(lambda: heartbeat_age_s() < 60, "the heartbeat never beat")
        assert _drop_other_connections(), "the heartbeat had no connection to drop"
        silence()  # what it writes from now on, it writes on a new connection
        _wait(lambda: heartbeat_age_s() < 60, "the heartbeat never beat again", timeout_s=10)
        # The driver is alive and says so: nobody takes its job over.
        assert services.jobs_reap_lost() == []
