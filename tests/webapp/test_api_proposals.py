"""REST API ``/api/v1/proposals/``: the approvals inbox, one proposal, approve and reject; who may
decide, the required comment, self-approval, state conflicts; bad input names the field. And
``/api/v1/jobs/<id>/override/``: a person's own plan for a job, proposed for another to approve."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from runtime.jobs.spec import PpoSimJobSpec
from tests.support import plans as events
from tests.support.jobs import make_job
from webapp.api.exceptions import INVALID_INPUT
from webapp.api.inputs import UNKNOWN_FIELD
from webapp.api.jobs import NO_SUCH_PROJECT
from webapp.jobs import services as job_services
from webapp.jobs.models import Job, JobState
from webapp.plans import errors, services
from webapp.plans.models import Proposal, ProposalState
from webapp.projects import services as project_services
from webapp.projects.models import Role

pytestmark = pytest.mark.django_db

PROPOSALS = "/api/v1/proposals/"


def _fields(response) -> dict:
    body = response.json()
    assert set(body) == {"code", "message", "fields"}, body
    return body["fields"]


def _propose(job, controller_id: int = 1, target: int = 8) -> Proposal:
    services.record_controller_event(job=job, event=events.proposal_event(controller_id, 4, target))
    return Proposal.objects.get(job=job, controller_id=controller_id)


@pytest.fixture
def job(project, member):
    """A PPO job (on the simulated cluster): the kind a controller drives."""
    owner = member(project, Role.OPERATOR, "owner")
    return make_job(owner=owner, project=project, epoch=1, spec=PpoSimJobSpec().to_json())


@pytest.fixture
def waiting(job) -> Proposal:
    return _propose(job)


@pytest.fixture
def approver(project, member):
    return member(project, Role.APPROVER, "approver")


def _decide(client, proposal, decision="approve", body=None):
    return client.post(
        f"{PROPOSALS}{proposal.pk}/{decision}/",
        {"comment": "ok"} if body is None else body,
        format="json",
    )


# --- reading -----------------------------------------------------------------------------------


def test_the_inbox_lists_waiting_proposals_of_visible_projects(
    api, project, other_project, member, job, approver
):
    stale = _propose(job, 1)
    waiting = _propose(job, 2, 6)  # replaces the first, which goes stale
    other_job = make_job(owner=member(other_project, Role.OPERATOR, "o2"), project=other_project)
    _propose(other_job, 1)
    client = api(user=approver)
    inbox = client.get(f"{PROPOSALS}?state=waiting&project=ml")
    assert inbox.status_code == 200, inbox.json()
    (row,) = inbox.json()["results"]
    assert (row["id"], row["job"], row["project"], row["state"]) == (
        waiting.pk,
        job.pk,
        "ml",
        "waiting",
    )
    assert row["controller_id"] == 2 and row["proposed_by"] is None and row["decided_by"] is None
    assert row["plan"] == events.plan_json(6) and row["verdict"]["admit"]
    assert row["route"] == "live"
    everything = client.get(PROPOSALS).json()["results"]
    assert [r["id"] for r in everything] == [waiting.pk, stale.pk]  # newest first, ml only
    assert client.get(f"{PROPOSALS}?state=stale").json()["results"][0]["id"] == stale.pk
    assert client.get(f"{PROPOSALS}?job={other_job.pk}").json()["results"] == []


def test_the_inbox_is_cursor_paginated(api, project, member, job, approver):
    for controller_id in range(1, 6):
        _propose(job, controller_id)
    client = api(user=approver)
    first = client.get(f"{PROPOSALS}?limit=2").json()
    second = client.get(first["next"]).json()
    third = client.get(second["next"]).json()
    ids = [r["id"] for page in (first, second, third) for r in page["results"]]
    assert len(ids) == 5 and ids == sorted(ids, reverse=True) and third["next"] is None


@pytest.mark.parametrize(
    ("query", "field", "message"),
    [
        ("state=pondering", "state", None),
        ("project=nope", "project", NO_SUCH_PROJECT),
        ("project=other", "project", NO_SUCH_PROJECT),  # exists, but not yours
        ("project=Not a slug!", "project", None),
        ("job=x", "job", None),
        ("cursor=zzz", "cursor", None),
        ("limit=abc", "limit", None),  # these three were read as the default page
        ("limit=0", "limit", None),
        ("limit=-5", "limit", None),
        ("limit=201", "limit", None),
    ],
)
def test_bad_filters_name_the_field(api, other_project, approver, waiting, query, field, message):
    response = api(user=approver).get(f"{PROPOSALS}?{query}")
    assert response.status_code == 400, response.content
    fields = _fields(response)
    assert list(fields) == [field], fields
    assert message is None or fields[field] == [message]


def test_one_proposal_is_visible_to_viewers_and_not_found_elsewhere(
    api, project, other_project, member, waiting, token_for
):
    url = f"{PROPOSALS}{waiting.pk}/"
    shown = api(user=member(project, Role.VIEWER)).get(url)
    assert shown.status_code == 200 and shown.json()["id"] == waiting.pk
    assert api(secret=token_for(project, Role.VIEWER)).get(url).status_code == 200
    for client in (
        api(user=member(other_project, Role.ADMIN)),
        api(secret=token_for(other_project)),
    ):
        assert client.get(url).status_code == 404
        assert client.get(PROPOSALS).json()["results"] == []
    assert (
        api(user=member(project, Role.VIEWER, "v2")).get(f"{PROPOSALS}999999/").status_code == 404
    )


# --- deciding ----------------------------------------------------------------------------------


def test_an_approver_approves_with_a_comment(api, approver, waiting, job):
    response = _decide(api(user=approver), waiting, body={"comment": "  worth it  "})
    assert response.status_code == 200, response.json()
    body = response.json()
    assert (body["state"], body["decided_by"], body["comment"]) == (
        "approved",
        "approver",
        "worth it",
    )
    assert body["decided_at"] is not None
    command = job.events.get(kind="command.approve")
    assert (command.data["proposal"], command.data["by"]) == (1, "approver")


def test_an_admin_token_rejects(api, project, waiting, job, token_for):
    response = _decide(api(secret=token_for(project, Role.APPROVER)), waiting, "reject")
    assert response.status_code == 200 and response.json()["state"] == "rejected"
    assert job.events.filter(kind="command.reject").count() == 1


@pytest.mark.parametrize("role", [Role.VIEWER, Role.OPERATOR])
def test_viewers_and_operators_cannot_decide(api, project, member, waiting, token_for, role):
    for client in (api(user=member(project, role)), api(secret=token_for(project, role))):
        for decision in ("approve", "reject"):
            response = _decide(client, waiting, decision)
            assert response.status_code == 403, response.json()
            assert response.json()["code"] == "permission_denied"
    waiting.refresh_from_db()
    assert waiting.state == ProposalState.WAITING
    assert not waiting.job.events.filter(kind__startswith="command.").exists()


def test_a_token_acts_below_its_creators_role(api, project, member, waiting):
    approver = member(project, Role.ADMIN, "boss")
    _, secret = project_services.token_create(
        user=approver, project=project, name="ro", role=Role.OPERATOR
    )
    assert _decide(api(secret=secret), waiting).status_code == 403


def test_another_project_gets_404_and_a_revoked_token_401(
    api, project, other_project, member, waiting, token_for
):
    assert _decide(api(user=member(other_project, Role.ADMIN)), waiting).status_code == 404
    assert _decide(api(secret=token_for(other_project, Role.ADMIN)), waiting).status_code == 404
    admin = member(project, Role.ADMIN, "boss")
    token, secret = project_services.token_create(
        user=admin, project=project, name="ci", role=Role.APPROVER
    )
    project_services.token_revoke(user=admin, project=project, token_id=token.pk)
    refused = _decide(api(secret=secret), waiting)
    assert refused.status_code == 401 and set(refused.json()) == {"code", "message", "fields"}
    assert _decide(api(), waiting).status_code == 401
    waiting.refresh_from_db()
    assert waiting.state == ProposalState.WAITING


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "comment"),
        ({"comment": ""}, "comment"),
        ({"comment": "   "}, "comment"),
        ({"comment": None}, "comment"),
        ({"comment": ["a"]}, "comment"),
        ({"comment": "x" * 4001}, "comment"),
        ({"comment": "fine\x1b[2J"}, "comment"),  # control characters; line breaks are allowed
        ({"comment": 1.5}, "comment"),
        ({"comment": True}, "comment"),
        ({"comment": "ok", "plan": {}}, "plan"),
        ([{"comment": "ok"}], "non_field_errors"),
    ],
)
@pytest.mark.parametrize("decision", ["approve", "reject"])
def test_bad_bodies_name_the_field(api, approver, waiting, body, field, decision):
    response = _decide(api(user=approver), waiting, decision, body=body)
    assert response.status_code == 400, response.content
    fields = _fields(response)
    assert field in fields, fields
    assert response.json()["message"] == INVALID_INPUT
    if body == {"comment": "ok", "plan": {}}:
        assert fields == {"plan": [UNKNOWN_FIELD]}
    waiting.refresh_from_db()
    assert waiting.state == ProposalState.WAITING


def test_a_body_that_is_not_json_is_a_400(api, approver, waiting):
    response = api(user=approver).post(
        f"{PROPOSALS}{waiting.pk}/approve/", "comment=ok", content_type="text/plain"
    )
    assert response.status_code == 415
    broken = api(user=approver).post(
        f"{PROPOSALS}{waiting.pk}/approve/", "{not json", content_type="application/json"
    )
    assert broken.status_code == 400 and set(broken.json()) == {"code", "message", "fields"}


def test_a_decided_proposal_is_a_409(api, approver, waiting):
    client = api(user=approver)
    assert _decide(client, waiting, "reject").status_code == 200
    for decision in ("approve", "reject"):
        response = _decide(client, waiting, decision)
        assert response.status_code == 409
        body = response.json()
        assert body["code"] == "not_waiting"
        assert body["message"] == errors.NOT_WAITING.format(
            proposal_id=waiting.pk, state="rejected"
        )


def test_an_outdated_proposal_is_a_409_and_marked_stale(api, approver, waiting, job):
    job.epoch = 2
    job.save(update_fields=["epoch"])
    response = _decide(api(user=approver), waiting)
    assert response.status_code == 409 and response.json()["code"] == "not_waiting"
    waiting.refresh_from_db()
    assert waiting.state == ProposalState.STALE


def test_a_proposal_of_a_cancelling_job_is_a_409_and_marked_stale(api, approver, job):
    """Its driver stops at its next step boundary, before it reads commands: an approval was
    recorded and never applied (found by review)."""
    job.state = JobState.RUNNING
    job.save(update_fields=["state"])
    cancel = api(user=job.owner).post(f"/api/v1/jobs/{job.pk}/cancel/")
    assert cancel.json()["state"] == JobState.CANCELLING
    late = _propose(job)  # the controller proposed during the step the job stops after
    response = _decide(api(user=approver), late)
    assert response.status_code == 409 and response.json()["code"] == "not_waiting"
    assert response.json()["message"] == errors.JOB_FINISHED.format(
        proposal_id=late.pk, state=JobState.CANCELLING
    )
    late.refresh_from_db()
    assert late.state == ProposalState.STALE
    assert not job.events.filter(kind="command.approve").exists()


def _stop(job, end: str) -> None:
    if end in ("succeeded", "failed"):
        job_services._finish(job.pk, job.epoch, end, "runtime_error" if end == "failed" else "")
    elif end == "cancelled":
        job_services.job_cancel(job_id=job.pk)  # cancelling: the driver stops at its next step
        job_services._finish(job.pk, job.epoch, JobState.CANCELLED)
    elif end == "pending-cancelled":
        Job.objects.filter(pk=job.pk).update(state=JobState.PENDING)
        job_services.job_cancel(job_id=job.pk)
    else:  # "reaped": a cancelling job whose driver went silent is ended by the reaper
        Job.objects.filter(pk=job.pk).update(
            state=JobState.CANCELLING, heartbeat_at=timezone.now() - timedelta(hours=1)
        )
        assert job_services.jobs_reap_lost() == []


@pytest.mark.parametrize("end", ["succeeded", "failed", "cancelled", "pending-cancelled", "reaped"])
def test_a_job_that_ends_leaves_no_proposal_waiting_in_the_inbox(api, approver, job, end):
    """Its proposals stayed waiting forever (found by review): they go stale with the move."""
    Job.objects.filter(pk=job.pk).update(state=JobState.AWAITING_APPROVAL)
    waiting = _propose(job)
    client = api(user=approver)
    assert [r["id"] for r in client.get(f"{PROPOSALS}?state=waiting").json()["results"]] == [
        waiting.pk
    ]
    _stop(job, end)
    job.refresh_from_db()
    assert job.is_terminal, job.state
    waiting.refresh_from_db()
    assert waiting.state == ProposalState.STALE
    assert client.get(f"{PROPOSALS}?state=waiting").json()["results"] == []


def test_self_approval_is_a_409_with_its_own_code(api, project, member, job, approver):
    proposer = member(project, Role.APPROVER, "proposer")
    override = services.proposal_override(
        user=proposer, job=job, plan=events.plan_json(8), reason="more slots"
    )
    refused = _decide(api(user=proposer), override)
    assert refused.status_code == 409
    assert refused.json() == {
        "code": "self_approval",
        "message": errors.SELF_APPROVAL,
        "fields": {},
    }
    approved = _decide(api(user=approver), override)
    assert approved.status_code == 200
    assert (approved.json()["proposed_by"], approved.json()["decided_by"]) == (
        "proposer",
        "approver",
    )


# --- overrides ---------------------------------------------------------------------------------


def _override(client, job_id, body):
    return client.post(f"/api/v1/jobs/{job_id}/override/", body, format="json")


@pytest.fixture
def running(job):
    Job.objects.filter(pk=job.pk).update(state=JobState.RUNNING)
    job.refresh_from_db()
    return job


def test_an_operator_proposes_an_override_and_another_person_approves_it(
    api, project, member, running, approver
):
    proposer = member(project, Role.OPERATOR, "pat")
    response = _override(
        api(user=proposer), running.pk, {"plan": events.plan_json(8), "reason": "x"}
    )
    assert response.status_code == 201, response.content
    body = response.json()
    assert response["Location"] == f"{PROPOSALS}{body['id']}/"
    assert (body["job"], body["state"], body["proposed_by"]) == (running.pk, "waiting", "pat")
    assert (body["controller_id"], body["verdict"], body["reason"]) == (None, None, "x")
    assert body["plan"] == events.plan_json(8) and body["epoch"] == running.epoch
    assert running.events.filter(kind="proposal.override").exists()
    decided = _decide(api(user=approver), Proposal.objects.get(pk=body["id"]))
    assert decided.status_code == 200 and decided.json()["state"] == "approved"
    # What the job's driver reads between steps: the override with its plan.
    link = job_services._ControlLink(running.pk, running.epoch)
    link.after = 0
    assert link.commands() == [("override", {"plan": events.plan_json(8), "proposal": body["id"]})]


def test_a_rejected_override_asks_nothing_of_the_driver(api, project, member, running, approver):
    link = job_services._ControlLink(running.pk, running.epoch)
    proposer = member(project, Role.OPERATOR, "pat")
    body = _override(api(user=proposer), running.pk, {"plan": events.plan_json(8), "reason": "x"})
    rejected = _decide(api(user=approver), Proposal.objects.get(pk=body.json()["id"]), "reject")
    assert rejected.status_code == 200
    assert running.events.filter(kind="command.reject").exists() and link.commands() == []


def test_a_newer_override_makes_the_older_stale_and_only_the_newest_is_approved(
    api, project, member, running, approver
):
    """Two overrides waiting: the older could still be approved and both reached the job (found
    by review). The newer makes the older stale; approving it is a 409 naming the newer."""
    proposer = member(project, Role.OPERATOR, "pat")
    client = api(user=proposer)
    older = _override(client, running.pk, {"plan": events.plan_json(8), "reason": "eight"})
    newer = _override(client, running.pk, {"plan": events.plan_json(6), "reason": "six"})
    older_id, newer_id = older.json()["id"], newer.json()["id"]
    assert api(user=approver).get(f"{PROPOSALS}{older_id}/").json()["state"] == "stale"
    inbox = api(user=approver).get(PROPOSALS, {"state": "waiting"}).json()["results"]
    assert [p["id"] for p in inbox] == [newer_id]
    stale = running.events.get(kind="proposals.stale")
    assert stale.data["proposals"] == [older_id] and str(newer_id) in stale.data["reason"]

    for decision in ("approve", "reject"):
        refused = _decide(api(user=approver), Proposal.objects.get(pk=older_id), decision)
        assert refused.status_code == 409 and refused.json()["code"] == "not_waiting"
        assert refused.json()["message"] == errors.SUPERSEDED.format(
            proposal_id=older_id, newer=newer_id
        )
    approved = _decide(api(user=approver), Proposal.objects.get(pk=newer_id))
    assert approved.status_code == 200 and approved.json()["state"] == "approved"
    link = job_services._ControlLink(running.pk, running.epoch)
    assert link.commands() == [("override", {"plan": events.plan_json(6), "proposal": newer_id})]
    assert running.events.filter(kind="command.approve").count() == 1


def test_a_controllers_proposal_and_an_override_make_each_other_stale(
    api, project, member, running, approver
):
    """Whichever is newer is the one decided: a person's override after the controller's
    proposal makes it stale and tells the controller (``command.stale``, which the driver
    passes on); the controller's next proposal makes a waiting override stale."""
    first = _propose(running, controller_id=1)
    proposer = member(project, Role.OPERATOR, "pat")
    made = _override(api(user=proposer), running.pk, {"plan": events.plan_json(6), "reason": "x"})
    override_id = made.json()["id"]
    first.refresh_from_db()
    assert first.state == ProposalState.STALE
    refused = _decide(api(user=approver), first)
    assert refused.status_code == 409
    assert refused.json()["message"] == errors.SUPERSEDED.format(
        proposal_id=first.pk, newer=override_id
    )
    link = job_services._ControlLink(running.pk, running.epoch)
    assert link.commands() == [("stale", 1)]

    second = _propose(running, controller_id=2)
    assert Proposal.objects.get(pk=override_id).state == ProposalState.STALE
    refused = _decide(api(user=approver), Proposal.objects.get(pk=override_id))
    assert refused.status_code == 409
    assert refused.json()["message"] == errors.SUPERSEDED.format(
        proposal_id=override_id, newer=second.pk
    )
    assert _decide(api(user=approver), second).status_code == 200
    assert link.commands() == [("approve", 2)]


