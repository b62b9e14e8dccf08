"""The executor on the Ray engine: eight CPU slots (Ray actors standing in for GPUs, which this
machine lacks) joined by gloo. Two model-stages move at once through slots one of them is leaving;
every unit's logical state (checksum) is unchanged, and a slot killed mid-transition leaves
intact units to replan from."""

import pytest

from runtime.emu.engine import UnitEngine
from runtime.engine.ray_cluster import ray_connection
from runtime.engine.ray_engine import state_seed
from runtime.engine.slots import SlotPool
from runtime.planner import default_catalog
from runtime.planner.calibration import Calibrator
from runtime.planner.plan import Layout, Plan
from runtime.planner.workload import PpoWorkload
from runtime.transition import Cluster, Executor, diff
from runtime.transition.units import occupancy, units_of

pytestmark = pytest.mark.ray

CATALOG = default_catalog()
ACC = CATALOG.accelerator("cpu-slot")
WORKLOAD = PpoWorkload.for_model(CATALOG.model("tiny-llama"))
NAMES = [ms.name for ms in WORKLOAD.model_stages()]
NUM_SLOTS = 8


def _plan(layouts) -> Plan:
    base = {n: (Layout(dp=1, tp=1, pp=1), ((0,),)) for n in NAMES}
    return Plan.of_units(accelerator=ACC.name, num_slots=NUM_SLOTS, layouts={**base, **layouts})


# actor@training leaves 4-5 for 6-7 and changes its layout; critic@training leaves 6-7 for 2-3;
CURRENT = _plan(
    {
        "actor@training": (Layout(dp=2, tp=1, pp=1), ((4,), (5,))),
        "critic@training": (Layout(dp=1, tp=2, pp=1), ((6, 7),)),
    }
)
TARGET = _plan(
    {
        "actor@training": (Layout(dp=1, tp=2, pp=1), ((6, 7),)),
        "critic@training": (Layout(dp=1, tp=2, pp=1), ((2, 3),)),
    }
)


def _tight_cluster() -> Cluster:
    """Room on slots 6-7 for the critic or the actor, never both."""
    before = occupancy(units_of(CURRENT, WORKLOAD), NUM_SLOTS)
    after = occupancy(units_of(TARGET, WORKLOAD), NUM_SLOTS)
    caps = tuple(
        max(b, a, 1) * (1.3 if s in (6, 7) else 4.0)
        for s, (b, a) in enumerate(zip(before, after, strict=True))
    )
    return Cluster(accelerator=ACC, num_slots=NUM_SLOTS, capacity_bytes=caps)


def _materialise(engine: UnitEngine, plan: Plan = CURRENT) -> dict[str, int]:
    """Create ``plan``'s units; every replica of a model-stage holds the same state."""
    checksums = {}
    for name, units in units_of(plan, WORKLOAD).items():
        for unit in units:
            engine.create(unit, seed=state_seed(name))
        checksums[name] = engine.checksum(units[0])
    return checksums


@pytest.fixture(scope="module")
def ray_session():
    with ray_connection(None, num_cpus=NUM_SLOTS):
        yield


@pytest.fixture
def engine(ray_session):
    pool = SlotPool.create(NUM_SLOTS, call_timeout_s=60)
    try:
        yield UnitEngine(pool)
    finally:
        pool.close()


def test_two_model_stages_move_at_once_through_shared_slots_with_state_unchanged(engine):
    before = _materialise(engine)
    dag = diff(CURRENT, TARGET, _tight_cluster(), WORKLOAD)
    resource = [(a, b) for (a, b), kind in dag.edges.items() if kind == "resource"]
    assert resource, "the tight slots 6-7 must force a release before an acquisition"
    calibrator = Calibrator()
    seen = []
    result = Executor(dag, engine, on_event=seen.append, calibrator=calibrator).run()

    assert result.ok and not result.failed
    for name, units in result.units.items():
        assert sorted(u.slots for u in units) == sorted(TARGET.model_stage(name).units)
        for unit in units:
            assert engine.checksum(unit) == before[name], (name, unit.unit_id)
    assert set(engine.units) == {u.unit_id for us in result.units.values() for u in us}

    # Every node went pending -> running -> done, and the resource edges held.
    states = {}
    for event in seen:
        if event["event"] == "transition.node":
            states.setdefault(event["node"], []).append(event["state"])
    assert states and all(s == ["pending", "running", "done"] for s in states.values())
    for a, b in resource:
        assert dag.nodes[a].finished_s <= dag.nodes[b].started_s
    # Nodes on disjoint slots ran at once: a second one started before the first finished.
    order = [(e["node"], e["state"]) for e in seen if e["event"] == "transition.node"]
    first_done = next(i for i, (_, s) in enumerate(order) if s == "done")
    assert sum(s == "running" for _, s in order[:first_done]) >= 2
    assert seen[-1]["event"] == "transition.finished" and seen[-1]["ok"]
    # Groups were made once, up front; measured times fed the transition efficiencies.
    assert result.groups_created >= 1
    assert sum(calibrator.num_samples(c) for c in ("transition:intra", "transition_copy")) > 0
    data = dag.to_json()
    assert all(n["state"] == "done" and n["actual_s"] is not None for n in data["nodes"])


