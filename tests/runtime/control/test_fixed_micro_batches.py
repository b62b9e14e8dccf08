"""``JobPolicy.fixed_micro_batches``: the seed paper's static baseline keeps the micro-batches it
was launched with, and halves one only after a step has run out of memory in the cluster twin
(and cost the job its restart from the last checkpoint)."""

import dataclasses
import math
import re

import pytest

from nereus.simulate_cli import POLICIES
from runtime.control import Controller, JobPolicy, PolicyError, run_job
from runtime.engine.sim import SimulatedEngine
from runtime.engine.traces import Trace
from runtime.planner import PpoWorkload, default_catalog

CATALOG = default_catalog()
ACC = CATALOG.accelerator("h100-sxm")
WORKLOAD = PpoWorkload.for_model(CATALOG.model("llama-3.1-8b"), gen_len=512, micro_batch=16)
"""Micro-batches of up to 16 sequences: the launch plan's outgrow the twin's memory as the
generated length grows."""
BASELINE = JobPolicy(calibration_probes=False, fixed_layouts=True, fixed_micro_batches=True)
"""``dp-only``: the launch layouts and micro-batches, data parallelism following the pool."""
RELAXED = JobPolicy(calibration_probes=False, fixed_layouts=True)
"""``relaxed-dp``: the launch layouts, micro-batches free."""
NAMED = re.compile(r"out of memory (?:on slot \d+ )?in (\S+@\w+)")


def _run(policy, *, steps, gen_len, pool=(), workload=WORKLOAD, backend="continuous"):
    """``steps`` steps on 16 H100s of the twin, every response of a step as long as its mean."""
    trace = Trace(
        name="t",
        steps=steps,
        accelerator=ACC.name,
        gpus=16,
        gen_len=gen_len,
        pool=pool,
        len_sigma=0.0,
    )
    engine = SimulatedEngine(trace, ACC, seed=1, backend=backend)
    controller = Controller(workload, ACC, policy)
    summary = run_job(engine, controller, steps)
    return controller, summary, engine


def _micro_batches(plan_json_or_plan, workload=WORKLOAD) -> dict[str, int]:
    plan_ = plan_json_or_plan
    if isinstance(plan_, dict):
        return {
            ms["name"]: ms["micro_batch"] or (0 if "@generation" in ms["name"] else 16)
            for ms in plan_["model_stages"]
        }
    return plan_.micro_batches(workload.micro_batch)


def _launch(controller) -> dict[str, int]:
    initial = next(e for e in controller.events if e["event"] == "control.plan")
    return _micro_batches(initial["plan"])


def _out_of_memory(controller) -> list[dict]:
    return [
        e
        for e in controller.events
        if e["event"] == "step" and not e["ok"] and e["failure"].startswith("out of memory")
    ]


def test_the_policy_field_is_validated_serialised_and_named_by_the_simulator():
    assert JobPolicy().fixed_micro_batches is False
    for bad in ("yes", 1, None):
        with pytest.raises(PolicyError, match=r"policy\.fixed_micro_batches: must be true or"):
            JobPolicy(fixed_micro_batches=bad)
    with pytest.raises(PolicyError, match=r"policy\.fixed_micro_batches"):
        JobPolicy.from_json({"fixed_micro_batches": "no"})
    assert BASELINE.to_json()["fixed_micro_batches"] is True
    assert JobPolicy.from_json(BASELINE.to_json()) == BASELINE
    assert JobPolicy.from_json(JobPolicy().to_json()).fixed_micro_batches is False
    # fixed_layouts stays independent of it
    assert not JobPolicy(fixed_micro_batches=True).fixed_layouts
    dp_only = JobPolicy.from_json(POLICIES["dp-only"])
    assert dp_only.fixed_layouts and dp_only.fixed_micro_batches
    assert dp_only.admission == "payback"
    relaxed = JobPolicy.from_json(POLICIES["relaxed-dp"])
    assert relaxed.fixed_layouts and not relaxed.fixed_micro_batches


def test_micro_batches_stay_at_launch_while_the_pool_grows_and_shrinks():
    """The pool grows from 16 to 32 slots and shrinks back at a flat 1,024 tokens: the job
    moves to 32 slots and back (the same layouts, data parallelism following the pool), every
    step in the micro-batches of the launch plan; with micro-batches free (``relaxed-dp``) the
    controller lowers some of them on the same trace without any step running out of memory."""
    pool = ((100.0, 32), (400.0, 16))
    flat = ((0, 1024.0),)
    controller, summary, engine = _run(BASELINE, steps=36, gen_len=flat, pool=pool)
    launch = _launch(controller)
    assert not _out_of_memory(controller)
    assert summary.rebatches == 0
    assert not [e for e in controller.events if e["event"].startswith("control.micro_batches")]
    ran = [engine.history[step].plan for step in sorted(engine.history)]
    assert len(ran) >= 30
    assert {p.num_slots for p in ran} >= {16, 32}
    dps = {tuple(ms.layout.dp for ms in p.model_stages) for p in ran}
    assert len(dps) >= 2  # data parallelism replanned with the pool
    layouts = {tuple((ms.layout.tp, ms.layout.pp) for ms in p.model_stages) for p in ran}
    assert len(layouts) == 1
    for plan_ in ran:
        assert _micro_batches(plan_) == launch
    moved = [
        e for e in controller.events if e["event"] in ("control.transition", "control.restart")
    ]
    assert moved and all(_micro_batches(e["target"]) == launch for e in moved)

    free, _, _ = _run(RELAXED, steps=36, gen_len=flat, pool=pool)
    assert not _out_of_memory(free) and _launch(free) == launch
    changes = [e["changed"] for e in free.events if e["event"] == "control.micro_batches"]
    assert changes and any(new < old for c in changes for old, new in c.values())


