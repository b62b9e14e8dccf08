"""A real PPO job's slot pool, changed by an operator: ``POST /api/v1/jobs/<id>/pool/``, the
``job_resize`` service behind it, the ``command.resize`` its driver reads between steps
(``_ControlLink``), the pool a later driver starts on (``job_pool_slots``), and the job page's
form. Refusals name the field and write nothing."""

from __future__ import annotations

import math

import pytest
from django.contrib.messages import get_messages
from django.core.exceptions import ValidationError

from runtime.jobs.spec import PpoJobSpec, PpoSimJobSpec, SftJobSpec
from tests.support.jobs import make_job
from webapp.api.exceptions import INVALID_INPUT
from webapp.api.inputs import UNKNOWN_FIELD
from webapp.jobs import errors, services
from webapp.jobs.models import Job, JobEvent, JobState
from webapp.projects.models import Role

pytestmark = pytest.mark.django_db

JOBS = "/api/v1/jobs/"
PPO_SPEC = PpoJobSpec(num_slots=2, max_slots=4, num_steps=10).to_json()
SIM_SPEC = PpoSimJobSpec(num_steps=10).to_json()
SFT_SPEC = SftJobSpec(num_slots=2, num_steps=5).to_json()
# tiny-llama with long, large batches: its models fit 4 CPU slots in some layout, 2 in none.
CRAMPED_SPEC = PpoJobSpec(
    model="tiny-llama",
    num_slots=4,
    max_slots=6,
    batch_size=16384,
    minibatch_size=8,
    max_new_tokens=8192,
).to_json()


def _fields(response) -> dict:
    body = response.json()
    assert set(body) == {"code", "message", "fields"}, body
    return body["fields"]


def _resizes(job) -> int:
    return JobEvent.objects.filter(job=job, kind="command.resize").count()


def _pool(client, job_id: int, body):
    return client.post(f"{JOBS}{job_id}/pool/", body, format="json")


@pytest.fixture
def operator(project, member):
    return member(project, Role.OPERATOR, "olga")


@pytest.fixture
def running(project, operator):
    """A running real PPO job (2 of at most 4 slots) in its first driver's epoch."""
    return make_job(
        owner=operator,
        project=project,
        name="ppo",
        spec=PPO_SPEC,
        state=JobState.RUNNING,
        epoch=1,
    )


# --- accepted ----------------------------------------------------------------------------------


def test_an_operator_resizes_and_the_command_is_recorded_with_its_data(api, operator, running):
    response = _pool(api(user=operator), running.pk, {"slots": 4, "notice_s": 30})
    assert response.status_code == 202, response.content
    body = response.json()
    event = JobEvent.objects.get(job=running, kind="command.resize")
    assert body == {"job": running.pk, "slots": 4, "notice_s": 30.0, "event": event.pk}
    assert event.epoch == running.epoch == 1
    assert event.data == {"slots": 4, "notice_s": 30.0, "by": "olga"}
    assert isinstance(event.data["notice_s"], float)
    running.refresh_from_db()
    assert running.state == JobState.RUNNING  # a command, not a move of the job


def test_notice_defaults_to_zero_and_a_token_resizes_as_its_creator(
    api, project, running, token_for
):
    response = _pool(api(secret=token_for(project, Role.OPERATOR)), running.pk, {"slots": 1})
    assert response.status_code == 202, response.content
    assert response.json()["notice_s"] == 0.0 and response.json()["slots"] == 1
    event = JobEvent.objects.get(pk=response.json()["event"])
    assert event.data["notice_s"] == 0.0 and event.data["by"] == "token-admin-ml-operator"


@pytest.mark.parametrize("slots", [1, 4])  # the pool's both ends: 1 and max_slots
def test_slots_from_one_to_max_slots_are_accepted(api, operator, running, slots):
    response = _pool(api(user=operator), running.pk, {"slots": slots})
    assert response.status_code == 202, response.content
    assert services.job_pool_slots(running) == slots


@pytest.mark.parametrize("state", [JobState.PENDING, JobState.AWAITING_APPROVAL])
def test_a_pending_or_waiting_job_is_resized(api, project, operator, state):
    """A pending job starts on the new pool (its first driver reads ``job_pool_slots``)."""
    job = make_job(owner=operator, project=project, spec=PPO_SPEC, state=state)
    response = _pool(api(user=operator), job.pk, {"slots": 3, "notice_s": 0})
    assert response.status_code == 202, response.content
    assert services.job_pool_slots(job) == 3
    assert JobEvent.objects.get(kind="command.resize").epoch == job.epoch


