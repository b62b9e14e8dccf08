"""PPO on the Ray engine when slots die: the controller replans from the intact units where a
replica survived (no step lost), and the job resumes from its last committed checkpoint where
none did; checkpoints resume to the same step, data order and random state."""

import dataclasses
import os
import shutil
import signal

import pytest

from runtime.control import Controller, JobPolicy, run_job
from runtime.emu import checkpoint
from runtime.emu.checkpoint import UnusableCheckpointError
from runtime.engine import ray_engine
from runtime.engine.ray_cluster import ray_connection
from runtime.engine.ray_engine import RayEngine
from runtime.engine.slots import SlotError, SlotPool
from runtime.jobs.ppo_job import RETRIES, run_ppo_steps
from runtime.planner import default_catalog
from runtime.ppo.algorithm import PPOConfig
from runtime.ppo.job import NonFiniteError, PpoJobConfig, PpoRuntime, plan_by_hand

pytestmark = pytest.mark.ray

SLOTS = 4
CONFIG = PpoJobConfig(
    batch_size=16,
    max_new_tokens=8,
    warmup_steps=10,
    checkpoint_every=2,
    ppo=PPOConfig(kl_coef=0.01, epochs=1, minibatch_size=8),
)
CPU = default_catalog().accelerator("cpu-slot")
# Training is one unit over all four slots (tensor parallel): slot 1 has no replica.
WITHOUT_A_REPLICA = {
    "actor@training": (4, 1),
    "critic@training": (4, 1),
    "actor@generation": (1, 1),
    "actor@inference": (1, 1),
    "ref@inference": (1, 1),
    "critic@inference": (1, 1),
    "reward@inference": (1, 1),
}


@pytest.fixture(scope="module")
def pool():
    with ray_connection(None, num_cpus=SLOTS):
        # A short timeout: a collective waiting on a dead peer gives up quickly.
        pool = SlotPool.create(SLOTS, call_timeout_s=30)
        yield pool
        pool.close()


def _engine(pool, tmp_path, config=CONFIG):
    job = PpoRuntime(config, workdir=tmp_path / "job")
    return RayEngine(pool, checkpoint_dir=tmp_path / "restart", job=job), job


def _run_with_a_kill(engine, job, *, layouts, kill_before: int, steps: int):
    events = []
    # The scenarios rest on the plan the catalog's figures give on four slots (a replica of
    # each training model on other slots, or none). Probes would time this machine's gloo
    # all-reduce (slow) first, and the plan would keep fewer replicas.
    policy = JobPolicy(fixed_layouts=True, calibration_probes=False)
    controller = Controller(job.workload(), CPU, policy, emit=events.append, fixed=layouts)
    ppo_steps = []

    def between_steps(step: int) -> bool:
        if step == kill_before:
            engine.engine.pool.kill(1)  # the slot's process dies, with its state
        return True

    def on_step(report):
        ppo_steps.append(report.extra.get("ppo_step") if report.ok else None)
        controller.emit_step(report)

    try:
        summary = run_job(engine, controller, steps, between_steps=between_steps, on_step=on_step)
    finally:
        engine.stop()
    return summary, events, ppo_steps


def test_a_killed_slot_with_a_live_replica_loses_no_step(pool, tmp_path):
    engine, job = _engine(pool, tmp_path)
    every = ("actor@training", "critic@training", "actor@generation", "actor@inference")
    layouts = {
        name: (1, 1) for name in (*every, "ref@inference", "critic@inference", "reward@inference")
    }
    summary, events, ppo_steps = _run_with_a_kill(
        engine, job, layouts=layouts, kill_before=3, steps=5
    )
    assert summary.steps == 5 and summary.failed_steps == 0
    assert ppo_steps == [0, 1, 2, 3, 4], "no step was lost or repeated"
    assert summary.restarts == 0 and summary.transitions >= 1
    assert any(e["event"] == "engine.slots_lost" and e["slots"] == [1] for e in engine.events)
    failure = [e for e in events if e["event"] == "control.trigger" and e["kind"] == "failure"]
    assert failure and "[1]" in failure[0]["detail"]
    transition = next(e for e in events if e["event"] == "control.transition")
    assert transition["ok"] and transition["dag"]["nodes"]


