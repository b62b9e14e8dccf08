"""A simulated PPO job driven through the web service: the real controller on the simulated
cluster, its events recorded as plans, proposals and transitions, and a person's approval reaching
the controller between steps (the driver runs in a thread here; in service, in a Celery worker)."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection

from webapp.jobs import services as job_services
from webapp.jobs.models import JobEvent, JobState
from webapp.plans import services as plan_services
from webapp.plans.models import Plan, Proposal, ProposalState, Transition
from webapp.projects.models import Role

pytestmark = pytest.mark.django_db(transaction=True)

SPEC = {"kind": "ppo-sim", "gpus": 16, "num_steps": 40, "trace": "growth", "pace_s": 0.0}


def _submit(owner, project, **changes):
    spec = {**SPEC, **changes}
    return job_services.job_submit(user=owner, project=project, name="sim", spec=spec)


def test_a_simulated_job_records_its_plans_and_labels_every_step(project, member, monkeypatch):
    monkeypatch.setattr(job_services, "_enqueue_driver", lambda job_id: None)
    owner = member(project, Role.OPERATOR, "owner")
    job = _submit(owner, project)
    state = job_services.job_drive(job_id=job.pk)
    job.refresh_from_db()
    assert state == JobState.SUCCEEDED, job.failure_detail
    steps = JobEvent.objects.filter(job=job, kind="step.finished")
    assert steps.count() == 40 and all(e.data["simulated"] for e in steps)
    assert Plan.objects.filter(job=job, current=True).count() == 1
    kinds = set(JobEvent.objects.filter(job=job).values_list("kind", flat=True))
    assert {"control.plan", "control.trigger", "control.decision"} <= kinds


def test_a_person_approves_a_proposal_and_the_controller_acts_on_it(project, member, monkeypatch):
    monkeypatch.setattr(job_services, "_enqueue_driver", lambda job_id: None)
    owner = member(project, Role.OPERATOR, "owner")
    approver = member(project, Role.APPROVER, "approver")
    # The length grows over the first quarter, then holds: proposals made while it grows are
    # superseded; the one standing once it holds is the one a person decides.
    job = _submit(
        owner,
        project,
        trace="plateau",
        gpu="h200",
        gpus=32,
        num_steps=80,
        pace_s=0.05,
        policy={"approval": "manual", "admission": "always_faster"},
    )
    result = {}

    def drive():
        try:
            result["state"] = job_services.job_drive(job_id=job.pk)
        finally:
            connection.close()

    driver = threading.Thread(target=drive)
    driver.start()
    deadline, proposal = time.monotonic() + 60, None
    while proposal is None and time.monotonic() < deadline and driver.is_alive():
        if JobEvent.objects.filter(job=job, kind="step.finished").count() >= 30:
            proposal = Proposal.objects.filter(job=job, state=ProposalState.WAITING).first()
        time.sleep(0.05)
    assert proposal is not None, "the controller never asked for approval"
    plan_services.proposal_decide(
        user=approver, proposal=proposal, decision="approve", comment="the DAG looks right"
    )
    driver.join(timeout=120)
    assert not driver.is_alive() and result["state"] == JobState.SUCCEEDED
    proposal.refresh_from_db()
    assert proposal.state == ProposalState.APPROVED and proposal.decided_by == approver
    applied = JobEvent.objects.get(
        job=job, kind="command.applied", data__proposal=proposal.controller_id
    )
    assert applied.data["outcome"] in ("applied", "stale")
    if applied.data["outcome"] == "applied":
        assert Transition.objects.filter(job=job).exists()


def test_a_bad_simulated_spec_names_the_field(project, member):
    owner = member(project, Role.OPERATOR, "owner")
    for change, field in (
        ({"trace": "zigzag"}, "trace"),
        ({"model": "gpt-9"}, "model"),
        ({"policy": {"gamma": 500}}, "policy.gamma"),
        ({"gpus": 0}, "gpus"),
    ):
        with pytest.raises(Exception) as info:
            _submit(owner, project, **change)
        assert field in str(info.value), (change, info.value)