def test_a_step_out_of_memory_halves_the_named_model_stage_and_the_halved_value_is_kept():
    """The length grows from 512 to 6,000 tokens over 30 steps: a micro-batch of the launch
    plan stops fitting in the twin's memory and a step runs out of it. Only then, and only the
    model-stage whose memory failed, halves its micro-batch; the job restarts from its
    checkpoint in it and keeps it (until another step runs out). The default policy lowers its
    micro-batches ahead of memory on the same trace, and no step fails."""
    grow = ((0, 512.0), (30, 6000.0))
    controller, summary, engine = _run(BASELINE, steps=30, gen_len=grow)
    failures = _out_of_memory(controller)
    assert failures and summary.failed_steps == len(failures)
    assert summary.restarts == len(failures) and summary.rebatches == 0
    launch = _launch(controller)
    # Walk the run: the micro-batches change only at an out-of-memory step, by halving the
    # model-stage the failure names, and every later step runs in what was kept.
    kept = dict(launch)
    halvings = 0
    for i, event in enumerate(controller.events):
        if event["event"] == "step" and event["ok"]:
            assert _micro_batches(engine.history[event["step"]].plan) == kept, event["step"]
        elif event["event"] in ("control.transition", "control.restart"):
            assert _micro_batches(event["target"]) == kept
        elif event["event"] == "control.micro_batches_halved":
            failed = controller.events[i - 1]  # the step's event, then the controller's
            assert failed["event"] == "step" and failed["step"] == event["step"]
            assert failed["failure"] == event["failure"]
            name = NAMED.match(event["failure"]).group(1)
            assert event["changed"] == {name: [kept[name], kept[name] // 2]}
            kept[name] //= 2
            halvings += 1
            restart = next(e for e in controller.events[i:] if e["event"] == "control.restart")
            assert _micro_batches(restart["target"])[name] == kept[name]
        elif event["event"] == "control.micro_batches":
            pytest.fail(f"micro-batches changed without running out of memory: {event}")
    assert halvings == len(failures)
    assert _micro_batches(controller.plan) == kept != launch

    adaptive, free, _ = _run(JobPolicy(calibration_probes=False), steps=30, gen_len=grow)
    assert free.failed_steps == 0 and free.rebatches > 0
    lowered = [e["changed"] for e in adaptive.events if e["event"] == "control.micro_batches"]
    assert any(new < old for c in lowered for old, new in c.values())


def test_generation_out_of_memory_decodes_in_twice_the_waves():
    """1,024 sequences a step decoded as a plain loop (the torch backend): each generation unit
    decodes all of its 256 at once until, as the length grows, their KV cache outgrows its
    memory. The step fails, and the job restarts decoding half of them at once (two waves)."""
    many = dataclasses.replace(WORKLOAD, micro_batch=1, global_batch=1024)
    grow = ((0, 512.0), (10, 8000.0))
    controller, _, engine = _run(BASELINE, steps=10, gen_len=grow, workload=many, backend="static")
    failures = _out_of_memory(controller)
    assert failures and failures[0]["failure"].startswith("out of memory in actor@generation")
    launch = _launch(controller)
    assert launch["actor@generation"] == 0  # all of a unit's sequences at once
    halved = next(e for e in controller.events if e["event"] == "control.micro_batches_halved")
    dp = controller.plan.model_stage("actor@generation").layout.dp
    share = math.ceil(many.global_batch / dp)
    assert halved["changed"] == {"actor@generation": [0, math.ceil(share / 2)]}
    after = [engine.history[s].plan for s in sorted(engine.history) if s > failures[0]["step"]]
    assert after
    for plan_ in after:
        assert plan_.micro_batches(1) == {**launch, "actor@generation": math.ceil(share / 2)}


def test_a_failure_naming_no_model_stage_halves_every_training_and_inference_one():
    """An out-of-memory failure that does not say where (a device's own message, say): every
    training and inference micro-batch halves, as each ran (at most a unit's share of the
    batch), and generation keeps its own."""
    grow = ((0, 512.0), (30, 6000.0))
    trace = Trace(name="t", steps=30, accelerator=ACC.name, gpus=16, gen_len=grow, len_sigma=0.0)
    engine = SimulatedEngine(trace, ACC, seed=1)
    controller = Controller(WORKLOAD, ACC, BASELINE)
    controller.initial_plan(engine)
    launch = _micro_batches(controller.plan)
    running = controller.plan
    for step in range(trace.steps):
        controller.before_step(engine, step)
        report = engine.step(controller.plan, controller._workload(controller._gen_len), step)
        if report.failure.startswith("out of memory"):
            report = dataclasses.replace(report, failure="out of memory (simulated)")
            running = controller.plan
            controller.after_step(report, engine)
            break
        controller.after_step(report, engine)
    else:
        pytest.fail("no step ran out of memory")
    expected = {}
    for ms in running.model_stages:
        size = launch[ms.name]
        if not ms.name.endswith("@generation"):
            size = max(1, min(size, math.ceil(WORKLOAD.global_batch / ms.layout.dp)) // 2)
        expected[ms.name] = size
    assert expected != launch
    assert controller.restarts == 1
    assert _micro_batches(controller.plan) == expected
