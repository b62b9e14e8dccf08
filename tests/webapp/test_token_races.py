"""API tokens under concurrency (PostgreSQL's row locks; SQLite runs one writer at a time): a
token made while its creator is being removed or demoted is revoked with their others, and a
double submit of the token form makes one token."""

from __future__ import annotations

import threading

import pytest
from django.db import connection
from django.test import Client

from webapp.projects import selectors
from webapp.projects import services as project_services
from webapp.projects import views as project_views
from webapp.projects.models import ApiToken, Membership, Role

pytestmark = [
    pytest.mark.skipif(
        connection.vendor != "postgresql",
        reason="SQLite has no row locks to test (CI runs these on PostgreSQL)",
    ),
    pytest.mark.django_db(transaction=True),
]


def _together(*calls) -> list:
    """Run each call in its own thread and database connection; their results or exceptions."""
    results: list = [None] * len(calls)

    def run(index: int) -> None:
        try:
            results[index] = calls[index]()
        except Exception as exc:  # reported by the test
            results[index] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return results


@pytest.mark.parametrize("change", ["removed", "demoted"])
def test_a_token_made_while_its_creator_is_removed_or_demoted_is_revoked(
    project, member, monkeypatch, change
):
    """The creator's role is checked, then the other request removes or demotes them, then the
    token is stored: the change must wait for it and revoke it, or the token works again at
    full power the day the person is added back or promoted."""
    ada = member(project, Role.ADMIN, "ada")
    checked, changed = threading.Event(), threading.Event()
    real_require = selectors.require_role

    def require_then_let_the_change_start(*args, **kwargs):
        role = real_require(*args, **kwargs)
        checked.set()
        # The change is made now; it must wait for this token (the wait ends unanswered).
        changed.wait(timeout=2)
        return role

    monkeypatch.setattr(
        project_services.selectors, "require_role", require_then_let_the_change_start
    )

    def change_membership():
        assert checked.wait(timeout=20)
        if change == "removed":
            Membership.objects.get(user=ada, project=project).delete()
        else:
            project_services.membership_set(project=project, user=ada, role=Role.OPERATOR)
        changed.set()

    made, changed = _together(
        lambda: project_services.token_create(
            user=ada, project=project, name="ci", role=Role.ADMIN
        ),
        change_membership,
    )
    assert not isinstance(changed, Exception), changed
    token, _ = made
    token.refresh_from_db()
    assert token.revoked_at is not None


def test_a_double_submit_of_the_token_form_makes_one_token(project, member, monkeypatch):
    admin = member(project, Role.ADMIN, "ada")
    arrived = threading.Semaphore(0)
    real_tokens_of = selectors.tokens_of

    def tokens_of_once_both_are_in(project):
        # Each request waits (a while) for the other to reach the check too: without the lock
        # both pass it before either stores its token.
        arrived.release()
        for _ in range(2):
            arrived.acquire(timeout=2)
        arrived.release()
        return real_tokens_of(project)

    monkeypatch.setattr(project_views.selectors, "tokens_of", tokens_of_once_both_are_in)

    def submit():
        client = Client()
        client.force_login(admin)
        return client.post(f"/projects/{project.slug}/tokens/", {"name": "ci", "role": "viewer"})

    results = _together(submit, submit)
    assert sorted(getattr(r, "status_code", r) for r in results) == [200, 409]
    assert ApiToken.objects.filter(name="ci", revoked_at__isnull=True).count() == 1
