"""PPO on the Ray engine: real slot actors, gloo, DTensor tensor parallelism, pipeline stages
exchanging activations point to point, data parallelism across units, and transitions between
steps that the job does not notice but for the pause."""

import dataclasses
import statistics
import time

import pytest
import torch

from runtime.emu.layout import assemble
from runtime.engine.ray_cluster import ray_connection
from runtime.engine.ray_engine import RayEngine
from runtime.engine.slots import SlotPool
from runtime.planner import default_catalog
from runtime.ppo import slot_work
from runtime.ppo.algorithm import PPOConfig
from runtime.ppo.job import PpoConfigError, PpoJobConfig, PpoRuntime, plan_by_hand
from runtime.transition import Cluster, diff

pytestmark = pytest.mark.ray

SLOTS = 6
CONFIG = PpoJobConfig(
    batch_size=16,
    max_new_tokens=8,
    warmup_steps=20,
    ppo=PPOConfig(kl_coef=0.01, epochs=1, minibatch_size=8),
)
CPU = default_catalog().accelerator("cpu-slot")

# Every model-stage's (dp, tp, pp); the transitions change the training units' layouts and, with
# them, the layouts of the stages rebuilt each step.
START = {
    "actor@training": (1, 2, 1),
    "critic@training": (1, 2, 1),
    "actor@generation": (2, 1, 1),
    "actor@inference": (1, 2, 1),
    "critic@inference": (2, 1, 1),
}
TP_TO_DP = {**START, "actor@training": (2, 1, 1), "actor@generation": (1, 2, 1)}
PIPELINE = {**TP_TO_DP, "critic@training": (1, 1, 2), "actor@inference": (1, 1, 2)}
SCALED = {
    **PIPELINE,
    "actor@training": (3, 1, 2),
    "critic@training": (3, 2, 1),
    "actor@generation": (3, 2, 1),
    "ref@inference": (3, 1, 1),
}


@pytest.fixture(scope="module")
def pool():
    with ray_connection(None, num_cpus=SLOTS):
        pool = SlotPool.create(SLOTS, call_timeout_s=120)
        yield pool
        pool.close()


@pytest.fixture
def runtime(pool, tmp_path):
    engines = []

    def make(config=CONFIG):
        job = PpoRuntime(config, workdir=tmp_path / f"job{len(engines)}")
        engine = RayEngine(pool, checkpoint_dir=tmp_path / "ckpt", job=job)
        engines.append(engine)
        return engine, job

    yield make
    for engine in engines:
        engine.stop()


def _plan(job, layouts, num_slots):
    return plan_by_hand(job.workload(), layouts, num_slots=num_slots)


def _move(engine, job, target):
    """Compile and run the transition from the units held now to ``target``."""
    cluster = Cluster(accelerator=CPU, num_slots=target.num_slots)
    dag = diff(engine.units(), target, cluster, job.workload(), tag=f"t{len(engine.events)}")
    outcome = engine.transition(dag)
    assert outcome.ok, outcome.failure
    return dag


def _state(engine):
    """Every training unit's logical state (parameters and Adam's) assembled on the driver."""
    out = {}
    for name, units in engine.units().items():
        for key, tensor in assemble(engine.engine.read(units[0])).items():
            out[f"{name}:{key}"] = tensor
    return out