def test_a_slot_lost_mid_transition_stops_it_and_reports_the_intact_units(engine):
    before = _materialise(engine)
    dag = diff(CURRENT, TARGET, _tight_cluster(), WORKLOAD)
    critic_extend = next(
        n for n in dag.nodes.values() if n.model_stage == "critic@training" and n.kind == "extend"
    )
    killed = []

    def revoke_slot_7(event):
        # The critic's copy to 2-3 is done: slot 7 (still holding the old critic, and wanted by
        # the actor) disappears, as a revoked GPU would.
        if event.get("node") == critic_extend.node_id and event["state"] == "done" and not killed:
            engine.pool.kill(7)
            killed.append(7)

    result = Executor(dag, engine, on_event=revoke_slot_7).run()
    assert not result.ok and result.failed
    assert result.lost_slots == [7]
    assert {dag.nodes[n].state for n in dag.nodes} <= {"done", "failed", "skipped"}
    assert any(n.state == "skipped" for n in dag.nodes.values())
    # Intact: nothing on slot 7; the actor's state is still on 4-5 (its move waits for the
    # critic to leave 6-7, which failed), and the critic's new copy on 2-3 was verified.
    for units in result.units.values():
        for unit in units:
            assert 7 not in unit.slots
            assert engine.checksum(unit) == before[unit.model_stage]
    assert {u.slots for u in result.units["critic@training"]} == {(2, 3)}
    actor = result.units["actor@training"]
    assert actor and {s for u in actor for s in u.slots} <= {4, 5}  # merged in place, not moved
    assert result.events[-1]["event"] == "transition.finished"
    assert not result.events[-1]["ok"]


def test_a_full_device_reshapes_through_the_coarse_layout_with_state_unchanged(engine):
    """(2,2,2) -> (2,4,1) with 60% room per slot: the grain route does not fit, so the compiler
    merges the replicas and splits the merged unit along pp; the real primitives carry it out on
    the slots and every replica's logical state is bit for bit what it was."""
    base = {n: (Layout(dp=1, tp=1, pp=1), ((0,),)) for n in NAMES}
    name = "actor@training"
    current = _plan({**base, name: (Layout(dp=2, tp=2, pp=2), ((0, 1, 2, 3), (4, 5, 6, 7)))})
    target = _plan({**base, name: (Layout(dp=2, tp=4, pp=1), ((0, 4, 1, 5), (2, 6, 3, 7)))})
    before_bytes = occupancy(units_of(current, WORKLOAD), NUM_SLOTS)
    after_bytes = occupancy(units_of(target, WORKLOAD), NUM_SLOTS)
    caps = tuple(max(a, b) * 1.6 + 1 for a, b in zip(before_bytes, after_bytes, strict=True))
    dag = diff(
        current,
        target,
        Cluster(accelerator=ACC, num_slots=NUM_SLOTS, capacity_bytes=caps),
        WORKLOAD,
    )
    assert [n.kind for n in dag.nodes.values() if n.model_stage == name] == ["merge", "split"]

    checksums = _materialise(engine, current)
    result = Executor(dag, engine).run()
    assert result.ok and not result.failed
    units = result.units[name]
    assert sorted(u.slots for u in units) == sorted(target.model_stage(name).units)
    assert all((u.layout.tp, u.layout.pp) == (4, 1) for u in units)
    for unit in units:
        assert engine.checksum(unit) == checksums[name], unit.unit_id
