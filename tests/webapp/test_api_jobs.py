"""REST API ``/api/v1/jobs/``: submit, idempotency, list with filters and cursors, retrieve,
cancel, events; who may do what; bad input is a 400 naming the field, never a 500."""

from __future__ import annotations

import base64
import threading
from urllib.parse import parse_qs, urlencode, urlsplit

import pytest
from django.db import connection

from tests.support.jobs import make_job
from webapp.api.exceptions import INVALID_INPUT
from webapp.api.inputs import UNKNOWN_FIELD
from webapp.api.jobs import BAD_IDEMPOTENCY_KEY, NO_SUCH_PROJECT, SPEC_NOT_OBJECT
from webapp.api.pagination import BAD_CURSOR
from webapp.jobs import errors, services
from webapp.jobs.models import Job, JobState
from webapp.projects.models import Role

pytestmark = pytest.mark.django_db

JOBS = "/api/v1/jobs/"
BODY = {"project": "ml", "name": "ci-run", "spec": {"num_slots": 2, "num_steps": 5}}


def _fields(response) -> dict:
    body = response.json()
    assert set(body) == {"code", "message", "fields"}, body
    return body["fields"]


# --- submit ------------------------------------------------------------------------------------


def test_submit_with_a_token_stores_the_job_and_enqueues_it_on_commit(
    api, project, token_for, django_capture_on_commit_callbacks, monkeypatch
):
    from webapp.jobs import tasks

    enqueued = []
    monkeypatch.setattr(tasks.job_drive, "delay", enqueued.append)
    monkeypatch.setattr(services, "_publish", lambda group, message: None)
    client = api(secret=token_for(project))
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = client.post(JOBS, BODY, format="json")
    assert response.status_code == 201, response.json()
    body = response.json()
    assert response["Location"] == f"{JOBS}{body['id']}/"
    assert (body["project"], body["name"], body["state"]) == ("ml", "ci-run", "pending")
    assert body["spec"]["num_slots"] == 2 and body["spec"]["seed"] == 0  # defaults filled in
    assert enqueued == []  # nothing leaves before the transaction commits
    for callback in callbacks:
        callback()
    assert enqueued == [body["id"]]
    assert Job.objects.get(pk=body["id"]).project == project


def test_submit_without_a_project_uses_the_tokens_project_or_the_personal_one(
    api, project, token_for, make_user
):
    body = {"name": "n", "spec": {}}
    by_token = api(secret=token_for(project)).post(JOBS, body, format="json")
    assert by_token.status_code == 201 and by_token.json()["project"] == "ml"
    carol = make_user("carol")
    by_session = api(user=carol).post(JOBS, body, format="json")
    assert by_session.status_code == 201
    assert by_session.json()["project"] == f"user-{carol.pk}"


def test_viewers_cannot_submit(api, project, member, token_for):
    viewer = member(project, Role.VIEWER)
    assert api(user=viewer).post(JOBS, BODY, format="json").status_code == 403
    assert (
        api(secret=token_for(project, Role.VIEWER)).post(JOBS, BODY, format="json").status_code
        == 403
    )
    assert not Job.objects.exists()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({**BODY, "spec": {"num_slots": 0}}, "spec.num_slots"),
        ({**BODY, "spec": {"num_slots": "two"}}, "spec.num_slots"),
        ({**BODY, "spec": {"slots": 2}}, "spec.slots"),
        ({**BODY, "spec": {"hidden": 65, "num_heads": 4}}, "spec.hidden"),
        ({**BODY, "spec": {"lr": 2.5}}, "spec.lr"),
        ({**BODY, "spec": {"lr": 10**400}}, "spec.lr"),  # past a float's range: not a 500
        ({**BODY, "spec": {"seed": 10**30}}, "spec.seed"),  # past torch's seed: not a worker crash
        ({**BODY, "spec": {"kind": "ppo-sim", "seed": -1}}, "spec.seed"),
        ({**BODY, "spec": {"kind": "ppo-sim", "trace_hours": 10**400}}, "spec.trace_hours"),
        ({**BODY, "spec": {"kind": "ppo-sim", "policy": {"gamma": 10**400}}}, "spec.policy.gamma"),
        (
            {**BODY, "spec": {"kind": "ppo-sim", "policy": {"fixed_layouts": "no"}}},
            "spec.policy.fixed_layouts",  # a non-empty string once turned fixed layouts on
        ),
        ({**BODY, "spec": [1, 2]}, "spec"),
        ({**BODY, "spec": None}, "spec"),
        ({"project": "ml", "spec": {}}, "name"),
        ({**BODY, "name": ""}, "name"),
        ({**BODY, "name": "x" * 201}, "name"),
        ({**BODY, "name": ["a"]}, "name"),
        ({**BODY, "project": "nope"}, "project"),
        ({**BODY, "project": "other"}, "project"),  # exists, but not yours: the same answer
        ({**BODY, "project": "Not a slug!"}, "project"),
        ({**BODY, "specs": {}}, "specs"),
        ([BODY], "non_field_errors"),
        ("just a string", "non_field_errors"),
    ],
)
def test_bad_submissions_name_the_field(api, project, other_project, member, body, field):
    operator = member(project, Role.OPERATOR)
    response = api(user=operator).post(JOBS, body, format="json")
    assert response.status_code == 400, response.content
    fields = _fields(response)
    assert field in fields, fields
    assert response.json()["message"] == INVALID_INPUT
    assert not Job.objects.exists()


