"""An operator's change of a running PPO job's slot pool, on the Ray engine (``RayEngine.resize``
through the driver's ``apply_commands``): a shrink announced ahead is a live move off the slots
to go, with no step lost and no restart; the slots are released once the job is off them, or
taken with their state at the deadline; a grant before then keeps them as they are."""

import math

import pytest

from runtime.control import Controller, JobPolicy
from runtime.engine.ray_cluster import ray_connection
from runtime.engine.ray_engine import RayEngine
from runtime.engine.slots import SlotPool
from runtime.jobs.driver import apply_commands
from runtime.jobs.ppo_job import run_ppo_steps
from runtime.planner import default_catalog
from runtime.ppo.algorithm import PPOConfig
from runtime.ppo.job import PpoJobConfig, PpoRuntime, plan_by_hand

pytestmark = pytest.mark.ray

SLOTS = 4
CONFIG = PpoJobConfig(
    batch_size=16,
    max_new_tokens=8,
    warmup_steps=10,
    checkpoint_every=0,
    ppo=PPOConfig(kl_coef=0.01, epochs=1, minibatch_size=8),
)
CPU = default_catalog().accelerator("cpu-slot")
# Training is one unit over all four slots (tensor parallel): slot 3 holds a quarter of the only
# copy of each trained model's state, so losing it unannounced would send the job back to a
# checkpoint (there is none here).
ACROSS_ALL = {
    "actor@training": (4, 1),
    "critic@training": (4, 1),
    "actor@generation": (1, 1),
    "actor@inference": (1, 1),
    "ref@inference": (1, 1),
    "critic@inference": (1, 1),
    "reward@inference": (1, 1),
}


class Sink:
    def __init__(self):
        self.events = []

    def emit(self, event) -> None:
        self.events.append(event)


@pytest.fixture(scope="module")
def pool():
    with ray_connection(None, num_cpus=SLOTS):
        pool = SlotPool.create(SLOTS, call_timeout_s=30)
        yield pool
        pool.close()


def _engine(pool, tmp_path):
    job = PpoRuntime(CONFIG, workdir=tmp_path / "job")
    return RayEngine(pool, checkpoint_dir=tmp_path / "restart", job=job), job


def _kinds(engine) -> list[str]:
    return [e["event"] for e in engine.events]


def test_a_shrink_announced_ahead_moves_the_job_off_the_slot_with_no_step_lost(pool, tmp_path):
    engine, job = _engine(pool, tmp_path)
    events, sink = [], Sink()
    controller = Controller(
        job.workload(), CPU, JobPolicy(fixed_layouts=True), emit=events.append, fixed=ACROSS_ALL
    )
    before_resize = {}
    ppo_steps = []

    def between_steps(loop_step: int) -> bool:
        if loop_step == 2:
            before_resize["units"] = engine.units()
            command = ("resize", {"slots": 3, "notice_s": 300.0})
            apply_commands(controller, engine, [command], sink)
        return True

    def on_step(report):
        ppo_steps.append(report.extra.get("ppo_step") if report.ok else None)
        controller.emit_step(report)

    try:
        run = run_ppo_steps(
            engine, controller, job, 5, between_steps=between_steps, on_step=on_step
        )
        after, lost = engine.units(), engine.lost_slots()
    finally:
        engine.stop()

    trained = before_resize["units"]["actor@training"]
    assert any(3 in unit.slots for unit in trained), "the test must shrink a slot in use"
    (applied,) = [e.data for e in sink.events]
    assert applied["command"] == "resize"
    assert "released once the job is off them" in applied["outcome"]
    assert engine.pool_size() == 3
    # The state on slot 3 was moved live: every step counted once, no restart, no failed step.
    assert not run.failure and run.summary.restarts == 0 and run.summary.failed_steps == 0
    assert ppo_steps == [0, 1, 2, 3, 4]
    transition = next(e for e in events if e["event"] == "control.transition")
    assert transition["ok"] and transition["dag"]["nodes"]
    urgent = [e for e in events if e["event"] == "control.trigger" and e["kind"] == "failure"]
    assert len(urgent) == 1 and urgent[0]["detail"] == "slots [3] leave the pool"
    assert all(3 not in u.slots for units in after.values() for u in units)
    # Released, not reclaimed: the job was off it before its deadline. Its process lives on,
    # idle: the group was not re-formed for it.
    kinds = _kinds(engine)
    assert "engine.reclaim_announced" in kinds and "engine.reclaimed" not in kinds
    assert [e["slot"] for e in engine.events if e["event"] == "engine.released"] == [3]
    assert kinds.index("engine.released") > kinds.index("engine.reclaim_announced")
    assert "engine.slots_lost" not in kinds and lost == frozenset()


