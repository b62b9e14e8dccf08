"""Fixtures of the deployment tests: people and projects (as the web tests make them)."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from webapp.projects import services as project_services
from webapp.projects.models import Project


@pytest.fixture
def project(db) -> Project:
    return Project.objects.create(name="Machine learning", slug="ml")


@pytest.fixture
def member(db):
    """``member(project, role, username)``: a new user holding ``role`` in ``project``."""

    def make(project: Project, role: str, username: str):
        user = get_user_model().objects.create_user(username=username, password=f"pw-{username}-1")
        project_services.membership_set(project=project, user=user, role=role)
        return user

    return make


@pytest.fixture
def api():
    def make(user=None) -> APIClient:
        client = APIClient()
        if user is not None:
            client.force_authenticate(user=user)
        return client

    return make