def test_spec_field_errors_carry_the_runtime_message(api, project, member):
    response = api(user=member(project, Role.OPERATOR)).post(
        JOBS, {**BODY, "spec": {"num_slots": 0}}, format="json"
    )
    assert _fields(response)["spec.num_slots"] == ["expected 1 <= num_slots <= 64, got 0"]
    client = api(user=member(project, Role.OPERATOR, "op2"))
    unknown = client.post(JOBS, {**BODY, "extra": 1}, format="json")
    assert _fields(unknown) == {"extra": [UNKNOWN_FIELD]}
    assert _fields(client.post(JOBS, {**BODY, "spec": []}, format="json")) == {
        "spec": [SPEC_NOT_OBJECT]
    }


def test_unreadable_bodies_are_400_or_415_never_500(api, project, member):
    client = api(user=member(project, Role.OPERATOR))
    broken = client.post(JOBS, "{not json", content_type="application/json")
    assert broken.status_code == 400 and broken.json()["code"] == "parse_error"
    form = client.post(JOBS, {"name": "x"})  # multipart
    assert form.status_code == 415
    assert _fields(client.post(JOBS, BODY | {"project": "ml\x00"}, format="json"))["project"]
    # Found by audit: a name that retitles the terminal of whoever prints it, or fakes a line
    named = _fields(client.post(JOBS, BODY | {"name": "ok\x1b]0;pwned\x07\r\nfake"}, format="json"))
    assert named == {"name": ["must not hold control characters (found U+001B)"]}
    assert _fields(client.post(JOBS, BODY | {"name": "a\nb"}, format="json"))["name"]
    for body in (
        "[" * 100_000 + "]" * 100_000,
        '{"name": "x", "spec": ' + "[" * 100_000 + "]" * 100_000 + "}",
    ):
        deep = client.post(JOBS, body, content_type="application/json")
        assert deep.status_code == 400 and deep.json()["code"] == "parse_error", deep.content
        assert "nested too deeply" in deep.json()["message"]
    assert not Job.objects.exists()


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ('{"name": "x", "spec": {}, "\\ud800": 1}', "body (a key)"),
        ('{"name": "x", "spec": {"\\ud800": 1}}', "body.spec (a key)"),
        (
            '{"name": "x", "spec": {"kind": "ppo-sim", "policy": {"thresholds": {"\\udc00": 1}}}}',
            "body.spec.policy.thresholds (a key)",
        ),
        ('{"name": "x", "spec": {"tags": ["ok", "\\ud83d"]}}', "body.spec.tags[1]"),
    ],
)
def test_a_lone_surrogate_anywhere_in_the_body_is_a_400_naming_where(
    api, project, member, body, where
):
    """JSON may escape a lone UTF-16 surrogate, which no UTF-8 text can hold: echoing it in an
    error message (an unknown key) used to fail while rendering, a 500."""
    response = api(user=member(project, Role.OPERATOR)).post(
        JOBS, body, content_type="application/json"
    )
    assert response.status_code == 400 and response.json()["code"] == "parse_error"
    assert where in response.json()["message"]
    assert not Job.objects.exists()


# --- idempotency -------------------------------------------------------------------------------


