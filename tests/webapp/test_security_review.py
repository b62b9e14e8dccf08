"""Fixes from a security review: a websocket ends with the browser session that opened it; the
admin cannot rewrite API tokens or proposals; the schema UI loads no third-party script; production
trusts only https:// CSRF origins. (``/healthz`` details: tests/webapp/test_health.py.)"""

import re

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.contrib.auth import HASH_SESSION_KEY, SESSION_KEY, get_user_model
from django.contrib.auth.models import Permission
from django.contrib.sessions.backends.db import SessionStore
from django.utils import timezone

from tests.support.jobs import make_job
from tests.support.websockets import closed_with, session_for
from webapp import config
from webapp.config import ConfigError
from webapp.jobs import services
from webapp.jobs.consumers import CLOSE_NOT_FOUND
from webapp.jobs.routing import websocket_urlpatterns
from webapp.jobs.ws_auth import websocket_application
from webapp.plans.models import Proposal, ProposalState
from webapp.projects import services as project_services
from webapp.projects.models import ApiToken, Role

# --- the websocket ends with its session --------------------------------------------------------

APP = websocket_application(websocket_urlpatterns)


@sync_to_async
def _ws_setup():
    alice = get_user_model().objects.create_user(username="alice", password="pw-alice-1234")
    job = make_job(owner=alice)
    services.job_event_append(job=job, epoch=job.epoch, kind="first", data={})
    return alice, job, session_for(alice), session_for(alice)


def _socket(job_id: int, session: str):
    cookie = f"{settings.SESSION_COOKIE_NAME}={session}".encode()
    return WebsocketCommunicator(APP, f"/ws/jobs/{job_id}/", headers=[(b"cookie", cookie)])


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
@pytest.mark.parametrize("via", ["live", "resume"])
@pytest.mark.parametrize("how", ["logout", "password_change", "expired", "other_user"])
async def test_a_socket_closes_when_its_session_no_longer_authenticates(how, via):
    """Logging out, changing the password, the session expiring or the session key now holding
    another user: the next read of the log closes the socket, and the event never reaches it."""
    alice, job, key, _ = await _ws_setup()
    ws = _socket(job.pk, key)
    assert (await ws.connect())[0]
    assert (await ws.receive_json_from(timeout=5))["event"]["kind"] == "first"

    @sync_to_async
    def invalidate():
        store = SessionStore(session_key=key)
        if how == "logout":
            store.delete()  # what django.contrib.auth.logout does
        elif how == "password_change":
            alice.set_password("new-secret-pw-999")
            alice.save()
        elif how == "expired":
            store.set_expiry(-1)
            store.save()
        else:
            bob = get_user_model().objects.create_user(username="bob", password="pw-bob-12345")
            store[SESSION_KEY] = str(bob.pk)
            store[HASH_SESSION_KEY] = bob.get_session_auth_hash()
            store.save()
        if via == "live":
            services.job_event_append(job=job, epoch=job.epoch, kind="secret", data={"loss": 0.1})

    await invalidate()
    if via == "resume":
        await ws.send_json_to({"type": "resume", "after": 0})
    assert await closed_with(ws) == CLOSE_NOT_FOUND


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_logging_out_another_session_leaves_this_socket_streaming():
    """The control: only the socket's own session matters, not the user's other ones."""
    _, job, key, other_key = await _ws_setup()
    ws = _socket(job.pk, key)
    assert (await ws.connect())[0]
    await ws.receive_json_from(timeout=5)

    @sync_to_async
    def logout_elsewhere():
        SessionStore(session_key=other_key).delete()
        services.job_event_append(job=job, epoch=job.epoch, kind="next", data={})

    await logout_elsewhere()
    assert (await ws.receive_json_from(timeout=5))["event"]["kind"] == "next"
    await ws.disconnect()


# --- the admin reads tokens and proposals, never rewrites them ---------------------------------


def _staff(make_user, *codenames):
    user = make_user("support")
    user.is_staff = True
    user.save()
    for codename in codenames:
        user.user_permissions.add(Permission.objects.get(codename=codename))
    return user


@pytest.mark.django_db
def test_the_token_admin_cannot_unrevoke_or_reassign_a_token(
    client, api, project, other_project, member, make_user
):
    staff = _staff(make_user, "change_apitoken", "view_apitoken")
    project_services.membership_set(project=project, user=staff, role=Role.ADMIN)
    token, secret = project_services.token_create(
        user=staff, project=project, name="mine", role=Role.VIEWER
    )
    revoked_at = timezone.now()
    ApiToken.objects.filter(pk=token.pk).update(revoked_at=revoked_at)
    victim = member(other_project, Role.ADMIN, "victim-admin")
    job = make_job(owner=victim, project=other_project, name="secret-job")

    client.force_login(staff)
    url = f"/admin/projects/apitoken/{token.pk}/change/"
    assert client.get(url).status_code == 200  # still readable
    client.post(
        url,
        {
            "project": other_project.pk,
            "user": victim.pk,
            "name": "renamed",
            "role": "admin",
            "revoked_at_0": "",
            "revoked_at_1": "",
        },
    )
    token.refresh_from_db()
    assert (token.project_id, token.user_id, token.name, token.role) == (
        project.pk,
        staff.pk,
        "mine",
        Role.VIEWER,
    )
    assert token.revoked_at == revoked_at
    assert api(secret=secret).get(f"/api/v1/jobs/{job.pk}/").status_code == 401


