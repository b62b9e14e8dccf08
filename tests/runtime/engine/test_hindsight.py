"""Hindsight on a simulated run (runtime/engine/hindsight.py): why each transition was made, and
what a move made for its saving truly saved over its life. Every second here is simulated: the
engine's cluster twin without noise, replayed over a history of steps written by hand (each with
its own sequences), so the assertions check how a move's life is bounded and what is summed over
it."""

import math
import random

import pytest

from runtime.engine import hindsight
from runtime.engine.sim import Ran, SimulatedEngine
from runtime.engine.traces import Trace
from runtime.planner import PpoWorkload, default_catalog
from runtime.planner.plan import Plan
from runtime.twin import ClusterTwin, device
from tests.support.plans import generation_over

CATALOG = default_catalog()
ACC = CATALOG.accelerator("h100-sxm")
WORKLOAD = PpoWorkload.for_model(CATALOG.model("llama-3.1-8b"), gen_len=1024)


TP2, TP4 = generation_over(16, 2), generation_over(16, 4)
SMALLER = generation_over(8, 4)


def _engine(history: dict[int, Plan]) -> SimulatedEngine:
    """An engine whose history is ``history``, one step every 100 simulated seconds, on a trace
    whose generated length doubles every few steps (so each step's prices differ), each step
    with its own sequences. Their lengths spread less than the default's: at its long tail,
    generation over TP2 runs out of memory from 1,024 tokens, which would end every move's life
    there."""
    trace = Trace(
        name="h",
        steps=len(history),
        accelerator=ACC.name,
        gpus=16,
        gen_len=((0, 512.0), (3, 1024.0), (5, 2048.0)),
        len_sigma=0.3,
    )
    engine = SimulatedEngine(
        trace, ACC, twin=ClusterTwin.draw(device(ACC.name), 3, noise=0.0), seed=1
    )
    engine.history = {}
    for step, plan in history.items():
        lengths = trace.response_lengths(step, WORKLOAD.global_batch, random.Random(step))
        engine.history[step] = Ran(
            plan=plan,
            at_s=100.0 * step,
            gen_len=sum(lengths) / len(lengths),
            lengths=tuple(lengths),
        )
    return engine


def _events(*, move_after: int, steps: int, kind: str = "drift", said: str = "pays back") -> list:
    """Steps 0..steps-1, with a decision of ``kind`` and the transition that carries it out
    after ``move_after``."""
    events = []
    for step in range(steps):
        events.append({"event": "step", "step": step})
        if step == move_after:
            verdict = {"reason": f"{said} ...", "saving_s": 0.25}
            events.append(
                {
                    "event": "control.decision",
                    "admit": True,
                    "trigger": {"kind": kind},
                    "verdict": verdict,
                }
            )
            because = {"trigger": kind, **verdict}
            events.append(
                {"event": "control.transition", "step": step, "because": because, "actual_s": 7.5}
            )
    return events


def _true(engine: SimulatedEngine, plan: Plan, step: int) -> float:
    """What the twin takes for ``plan`` on step ``step``'s own sequences, at its clock."""
    ran = engine.history[step]
    at = WORKLOAD.with_gen_len(round(ran.gen_len))
    return engine.twin.step(plan, at, lengths=ran.lengths, at_s=100.0 * step).seconds


def test_a_moves_life_ends_when_the_pool_changes_and_sums_what_it_truly_saved():
    history = {0: TP2, 1: TP2, 2: TP4, 3: TP4, 4: TP4, 5: TP4, 6: SMALLER, 7: SMALLER}
    engine = _engine(history)
    [move] = hindsight.moves(_events(move_after=1, steps=8), engine, WORKLOAD)
    assert move.why == "saving" and move.step == 1 and move.cost_s == 7.5
    assert move.moved == (("actor@generation", (2, 1), (4, 1)),)
    assert move.predicted_saving_s == 0.25
    # Steps 2-5 ran TP4; the old plan is the same but for generation in TP2.
    expected = sum(_true(engine, TP2, s) - _true(engine, TP4, s) for s in range(2, 6))
    assert move.steps == 4 and move.until == "the pool changed at step 6"
    assert math.isclose(move.true_saving_s, expected, rel_tol=1e-12)
    assert expected != 0  # the two layouts truly differ, at lengths that differ
    assert math.isclose(move.net_s, expected - 7.5, rel_tol=1e-12)


