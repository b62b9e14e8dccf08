"""Counterfactual replays of a simulated run (runtime/engine/hindsight.py): the same run, from
the same seeds, with moves made for their saving refused by the controller's ``veto``. Every
second here is simulated; the runs are small (16 slots, 40 steps) and real: the controller,
planner, admission and transition compiler are the job's own."""

import dataclasses

import pytest

from runtime.control.controller import Controller, run_job
from runtime.control.policy import JobPolicy
from runtime.engine import hindsight
from runtime.engine.sim import Ran, SimulatedEngine
from runtime.engine.traces import Trace, generate
from runtime.planner import PpoWorkload, default_catalog
from runtime.twin import ClusterTwin, device
from tests.support.plans import generation_over

CATALOG = default_catalog()
ACC = CATALOG.accelerator("h100-sxm")
WORKLOAD = PpoWorkload.for_model(CATALOG.model("llama-3.1-8b"), gen_len=500)
STEPS = 40
# An oscillating length: DynaRL-style admission (whatever is predicted faster) makes about ten
# moves for their saving in 40 steps here, on a pool that does not change in that time.
OSCILLATE = generate("oscillate", seed=9, steps=STEPS, gpus=16, accelerator=ACC.name, spot=True)
# A length growing from 500 to 4,000 tokens, each response at the mean, on a pool that grows from
# 16 to 24 slots during the first step: payback defers the move onto the new slots, and later
# admits one whose new units there are built during one more step, so it runs after that step.
GROWTH = Trace(
    name="growth",
    steps=STEPS,
    accelerator=ACC.name,
    gpus=16,
    gen_len=((0, 500.0), (STEPS, 4000.0)),
    pool=((30.0, 24),),
    len_sigma=0.0,
)


def _start(trace=OSCILLATE, admission="always_faster", made: list | None = None):
    def start():
        engine = SimulatedEngine(trace, ACC, twin=ClusterTwin.draw(device(ACC.name), 7), seed=3)
        controller = Controller(WORKLOAD, ACC, JobPolicy(admission=admission))
        if made is not None:
            made.append(controller)
        return engine, controller

    return start


def _ran(start):
    engine, controller = start()
    run_job(engine, controller, STEPS)
    return engine, controller, hindsight.moves(controller.events, engine, WORKLOAD)


@pytest.fixture(scope="module")
def ran():
    return _ran(_start())


def test_a_copy_resumed_with_no_veto_runs_the_same_steps_as_the_run(ran):
    engine, controller, seen = ran
    assert sum(m.why == "saving" for m in seen) >= 3  # the run moves, so a copy could diverge
    again, control = _start()()
    copies = {}

    def at_20(step):
        if step == 20:
            copies["run"] = hindsight._copy(again, control)
        return True

    run_job(again, control, STEPS, between_steps=at_20)
    copied_engine, copied = copies["run"]
    assert copied.events == [] and copied_engine.history == {}  # a copy starts its own record
    summary = run_job(copied_engine, copied, STEPS, resume_at=20)
    assert summary.steps == STEPS - 20 and not summary.stopped
    assert copied_engine.now() == again.now() == engine.now()
    assert sorted(copied_engine.history) == list(range(20, STEPS))
    for step, ran_then in copied_engine.history.items():
        assert ran_then == engine.history[step]
    moved_after = [e for e in controller.events if e["event"] == "control.transition"]
    moved_after = [e for e in moved_after if e["step"] >= 20]
    assert [e["target"] for e in copied.events if e["event"] == "control.transition"] == [
        e["target"] for e in moved_after
    ]


def test_each_move_for_a_saving_is_refused_in_its_own_replay_at_its_decision(ran):
    engine, _, seen = ran
    saving = [m for m in seen if m.why == "saving" and hindsight._relaid(m)][:2]
    assert len(saving) == 2
    replays = hindsight.counterfactuals(_start(), STEPS, saving)
    assert [r.step for r in replays] == [m.step for m in saving]
    for replay, move in zip(replays, saving, strict=True):
        assert replay.run_s == engine.now()
        assert replay.refused_at == move.decided  # the move itself, not a later lookalike
        assert replay.met and replay.to_json()["met"] is True
        assert replay.without_s != replay.run_s  # refusing a transition changes the run


def test_a_move_built_ahead_is_refused_at_the_step_that_admitted_it():
    """A move whose new units are built during one more step is admitted a step before it
    runs: its replay is copied before the admitting decision, which the veto then refuses."""
    engine, controller, seen = _ran(_start(GROWTH, "payback"))
    staged = [m for m in seen if m.why == "saving" and m.moved and m.decided < m.step]
    assert staged, [(m.step, m.decided, m.why) for m in seen]
    [replay] = hindsight.counterfactuals(_start(GROWTH, "payback"), STEPS, staged[:1])
    assert replay.refused_at == staged[0].decided and replay.refused >= 1
    assert replay.without_s != engine.now()
    # The pool changed in this run: the units built ahead were on the slots it granted.
    [moved] = [
        e
        for e in controller.events
        if e["event"] == "control.transition" and e["step"] == staged[0].step
    ]
    ahead = [slot for unit in moved["dag"]["ahead"] for slot in unit["slots"]]
    assert ahead and min(ahead) >= 16 and engine.pool_size() == 24


