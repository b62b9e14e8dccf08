"""Found by audit: a JSON body giving one key twice was read "last one wins" (``{"slots": 2,
"slots": 3}`` resized a pool to 3), and a 404 DRF makes itself (an unknown ``?format=``) came out
as the repr of DRF's error dict. A repeated key, at any depth, is a 400 naming it before any view
acts, and writes nothing; every error keeps the one shape with a readable message."""

from __future__ import annotations

import pytest
import yaml
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.forms.models import model_to_dict
from django.http import Http404
from rest_framework import exceptions
from rest_framework.response import Response

from runtime.jobs.spec import PpoJobSpec
from tests.support.jobs import make_job
from webapp.api.exceptions import INVALID_INPUT, exception_handler
from webapp.jobs import services
from webapp.jobs.models import Job, JobEvent, JobState
from webapp.projects.models import Role

pytestmark = pytest.mark.django_db

JOBS = "/api/v1/jobs/"
PPO_SPEC = PpoJobSpec(num_slots=2, max_slots=4, num_steps=10).to_json()


def _error(response) -> dict:
    body = response.json()
    assert set(body) == {"code", "message", "fields"}, body
    return body


@pytest.fixture
def running(project, member):
    """A running real PPO job (2 of at most 4 slots), owned by an operator of its project."""
    owner = member(project, Role.OPERATOR, "olga")
    return make_job(owner=owner, project=project, name="ppo", spec=PPO_SPEC, state=JobState.RUNNING)


# --- a key given twice ---------------------------------------------------------------------


def test_a_pool_body_giving_slots_twice_is_a_400_naming_it_and_changes_nothing(api, running):
    before = model_to_dict(Job.objects.get(pk=running.pk))
    response = api(user=running.owner).post(
        f"{JOBS}{running.pk}/pool/", '{"slots": 2, "slots": 3}', content_type="application/json"
    )
    assert response.status_code == 400, response.content
    body = _error(response)
    assert body["code"] == "parse_error"
    assert body["message"] == "slots: 'slots' is given twice in one object"
    assert body["fields"] == {"slots": ["'slots' is given twice in one object"]}
    assert model_to_dict(Job.objects.get(pk=running.pk)) == before
    assert not JobEvent.objects.filter(job=running).exists()
    assert services.job_pool_slots(running) is None  # no resize was asked for


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ('{"name": "x", "name": "y", "spec": {}}', "name"),
        (
            '{"name": "x", "spec": {"kind": "ppo-sim", "num_steps": 1, "num_steps": 2}}',
            "spec.num_steps",
        ),
        (
            '{"name": "x", "spec": {"kind": "ppo-sim", "policy": {"gamma": 1, "gamma": 2}}}',
            "spec.policy.gamma",
        ),
        ('{"name": "x", "spec": {"tags": ["a", {"k": 1, "k": 1}]}}', "spec.tags.1.k"),
        # the same value twice is still two keys: which one was meant is not for the API to guess
        ('{"name": "x", "spec": {}, "spec": {}}', "spec"),
    ],
)
def test_a_key_given_twice_anywhere_in_a_submitted_body_is_a_400_naming_its_path(
    api, project, member, text, path
):
    response = api(user=member(project, Role.OPERATOR)).post(
        JOBS, text, content_type="application/json"
    )
    assert response.status_code == 400, response.content
    body = _error(response)
    key = path.rsplit(".", 1)[-1]
    assert body["code"] == "parse_error"
    assert body["message"] == f"{path}: {key!r} is given twice in one object"
    assert body["fields"] == {path: [f"{key!r} is given twice in one object"]}
    assert not Job.objects.exists()


def test_the_first_repeat_in_the_body_is_the_one_named(api, project, member):
    text = '{"a": {"x": 1, "x": 2}, "b": {"y": 1, "y": 2}}'
    response = api(user=member(project, Role.OPERATOR)).post(
        JOBS, text, content_type="application/json"
    )
    assert response.status_code == 400 and set(_error(response)["fields"]) == {"a.x"}
    assert not Job.objects.exists()


# --- errors DRF makes itself ----------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["xml", "yaml", "'><script>", "x" * 1000])
def test_an_unknown_format_is_a_400_naming_format_and_a_known_one_still_answers(api, running, fmt):
    response = api(user=running.owner).get(f"{JOBS}{running.pk}/", {"format": fmt})
    assert response.status_code == 400, response.content
    body = _error(response)
    assert body["code"] == "invalid"
    assert list(body["fields"]) == ["format"]
    (message,) = body["fields"]["format"]
    assert f"{fmt[:40]!r}" in message and "is not a format here; one of: json" in message
    assert len(message) < 200
    known = api(user=running.owner).get(f"{JOBS}{running.pk}/", {"format": "json"})
    assert known.status_code == 200 and known.json()["id"] == running.pk


def test_the_schema_names_its_own_formats_for_an_unknown_one(client):
    """The schema's first renderer is YAML: DRF answers an error in it when the asked format
    cannot be had."""
    response = client.get("/api/schema/", {"format": "xml"})
    assert response.status_code == 400, response.content
    assert yaml.safe_load(response.content) == {
        "code": "invalid",
        "message": INVALID_INPUT,
        "fields": {"format": ["'xml' is not a format here; one of: yaml, json"]},
    }
    assert client.get("/api/schema/", {"format": "json"}).status_code == 200


@pytest.mark.parametrize(
    ("exc", "status", "code", "message"),
    [
        (Http404(), 404, "not_found", "Not found."),
        (
            Http404("No Job matches the given query."),
            404,
            "not_found",
            "No Job matches the given query.",
        ),
        (
            DjangoPermissionDenied(),
            403,
            "permission_denied",
            "You do not have permission to perform this action.",
        ),
        (DjangoPermissionDenied("not yours"), 403, "permission_denied", "not yours"),
        (exceptions.NotFound({"detail": "gone"}), 404, "not_found", "gone"),
    ],
)
def test_errors_drf_converts_itself_keep_the_one_shape(exc, status, code, message):
    response = exception_handler(exc, {})
    assert response.status_code == status
    assert response.data == {"code": code, "message": message, "fields": {}}


def test_an_error_detail_of_fields_is_read_as_fields():
    response = exception_handler(exceptions.NotFound({"job": ["gone"], "after": "too far"}), {})
    assert response.status_code == 404
    assert response.data == {
        "code": "not_found",
        "message": "job: gone; after: too far",
        "fields": {"job": ["gone"], "after": ["too far"]},
    }


def test_a_response_holding_a_detail_dict_is_read_for_its_detail(monkeypatch):
    """Whatever DRF's own handler answers, a ``detail`` is the message, not a dict's repr."""
    from webapp.api import exceptions as api_exceptions

    monkeypatch.setattr(
        api_exceptions,
        "drf_exception_handler",
        lambda exc, context: Response({"detail": exceptions.ErrorDetail("gone", code="gone")}, 410),
    )
    response = exception_handler(ValueError("x"), {})
    assert response.status_code == 410
    assert response.data == {"code": "gone", "message": "gone", "fields": {}}
