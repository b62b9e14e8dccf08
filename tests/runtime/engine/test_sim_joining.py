"""The simulated cluster's step while a transition's new derived units are still building: the
generation units that are built generate, the others join once built, and the step's next stage
waits for whatever is still building on its slots. Every second here is simulated: the
engine's cluster twin without noise, so the assertions check what the twin plays out, not how
fast anything runs."""

import dataclasses

import pytest

from runtime.engine.sim import SimulatedEngine
from runtime.engine.traces import Trace
from runtime.planner import PpoWorkload, default_catalog
from runtime.planner.plan import Layout, Plan
from runtime.transition import Cluster, diff
from runtime.twin import ClusterTwin, build_seconds, device

CATALOG = default_catalog()
ACC = CATALOG.accelerator("h100-sxm")
WORKLOAD = PpoWorkload.for_model(CATALOG.model("llama-3.1-8b"), gen_len=1024)
INFERENCE = [ms.name for ms in WORKLOAD.model_stages() if ms.stage == "inference"]


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


def _built(engine: SimulatedEngine, name: str, tp: int) -> float:
    """What one new unit of model-stage ``name`` over ``tp`` slots of a node takes to build on
    the engine's twin (it has no noise): its start-up, and its weights sent to it."""
    role, _, stage = name.partition("@")
    params = WORKLOAD.models[role].num_params(scalar_head=role in ("critic", "reward"))
    per_slot = params * WORKLOAD.bytes_per_value / tp
    return build_seconds(engine.twin, stage, per_slot, tuple(range(16, 16 + tp)))


def _ahead_s(engine: SimulatedEngine, generation_tp: int) -> float:
    """A granted slot's builds, one after another: its four inference units (over 8 slots),
    then its generation unit."""
    inference = sum(_built(engine, name, 8) for name in INFERENCE)
    return inference + _built(engine, "actor@generation", generation_tp)


SLOW_START = dataclasses.replace(device(ACC.name), serving_start_s=60.0)
"""H100s whose serving engines take a minute to start (a longer graph capture): the builds on
the granted slots outlast a step, so a transition after it waits for what is left of them."""


def _engine() -> SimulatedEngine:
    # Every response at the mean length: steps on one plan play the same sequences.
    trace = Trace(
        name="j", steps=10, accelerator=ACC.name, gpus=32, gen_len=((0, 1024.0),), len_sigma=0.0
    )
    return SimulatedEngine(trace, ACC, twin=ClusterTwin.draw(SLOW_START, 3, noise=0.0), seed=1)


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
    ahead_s = _ahead_s(engine, 4)
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
    assert first.stage_seconds["generation"] == pytest.approx(_built(engine, "actor@generation", 4))
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
    assert outcome.rebuild_s == pytest.approx(_ahead_s(engine, 4))
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
    assert waited == pytest.approx(_ahead_s(engine, 2), rel=0.05)
