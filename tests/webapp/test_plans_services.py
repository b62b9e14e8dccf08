"""``webapp.plans.services``: controller events into rows and the job's log, and people's
decisions on proposals (roles, comments, self-approval, state)."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from runtime.jobs.driver import apply_commands
from runtime.jobs.spec import PpoSimJobSpec
from tests.support import plans as events
from tests.support.jobs import make_job
from webapp.jobs import errors as job_errors
from webapp.jobs import services as job_services
from webapp.jobs.models import JobEvent, JobState
from webapp.plans import errors, services
from webapp.plans.models import (
    Plan,
    Proposal,
    ProposalRoute,
    ProposalState,
    Transition,
    TransitionState,
)
from webapp.projects import errors as project_errors
from webapp.projects.models import Role

pytestmark = pytest.mark.django_db


@pytest.fixture
def owner(project, member):
    return member(project, Role.OPERATOR, "owner")


@pytest.fixture
def job(owner, project):
    """A PPO job (on the simulated cluster): the kind a controller drives."""
    spec = PpoSimJobSpec().to_json()
    return make_job(owner=owner, project=project, state=JobState.RUNNING, epoch=1, spec=spec)


@pytest.fixture
def approver(project, member):
    return member(project, Role.APPROVER, "approver")


def _record(job, *items, **kwargs):
    return [services.record_controller_event(job=job, event=e, **kwargs) for e in items]


def _kinds(job) -> list[str]:
    return list(job.events.values_list("kind", flat=True))


# --- a real controller, end to end -------------------------------------------------------------


def test_a_real_controllers_events_become_plans_a_proposal_and_a_transition(job, approver):
    controller, engine = events.simulated_controller(
        lambda e: services.record_controller_event(job=job, event=e), approval="manual"
    )
    initial = Plan.objects.get(job=job)
    assert initial.current and initial.reason == "initial" and initial.epoch == 1
    assert initial.predicted_step_s == pytest.approx(controller.plan.predicted_step_s)
    events.run_steps(controller, engine, range(3))  # the pool grows; the controller asks first
    proposal = Proposal.objects.get(job=job)
    assert (proposal.state, proposal.controller_id, proposal.proposed_by) == ("waiting", 1, None)
    assert proposal.plan == controller.pending.plan.to_json()
    assert proposal.verdict["admit"] and proposal.verdict["saving_s"] > 0
    assert proposal.reason == proposal.verdict["reason"]
    assert proposal.expires_at - proposal.created_at == pytest.approx(
        timedelta(seconds=3600), abs=timedelta(seconds=5)
    )

    services.proposal_decide(
        user=approver, proposal=proposal, decision="approve", comment="worth 16 more GPUs"
    )
    command = job.events.get(kind="command.approve")
    assert command.data["proposal"] == 1 and command.data["comment"] == "worth 16 more GPUs"
    assert command.data["plan"] == proposal.plan and command.epoch == 1
    # What the driver will do with that command (not built yet): hand it to the controller.
    assert controller.command("approve", command.data["proposal"], engine) == "applied"

    proposal.refresh_from_db()
    assert proposal.state == ProposalState.APPROVED and proposal.decided_by == approver
    transition = Transition.objects.get(job=job)
    assert transition.state == TransitionState.DONE and transition.from_plan == initial
    assert transition.to_plan.current and transition.to_plan.plan == proposal.plan
    assert transition.num_nodes == len(transition.dag["nodes"]) > 0
    assert transition.predicted_s > 0 and transition.actual_s > 0 and transition.simulated
    assert list(Plan.objects.filter(job=job, current=True)) == [transition.to_plan]
    kinds = _kinds(job)
    assert kinds.index("control.proposal") < kinds.index("command.approve")
    assert kinds.index("control.approved") < kinds.index("control.transition")
    logged = job.events.get(kind="control.transition")
    assert logged.data["record"] == {"transition": transition.pk, "plan": transition.to_plan_id}


def test_an_unanswered_proposal_expires_and_the_job_keeps_its_plan(job):
    controller, engine = events.simulated_controller(
        lambda e: services.record_controller_event(job=job, event=e),
        approval="manual",
        approval_timeout_s=30,
    )
    events.run_steps(controller, engine, range(4))
    assert Proposal.objects.get(job=job).state == ProposalState.EXPIRED
    assert not Transition.objects.exists()
    assert Plan.objects.get(job=job, current=True).reason == "initial"


@pytest.mark.parametrize("stored", [3e11, 1e300, 10**30])
def test_a_stored_approval_timeout_beyond_30_days_waits_30_days(owner, project, stored):
    """A spec stored before the bound (or written around it) must not fail the job at its first
    proposal: the deadline overflowed the calendar (found by review)."""
    job = make_job(
        owner=owner,
        project=project,
        state=JobState.RUNNING,
        epoch=1,
        spec={"kind": "ppo-sim", "policy": {"approval": "manual", "approval_timeout_s": stored}},
    )
    assert services.approval_timeout(job) == timedelta(days=30)
    before = timezone.now()
    _record(job, events.proposal_event(1))
    waiting = Proposal.objects.get(job=job)
    assert before + timedelta(days=30) <= waiting.expires_at <= timezone.now() + timedelta(days=30)


def test_automatic_transitions_take_their_target_from_the_decision(job):
    controller, engine = events.simulated_controller(
        lambda e: services.record_controller_event(job=job, event=e)
    )
    events.run_steps(controller, engine, range(2))
    transition = Transition.objects.get(job=job)
    assert transition.to_plan.plan == controller.plan.to_json() and transition.to_plan.current
    assert not Proposal.objects.exists()


# --- single events -----------------------------------------------------------------------------


def test_the_same_event_id_is_recorded_once(job):
    first = services.record_controller_event(job=job, event=events.initial_event(), event_id="1:1")
    again = services.record_controller_event(job=job, event=events.initial_event(), event_id="1:1")
    assert first.pk == again.pk and Plan.objects.count() == 1 and job.events.count() == 1
    assert first.data["event_id"] == "1:1"
    services.record_controller_event(job=job, event=events.initial_event(8), event_id="1:2")
    assert Plan.objects.count() == 2 and Plan.objects.filter(current=True).count() == 1


def test_a_failed_transition_keeps_the_current_plan(job):
    _record(job, events.initial_event(4), events.decision_event(4, 8))
    _record(job, events.transition_event(4, 8, ok=False))
    transition = Transition.objects.get()
    assert transition.state == TransitionState.FAILED
    assert transition.failure == "slot 3 stopped answering"
    assert not transition.to_plan.current and transition.to_plan.reason == "transition failed"
    assert Plan.objects.get(current=True) == transition.from_plan


def test_a_transition_or_restart_naming_its_target_records_that_plan(job):
    """Not the last decision's candidate, which a move the controller had in hand may not be
    (a staged move, the salvage plan a restart replaced)."""
    _record(job, events.initial_event(4), events.decision_event(4, 8))
    _record(job, {**events.transition_event(4, 2), "target": events.plan_json(2)})
    assert Transition.objects.get().to_plan.plan == events.plan_json(2)
    assert Plan.objects.get(current=True).plan == events.plan_json(2)
    _record(job, events.decision_event(2, 8))
    restart = {"event": "control.restart", "seconds": 1.0, "reason": "r", "target": None}
    with pytest.raises(ValueError, match="target"):
        _record(job, restart)
    _record(job, {**restart, "target": events.plan_json(4)})
    assert Plan.objects.get(current=True).plan == events.plan_json(4)


def test_infinite_numbers_are_stored_as_null(job):
    infeasible = events.decision_event(cost_s=math.inf, infeasible="slot 2 cannot hold it")
    logged = services.record_controller_event(job=job, event=infeasible)
    logged.refresh_from_db()
    assert logged.data["verdict"]["cost_s"] is None
    assert logged.data["verdict"]["reason"] == "infeasible: slot 2 cannot hold it"


def test_a_new_proposal_makes_the_waiting_one_stale(job):
    _record(job, events.proposal_event(1), events.proposal_event(2, 4, 6))
    states = dict(Proposal.objects.values_list("controller_id", "state"))
    assert states == {1: ProposalState.STALE, 2: ProposalState.WAITING}


def test_controller_outcomes_set_the_proposals_state(job, approver):
    _record(job, events.proposal_event(1))
    proposal = Proposal.objects.get()
    services.proposal_decide(user=approver, proposal=proposal, decision="approve", comment="ok")
    # The units changed before the driver passed the approval on: the plan was not applied.
    _record(job, {"event": "control.stale", "proposal": 1})
    proposal.refresh_from_db()
    assert proposal.state == ProposalState.STALE and proposal.decided_by == approver
    _record(job, {"event": "control.rejected", "proposal": 99})  # unknown: logged only
    assert job.events.filter(kind="control.rejected").get().data["record"] == {"proposal": None}


def test_a_proposal_keeps_its_route(job):
    """A proposal the controller can only reach by checkpoint/restart says so; one without a
    route (an older driver) is a live transition."""
    _record(job, events.proposal_event(1))
    _record(job, {**events.proposal_event(2), "route": "restart"})
    routes = dict(Proposal.objects.values_list("controller_id", "route"))
    assert routes == {1: ProposalRoute.LIVE, 2: ProposalRoute.RESTART}


def test_an_older_epoch_is_refused(job):
    with pytest.raises(job_errors.StaleEpochError):
        services.record_controller_event(job=job, event=events.initial_event(), epoch=0)
    assert not Plan.objects.exists() and not JobEvent.objects.exists()


@pytest.mark.parametrize(
    ("event", "field"),
    [
        ({"plan": {}}, "event"),
        ({"event": "control.plan"}, "plan"),
        ({"event": "control.plan", "plan": {"num_slots": 2}}, "plan"),
        ({"event": "control.proposal", "plan": events.plan_json()}, "proposal"),
        (
            {"event": "control.proposal", "proposal": 1, "plan": events.plan_json(), "verdict": 3},
            "verdict",
        ),
        ({**events.proposal_event(1), "route": "teleport"}, "route"),
        ({"event": "control.transition", "ok": True, "predicted_s": 1.0, "dag": []}, "dag"),
        (
            {"event": "control.transition", "ok": "yes", "predicted_s": 1.0, "dag": {"nodes": []}},
            "ok",
        ),
        (
            {"event": "control.transition", "ok": True, "predicted_s": "1", "dag": {"nodes": []}},
            "predicted_s",
        ),
    ],
)
def test_malformed_events_raise_naming_the_field(job, event, field):
    with pytest.raises(ValueError, match=rf"^event\.{field}: "):
        services.record_controller_event(job=job, event=event)
    assert not JobEvent.objects.exists()


# --- decisions ---------------------------------------------------------------------------------


@pytest.fixture
def waiting(job):
    _record(job, events.proposal_event(1))
    return Proposal.objects.get()


@pytest.mark.parametrize("role", [Role.VIEWER, Role.OPERATOR])
def test_below_approver_cannot_decide(waiting, project, member, role):
    person = member(project, role)
    with pytest.raises(project_errors.RoleError):
        services.proposal_decide(user=person, proposal=waiting, decision="approve", comment="x")
    waiting.refresh_from_db()
    assert waiting.state == ProposalState.WAITING


def test_another_projects_member_does_not_find_it(waiting, other_project, member):
    stranger = member(other_project, Role.ADMIN)
    with pytest.raises(project_errors.NotFoundError):
        services.proposal_decide(user=stranger, proposal=waiting, decision="approve", comment="x")


@pytest.mark.parametrize(
    ("decision", "comment", "field"),
    [("approve", "", "comment"), ("reject", "  \n", "comment"), ("maybe", "ok", "decision")],
)
def test_bad_decisions_name_the_field(waiting, approver, decision, comment, field):
    with pytest.raises(ValidationError) as caught:
        services.proposal_decide(
            user=approver, proposal=waiting, decision=decision, comment=comment
        )
    assert list(caught.value.message_dict) == [field]


def test_only_waiting_proposals_can_be_decided(waiting, approver):
    services.proposal_decide(user=approver, proposal=waiting, decision="reject", comment="no")
    with pytest.raises(errors.ProposalError, match="is rejected, not waiting"):
        services.proposal_decide(user=approver, proposal=waiting, decision="approve", comment="y")
    assert waiting.job.events.filter(kind__startswith="command.").count() == 1


def test_a_proposal_past_its_deadline_expires_when_decided(waiting, approver):
    Proposal.objects.filter(pk=waiting.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    with pytest.raises(errors.ProposalError, match="expired"):
        services.proposal_decide(user=approver, proposal=waiting, decision="approve", comment="y")
    waiting.refresh_from_db()
    assert waiting.state == ProposalState.EXPIRED  # kept although the call failed


def test_a_proposal_of_an_older_driver_or_a_finished_job_is_stale(waiting, approver, job):
    job.epoch = 2
    job.save(update_fields=["epoch"])
    with pytest.raises(errors.ProposalError, match="epoch 1"):
        services.proposal_decide(user=approver, proposal=waiting, decision="approve", comment="y")
    waiting.refresh_from_db()
    assert waiting.state == ProposalState.STALE
    _record(job, events.proposal_event(1))
    fresh = Proposal.objects.get(epoch=2)
    job.state = JobState.SUCCEEDED
    job.save(update_fields=["state"])
    with pytest.raises(errors.ProposalError, match="has finished"):
        services.proposal_decide(user=approver, proposal=fresh, decision="reject", comment="y")


def test_self_approval_is_refused_unless_allowed(job, owner, approver, settings, member, project):
    membership_owner = member(project, Role.APPROVER, "proposer")
    override = services.proposal_override(
        user=membership_owner, job=job, plan=events.plan_json(8), reason="more slots"
    )
    assert override.proposed_by == membership_owner and override.verdict is None
    with pytest.raises(errors.SelfApprovalError):
        services.proposal_decide(
            user=membership_owner, proposal=override, decision="approve", comment="mine"
        )
    settings.NEREUS_ALLOW_SELF_APPROVAL = True
    decided = services.proposal_decide(
        user=membership_owner, proposal=override, decision="approve", comment="mine"
    )
    assert decided.state == ProposalState.APPROVED
    assert job.events.get(kind="command.approve").data["proposal"] is None


def test_a_proposer_may_withdraw_their_own_override(job, approver):
    override = services.proposal_override(
        user=approver, job=job, plan=events.plan_json(8), reason="try it"
    )
    services.proposal_decide(user=approver, proposal=override, decision="reject", comment="no")
    override.refresh_from_db()
    assert override.state == ProposalState.REJECTED


def test_overrides_need_an_operator_and_a_plan(job, project, member):
    viewer = member(project, Role.VIEWER)
    with pytest.raises(project_errors.RoleError):
        services.proposal_override(user=viewer, job=job, plan=events.plan_json(8), reason="")
    operator = member(project, Role.OPERATOR, "op")
    with pytest.raises(ValidationError) as caught:
        services.proposal_override(user=operator, job=job, plan={"num_slots": 3}, reason="")
    assert list(caught.value.message_dict) == ["plan"]


def test_overdue_proposals_expire(waiting):
    assert services.proposals_expire_overdue() == 0
    later = waiting.expires_at + timedelta(seconds=1)
    assert services.proposals_expire_overdue(now=later) == 1
    waiting.refresh_from_db()
    assert waiting.state == ProposalState.EXPIRED
    # Pages showing it learn it (they stop offering Approve): one event for the job.
    (event,) = JobEvent.objects.filter(job=waiting.job, kind="proposals.expired")
    assert event.data["proposals"] == [waiting.pk] and "deadline" in event.data["reason"]
    assert services.proposals_expire_overdue(now=later) == 0


def test_a_decision_that_finds_a_proposal_expired_says_so_to_the_job_s_pages(waiting, approver):
    Proposal.objects.filter(pk=waiting.pk).update(expires_at=timezone.now())
    with pytest.raises(errors.ProposalError):
        services.proposal_decide(
            user=approver, proposal=waiting, decision="approve", comment="late"
        )
    (event,) = JobEvent.objects.filter(job=waiting.job, kind="proposals.expired")
    assert event.data["proposals"] == [waiting.pk]


def test_the_beat_schedule_runs_registered_tasks_and_expires_overdue_proposals(waiting):
    from django.conf import settings

    from webapp.celery import app

    app.loader.import_default_modules()  # what a worker does at start: autodiscovery
    scheduled = {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    assert {"jobs.reap", "plans.expire"} <= scheduled
    assert scheduled <= set(app.tasks)
    expire = app.tasks["plans.expire"]
    assert expire.apply().get() == 0  # not due yet
    Proposal.objects.filter(pk=waiting.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert expire.apply().get() == 1
    waiting.refresh_from_db()
    assert waiting.state == ProposalState.EXPIRED


def test_an_override_to_the_running_plan_cancels_a_move_staged_meanwhile(
    owner, approver, project, no_live_delivery
):
    """The controller (approval auto) staged a move after step 0; a person's override to stay
    on the running plan, approved, is handed over between steps: the staged move is not made
    after the next step, and the job's current plan in the database is the one it runs."""
    job = make_job(
        owner=owner, project=project, state=JobState.RUNNING, epoch=1, spec={"kind": "ppo-sim"}
    )
    link = job_services._ControlLink(job.pk, 1)
    sink = job_services.DatabaseEventSink(job_id=job.pk, epoch=1)
    # Generation units slow to start (60 s), slots granted once the job has run: the
    # controller builds the new units ahead on them while one more step runs, and stages the
    # move.
    controller, engine = events.simulated_controller(
        link.emit_control, approval="auto", serving_start_s=60.0, grow_at_s=60.0
    )
    step = 0
    while controller.staged is None and step < 10:
        events.run_steps(controller, engine, range(step, step + 1))
        step += 1
    assert controller.staged is not None  # a move in hand, to run after the next step
    running = controller.plan.to_json()
    stay = services.proposal_override(user=owner, job=job, plan=running, reason="stay")
    services.proposal_decide(user=approver, proposal=stay, decision="approve", comment="ok")
    apply_commands(controller, engine, link.commands(), sink)  # the driver, between steps
    applied = JobEvent.objects.get(job=job, kind="command.applied")
    assert applied.data["outcome"] == "unchanged"
    events.run_steps(controller, engine, range(step, step + 1))
    assert controller.plan.to_json() == running and controller.staged is None
    assert not Transition.objects.filter(job=job).exists()
    assert Plan.objects.get(job=job, current=True).plan == running