def test_without_saving_moves_the_run_still_moves_for_memory_and_makes_no_saving_move(ran):
    engine, _, seen = ran
    made: list[Controller] = []
    replay = hindsight.without_saving_moves(_start(made=made), STEPS, engine.now())
    [vetoed] = made
    why = [
        hindsight.reason(e["because"]) for e in vetoed.events if e["event"] == "control.transition"
    ]
    assert "saving" not in why
    # A move forced by memory is not the veto's to refuse: the run makes each one it decides
    # on, as the run as it ran did. (Which it decides on differ: here, the run without its
    # saving moves keeps layouts that those moves had left, and one of them outgrows memory.)
    forced = [
        e
        for e in vetoed.events
        if e["event"] == "control.decision"
        and e["reason"].startswith("the running plan will not fit")
    ]
    assert forced and all(e["admit"] for e in forced)
    restarted = [
        e
        for e in vetoed.events
        if e["event"] == "control.restart"
        and e["reason"].startswith("the running plan will not fit")
    ]
    assert why.count("memory") + len(restarted) == len(forced)  # live, or by restart
    assert replay.refused >= sum(m.why == "saving" for m in seen)
    assert replay.without_s != engine.now()


def test_a_moves_veto_refuses_its_layout_until_the_run_left_it_or_the_pool_changed():
    tp2, tp4 = generation_over(16, 2), generation_over(16, 4)
    trace = Trace(
        name="v",
        steps=10,
        accelerator=ACC.name,
        gpus=16,
        gen_len=((0, 500.0),),
        pool=((50.0, 8), (100.0, 16)),
    )
    engine = SimulatedEngine(trace, ACC, twin=ClusterTwin.draw(device(ACC.name), 7), seed=3)
    move = hindsight.MoveHindsight(
        step=3, why="saving", cost_s=1.0, moved=(("actor@generation", (2, 1), (4, 1)),)
    )
    targets = {"actor@generation": (4, 1)}
    veto = hindsight._veto_of(move, targets, engine, until_step=8)
    assert "the move of step 3 (actor@generation)" in veto(tp2, tp4, 3)
    assert veto(tp4, tp4, 4) == ""  # staying in the layout is no move into it
    assert veto(tp4, tp2, 4) == ""  # nor is moving out of it
    assert veto(tp2, tp4, 6) != ""
    # Decided at 7, a move would run from step 8, when the run as it ran had left the layout.
    assert veto(tp2, tp4, 7) == ""
    # The pool shrank and came back while nobody asked: the runs have replanned since.
    engine.clock = 110.0
    assert engine.pool_size() == 16
    assert veto(tp2, tp4, 5) == ""
    fresh = hindsight._veto_of(move, targets, engine, until_step=8)
    assert fresh(tp2, tp4, 5) != ""  # a veto first asked after the changes holds


def test_a_deep_copy_of_a_run_shares_nothing_it_writes():
    """The copies replays go on from must not write into the run they were made from."""
    engine, controller = _start()()
    run_job(engine, controller, 5)
    clock, events, history = engine.now(), len(controller.events), dict(engine.history)
    plan, efficiency = controller.plan, dict(controller.calibrator.efficiency())
    copied_engine, copied = hindsight._copy(engine, controller)
    copied.veto = lambda running, candidate, step: "refused"
    run_job(copied_engine, copied, 20, resume_at=5)
    assert copied_engine.now() > clock and len(copied_engine.history) == 15
    assert engine.now() == clock and len(controller.events) == events
    assert engine.history == history and controller.plan is plan
    assert controller.calibrator.efficiency() == efficiency
    assert controller.veto is None


def test_a_moves_veto_lasts_while_the_run_as_it_ran_kept_what_it_made():
    tp2, tp4, other = (generation_over(16, tp) for tp in (2, 4, 8))
    trace = Trace(name="k", steps=10, accelerator=ACC.name, gpus=16, gen_len=((0, 500.0),))
    engine = SimulatedEngine(trace, ACC, twin=ClusterTwin.draw(device(ACC.name), 7), seed=3)
    ran = {0: tp2, 1: tp2, 2: tp4, 3: tp4, 4: tp4, 5: other, 6: tp4}
    engine.history = {s: Ran(plan=p, at_s=10.0 * s, gen_len=500.0) for s, p in ran.items()}
    move = hindsight.MoveHindsight(
        step=1, why="saving", cost_s=1.0, moved=(("actor@generation", (2, 1), (4, 1)),)
    )
    targets = hindsight._targets(move, engine)
    assert targets == {"actor@generation": (4, 1)}
    assert hindsight._kept_until(move, targets, engine, 10) == 5  # step 5 ran TP8
    del engine.history[5], engine.history[6]
    assert hindsight._kept_until(move, targets, engine, 10) == 10  # kept to the run's end


def test_a_replay_that_did_not_meet_its_move_is_not_counted():
    met = hindsight.Counterfactual(
        step=4, run_s=10.0, without_s=12.0, refused=1, refused_at=3, decided=3
    )
    later = dataclasses.replace(met, refused_at=6)
    never = dataclasses.replace(met, refused=0, refused_at=None)
    assert met.met and not later.met and not never.met


def test_a_copy_does_not_emit_to_the_runs_sink():
    seen: list[dict] = []
    engine = SimulatedEngine(OSCILLATE, ACC, twin=ClusterTwin.draw(device(ACC.name), 7), seed=3)
    controller = Controller(WORKLOAD, ACC, JobPolicy(admission="always_faster"), emit=seen.append)
    run_job(engine, controller, 3)
    emitted = len(seen)
    copied_engine, copied = hindsight._copy(engine, controller)
    run_job(copied_engine, copied, 8, resume_at=3)
    assert len(seen) == emitted and copied.events  # the copy logged its own, and only there