def test_a_moves_life_ends_when_its_model_stages_move_again():
    history = {0: TP2, 1: TP4, 2: TP4, 3: TP2, 4: TP2}
    engine = _engine(history)
    [move] = hindsight.moves(_events(move_after=0, steps=5), engine, WORKLOAD)
    assert move.steps == 2 and move.until == "step 3 moved them again"
    expected = sum(_true(engine, TP2, s) - _true(engine, TP4, s) for s in (1, 2))
    assert math.isclose(move.true_saving_s, expected, rel_tol=1e-12)


@pytest.mark.parametrize(
    ("kind", "said", "why"),
    [
        ("pool", "pays back", "slots"),
        ("memory", "the running plan will not fit (x)", "memory"),
        ("lost", "urgent: feasibility only", "urgent"),
        ("override", "a person's plan", "override"),
        ("drift", "faster by 0.1 s/step", "saving"),
    ],
)
def test_each_transition_has_its_reason_and_only_moves_for_a_saving_are_replayed(kind, said, why):
    engine = _engine({0: TP2, 1: TP4, 2: TP4})
    [move] = hindsight.moves(_events(move_after=0, steps=3, kind=kind, said=said), engine, WORKLOAD)
    assert move.why == why
    assert (move.true_saving_s is not None) == (why == "saving")
    looked_back = hindsight.summary([move])
    assert looked_back["simulated"] is True
    assert looked_back["transitions"][why] == 1 and sum(looked_back["transitions"].values()) == 1
    assert looked_back["moves_for_saving"] == (why == "saving")


def test_a_transition_that_carried_out_no_decision_is_other():
    engine = _engine({0: TP2, 1: TP4, 2: TP4, 3: TP2})
    events = _events(move_after=0, steps=4)
    events.insert(  # before step 3
        -1, {"event": "control.transition", "step": 2, "because": None, "actual_s": 3.0}
    )
    first, second = hindsight.moves(events, engine, WORKLOAD)
    assert first.why == "saving" and second.why == "other" and second.true_saving_s is None


def test_the_summary_counts_the_moves_that_repaid_and_their_net():
    moves = [
        hindsight.MoveHindsight(step=1, why="saving", cost_s=10.0, true_saving_s=25.0, steps=9),
        hindsight.MoveHindsight(step=5, why="saving", cost_s=10.0, true_saving_s=4.0, steps=3),
        hindsight.MoveHindsight(step=9, why="slots", cost_s=6.0),
    ]
    looked_back = hindsight.summary(moves)
    assert looked_back["moves_for_saving"] == 2 and looked_back["repaid"] == 1
    assert looked_back["net_s"] == pytest.approx(9.0)
    assert looked_back["transitions"]["slots"] == 1 and looked_back["transitions"]["saving"] == 2
    assert moves[0].to_json()["net_s"] == 15.0 and moves[2].to_json()["net_s"] is None


def test_a_simulated_step_records_the_plan_and_clock_it_ran_at():
    trace = Trace(name="r", steps=3, accelerator=ACC.name, gpus=16, gen_len=((0, 512.0),))
    engine = SimulatedEngine(
        trace, ACC, twin=ClusterTwin.draw(device(ACC.name), 3, noise=0.0), seed=1
    )
    engine.start(TP2, WORKLOAD)
    first = engine.step(TP2, WORKLOAD, 0)
    engine.step(TP2, WORKLOAD, 1)
    assert engine.history[0].plan == TP2 and engine.history[0].at_s == 0.0
    # Its sequences, each of its own length: their mean is the step's generated length.
    lengths = engine.history[0].lengths
    assert len(lengths) == WORKLOAD.global_batch and len(set(lengths)) > 1
    assert engine.history[0].gen_len == first.gen_len == sum(lengths) / len(lengths)
    assert engine.history[1].at_s == pytest.approx(first.seconds)
    # Without noise, the step took what the twin plays of the plan on those sequences, and a
    # replay of the step plays it again.
    at = WORKLOAD.with_gen_len(round(first.gen_len))
    played = engine.twin.step(TP2, at, lengths=lengths, at_s=0.0)
    assert first.seconds == pytest.approx(played.seconds)
    assert engine.replay(TP2, WORKLOAD, engine.history[0]) == (pytest.approx(played.seconds), "")