def test_of_two_overrides_only_the_newer_is_approved_and_reaches_the_controller(
    owner, approver, project, no_live_delivery
):
    """The controller waits for approval of a move; a person proposes a plan, then another:
    each newer proposal makes the older stale (the older override cannot be approved, where
    it once was and both reached the job), the controller lets its own go between steps, and
    the job moves to the newest plan alone."""
    job = make_job(
        owner=owner, project=project, state=JobState.RUNNING, epoch=1, spec={"kind": "ppo-sim"}
    )
    link = job_services._ControlLink(job.pk, 1)
    sink = job_services.DatabaseEventSink(job_id=job.pk, epoch=1)
    controller, engine = events.simulated_controller(link.emit_control, approval="manual")
    events.run_steps(controller, engine, range(1))
    asked = Proposal.objects.get(job=job)
    assert controller.pending is not None and asked.state == ProposalState.WAITING
    job.refresh_from_db()
    assert job.state == JobState.AWAITING_APPROVAL
    running = controller.plan.to_json()
    elsewhere = controller.pending.plan.to_json()

    older = services.proposal_override(user=owner, job=job, plan=elsewhere, reason="move")
    newer = services.proposal_override(user=owner, job=job, plan=running, reason="stay")
    asked.refresh_from_db()
    older.refresh_from_db()
    assert (asked.state, older.state) == (ProposalState.STALE, ProposalState.STALE)
    with pytest.raises(errors.ProposalError) as refused:
        services.proposal_decide(user=approver, proposal=older, decision="approve", comment="go")
    assert str(refused.value) == errors.SUPERSEDED.format(proposal_id=older.pk, newer=newer.pk)
    services.proposal_decide(user=approver, proposal=newer, decision="approve", comment="stay")

    apply_commands(controller, engine, link.commands(), sink)  # the driver, between steps
    outcomes = [
        (e.data["command"], e.data["outcome"])
        for e in JobEvent.objects.filter(job=job, kind="command.applied").order_by("pk")
    ]
    assert outcomes == [("stale", "stale"), ("override", "unchanged")]
    assert controller.pending is None
    job.refresh_from_db()
    assert job.state == JobState.RUNNING  # no approval is awaited any more
    events.run_steps(controller, engine, range(1, 2))
    assert controller.plan.to_json() == running and controller.transitions == 0
    assert not Transition.objects.filter(job=job).exists()
    states = dict(Proposal.objects.filter(job=job).values_list("pk", "state"))
    assert states == {
        asked.pk: ProposalState.STALE,
        older.pk: ProposalState.STALE,
        newer.pk: ProposalState.APPROVED,
    }