def test_an_older_proposal_still_waiting_is_found_stale_when_decided(api, running, approver):
    """Two proposals left waiting (stored before newer ones made older ones stale): deciding
    the older one refuses it and marks it stale, saying so to the job's pages."""
    now = timezone.now()
    rows = [
        Proposal.objects.create(
            job=running,
            epoch=running.epoch,
            controller_id=None,
            plan=events.plan_json(n),
            reason="stored",
            proposed_by=running.owner,
            expires_at=now + timedelta(hours=1),
        )
        for n in (8, 6)
    ]
    refused = _decide(api(user=approver), rows[0])
    assert refused.status_code == 409
    assert refused.json()["message"] == errors.SUPERSEDED.format(
        proposal_id=rows[0].pk, newer=rows[1].pk
    )
    rows[0].refresh_from_db()
    assert rows[0].state == ProposalState.STALE
    assert running.events.get(kind="proposals.stale").data["proposals"] == [rows[0].pk]
    assert _decide(api(user=approver), rows[1]).status_code == 200


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"reason": "more slots"}, "plan"),
        ({"plan": None, "reason": "more slots"}, "plan"),
        ({"plan": [1, 2], "reason": "more slots"}, "plan"),
        ({"plan": {"num_slots": 3}, "reason": "more slots"}, "plan"),
        ({"plan": "a plan", "reason": "more slots"}, "plan"),
        ({"plan": events.plan_json(8)}, "reason"),
        ({"plan": events.plan_json(8), "reason": "  "}, "reason"),
        ({"plan": events.plan_json(8), "reason": "x", "urgent": True}, "urgent"),
        ({"plan": events.plan_json(8), "reason": 7}, "reason"),
    ],
)
def test_bad_override_bodies_name_the_field(api, project, member, running, body, field):
    response = _override(api(user=member(project, Role.OPERATOR, "pat")), running.pk, body)
    assert response.status_code == 400, response.content
    assert list(_fields(response)) == [field]
    assert not Proposal.objects.exists()


