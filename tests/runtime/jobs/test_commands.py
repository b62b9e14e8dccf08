"""People's commands reaching a running job's controller between steps (``apply_commands``):
approvals and rejections of the controller's proposals, and a person's own plan (an override)
that another person approved, which the controller moves to or refuses, saying why."""

from __future__ import annotations

import copy

import pytest

from runtime.events import RuntimeEvent
from runtime.jobs.driver import apply_commands
from runtime.planner.plan import Layout, Plan
from tests.support import plans as support


class Sink:
    def __init__(self):
        self.events: list[RuntimeEvent] = []

    def emit(self, event: RuntimeEvent) -> None:
        self.events.append(event)


def _waiting():
    """A real controller on a simulated pool of 16 H100s grown to 32, with a proposal to use
    them waiting for a person (manual approval)."""
    events: list[dict] = []
    controller, engine = support.simulated_controller(events.append, approval="manual")
    support.run_steps(controller, engine, range(1))
    assert controller.pending is not None
    return controller, engine, events


def _halved_generation(controller) -> dict:
    """The running plan with generation on half its units: a change a person might make,
    which a live transition reaches (it drops the other units)."""
    data = copy.deepcopy(controller.plan.to_json())
    (generation,) = [ms for ms in data["model_stages"] if ms["name"] == "actor@generation"]
    generation["layout"]["dp"] = len(generation["units"]) // 2
    generation["units"] = generation["units"][: generation["layout"]["dp"]]
    return data


def _by_hand(controller, layout: Layout, units) -> dict:
    """Every model-stage of the running plan in ``layout`` on ``units``."""
    layouts = {ms.name: (layout, units) for ms in controller.plan.model_stages}
    return Plan.of_units(
        accelerator=support.H100.name,
        num_slots=max(s for u in units for s in u) + 1,
        layouts=layouts,
    ).to_json()


def _override(controller, engine, plan_json, proposal=7) -> dict:
    sink = Sink()
    apply_commands(
        controller, engine, [("override", {"plan": plan_json, "proposal": proposal})], sink
    )
    (applied,) = sink.events
    assert applied.kind == "command.applied"
    return applied.data


def test_an_approved_override_supersedes_the_waiting_proposal_and_the_job_moves_to_it():
    controller, engine, events = _waiting()
    waiting = controller.pending.proposal_id
    wanted_json = _halved_generation(controller)
    wanted = Plan.from_json(wanted_json)
    seen = len(events)

    applied = _override(controller, engine, wanted_json)

    assert applied == {"command": "override", "proposal": 7, "outcome": "applied"}
    assert controller.plan.places_like(wanted) and controller.pending is None
    after = events[seen:]
    assert after[0] == {
        "event": "control.stale",
        "proposal": waiting,
        "reason": "superseded by an approved override",
    }
    decision = next(e for e in after if e["event"] == "control.decision")
    assert decision["trigger"]["kind"] == "override" and decision["admit"]
    assert Plan.from_json(decision["candidate"]).places_like(wanted)
    (transition,) = [e for e in after if e["event"] == "control.transition"]
    assert transition["ok"] and controller.transitions == 1
    # The job runs on the person's plan (with manual approval, nothing moves it without one).
    support.run_steps(controller, engine, range(1, 3))
    assert controller.plan.places_like(wanted) and controller.transitions == 1


def _without_a_model_stage(controller) -> dict:
    data = controller.plan.to_json()
    data["model_stages"] = data["model_stages"][:-1]
    return data


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        # an 8B model's training state on one 80 GB device
        (lambda c: _by_hand(c, Layout(dp=1, tp=1, pp=1), ((0,),)), "it does not fit in memory: "),
        (
            lambda c: _by_hand(c, Layout(dp=64, tp=1, pp=1), tuple((s,) for s in range(64))),
            "it uses 64 slots; 32 are alive",
        ),
        (_without_a_model_stage, "its model-stages "),
        (lambda c: support.plan_json(8), "it is for cpu-slot; the job runs on h100-sxm"),
        (lambda c: {"num_slots": 3}, "not a plan: "),
        (lambda c: None, "not a plan: "),
    ],
    ids=["memory", "slots", "model-stages", "accelerator", "not-a-plan", "null"],
)
def test_an_override_the_job_cannot_take_is_refused_saying_why_and_the_job_runs_on(make, reason):
    controller, engine, events = _waiting()
    running, waiting = controller.plan, controller.pending
    seen = len(events)

    applied = _override(controller, engine, make(controller))

    assert applied["outcome"].startswith(f"refused: {reason}"), applied
    (refused,) = events[seen:]
    assert refused["event"] == "control.override_refused"
    assert refused["reason"].startswith(reason)
    # Nothing changed: the same plan, the controller's proposal still waiting, no transition.
    assert controller.plan is running and controller.pending is waiting
    assert controller.transitions == 0
    support.run_steps(controller, engine, range(1, 3))
    assert controller.plan is running