@pytest.mark.django_db
def test_the_token_admin_revokes_through_an_action(client, api, project, member, make_user):
    staff = _staff(make_user, "change_apitoken", "view_apitoken")
    owner = member(project, Role.ADMIN, "owner")
    leaver = member(project, Role.ADMIN, "leaver")
    job = make_job(owner=owner, project=project)
    token, secret = project_services.token_create(user=owner, project=project, name="ci")
    gone, _ = project_services.token_create(user=leaver, project=project, name="old")
    project.memberships.filter(user=leaver).delete()  # its creator left: revoke it all the same
    kept, kept_secret = project_services.token_create(user=owner, project=project, name="kept")
    assert api(secret=secret).get(f"/api/v1/jobs/{job.pk}/").status_code == 200

    client.force_login(staff)
    response = client.post(
        "/admin/projects/apitoken/",
        {"action": "revoke_tokens", "_selected_action": [token.pk, gone.pk]},
    )
    assert response.status_code == 302
    token.refresh_from_db(), gone.refresh_from_db(), kept.refresh_from_db()
    assert token.revoked_at is not None and gone.revoked_at is not None
    assert kept.revoked_at is None
    assert api(secret=secret).get(f"/api/v1/jobs/{job.pk}/").status_code == 401
    assert api(secret=kept_secret).get(f"/api/v1/jobs/{job.pk}/").status_code == 200


@pytest.mark.django_db
def test_the_proposal_admin_cannot_rewrite_or_forge_a_proposal(
    client, api, project, member, make_user
):
    """Re-attributing a proposal (or adding one in another's name) would let its real author
    approve it himself: the two-person rule. The admin only shows proposals."""
    staff = _staff(make_user, "change_proposal", "add_proposal")
    project_services.membership_set(project=project, user=staff, role=Role.APPROVER)
    other = member(project, Role.OPERATOR, "someone-else")
    job = make_job(
        owner=staff, project=project, state="running", spec={"kind": "ppo-sim", "num_steps": 5}
    )
    expires = timezone.now() + timezone.timedelta(hours=1)
    proposal = Proposal.objects.create(
        job=job,
        epoch=job.epoch,
        plan={"num_slots": 2},
        reason="mine",
        proposed_by=staff,
        expires_at=expires,
    )
    client.force_login(staff)
    url = f"/admin/plans/proposal/{proposal.pk}/change/"
    assert client.get(url).status_code == 200  # viewing stays
    response = client.post(
        url,
        {
            "job": job.pk,
            "epoch": proposal.epoch,
            "controller_id": "",
            "plan": '{"num_slots": 64}',
            "verdict": "null",
            "reason": "mine",
            "route": "live",
            "proposed_by": other.pk,
            "expires_at_0": expires.strftime("%Y-%m-%d"),
            "expires_at_1": expires.strftime("%H:%M:%S"),
        },
    )
    assert response.status_code == 403
    assert client.get("/admin/plans/proposal/add/").status_code == 403
    proposal.refresh_from_db()
    assert proposal.proposed_by_id == staff.pk and proposal.plan == {"num_slots": 2}
    approve = api(user=staff).post(
        f"/api/v1/proposals/{proposal.pk}/approve/", {"comment": "x"}, format="json"
    )
    assert approve.status_code == 409
    proposal.refresh_from_db()
    assert proposal.state == ProposalState.WAITING


# --- the schema UI's scripts are served from here ------------------------------------------------


@pytest.mark.django_db
def test_the_schema_ui_loads_no_third_party_asset(client, make_user):
    client.force_login(make_user("reader"))
    page = client.get("/api/schema/ui/").content.decode()
    assets = re.findall(r'<(?:script|link)\b[^>]*\b(?:src|href)="([^"]+)"', page)
    assert any(a.endswith("swagger-ui-bundle.js") for a in assets), assets
    assert "cdn." not in page
    for asset in assets:
        assert asset.startswith("/") and not asset.startswith("//"), asset
        assert client.get(asset).status_code == 200, asset


# --- production trusts only https:// origins ---------------------------------------------------


def _production(tmp_path, origins: str) -> dict[str, str]:
    return {
        "NEREUS_PRODUCTION": "1",
        "NEREUS_SECRET_KEY": "k" * 30 + "abcdefghijklmnopqrstuvwxyz",
        "NEREUS_ALLOWED_HOSTS": "nereus.example.com",
        "NEREUS_VAR_DIR": str(tmp_path),
        "NEREUS_CSRF_TRUSTED_ORIGINS": origins,
    }


def test_production_refuses_a_plain_http_trusted_origin(tmp_path):
    with pytest.raises(ConfigError) as info:
        config.load(_production(tmp_path, "https://a.example.com,http://nereus.example.com"))
    assert info.value.variable == "NEREUS_CSRF_TRUSTED_ORIGINS"
    assert "'http://nereus.example.com' must start with https://" in str(info.value)


def test_https_origins_in_production_and_http_in_development_are_kept(tmp_path):
    cfg = config.load(_production(tmp_path, "https://nereus.example.com"))
    assert cfg.csrf_trusted_origins == ("https://nereus.example.com",)
    dev = config.load(
        {"NEREUS_VAR_DIR": str(tmp_path), "NEREUS_CSRF_TRUSTED_ORIGINS": "http://localhost:8000"}
    )
    assert dev.csrf_trusted_origins == ("http://localhost:8000",)
