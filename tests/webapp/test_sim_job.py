"""A simulated PPO job driven through the web service: the real controller on the simulated
cluster, its events recorded as plans, proposals and transitions, and a person's approval reaching
the controller between steps (the driver runs in a thread here; in service, in a Celery worker)."""

from __future__ import annotations

import copy
import threading
import time

import pytest
from django.db import connection

from runtime.planner.plan import Layout
from runtime.planner.plan import Plan as RuntimePlan
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


def _overrides(running: dict) -> tuple[dict, dict]:
    """Two changes a person might make to the running plan: generation on half its units (a
    live transition drops the others), each decoding at once no more sequences than a unit did
    before (so that its KV cache needs no more memory), and every model-stage on slot 0 alone
    (an 8B model's training state is far beyond one device)."""
    fits = copy.deepcopy(running)
    (generation,) = [ms for ms in fits["model_stages"] if ms["name"] == "actor@generation"]
    share = -(-256 // len(generation["units"]))  # the simulated job's 256 sequences a step
    generation["micro_batch"] = min(generation["micro_batch"] or share, share)
    generation["layout"]["dp"] = len(generation["units"]) // 2
    generation["units"] = generation["units"][: generation["layout"]["dp"]]
    layouts = {ms["name"]: (Layout(dp=1, tp=1, pp=1), ((0,),)) for ms in running["model_stages"]}
    too_big = RuntimePlan.of_units(
        accelerator=running["accelerator"], num_slots=running["num_slots"], layouts=layouts
    )
    return fits, too_big.to_json()


def test_an_override_approved_over_rest_moves_the_job_and_one_that_does_not_fit_is_refused(
    project, member, api, monkeypatch
):
    """A person's plan, proposed and approved over REST by two people, reaches the simulated
    job's driver, which moves to it; one that does not fit is refused and the job runs on. An
    approved override crashed the driver's command reader and failed the job (found by
    review)."""
    monkeypatch.setattr(job_services, "_enqueue_driver", lambda job_id: None)
    owner = member(project, Role.OPERATOR, "owner")
    proposer, approver = (
        member(project, Role.OPERATOR, "pat"),
        member(project, Role.APPROVER, "ann"),
    )
    spec = {
        **SPEC,
        "num_steps": 12,
        "trace": "shrink",  # answers get shorter: nothing outgrows memory
        "trace_hours": 1000,  # the spot pool barely moves during the run
        "policy": {"approval": "manual", "admission": "never"},  # only a person moves the plan
    }
    submitted = api(user=owner).post(
        "/api/v1/jobs/", {"name": "sim", "project": "ml", "spec": spec}, format="json"
    )
    assert submitted.status_code == 201, submitted.content
    job_id = submitted.json()["id"]

    # The driver waits before step 4's commands until the first override is approved, and
    # before step 5's until the second is (approved between the same two steps, only the newer
    # would be taken: tests/runtime/jobs/test_commands.py).
    gates = {n: (threading.Event(), threading.Event()) for n in (5, 6)}
    should_stop, calls = job_services._should_stop, []

    def gated(job_id, epoch):
        calls.append(epoch)
        if len(calls) in gates:
            reached, release = gates[len(calls)]
            reached.set()
            release.wait(60)
        return should_stop(job_id, epoch)

    monkeypatch.setattr(job_services, "_should_stop", gated)
    result = {}

    def drive():
        try:
            result["state"] = job_services.job_drive(job_id=job_id)
        finally:
            connection.close()

    driver = threading.Thread(target=drive)
    driver.start()
    try:
        assert gates[5][0].wait(60), "the driver never reached step 4"
        fits, too_big = _overrides(Plan.objects.get(job_id=job_id, current=True).plan)
        ids = []
        for gate, plan_json in zip(gates.values(), (too_big, fits), strict=True):
            assert gate[0].wait(60), "the driver never reached the next step"
            made = api(user=proposer).post(
                f"/api/v1/jobs/{job_id}/override/",
                {"plan": plan_json, "reason": "try this layout"},
                format="json",
            )
            assert made.status_code == 201, made.content
            ids.append(made.json()["id"])
            decided = api(user=approver).post(
                f"/api/v1/proposals/{ids[-1]}/approve/", {"comment": "ok"}, format="json"
            )
            assert decided.status_code == 200, decided.content
            gate[1].set()
    finally:
        for _, release in gates.values():
            release.set()
        driver.join(timeout=120)
    assert not driver.is_alive() and result["state"] == JobState.SUCCEEDED, result

    refused_id, applied_id = ids
    outcomes = {
        e.data["proposal"]: e.data["outcome"]
        for e in JobEvent.objects.filter(job_id=job_id, kind="command.applied")
    }
    assert outcomes[refused_id].startswith("refused: it does not fit in memory"), outcomes
    assert outcomes[applied_id] == "applied", outcomes
    refused = JobEvent.objects.get(job_id=job_id, kind="control.override_refused")
    assert refused.data["reason"].startswith("it does not fit in memory")
    # The job ran every step, and ends on the approved override's plan.
    assert JobEvent.objects.filter(job_id=job_id, kind="step.finished").count() == 12
    current = Plan.objects.get(job_id=job_id, current=True)
    assert RuntimePlan.from_json(current.plan).places_like(RuntimePlan.from_json(fits))
    assert Transition.objects.get(job_id=job_id).to_plan == current
    states = dict(Proposal.objects.filter(job_id=job_id).values_list("pk", "state"))
    assert states == {refused_id: ProposalState.STALE, applied_id: ProposalState.APPROVED}


def test_a_bad_simulated_spec_names_the_field(project, member):
    owner = member(project, Role.OPERATOR, "owner")
    for change, field in (
        ({"trace": "zigzag"}, "trace"),
        ({"model": "gpt-9"}, "model"),
        ({"policy": {"gamma": 500}}, "policy.gamma"),
        ({"gpus": 0}, "gpus"),
        # accepted, it failed the job at its first proposal (found by review)
        ({"policy": {"approval_timeout_s": 3e11}}, "policy.approval_timeout_s"),
    ):
        with pytest.raises(Exception) as info:
            _submit(owner, project, **change)
        assert field in str(info.value), (change, info.value)
