from django.contrib import admin, messages
from django.db import transaction
from django.utils import timezone

from webapp.projects import errors as project_errors
from webapp.projects import services as project_services
from webapp.projects.models import ApiToken, Membership, Project


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "personal_for", "created_at"]
    search_fields = ["slug", "name"]
    inlines = [MembershipInline]


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Tokens are read here and can be revoked (an action), never edited: un-revoking one or
    pointing it at another user, project or role would hand its secret's holder that access."""

    list_display = ["prefix", "name", "project", "user", "role", "last_used_at", "revoked_at"]
    list_filter = ["role"]
    # The hash is useless to a reader and the secret is never stored: nothing here to reveal.
    exclude = ["key_hash"]
    readonly_fields = [
        "project",
        "user",
        "name",
        "role",
        "prefix",
        "created_at",
        "last_used_at",
        "revoked_at",
    ]
    actions = ["revoke_tokens"]

    def has_add_permission(self, request) -> bool:
        return False  # tokens are issued through the API, which shows the secret once

    @admin.action(description="Revoke selected tokens", permissions=["change"])
    def revoke_tokens(self, request, queryset) -> None:
        revoked = 0
        for token in queryset.select_related("project", "user"):
            with transaction.atomic():
                try:
                    # The service lets a token's own creator revoke it, whatever their role now.
                    project_services.token_revoke(
                        user=token.user, project=token.project, token_id=token.pk
                    )
                except (project_errors.NotFoundError, project_errors.RoleError):
                    # The creator left the project: the token is disarmed already; revoke it too.
                    ApiToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(
                        revoked_at=timezone.now()
                    )
            revoked += 1
        self.message_user(request, f"Revoked {revoked} token(s).", messages.SUCCESS)