def _tampered(change) -> dict:
    plan = events.plan_json(8)
    change(plan)
    return plan


def _set_first_stage(field, value):
    return lambda plan: plan["model_stages"][0].__setitem__(field, value)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda plan: plan.__setitem__("predicted_step_s", 10**400), "predicted_step_s"),
        (_set_first_stage("predicted_s", 10**400), "actor@generation.predicted_s"),
        (_set_first_stage("micro_batch", 10**400), "actor@generation.micro_batch"),
        (_set_first_stage("units", [[float(s)] for s in range(8)]), "actor@generation.units"),
        (
            _set_first_stage("units", [[True]] + [[s] for s in range(1, 8)]),
            "actor@generation.units",
        ),
        (_set_first_stage("name", 5), "name"),
        (_set_first_stage("name", "actor"), "name"),
        (lambda plan: plan.__setitem__("num_slots", 10**30), "num_slots"),
        (
            lambda plan: plan["stages"][0].__setitem__("predicted_s", "soon"),
            "generation.predicted_s",
        ),
    ],
)
def test_an_override_plan_with_values_of_the_wrong_kind_is_refused_naming_them(
    api, project, member, running, change, named
):
    """Found by review: such plans were accepted, then failed the running job when its driver
    applied them (a float slot id indexing a list, an integer too large for a float)."""
    body = {"plan": _tampered(change), "reason": "try it"}
    response = _override(api(user=member(project, Role.OPERATOR, "pat")), running.pk, body)
    assert response.status_code == 400, response.content
    (message,) = _fields(response)["plan"]
    assert f"{named}:" in message and len(message) < 300, message
    assert not Proposal.objects.exists()