def test_approvers_and_admins_may_resize_too(api, project, member, running):
    for role in (Role.APPROVER, Role.ADMIN):
        response = _pool(api(user=member(project, role)), running.pk, {"slots": 3})
        assert response.status_code == 202, (role, response.content)
    assert _resizes(running) == 2


# --- what the driver reads -----------------------------------------------------------------------


def test_the_drivers_link_yields_a_resize_of_its_epoch_once(api, operator, running):
    link = services._ControlLink(running.pk, running.epoch)
    assert link.commands() == []
    _pool(api(user=operator), running.pk, {"slots": 3, "notice_s": 12.5})
    assert link.commands() == [("resize", {"slots": 3, "notice_s": 12.5})]
    assert link.commands() == []  # handed over once
    _pool(api(user=operator), running.pk, {"slots": 1})
    _pool(api(user=operator), running.pk, {"slots": 4})
    assert link.commands() == [
        ("resize", {"slots": 1, "notice_s": 0.0}),
        ("resize", {"slots": 4, "notice_s": 0.0}),
    ]


def test_a_resize_given_to_an_older_driver_is_not_replayed_but_sets_the_pool(
    api, operator, running
):
    assert services.job_pool_slots(running) is None  # never resized: the spec's num_slots
    client = api(user=operator)
    assert _pool(client, running.pk, {"slots": 3}).status_code == 202  # to the epoch-1 driver
    Job.objects.filter(pk=running.pk).update(epoch=2)  # a new driver took the job over
    running.refresh_from_db()
    newer = services._ControlLink(running.pk, 2)
    assert newer.commands() == []
    newer.after = 0  # even read from the log's start, the epoch-1 resize is not this driver's
    assert newer.commands() == []
    assert services.job_pool_slots(running) == 3  # it starts on that pool instead

    assert _pool(client, running.pk, {"slots": 2, "notice_s": 5}).status_code == 202
    assert newer.commands() == [("resize", {"slots": 2, "notice_s": 5.0})]
    assert services.job_pool_slots(running) == 2  # the latest, whichever epoch
    older = services._ControlLink(running.pk, 1)
    older.after = 0
    assert older.commands() == [("resize", {"slots": 3, "notice_s": 0.0})]


def test_a_resize_does_not_disturb_the_approvals_the_link_hands_over(api, operator, running):
    link = services._ControlLink(running.pk, running.epoch)
    services.job_event_append(
        job=running, epoch=1, kind="command.approve", data={"proposal": 7, "by": "anna"}
    )
    _pool(api(user=operator), running.pk, {"slots": 3})
    services.job_event_append(
        job=running, epoch=1, kind="command.reject", data={"proposal": 8, "by": "anna"}
    )
    assert link.commands() == [
        ("approve", 7),
        ("resize", {"slots": 3, "notice_s": 0.0}),
        ("reject", 8),
    ]


# --- bad input: 400 naming the field, nothing recorded ------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "slots"),
        ({"notice_s": 5}, "slots"),
        ({"slots": None}, "slots"),
        ({"slots": 0}, "slots"),
        ({"slots": -1}, "slots"),
        ({"slots": 5}, "slots"),  # above max_slots (4)
        ({"slots": 65}, "slots"),
        ({"slots": 10**400}, "slots"),
        ({"slots": "two"}, "slots"),
        ({"slots": True}, "slots"),
        ({"slots": False}, "slots"),
        ({"slots": 2.5}, "slots"),
        ({"slots": [2]}, "slots"),
        ({"slots": {"n": 2}}, "slots"),
        ({"slots": 2, "notice_s": -1}, "notice_s"),
        ({"slots": 2, "notice_s": -0.001}, "notice_s"),
        ({"slots": 2, "notice_s": 86400.5}, "notice_s"),
        ({"slots": 2, "notice_s": 10**6}, "notice_s"),
        ({"slots": 2, "notice_s": "soon"}, "notice_s"),
        ({"slots": 2, "notice_s": None}, "notice_s"),
        ({"slots": 2, "notice_s": [1]}, "notice_s"),
        ({"slots": 2, "urgent": True}, "urgent"),
        ({"slots": 2, "num_slots": 3}, "num_slots"),
        ([{"slots": 2}], "non_field_errors"),
        # DRF's own number fields would take these as 1.0, 30.0, 3 and 3: the API's do not.
        ({"slots": 2, "notice_s": True}, "notice_s"),
        ({"slots": 2, "notice_s": "30"}, "notice_s"),
        ({"slots": "3"}, "slots"),
        ({"slots": 3.0}, "slots"),
    ],
)
def test_bad_input_is_a_400_naming_the_field_and_records_nothing(
    api, operator, running, body, field
):
    response = _pool(api(user=operator), running.pk, body)
    assert response.status_code == 400, response.content
    fields = _fields(response)
    assert list(fields) == [field], fields
    assert response.json()["message"] == INVALID_INPUT
    assert _resizes(running) == 0


