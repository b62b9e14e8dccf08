"""The projects pages: the projects one belongs to, and one project's members and API tokens,
which its admins issue (the secret shown in that one answer) and anyone revokes their own."""

from __future__ import annotations

import re

import pytest

from webapp.projects import services as project_services
from webapp.projects.models import ApiToken, Role

pytestmark = pytest.mark.django_db


def _secret(page: str) -> str:
    return re.search(r'<code id="token-secret">([^<]+)</code>', page).group(1)


def test_the_list_shows_my_projects_and_my_role_in_each(client, project, other_project, member):
    pat = member(project, Role.APPROVER, "pat")
    client.force_login(pat)
    page = client.get("/projects/").content.decode()
    assert "Machine learning" in page and "<code>ml</code>" in page and "approver" in page
    assert "Other team" not in page
    assert client.get("/projects/other/").status_code == 404  # not a member: not there at all
    assert client.get("/projects/missing/").status_code == 404
    client.logout()
    assert client.get("/projects/").status_code == 302  # to the sign-in page


def test_an_admin_issues_a_token_whose_secret_is_shown_once_and_works(client, api, project, member):
    admin = member(project, Role.ADMIN, "ada")
    client.force_login(admin)
    made = client.post("/projects/ml/tokens/", {"name": "nightly", "role": "viewer"})
    assert made.status_code == 200 and made["Cache-Control"] == "no-store"
    page = made.content.decode()
    secret = _secret(page)
    token = ApiToken.objects.get(name="nightly")
    assert token.role == Role.VIEWER and secret.startswith(token.prefix)
    assert secret not in token.key_hash and "--project ml" in page
    assert api(secret=secret).get("/api/v1/jobs/").status_code == 200
    again = client.get("/projects/ml/").content.decode()
    assert secret not in again and token.prefix in again and "nightly" in again  # once only
    # A reload of the answer sends the form again: refused, not a second token.
    reloaded = client.post("/projects/ml/tokens/", {"name": "nightly", "role": "viewer"})
    assert reloaded.status_code == 409 and 'data-field="name"' in reloaded.content.decode()
    assert ApiToken.objects.filter(name="nightly").count() == 1
    # One with a lifetime says until when it works, and once ended that it expired.
    client.post("/projects/ml/tokens/", {"name": "week", "role": "viewer", "expires_in_days": 7})
    week = ApiToken.objects.get(name="week")
    assert (
        f"active until {week.expires_at:%Y-%m-%d}" in client.get("/projects/ml/").content.decode()
    )
    ApiToken.objects.filter(pk=week.pk).update(expires_at=week.created_at)
    assert "expired " in client.get("/projects/ml/").content.decode()


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"name": "", "role": "viewer"}, "name"),
        ({"name": "x", "role": "god"}, "role"),
        ({"name": "x", "role": "viewer", "expires_in_days": "0"}, "expires_in_days"),
    ],
)
def test_a_bad_token_form_names_the_field_and_makes_nothing(client, project, member, data, field):
    client.force_login(member(project, Role.ADMIN, "ada"))
    response = client.post("/projects/ml/tokens/", data)
    assert response.status_code == 400
    assert f'data-field="{field}"' in response.content.decode()
    assert not ApiToken.objects.exists()


def test_members_below_admin_see_their_own_tokens_only_and_cannot_issue(
    client, project, member, token_for
):
    admin = member(project, Role.ADMIN, "ada")
    token_for(project, Role.OPERATOR, admin=admin)
    theirs = ApiToken.objects.get(name__startswith="ci-operator")
    operator = member(project, Role.OPERATOR, "olga")
    mine, _ = project_services.token_create(user=admin, project=project, name="x")
    ApiToken.objects.filter(pk=mine.pk).update(user=operator)  # as if olga made it when admin
    client.force_login(operator)
    page = client.get("/projects/ml/").content.decode()
    assert 'id="token-form"' not in page and f'id="token-{mine.pk}"' in page
    assert theirs.prefix not in page and f'id="token-{theirs.pk}"' not in page
    refused = client.post("/projects/ml/tokens/", {"name": "mine", "role": "viewer"})
    assert refused.status_code == 403 and ApiToken.objects.count() == 2
    # Nor does the form tell them whether a name they cannot see is taken.
    taken = client.post("/projects/ml/tokens/", {"name": theirs.name, "role": "viewer"})
    assert taken.status_code == 403 and theirs.name not in taken.content.decode()


def test_revoking_a_token_ends_it_and_another_project_s_is_not_found(
    client, api, project, other_project, member, token_for
):
    admin = member(project, Role.ADMIN, "ada")
    secret = token_for(project, Role.OPERATOR, admin=admin)
    token = ApiToken.objects.get(project=project)
    foreign = ApiToken.objects.get(
        pk=project_services.token_create(
            user=member(other_project, Role.ADMIN, "oz"), project=other_project, name="theirs"
        )[0].pk
    )
    client.force_login(admin)
    response = client.post(f"/projects/ml/tokens/{token.pk}/revoke/", follow=True)
    assert "revoked" in response.content.decode()
    token.refresh_from_db()
    assert token.revoked_at is not None
    assert api(secret=secret).get("/api/v1/jobs/").status_code == 401
    assert client.post(f"/projects/ml/tokens/{foreign.pk}/revoke/").status_code == 404
    assert client.post(f"/projects/other/tokens/{foreign.pk}/revoke/").status_code == 404
    foreign.refresh_from_db()
    assert foreign.revoked_at is None
    assert client.get(f"/projects/ml/tokens/{token.pk}/revoke/").status_code == 405