@pytest.mark.parametrize("stage", ["_infer", "_train"])
def test_a_slot_killed_mid_step_keeps_the_other_units_only_before_training(pool, tmp_path, stage):
    """A slot dies in the middle of step 3. In its inference stage no unit's state changed yet:
    the step fails, the units on the other slots are kept as they were at the step's start, and
    the controller moves the job off the dead slot; the step is done again, with no restart and
    no step lost. In its training stage the units may be mid-update: everything is released and
    the job goes back to its last checkpoint (step 2)."""
    engine, job = _engine(pool, tmp_path)
    layouts = {name: (1, 1) for name in WITHOUT_A_REPLICA}
    run_stage, calls = getattr(job, stage), []

    def run_and_lose_a_slot(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # step 3's
            engine.engine.pool.kill(1)
        return run_stage(*args, **kwargs)

    setattr(job, stage, run_and_lose_a_slot)
    summary, events, ppo_steps = _run_with_a_kill(
        engine, job, layouts=layouts, kill_before=-1, steps=5
    )
    failed = [e for e in engine.events if e["event"] == "engine.step_failed"]
    assert len(failed) == 1
    if stage == "_infer":
        assert ppo_steps == [0, 1, 2, None, 3], "the failed step is done again, from step 3"
        assert summary.restarts == 0 and summary.transitions >= 1
        assert failed[0]["kept"] is True
        transition = next(e for e in events if e["event"] == "control.transition")
        assert transition["ok"] and all(1 not in u for us in job_units(engine) for u in us)
    else:
        assert ppo_steps == [0, 1, 2, None, 2], "back to the checkpoint of step 2"
        assert summary.restarts >= 1 and failed[0]["kept"] is False


def job_units(engine):
    return [[u.slots for u in units] for units in engine.units().values()]


def test_a_killed_slot_without_a_replica_resumes_from_the_last_checkpoint(pool, tmp_path):
    engine, job = _engine(pool, tmp_path)
    summary, events, ppo_steps = _run_with_a_kill(
        engine, job, layouts=WITHOUT_A_REPLICA, kill_before=3, steps=5
    )
    restart = next(e for e in events if e["event"] == "control.restart")
    assert restart["from_checkpoint"]
    # Committed at steps 2 (and 4): the job goes back to step 2 and runs on from there.
    assert summary.restarts >= 1
    assert any(e["event"] == "engine.resumed" and e["step"] == 2 for e in engine.events)
    assert ppo_steps[:3] == [0, 1, 2] and ppo_steps[3:] == [2, 3]


def _run_ppo_steps(engine, job, num_steps: int, *, between_steps):
    """``run_ppo_job``'s step loop on the test's engine, with the layouts above."""
    events = []
    controller = Controller(
        job.workload(),
        CPU,
        JobPolicy(fixed_layouts=True),
        emit=events.append,
        fixed=WITHOUT_A_REPLICA,
    )
    ppo_steps = []

    def on_step(report):
        ppo_steps.append(report.extra.get("ppo_step") if report.ok else None)
        controller.emit_step(report)

    try:
        run = run_ppo_steps(
            engine, controller, job, num_steps, between_steps=between_steps, on_step=on_step
        )
    finally:
        engine.stop()
    return run, ppo_steps


def test_a_job_sent_back_to_its_checkpoint_runs_until_it_has_made_every_step(pool, tmp_path):
    """The scenario above through the job's own loop: the resume sends the job back from step 3
    to step 2, and the loop runs on until the job has made its five updates (one loop step more),
    reporting the job's count, not the loop's."""
    engine, job = _engine(pool, tmp_path)

    def between_steps(step: int) -> bool:
        if step == 3:
            engine.engine.pool.kill(1)
        return True

    run, ppo_steps = _run_ppo_steps(engine, job, 5, between_steps=between_steps)
    assert ppo_steps == [0, 1, 2, 2, 3, 4]
    assert run.failure == "" and not run.stopped
    assert run.steps_done == job.state.next_step == 5 and run.summary.steps == 6
    assert any(e["event"] == "engine.resumed" and e["step"] == 2 for e in engine.events)


def test_a_step_that_fails_every_time_ends_the_job_with_a_failure(pool, tmp_path):
    """From step 2 on every step fails (as a slot's error does); each time the controller
    resumes from the checkpoint of step 2 and the step fails again. The loop gives up after
    ``RETRIES`` setbacks, saying why, with the two steps the job made."""
    engine, job = _engine(pool, tmp_path)
    real_step = job.step

    def step(unit_engine, plan, workload, loop_step):
        if job.state.next_step >= 2:
            raise SlotError("slot 2 failed: a deterministic error in the step")
        return real_step(unit_engine, plan, workload, loop_step)

    job.step = step
    run, ppo_steps = _run_ppo_steps(engine, job, 5, between_steps=lambda step: True)
    assert ppo_steps == [0, 1] + [None] * RETRIES
    assert run.steps_done == job.state.next_step == 2 and not run.stopped
    assert run.failure.startswith(f"{RETRIES} setbacks without getting past step 2; ")
    assert "step 2 failed: a slot failed during the step: slot 2 failed" in run.failure


def test_a_checkpoint_resumes_the_same_trajectory_in_another_layout(pool, tmp_path):
    engine, job = _engine(pool, tmp_path, dataclasses.replace(CONFIG, checkpoint_every=2))
    start = plan_by_hand(
        job.workload(),
        {"actor@training": (2, 1, 1), "critic@training": (1, 2, 1), "actor@generation": (2, 1, 1)},
        num_slots=SLOTS,
    )
    workload = job.workload()
    engine.start(start, workload)
    first = [engine.step(start, workload, s).extra["stats"] for s in range(4)]
    (job.checkpoint_root / "step-000004" / "COMMITTED").unlink()  # as if step 4's never finished
    other = plan_by_hand(
        workload,
        {"actor@training": (1, 2, 2), "critic@training": (1, 1, 2), "actor@generation": (1, 2, 1)},
        num_slots=SLOTS,
    )
    engine._release_all()
    engine.restart(other, workload)
    assert job.state.next_step == 2
    again = [engine.step(other, workload, s).extra["stats"] for s in (4, 5)]
    engine.stop()
    for got, want in zip(again, first[2:], strict=True):
        assert got["step"] == want["step"]
        assert got["mean_response_length"] == want["mean_response_length"]
        for key in ("mean_reward", "kl", "policy_loss", "value_loss"):
            assert got[key] == pytest.approx(want[key], rel=1e-3, abs=1e-5), key


def test_a_new_driver_on_the_same_job_directory_resumes_from_its_checkpoint(pool, tmp_path):
    """A driver lost with its process (a killed worker): the next one starts where the job's
    last committed checkpoint left it, not from step 0."""
    engine, job = _engine(pool, tmp_path)
    plan = plan_by_hand(job.workload(), {"actor@training": (2, 1, 1)}, num_slots=SLOTS)
    engine.start(plan, job.workload())
    first = [engine.step(plan, job.workload(), s).extra["stats"] for s in range(3)]
    engine.stop()  # the checkpoint of step 2 is committed; step 3's work is lost with the driver

    engine, job = _engine(pool, tmp_path)
    engine.start(plan, job.workload())
    report = engine.step(plan, job.workload(), 0)
    engine.stop()
    assert report.extra["ppo_step"] == 2
    assert report.extra["stats"]["mean_response_length"] == first[2]["mean_response_length"]
    assert any(e["event"] == "engine.resumed" and e["step"] == 2 for e in engine.events)


def test_a_revoked_then_granted_slot_takes_part_in_the_next_transition(pool, tmp_path):
    """Groups are made collectively by every process of the pool, the replacement of a revoked
    slot included, so that one granted back can join new groups (otherwise the processes'
    group counters disagree and the next group creation waits forever)."""
    from runtime.transition import Cluster, diff

    engine, job = _engine(pool, tmp_path)
    workload = job.workload()
    three = {"actor@training": (3, 1, 1), "critic@training": (1, 2, 1)}
    plan = plan_by_hand(workload, three, num_slots=SLOTS)
    engine.start(plan, workload)
    assert engine.step(plan, workload, 0).ok
    assert engine.revoke() == 3 and engine.lost_slots() == {3}
    assert engine.step(plan, workload, 1).ok  # new groups made while slot 3 is out
    assert engine.grant() == 3 and engine.lost_slots() == frozenset()
    four = plan_by_hand(
        workload, {"actor@training": (2, 2, 1), "critic@training": (1, 2, 2)}, num_slots=SLOTS
    )
    cpu = default_catalog().accelerator("cpu-slot")
    dag = diff(engine.units(), four, Cluster(accelerator=cpu, num_slots=SLOTS), workload)
    assert engine.transition(dag).ok
    report = engine.step(four, workload, 2)
    used = {s for us in engine.units().values() for u in us for s in u.slots}
    engine.stop()
    assert report.ok and report.extra["ppo_step"] == 2
    assert 3 in used


def test_a_step_without_the_state_fails_until_a_restart_brings_it_back(pool, tmp_path):
    """After a step failed part-way the units are gone: a step is a failed report naming the
    model-stage (not an error from deep inside the job), and a restart resumes from the
    checkpoint."""
    engine, job = _engine(pool, tmp_path)
    workload = job.workload()
    plan = plan_by_hand(workload, {"actor@training": (2, 1, 1)}, num_slots=SLOTS)
    engine.start(plan, workload)
    for step in range(2):
        assert engine.step(plan, workload, step).ok  # a checkpoint is committed at step 2
    engine._release_all()  # what a failed step leaves
    job.lost_state()
    report = engine.step(plan, workload, 2)
    assert not report.ok and report.failure == "actor@training: no units hold its state"
    engine.restart(plan, workload)
    report = engine.step(plan, workload, 3)
    engine.stop()
    assert report.ok and report.extra["ppo_step"] == 2


def test_a_slot_busy_with_a_long_call_is_not_taken_for_dead(pool, tmp_path):
    """Units built ahead run as a long call on their slots while the job probes the pool: those
    slots are skipped (their call reports a death itself), the others are asked as ever. The
    long call here waits for a file the test writes, so it cannot end on its own."""
    import time

    go = tmp_path / "go"

    def wait_for(ctx, *, path):
        while not os.path.exists(path):
            time.sleep(0.01)
        return ctx.rank

    pending = pool.start(wait_for, on=[3], path=str(go))
    assert pending.running() == {3}
    # Asked, slot 3 cannot answer while its call runs: a slot that does not answer in time is
    # busy, not dead (only an actor's death is), so it counts as alive either way.
    assert pool.alive(timeout_s=0.5) == [True] * SLOTS
    assert pool.alive(timeout_s=0.5, busy=pending.running()) == [True] * SLOTS
    assert pool.run(wait_for, on=[0], path=str(tmp_path)) == [0]  # others answer meanwhile
    go.write_text("")
    assert pending.wait() == [3] and pending.running() == frozenset()


def _folder_state(folder) -> dict:
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
    }