def test_the_same_key_and_body_return_the_same_job(api, project, token_for):
    client = api(secret=token_for(project))
    first = client.post(JOBS, BODY, format="json", HTTP_IDEMPOTENCY_KEY="run-42")
    again = client.post(JOBS, BODY, format="json", HTTP_IDEMPOTENCY_KEY="run-42")
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"]
    assert again["Idempotent-Replayed"] == "true"
    # key order and spacing do not make a different body
    reordered = client.post(
        JOBS,
        '{"spec": {"num_steps": 5, "num_slots": 2}, "name": "ci-run",  "project": "ml"}',
        content_type="application/json",
        HTTP_IDEMPOTENCY_KEY="run-42",
    )
    assert reordered.status_code == 200 and reordered.json()["id"] == first.json()["id"]
    assert Job.objects.count() == 1
    other_key = client.post(JOBS, BODY, format="json", HTTP_IDEMPOTENCY_KEY="run-43")
    assert other_key.status_code == 201 and other_key.json()["id"] != first.json()["id"]


def test_the_same_key_with_another_body_is_a_conflict(api, project, token_for):
    client = api(secret=token_for(project))
    assert client.post(JOBS, BODY, format="json", HTTP_IDEMPOTENCY_KEY="k").status_code == 201
    changed = {**BODY, "spec": {"num_slots": 1, "num_steps": 5}}
    response = client.post(JOBS, changed, format="json", HTTP_IDEMPOTENCY_KEY="k")
    assert response.status_code == 409
    assert response.json() == {
        "code": "idempotency_key_reused",
        "message": errors.IDEMPOTENCY_MISMATCH.format(key="k"),
        "fields": {},
    }
    assert Job.objects.count() == 1


def test_keys_belong_to_their_user(api, project, member):
    one, two = member(project, Role.OPERATOR, "one"), member(project, Role.OPERATOR, "two")
    a = api(user=one).post(JOBS, BODY, format="json", HTTP_IDEMPOTENCY_KEY="same")
    b = api(user=two).post(JOBS, BODY, format="json", HTTP_IDEMPOTENCY_KEY="same")
    assert (a.status_code, b.status_code) == (201, 201) and a.json()["id"] != b.json()["id"]


def test_a_token_of_another_project_cannot_replay_a_key_into_a_job_it_cannot_see(
    api, project, other_project, member
):
    from webapp.projects import services as project_services

    user = member(project, Role.ADMIN, "both")
    project_services.membership_set(project=other_project, user=user, role=Role.ADMIN)
    _, secret = project_services.token_create(user=user, project=other_project, name="t")
    assert (
        api(user=user).post(JOBS, BODY, format="json", HTTP_IDEMPOTENCY_KEY="k").status_code == 201
    )
    response = api(secret=secret).post(JOBS, BODY, format="json", HTTP_IDEMPOTENCY_KEY="k")
    # the body names project "ml", which the token cannot see
    assert response.status_code == 400 and "project" in _fields(response)
    body = {"name": "ci-run", "spec": BODY["spec"]}
    api(user=user).post(JOBS, body, format="json", HTTP_IDEMPOTENCY_KEY="k2")  # personal project
    response = api(secret=secret).post(JOBS, body, format="json", HTTP_IDEMPOTENCY_KEY="k2")
    assert response.status_code == 409


@pytest.mark.parametrize("key", ["", "x" * 256, "clé", "tab\there"])
def test_bad_idempotency_keys_are_field_errors(api, project, token_for, key):
    response = api(secret=token_for(project)).post(
        JOBS, BODY, format="json", HTTP_IDEMPOTENCY_KEY=key
    )
    assert response.status_code == 400
    assert _fields(response) == {"Idempotency-Key": [BAD_IDEMPOTENCY_KEY]}


@pytest.mark.skipif(
    connection.vendor != "postgresql", reason="relies on PostgreSQL's row-level write concurrency"
)
@pytest.mark.django_db(transaction=True)
def test_concurrent_requests_with_one_key_make_one_job(project, member, monkeypatch):
    """Both requests pass the lookup before either inserts; the unique constraint decides."""
    user = member(project, Role.OPERATOR)
    barrier = threading.Barrier(2, timeout=20)
    real_submit = services.job_submit

    def submit_after_both_looked(**kwargs):
        barrier.wait()
        return real_submit(**kwargs)

    monkeypatch.setattr(services, "job_submit", submit_after_both_looked)
    monkeypatch.setattr(services, "_enqueue_driver", lambda job_id: None)
    results: list = [None, None]

    def run(index: int) -> None:
        try:
            results[index] = services.job_submit_idempotent(
                user=user,
                name="n",
                spec={},
                project=project,
                idempotency_key="race",
                body={"name": "n", "spec": {}},
            )
        except Exception as exc:  # reported below, in the test's thread
            results[index] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert all(isinstance(r, tuple) for r in results), results
    (job_a, replayed_a), (job_b, replayed_b) = results
    assert job_a.pk == job_b.pk and sorted([replayed_a, replayed_b]) == [False, True]
    assert Job.objects.count() == 1


