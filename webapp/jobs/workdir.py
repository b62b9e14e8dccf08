"""A job's working directory (its checkpoints and exports), and whose it is.

The directory is ``<NEREUS_JOBS_DIR>/<job id>/``, the same for every driver of the job, so that a
driver taking over after a lost worker resumes from the last committed checkpoint there. Job ids
are not unique over the directory's life, though: a database reset, restored from a backup or
pointed at a new server hands out ids the folders of earlier jobs still carry, and a new job 1
would then resume, and list as its own, what an old job 1 trained.

So the first driver of a job stamps the folder with the job's identity (``owner.json``: id and
creation instant), and every later reader checks it. A folder of another job is set aside whole
(renamed, never deleted: it may be someone's only copy of a trained model) before the job writes
there, and its exports are never shown as this job's.

A folder made before stamps existed has none; it is the job's own when nothing in it is older
than the job (a job's files can only be written after the job was made), give or take ``CLOCK_SLACK_S``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from django.conf import settings
from django.utils import timezone

from runtime.files import write_file
from webapp.jobs.models import Job

OWNER_FILE = "owner.json"

CLOCK_SLACK_S = 2.0
"""How much older than its job a file of an unstamped folder may look and still be the job's:
file times come from the kernel's coarse clock (a tick behind), or from a file server's."""


def job_workdir(job_id: int) -> Path:
    """A job's working directory: the same for every driver of the job."""
    return Path(settings.NEREUS_JOBS_DIR) / str(job_id)


def _identity(job: Job) -> dict:
    return {"job": job.pk, "created_at": job.created_at.isoformat()}


def _stamp(folder: Path) -> dict | None:
    """The folder's owner stamp; ``{}`` for one that cannot be read as one (torn, edited)."""
    try:
        text = (folder / OWNER_FILE).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError):
        return {}
    try:
        stamp = json.loads(text)
    except ValueError:
        return {}
    return stamp if isinstance(stamp, dict) else {}


def _oldest_mtime(folder: Path) -> float | None:
    """The earliest modification time of anything under ``folder``, or None when it is empty."""
    oldest = None
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            try:
                mtime = os.lstat(os.path.join(root, name)).st_mtime
            except FileNotFoundError:
                continue  # removed while walked (a checkpoint pruned): not a witness either way
            oldest = mtime if oldest is None else min(oldest, mtime)
    return oldest


def belongs_to(folder: Path, job: Job) -> bool:
    """Whether ``folder`` (a job directory that exists) is ``job``'s own: stamped with its
    identity, or unstamped with nothing in it older than the job."""
    stamp = _stamp(folder)
    if stamp is not None:
        return stamp == _identity(job)
    oldest = _oldest_mtime(folder)
    return oldest is None or oldest >= job.created_at.timestamp() - CLOCK_SLACK_S


def job_workdir_owned(job: Job) -> Path | None:
    """The job's directory when it exists and is the job's own (see ``belongs_to``), else None:
    what readers of a job's files (its artifacts) ask for."""
    folder = job_workdir(job.pk)
    if not folder.is_dir() or not belongs_to(folder, job):
        return None
    return folder


def job_workdir_claim(job: Job) -> tuple[Path, Path | None]:
    """Make the job's directory its own before a driver writes there: a folder another job left
    is renamed to ``<id>.set-aside-<UTC instant>`` beside it, then the directory is made (when
    missing) and stamped. Returns the directory and where a foreign folder went (None when there
    was none). Drivers of one job claim the same directory; each writes the same stamp."""
    folder = job_workdir(job.pk)
    moved = None
    if folder.is_dir() and not belongs_to(folder, job):
        instant = timezone.now().strftime("%Y%m%dT%H%M%S.%fZ")
        moved = folder.with_name(f"{folder.name}.set-aside-{instant}")
        try:
            folder.rename(moved)
        except FileNotFoundError:
            # Another driver of this job (one taking over) set it aside first; what it made
            # in its place is checked again below and stamped the same.
            moved = None
    folder.mkdir(parents=True, exist_ok=True)
    if _stamp(folder) != _identity(job):
        # Written whole or not at all: a torn stamp would make the folder foreign to its job.
        write_file(folder / OWNER_FILE, json.dumps(_identity(job)))
    return folder, moved
