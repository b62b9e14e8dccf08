"""A job recovers from what is no fault of its own: a driver task lost before any driver claimed
it (delivered again by the periodic check), its database away for a moment (the driver writes
again, or stops and leaves the job to a new driver), workers lost while it made progress (only
deliveries in a row without progress count towards ``NEREUS_MAX_DRIVER_DELIVERIES``); and what an
older driver left waiting (its proposals) is marked stale when a new driver takes the job over.
The same for a real PostgreSQL database that drops its connections: ``test_job_db_outage.py``."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import OperationalError
from django.test import override_settings
from django.utils import timezone

from runtime.events import RuntimeEvent
from tests.support.jobs import silence
from webapp.jobs import errors, services
from webapp.jobs.models import FailureReason, Job, JobEvent, JobState
from webapp.plans import services as plan_services
from webapp.plans.models import Proposal, ProposalState
from webapp.projects.models import Role

LOST_S = 6.0
PENDING_S = 300.0
SIM_SPEC = {"kind": "ppo-sim", "gpus": 16, "num_steps": 8, "pace_s": 0.0}


@pytest.fixture(autouse=True)
def _no_live_delivery(no_live_delivery):
    pass


@pytest.fixture
def owner(project, member):
    return member(project, Role.OPERATOR, "owner")


def _submit(owner, project, spec=None) -> Job:
    return services.job_submit(
        user=owner, project=project, name="j", spec=spec or {"num_slots": 1, "num_steps": 300}
    )


def _step(job_id: int, epoch: int, step: int, **data) -> None:
    services.DatabaseEventSink(job_id=job_id, epoch=epoch).emit(
        RuntimeEvent(kind="step.finished", data={"step": step, **data})
    )


def _redrive(job: Job, now) -> int:
    """The worker is lost: the periodic check hands the job to a new driver, which claims it."""
    assert services.jobs_reap_lost(now=now) == [job.pk]
    job.refresh_from_db()
    claimed = services._claim_driver(job.pk, epoch=job.epoch)
    return claimed[1] if claimed is not None else 0


# --- a pending job whose driver task was lost ----------------------------------------------------


@pytest.mark.django_db
@override_settings(NEREUS_PENDING_REDELIVER_S=PENDING_S)
def test_a_pending_job_whose_task_was_lost_is_delivered_again(
    project, owner, enqueued, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        job = _submit(owner, project)  # the web process dies after commit: the task is lost
    enqueued.clear()
    submitted = Job.objects.get(pk=job.pk).created_at
    assert services.jobs_reap_lost(now=submitted + timedelta(seconds=PENDING_S - 1)) == []
    later = submitted + timedelta(seconds=PENDING_S + 1)
    with django_capture_on_commit_callbacks(execute=True):
        assert services.jobs_reap_lost(now=later) == [job.pk]
    job.refresh_from_db()
    assert job.state == JobState.PENDING and job.epoch == 1 and enqueued == [(job.pk, 1)]
    event = JobEvent.objects.get(job=job, kind="job.redelivered")
    assert event.data["epoch"] == 0 and event.data["pending_s"] >= PENDING_S
    # Not again at once; the next time after twice the wait.
    assert services.jobs_reap_lost(now=later + timedelta(seconds=PENDING_S + 1)) == []
    with django_capture_on_commit_callbacks(execute=True):
        assert services.jobs_reap_lost(now=later + timedelta(seconds=2 * PENDING_S + 1)) == [job.pk]
    assert enqueued == [(job.pk, 1), (job.pk, 2)]
    # The redelivery runs the job.
    claimed = services._claim_driver(job.pk, epoch=2)
    assert claimed is not None and claimed[0].state == JobState.RUNNING
    assert services.jobs_reap_lost(now=later + timedelta(days=1)) == [job.pk]  # then lost


@pytest.mark.django_db
@override_settings(NEREUS_PENDING_REDELIVER_S=PENDING_S, NEREUS_DRIVER_LOST_S=LOST_S)
@pytest.mark.parametrize("first", ["original", "redelivery"])
def test_a_job_waiting_in_the_queue_runs_once_whichever_delivery_comes_first(
    project, owner, enqueued, first
):
    job = _submit(owner, project)
    later = Job.objects.get(pk=job.pk).created_at + timedelta(seconds=PENDING_S + 1)
    assert services.jobs_reap_lost(now=later) == [job.pk]
    # Both the submit's task (no epoch) and the redelivery's (epoch 1) reach a worker.
    original = lambda: services._claim_driver(job.pk, epoch=None, unless_alive=True)  # noqa: E731
    redelivery = lambda: services._claim_driver(job.pk, epoch=1)  # noqa: E731
    deliveries = [original, redelivery] if first == "original" else [redelivery, original]
    assert deliveries[0]() is not None
    assert deliveries[1]() is None
    job.refresh_from_db()
    assert job.state == JobState.RUNNING and job.epoch == 2 and job.driver_deliveries == 1


@pytest.mark.django_db
@override_settings(NEREUS_PENDING_REDELIVER_S=PENDING_S)
def test_a_redelivery_the_queue_refuses_leaves_the_job_pending(project, owner, monkeypatch):
    from webapp.jobs import tasks

    real_enqueue = services._enqueue_driver
    monkeypatch.setattr(services, "_enqueue_driver", lambda job_id, epoch=None: None)
    job = _submit(owner, project)
    monkeypatch.setattr(services, "_enqueue_driver", real_enqueue)

    def refuse(*args):
        raise ConnectionError("broker away")

    monkeypatch.setattr(tasks.job_drive, "delay", refuse)
    services._enqueue_driver(job.pk, epoch=1)  # the submit's own task may still be queued
    job.refresh_from_db()
    assert job.state == JobState.PENDING


# --- an older driver's proposals -----------------------------------------------------------------


def _a_plan_json():
    from runtime.jobs.sim_job import sim_job_parts
    from runtime.jobs.spec import PpoSimJobSpec

    engine, controller = sim_job_parts(PpoSimJobSpec(gpus=16, num_steps=8, pace_s=0.0))
    controller.initial_plan(engine)
    return controller.plan.to_json()


def _propose(link, controller_id: int, plan) -> Proposal:
    link.emit_control(
        {"event": "control.proposal", "proposal": controller_id, "plan": plan, "route": "live"}
    )
    return Proposal.objects.get(job_id=link.job_id, controller_id=controller_id)


@pytest.mark.django_db
@override_settings(NEREUS_DRIVER_LOST_S=LOST_S, NEREUS_ALLOW_SELF_APPROVAL=False)
def test_a_new_driver_stales_what_the_lost_one_left_waiting(project, owner, member, enqueued):
    approver = member(project, Role.APPROVER, "approver")
    job = _submit(owner, project, SIM_SPEC)
    _, epoch = services._claim_driver(job.pk)
    link, plan = services._ControlLink(job.pk, epoch), _a_plan_json()

    def approve(proposal):
        plan_services.proposal_decide(
            user=approver, proposal=proposal, decision="approve", comment="fine"
        )

    taken = _propose(link, 1, plan)  # approved, and its controller took it
    approve(taken)
    link.emit_control({"event": "control.approved", "proposal": 1})
    override = plan_services.proposal_override(user=owner, job=job, plan=plan, reason="mine")
    approve(override)  # approved, and the controller moved to it
    services.DatabaseEventSink(job_id=job.pk, epoch=epoch).emit(
        RuntimeEvent(
            kind="command.applied",
            data={"command": "override", "proposal": override.pk, "outcome": "applied"},
        )
    )
    unapplied = _propose(link, 2, plan)  # approved; the driver is lost before it reads it
    approve(unapplied)
    unapplied_override = plan_services.proposal_override(
        user=owner, job=job, plan=plan, reason="again"
    )
    approve(unapplied_override)
    waiting = _propose(link, 3, plan)
    job.refresh_from_db()
    assert job.state == JobState.AWAITING_APPROVAL

    new_epoch = _redrive(job, timezone.now() + timedelta(seconds=60))
    job.refresh_from_db()
    assert job.state == JobState.RUNNING and job.epoch == new_epoch
    states = dict(Proposal.objects.filter(job=job).values_list("pk", "state"))
    assert states == {
        taken.pk: ProposalState.APPROVED,
        override.pk: ProposalState.APPROVED,
        unapplied.pk: ProposalState.STALE,
        unapplied_override.pk: ProposalState.APPROVED,  # a person's: the new driver takes it
        waiting.pk: ProposalState.STALE,
    }
    event = JobEvent.objects.get(job=job, kind="proposals.stale")
    assert sorted(event.data["proposals"]) == sorted([unapplied.pk, waiting.pk])
    assert f"epoch {epoch}" in event.data["reason"] and "lost" in event.data["reason"]
    assert Proposal.objects.get(pk=unapplied_override.pk).epoch == new_epoch
    assert services._ControlLink(job.pk, new_epoch).commands() == [
        ("override", {"plan": plan, "proposal": unapplied_override.pk})
    ]


@pytest.mark.django_db
@override_settings(NEREUS_DRIVER_LOST_S=LOST_S)
def test_a_redelivered_task_that_takes_over_stales_the_old_proposals(project, owner):
    job = _submit(owner, project, SIM_SPEC)
    _, epoch = services._claim_driver(job.pk, unless_alive=True)
    waiting = _propose(services._ControlLink(job.pk, epoch), 1, _a_plan_json())
    silence(job, LOST_S + 1)
    # The broker delivers the task again (its worker was lost) before the periodic check runs.
    _, new_epoch = services._claim_driver(job.pk, unless_alive=True)
    waiting.refresh_from_db()
    assert waiting.state == ProposalState.STALE
    event = JobEvent.objects.get(job=job, kind="proposals.stale")
    assert event.epoch == new_epoch and event.data["proposals"] == [waiting.pk]


# --- the delivery count ----------------------------------------------------------------------------


@pytest.mark.django_db
@override_settings(NEREUS_DRIVER_LOST_S=LOST_S, NEREUS_MAX_DRIVER_DELIVERIES=3)
def test_a_job_making_progress_survives_any_number_of_lost_workers(project, owner, enqueued):
    job = _submit(owner, project)
    _, epoch = services._claim_driver(job.pk)
    now, step = timezone.now(), 0
    for _ in range(5):
        for _ in range(3):  # each driver goes further than the one before
            _step(job.pk, epoch, step)
            step += 1
        job.refresh_from_db()
        assert job.driver_deliveries == 0
        now += timedelta(hours=1)
        epoch = _redrive(job, now)
        assert epoch, "the job was failed"
    job.refresh_from_db()
    assert job.state == JobState.RUNNING and job.driver_deliveries == 1


@pytest.mark.django_db
@override_settings(NEREUS_DRIVER_LOST_S=LOST_S, NEREUS_MAX_DRIVER_DELIVERIES=3)
def test_a_job_that_keeps_killing_its_worker_at_one_step_still_fails(project, owner, enqueued):
    job = _submit(owner, project)
    _, epoch = services._claim_driver(job.pk)
    for step in range(5):
        _step(job.pk, epoch, step)
    now = timezone.now() + timedelta(hours=1)
    epoch = _redrive(job, now)
    for delivery in range(1, 4):
        # Each new driver starts over (or from a checkpoint) and dies before it gets further;
        # a step that failed is no progress either.
        for step in range(2, 5):
            _step(job.pk, epoch, step)
        _step(job.pk, epoch, 5, ok=False)
        job.refresh_from_db()
        assert job.driver_deliveries == delivery
        now += timedelta(hours=1)
        epoch = _redrive(job, now)
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert job.failure_reason == FailureReason.TOO_MANY_DELIVERIES
    assert job.failure_detail == errors.TOO_MANY_DELIVERIES.format(count=4)


# --- the database away ------------------------------------------------------------------------------


@pytest.mark.django_db
@override_settings(NEREUS_DRIVER_LOST_S=LOST_S, NEREUS_DB_RETRY_S=())
def test_a_driver_whose_database_stays_away_leaves_the_job_to_a_new_driver(
    project, owner, enqueued, monkeypatch, django_capture_on_commit_callbacks
):
    job = _submit(owner, project, SIM_SPEC)

    def database_away(job_id, epoch, spec, sink):
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(services, "_drive_simulated", database_away)
    assert services.job_drive(job_id=job.pk) == JobState.RUNNING
    job.refresh_from_db()
    assert job.state == JobState.RUNNING and job.failure_reason == FailureReason.NONE
    assert not JobEvent.objects.filter(job=job, kind="job.state", data__state="failed").exists()
    # Its heartbeat stopped with it: the periodic check hands the job to a new driver.
    silence(job, LOST_S + 1)
    with django_capture_on_commit_callbacks(execute=True):
        assert services.jobs_reap_lost() == [job.pk]
    assert enqueued == [(job.pk, job.epoch + 1)]


@pytest.mark.django_db
def test_a_job_s_own_error_still_fails_it(project, owner, enqueued, monkeypatch):
    job = _submit(owner, project, SIM_SPEC)

    def broken(job_id, epoch, spec, sink):
        raise RuntimeError("the reward model diverged")

    monkeypatch.setattr(services, "_drive_simulated", broken)
    assert services.job_drive(job_id=job.pk) == JobState.FAILED
    job.refresh_from_db()
    assert job.failure_reason == FailureReason.RUNTIME_ERROR


@pytest.mark.django_db(transaction=True)
@override_settings(NEREUS_DB_RETRY_S=(0.01, 0.01))
def test_an_event_write_is_retried_while_the_database_is_away(project, owner, monkeypatch):
    monkeypatch.setattr(services, "_enqueue_driver", lambda job_id, epoch=None: None)
    job = _submit(owner, project)
    _, epoch = services._claim_driver(job.pk)
    real_append, failures = services.job_event_append, []

    def away_twice(**kwargs):
        if kwargs["kind"] == "step.finished" and len(failures) < 2:
            failures.append(1)
            raise OperationalError("terminating connection due to administrator command")
        return real_append(**kwargs)

    monkeypatch.setattr(services, "job_event_append", away_twice)
    _step(job.pk, epoch, 0)
    assert len(failures) == 2
    assert JobEvent.objects.filter(job=job, kind="step.finished").count() == 1
    # Past the last pause it gives up: the driver then leaves the job to a new one.
    failures.clear()
    monkeypatch.setattr(
        services,
        "job_event_append",
        lambda **kwargs: (_ for _ in ()).throw(OperationalError("still away")),
    )
    with pytest.raises(OperationalError):
        _step(job.pk, epoch, 1)
