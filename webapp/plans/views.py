"""Pages: the approvals inbox, and deciding a proposal (from the inbox or a job's page)."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import Http404
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from webapp.plans import errors, selectors, services
from webapp.plans.models import ProposalState
from webapp.projects import errors as project_errors
from webapp.projects.models import Role
from webapp.projects.selectors import projects_visible_to

RECENT = 20


def _inbox_context(user) -> dict:
    approvable = projects_visible_to(user, min_role=Role.APPROVER)
    waiting = selectors.proposal_list_for(user, state=ProposalState.WAITING).filter(
        job__project__in=approvable
    )
    decided = (
        selectors.proposal_list_for(user)
        .filter(job__project__in=approvable)
        .exclude(state=ProposalState.WAITING)[:RECENT]
    )
    return {"waiting": list(waiting), "decided": list(decided)}


@login_required
def approvals_inbox(request):
    return render(request, "plans/inbox.html", {**_inbox_context(request.user), "errors": {}})


@login_required
@require_POST
def proposal_decide_view(request, proposal_id: int):
    """Approve or reject (``decision``) with a ``comment``; back to ``next`` or the inbox."""
    try:
        proposal = selectors.proposal_get_for(request.user, proposal_id=proposal_id)
    except project_errors.NotFoundError:
        raise Http404("no such proposal") from None
    back = request.POST.get("next", "")
    if not url_has_allowed_host_and_scheme(back, allowed_hosts={request.get_host()}):
        back = ""
    back = back or reverse("plans:inbox")
    try:
        services.proposal_decide(
            user=request.user,
            proposal=proposal,
            decision=request.POST.get("decision", ""),
            comment=request.POST.get("comment", ""),
        )
    except project_errors.RoleError as exc:
        raise PermissionDenied(str(exc)) from exc
    except ValidationError as exc:
        # Field errors: shown next to this proposal's form, with what was typed kept.
        context = _inbox_context(request.user)
        context["errors"] = {proposal.pk: exc.message_dict}
        context["typed"] = {proposal.pk: request.POST.get("comment", "")}
        return render(request, "plans/inbox.html", context, status=400)
    except errors.ProposalError as exc:
        messages.error(request, f"proposal {proposal.pk}: {exc}")
        return redirect(back)
    verb = "approved" if request.POST.get("decision") == "approve" else "rejected"
    messages.success(request, f"proposal {proposal.pk} of job {proposal.job_id} {verb}")
    return redirect(back)
