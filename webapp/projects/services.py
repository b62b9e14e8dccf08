"""Writes about projects: creating them, setting roles, issuing and revoking API tokens."""

from __future__ import annotations

import hashlib
import re
import secrets
from datetime import timedelta

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from webapp.projects import errors, selectors
from webapp.projects.models import ApiToken, Membership, Project, Role

TOKEN_PREFIX = "nrs_"
# Writing last_used_at on every request would turn each API read into a write; a minute is enough.
LAST_USED_RESOLUTION = timedelta(seconds=60)
_PERSONAL_SLUG = re.compile(r"^user-\d+$")


def _hash(secret: str) -> str:
    # The secret has 256 random bits, so a fast hash is enough: nothing to brute-force.
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


@transaction.atomic
def project_create(*, user, name: str, slug: str) -> Project:
    """A new project whose creator is its admin."""
    if _PERSONAL_SLUG.match(slug):
        raise ValidationError({"slug": f"slug: {slug!r} is reserved for personal projects"})
    if Project.objects.filter(slug=slug).exists():
        raise ValidationError({"slug": f"slug: {slug!r} is taken"})
    project = Project.objects.create(name=name, slug=slug)
    Membership.objects.create(user=user, project=project, role=Role.ADMIN)
    return project


def membership_set(*, project: Project, user, role: str) -> Membership:
    """Give ``user`` ``role`` in ``project`` (adding them if needed)."""
    membership, _ = Membership.objects.update_or_create(
        user=user, project=project, defaults={"role": Role(role)}
    )
    return membership


def project_personal_for(user) -> Project:
    """The user's personal project (created on first use, with them as admin): where their jobs go
    when they name no project."""
    project = Project.objects.filter(personal_for=user).first()
    if project is not None:
        return project
    # ``user-<id>`` unless a project took that slug another way (the admin site does not
    # reserve it): then the next free ``user-<id>-<n>``.
    for n in range(100):
        slug = f"user-{user.pk}" if n == 0 else f"user-{user.pk}-{n}"
        try:
            with transaction.atomic():
                project = Project.objects.create(
                    name=f"{user.get_username()}'s jobs", slug=slug, personal_for=user
                )
                Membership.objects.create(user=user, project=project, role=Role.ADMIN)
            return project
        except IntegrityError:
            project = Project.objects.filter(personal_for=user).first()
            if project is not None:  # a concurrent request created it first
                return project
    raise IntegrityError(f"no free slug for the personal project of user {user.pk}")


MAX_TOKEN_DAYS = 3650
"""The longest a token may be given to live, in days (none given: until revoked)."""


@transaction.atomic
def token_create(
    *,
    user,
    project: Project,
    name: str,
    role: str = Role.OPERATOR,
    expires_in_days: int | None = None,
):
    """Issue a token; returns ``(token, secret)``. The secret is shown once and never stored.

    Needs the admin role, so any role may be given; a token never acts above its creator's
    current role anyway (see ``selectors.role_of``).
    """
    with transaction.atomic():
        # The creator's membership row, locked until the token is stored: a removal or demotion
        # of the creator at the same moment waits for it, and then revokes it (``signals``);
        # one that came first has already taken the role this checks.
        Membership.objects.select_for_update().filter(user=user, project=project).first()
        selectors.require_role(user, project, Role.ADMIN)
        # One active token per name, for the page and the API alike. The project's row is locked
        # for the check, so that two requests at once (a double click, a resend) make one.
        Project.objects.select_for_update().filter(pk=project.pk).first()
        active = selectors.tokens_of(project).filter(name=name, revoked_at__isnull=True)
        if active.exclude(expires_at__lte=timezone.now()).exists():
            raise errors.TokenNameTakenError(name)
        return _token_insert(
            user=user, project=project, name=name, role=role, expires_in_days=expires_in_days
        )


def _token_insert(*, user, project: Project, name: str, role: str, expires_in_days):
    if expires_in_days is not None and not 1 <= expires_in_days <= MAX_TOKEN_DAYS:
        raise ValidationError(
            {"expires_in_days": [f"expected a whole number of days from 1 to {MAX_TOKEN_DAYS}"]}
        )
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    token = ApiToken.objects.create(
        project=project,
        user=user,
        name=name,
        role=Role(role),
        prefix=secret[: len(TOKEN_PREFIX) + 6],
        key_hash=_hash(secret),
        expires_at=(
            None if expires_in_days is None else timezone.now() + timedelta(days=expires_in_days)
        ),
    )
    return token, secret


@transaction.atomic
def token_revoke(*, user, project: Project, token_id: int) -> ApiToken:
    """Revoke a token of ``project`` (its admins, or the token's own creator); idempotent."""
    role = selectors.require_role(user, project, Role.VIEWER)
    token = ApiToken.objects.select_for_update().filter(project=project, pk=token_id).first()
    if token is None:
        raise errors.NotFoundError()
    if token.user_id != user.pk and not role.allows(Role.ADMIN):
        raise errors.RoleError(errors.ROLE_NEEDED.format(role=Role.ADMIN.value, project=project))
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        token.save(update_fields=["revoked_at"])
    return token


def token_authenticate(secret: str) -> ApiToken:
    """The active token with this secret, its use recorded; ``NotFoundError`` otherwise."""
    if not secret.startswith(TOKEN_PREFIX):
        raise errors.NotFoundError(errors.TOKEN_INVALID)
    token = (
        ApiToken.objects.select_related("user", "project")
        .filter(key_hash=_hash(secret), revoked_at__isnull=True, user__is_active=True)
        .first()
    )
    if token is None:
        raise errors.NotFoundError(errors.TOKEN_INVALID)
    if token.is_expired:
        raise errors.NotFoundError(errors.TOKEN_EXPIRED)
    now = timezone.now()
    if token.last_used_at is None or now - token.last_used_at >= LAST_USED_RESOLUTION:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
        token.last_used_at = now
    return token
