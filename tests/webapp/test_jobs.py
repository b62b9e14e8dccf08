"""Jobs: the state machine, the event log with epochs, the driver's delivery count, the pages."""

import re

import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.test import override_settings

from tests.support.jobs import make_job
from webapp.jobs import errors, services
from webapp.jobs.models import ALLOWED_MOVES, FailureReason, Job, JobEvent, JobState
from webapp.projects.models import Role

pytestmark = pytest.mark.django_db

SPEC = {"num_slots": 2, "num_steps": 5}


@pytest.fixture
def alice():
    return get_user_model().objects.create_user(username="alice", password="pw-alice-1234")


@pytest.fixture
def bob():
    return get_user_model().objects.create_user(username="bob", password="pw-bob-1234")


@pytest.fixture
def job(alice):
    return make_job(owner=alice, spec=SPEC)


def test_submit_validates_the_spec_and_logs_the_submission(alice):
    job = services.job_submit(user=alice, name="ok", spec=SPEC)
    assert job.state == JobState.PENDING and job.spec["num_slots"] == 2
    assert [e.kind for e in job.events.all()] == ["job.submitted"]
    with pytest.raises(ValidationError) as info:
        services.job_submit(user=alice, name="bad", spec={"num_slots": 0})
    assert "num_slots" in info.value.message_dict
    with pytest.raises(ValidationError) as info:
        services.job_submit(user=alice, name="bad", spec={"slots": 2})
    assert "slots" in info.value.message_dict
    assert Job.objects.count() == 1  # nothing half-written


@pytest.mark.parametrize(
    ("source", "target"), [(s, t) for s in JobState for t in JobState if t not in ALLOWED_MOVES[s]]
)
def test_illegal_moves_are_refused(job, source, target):
    Job.objects.filter(pk=job.pk).update(state=source)
    job.refresh_from_db()
    with pytest.raises(
        errors.JobError, match=errors.ILLEGAL_MOVE.format(current=source, target=target)
    ):
        services.job_move(job=job, target=target)
    job.refresh_from_db()
    assert job.state == source


def test_terminal_states_allow_no_move():
    for state in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED):
        assert ALLOWED_MOVES[state] == frozenset()


def test_event_ids_increase_and_stale_epochs_are_refused(job):
    first = services.job_event_append(job=job, epoch=0, kind="a", data={})
    Job.objects.filter(pk=job.pk).update(epoch=2)
    job.refresh_from_db()
    second = services.job_event_append(job=job, epoch=2, kind="b", data={"x": 1})
    assert second.pk > first.pk
    with pytest.raises(errors.StaleEpochError):
        services.job_event_append(job=job, epoch=1, kind="late", data={})
    assert list(job.events.values_list("kind", flat=True)) == ["a", "b"]


def test_cancel_pending_ends_at_once_and_finished_jobs_refuse(job):
    assert services.job_cancel(job_id=job.pk).state == JobState.CANCELLED
    with pytest.raises(errors.JobError, match="already finished"):
        services.job_cancel(job_id=job.pk)


def test_cancel_running_asks_the_driver_to_stop(job):
    Job.objects.filter(pk=job.pk).update(state=JobState.RUNNING, epoch=1)
    assert services.job_cancel(job_id=job.pk).state == JobState.CANCELLING
    assert services._should_stop(job.pk, 1)


def test_each_delivery_bumps_the_epoch_and_too_many_fail_the_job(job):
    with override_settings(NEREUS_MAX_DRIVER_DELIVERIES=2):
        claimed = services._claim_driver(job.pk)
        assert claimed is not None and claimed[1] == 1
        job.refresh_from_db()
        assert job.state == JobState.RUNNING
        # the worker died; the task is redelivered and a new driver takes over with a new epoch
        assert services._claim_driver(job.pk)[1] == 2
        assert services._should_stop(job.pk, 1)  # the old driver sees it was superseded
        assert services._claim_driver(job.pk) is None
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert job.failure_reason == FailureReason.TOO_MANY_DELIVERIES
    assert job.driver_deliveries == 3


def test_stale_driver_sink_cannot_write(job):
    from runtime.events import RuntimeEvent

    services._claim_driver(job.pk)
    services._claim_driver(job.pk)
    stale = services.DatabaseEventSink(job_id=job.pk, epoch=1)
    with pytest.raises(errors.StaleEpochError):
        stale.emit(RuntimeEvent(kind="step.finished", data={"step": 0}))
    services.DatabaseEventSink(job_id=job.pk, epoch=2).emit(
        RuntimeEvent(kind="step.finished", data={})
    )
    assert JobEvent.objects.filter(job=job, kind="step.finished").count() == 1