# --- list, retrieve ----------------------------------------------------------------------------


def test_list_shows_only_visible_jobs_and_filters(api, project, other_project, member):
    viewer = member(project, Role.VIEWER)
    mine = make_job(owner=viewer, project=project, name="mine")
    running = make_job(owner=viewer, project=project, name="running", state=JobState.RUNNING)
    outsider = member(other_project, Role.ADMIN)
    make_job(owner=outsider, project=other_project, name="secret")
    make_job(owner=viewer, name="personal")
    client = api(user=viewer)

    names = [j["name"] for j in client.get(JOBS).json()["results"]]
    assert names == ["personal", "running", "mine"]
    only_running = client.get(JOBS, {"state": "running"}).json()["results"]
    assert [j["id"] for j in only_running] == [running.pk]
    in_ml = client.get(JOBS, {"project": "ml"}).json()["results"]
    assert [j["id"] for j in in_ml] == [running.pk, mine.pk]
    for bad, field in [({"state": "sleeping"}, "state"), ({"project": "other"}, "project")]:
        response = client.get(JOBS, bad)
        assert response.status_code == 400 and field in _fields(response), bad
    assert _fields(client.get(JOBS, {"project": "other"}))["project"] == [NO_SUCH_PROJECT]


def test_cursor_pagination_walks_every_job_once_newest_first(api, project, member):
    viewer = member(project, Role.VIEWER)
    ids = [make_job(owner=viewer, project=project, name=f"j{i}").pk for i in range(7)]
    client, url, seen, pages = api(user=viewer), f"{JOBS}?limit=3", [], 0
    while url:
        page = client.get(url).json()
        seen += [j["id"] for j in page["results"]]
        url, pages = page["next"], pages + 1
        # a job submitted while paging never shifts the pages already handed out
        if pages == 1:
            make_job(owner=viewer, project=project, name="late")
    assert seen == sorted(ids, reverse=True) and pages == 3
    first = client.get(f"{JOBS}?limit=3").json()
    back = client.get(client.get(first["next"]).json()["previous"]).json()
    assert [j["id"] for j in back["results"]] == [j["id"] for j in first["results"]]


@pytest.mark.parametrize(
    "cursor",
    [
        "garbage",
        base64.b64encode(b"p=abc").decode(),
        base64.b64encode(b"p=99999999999999999999999").decode(),
        base64.b64encode(b"p=" + b"9" * 5000).decode(),  # past int()'s 4,300 digits: was a 500
        base64.b64encode(b"o=x").decode(),
    ],
)
def test_unreadable_cursors_are_field_errors(api, project, member, cursor):
    response = api(user=member(project, Role.VIEWER)).get(f"{JOBS}?{urlencode({'cursor': cursor})}")
    assert response.status_code == 400 and _fields(response) == {"cursor": [BAD_CURSOR]}


@pytest.mark.parametrize("limit", ["abc", "0", "-5", "201", "2.5", ""])
def test_a_page_size_that_is_not_1_to_200_is_a_field_error(api, project, member, limit):
    """It was read as the default page (and one above 200 as 200), where the events endpoint
    answers 400 on ``limit``: every list does now (found by review)."""
    viewer = member(project, Role.VIEWER)
    job = make_job(owner=viewer, project=project)
    client = api(user=viewer)
    for url in (JOBS, f"{JOBS}{job.pk}/plans/", f"{JOBS}{job.pk}/transitions/"):
        response = client.get(url, {"limit": limit})
        assert response.status_code == 400, (url, response.content)
        assert list(_fields(response)) == ["limit"], (url, response.content)
    assert len(client.get(JOBS, {"limit": "200"}).json()["results"]) == 1


