"""Who may see and do what in which project: the access rules, applied in one place.

A request acts as a user, optionally through an API token. A token narrows the user to the token's
project and to the lower of the token's role and the user's current role there. A project the
caller cannot see does not exist for them: lookups raise ``NotFoundError``, never a permission
error, so its existence is not revealed.
"""

from __future__ import annotations

from django.db.models import QuerySet

from webapp.projects import errors
from webapp.projects.models import ROLE_RANKS, ApiToken, Membership, Project, Role


def roles_at_least(role: str) -> list[str]:
    """The roles that include ``role``."""
    floor = ROLE_RANKS[Role(role)]
    return [r.value for r, rank in ROLE_RANKS.items() if rank >= floor]


def projects_visible_to(
    user, *, token: ApiToken | None = None, min_role: str = Role.VIEWER
) -> QuerySet[Project]:
    """Projects where the caller holds ``min_role`` or above."""
    if user is None or not user.is_authenticated:
        return Project.objects.none()
    if token is not None and not Role(token.role).allows(min_role):
        return Project.objects.none()
    projects = Project.objects.filter(
        memberships__user=user, memberships__role__in=roles_at_least(min_role)
    )
    if token is not None:
        projects = projects.filter(pk=token.project_id)
    return projects


def project_get_for(user, *, slug: str, token: ApiToken | None = None) -> Project:
    """A project the caller can see, by slug; ``NotFoundError`` otherwise."""
    project = projects_visible_to(user, token=token).filter(slug=slug).first()
    if project is None:
        raise errors.NotFoundError()
    return project


def role_of(user, project: Project, *, token: ApiToken | None = None) -> Role | None:
    """The caller's effective role in a project, or None when they cannot see it."""
    if user is None or not user.is_authenticated:
        return None
    if token is not None and token.project_id != project.pk:
        return None
    membership = Membership.objects.filter(user=user, project=project).only("role").first()
    if membership is None:
        return None
    role = Role(membership.role)
    if token is not None and ROLE_RANKS[Role(token.role)] < ROLE_RANKS[role]:
        role = Role(token.role)
    return role


def require_role(user, project: Project, role: str, *, token: ApiToken | None = None) -> Role:
    """The caller's role if it is ``role`` or above; ``NotFoundError`` when they cannot see the
    project at all, ``RoleError`` when they can but their role is too low."""
    have = role_of(user, project, token=token)
    if have is None:
        raise errors.NotFoundError()
    if not have.allows(role):
        raise errors.RoleError(errors.ROLE_NEEDED.format(role=Role(role).value, project=project))
    return have


def tokens_of(project: Project) -> QuerySet[ApiToken]:
    """A project's tokens, newest first, revoked ones included."""
    return ApiToken.objects.filter(project=project).select_related("user")
