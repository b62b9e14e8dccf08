"""Fixtures of the web tests: people, projects with roles, and API clients."""

from __future__ import annotations

import itertools

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from webapp.jobs import services as job_services
from webapp.projects import services as project_services
from webapp.projects.models import Project, Role


@pytest.fixture
def make_user(db):
    def make(username: str):
        return get_user_model().objects.create_user(username=username, password=f"pw-{username}-1")

    return make


@pytest.fixture
def project(db) -> Project:
    """Project "ml", with no members yet."""
    return Project.objects.create(name="Machine learning", slug="ml")


@pytest.fixture
def other_project(db) -> Project:
    return Project.objects.create(name="Other team", slug="other")


@pytest.fixture
def member(make_user):
    """``member(project, role, username)``: a new user holding ``role`` in ``project``."""

    def make(project: Project, role: str, username: str | None = None):
        user = make_user(username or f"{role}-of-{project.slug}")
        project_services.membership_set(project=project, user=user, role=role)
        return user

    return make


@pytest.fixture
def api():
    """``api(user=None, secret=None)``: a REST client signed in as ``user`` or carrying a token."""

    def make(user=None, secret: str | None = None) -> APIClient:
        client = APIClient()
        if user is not None:
            client.force_authenticate(user=user)
        if secret is not None:
            client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
        return client

    return make


@pytest.fixture
def token_for(member):
    """``token_for(project, role)``: the secret of a new token of an admin of ``project``."""

    made = itertools.count()

    def make(project: Project, role: str = Role.OPERATOR, admin=None) -> str:
        admin = admin or member(project, Role.ADMIN, f"token-admin-{project.slug}-{role}")
        _, secret = project_services.token_create(  # one active token per name in a project
            user=admin, project=project, name=f"ci-{role}-{next(made)}", role=role
        )
        return secret

    return make


@pytest.fixture
def no_live_delivery(monkeypatch):
    """Events are stored but not published live. A test that executes on-commit callbacks
    inside its own transaction would otherwise publish through the database channel layer
    (no Redis), whose ``database_sync_to_async`` closes the test's connection mid-transaction."""
    monkeypatch.setattr(job_services, "_publish", lambda group, message: None)


@pytest.fixture
def enqueued(monkeypatch):
    """The driver tasks the test enqueues, as (job id, epoch), instead of sending them."""
    calls = []
    monkeypatch.setattr(
        job_services, "_enqueue_driver", lambda job_id, epoch=None: calls.append((job_id, epoch))
    )
    return calls
