"""A job's directory belongs to the job that made it: a folder an earlier job with the same id
left (the database was reset, restored or replaced, and ids were handed out again) is set aside
whole before the new job writes there, and none of its files is shown as the new job's."""

from __future__ import annotations

import json
import os

import pytest
from django.test import override_settings

from runtime.jobs.driver import JobOutcome
from webapp.jobs import services as job_services
from webapp.jobs.models import JobEvent, JobState
from webapp.jobs.workdir import OWNER_FILE, belongs_to, job_workdir, job_workdir_claim
from webapp.projects.models import Role

SPEC = {"kind": "ppo", "num_slots": 1, "max_slots": 1, "num_steps": 2}


@pytest.fixture
def jobs_dir(tmp_path):
    with override_settings(NEREUS_JOBS_DIR=tmp_path / "jobs"):
        yield tmp_path / "jobs"


@pytest.fixture
def owner(project, member):
    return member(project, Role.OPERATOR, "owner")


@pytest.fixture
def job(project, owner, monkeypatch, jobs_dir):
    monkeypatch.setattr(job_services, "_enqueue_driver", lambda job_id: None)
    return job_services.job_submit(user=owner, project=project, name="ppo", spec=SPEC)


def _old_job_folder(job, *, stamp: dict | str | None, age_s: float = 3600.0):
    """What an earlier job with ``job``'s id left: a committed checkpoint and an export, written
    ``age_s`` before ``job`` was made."""
    folder = job_workdir(job.pk)
    (folder / "checkpoints" / "step-000040").mkdir(parents=True)
    (folder / "checkpoints" / "step-000040" / "COMMITTED").write_text("40")
    manifest = {"files": [], "source": {"role": "actor", "step": 40}}
    (folder / "export" / "actor").mkdir(parents=True)
    (folder / "export" / "actor" / "manifest.json").write_text(json.dumps(manifest))
    if stamp is not None:
        text = stamp if isinstance(stamp, str) else json.dumps(stamp)
        (folder / OWNER_FILE).write_text(text)
    then = job.created_at.timestamp() - age_s
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            os.utime(os.path.join(root, name), (then, then))
    return folder


@pytest.mark.django_db
@pytest.mark.parametrize(
    "stamp",
    [
        None,  # made before folders were stamped: its files are older than the job
        {"job": 1, "created_at": "2020-01-01T00:00:00+00:00"},  # another job 1
        '{"job": 1, "crea',  # a torn stamp is no proof of ownership
    ],
    ids=["unstamped-older", "other-job", "torn"],
)
def test_a_folder_another_job_left_is_set_aside_whole_and_a_new_one_stamped(job, stamp):
    folder = _old_job_folder(job, stamp=stamp)
    assert not belongs_to(folder, job)

    claimed, moved = job_workdir_claim(job)

    assert claimed == folder and moved is not None and moved.parent == folder.parent
    assert moved.name.startswith(f"{job.pk}.set-aside-")
    # Nothing of the old job was lost, and nothing of it is left where the new job works.
    assert (moved / "checkpoints" / "step-000040" / "COMMITTED").read_text() == "40"
    assert (moved / "export" / "actor" / "manifest.json").exists()
    assert sorted(p.name for p in claimed.iterdir()) == [OWNER_FILE]
    assert belongs_to(claimed, job)
    # A second driver of the same job (a takeover) keeps what the first one wrote.
    (claimed / "checkpoints").mkdir()
    again, moved_again = job_workdir_claim(job)
    assert again == claimed and moved_again is None and (claimed / "checkpoints").is_dir()


@pytest.mark.django_db
def test_an_unstamped_folder_written_after_the_job_was_made_stays_the_job_s(job):
    """A job that ran before stamps existed keeps its checkpoints across the upgrade."""
    folder = _old_job_folder(job, stamp=None, age_s=-5.0)
    claimed, moved = job_workdir_claim(job)
    assert moved is None and claimed == folder
    assert (folder / "checkpoints" / "step-000040" / "COMMITTED").exists()
    assert json.loads((folder / OWNER_FILE).read_text())["job"] == job.pk


@pytest.mark.django_db
def test_another_job_s_exports_are_not_listed_or_served_as_this_job_s(api, owner, job):
    _old_job_folder(job, stamp={"job": job.pk, "created_at": "2020-01-01T00:00:00+00:00"})
    client = api(user=owner)
    listed = client.get(f"/api/v1/jobs/{job.pk}/artifacts/")
    assert listed.status_code == 200 and listed.json() == {"results": []}
    one = client.get(f"/api/v1/jobs/{job.pk}/artifacts/actor/manifest.json")
    assert one.status_code == 404 and "no artifact 'actor'" in one.json()["message"]


@pytest.mark.django_db
def test_the_driver_sets_the_old_folder_aside_before_the_job_writes(job, monkeypatch):
    """The driver's claim, with the PPO run itself (Ray slots; tests/webapp/test_ppo_job.py runs
    a real one) replaced by one that records the directory it was given and finds no
    checkpoint there to resume from."""
    folder = _old_job_folder(job, stamp=None)
    seen = {}

    def run_ppo_job(spec, *, workdir, **_):
        seen["workdir"] = workdir
        seen["resumable"] = (workdir / "checkpoints").exists()
        return JobOutcome(status="succeeded", steps_done=2, final_loss=None)

    monkeypatch.setattr("runtime.jobs.ppo_job.run_ppo_job", run_ppo_job)
    assert job_services.job_drive(job_id=job.pk) == JobState.SUCCEEDED
    assert seen == {"workdir": folder, "resumable": False}
    event = JobEvent.objects.get(job=job, kind="job.workdir_set_aside")
    assert event.data["workdir"] == str(folder)
    assert os.path.isfile(os.path.join(event.data["moved_to"], "checkpoints/step-000040/COMMITTED"))


@pytest.mark.django_db
def test_a_claim_racing_another_driver_of_the_job_that_set_the_folder_aside_first(job, monkeypatch):
    """Two drivers of one job (one taking over) both find the foreign folder; the other one
    renames it first. This claim then finds nothing to rename and stamps what is there."""
    folder = _old_job_folder(job, stamp={"job": job.pk, "created_at": "2000-01-01T00:00:00"})
    elsewhere = folder.with_name(f"{folder.name}.set-aside-by-the-other-driver")
    checked = belongs_to

    def other_driver_first(path, of_job):
        mine = checked(path, of_job)
        path.rename(elsewhere)  # the other driver's rename lands between the check and ours
        return mine

    monkeypatch.setattr("webapp.jobs.workdir.belongs_to", other_driver_first)
    claimed, moved = job_workdir_claim(job)
    assert (claimed, moved) == (folder, None)
    assert json.loads((folder / OWNER_FILE).read_text())["job"] == job.pk
    assert not (folder / "checkpoints").exists()
    assert (elsewhere / "checkpoints" / "step-000040" / "COMMITTED").is_file()
