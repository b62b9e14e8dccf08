"""Reads about jobs, with the visibility rules applied in one place."""

from __future__ import annotations

from django.db.models import QuerySet

from webapp.jobs.models import Job, JobEvent


def jobs_visible_to(user) -> QuerySet[Job]:
    """Jobs a user may see: their own (staff see all). Others' jobs are simply not found."""
    if not user.is_authenticated:
        return Job.objects.none()
    if user.is_staff:
        return Job.objects.all()
    return Job.objects.filter(owner=user)


def job_events_since(*, job: Job, after_id: int = 0, limit: int = 1000) -> list[JobEvent]:
    """The job's events with ids greater than ``after_id``, oldest first."""
    return list(job.events.filter(id__gt=after_id).order_by("id")[:limit])
