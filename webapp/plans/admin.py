from django.contrib import admin

from webapp.plans.models import Plan, Proposal, Transition


@admin.register(Plan)
class PlanAdmin(admin.ModelAdmin):
    list_display = ["id", "job", "epoch", "predicted_step_s", "current", "reason", "created_at"]
    list_filter = ["current"]


@admin.register(Transition)
class TransitionAdmin(admin.ModelAdmin):
    list_display = ["id", "job", "state", "predicted_s", "actual_s", "num_nodes", "created_at"]
    list_filter = ["state"]


@admin.register(Proposal)
class ProposalAdmin(admin.ModelAdmin):
    list_display = ["id", "job", "state", "proposed_by", "decided_by", "created_at", "expires_at"]
    list_filter = ["state"]
    # Decisions go through the service (role checks, the job's log); the admin only reads them.
    # Nothing is editable nor addable here: rewriting who proposed a change (or to which job, plan
    # or epoch), or forging one in someone else's name, would defeat the two-person rule.
    readonly_fields = ["state", "decided_by", "decided_at", "comment"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False  # viewing needs the view (or change) permission, as usual