def test_an_unknown_field_is_refused_by_name(api, operator, running):
    response = _pool(api(user=operator), running.pk, {"slots": 2, "extra": 1, "also": 2})
    assert _fields(response) == {"also": [UNKNOWN_FIELD], "extra": [UNKNOWN_FIELD]}
    assert _resizes(running) == 0


def test_slots_out_of_the_pool_say_what_the_pool_is(api, operator, running):
    response = _pool(api(user=operator), running.pk, {"slots": 5})
    (message,) = _fields(response)["slots"]
    assert "max_slots (4)" in message and "got 5" in message, message
    assert not message.startswith("slots:")  # the field is the key, not repeated in the text


@pytest.mark.parametrize("text", ["1e400", "-1e400"])
def test_a_notice_past_a_floats_range_is_a_400_on_notice_s(api, operator, running, text):
    response = api(user=operator).post(
        f"{JOBS}{running.pk}/pool/",
        f'{{"slots": 2, "notice_s": {text}}}',
        content_type="application/json",
    )
    assert response.status_code == 400, response.content
    assert list(_fields(response)) == ["notice_s"]
    assert _resizes(running) == 0


@pytest.mark.parametrize("constant", ["NaN", "Infinity"])
def test_nan_or_infinity_in_the_body_is_refused(api, operator, running, constant):
    response = api(user=operator).post(
        f"{JOBS}{running.pk}/pool/",
        f'{{"slots": 2, "notice_s": {constant}}}',
        content_type="application/json",
    )
    assert response.status_code == 400, response.content
    assert _resizes(running) == 0


def test_unreadable_bodies_are_400_or_415(api, operator, running):
    client = api(user=operator)
    broken = client.post(f"{JOBS}{running.pk}/pool/", "{not json", content_type="application/json")
    assert broken.status_code == 400 and broken.json()["code"] == "parse_error"
    assert client.post(f"{JOBS}{running.pk}/pool/", {"slots": 2}).status_code == 415  # multipart
    assert _resizes(running) == 0


def test_a_pool_its_models_fit_in_no_layout_is_refused_on_slots(api, project, operator):
    job = make_job(owner=operator, project=project, spec=CRAMPED_SPEC, state=JobState.RUNNING)
    client = api(user=operator)
    response = _pool(client, job.pk, {"slots": 2})
    assert response.status_code == 400, response.content
    (message,) = _fields(response)["slots"]
    assert "does not fit 2 CPU slots" in message, message
    assert _resizes(job) == 0
    assert _pool(client, job.pk, {"slots": 6}).status_code == 202  # it fits the larger pool


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (SIM_SPEC, errors.RESIZE_SIMULATED),
        (SFT_SPEC, errors.RESIZE_FIXED.format(kind="sft")),
        ({"num_slots": 1, "num_steps": 1}, errors.RESIZE_FIXED.format(kind="sft")),  # no kind
    ],
)
def test_a_simulated_or_supervised_job_is_a_400_on_slots(api, project, operator, spec, message):
    job = make_job(owner=operator, project=project, spec=spec, state=JobState.RUNNING)
    response = _pool(api(user=operator), job.pk, {"slots": 2})
    assert response.status_code == 400, response.content
    assert _fields(response) == {"slots": [message]}
    assert _resizes(job) == 0