def test_transitions_between_steps_keep_the_trajectory_and_the_state(runtime):
    workload_slots = {0: (START, 4), 2: (TP_TO_DP, 4), 3: (PIPELINE, 4), 5: (SCALED, 6)}
    steps = 7

    fixed_engine, fixed_job = runtime()
    plan = _plan(fixed_job, START, 4)
    fixed_engine.start(plan, fixed_job.workload())
    reports = [fixed_engine.step(plan, fixed_job.workload(), s) for s in range(steps)]
    fixed = [r.extra["stats"] for r in reports]
    # The derived units' workspaces are built once, before the first step's stages, and kept.
    assert set(reports[0].rebuild_seconds) == {"generation", "inference"}
    assert all(r.rebuild_seconds == {} for r in reports[1:])
    # The engine learns each stage's build time from the builds reported (halfway per report).
    defaults = {"generation": 1.0, "inference": 0.5}
    assert dict(fixed_engine.rebuild_s) == {
        stage: 0.5 * defaults[stage] + 0.5 * reports[0].rebuild_seconds[stage] for stage in defaults
    }
    fixed_params = fixed_job.parameters(fixed_engine.engine, "actor")
    fixed_engine.stop()

    engine, job = runtime()
    moved = []
    for step in range(steps):
        if step in workload_slots:
            layouts, num_slots = workload_slots[step]
            target = _plan(job, layouts, num_slots)
            if step == 0:
                engine.start(target, job.workload())
            else:
                before = _state(engine)
                dag = _move(engine, job, target)
                after = _state(engine)
                assert before.keys() == after.keys()
                # The logical state after the transition is the state before it, bit for bit.
                assert all(torch.equal(before[k], after[k]) for k in before), step
                moved.append(len(dag.nodes))
            plan = target
        if step == 4:
            # The scaled plan's new units on slots the running plan leaves idle are built now,
            # while this step runs on slots 0-3; the step after the transition waits for them.
            scaled = _plan(job, SCALED, 6)
            ahead = diff(
                engine.units(),
                scaled,
                Cluster(accelerator=CPU, num_slots=6),
                job.workload(),
                derived_from=plan,
            ).ahead
            idle = set(range(6)) - {s for ms in plan.model_stages for s in ms.slots}
            assert ahead and all(set(slots) <= idle for _, slots in ahead)
            # Those on slots 2-3 are left to the step after the transition.
            ahead = {(name, slots) for name, slots in ahead if set(slots) <= {4, 5}}
            units = {}
            for name, slots in sorted(ahead):
                units.setdefault(name, []).append(slots)
            engine.build_ahead(scaled, job.workload(), units)
        report = engine.step(plan, job.workload(), step)
        moved_stats = report.extra["stats"]
        # A step after a transition builds the derived units it changed, and no others.
        if step == 2:  # actor@generation went from dp 2 to tp 2; inference stayed
            assert set(report.rebuild_seconds) == {"generation"}
        if step in (1, 4):
            # Step 4 neither built nor waited for the units building on the idle slots.
            assert report.rebuild_seconds == {}
        if step == 4:
            # Still building, or waited for at the end of the step by its checkpoint (which
            # makes groups on every slot); either way after the step's own stages.
            assert job._ahead is not None or job.last_ahead
        if step == 5:  # the units built ahead are reported with those built now
            assert job._ahead is None and "inference" in report.rebuild_seconds
            built = {uid.partition("/")[0] + "@" + uid.rpartition("@")[2] for uid in job.last_ahead}
            assert built == {f"{name}@{'-'.join(map(str, slots))}" for name, slots in ahead}
            for uid, seconds in job.last_ahead.items():
                stage = uid.partition("/")[0].partition("@")[2]
                assert report.rebuild_seconds[stage] >= seconds
            # Generation grew from one tp-2 unit (slots 0-1, kept) to three: the one on slots
            # 4-5 was built ahead, the one on slots 2-3 was built while this step generated on
            # the other two, and joins from the next step.
            assert report.extra["generated_on"] == [
                "actor@generation/2x1@0-1",
                "actor@generation/2x1@4-5",
            ]
        if step == 6:
            assert len(report.extra["generated_on"]) == 3 and report.rebuild_seconds == {}
        reference = fixed[step]
        assert moved_stats["mean_response_length"] == reference["mean_response_length"], step
        for key in ("mean_reward", "kl", "policy_loss", "value_loss", "entropy"):
            assert moved_stats[key] == pytest.approx(reference[key], rel=1e-3, abs=1e-5), (
                step,
                key,
            )
    assert len(moved) == 3 and all(moved)
    # Four layouts later, the actor's weights are those of the run that never moved.
    params = job.parameters(engine.engine, "actor")
    for key, tensor in fixed_params.items():
        torch.testing.assert_close(params[key], tensor, rtol=1e-4, atol=1e-5)
    # Units now span all six slots: the scale from 4 to 6 really happened.
    assert {s for us in engine.units().values() for u in us for s in u.slots} == set(range(6))


