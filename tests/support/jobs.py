"""Rows for web tests: jobs need a project; by default their owner's personal project."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.utils import timezone

from webapp.jobs.models import Job
from webapp.projects.services import project_personal_for


def make_job(*, owner, project=None, name: str = "j", spec: dict[str, Any] | None = None, **fields):
    """A job row as it is stored (no validation, no events, nothing enqueued)."""
    return Job.objects.create(
        name=name,
        owner=owner,
        project=project if project is not None else project_personal_for(owner),
        spec=spec if spec is not None else {"num_slots": 1, "num_steps": 1},
        **fields,
    )


def silence(job: Job, seconds: float) -> None:
    """The job's driver last beat ``seconds`` ago."""
    Job.objects.filter(pk=job.pk).update(heartbeat_at=timezone.now() - timedelta(seconds=seconds))