def test_a_job_whose_stored_spec_no_longer_validates_is_a_400_not_a_500(api, project, operator):
    """Found by review: a spec stored before a check it now fails (an SFT spec over a CPU slot's
    memory, checked since) made the pool endpoint a 500."""
    job = make_job(owner=operator, project=project, spec=SFT_SPEC, state=JobState.RUNNING)
    Job.objects.filter(pk=job.pk).update(spec={**SFT_SPEC, "hidden": 65536})
    response = _pool(api(user=operator), job.pk, {"slots": 2})
    assert response.status_code == 400, response.content
    (message,) = _fields(response)["slots"]
    assert "stored spec no longer passes the checks (hidden: " in message
    assert _resizes(job) == 0


# --- the job's state: 409, nothing recorded ---------------------------------------------------


@pytest.mark.parametrize("state", [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED])
def test_a_finished_job_is_a_409(api, project, operator, state):
    job = make_job(owner=operator, project=project, spec=PPO_SPEC, state=state)
    response = _pool(api(user=operator), job.pk, {"slots": 3})
    assert response.status_code == 409, response.content
    assert response.json() == {
        "code": "conflict",
        "message": errors.JOB_FINISHED.format(job_id=job.pk, state=state),
        "fields": {},
    }
    assert _resizes(job) == 0


def test_a_job_being_cancelled_is_a_409(api, operator, running):
    cancel = api(user=operator).post(f"{JOBS}{running.pk}/cancel/")
    assert cancel.status_code == 200 and cancel.json()["state"] == JobState.CANCELLING
    response = _pool(api(user=operator), running.pk, {"slots": 3})
    assert response.status_code == 409, response.content
    assert response.json()["message"] == errors.JOB_STOPPING.format(
        job_id=running.pk, state=JobState.CANCELLING
    )
    assert _resizes(running) == 0


def test_a_resize_recorded_before_the_cancel_stays_the_only_one(api, operator, running):
    client = api(user=operator)
    assert _pool(client, running.pk, {"slots": 3}).status_code == 202
    client.post(f"{JOBS}{running.pk}/cancel/")
    assert _pool(client, running.pk, {"slots": 1}).status_code == 409
    assert _resizes(running) == 1 and services.job_pool_slots(running) == 3


# --- who may ------------------------------------------------------------------------------------


def test_viewers_get_403_and_record_nothing(api, project, member, running, token_for):
    for client in (
        api(user=member(project, Role.VIEWER)),
        api(secret=token_for(project, Role.VIEWER)),
    ):
        response = _pool(client, running.pk, {"slots": 3})
        assert response.status_code == 403, response.content
        assert response.json()["code"] == "permission_denied"
    assert _resizes(running) == 0


def test_a_token_acts_below_its_creators_role(api, project, member, running):
    from webapp.projects import services as project_services

    admin = member(project, Role.ADMIN, "boss")
    _, secret = project_services.token_create(
        user=admin, project=project, name="ro", role=Role.VIEWER
    )
    assert _pool(api(secret=secret), running.pk, {"slots": 3}).status_code == 403
    assert _resizes(running) == 0


def test_another_projects_job_or_no_job_is_a_404(
    api, project, other_project, member, running, token_for
):
    for client in (
        api(user=member(other_project, Role.ADMIN)),
        api(secret=token_for(other_project, Role.ADMIN)),
    ):
        response = _pool(client, running.pk, {"slots": 3})
        assert response.status_code == 404, response.content
        assert response.json()["code"] == "not_found"
    assert _pool(api(user=running.owner), 987654, {"slots": 3}).status_code == 404
    assert _resizes(running) == 0


def test_an_outsider_learns_nothing_of_the_jobs_pool(api, other_project, member, running):
    """A slot count past the job's max_slots is checked only once the job is visible: an
    outsider gets the same 404 whatever the count, never the job's max_slots."""
    outsider = api(user=member(other_project, Role.ADMIN))
    for slots in (3, 99):
        response = _pool(outsider, running.pk, {"slots": slots})
        assert response.status_code == 404, response.content
        assert "max_slots" not in response.content.decode()
    assert _resizes(running) == 0


def test_without_credentials_is_a_401(api, running):
    response = _pool(api(), running.pk, {"slots": 3})
    assert response.status_code == 401
    assert _resizes(running) == 0