def test_a_slot_the_plan_still_uses_at_its_deadline_is_taken(pool, tmp_path, monkeypatch):
    engine, job = _engine(pool, tmp_path)
    workload = job.workload()
    # Slot 3 holds no training state, only the generation unit the plan runs there.
    plan = plan_by_hand(
        workload, {"actor@training": (1, 2, 1)}, num_slots=SLOTS, slots={"actor@generation": (3,)}
    )
    engine.start(plan, workload)
    try:
        engine.resize(3, notice_s=60.0)
        # Until its deadline the slot is the job's, before the first step too: a step on the
        # plan that uses it runs.
        assert engine.pool_size() == 3 and engine.lost_slots() == frozenset()
        assert engine.step(plan, workload, 0).ok
        assert engine.step(plan, workload, 1).ok
        clock = engine.now()
        monkeypatch.setattr(engine, "now", lambda: clock + 61.0)
        assert 3 in engine.lost_slots()
    finally:
        engine.stop()
    assert [e["slot"] for e in engine.events if e["event"] == "engine.reclaimed"] == [3]
    assert "engine.released" not in _kinds(engine)


def test_a_grant_before_the_deadline_keeps_the_slot_and_what_it_holds(pool, tmp_path):
    engine, job = _engine(pool, tmp_path)
    workload = job.workload()
    plan = plan_by_hand(workload, {"actor@training": (2, 2, 1)}, num_slots=SLOTS)
    engine.start(plan, workload)
    try:
        held = engine.units()
        assert engine.resize(2, notice_s=60.0).startswith("pool 4 -> 2 slots")
        assert "given" in engine.resize(4)
        assert engine.pool_size() == 4 and engine.lost_slots() == frozenset()
        assert engine.units() == held
        assert engine.step(plan, workload, 0).ok  # the same processes, the same state
    finally:
        engine.stop()
    withdrawn = [e["slot"] for e in engine.events if e["event"] == "engine.reclaim_withdrawn"]
    assert withdrawn == [2, 3]
    assert "engine.released" not in _kinds(engine) and "engine.revoked" not in _kinds(engine)


def test_a_slot_that_died_during_its_notice_comes_back_empty_when_granted(pool, tmp_path):
    engine, job = _engine(pool, tmp_path)
    workload = job.workload()
    plan = plan_by_hand(workload, {"actor@training": (2, 2, 1)}, num_slots=SLOTS)
    engine.start(plan, workload)
    try:
        engine.resize(3, notice_s=60.0)
        engine.engine.pool.kill(3)  # the node failed before the reclaim
        assert engine.resize(4) == "pool 3 -> 4 slots: slots [3] given"
        # Not kept as it was: what it held is gone, and the slot is the job's again, empty.
        assert engine.lost_slots() == frozenset()
        units = engine.units()
    finally:
        engine.stop()
    assert all(3 not in u.slots for us in units.values() for u in us)
    kinds = _kinds(engine)
    assert "engine.granted" in kinds and "engine.reclaim_withdrawn" not in kinds


def test_a_shrink_without_notice_takes_the_slots_at_once(pool, tmp_path):
    engine, _ = _engine(pool, tmp_path)
    try:
        assert engine.resize(2) == "pool 4 -> 2 slots: slots [2, 3] taken at once"
        assert engine.lost_slots() == {2, 3}
        assert engine.resize(3) == "pool 2 -> 3 slots: slots [2] given"
        assert engine.lost_slots() == {3}
    finally:
        engine.stop()


@pytest.mark.parametrize(
    ("slots", "notice_s", "field"),
    [
        (0, 0.0, "slots"),
        (SLOTS + 1, 0.0, "slots"),
        (True, 0.0, "slots"),
        (2.0, 0.0, "slots"),
        (2, -1.0, "notice_s"),
        (2, math.nan, "notice_s"),
        (2, math.inf, "notice_s"),
        (2, "soon", "notice_s"),
    ],
)
def test_a_bad_resize_is_refused_naming_the_field_and_changes_nothing(
    pool, tmp_path, slots, notice_s, field
):
    engine, _ = _engine(pool, tmp_path)
    with pytest.raises(ValueError, match=f"^{field}: "):
        engine.resize(slots, notice_s=notice_s)
    assert engine.pool_size() == SLOTS and engine.events == []
