"""The controller on the simulated cluster: the approval gate, the urgent path, the step loop."""

import pytest

from runtime.control import Controller, JobPolicy, run_job
from runtime.engine.sim import SimulatedEngine, TrueModel
from runtime.engine.traces import Trace
from runtime.planner import PpoWorkload, default_catalog

CATALOG = default_catalog()
ACC = CATALOG.accelerator("h100-sxm")
WORKLOAD = PpoWorkload.for_model(CATALOG.model("llama-3.1-8b"), gen_len=1024)


def _engine(pool=((1.0, 32),), gpus=16) -> SimulatedEngine:
    trace = Trace(
        name="t", steps=20, accelerator=ACC.name, gpus=gpus, gen_len=((0, 1024.0),), pool=pool
    )
    return SimulatedEngine(trace, ACC, truth=TrueModel.draw(3, noise=0.0), seed=1)


def _steps(controller, engine, steps):
    for step in steps:
        controller.before_step(engine, step)
        report = engine.step(controller.plan, WORKLOAD, step)
        controller.after_step(report, engine)


def _kinds(controller):
    return [e["event"] for e in controller.events]


def test_a_manual_job_keeps_running_until_a_person_approves():
    engine = _engine()
    controller = Controller(WORKLOAD, ACC, JobPolicy(admission="always_faster", approval="manual"))
    controller.initial_plan(engine)
    _steps(controller, engine, range(3))  # the pool grows to 32 during step 0
    proposal = controller.pending
    assert proposal is not None and controller.plan.num_slots == 16
    assert _kinds(controller).count("control.proposal") == 1  # asked once, not every step
    decision = next(e for e in controller.events if e["event"] == "control.decision")
    assert decision["trigger"]["kind"] == "pool" and decision["admit"]
    assert decision["verdict"]["saving_s"] > 0 and decision["verdict"]["cost_s"] > 0
    assert decision["candidate"]["num_slots"] == 32 and decision["gamma"] == 0.5
    assert controller.command("approve", proposal.proposal_id, engine) == "applied"
    assert controller.pending is None and controller.transitions == 1
    assert {s for ms in controller.plan.model_stages for s in ms.slots} > set(range(16))
    transition = next(e for e in controller.events if e["event"] == "control.transition")
    assert transition["ok"] and transition["simulated"] and transition["dag"]["nodes"]
    with pytest.raises(ValueError, match="proposal: 1 is not waiting"):
        controller.command("approve", 1, engine)


def test_the_same_change_asked_again_keeps_the_waiting_proposal():
    from runtime.control.monitor import Trigger

    engine = _engine()
    controller = Controller(WORKLOAD, ACC, JobPolicy(admission="always_faster", approval="manual"))
    controller.initial_plan(engine)
    _steps(controller, engine, range(1))
    waiting = controller.pending
    assert waiting is not None
    again = Trigger(kind="drift", signal="step_time", value=2.0, reference=1.0, step=1)
    controller.replan(again, engine)
    assert controller.pending is waiting  # same plan, same units: not superseded
    assert "control.stale" not in _kinds(controller)
    kept = controller.events[-1]
    assert kept["event"] == "control.proposal_still_waiting"
    assert kept["proposal"] == waiting.proposal_id and kept["trigger"]["signal"] == "step_time"
    assert controller.command("approve", waiting.proposal_id, engine) == "applied"


def test_a_rejected_or_expired_proposal_keeps_the_plan():
    engine = _engine()
    policy = JobPolicy(admission="always_faster", approval="manual", approval_timeout_s=30)
    controller = Controller(WORKLOAD, ACC, policy)
    first = controller.initial_plan(engine)
    _steps(controller, engine, range(1))
    assert controller.command("reject", controller.pending.proposal_id, engine) == "rejected"
    assert controller.plan == first and controller.transitions == 0
    # A second proposal nobody answers expires after 30 simulated seconds.
    engine2 = _engine()
    controller2 = Controller(WORKLOAD, ACC, policy)
    controller2.initial_plan(engine2)
    _steps(controller2, engine2, range(4))
    assert "control.expired" in _kinds(controller2) and controller2.pending is None
    with pytest.raises(ValueError, match="command: expected 'approve' or 'reject'"):
        controller2.command("maybe", 1, engine2)


def test_manual_above_lets_cheap_transitions_through():
    engine = _engine()
    policy = JobPolicy(admission="always_faster", approval="manual_above", approval_above_s=1e6)
    controller = Controller(WORKLOAD, ACC, policy)
    controller.initial_plan(engine)
    _steps(controller, engine, range(2))
    assert controller.pending is None and controller.transitions == 1