def test_units_built_ahead_for_a_move_that_never_comes_are_freed(runtime):
    """A proposal rejected (or a staged move dropped) leaves units built ahead on idle slots:
    once their builds end, the next step frees them."""
    engine, job = runtime()
    plan = _plan(job, START, 4)
    engine.start(plan, job.workload())
    engine.step(plan, job.workload(), 0)
    scaled = _plan(job, SCALED, 6)
    cluster = Cluster(accelerator=CPU, num_slots=6)
    ahead = diff(engine.units(), scaled, cluster, job.workload(), derived_from=plan).ahead
    units = {}
    for name, slots in sorted(ahead):
        units.setdefault(name, []).append(slots)
    idle = sorted({s for _, slots in ahead for s in slots})
    engine.build_ahead(scaled, job.workload(), units)
    engine.drop_ahead()
    deadline = time.monotonic() + 120
    while job.building_ahead() and time.monotonic() < deadline:
        time.sleep(0.05)
    held = engine.engine.pool.run(slot_work.workspaces, on=idle)
    assert any(held)  # built, and still held
    engine.step(plan, job.workload(), 1)
    assert engine.engine.pool.run(slot_work.workspaces, on=idle) == [[] for _ in idle]
    # The running plan's own workspaces stay.
    assert engine.engine.pool.run(slot_work.workspaces, on=[0])[0]


def test_smaller_micro_batches_and_generation_waves_make_the_same_update(runtime):
    """A plan may train and score in smaller micro-batches than the workload's, and generate in
    waves (to fit memory): each training slot accumulates the gradients of one-row
    micro-batches, each weighted by its share of the tokens, in the data-parallel actor (pp 1)
    and the pipelined critic (pp 2); inference scores one row at a time, pipelined or not; and
    generation decodes one prompt at a time. The steps' statistics and the weights come out as
    the whole batch's do."""

    def run(micro_batch: int):
        engine, job = runtime()
        plan = _plan(job, PIPELINE, 4)
        if micro_batch:
            plan = dataclasses.replace(
                plan,
                model_stages=tuple(
                    dataclasses.replace(ms, micro_batch=micro_batch) for ms in plan.model_stages
                ),
            )
        engine.start(plan, job.workload())
        stats = [engine.step(plan, job.workload(), s).extra["stats"] for s in range(2)]
        return stats, job.parameters(engine.engine, "actor")

    assert CONFIG.ppo.minibatch_size > 1  # more than one row per unit and minibatch
    (whole, whole_params), (rows, rows_params) = run(0), run(1)
    for a, b in zip(whole, rows, strict=True):
        assert a["mean_response_length"] == b["mean_response_length"]
        for key in ("policy_loss", "value_loss", "entropy", "kl"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), key
    for key, tensor in whole_params.items():
        torch.testing.assert_close(rows_params[key], tensor, rtol=1e-4, atol=1e-5)


def test_a_training_unit_with_no_rows_of_a_minibatch_joins_the_update_with_zero_gradients(
    runtime,
):
    """Batch 9 in minibatches of 4 leaves a last minibatch of one row: of two data-parallel
    training units, one gets none. It runs no forward, backward or pipeline schedule, but takes
    part in the gradients' sum and norm with zeros, so the update is the one-unit update (the
    actor on one slot per unit, the critic pipelined over two)."""
    config = dataclasses.replace(
        CONFIG,
        batch_size=9,
        max_new_tokens=4,
        warmup_steps=2,
        ppo=PPOConfig(kl_coef=0.01, epochs=1, minibatch_size=4),
    )

    def run(layouts: dict):
        engine, job = runtime(config)
        plan = _plan(job, layouts, 4)
        engine.start(plan, job.workload())
        report = engine.step(plan, job.workload(), 0)
        assert report.ok, report.failure
        return report.extra["stats"], {
            role: job.parameters(engine.engine, role) for role in ("actor", "critic")
        }

    one, one_params = run({"actor@training": (1, 1, 1), "critic@training": (1, 1, 1)})
    two, two_params = run({"actor@training": (2, 1, 1), "critic@training": (2, 1, 2)})
    assert two["mean_response_length"] == one["mean_response_length"]
    for key in ("policy_loss", "value_loss", "entropy", "clip_fraction"):
        assert two[key] == pytest.approx(one[key], rel=1e-3, abs=1e-5), key
    for role, params in one_params.items():
        for key, tensor in params.items():
            torch.testing.assert_close(
                two_params[role][key], tensor, rtol=1e-4, atol=1e-5, msg=f"{role}:{key}"
            )