def test_approvals_and_rejections_still_reach_the_controllers_proposals():
    controller, engine, _ = _waiting()
    proposal = controller.pending.proposal_id
    sink = Sink()
    apply_commands(controller, engine, [("reject", proposal), ("approve", proposal)], sink)
    assert [e.data for e in sink.events] == [
        {"command": "reject", "proposal": proposal, "outcome": "rejected"},
        {
            "command": "approve",
            "proposal": proposal,
            "outcome": f"ignored: proposal: {proposal} is not waiting",
        },
    ]


def test_of_two_overrides_approved_between_steps_only_the_newer_is_taken():
    """Approved one after the other before the driver read either, both were applied (the job
    moved to the older, then on to the newer; found by review): the newer supersedes the
    older, which is reported stale, and the job moves once, to the newer."""
    controller, engine, events = _waiting()
    running = controller.plan
    seen = len(events)
    sink = Sink()
    commands = [
        ("override", {"plan": _halved_generation(controller), "proposal": 7}),
        ("override", {"plan": running.to_json(), "proposal": 9}),
    ]
    apply_commands(controller, engine, commands, sink)
    assert [e.data for e in sink.events] == [
        {
            "command": "override",
            "proposal": 7,
            "outcome": "stale: superseded by override 9, approved after it",
        },
        {"command": "override", "proposal": 9, "outcome": "unchanged"},
    ]
    assert controller.plan is running and controller.transitions == 0
    assert controller.pending is None  # the person's plan superseded it too
    assert not [e for e in events[seen:] if e["event"] == "control.transition"]


def test_a_proposal_a_persons_newer_override_made_stale_is_let_go():
    """The service made the controller's waiting proposal stale when a person proposed a plan
    after it (only the newest can be approved): told so between steps, the controller drops
    it and what it built ahead for it, and reports it stale."""
    controller, engine, events = _waiting()
    proposal = controller.pending.proposal_id
    dropped = []
    engine.drop_ahead = lambda: dropped.append(True)
    seen = len(events)
    sink = Sink()
    apply_commands(controller, engine, [("stale", proposal), ("approve", proposal)], sink)
    assert [e.data for e in sink.events] == [
        {"command": "stale", "proposal": proposal, "outcome": "stale"},
        {
            "command": "approve",
            "proposal": proposal,
            "outcome": f"ignored: proposal: {proposal} is not waiting",
        },
    ]
    assert controller.pending is None and dropped
    assert events[seen:] == [
        {
            "event": "control.stale",
            "proposal": proposal,
            "reason": "superseded by a person's newer proposal",
        }
    ]
    assert controller.transitions == 0


def test_a_pool_change_on_an_engine_whose_pool_follows_a_trace_is_refused():
    """The simulated engine's pool is its trace's: a resize reaching it (the web refuses one for
    a simulated job, so only a stored command from before could) is refused, saying so, and
    the pool and the plan stay as they are."""
    controller, engine, _ = _waiting()
    pool, running = engine.pool_size(), controller.plan
    sink = Sink()
    apply_commands(controller, engine, [("resize", {"slots": 8, "notice_s": 0.0})], sink)
    assert [e.data for e in sink.events] == [
        {
            "command": "resize",
            "slots": 8,
            "notice_s": 0.0,
            "outcome": "refused: slots: the simulated engine's pool follows its trace",
        }
    ]
    assert engine.pool_size() == pool and controller.plan is running