def test_checkpoints_are_written_whole_by_the_job_s_own_driver_only(pool, tmp_path):
    """Found by review: a second save of a committed step rewrote it in place (a crash then
    left a mix of two writers' files that resume trusted), a torn COMMITTED mark stopped every
    later driver at start, and a driver taken over mid-step still wrote its checkpoint."""
    from runtime.ppo import export
    from runtime.ppo.job import SupersededError

    current = {"driver": True}
    job = PpoRuntime(CONFIG, workdir=tmp_path / "job", still_current=lambda: current["driver"])
    engine = RayEngine(pool, checkpoint_dir=tmp_path / "restart", job=job)
    workload = job.workload()
    plan = plan_by_hand(workload, {"actor@training": (2, 1, 1)}, num_slots=SLOTS)
    engine.start(plan, workload)
    try:
        for s in range(2):
            assert engine.step(plan, workload, s).ok
        committed = job.checkpoint_root / "step-000002"
        before = _folder_state(committed)
        assert "COMMITTED" in before

        # 1. A save of the same step that dies part-way (after the units, before the mark)
        # leaves the committed one as it was, and nothing half-written beside it.
        def dies(path):
            raise OSError("the disk went away")

        job.save_state = dies
        with pytest.raises(OSError, match="disk went away"):
            job.save_checkpoint(engine.engine)
        del job.save_state
        assert _folder_state(committed) == before
        assert sorted(p.name for p in job.checkpoint_root.iterdir()) == ["step-000002"]

        # 2. A driver that was taken over writes neither a checkpoint nor an export.
        current["driver"] = False
        with pytest.raises(SupersededError):
            job.save_checkpoint(engine.engine)
        with pytest.raises(SupersededError):
            job.export(engine.engine)
        assert _folder_state(committed) == before and not job.export_root.exists()
        current["driver"] = True

        # 3. A newer checkpoint whose mark is torn is skipped: resume and export use step 2.
        torn = job.checkpoint_root / "step-000004"
        torn.mkdir()
        (torn / "COMMITTED").write_text('{"step": 4, "un')
        assert job.last_checkpoint().step == 2
        out = export.export_job_checkpoint(job.workdir, tmp_path / "out", dtype="float32")
        assert export.read_manifest(out)["source"]["step"] == 2
    finally:
        engine.stop()


