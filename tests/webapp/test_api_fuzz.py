"""Schemathesis over the OpenAPI schema: generated requests to every operation, valid and not,
with a project token; none may get a server error. Driven through schemathesis' Python API (its
pytest plugin does not load under this pytest), each operation with its own hypothesis run."""

import pytest
import schemathesis
from django.core.wsgi import get_wsgi_application
from hypothesis import HealthCheck, given, settings

from webapp.projects.models import Role

EXAMPLES = 12


@pytest.fixture
def schema(db):
    return schemathesis.openapi.from_wsgi("/api/schema/", get_wsgi_application())


def _operations(schema):
    out = []
    for result in schema.get_all_operations():
        out.append(result.ok())
    return out


@pytest.mark.django_db(transaction=True)
def test_no_operation_answers_with_a_server_error(schema, project, token_for):
    secret = token_for(project, Role.APPROVER)
    headers = {"Authorization": f"Bearer {secret}"}
    operations = _operations(schema)
    assert len(operations) >= 10, [op.label for op in operations]
    failures = []
    statuses: set[int] = set()
    for operation in operations:

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def check(case):
            response = case.call(headers=headers)
            statuses.add(response.status_code)
            if response.status_code >= 500:
                failures.append(
                    f"{case.operation.label}: {response.status_code} {case.as_curl_command()}"
                )

        check()
    assert not failures, "\n".join(failures[:10])
    # The token let requests through, and bad ones were answered as the client's fault.
    assert any(200 <= s < 300 for s in statuses) and 400 in statuses, sorted(statuses)
