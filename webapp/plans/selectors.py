"""Reads about plans, transitions and proposals, with the jobs' visibility rules: whatever belongs
to a job the caller cannot see is simply not found."""

from __future__ import annotations

from django.db.models import QuerySet

from webapp.jobs.models import Job
from webapp.jobs.selectors import jobs_visible_to
from webapp.plans.models import Plan, Proposal, ProposalState, Transition
from webapp.projects import errors as project_errors
from webapp.projects.models import ApiToken, Project


def plans_of(job: Job) -> QuerySet[Plan]:
    """A job's plans, newest first."""
    return Plan.objects.filter(job=job)


def transitions_of(job: Job) -> QuerySet[Transition]:
    """A job's transitions, newest first; the DAG is left out (it can be large)."""
    return Transition.objects.filter(job=job).defer("dag")


def transition_get_for(user, *, transition_id: int, token: ApiToken | None = None) -> Transition:
    """One transition of a visible job; ``NotFoundError`` otherwise."""
    transition = (
        Transition.objects.filter(job__in=jobs_visible_to(user, token=token), pk=transition_id)
        .select_related("job")
        .first()
    )
    if transition is None:
        raise project_errors.NotFoundError()
    return transition


def proposal_list_for(
    user,
    *,
    token: ApiToken | None = None,
    state: str | None = None,
    project: Project | None = None,
    job_id: int | None = None,
) -> QuerySet[Proposal]:
    """Proposals of visible jobs, newest first, optionally narrowed by state, project or job."""
    proposals = Proposal.objects.filter(job__in=jobs_visible_to(user, token=token)).select_related(
        "job__project", "proposed_by", "decided_by"
    )
    if state is not None:
        proposals = proposals.filter(state=ProposalState(state))
    if project is not None:
        proposals = proposals.filter(job__project=project)
    if job_id is not None:
        proposals = proposals.filter(job_id=job_id)
    return proposals


def proposal_get_for(user, *, proposal_id: int, token: ApiToken | None = None) -> Proposal:
    """One proposal of a visible job; ``NotFoundError`` whether it is missing or not yours."""
    proposal = proposal_list_for(user, token=token).filter(pk=proposal_id).first()
    if proposal is None:
        raise project_errors.NotFoundError()
    return proposal