def _nested(depth: int):
    value = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda plan: plan.__setitem__("note", "keep tp=2"), "plan.note: unknown field"),
        (
            _set_first_stage("layuot", {"dp": 1, "tp": 1, "pp": 1}),
            "plan.model_stages[0].layuot: unknown field",
        ),
        (
            lambda plan: plan["stages"][1].__setitem__("overlap", True),
            "not a plan: stages[1].overlap: unknown field",
        ),
        (_set_first_stage("breakdown", []), "not a plan: model_stages[0].breakdown: expected an"),
        (lambda plan: plan.__setitem__("models", None), "not a plan: models: expected an object"),
        (lambda plan: plan.__setitem__("note", _nested(600)), "plan.note: unknown field"),
        (lambda plan: plan.__setitem__("job", _nested(600)), "not a plan: job: expected text"),
        # PostgreSQL's jsonb cannot hold a NUL: storing one was a 500 (SQLite stored it)
        (lambda plan: plan.__setitem__("job", "a\x00b"), "plan.job: must not contain NUL"),
        (
            lambda plan: plan.__setitem__("accelerator", "cpu-slot\x00"),
            "plan.accelerator: must not contain NUL",
        ),
        (
            lambda plan: plan.__setitem__("models", {"actor": "tiny\x00"}),
            "plan.models.actor: must not contain NUL",
        ),
        (
            _set_first_stage("breakdown", {"gemm\x00": 1.0}),
            "plan.model_stages[0].breakdown: a key must not contain NUL",
        ),
        (
            _set_first_stage("name", "actor@generation\x00"),
            "plan.model_stages[0].name: must not contain NUL",
        ),
        (
            lambda plan: plan["stages"][0].__setitem__("stage", "generation\x00"),
            "plan.stages[0].stage: must not contain NUL",
        ),
    ],
)
def test_an_override_plan_with_a_field_the_runtime_does_not_read_is_refused_naming_it(
    api, project, member, running, change, message
):
    """Found by review: such fields were dropped without a word or stored as sent, and one
    nested some 500 deep made a 500 (a recursion error while storing it)."""
    body = {"plan": _tampered(change), "reason": "try it"}
    response = _override(api(user=member(project, Role.OPERATOR, "pat")), running.pk, body)
    assert response.status_code == 400, response.content
    (said,) = _fields(response)["plan"]
    assert said.startswith(message), said
    assert not Proposal.objects.exists()