def test_responses_grow_under_the_length_reward(runtime):
    config = dataclasses.replace(
        CONFIG, max_new_tokens=12, ppo=PPOConfig(kl_coef=0.01, epochs=2, minibatch_size=8)
    )
    engine, job = runtime(config)
    layouts = {**START, "ref@inference": (2, 1, 2), "reward@inference": (1, 2, 2)}
    plan = _plan(job, layouts, 4)
    engine.start(plan, job.workload())
    stats = [engine.step(plan, job.workload(), s).extra["stats"] for s in range(8)]
    first = statistics.fmean(s["mean_response_length"] for s in stats[:2])
    last = statistics.fmean(s["mean_response_length"] for s in stats[-2:])
    assert last > first + 1
    assert statistics.fmean(s["mean_reward"] for s in stats[-2:]) > statistics.fmean(
        s["mean_reward"] for s in stats[:2]
    )


def test_a_layout_the_model_cannot_take_is_refused_before_any_slot_is_touched(runtime):
    engine, job = runtime()
    # tiny-sft has 4 attention heads: tensor parallelism over 3 slots cannot split them.
    plan = _plan(job, {**START, "actor@training": (1, 3, 1)}, 4)
    with pytest.raises(PpoConfigError, match=r"plan\.actor@training: .*tp=3"):
        engine.start(plan, job.workload())
    assert engine.units() == {}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"tasks": ()}, "tasks"),
        ({"tasks": ("copy", "poetry")}, "tasks"),
        ({"reward": "vibes"}, "reward"),
        ({"model": "gpt-9"}, "model"),
        ({"batch_size": 4}, "ppo.minibatch_size"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_bad_job_configuration_names_the_field(tmp_path, change, field):
    with pytest.raises(PpoConfigError, match=rf"^{field}"):
        PpoRuntime(dataclasses.replace(CONFIG, **change), workdir=tmp_path)


def test_a_checkpoint_whose_shapes_do_not_match_is_refused(tmp_path):
    from runtime.ppo.model import build_model
    from tests.runtime.ppo.test_weights import _write_safetensors

    other = build_model(default_catalog().model("tiny-llama"), scalar_head=False, seed=0)
    path = tmp_path / "model.safetensors"
    _write_safetensors(path, dict(other.state_dict()))
    with pytest.raises(PpoConfigError, match=r"^init_from: model\.embed_tokens\.weight has shape"):
        PpoRuntime(dataclasses.replace(CONFIG, init_from=str(path)), workdir=tmp_path / "job")


def test_a_checkpoint_with_rope_frequency_buffers_starts_the_actor_from_its_weights(tmp_path):
    """Older Hugging Face Llama exports store each layer's ``rotary_emb.inv_freq``: derived
    buffers, not weights. The job accepts the file and starts the actor (and the reference) from
    its weights, skipping them, as ``load_weights`` does."""
    from runtime.ppo.model import build_model
    from tests.runtime.ppo.test_weights import _write_safetensors

    model = default_catalog().model(CONFIG.model)
    state = dict(build_model(model, scalar_head=False, seed=3).state_dict())
    frequencies = {
        f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8)
        for i in range(model.num_layers)
    }
    path = tmp_path / "model.safetensors"
    _write_safetensors(path, {**state, **frequencies})
    config = dataclasses.replace(CONFIG, init_from=str(path), warmup_steps=0)
    weights = PpoRuntime(config, workdir=tmp_path / "job").initial_weights()
    for role in ("actor", "ref"):
        started = torch.load(weights[role], weights_only=True)
        assert started.keys() == state.keys()
        for key, tensor in state.items():
            assert torch.equal(started[key], tensor), (role, key)


def test_a_checkpoint_with_a_tensor_the_model_lacks_is_refused(tmp_path):
    """A tensor the model has no place for (not a derived buffer) is refused by name when the job
    is made, before any slot is created (not when the slots load the actor)."""
    from runtime.ppo.model import build_model
    from tests.runtime.ppo.test_weights import _write_safetensors

    state = dict(
        build_model(default_catalog().model(CONFIG.model), scalar_head=False, seed=0).state_dict()
    )
    state["model.layers.0.mlp.gate_proj.bias"] = torch.zeros(8)
    path = tmp_path / "model.safetensors"
    _write_safetensors(path, state)
    with pytest.raises(
        PpoConfigError, match=r"^init_from: .* 'model\.layers\.0\.mlp\.gate_proj\.bias'"
    ):
        PpoRuntime(dataclasses.replace(CONFIG, init_from=str(path)), workdir=tmp_path / "job")