# --- pages -------------------------------------------------------------------------------------


def test_pages_need_a_login(client, job):
    response = client.get("/jobs/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")


def test_list_page_shows_own_jobs_and_submits(client, alice, bob, job):
    make_job(owner=bob, name="bobs-secret-job", spec=SPEC)
    client.force_login(alice)
    page = client.get("/jobs/").content.decode()
    assert "bobs-secret-job" not in page and "<td>j</td>" in page
    response = client.post("/jobs/", {"name": "new", "num_slots": 1, "num_steps": 3, "seed": 7})
    new = Job.objects.get(name="new")
    assert response.status_code == 302 and response["Location"] == f"/jobs/{new.pk}/"
    assert new.spec["seed"] == 7


def test_submit_form_reports_field_errors(client, alice):
    client.force_login(alice)
    response = client.post("/jobs/", {"name": "", "num_slots": 0, "num_steps": "many", "seed": 0})
    assert response.status_code == 200
    form = response.context["form"]
    assert set(form.errors) == {"name", "num_slots", "num_steps"}
    assert not Job.objects.exists()


def test_other_peoples_jobs_are_not_found(client, bob, job):
    client.force_login(bob)
    assert client.get(f"/jobs/{job.pk}/").status_code == 404
    assert client.post(f"/jobs/{job.pk}/cancel/").status_code == 404
    job.refresh_from_db()
    assert job.state == JobState.PENDING


def test_project_members_see_each_others_jobs_and_only_operators_cancel(client, alice, bob, job):
    from webapp.projects.services import membership_set

    membership_set(project=job.project, user=bob, role=Role.VIEWER)
    client.force_login(bob)
    assert "<td>j</td>" in client.get("/jobs/").content.decode()
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert f"/jobs/{job.pk}/cancel/" not in page
    assert client.post(f"/jobs/{job.pk}/cancel/").status_code == 403
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    membership_set(project=job.project, user=bob, role=Role.OPERATOR)
    assert f"/jobs/{job.pk}/cancel/" in client.get(f"/jobs/{job.pk}/").content.decode()
    assert client.post(f"/jobs/{job.pk}/cancel/").status_code == 302
    job.refresh_from_db()
    assert job.state == JobState.CANCELLED


def test_the_submit_form_offers_only_projects_where_one_may_submit(client, alice, bob, job):
    from webapp.projects.services import membership_set

    membership_set(project=job.project, user=bob, role=Role.VIEWER)
    client.force_login(bob)
    response = client.post(
        "/jobs/",
        {"project": job.project.pk, "name": "n", "num_slots": 1, "num_steps": 1, "seed": 0},
    )
    assert response.status_code == 200 and "project" in response.context["form"].errors
    assert Job.objects.count() == 1


def test_detail_page_loads_plotly_from_static_and_labels_the_engine(client, alice, job):
    client.force_login(alice)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    sources = re.findall(r'<script[^>]*\bsrc="([^"]+)"', page)
    assert "/static/vendor/plotly/plotly.min.js" in sources
    # Every script comes from this server: nothing from a CDN or any other host (the CSRF
    # token is random text, so the page is searched for script sources, not for "cdn").
    assert all(src.startswith("/static/") for src in sources), sources
    assert "engine: Ray, real slots" in page
    static = client.get("/static/vendor/plotly/plotly.min.js")
    assert static.status_code == 200


def test_a_cancel_during_the_last_step_ends_cancelled_not_stuck(job):
    _, epoch = services._claim_driver(job.pk)
    services.job_cancel(job_id=job.pk)
    assert services._finish(job.pk, epoch, JobState.SUCCEEDED) == JobState.CANCELLED


def test_a_driver_takes_over_a_job_caught_mid_transition(job):
    services._claim_driver(job.pk)
    Job.objects.filter(pk=job.pk).update(state=JobState.TRANSITIONING)
    claimed = services._claim_driver(job.pk)
    assert claimed is not None and claimed[0].state == JobState.RUNNING and claimed[1] == 2


def test_a_broker_that_refuses_the_task_fails_the_job_with_a_reason(job, monkeypatch):
    from webapp.jobs import tasks

    def refuse(*args, **kwargs):
        raise ConnectionRefusedError("broker down")

    monkeypatch.setattr(tasks.job_drive, "delay", refuse)
    services._enqueue_driver(job.pk)
    job.refresh_from_db()
    assert job.state == JobState.FAILED and job.failure_reason == FailureReason.QUEUE_UNAVAILABLE
    assert "broker down" in job.failure_detail