def test_an_override_of_an_unknown_or_unseen_job_is_a_404_and_viewers_get_403(
    api, project, other_project, member, running
):
    body = {"plan": events.plan_json(8), "reason": "x"}
    operator = member(project, Role.OPERATOR, "pat")
    assert _override(api(user=operator), 987654, body).status_code == 404
    assert (
        _override(api(user=member(other_project, Role.ADMIN)), running.pk, body).status_code == 404
    )
    assert _override(api(user=member(project, Role.VIEWER)), running.pk, body).status_code == 403
    assert not Proposal.objects.exists()


@pytest.mark.parametrize("state", [JobState.CANCELLING, JobState.SUCCEEDED, JobState.FAILED])
def test_an_override_of_a_stopping_or_finished_job_is_a_409(api, project, member, job, state):
    Job.objects.filter(pk=job.pk).update(state=state)
    body = {"plan": events.plan_json(8), "reason": "x"}
    response = _override(api(user=member(project, Role.OPERATOR, "pat")), job.pk, body)
    assert response.status_code == 409
    assert response.json()["message"] == errors.OVERRIDE_JOB_STOPPED.format(
        job_id=job.pk, state=state
    )
    assert not Proposal.objects.exists()


def test_an_override_of_a_job_no_controller_drives_is_refused_naming_the_plan(api, project, member):
    owner = member(project, Role.OPERATOR, "owner")
    sft = make_job(owner=owner, project=project, state=JobState.RUNNING, spec={"num_slots": 2})
    response = _override(api(user=owner), sft.pk, {"plan": events.plan_json(8), "reason": "x"})
    assert response.status_code == 400
    assert _fields(response) == {"plan": [errors.OVERRIDE_FIXED.format(kind="sft")]}
    assert not Proposal.objects.exists()


