"""Projects, memberships with ordered roles, and project-scoped API tokens."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class Role(models.TextChoices):
    """What a member may do; each role includes every role below it."""

    VIEWER = "viewer"
    OPERATOR = "operator"
    APPROVER = "approver"
    ADMIN = "admin"

    @property
    def rank(self) -> int:
        return ROLE_RANKS[self]

    def allows(self, needed: str) -> bool:
        """Whether this role is ``needed`` or above it."""
        return ROLE_RANKS[self] >= ROLE_RANKS[Role(needed)]


ROLE_RANKS = {Role.VIEWER: 0, Role.OPERATOR: 1, Role.APPROVER: 2, Role.ADMIN: 3}


class Project(models.Model):
    """A group of jobs and the people who may see and steer them."""

    name = models.CharField(max_length=200)
    slug = models.SlugField(max_length=64, unique=True)
    personal_for = models.OneToOneField(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="personal_project",
        help_text="Set on the project a user's jobs go to when they name none.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug


class Membership(models.Model):
    """A user's role in one project."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.VIEWER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "project"], name="projects_one_role_per_user")
        ]

    def __str__(self) -> str:
        return f"{self.user_id}@{self.project_id}: {self.role}"


class ApiToken(models.Model):
    """A revocable bearer token for one project. Only a hash of the secret is stored.

    A token acts for the user who created it, limited to its project and to the lower of its own
    role and that user's current role there; removing the member, or lowering their role, also
    revokes their tokens that the change leaves above it (``signals``).
    """

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="api_tokens")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    name = models.CharField(max_length=200)
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.OPERATOR)
    prefix = models.CharField(
        max_length=16,
        help_text="The secret's first characters, to tell tokens apart; not enough to use one.",
    )
    key_hash = models.CharField(max_length=64, unique=True, help_text="SHA-256 of the secret.")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="The token no longer works after this; none: until revoked.",
    )

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.project_id})"

    @property
    def is_active(self) -> bool:
        return self.revoked_at is None and not self.is_expired

    @property
    def is_expired(self) -> bool:
        from django.utils import timezone

        return self.expires_at is not None and self.expires_at <= timezone.now()
