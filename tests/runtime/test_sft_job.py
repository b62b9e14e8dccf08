"""The smallest real job on a local Ray instance: CPU slots as Ray actors, a gloo group, real
gradient all-reduce. (CPU actors stand in for GPUs here; the same code takes NCCL on GPUs.)"""

import pytest
import ray
import torch
import torch.distributed as dist

from runtime.engine.ray_cluster import ray_connection
from runtime.engine.slots import SlotError, SlotPool
from runtime.events import ListSink
from runtime.jobs import driver, sft
from runtime.jobs.driver import run_sft_job
from runtime.jobs.spec import SftJobSpec

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def local_ray():
    with ray_connection(None, num_cpus=4) as connection:
        yield connection


def _all_reduce_rank(ctx):
    value = torch.tensor([float(ctx.rank)])
    dist.all_reduce(value)
    return ctx.rank, ctx.world_size, value.item()


def test_local_instance_is_on_loopback(local_ray):
    assert local_ray.started_locally
    assert local_ray.address.startswith("127.0.0.1:")
    assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}


def test_slots_form_a_real_gloo_group(local_ray):
    pool = SlotPool.create(3, call_timeout_s=60)
    try:
        results = pool.run(_all_reduce_rank)
    finally:
        pool.close()
    assert pool.backend == "gloo"
    assert sorted(r[0] for r in results) == [0, 1, 2]
    assert all(world == 3 and total == 0 + 1 + 2 for _, world, total in results)


def test_a_dead_slot_becomes_a_slot_error_not_a_hang(local_ray):
    pool = SlotPool.create(2, call_timeout_s=20)
    try:
        ray.kill(pool._actors[1])
        with pytest.raises(SlotError, match=r"^slot 1 died: "):
            pool.run(_all_reduce_rank)
    finally:
        pool.close()


def test_sft_job_learns_and_keeps_replicas_identical(local_ray):
    sink = ListSink()
    outcome = run_sft_job(
        SftJobSpec(num_slots=2, num_steps=12, seed=1), sink=sink, ray_address=None
    )
    assert outcome.status == "succeeded" and outcome.steps_done == 12
    kinds = [e.kind for e in sink.events]
    assert kinds[:2] == ["job.started", "slots.ready"] and kinds[-2:] == [
        "replicas.verified",
        "job.finished",
    ]
    steps = [e.data for e in sink.of_kind("step.finished")]
    assert [s["step"] for s in steps] == list(range(12))
    assert steps[-1]["loss"] < 0.8 * steps[0]["loss"]  # it learns the progressions
    assert all(s["allreduce_bytes"] == steps[0]["allreduce_bytes"] > 0 for s in steps)
    assert all(len(s["peak_memory_bytes"]) == 2 and min(s["peak_memory_bytes"]) > 0 for s in steps)
    assert sink.of_kind("replicas.verified")[0].data["identical"] is True


def test_same_seed_same_losses(local_ray):
    runs = []
    for _ in range(2):
        sink = ListSink()
        run_sft_job(SftJobSpec(num_slots=2, num_steps=3, seed=5), sink=sink, ray_address=None)
        runs.append([e.data["loss"] for e in sink.of_kind("step.finished")])
    assert runs[0] == runs[1]


def test_cancellation_stops_at_a_step_boundary(local_ray):
    sink = ListSink()
    outcome = run_sft_job(
        SftJobSpec(num_slots=1, num_steps=50),
        sink=sink,
        ray_address=None,
        should_stop=lambda: len(sink.of_kind("step.finished")) >= 3,
    )
    assert (outcome.status, outcome.steps_done) == ("cancelled", 3)
    assert sink.events[-1].kind == "job.finished" and sink.events[-1].data["status"] == "cancelled"


def _poison_the_first_weight(ctx):
    with torch.no_grad():
        next(ctx.state["model"].parameters()).fill_(float("nan"))


def test_a_nan_loss_fails_the_job_naming_it_and_the_update_is_not_made(local_ray):
    spec = SftJobSpec(num_slots=2, num_steps=3, micro_batch=2, seq_len=8, hidden=16, num_heads=2)
    pool = SlotPool.create(2, call_timeout_s=20)
    try:
        pool.run(sft.setup_replica, spec_json=spec.to_json())
        pool.run(_poison_the_first_weight, on=[1])  # one replica's loss is NaN
        before = pool.run(sft.replica_checksum)
        with pytest.raises(ArithmeticError, match="step 0: the loss or its gradients are not"):
            driver._train(spec, pool, ListSink(), lambda: False)
        assert pool.run(sft.replica_checksum) == before  # no replica was updated
    finally:
        pool.close()


def test_a_pool_forms_whatever_its_call_timeout_new_processes_are_waited_for(local_ray):
    """Starting a slot process (Python, torch, the actor) takes longer than a short call
    timeout on a busy machine; forming the group must not fail for it."""
    pool = SlotPool.create(2, call_timeout_s=1.0)
    try:
        assert pool.num_slots == 2 and pool.backend == "gloo"
        assert all(node["address"] == "127.0.0.1" for node in pool.nodes())
    finally:
        pool.close()