def test_a_transition_that_names_its_step_needs_no_step_events():
    """A web job's steps go to its own event log, not the controller's: the transition's
    ``step`` (the last step before it) places it in the engine's history."""
    engine = _engine({0: TP2, 1: TP2, 2: TP4, 3: TP4})
    events = [e for e in _events(move_after=1, steps=4) if e["event"] != "step"]
    events[-1]["step"] = 1
    del events[0]  # the decision: the transition says what it carried out
    events[-1]["because"] = {"trigger": "drift", "reason": "pays back ...", "saving_s": 0.25}
    [move] = hindsight.moves(events, engine, WORKLOAD)
    assert move.step == 1 and move.steps == 2 and move.until == "the run ended"
    expected = sum(_true(engine, TP2, s) - _true(engine, TP4, s) for s in (2, 3))
    assert math.isclose(move.true_saving_s, expected, rel_tol=1e-12)


def test_a_simulated_jobs_last_event_carries_its_hindsight():
    from runtime.events import ListSink
    from runtime.jobs.sim_job import run_sim_ppo_job
    from runtime.jobs.spec import PpoSimJobSpec

    sink = ListSink()
    spec = PpoSimJobSpec(
        gpus=32,
        trace="oscillate",
        num_steps=40,
        pace_s=0,
        seed=9,
        policy={"admission": "always_faster"},
    )
    control: list[dict] = []
    run_sim_ppo_job(spec, sink=sink, emit_control=control.append)
    [finished] = sink.of_kind("job.finished")
    # Each transition names the last step run before it and the decision it carries out.
    ran = [e.data["step"] for e in sink.of_kind("step.finished")]
    decided = None
    for event in control:
        if event["event"] == "control.decision" and event["admit"]:
            decided = event
        if event["event"] == "control.transition":
            assert event["because"]["trigger"] == decided["trigger"]["kind"]
            assert event["because"]["saving_s"] == decided["verdict"]["saving_s"]
            assert event["step"] in ran or event["step"] == -1
    looked_back = finished.data["hindsight"]
    assert looked_back["simulated"] is True
    assert sum(looked_back["transitions"].values()) == finished.data["transitions"] > 0
    # Moves made for a saving are replayed although the controller's log holds no step events
    # (the job's steps go to its own log).
    assert 0 < looked_back["moves_for_saving"] <= looked_back["transitions"]["saving"]
    assert 0 <= looked_back["repaid"] <= looked_back["moves_for_saving"]


def test_a_failed_transition_or_one_followed_by_another_change_is_not_replayed():
    engine = _engine({0: TP2, 1: TP4, 2: TP4})
    events = _events(move_after=0, steps=3)
    events[2]["ok"] = False
    [failed] = hindsight.moves(events, engine, WORKLOAD)
    assert failed.why == "saving" and failed.true_saving_s is None
    # The move's target is not what the next step ran: something else changed in between.
    events[2].update(ok=True, target=SMALLER.to_json())
    [muddled] = hindsight.moves(events, engine, WORKLOAD)
    assert muddled.true_saving_s is None and muddled.until.startswith("another change")
    events[2]["target"] = TP4.to_json()
    [clean] = hindsight.moves(events, engine, WORKLOAD)
    assert clean.steps == 2


def test_a_second_transition_at_one_boundary_is_weighed_against_the_first_ones_target():
    """A salvage after step 0 goes to TP4 on generation; a move at the same boundary then goes
    back to TP2: the move's old plan is the salvage's target, not what step 0 ran."""
    engine = _engine({0: TP2, 1: TP2, 2: TP2})
    salvage = {"trigger": "lost", "reason": "salvage: keep the intact units", "saving_s": None}
    saving = {"trigger": "drift", "reason": "pays back ...", "saving_s": 0.5}
    events = [
        {"event": "step", "step": 0},
        {
            "event": "control.transition",
            "step": 0,
            "actual_s": 4.0,
            "because": salvage,
            "target": TP4.to_json(),
        },
        {
            "event": "control.transition",
            "step": 0,
            "actual_s": 6.0,
            "because": saving,
            "target": TP2.to_json(),
        },
    ]
    first, second = hindsight.moves(events, engine, WORKLOAD)
    assert first.why == "urgent" and first.true_saving_s is None
    assert second.moved == (("actor@generation", (4, 1), (2, 1)),)
    expected = sum(_true(engine, TP4, s) - _true(engine, TP2, s) for s in (1, 2))
    assert math.isclose(second.true_saving_s, expected, rel_tol=1e-12)
