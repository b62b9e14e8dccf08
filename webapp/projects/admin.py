from django.contrib import admin

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
    list_display = ["prefix", "name", "project", "user", "role", "last_used_at", "revoked_at"]
    list_filter = ["role"]
    # The hash is useless to a reader and the secret is never stored: nothing here to reveal.
    exclude = ["key_hash"]
    readonly_fields = ["prefix", "last_used_at"]

    def has_add_permission(self, request) -> bool:
        return False  # tokens are issued through the API, which shows the secret once