def test_retrieve_and_the_404_of_other_projects(api, project, other_project, member, token_for):
    viewer = member(project, Role.VIEWER)
    job = make_job(owner=viewer, project=project)
    body = api(user=viewer).get(f"{JOBS}{job.pk}/").json()
    assert (body["id"], body["project"], body["owner"]) == (job.pk, "ml", viewer.get_username())
    outsider = member(other_project, Role.ADMIN)
    for client in (api(user=outsider), api(secret=token_for(other_project, Role.ADMIN))):
        for path in ("", "events/"):
            assert client.get(f"{JOBS}{job.pk}/{path}").status_code == 404
        assert client.post(f"{JOBS}{job.pk}/cancel/").status_code == 404
    assert api(user=viewer).get(f"{JOBS}{2**70}/").status_code == 404
    assert api(user=viewer).get(f"{JOBS}{job.pk + 1000}/").json()["code"] == "not_found"


def test_a_token_sees_only_its_own_project(api, project, other_project, member):
    from webapp.projects import services as project_services

    user = member(project, Role.ADMIN, "both")
    project_services.membership_set(project=other_project, user=user, role=Role.ADMIN)
    elsewhere = make_job(owner=user, project=other_project)
    _, secret = project_services.token_create(user=user, project=project, name="ml-only")
    client = api(secret=secret)
    assert client.get(f"{JOBS}{elsewhere.pk}/").status_code == 404
    assert client.get(JOBS).json()["results"] == []
    assert api(user=user).get(f"{JOBS}{elsewhere.pk}/").status_code == 200


# --- cancel ------------------------------------------------------------------------------------


def test_operators_cancel_viewers_get_403_and_finished_jobs_409(api, project, member, token_for):
    job = make_job(owner=member(project, Role.ADMIN), project=project)
    viewer_response = api(user=member(project, Role.VIEWER)).post(f"{JOBS}{job.pk}/cancel/")
    assert (
        viewer_response.status_code == 403 and viewer_response.json()["code"] == "permission_denied"
    )
    token_response = api(secret=token_for(project, Role.VIEWER)).post(f"{JOBS}{job.pk}/cancel/")
    assert token_response.status_code == 403
    job.refresh_from_db()
    assert job.state == JobState.PENDING

    response = api(secret=token_for(project, Role.OPERATOR)).post(f"{JOBS}{job.pk}/cancel/")
    assert response.status_code == 200 and response.json()["state"] == "cancelled"
    again = api(user=member(project, Role.OPERATOR)).post(f"{JOBS}{job.pk}/cancel/")
    assert again.status_code == 409
    assert again.json()["message"] == errors.JOB_FINISHED.format(job_id=job.pk, state="cancelled")


def test_a_running_job_is_asked_to_stop(api, project, member):
    job = make_job(owner=member(project, Role.ADMIN), project=project, state=JobState.RUNNING)
    response = api(user=member(project, Role.APPROVER)).post(f"{JOBS}{job.pk}/cancel/")
    assert response.status_code == 200 and response.json()["state"] == "cancelling"


# --- events ------------------------------------------------------------------------------------


def test_events_since_an_id_in_order_and_in_pages(api, project, member):
    viewer = member(project, Role.VIEWER)
    job = make_job(owner=viewer, project=project)
    ids = [
        services.job_event_append(job=job, epoch=0, kind="step", data={"n": n}).pk for n in range(5)
    ]
    client = api(user=viewer)
    page = client.get(f"{JOBS}{job.pk}/events/").json()
    assert [e["id"] for e in page["results"]] == ids and page["next"] is None
    assert page["results"][0] == {
        "id": ids[0],
        "job": job.pk,
        "epoch": 0,
        "kind": "step",
        "data": {"n": 0},
        "at": page["results"][0]["at"],
    }
    page = client.get(f"{JOBS}{job.pk}/events/", {"after": ids[1], "limit": 2}).json()
    assert [e["data"]["n"] for e in page["results"]] == [2, 3]
    assert parse_qs(urlsplit(page["next"]).query) == {"after": [str(ids[3])], "limit": ["2"]}
    rest = client.get(page["next"]).json()
    assert [e["id"] for e in rest["results"]] == [ids[4]] and rest["next"] is None


@pytest.mark.parametrize(
    "query", [{"after": "-1"}, {"after": "x"}, {"after": str(2**64)}, {"limit": "0"}]
)
def test_bad_event_queries_are_field_errors(api, project, member, query):
    viewer = member(project, Role.VIEWER)
    job = make_job(owner=viewer, project=project)
    response = api(user=viewer).get(f"{JOBS}{job.pk}/events/", query)
    assert response.status_code == 400 and set(_fields(response)) == set(query)