def test_a_step_on_a_plan_whose_unit_is_gone_fails_instead_of_training_on_fewer(pool, tmp_path):
    """A slot revoked then granted back comes back empty. A step on the plan that names its
    training unit trained on the replicas left and reported success, so the controller never
    replanned (found by review; the simulated engine failed it)."""
    engine, job = _engine(pool, tmp_path)
    workload = job.workload()
    plan = plan_by_hand(workload, {"actor@training": (4, 1, 1)}, num_slots=SLOTS)
    engine.start(plan, workload)
    try:
        assert engine.step(plan, workload, 0).ok
        assert engine.revoke() == 3 and engine.grant() == 3
        report = engine.step(plan, workload, 1)
        assert not report.ok and "actor@training: the unit on slots [3] is gone" in report.failure
        assert job.state.next_step == 1  # no update was made
    finally:
        engine.stop()


def _started(pool, tmp_path):
    """A job started on the pool in the planner's default layouts: its engine, the job, the
    plan and the workload."""
    engine, job = _engine(pool, tmp_path)
    plan, workload = plan_by_hand(job.workload(), {}, num_slots=SLOTS), job.workload()
    engine.start(plan, workload)
    return engine, job, plan, workload


def test_a_checkpoint_that_cannot_be_written_fails_its_step_and_keeps_the_updated_units(
    pool, tmp_path
):
    """Every slot is alive: the folder cannot be written (a file in its place, as a full disk
    or a permission would). The step's update is whole; the step fails naming the folder, and
    the units stay, updated, for the next step (no restart, no step redone)."""
    engine, job, plan, workload = _started(pool, tmp_path)
    try:
        assert engine.step(plan, workload, 0).ok
        job.checkpoint_root.write_text("in the way")
        report = engine.step(plan, workload, 1)  # its update is made, then the save fails
        assert not report.ok and f"saving checkpoint {job.checkpoint_root}" in report.failure
        assert engine.lost_slots() == frozenset() and engine.engine.units
        assert job.state.next_step == 2
        job.checkpoint_root.unlink()
        assert engine.step(plan, workload, 2).ok  # the next step goes on from them
    finally:
        engine.stop()


