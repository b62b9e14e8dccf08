"""Reads about jobs, with the visibility rules applied in one place.

A job is visible to whoever can see its project (see ``webapp.projects.selectors``); any other job
is simply not found.
"""

from __future__ import annotations

from django.db.models import QuerySet

from webapp.jobs.models import Job, JobEvent, JobState
from webapp.projects import errors as project_errors
from webapp.projects.models import ApiToken, Project
from webapp.projects.selectors import projects_visible_to


def jobs_visible_to(user, *, token: ApiToken | None = None) -> QuerySet[Job]:
    """Jobs of the projects the caller can see, newest first."""
    return Job.objects.filter(project__in=projects_visible_to(user, token=token))


def job_list_for(
    user,
    *,
    token: ApiToken | None = None,
    state: str | None = None,
    project: Project | None = None,
) -> QuerySet[Job]:
    """Visible jobs, optionally only those in ``state`` or in ``project``."""
    jobs = jobs_visible_to(user, token=token).select_related("project", "owner")
    if state is not None:
        jobs = jobs.filter(state=JobState(state))
    if project is not None:
        jobs = jobs.filter(project=project)
    return jobs


def job_get_for(user, *, job_id: int, token: ApiToken | None = None) -> Job:
    """One visible job; ``NotFoundError`` whether it does not exist or the caller cannot see it."""
    job = job_list_for(user, token=token).filter(pk=job_id).first()
    if job is None:
        raise project_errors.NotFoundError()
    return job


def job_events_since(*, job: Job, after_id: int = 0, limit: int = 1000) -> list[JobEvent]:
    """The job's events with ids greater than ``after_id``, oldest first."""
    return list(job.events.filter(id__gt=after_id).order_by("id")[:limit])
