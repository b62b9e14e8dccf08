"""REST API: a job's plans and transitions, one transition with its DAG; scoping and tokens."""

from __future__ import annotations

import pytest

from tests.support import plans as events
from tests.support.jobs import make_job
from webapp.api.pagination import BAD_CURSOR
from webapp.jobs.models import JobState
from webapp.plans import services
from webapp.projects import services as project_services
from webapp.projects.models import Role

pytestmark = pytest.mark.django_db


def _fields(response) -> dict:
    body = response.json()
    assert set(body) == {"code", "message", "fields"}, body
    return body["fields"]


@pytest.fixture
def moved_job(project, member):
    """A job that started on 4 slots and moved to 8."""
    job = make_job(owner=member(project, Role.OPERATOR, "owner"), project=project, epoch=1)
    job.state = JobState.RUNNING
    job.save(update_fields=["state"])
    for event in (
        events.initial_event(4),
        events.decision_event(4, 8),
        events.transition_event(4, 8),
    ):
        services.record_controller_event(job=job, event=event)
    return job


def test_plans_are_listed_newest_first_with_the_current_one_marked(api, project, member, moved_job):
    viewer = member(project, Role.VIEWER)
    response = api(user=viewer).get(f"/api/v1/jobs/{moved_job.pk}/plans/")
    assert response.status_code == 200, response.json()
    rows = response.json()["results"]
    assert [(r["plan"]["num_slots"], r["current"], r["reason"]) for r in rows] == [
        (8, True, "transition"),
        (8, False, "initial"),
    ]
    assert [
        len({s for ms in r["plan"]["model_stages"] for u in ms["units"] for s in u}) for r in rows
    ] == [8, 4]
    assert rows[0]["predicted_step_s"] == pytest.approx(rows[0]["plan"]["predicted_step_s"])
    assert rows[0]["predicted_step_s"] < rows[1]["predicted_step_s"]


def test_transitions_list_without_dags_and_detail_with_one(api, project, member, moved_job):
    client = api(user=member(project, Role.VIEWER))
    listed = client.get(f"/api/v1/jobs/{moved_job.pk}/transitions/")
    assert listed.status_code == 200
    (row,) = listed.json()["results"]
    assert "dag" not in row
    plans = client.get(f"/api/v1/jobs/{moved_job.pk}/plans/").json()["results"]
    assert (row["from_plan"], row["to_plan"]) == (plans[1]["id"], plans[0]["id"])
    assert row["state"] == "done" and row["num_nodes"] > 0 and row["simulated"]
    assert row["actual_s"] == pytest.approx(row["predicted_s"] * 1.1)
    detail = client.get(f"/api/v1/transitions/{row['id']}/")
    assert detail.status_code == 200
    body = detail.json()
    assert body["dag"] == events.dag_json(4, 8)
    assert len(body["dag"]["nodes"]) == row["num_nodes"] and body["dag"]["critical_path"]
    assert {k: body[k] for k in row} == row


def test_lists_are_cursor_paginated(api, project, member, moved_job):
    for num_slots in (2, 6, 8):
        services.record_controller_event(job=moved_job, event=events.initial_event(num_slots))
    client = api(user=member(project, Role.VIEWER))
    url = f"/api/v1/jobs/{moved_job.pk}/plans/?limit=3"
    first = client.get(url).json()
    assert len(first["results"]) == 3 and first["next"]
    second = client.get(first["next"]).json()
    assert len(second["results"]) == 2 and second["next"] is None
    ids = [r["id"] for r in first["results"] + second["results"]]
    assert ids == sorted(ids, reverse=True)
    bad = client.get(f"/api/v1/jobs/{moved_job.pk}/plans/?cursor=zzz")
    assert bad.status_code == 400 and _fields(bad) == {"cursor": [BAD_CURSOR]}


def test_another_projects_job_and_transition_are_not_found(
    api, other_project, member, moved_job, token_for
):
    transition = moved_job.transitions.get()
    for client in (
        api(user=member(other_project, Role.ADMIN)),
        api(secret=token_for(other_project)),
    ):
        for url in (
            f"/api/v1/jobs/{moved_job.pk}/plans/",
            f"/api/v1/jobs/{moved_job.pk}/transitions/",
            f"/api/v1/transitions/{transition.pk}/",
            "/api/v1/transitions/999999/",
        ):
            response = client.get(url)
            assert response.status_code == 404, url
            assert response.json()["code"] == "not_found"


def test_tokens_read_their_project_and_revoked_ones_are_refused(api, project, member, moved_job):
    admin = member(project, Role.ADMIN, "boss")
    token, secret = project_services.token_create(
        user=admin, project=project, name="ci", role=Role.VIEWER
    )
    url = f"/api/v1/jobs/{moved_job.pk}/plans/"
    assert api(secret=secret).get(url).status_code == 200
    project_services.token_revoke(user=admin, project=project, token_id=token.pk)
    refused = api(secret=secret).get(url)
    assert refused.status_code == 401 and set(refused.json()) == {"code", "message", "fields"}
    assert api().get(url).status_code == 401