@pytest.mark.parametrize("approved", [False, True], ids=["waiting", "approved"])
def test_an_override_given_before_a_driver_claims_the_job_reaches_that_driver(
    api, project, member, job, approver, approved
):
    """Given while the job waits in the queue (or between a lost driver and the next): the new
    driver's epoch takes it, where it went stale without a word."""
    proposer = member(project, Role.OPERATOR, "pat")
    made = _override(api(user=proposer), job.pk, {"plan": events.plan_json(8), "reason": "x"})
    row = Proposal.objects.get(pk=made.json()["id"])
    if approved:
        assert _decide(api(user=approver), row).status_code == 200
    _, epoch = job_services._claim_driver(job.pk)
    row.refresh_from_db()
    assert row.epoch == epoch and row.state == ("approved" if approved else "waiting")
    if not approved:
        assert _decide(api(user=approver), row).status_code == 200
    link = job_services._ControlLink(job.pk, epoch)
    assert link.commands() == [("override", {"plan": events.plan_json(8), "proposal": row.pk})]
    # A controller's own proposal from before is stale: its ids were the old driver's.
    stale = _propose(job, controller_id=3)
    Job.objects.filter(pk=job.pk).update(heartbeat_at=None)
    job_services._claim_driver(job.pk)
    stale.refresh_from_db()
    assert stale.state == ProposalState.STALE


