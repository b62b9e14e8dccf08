"""The simulated cluster's step while a transition's new derived units are still building: the
generation units that are built generate, the others join once built, and the step's next stage
waits for whatever is still building on its slots. Every second here is simulated: the
engine's true model without noise, so the assertions check what the model plays out, not how
fast anything runs."""

import pytest

from runtime.engine.sim import REBUILD_TRUTH, SimulatedEngine, TrueModel
from runtime.engine.traces import Trace
from runtime.planner import PpoWorkload, default_catalog
from runtime.planner.plan import Layout, Plan
from runtime.transition import Cluster, diff
from runtime.transition.compiler import DEFAULT_REBUILD_S

CATALOG = default_catalog()
ACC = CATALOG.accelerator("h100-sxm")
WORKLOAD = PpoWorkload.for_model(CATALOG.model("llama-3.1-8b"), gen_len=1024)
BUILD = {stage: seconds * REBUILD_TRUTH for stage, seconds in DEFAULT_REBUILD_S}
INFERENCE = [ms.name for ms in WORKLOAD.model_stages() if ms.stage == "inference"]
"""What one new unit of each derived stage truly takes to build (the engine has no noise)."""


def _plan(num_slots: int, generation: tuple[int, int], first: int = 0) -> Plan:
    """Everything tensor-parallel over 8 GPUs across ``num_slots``; generation (dp, tp) from
    slot ``first``."""
    layouts = {}
    for ms in WORKLOAD.model_stages():
        dp, tp = generation if ms.stage == "generation" else (num_slots // 8, 8)
        start = first if ms.stage == "generation" else 0
        units = tuple(tuple(range(start + i * tp, start + (i + 1) * tp)) for i in range(dp))
        layouts[ms.name] = (Layout(dp=dp, tp=tp, pp=1), units)
    return Plan.of_units(accelerator=ACC.name, num_slots=32, layouts=layouts)


SMALL = _plan(16, (8, 2))
"""On slots 0-15 of a pool of 32; generation in tp 2."""
GROWN = _plan(32, (8, 4))
"""On all 32; generation reshaped to tp 4, so no generation unit stays in place."""


def _engine() -> SimulatedEngine:
    trace = Trace(name="j", steps=10, accelerator=ACC.name, gpus=32, gen_len=((0, 1024.0),))
    return SimulatedEngine(trace, ACC, truth=TrueModel.draw(3, noise=0.0), seed=1)


def _dag(engine):
    cluster = Cluster(accelerator=ACC, num_slots=32, rebuild_s=engine.rebuild_s)
    return diff(engine.units(), GROWN, cluster, WORKLOAD, derived_from=SMALL)


def test_generation_built_ahead_on_granted_slots_generates_while_the_rest_builds():
    engine = _engine()
    engine.start(SMALL, WORKLOAD)
    assert engine.step(SMALL, WORKLOAD, 0).ok
    dag = _dag(engine)
    # Reshaped, generation keeps nothing in place: the first step would have nothing to
    # generate on, and the transition waits for every new unit.
    assert dag.generating == frozenset() and dag.joining == frozenset()
    assert {slots for _, slots in dag.ahead} == {
        tuple(range(i, i + n)) for n in (4, 8) for i in range(16, 32, n)
    }
    # Built ahead on slots 16-31 while the job steps once more on 0-15 ...
    units = {}
    for name, slots in sorted(dag.ahead):
        units.setdefault(name, []).append(slots)
    engine.build_ahead(GROWN, WORKLOAD, units)
    during = engine.step(SMALL, WORKLOAD, 1)
    assert during.ok
    dag.built_ahead = dag.ahead
    # ... they generate in the first step on all 32, while every new unit on 0-15 builds.
    assert dag.joining == {("actor@generation", tuple(range(i, i + 4))) for i in range(0, 16, 4)}
    assert dag.rebuild_makespan() == 0.0
    # Four inference units, then generation, on each granted slot: the transition waits for
    # what is left of that after the step.
    ahead_s = 4 * BUILD["inference"] + BUILD["generation"]
    assert during.seconds < ahead_s
    outcome = engine.transition(dag)
    assert outcome.ok
    assert outcome.rebuild_s == pytest.approx(ahead_s - during.seconds)
    first = engine.step(GROWN, WORKLOAD, 2)
    second = engine.step(GROWN, WORKLOAD, 3)
    assert first.ok and second.ok
    # The inference units on 0-15 stay in place; the generation units there build from the
    # transition's end: the first step's generation (on half the units) lasts until they are
    # built, and the next one runs on all.
    assert first.stage_seconds["generation"] == pytest.approx(BUILD["generation"])
    assert second.stage_seconds["generation"] < first.stage_seconds["generation"] / 2
    assert first.stage_seconds["training"] == pytest.approx(
        second.stage_seconds["training"], rel=0.05
    )


def test_without_a_generation_unit_built_the_transition_waits_for_every_build():
    engine = _engine()
    engine.start(SMALL, WORKLOAD)
    engine.step(SMALL, WORKLOAD, 0)
    dag = _dag(engine)
    outcome = engine.transition(dag)
    assert outcome.ok
    # Slots 0-31 each build four inference units and one generation unit, all at once.
    assert outcome.rebuild_s == pytest.approx(4 * BUILD["inference"] + BUILD["generation"])
    first = engine.step(GROWN, WORKLOAD, 1)
    second = engine.step(GROWN, WORKLOAD, 2)
    assert first.stage_seconds["generation"] == pytest.approx(
        second.stage_seconds["generation"], rel=0.05
    )


def test_a_step_whose_generation_units_are_all_still_building_waits_for_them():
    """Generation grows onto slots 16-31 (the units on 0-15 stay); before any step, a second
    move keeps only the new units, which are still building: the step cannot start its
    generation until they are built."""
    wider = _plan(32, (16, 2))
    upper = _plan(32, (8, 2), first=16)
    engine = _engine()
    engine.start(SMALL, WORKLOAD)
    engine.step(SMALL, WORKLOAD, 0)
    cluster = Cluster(accelerator=ACC, num_slots=32, rebuild_s=engine.rebuild_s)
    first = diff(engine.units(), wider, cluster, WORKLOAD, derived_from=SMALL)
    assert {n for n, _ in first.joining} == {"actor@generation", *INFERENCE}
    assert engine.transition(first).ok
    second = diff(engine.units(), upper, cluster, WORKLOAD, derived_from=wider)
    assert second.rebuild_units == {}  # as far as the plans tell, those units are there
    assert engine.transition(second).ok
    blocked = engine.step(upper, WORKLOAD, 1)
    normal = engine.step(upper, WORKLOAD, 2)
    assert blocked.ok and normal.ok
    # Slots 16-31 build their inference units, then generation: the step's generation starts
    # when they are built and then takes what it takes.
    waited = blocked.stage_seconds["generation"] - normal.stage_seconds["generation"]
    assert waited == pytest.approx(4 * BUILD["inference"] + BUILD["generation"], rel=0.05)
