"""The websocket with a project API token (what a CI client sends): it sees its project's jobs,
not another project's, and a revoked token is refused like no credentials at all."""

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth import get_user_model

from tests.support.jobs import make_job
from tests.support.websockets import closed_with
from webapp.jobs import services
from webapp.jobs.consumers import CLOSE_NOT_FOUND, CLOSE_UNAUTHENTICATED
from webapp.jobs.routing import websocket_urlpatterns
from webapp.jobs.ws_auth import websocket_application
from webapp.projects import services as project_services
from webapp.projects.models import Project, Role

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]

APP = websocket_application(websocket_urlpatterns)


@sync_to_async
def _setup():
    users = get_user_model()
    admin = users.objects.create_user(username="ada", password="pw-ada-12345")
    ml = Project.objects.create(name="ML", slug="ml")
    other = Project.objects.create(name="Other", slug="other")
    for project in (ml, other):
        project_services.membership_set(project=project, user=admin, role=Role.ADMIN)
    job = make_job(owner=admin, project=ml)
    services.job_event_append(job=job, epoch=job.epoch, kind="step.finished", data={"step": 0})
    token, secret = project_services.token_create(
        user=admin, project=ml, name="ci", role=Role.VIEWER
    )
    _, other_secret = project_services.token_create(
        user=admin, project=other, name="ci", role=Role.VIEWER
    )
    return admin, ml, job, token, secret, other_secret


def _socket(job_id: int, header: bytes | None):
    headers = [(b"authorization", header)] if header is not None else []
    return WebsocketCommunicator(APP, f"/ws/jobs/{job_id}/", headers=headers)


async def test_a_project_token_streams_the_projects_job():
    _, _, job, _, secret, _ = await _setup()
    ws = _socket(job.pk, f"Bearer {secret}".encode())
    connected, _ = await ws.connect()
    assert connected
    message = await ws.receive_json_from(timeout=5)
    assert message["type"] == "event"
    assert message["event"]["kind"] == "step.finished" and message["event"]["data"] == {"step": 0}
    await ws.disconnect()


async def test_another_projects_token_gets_not_found():
    _, _, job, _, _, other_secret = await _setup()
    connected, code = await _socket(job.pk, f"Bearer {other_secret}".encode()).connect()
    assert not connected and code == CLOSE_NOT_FOUND


@pytest.mark.parametrize("header", [b"Bearer not-a-token", b"Bearer", b"Bearer \xff\xfe"])
async def test_a_bad_token_is_refused(header):
    _, _, job, _, _, _ = await _setup()
    connected, code = await _socket(job.pk, header).connect()
    assert not connected and code == CLOSE_UNAUTHENTICATED


async def test_a_revoked_token_is_refused():
    admin, ml, job, token, secret, _ = await _setup()
    await sync_to_async(project_services.token_revoke)(user=admin, project=ml, token_id=token.pk)
    connected, code = await _socket(job.pk, f"Bearer {secret}".encode()).connect()
    assert not connected and code == CLOSE_UNAUTHENTICATED


@pytest.mark.parametrize("via", ["live", "resume"])
@pytest.mark.parametrize("lose_access", ["revoke_token", "remove_member", "deactivate_user"])
async def test_a_socket_that_loses_access_is_closed_before_the_next_event(lose_access, via):
    """Access is checked at every read of the log, not only at connect: once the token is revoked,
    its user removed from the project or deactivated, the next event closes the socket (live or
    asked for with resume) and its data never reaches the client."""
    admin, ml, job, token, secret, _ = await _setup()
    ws = _socket(job.pk, f"Bearer {secret}".encode())
    connected, _ = await ws.connect()
    assert connected
    assert (await ws.receive_json_from(timeout=5))["event"]["kind"] == "step.finished"

    @sync_to_async
    def lose():
        if lose_access == "revoke_token":
            project_services.token_revoke(user=admin, project=ml, token_id=token.pk)
        elif lose_access == "remove_member":
            ml.memberships.filter(user=admin).delete()
        else:
            type(admin).objects.filter(pk=admin.pk).update(is_active=False)
        if via == "live":
            services.job_event_append(job=job, epoch=job.epoch, kind="secret", data={"loss": 0.1})

    await lose()
    if via == "resume":
        await ws.send_json_to({"type": "resume", "after": 0})
    assert await closed_with(ws) == CLOSE_NOT_FOUND


async def test_a_socket_that_keeps_access_streams_on():
    """The control for the test above: the same steps without losing access deliver the event."""
    _, _, job, _, secret, _ = await _setup()
    ws = _socket(job.pk, f"Bearer {secret}".encode())
    assert (await ws.connect())[0]
    await ws.receive_json_from(timeout=5)
    await sync_to_async(services.job_event_append)(
        job=job, epoch=job.epoch, kind="next", data={"loss": 0.1}
    )
    assert (await ws.receive_json_from(timeout=5))["event"]["kind"] == "next"
    await ws.disconnect()
