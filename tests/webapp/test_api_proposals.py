"""REST API ``/api/v1/proposals/``: the approvals inbox, one proposal, approve and reject; who may
decide, the required comment, self-approval, state conflicts; bad input names the field."""

from __future__ import annotations

import pytest

from tests.support import plans as events
from tests.support.jobs import make_job
from webapp.api.exceptions import INVALID_INPUT
from webapp.api.jobs import NO_SUCH_PROJECT, UNKNOWN_FIELD
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
    return make_job(owner=member(project, Role.OPERATOR, "owner"), project=project, epoch=1)


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
    ):
        assert path in paths, path