def test_a_nan_reward_stops_the_step_before_it_trains_or_saves(pool, tmp_path):
    engine, job, plan, workload = _started(pool, tmp_path)
    try:
        assert engine.step(plan, workload, 0).ok
        before = {u.unit_id: engine.engine.checksum(u) for u in engine.engine.units.values()}
        job.reward = lambda prompt, response: float("nan")  # a reward model's bad score
        with pytest.raises(NonFiniteError, match=r"step 1: rewards is not finite for sequences"):
            engine.step(plan, workload, 1)  # step 1 would save the checkpoint step-000002
        after = {u.unit_id: engine.engine.checksum(u) for u in engine.engine.units.values()}
        assert after == before and job.last_checkpoint() is None
    finally:
        engine.stop()


def _damage(kind: str, folder):
    """Bit rot in a shard of the actor (64 bytes flipped mid-file), a shard cut short, or the
    driver's state cut short."""
    if kind == "state torn":
        state = folder / "state.json"
        state.write_text(state.read_text()[:100])
        return
    (shard,) = (folder / "actor_training").glob("*.distcp")
    data = bytearray(shard.read_bytes())
    if kind == "shard torn":
        shard.write_bytes(bytes(data[: len(data) // 3]))
        return
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0x5A for b in data[middle : middle + 64])
    shard.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def four_steps(pool, tmp_path_factory):
    """The folder of a job that made 4 steps, with the checkpoints of steps 2 and 4."""
    root = tmp_path_factory.mktemp("four-steps")
    engine, _, plan, workload = _started(pool, root)
    for s in range(4):
        assert engine.step(plan, workload, s).ok
    engine.stop()
    return root / "job"


@pytest.mark.parametrize("kind", ["bits flipped", "shard torn", "state torn"])
def test_a_damaged_newest_checkpoint_is_not_resumed_the_one_before_it_is(
    pool, four_steps, tmp_path, kind
):
    """The next driver of a job checks what it loads against the checksums the checkpoint was
    saved with (the bits-flipped shard loads without an error, and was resumed from), and
    falls back to the checkpoint before one it cannot use, naming why."""
    shutil.copytree(four_steps, tmp_path / "job")  # a job folder of its own to damage
    engine, job = _engine(pool, tmp_path)
    plan = plan_by_hand(job.workload(), {}, num_slots=SLOTS)
    _damage(kind, job.checkpoint_root / "step-000004")

    engine, job = _engine(pool, tmp_path)
    engine.start(plan, job.workload())
    try:
        assert job.state.next_step == 2 and engine.started_from == 2
        (unusable,) = [e for e in engine.events if e["event"] == "engine.checkpoint_unusable"]
        assert unusable["step"] == 4 and unusable["folder"].endswith("step-000004")
        if kind == "state torn":
            assert "state.json: unreadable driver state" in unusable["error"]
        if kind == "bits flipped":
            assert "actor@training" in unusable["error"] and "saved 0x" in unusable["error"]
        assert engine.step(plan, job.workload(), 0).extra["ppo_step"] == 2
    finally:
        engine.stop()

    _damage("bits flipped", job.checkpoint_root / "step-000002")
    engine, job = _engine(pool, tmp_path)
    with pytest.raises(UnusableCheckpointError, match=r"no committed checkpoint under .* step 4"):
        engine.start(plan, job.workload())
    engine.stop()


class _LoadThatKillsSlot1Once:
    """``runtime.emu.checkpoint`` as the engine sees it, but whose ``load_unit`` kills slot 1's
    process the first time it runs there (a flag file says it did)."""

    def __init__(self, flag):
        self.flag = str(flag)

    def __getattr__(self, name):
        if name != "load_unit":
            return getattr(checkpoint, name)
        flag = self.flag

        def load_unit(ctx, *, unit, path):
            from runtime.emu.checkpoint import load_unit as load

            if ctx.rank == 1 and not os.path.exists(flag):
                open(flag, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            return load(ctx, unit=unit, path=path)

        return load_unit


def test_a_slot_lost_while_a_restart_loads_is_replaced_and_the_load_made_again(
    pool, tmp_path, monkeypatch
):
    engine, job = _engine(pool, tmp_path)
    plan = plan_by_hand(job.workload(), {"actor@training": (2, 1, 1)}, num_slots=SLOTS)
    engine.start(plan, job.workload())
    try:
        for s in range(2):  # the checkpoint of step 2
            assert engine.step(plan, job.workload(), s).ok
        engine._release_all()  # as a failed update leaves the job: back to the checkpoint
        job.lost_state()
        monkeypatch.setattr(ray_engine, "checkpoint", _LoadThatKillsSlot1Once(tmp_path / "k"))
        engine.restart(plan, job.workload())
        assert (tmp_path / "k").exists()
        assert [e["event"] for e in engine.events].count("engine.restart_retried") == 1
        monkeypatch.undo()
        assert engine.step(plan, job.workload(), 2).extra["ppo_step"] == 2
    finally:
        engine.stop()


def test_a_slot_dying_after_the_last_step_does_not_fail_the_job_s_stop(pool, tmp_path):
    """The job made every step (and exported): a slot lost while it stops costs what it held,
    not the job's outcome. Last in this file: the pool's next user re-forms its group."""
    engine, _, plan, workload = _started(pool, tmp_path)
    assert engine.step(plan, workload, 0).ok
    engine.engine.pool.kill(1)
    engine.stop()
    assert not engine.engine.units