# --- the service itself --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("slots", "notice_s", "field"),
    [
        (True, 0.0, "slots"),
        (2.0, 0.0, "slots"),
        ("2", 0.0, "slots"),
        (None, 0.0, "slots"),
        (2, math.nan, "notice_s"),
        (2, math.inf, "notice_s"),
        (2, -math.inf, "notice_s"),
        (2, True, "notice_s"),
        (2, "5", "notice_s"),
        (2, None, "notice_s"),
        (2, 86400.0001, "notice_s"),
    ],
)
def test_the_service_refuses_values_of_the_wrong_kind_naming_them(running, slots, notice_s, field):
    with pytest.raises(ValidationError) as info:
        services.job_resize(job_id=running.pk, slots=slots, notice_s=notice_s, by="x")
    assert list(info.value.message_dict) == [field]
    assert _resizes(running) == 0


def test_the_service_takes_a_whole_number_of_seconds_up_to_a_day(running):
    for notice in (0, 86400, 86400.0):
        event = services.job_resize(job_id=running.pk, slots=2, notice_s=notice, by="x")
        assert event.data["notice_s"] == float(notice)
        assert isinstance(event.data["notice_s"], float)
    assert _resizes(running) == 3


def test_the_persons_service_checks_visibility_then_role(project, other_project, member, running):
    from webapp.projects import errors as project_errors

    with pytest.raises(project_errors.NotFoundError):
        services.job_resize_for(user=member(other_project, Role.ADMIN), job_id=running.pk, slots=2)
    with pytest.raises(project_errors.RoleError):
        services.job_resize_for(user=member(project, Role.VIEWER), job_id=running.pk, slots=2)
    Job.objects.filter(pk=running.pk).update(state=JobState.CANCELLING)
    with pytest.raises(errors.JobError):
        services.job_resize_for(user=running.owner, job_id=running.pk, slots=2)
    assert _resizes(running) == 0


# --- the job page ------------------------------------------------------------------------------


def _messages(response) -> list[str]:
    return [str(m) for m in get_messages(response.wsgi_request)]


def test_the_page_offers_the_pool_form_to_operators_of_a_running_ppo_job(
    client, project, member, operator, running
):
    client.force_login(operator)
    page = client.get(f"/jobs/{running.pk}/").content.decode()
    assert 'id="pool-form"' in page and f'action="/jobs/{running.pk}/pool/"' in page
    assert 'name="slots"' in page and 'name="notice_s"' in page
    assert 'name="slots" value="2"' in page  # starts at the spec's pool
    services.job_resize(job_id=running.pk, slots=3, notice_s=0, by="olga")
    page = client.get(f"/jobs/{running.pk}/").content.decode()
    assert 'name="slots" value="3"' in page  # then at the last one asked for

    client.force_login(member(project, Role.VIEWER, "vic"))
    page = client.get(f"/jobs/{running.pk}/").content.decode()
    assert 'id="pool-form"' not in page and f"/jobs/{running.pk}/pool/" not in page


@pytest.mark.parametrize(
    ("spec", "state"),
    [
        (SIM_SPEC, JobState.RUNNING),
        (SFT_SPEC, JobState.RUNNING),
        (PPO_SPEC, JobState.SUCCEEDED),
        (PPO_SPEC, JobState.CANCELLED),
        (PPO_SPEC, JobState.CANCELLING),
    ],
)
def test_no_pool_form_on_a_simulated_supervised_or_finished_job(
    client, project, operator, spec, state
):
    job = make_job(owner=operator, project=project, spec=spec, state=state)
    client.force_login(operator)
    response = client.get(f"/jobs/{job.pk}/")
    assert response.status_code == 200
    page = response.content.decode()
    assert 'id="pool-form"' not in page and f"/jobs/{job.pk}/pool/" not in page


def test_posting_the_form_records_the_command_and_redirects(client, operator, running):
    client.force_login(operator)
    response = client.post(f"/jobs/{running.pk}/pool/", {"slots": "3", "notice_s": "45"})
    assert response.status_code == 302 and response["Location"] == f"/jobs/{running.pk}/"
    event = JobEvent.objects.get(job=running, kind="command.resize")
    assert event.data == {"slots": 3, "notice_s": 45.0, "by": "olga"}
    assert event.epoch == running.epoch
    (message,) = _messages(response)
    assert "pool of 3 slots asked with 45 s notice" in message


