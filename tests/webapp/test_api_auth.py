"""REST API authentication and the token endpoints: bearer tokens beside sessions; revoked,
unknown or malformed tokens get 401; tokens are managed from a session by project admins; the
OpenAPI schema covers /api/v1/."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from tests.support.jobs import make_job
from webapp.api.authentication import MALFORMED_HEADER
from webapp.api.projects import SESSION_ONLY
from webapp.projects import errors
from webapp.projects import services as project_services
from webapp.projects.models import ApiToken, Membership, Role

pytestmark = pytest.mark.django_db

JOBS = "/api/v1/jobs/"


def _tokens(slug: str) -> str:
    return f"/api/v1/projects/{slug}/tokens/"


def test_no_credentials_is_a_401_naming_the_scheme(client):
    response = client.get(JOBS)
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == 'Bearer realm="nereus"'
    assert response.json()["code"] == "not_authenticated"


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ("Bearer nrs_nobody-knows-this-one", errors.TOKEN_INVALID),
        ("Bearer", MALFORMED_HEADER),
        ("Bearer a b", MALFORMED_HEADER),
        ("bearer garbage", errors.TOKEN_INVALID),
    ],
)
def test_unknown_or_malformed_tokens_are_401(client, header, message):
    response = client.get(JOBS, HTTP_AUTHORIZATION=header)
    assert response.status_code == 401
    assert response.json() == {"code": "authentication_failed", "message": message, "fields": {}}


def test_a_non_ascii_token_is_401_not_500(project):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Bearer nrs_é".encode().decode("latin-1"))
    assert client.get(JOBS).status_code == 401


def test_a_revoked_token_is_401_even_on_a_job_it_could_see(api, project, member, token_for):
    admin = member(project, Role.ADMIN)
    job = make_job(owner=admin, project=project)
    secret = token_for(project, Role.OPERATOR, admin=admin)
    client = api(secret=secret)
    assert client.get(f"{JOBS}{job.pk}/").status_code == 200
    token = ApiToken.objects.get()
    assert secret.startswith(token.prefix)
    assert token.last_used_at is not None
    revoke = api(user=admin).post(f"{_tokens('ml')}{token.pk}/revoke/")
    assert revoke.status_code == 200 and revoke.json()["revoked_at"] is not None
    for response in (client.get(f"{JOBS}{job.pk}/"), client.post(f"{JOBS}{job.pk}/cancel/")):
        assert response.status_code == 401
        assert response.json()["message"] == errors.TOKEN_INVALID


def test_a_removed_member_s_tokens_stay_ended_when_they_are_added_back(api, project, member):
    ada = member(project, Role.ADMIN, "ada")
    job = make_job(owner=ada, project=project)
    kept = member(project, Role.ADMIN, "kim")
    _, secret = project_services.token_create(user=ada, project=project, name="ci", role="admin")
    _, other = project_services.token_create(user=kept, project=project, name="ci2", role="admin")
    assert api(secret=secret).get(f"{JOBS}{job.pk}/").status_code == 200
    Membership.objects.filter(user=ada, project=project).delete()  # as the admin site does
    project_services.membership_set(project=project, user=ada, role=Role.VIEWER)
    assert api(secret=secret).get(f"{JOBS}{job.pk}/").status_code == 401
    assert api(secret=other).get(f"{JOBS}{job.pk}/").status_code == 200  # another member's


def test_a_demotion_ends_the_member_s_tokens_above_their_new_role(api, project, member):
    ada = member(project, Role.ADMIN, "ada")
    job = make_job(owner=ada, project=project)
    made = {
        role: project_services.token_create(user=ada, project=project, name=role, role=role)[1]
        for role in (Role.ADMIN, Role.OPERATOR, Role.VIEWER)
    }
    project_services.membership_set(project=project, user=ada, role=Role.OPERATOR)
    project_services.membership_set(project=project, user=ada, role=Role.ADMIN)  # promoted again
    seen = {role: api(secret=s).get(f"{JOBS}{job.pk}/").status_code for role, s in made.items()}
    assert seen == {Role.ADMIN: 401, Role.OPERATOR: 200, Role.VIEWER: 200}


def test_a_token_given_a_lifetime_stops_working_when_it_ends(api, project, member):
    admin = member(project, Role.ADMIN)
    made = api(user=admin).post(
        _tokens("ml"), {"name": "ci", "role": "viewer", "expires_in_days": 30}, format="json"
    )
    assert made.status_code == 201
    body = made.json()
    token = ApiToken.objects.get(pk=body["id"])
    left = token.expires_at - timezone.now()
    assert timedelta(days=29, hours=23) < left <= timedelta(days=30) and body["expires_at"]
    assert api(secret=body["secret"]).get(JOBS).status_code == 200
    ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now())
    expired = api(secret=body["secret"]).get(JOBS)
    assert expired.status_code == 401 and expired.json()["message"] == errors.TOKEN_EXPIRED
    forever = api(user=admin).post(_tokens("ml"), {"name": "x"}, format="json").json()
    assert forever["expires_at"] is None
    for days in (0, 3651, 1.5, "30", True):
        bad = api(user=admin).post(
            _tokens("ml"), {"name": "y", "expires_in_days": days}, format="json"
        )
        assert bad.status_code == 400 and list(bad.json()["fields"]) == ["expires_in_days"], days


def test_the_answer_that_carries_a_new_secret_is_not_cached(api, project, member):
    admin = member(project, Role.ADMIN)
    response = api(user=admin).post(_tokens("ml"), {"name": "ci"}, format="json")
    assert response.status_code == 201 and response["Cache-Control"] == "no-store"


def test_session_login_works_beside_tokens(client, project, member):
    viewer = member(project, Role.VIEWER)
    make_job(owner=viewer, project=project)
    client.force_login(viewer)
    assert len(client.get(JOBS).json()["results"]) == 1
    # a session write without the CSRF token is refused (the browser case)
    csrf_client = type(client)(enforce_csrf_checks=True)
    csrf_client.force_login(viewer)
    assert csrf_client.post(JOBS, {}, content_type="application/json").status_code == 403


def test_admins_issue_tokens_whose_secret_is_shown_once(api, project, member):
    admin = member(project, Role.ADMIN)
    response = api(user=admin).post(_tokens("ml"), {"name": "ci", "role": "viewer"}, format="json")
    assert response.status_code == 201
    created = response.json()
    secret = created["secret"]
    assert created["role"] == "viewer" and secret.startswith(created["prefix"])
    listed = api(user=admin).get(_tokens("ml")).json()
    assert [t["id"] for t in listed] == [created["id"]] and "secret" not in listed[0]
    assert secret not in api(user=admin).get(_tokens("ml")).content.decode()
    assert api(secret=secret).get(JOBS).status_code == 200
    bad = api(user=admin).post(_tokens("ml"), {"name": "", "role": "god"}, format="json")
    assert bad.status_code == 400 and set(bad.json()["fields"]) == {"name", "role"}
    # A misspelt field is refused, not dropped for the default role (operator, above what was
    # asked for); a name is text, not a number made into one.
    for body, field in (
        ({"name": "t", "rol": "viewer"}, "rol"),
        ({"name": "t", "project": "other"}, "project"),
        ({"name": 1.5}, "name"),
    ):
        refused = api(user=admin).post(_tokens("ml"), body, format="json")
        assert refused.status_code == 400 and list(refused.json()["fields"]) == [field], body
    # One active token per name, as on the project page (found by audit: the API made two).
    again = api(user=admin).post(_tokens("ml"), {"name": "ci", "role": "viewer"}, format="json")
    assert again.status_code == 409 and again.json()["code"] == "name_taken"
    assert list(again.json()["fields"]) == ["name"] and "active already" in again.json()["message"]
    assert len(api(user=admin).get(_tokens("ml")).json()) == 1
    api(user=admin).post(f"{_tokens('ml')}{created['id']}/revoke/")
    assert api(user=admin).post(_tokens("ml"), {"name": "ci"}, format="json").status_code == 201


def test_token_endpoints_need_an_admin_session(api, project, other_project, member, token_for):
    operator = member(project, Role.OPERATOR)
    assert api(user=operator).get(_tokens("ml")).status_code == 403
    assert api(user=operator).post(_tokens("ml"), {"name": "x"}, format="json").status_code == 403
    assert api(user=operator).get(_tokens("other")).status_code == 404
    assert api(user=operator).get(_tokens("missing")).status_code == 404
    admin_token = api(secret=token_for(project, Role.ADMIN))
    response = admin_token.post(_tokens("ml"), {"name": "x"}, format="json")
    assert response.status_code == 403 and response.json()["message"] == SESSION_ONLY


def test_projects_list_shows_my_role_and_a_token_sees_its_project_only(
    api, project, other_project, member
):
    from webapp.projects import services

    user = member(project, Role.APPROVER, "both")
    services.membership_set(project=other_project, user=user, role=Role.VIEWER)
    assert api(user=user).get("/api/v1/projects/").json() == [
        {"slug": "ml", "name": "Machine learning", "role": "approver"},
        {"slug": "other", "name": "Other team", "role": "viewer"},
    ]
    admin = member(project, Role.ADMIN)
    _, secret = services.token_create(user=admin, project=project, name="t", role=Role.VIEWER)
    assert api(secret=secret).get("/api/v1/projects/").json() == [
        {"slug": "ml", "name": "Machine learning", "role": "viewer"}
    ]


def test_the_schema_covers_the_v1_api_and_the_bearer_scheme(client):
    response = client.get("/api/schema/", {"format": "json"})
    assert response.status_code == 200
    schema = response.json()
    for path in (
        "/api/v1/jobs/",
        "/api/v1/jobs/{job_id}/",
        "/api/v1/jobs/{job_id}/cancel/",
        "/api/v1/jobs/{job_id}/events/",
        "/api/v1/projects/{slug}/tokens/",
    ):
        assert path in schema["paths"], path
    assert schema["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    submit = schema["paths"]["/api/v1/jobs/"]["post"]
    assert "Idempotency-Key" in {p["name"] for p in submit["parameters"]}


@pytest.mark.django_db
def test_a_path_under_the_api_that_nothing_serves_is_a_json_404(client, settings):
    """In the API's one error shape, in debug mode as well; pages keep Django's own 404."""
    for debug in (False, True):
        settings.DEBUG = debug
        for path in ("/api/v1/nope/", "/api/v1/jobs/1/artifacts/a/b/c", "/api/v2/jobs/"):
            response = client.get(path)
            assert response.status_code == 404, path
            assert response.json() == {
                "code": "not_found",
                "message": f"no such resource: GET {path}",
                "fields": {},
            }
    settings.DEBUG = False
    page = client.get("/jobs/nope/")
    assert page.status_code == 404 and page["Content-Type"].startswith("text/html")