def test_revoked_slots_take_the_urgent_path_before_the_next_step():
    engine = _engine(pool=((1.0, 8),), gpus=16)
    controller = Controller(WORKLOAD, ACC, JobPolicy(approval="manual"))
    controller.initial_plan(engine)
    _steps(controller, engine, range(3))
    # Slots 8-15 went with their state; no person was asked (urgent), no step ran on them.
    assert engine.pool_size() == 8 and controller.pending is None
    assert max(s for ms in controller.plan.model_stages for s in ms.slots) < 8
    moved = controller.transitions + controller.restarts
    assert moved == 1
    decision = next(e for e in controller.events if e["event"] == "control.decision")
    assert (decision["trigger"]["kind"], decision["trigger"]["value"]) == ("pool", 8)
    # feasibility only: a live transition if one fits, else checkpoint/restart
    assert decision["reason"] == "urgent: feasibility only" or decision["reason"].startswith(
        "infeasible"
    )
    assert all(e["ok"] for e in controller.events if e["event"] == "step")


def test_the_step_loop_accounts_for_all_the_time():
    engine = _engine()
    controller = Controller(WORKLOAD, ACC, JobPolicy(admission="always_faster"))
    summary = run_job(engine, controller, 6)
    assert summary.simulated and summary.steps == 6 and summary.failed_steps == 0
    assert summary.seconds == pytest.approx(
        summary.step_seconds + summary.transition_seconds + summary.restart_seconds
    )
    assert summary.transitions == 1 and summary.mean_step_s == pytest.approx(summary.seconds / 6)
    steps = [e for e in controller.events if e["event"] == "step"]
    assert len(steps) == 6 and all(e["simulated"] for e in steps)


def _failing(*slots) -> SimulatedEngine:
    trace = Trace(
        name="f",
        steps=4,
        accelerator=ACC.name,
        gpus=16,
        gen_len=((0, 1024.0),),
        failures=tuple((1.0 + i, s) for i, s in enumerate(slots)),
    )
    return SimulatedEngine(trace, ACC, truth=TrueModel.draw(3, noise=0.0), seed=1)


def test_a_failed_slot_is_replanned_from_the_intact_units():
    """Slot 0 fails during the first step: the actor's training unit on 0-3 is broken, its
    replica on 4-7 is intact, so the job moves on by a live transition, not a restart."""
    engine = _failing(0)
    controller = Controller(WORKLOAD, ACC, JobPolicy())
    first = controller.initial_plan(engine)
    assert first.model_stage("actor@training").units[0][0] == 0
    assert first.model_stage("actor@training").layout.dp == 2
    _steps(controller, engine, range(3))
    assert controller.restarts == 0 and controller.transitions >= 1
    assert all(0 not in ms.slots for ms in controller.plan.model_stages)
    actor = engine.units()["actor@training"]
    assert actor and all(0 not in u.slots for u in actor)
    assert all(e["ok"] for e in controller.events if e["event"] == "step")


def test_without_an_intact_replica_the_job_restarts_from_its_checkpoint():
    """Slots 0 and 4 fail: both of the actor's training units are broken (no replica holds its
    state), so the urgent path falls back to checkpoint/restart, and says why."""
    engine = _failing(0, 4)
    controller = Controller(WORKLOAD, ACC, JobPolicy())
    controller.initial_plan(engine)
    _steps(controller, engine, range(3))
    assert controller.restarts >= 1
    restart = next(e for e in controller.events if e["event"] == "control.restart")
    assert restart["from_checkpoint"] and "no intact unit" in restart["reason"]


def test_an_unreachable_best_plan_gives_way_to_the_fastest_reachable_one(monkeypatch):
    """The planner's best plan for the grown pool cannot be reached live (refused here on
    purpose): the controller compiles the next-best plans and the running layouts with data
    parallelism replanned, and admits the fastest that a transition can reach."""
    from runtime.control import controller as control
    from runtime.transition import TransitionRefusedError

    engine = _engine()
    controller = Controller(WORKLOAD, ACC, JobPolicy(admission="always_faster"))
    controller.initial_plan(engine)
    compile_ = control.Controller._compile
    refused, tried = [], []

    def compile_unless_first(self, engine_, candidate, workload):
        if not refused:
            refused.append(candidate)
            raise TransitionRefusedError("target: refused by the test")
        dag = compile_(self, engine_, candidate, workload)  # raises where it really cannot
        tried.append(candidate)
        return dag

    monkeypatch.setattr(control.Controller, "_compile", compile_unless_first)
    _steps(controller, engine, range(1))  # the pool grows to 32 during step 0
    reasons = [e["reason"] for e in controller.events if e["event"] == "control.decision"]
    assert reasons[0] == "unreachable, trying the next best: target: refused by the test"
    assert reasons[1] == "faster by " + reasons[1].removeprefix("faster by ")
    assert controller.transitions == 1 and controller.plan.num_slots == 32
    assert len(tried) >= 2 and controller.plan not in refused and controller.plan in tried
    # the fastest of the reachable options, priced at the step's workload
    assert controller._price(controller.plan, WORKLOAD) == min(
        controller._price(p, WORKLOAD) for p in tried
    )