def test_a_blank_notice_on_the_page_is_zero(client, operator, running):
    client.force_login(operator)
    response = client.post(f"/jobs/{running.pk}/pool/", {"slots": "1", "notice_s": ""})
    assert response.status_code == 302
    assert JobEvent.objects.get(job=running, kind="command.resize").data["notice_s"] == 0.0
    assert "notice" not in _messages(response)[0]


@pytest.mark.parametrize(
    ("form", "field"),
    [
        ({}, "slots"),
        ({"slots": ""}, "slots"),
        ({"slots": "two"}, "slots"),
        ({"slots": "2.5"}, "slots"),
        ({"slots": "0"}, "slots"),
        ({"slots": "5"}, "slots"),  # a form-valid number, above the job's max_slots (4)
        ({"slots": "65"}, "slots"),
        ({"slots": "2", "notice_s": "-1"}, "notice_s"),
        ({"slots": "2", "notice_s": "86401"}, "notice_s"),
        ({"slots": "2", "notice_s": "soon"}, "notice_s"),
        ({"slots": "2", "notice_s": "nan"}, "notice_s"),
        ({"slots": "2", "notice_s": "inf"}, "notice_s"),
    ],
)
def test_bad_page_input_is_a_message_naming_the_field(client, operator, running, form, field):
    client.force_login(operator)
    response = client.post(f"/jobs/{running.pk}/pool/", form)
    assert response.status_code == 302 and response["Location"] == f"/jobs/{running.pk}/"
    messages = _messages(response)
    assert messages and all(m.startswith(f"{field}: ") for m in messages), messages
    assert _resizes(running) == 0
    shown = client.get(response["Location"]).content.decode()
    assert f"{field}: " in shown  # the message reaches the job page


@pytest.mark.parametrize(
    ("spec", "state", "expected"),
    [
        (SIM_SPEC, JobState.RUNNING, f"slots: {errors.RESIZE_SIMULATED}"),
        (SFT_SPEC, JobState.RUNNING, f"slots: {errors.RESIZE_FIXED.format(kind='sft')}"),
        (PPO_SPEC, JobState.SUCCEEDED, "has already finished (succeeded)"),
        (PPO_SPEC, JobState.CANCELLING, "its driver takes no more commands"),
    ],
)
def test_a_page_post_the_job_cannot_take_is_a_message(
    client, project, operator, spec, state, expected
):
    job = make_job(owner=operator, project=project, spec=spec, state=state)
    client.force_login(operator)
    response = client.post(f"/jobs/{job.pk}/pool/", {"slots": "2", "notice_s": "0"})
    assert response.status_code == 302 and response["Location"] == f"/jobs/{job.pk}/"
    (message,) = _messages(response)
    assert expected in message, message
    assert _resizes(job) == 0


def test_page_posts_of_viewers_are_403_and_of_outsiders_404(
    client, project, other_project, member, running
):
    # Whatever the input: a bad one is answered as a good one, before the form is read.
    client.force_login(member(project, Role.VIEWER, "vic"))
    for body in ({"slots": "3"}, {"slots": "0"}):
        assert client.post(f"/jobs/{running.pk}/pool/", body).status_code == 403
    client.force_login(member(other_project, Role.ADMIN, "otto"))
    for body in ({"slots": "3"}, {"slots": "0"}):
        assert client.post(f"/jobs/{running.pk}/pool/", body).status_code == 404
    assert client.get(f"/jobs/{running.pk}/pool/").status_code == 405
    assert _resizes(running) == 0


def test_the_page_form_needs_a_login(client, running):
    response = client.post(f"/jobs/{running.pk}/pool/", {"slots": "3"})
    assert response.status_code == 302 and "/login" in response["Location"]
    assert _resizes(running) == 0


def test_the_schema_lists_the_pool_endpoint(api, operator):
    response = api(user=operator).get("/api/schema/", HTTP_ACCEPT="application/json")
    assert response.status_code == 200
    operation = response.json()["paths"]["/api/v1/jobs/{job_id}/pool/"]["post"]
    assert "202" in operation["responses"]