def test_nereus_override_posts_the_plan_file_and_names_bad_input(
    api, project, member, running, monkeypatch, tmp_path, capsys
):
    """The CLI's command (``nereus.client_cli.override``) against the real view."""
    from nereus import client, client_cli
    from nereus.client import EXIT_OK, EXIT_USAGE

    operator = member(project, Role.OPERATOR, "pat")

    class Client(client.Client):
        """The real client's requests, answered by the test client instead of a socket."""

        def __init__(self):
            pass

        def _call(self, method, path, *, body=None, headers=None):
            response = api(user=operator).generic(
                method, path, json.dumps(body), content_type="application/json"
            )
            if response.status_code >= 400:
                raise client_cli.ApiError(
                    str(response.json()), exit_code=EXIT_USAGE, fields=response.json()["fields"]
                )
            return response.status_code, response.json()

    monkeypatch.setattr(client_cli, "_client", lambda url, token: Client())
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(events.plan_json(8)))
    common = {"job_id": running.pk, "as_json": False, "url": None, "token": None}

    assert client_cli.override(plan_file=str(plan_file), reason="more slots", **common) == EXIT_OK
    proposal = Proposal.objects.get()
    assert proposal.proposed_by == operator and proposal.plan == events.plan_json(8)
    assert capsys.readouterr().out.startswith(f"proposal {proposal.pk}: waiting (job {running.pk})")
    assert client_cli.override(plan_file=str(plan_file), reason=" ", **common) == EXIT_USAGE
    assert "nereus override: reason: required" in capsys.readouterr().err
    missing = str(tmp_path / "nope.json")
    assert client_cli.override(plan_file=missing, reason="x", **common) == EXIT_USAGE
    assert "nereus override: --plan: cannot read" in capsys.readouterr().err
    plan_file.write_text('{"num_slots": 3}')
    assert client_cli.override(plan_file=str(plan_file), reason="x", **common) == EXIT_USAGE
    assert "plan" in capsys.readouterr().err
    assert Proposal.objects.count() == 1


