"""Projects: ordered roles, the access rules (not found before forbidden), personal projects, API
tokens (hash only, secret once, last use, revocation), and the migration of existing jobs."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from webapp.projects import errors, selectors, services
from webapp.projects.models import ApiToken, Membership, Project, Role

pytestmark = pytest.mark.django_db


def test_roles_are_ordered():
    order = [Role.VIEWER, Role.OPERATOR, Role.APPROVER, Role.ADMIN]
    for i, have in enumerate(order):
        for j, need in enumerate(order):
            assert have.allows(need) == (i >= j), (have, need)
    assert selectors.roles_at_least(Role.APPROVER) == ["approver", "admin"]


def test_require_role_says_not_found_before_forbidden(project, member, make_user):
    viewer = member(project, Role.VIEWER)
    assert selectors.require_role(viewer, project, Role.VIEWER) == Role.VIEWER
    with pytest.raises(errors.RoleError, match="operator role in project ml"):
        selectors.require_role(viewer, project, Role.OPERATOR)
    with pytest.raises(errors.NotFoundError):
        selectors.require_role(make_user("stranger"), project, Role.VIEWER)
    assert list(selectors.projects_visible_to(viewer)) == [project]
    assert not selectors.projects_visible_to(viewer, min_role=Role.OPERATOR).exists()


def test_a_token_acts_at_the_lower_of_its_role_and_its_creators(project, other_project, member):
    admin = member(project, Role.ADMIN)
    token, _ = services.token_create(user=admin, project=project, name="t", role=Role.APPROVER)
    assert selectors.role_of(admin, project, token=token) == Role.APPROVER
    assert selectors.role_of(admin, other_project, token=token) is None
    services.membership_set(project=project, user=admin, role=Role.VIEWER)
    assert selectors.role_of(admin, project, token=token) == Role.VIEWER
    Membership.objects.filter(user=admin).delete()
    assert selectors.role_of(admin, project, token=token) is None
    assert not selectors.projects_visible_to(admin, token=token).exists()


def test_the_personal_project_is_made_once_with_its_user_as_admin(make_user):
    carol = make_user("carol")
    project = services.project_personal_for(carol)
    assert services.project_personal_for(carol) == project
    assert project.slug == f"user-{carol.pk}" and project.personal_for == carol
    assert selectors.role_of(carol, project) == Role.ADMIN


def test_project_create_makes_its_creator_admin_and_guards_slugs(make_user, project):
    dave = make_user("dave")
    created = services.project_create(user=dave, name="Vision", slug="vision")
    assert selectors.role_of(dave, created) == Role.ADMIN
    for slug in ("ml", "user-7"):
        with pytest.raises(ValidationError) as info:
            services.project_create(user=dave, name="x", slug=slug)
        assert "slug" in info.value.message_dict


def test_a_token_stores_only_a_hash_and_records_its_last_use(project, member):
    admin = member(project, Role.ADMIN)
    token, secret = services.token_create(user=admin, project=project, name="ci")
    assert secret.startswith(services.TOKEN_PREFIX) and len(secret) > 40
    stored = ApiToken.objects.filter(pk=token.pk).values().get()
    assert secret not in {str(v) for v in stored.values()}
    assert stored["key_hash"] == hashlib.sha256(secret.encode()).hexdigest()
    assert secret.startswith(stored["prefix"]) and len(stored["prefix"]) < 16
    assert token.role == Role.OPERATOR and token.last_used_at is None

    assert services.token_authenticate(secret).pk == token.pk
    used = ApiToken.objects.get(pk=token.pk).last_used_at
    assert used is not None
    services.token_authenticate(secret)  # within the resolution: no write
    assert ApiToken.objects.get(pk=token.pk).last_used_at == used
    ApiToken.objects.filter(pk=token.pk).update(last_used_at=used - timedelta(minutes=5))
    services.token_authenticate(secret)
    assert ApiToken.objects.get(pk=token.pk).last_used_at > used - timedelta(minutes=1)


def test_revoked_unknown_and_orphaned_tokens_do_not_authenticate(project, member):
    admin = member(project, Role.ADMIN)
    token, secret = services.token_create(user=admin, project=project, name="ci")
    for bad in ("nrs_unknown", "not-even-ours", secret + "x"):
        with pytest.raises(errors.NotFoundError, match=errors.TOKEN_INVALID):
            services.token_authenticate(bad)
    services.token_revoke(user=admin, project=project, token_id=token.pk)
    first = ApiToken.objects.get(pk=token.pk).revoked_at
    assert first is not None and first <= timezone.now()
    services.token_revoke(user=admin, project=project, token_id=token.pk)  # harmless twice
    assert ApiToken.objects.get(pk=token.pk).revoked_at == first
    with pytest.raises(errors.NotFoundError):
        services.token_authenticate(secret)
    _, other = services.token_create(user=admin, project=project, name="ci2")
    type(admin).objects.filter(pk=admin.pk).update(is_active=False)
    with pytest.raises(errors.NotFoundError):
        services.token_authenticate(other)


def test_who_may_issue_and_revoke_tokens(project, other_project, member):
    admin = member(project, Role.ADMIN)
    operator = member(project, Role.OPERATOR)
    with pytest.raises(errors.RoleError):
        services.token_create(user=operator, project=project, name="no")
    with pytest.raises(errors.NotFoundError):
        services.token_create(user=admin, project=other_project, name="no")
    services.membership_set(project=project, user=operator, role=Role.ADMIN)
    own, _ = services.token_create(user=operator, project=project, name="own")
    services.membership_set(project=project, user=operator, role=Role.OPERATOR)
    services.token_revoke(user=operator, project=project, token_id=own.pk)  # its creator may
    theirs, _ = services.token_create(user=admin, project=project, name="admins")
    with pytest.raises(errors.RoleError):
        services.token_revoke(user=operator, project=project, token_id=theirs.pk)
    with pytest.raises(errors.NotFoundError):
        services.token_revoke(user=admin, project=project, token_id=theirs.pk + 100)


@pytest.mark.django_db(transaction=True)
def test_existing_jobs_move_to_their_owners_personal_projects():
    before = [("jobs", "0002_failure_reasons_and_takeover")]
    latest = [("jobs", "0005_project_required")]
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    old = executor.loader.project_state(before).apps
    user_model = old.get_model("auth", "User")
    alice = user_model.objects.create(username="alice")
    bob = user_model.objects.create(username="bob")
    job_model = old.get_model("jobs", "Job")
    for owner in (alice, alice, bob):
        job_model.objects.create(name="old", owner=owner, spec={})

    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(latest)
    # Migrating jobs back unapplied what depends on it (plans); leave every app at its latest
    # state, as later tests (transactional ones, which keep the schema) expect.
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(executor.loader.graph.leaf_nodes())
    from webapp.jobs.models import Job

    projects = {job.owner.username: job.project for job in Job.objects.select_related("project")}
    assert projects["alice"] != projects["bob"]
    assert projects["alice"].personal_for_id == alice.pk
    assert Job.objects.filter(project=projects["alice"]).count() == 2
    assert Membership.objects.get(user_id=bob.pk, project=projects["bob"]).role == Role.ADMIN
    assert Project.objects.count() == 2


def test_a_personal_project_takes_the_next_slug_when_its_own_is_taken(make_user):
    """A project the admin site made with slug ``user-<id>`` (it does not reserve them) made
    every submission of that user without a project a 500 (found by review)."""
    erin = make_user("erin")
    Project.objects.create(name="team", slug=f"user-{erin.pk}")
    project = services.project_personal_for(erin)
    assert project.slug == f"user-{erin.pk}-1" and project.personal_for == erin
    assert services.project_personal_for(erin) == project
    assert selectors.role_of(erin, project) == Role.ADMIN
