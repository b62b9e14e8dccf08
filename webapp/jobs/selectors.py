"""Reads about jobs, with the visibility rules applied in one place.

A job is visible to whoever can see its project (see ``webapp.projects.selectors``); any other job
is simply not found.
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

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


def job_artifacts(*, job: Job) -> dict[str, dict]:
    """``{name: manifest}`` of the job's complete exports (``runtime.ppo.export``), read from the
    job's directory; an export still being written has no manifest yet and is not listed."""
    from runtime.ppo.export import artifacts  # torch: only where a model is asked for
    from webapp.jobs.workdir import job_workdir_owned

    folder = job_workdir_owned(job)
    return {} if folder is None else artifacts(folder / "export")


def job_artifact_file(*, job: Job, artifact: str, name: str) -> tuple[BinaryIO, dict]:
    """One file of one export, opened, with its manifest entry: only a file its manifest lists,
    only a regular file (not a link), and only while it has the size the manifest says and the
    manifest did not change while it was being opened (an export replaced then). The caller
    closes the file. ``ArtifactError`` names what is missing."""
    from runtime.ppo.export import artifact as read_artifact
    from runtime.ppo.export import read_manifest
    from webapp.jobs.workdir import job_workdir_owned

    folder = job_workdir_owned(job)
    if folder is None:
        raise ArtifactError("artifact", f"this job has no artifact {artifact!r}")
    root = folder / "export"
    for _ in range(3):
        manifest = read_artifact(root, artifact)
        if manifest is None:
            raise ArtifactError("artifact", f"this job has no artifact {artifact!r}")
        entry = next((f for f in manifest["files"] if f["name"] == name), None)
        if entry is None:
            raise ArtifactError("file", f"artifact {artifact!r} has no file {name!r}")
        handle = _open_regular(root / artifact / entry["name"], entry["bytes"])
        unchanged = read_manifest(root / artifact) == manifest
        if handle is not None and unchanged:
            return handle, entry
        if handle is not None:
            handle.close()
        if unchanged:
            break  # not replaced meanwhile: the file itself is missing or changed
    raise ArtifactError("file", f"{name!r} of artifact {artifact!r} is missing or changed")


def _open_regular(path, size: int) -> BinaryIO | None:
    """``path`` opened if it is a regular file (not a link) of ``size`` bytes, else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    handle = os.fdopen(fd, "rb")
    info = os.fstat(fd)
    if stat.S_ISREG(info.st_mode) and info.st_size == size:
        return handle
    handle.close()
    return None


class ArtifactError(LookupError):
    """No such artifact or file for this job; ``field`` names which."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