def test_the_schema_is_valid(api, approver):
    response = api(user=approver).get("/api/schema/", HTTP_ACCEPT="application/json")
    assert response.status_code == 200
    paths = response.json()["paths"]
    for path in (
        "/api/v1/jobs/{job_id}/plans/",
        "/api/v1/jobs/{job_id}/transitions/",
        "/api/v1/transitions/{transition_id}/",
        "/api/v1/proposals/",
        "/api/v1/proposals/{proposal_id}/",
        "/api/v1/proposals/{proposal_id}/approve/",
        "/api/v1/proposals/{proposal_id}/reject/",
        "/api/v1/jobs/{job_id}/override/",
    ):
        assert path in paths, path


@pytest.mark.parametrize("end", ["cancel-running", "cancel-pending", "succeeded"])
def test_an_approval_the_driver_never_took_goes_stale_when_the_job_ends(
    api, project, member, approver, end
):
    """The driver checks for a stop before it reads commands, so an approval given just before
    the job ended was never applied; it stayed 'approved' for ever (found by review). One the
    controller took (``control.approved``) stays approved."""
    owner = member(project, Role.OPERATOR, "ender")
    pending = end == "cancel-pending"
    job = make_job(
        owner=owner,
        project=project,
        epoch=1,
        state=JobState.PENDING if pending else JobState.RUNNING,
        spec=PpoSimJobSpec().to_json(),
    )
    if pending:
        proposal = services.proposal_override(
            user=owner, job=job, plan=events.plan_json(8), reason="r"
        )
        taken = None
    else:
        services.record_controller_event(job=job, event=events.proposal_event(1, 4, 8))
        services.record_controller_event(job=job, event=events.proposal_event(2, 4, 8))
        taken, proposal = Proposal.objects.filter(job=job).order_by("controller_id")
        assert proposal.state == ProposalState.WAITING  # the newer made the older stale
        Proposal.objects.filter(pk=taken.pk).update(state=ProposalState.APPROVED)
        job_services.job_event_append(
            job=job, epoch=1, kind="control.approved", data={"proposal": 1}
        )
    approved = api(user=approver).post(
        f"{PROPOSALS}{proposal.pk}/approve/", {"comment": "ok"}, format="json"
    )
    assert approved.status_code == 200 and approved.json()["state"] == "approved"
    if end == "succeeded":
        job_services._finish(job.pk, 1, JobState.SUCCEEDED)  # the last step ended first
    else:
        assert api(user=owner).post(f"/api/v1/jobs/{job.pk}/cancel/").status_code == 200
        if not pending:  # the driver sees the cancel at the step boundary, before commands
            job_services._finish(job.pk, 1, JobState.CANCELLED)
    job.refresh_from_db()
    proposal.refresh_from_db()
    assert job.is_terminal and proposal.state == ProposalState.STALE
    stale = job.events.get(kind="proposals.stale").data
    assert stale["proposals"] == [proposal.pk] and job.state in stale["reason"]
    if taken is not None:
        taken.refresh_from_db()
        assert taken.state == ProposalState.APPROVED


def test_an_approval_given_while_a_new_driver_sets_up_reaches_it(
    api, project, member, approver, no_live_delivery
):
    """Between claiming the job and building its control link (a PPO driver first claims its
    directory), an override was proposed and approved; the link started after that command and
    never handed it over (found by review)."""
    owner = member(project, Role.OPERATOR, "setter")
    job = make_job(owner=owner, project=project, spec={"kind": "ppo-sim"})
    _, epoch = job_services._claim_driver(job.pk)
    made = api(user=owner).post(
        f"/api/v1/jobs/{job.pk}/override/",
        {"plan": events.plan_json(8), "reason": "more"},
        format="json",
    )
    assert made.status_code == 201, made.content
    pid = made.json()["id"]
    decided = api(user=approver).post(
        f"{PROPOSALS}{pid}/approve/", {"comment": "ok"}, format="json"
    )
    assert decided.status_code == 200
    link = job_services._ControlLink(job.pk, epoch)
    assert link.commands() == [("override", {"plan": events.plan_json(8), "proposal": pid})]
