"""A real PPO job (kind "ppo") through the web service: submission errors that name the field, and a
small job on CPU slots (a local Ray instance) driven to completion through the services, with its
controller's events recorded as plans and transitions, its checkpoints in the job's own
directory and its trained actor exported there."""

from __future__ import annotations

import hashlib

import pytest
import torch
from django.test import override_settings

from runtime.ppo import export
from runtime.ppo.weights import read_state_dict
from webapp.jobs import services as job_services
from webapp.jobs.models import Job, JobEvent, JobState
from webapp.plans.models import Plan, Transition, TransitionState
from webapp.projects.models import Role

JOBS = "/api/v1/jobs/"
# Small enough for two shared CPU cores: a few seconds a step.
SPEC = {
    "kind": "ppo",
    "model": "tiny-sft",
    "tasks": "copy",
    "reward": "length",
    "num_slots": 2,
    "max_slots": 2,
    "num_steps": 6,
    "batch_size": 16,
    "max_new_tokens": 8,
    "warmup_steps": 5,
    "checkpoint_every": 2,
}


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"tasks": "zigzag"}, "spec.tasks"),
        ({"reward": "vibes"}, "spec.reward"),
        ({"model": "gpt-9"}, "spec.model"),
        ({"batch_size": 0}, "spec.batch_size"),
        ({"max_new_tokens": 0}, "spec.max_new_tokens"),
        ({"num_slots": 3, "max_slots": 2}, "spec.max_slots"),
        ({"revoke_at_step": 6}, "spec.revoke_at_step"),
        ({"num_slots": 1, "max_slots": 1, "revoke_at_step": 2}, "spec.revoke_at_step"),
        ({"checkpoint_every": -1}, "spec.checkpoint_every"),
        ({"pace_s": 61}, "spec.pace_s"),
        ({"policy": {"approval": "sometimes"}}, "spec.policy.approval"),
        ({"policy": {"approval_above_s": -1}}, "spec.policy.approval_above_s"),
        ({"num_steps": "many"}, "spec.num_steps"),
        ({"surprise": 1}, "spec.surprise"),
    ],
)
def test_a_bad_ppo_spec_is_a_400_naming_the_field(api, project, member, change, field):
    client = api(user=member(project, Role.OPERATOR, "owner"))
    response = client.post(
        JOBS, {"project": "ml", "name": "ppo", "spec": {**SPEC, **change}}, format="json"
    )
    assert response.status_code == 400, response.content
    fields = response.json()["fields"]
    assert any(key == field or key.startswith(field) for key in fields), fields
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_a_good_ppo_spec_is_stored_whole(api, project, member, monkeypatch):
    monkeypatch.setattr(job_services, "_enqueue_driver", lambda job_id: None)
    client = api(user=member(project, Role.OPERATOR, "owner"))
    response = client.post(JOBS, {"project": "ml", "name": "ppo", "spec": SPEC}, format="json")
    assert response.status_code == 201, response.content
    job = Job.objects.get()
    assert job.spec["kind"] == "ppo" and job.spec["batch_size"] == 16
    assert job.spec["revoke_at_step"] == -1 and job.spec["policy"] == {}


@pytest.mark.ray
@pytest.mark.django_db(transaction=True)
def test_a_real_ppo_job_runs_through_the_services_and_records_its_controller(
    api, project, member, monkeypatch, tmp_path
):
    """The slot pool loses a slot before step 2: the controller's urgent transition runs on the
    real slots (without approval) and is recorded with its DAG; every step is real."""
    monkeypatch.setattr(job_services, "_enqueue_driver", lambda job_id: None)
    owner = member(project, Role.OPERATOR, "owner")
    spec = {**SPEC, "max_slots": 4, "num_slots": 4, "revoke_at_step": 2}
    with override_settings(NEREUS_JOBS_DIR=tmp_path / "jobs"):
        job = job_services.job_submit(user=owner, project=project, name="ppo", spec=spec)
        state = job_services.job_drive(job_id=job.pk)
    job.refresh_from_db()
    assert state == JobState.SUCCEEDED, job.failure_detail
    assert job.epoch == 1 and job.heartbeat_at is not None
    events = list(JobEvent.objects.filter(job=job))
    steps = [e.data for e in events if e.kind == "step.finished"]
    assert [s["step"] for s in steps] == list(range(6))
    assert all(s["simulated"] is False and s["ok"] for s in steps)
    assert all(s["ppo"]["mean_reward"] is not None for s in steps)
    assert [s["num_slots"] for s in steps] == [4, 4, 3, 3, 3, 3]
    kinds = [e.kind for e in events]
    assert "engine.revoked" in kinds and "slots.ready" in kinds
    assert {"control.plan", "control.decision", "control.transition"} <= set(kinds), kinds
    finished = next(e.data for e in events if e.kind == "job.finished")
    assert finished["status"] == "succeeded" and finished["simulated"] is False
    # The controller's events became rows: the plan in force, and the transition with its DAG.
    assert Plan.objects.filter(job=job, current=True).count() == 1
    transition = Transition.objects.filter(job=job).order_by("pk").first()
    assert transition is not None and transition.state == TransitionState.DONE
    assert transition.dag["nodes"] and not transition.simulated
    # The live node reports of the DAG came before the transition's record.
    first_node = kinds.index("transition.node")
    assert first_node < kinds.index("control.transition")
    # Checkpoints are in the job's own directory, where a new driver would look for them.
    job_dir = tmp_path / "jobs" / str(job.pk)
    assert any(job_dir.rglob("*")), "no checkpoint written"
    # The trained actor was exported at the end, as the units held it: the REST API lists it and
    # serves its files; its weights are the last checkpoint's (saved after the last step, in the
    # layout the job ended on), read back on one process by ``nereus export``'s code.
    exported = next(e.data for e in events if e.kind == "job.exported")
    assert exported["artifact"] == "actor" and exported["step"] == 6
    client = api(user=owner)
    with override_settings(NEREUS_JOBS_DIR=tmp_path / "jobs"):
        (artifact,) = client.get(f"/api/v1/jobs/{job.pk}/artifacts/").json()["results"]
        files = {f["name"]: f for f in artifact["files"]}
        body = b"".join(client.get(files["model.safetensors"]["url"]).streaming_content)
    assert hashlib.sha256(body).hexdigest() == files["model.safetensors"]["sha256"]
    (tmp_path / "model.safetensors").write_bytes(body)
    live = read_state_dict(tmp_path / "model.safetensors")
    from_checkpoint = read_state_dict(
        export.export_job_checkpoint(job_dir, tmp_path / "from-checkpoint", dtype="float32")
    )
    assert live.keys() == from_checkpoint.keys() and "lm_head.weight" in live
    for key, tensor in live.items():
        assert torch.equal(tensor, from_checkpoint[key]), key


