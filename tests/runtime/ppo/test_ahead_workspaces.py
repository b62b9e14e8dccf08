"""Units built ahead are freed on all of their slots or on none: a unit's workspace dropped on one
member only would be rebuilt on that member alone, which then waits at the unit's barrier for a
peer that skips it (holding it already), and the step hangs."""

import pytest
import torch

from runtime.engine.ray_cluster import ray_connection
from runtime.engine.ray_engine import RayEngine
from runtime.engine.slots import SlotPool
from runtime.ppo import slot_work
from runtime.ppo.algorithm import PPOConfig
from runtime.ppo.job import PpoJobConfig, PpoRuntime, plan_by_hand
from tests.support.waiting import wait_until

pytestmark = pytest.mark.ray

SLOTS = 4
CONFIG = PpoJobConfig(
    batch_size=8,
    max_new_tokens=4,
    warmup_steps=2,
    checkpoint_every=0,
    ppo=PPOConfig(kl_coef=0.01, epochs=1, minibatch_size=8),
)
BASE = {"actor@training": (1, 2, 1), "critic@training": (1, 2, 1), "actor@generation": (1, 2, 1)}
GENERATION = "actor@generation/2x1@2-3"


def _wait_idle(job, timeout_s=60.0):
    wait_until(lambda: not job.building_ahead(), "the builds ahead ended", timeout_s=timeout_s)


def test_a_dropped_unit_built_ahead_goes_on_all_its_slots_or_none(tmp_path):
    torch.set_num_threads(1)
    with ray_connection(None, num_cpus=SLOTS):
        pool = SlotPool.create(SLOTS, call_timeout_s=30)
        job = PpoRuntime(CONFIG, workdir=tmp_path / "job")
        engine = RayEngine(pool, checkpoint_dir=tmp_path / "restart", job=job)
        try:
            wl = job.workload()
            base = plan_by_hand(wl, BASE, num_slots=SLOTS)
            # Generation spreads onto slots 2-3; then ref onto slot 3.
            wide = plan_by_hand(wl, {**BASE, "actor@generation": (2, 2, 1)}, num_slots=SLOTS)
            ref = plan_by_hand(
                wl,
                {**BASE, "ref@inference": (2, 1, 1)},
                num_slots=SLOTS,
                slots={"ref@inference": (0, 3)},
            )
            engine.start(base, wl)
            assert engine.step(base, wl, 0).ok
            engine.build_ahead(wide, wl, {"actor@generation": ((2, 3),)})
            _wait_idle(job)
            engine.drop_ahead()  # superseded by a proposal that builds on slot 3 only
            engine.build_ahead(ref, wl, {"ref@inference": ((3,),)})
            assert engine.step(base, wl, 1).ok  # slot 3 still building: slot 2 is left alone
            held = [GENERATION in ws for ws in pool.run(slot_work.workspaces, on=[2, 3])]
            assert held[0] == held[1], f"slots 2, 3 hold {GENERATION}: {held}"
            # A plan that uses the unit builds it (or not) on both members together.
            result = engine.step(wide, wl, 2)
            assert result.ok, result.failure
        finally:
            engine.stop()
            pool.close()