@pytest.mark.ray
@pytest.mark.django_db(transaction=True)
def test_an_operator_resizes_a_real_ppo_job_s_pool_before_and_while_it_runs(
    project, member, monkeypatch, tmp_path
):
    """Given to the pending job, a pool of 3 is the one its driver starts on; given while it
    runs, a shrink to 2 with notice reaches the driver between steps, which moves the job off
    slot 2 while it still holds its state and then releases it: no step fails or repeats."""
    monkeypatch.setattr(job_services, "_enqueue_driver", lambda job_id: None)
    owner = member(project, Role.OPERATOR, "owner")
    spec = {**SPEC, "num_slots": 2, "max_slots": 3, "num_steps": 4}
    calls = {"n": 0}
    commands = job_services._ControlLink.commands

    def commands_with_a_shrink(link):
        calls["n"] += 1
        if calls["n"] == 2:  # before the job's step 1
            job_services.job_resize_for(user=owner, job_id=link.job_id, slots=2, notice_s=120)
        return commands(link)

    monkeypatch.setattr(job_services._ControlLink, "commands", commands_with_a_shrink)
    with override_settings(NEREUS_JOBS_DIR=tmp_path / "jobs"):
        job = job_services.job_submit(user=owner, project=project, name="ppo", spec=spec)
        job_services.job_resize_for(user=owner, job_id=job.pk, slots=3)
        state = job_services.job_drive(job_id=job.pk)
    job.refresh_from_db()
    assert state == JobState.SUCCEEDED, job.failure_detail
    events = list(JobEvent.objects.filter(job=job))
    data = {kind: [e.data for e in events if e.kind == kind] for kind in {e.kind for e in events}}
    assert data["slots.ready"][0]["num_slots"] == 3
    steps = data["step.finished"]
    assert [s["step"] for s in steps] == [0, 1, 2, 3] and all(s["ok"] for s in steps)
    assert [s["num_slots"] for s in steps] == [3, 2, 2, 2]
    (applied,) = data["command.applied"]
    assert applied["command"] == "resize" and applied["slots"] == 2
    assert "released once the job is off them" in applied["outcome"]
    assert [e["slot"] for e in data["engine.released"]] == [2]
    assert "engine.step_failed" not in data and "engine.reclaimed" not in data


@pytest.mark.django_db
def test_the_job_awaits_approval_while_its_controller_s_proposal_waits(project, member):
    from tests.support.jobs import make_job
    from tests.support.plans import initial_event, proposal_event

    job = make_job(
        owner=member(project, Role.OPERATOR, "owner"), project=project, state="running", epoch=1
    )
    link = job_services._ControlLink(job.pk, 1)
    link.emit_control(initial_event())
    link.emit_control(proposal_event(1))
    job.refresh_from_db()
    assert job.state == JobState.AWAITING_APPROVAL
    link.emit_control({"event": "control.approved", "proposal": 1})
    job.refresh_from_db()
    assert job.state == JobState.RUNNING
    link.emit_control(proposal_event(2))
    # The job ends while a proposal still waits: it succeeds all the same.
    assert job_services._finish(job.pk, 1, JobState.SUCCEEDED) == JobState.SUCCEEDED
    states = list(
        JobEvent.objects.filter(job=job, kind="job.state").values_list("data__state", flat=True)
    )
    assert states == ["awaiting_approval", "running", "awaiting_approval", "running", "succeeded"]
