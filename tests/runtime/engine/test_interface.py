"""One suite, both engines: the simulated cluster honours the engine interface the Ray engine
honours (placing a plan's units, transitions to a target, checkpoint/restart onto another plan).

The Ray engine runs on 6 CPU slots (Ray actors standing in for GPUs, which this machine lacks)
joined by gloo; the simulated one on a 6-slot trace. The PPO step itself is covered per engine
(the simulated step here; the Ray one with the PPO runtime)."""

import pytest

from runtime.engine.ray_cluster import ray_connection
from runtime.engine.ray_engine import RayEngine
from runtime.engine.sim import PROBE_SETUP_S, STALL_S, SimulatedEngine, TrueModel
from runtime.engine.slots import SlotPool
from runtime.engine.traces import Trace
from runtime.planner import default_catalog
from runtime.planner.plan import Layout, Plan
from runtime.planner.probes import Probe, link_probes, probes_for
from runtime.planner.workload import PpoWorkload
from runtime.transition import Cluster, diff

CATALOG = default_catalog()
ACC = CATALOG.accelerator("cpu-slot")
WORKLOAD = PpoWorkload.for_model(CATALOG.model("tiny-llama"))
NAMES = [ms.name for ms in WORKLOAD.model_stages()]
SLOTS = 6


def _plan(actor, critic) -> Plan:
    layouts = {n: (Layout(dp=1, tp=1, pp=1), ((0,),)) for n in NAMES}
    layouts["actor@training"], layouts["critic@training"] = actor, critic
    return Plan.of_units(accelerator=ACC.name, num_slots=SLOTS, layouts=layouts)


FIRST = _plan((Layout(dp=1, tp=2, pp=1), ((0, 1),)), (Layout(dp=2, tp=1, pp=1), ((2,), (3,))))
SECOND = _plan((Layout(dp=2, tp=1, pp=1), ((0,), (1,))), (Layout(dp=1, tp=2, pp=1), ((4, 5),)))
THIRD = _plan((Layout(dp=1, tp=1, pp=2), ((2, 3),)), (Layout(dp=1, tp=2, pp=1), ((0, 1),)))


@pytest.fixture(scope="module")
def ray_pool():
    with ray_connection(None, num_cpus=SLOTS):
        pool = SlotPool.create(SLOTS, call_timeout_s=60)
        try:
            yield pool
        finally:
            pool.close()


@pytest.fixture(params=["simulated", pytest.param("ray", marks=pytest.mark.ray)])
def engine(request, tmp_path):
    if request.param == "simulated":
        trace = Trace(name="flat", steps=10, accelerator=ACC.name, gpus=SLOTS, gen_len=((0, 64.0),))
        return SimulatedEngine(trace, ACC, truth=TrueModel.draw(1), seed=1)
    return RayEngine(request.getfixturevalue("ray_pool"), checkpoint_dir=tmp_path)


def _shape(units) -> dict:
    return {
        name: sorted((u.layout.tp, u.layout.pp, u.slots) for u in us) for name, us in units.items()
    }


def _expected(plan: Plan) -> dict:
    return {
        name: sorted(
            (plan.model_stage(name).layout.tp, plan.model_stage(name).layout.pp, tuple(u))
            for u in plan.model_stage(name).units
        )
        for name in ("actor@training", "critic@training")
    }


def test_an_engine_places_transitions_and_restarts(engine, tmp_path):
    engine.start(FIRST, WORKLOAD)
    assert engine.pool_size() == SLOTS and not engine.lost_slots()
    assert _shape(engine.units()) == _expected(FIRST)

    cluster = Cluster(accelerator=ACC, num_slots=SLOTS, capacity_bytes=(1e12,) * SLOTS)
    dag = diff(engine.units(), SECOND, cluster, WORKLOAD, derived_from=FIRST)
    before = engine.now()
    outcome = engine.transition(dag)
    assert outcome.ok and outcome.seconds > 0 and not outcome.failure
    assert outcome.simulated == engine.simulated
    assert _shape(engine.units()) == _expected(SECOND)
    assert engine.now() >= before

    seconds = engine.restart(THIRD, WORKLOAD)
    assert seconds > 0
    assert _shape(engine.units()) == _expected(THIRD)
    # The Ray engine saved into a folder of that restart's own, under its checkpoint folder
    # (``tmp_path``), and removed it once loaded.
    assert list(tmp_path.iterdir()) == []


def test_an_engine_times_each_probe_alone_and_leaves_the_units_be(engine):
    """Calibration probes: each communication class's collective timed on its slots (gloo on
    the Ray engine's processes; the true model's, a little optimistic, on the simulated one)."""
    engine.start(FIRST, WORKLOAD)
    probes = probes_for(WORKLOAD, ACC, range(SLOTS))  # one node: the four intra classes
    assert len(probes) == 4 and max(len(p.slots) for p in probes) == 4
    before = engine.now()
    report = engine.run_probes(probes)
    assert not report.failure and report.simulated == engine.simulated
    assert len(report.measured_s) == len(probes)
    for probe, runs in zip(probes, report.measured_s, strict=True):
        assert len(runs) == probe.repeats and min(runs) > 0
    assert report.seconds >= sum(sum(runs) for runs in report.measured_s)
    assert engine.now() - before >= report.seconds
    assert _shape(engine.units()) == _expected(FIRST)
    # The links' gauge, timed again later in the job, on the groups made the first time (the
    # Ray engine keeps them; the simulated one charges their set-up only once, as that costs).
    [gauge] = link_probes(WORKLOAD, ACC, range(SLOTS))
    again = engine.run_probes([gauge])
    assert not again.failure and len(again.measured_s[0]) == gauge.repeats
    assert min(again.measured_s[0]) > 0
    if engine.simulated:
        assert again.seconds < PROBE_SETUP_S < report.seconds
    with pytest.raises(ValueError, match=rf"probes\[0\]\.slots: slot {SLOTS} is not a live slot"):
        engine.run_probes([Probe(op_class="pp_p2p:intra", slots=(0, SLOTS), nbytes=1024)])


def test_the_simulated_step_is_labelled_and_calibratable():
    trace = Trace(name="flat", steps=10, accelerator=ACC.name, gpus=SLOTS, gen_len=((0, 64.0),))
    engine = SimulatedEngine(trace, ACC, truth=TrueModel.draw(1), seed=1)
    engine.start(FIRST, WORKLOAD)
    report = engine.step(FIRST, WORKLOAD, 0)
    assert report.ok and report.simulated and report.seconds > 0
    assert report.samples and all(
        s.measured_s > 0 and s.terms and min(s.terms.values()) > 0 for s in report.samples
    )
    assert abs(report.gen_len - 64) / 64 < 0.1
    assert engine.now() == pytest.approx(report.seconds)


def test_a_step_draws_the_same_noise_whatever_ran_before_it():
    """Two policies compared on one trace and seed see the same generated lengths and the same
    model-stage noise at each step, however their plans and transitions differ (one stream of
    draws per step; found by review: one shared stream made the lengths diverge once the plans
    did, and the comparison measured the noise)."""
    trace = Trace(name="flat", steps=10, accelerator=ACC.name, gpus=SLOTS, gen_len=((0, 64.0),))
    truth = TrueModel.draw(1, interference=0.0)  # the same efficiencies at any clock
    one = SimulatedEngine(trace, ACC, truth=truth, seed=5)
    other = SimulatedEngine(trace, ACC, truth=truth, seed=5)
    one.start(FIRST, WORKLOAD)
    other.start(SECOND, WORKLOAD)
    for step in range(3):  # a different history: other steps, on another plan
        one.step(FIRST, WORKLOAD, step)
    a, b = one.step(FIRST, WORKLOAD, 3), other.step(SECOND, WORKLOAD, 3)
    assert a.gen_len == b.gen_len
    assert a.stage_seconds["inference"] == pytest.approx(b.stage_seconds["inference"])
    assert other.step(SECOND, WORKLOAD, 4).gen_len != b.gen_len  # and each step its own


def _simulated(gen_len, *, checkpoint_every=3) -> SimulatedEngine:
    trace = Trace(name="oom", steps=10, accelerator=ACC.name, gpus=SLOTS, gen_len=gen_len)
    engine = SimulatedEngine(
        trace, ACC, truth=TrueModel.draw(1), seed=1, checkpoint_every=checkpoint_every
    )
    engine.start(FIRST, WORKLOAD)
    return engine


def test_an_out_of_memory_step_loses_the_state_back_to_the_last_checkpoint():
    """As on the Ray engine, where a step that fails part-way leaves every unit mid-update: the
    simulated job's state is gone, no step runs until a restart, and the restart loads the last
    checkpoint (every 3 steps here) and does the steps since it again."""
    engine = _simulated(((0, 64.0), (4, 64.0), (5, 10_000.0)))
    took = [engine.step(FIRST, WORKLOAD, s) for s in range(5)]
    assert all(r.ok for r in took)
    failed = engine.step(FIRST, WORKLOAD, 5)
    assert not failed.ok and failed.failure.startswith("out of memory")
    assert engine.units() == {}
    again = engine.step(FIRST, WORKLOAD, 6)
    assert not again.ok and again.failure.endswith("no units hold its state (simulated)")
    assert again.seconds == STALL_S  # the job waits: no step is free
    # What a restart of an intact job costs: the fixed part, saving and loading the state.
    intact = _simulated(((0, 64.0),))
    saved_and_loaded = intact.restart(FIRST, WORKLOAD) - intact.truth.restart_fixed_s
    seconds = engine.restart(FIRST, WORKLOAD)
    # Here nothing is left to save; steps 3 and 4 came after the checkpoint of step 2.
    redo = took[3].seconds + took[4].seconds
    expected = engine.truth.restart_fixed_s + saved_and_loaded / 2 + redo
    assert seconds == pytest.approx(expected)
    assert _shape(engine.units()) == _expected(FIRST)
    assert engine.step(FIRST, WORKLOAD, 7).ok is False  # still 10,000 tokens: it cannot fit
    # The restart committed no checkpoint: steps 3 and 4 are lost, and done, once more.
    assert engine.restart(FIRST, WORKLOAD) == pytest.approx(expected)


def test_a_restart_without_an_intact_copy_redoes_the_steps_since_the_checkpoint():
    """Slots 2 and 3 are lost, as a revocation leaves them: both of the critic's units go with
    them, so its state comes from the checkpoint of step 2, and steps 3 and 4 are done again."""
    engine = _simulated(((0, 64.0),))
    took = [engine.step(FIRST, WORKLOAD, s) for s in range(5)]
    kept = _simulated(((0, 64.0),))
    for step in range(5):
        kept.step(FIRST, WORKLOAD, step)
    with_copies = kept.restart(FIRST, WORKLOAD)  # every unit intact: saved, then loaded
    engine._lost.update({2, 3})  # as the trace's revocation would leave them
    seconds = engine.restart(FIRST, WORKLOAD)
    load_only = (with_copies - engine.truth.restart_fixed_s) / 2
    expected = engine.truth.restart_fixed_s + load_only + took[3].seconds + took[4].seconds
    assert seconds == pytest.approx(expected)


def test_checkpoint_every_is_checked():
    with pytest.raises(ValueError, match="checkpoint_every: must be at least 1"):
        _simulated(((0, 64.0),), checkpoint_every=0)


def test_the_true_model_is_not_the_planners_at_any_efficiencies():
    """Calibration learns one efficiency per class; the simulated truth also has what that form
    lacks (an eager step's kernel launches, per layer and micro-batch, which tensor parallelism
    does not divide as it divides the weights each rank streams), so the weight-read efficiency
    that prices one layout's micro-batches exactly still misprices a wider layout's: smaller
    micro-batches more. A fit over both layouts must err on both."""
    from runtime.planner.cost import DEFAULT_EFFICIENCY, predict
    from runtime.planner.shapes import LayoutShape

    acc = CATALOG.accelerator("h100-sxm")
    workload = PpoWorkload.for_model(CATALOG.model("llama-3.1-8b"), gen_len=1024, micro_batch=4)
    truth = TrueModel.draw(2, interference=0.0)
    ms = next(m for m in workload.model_stages() if m.name == "actor@training")

    def excess(weight_read: float, tp: int, micro_batch: int) -> float:
        layout = Layout(dp=8 // tp, tp=tp, pp=1)
        shape = LayoutShape.of_layout(ms, workload, acc, layout, micro_batch)
        efficiency = {**DEFAULT_EFFICIENCY, **truth.efficiency, "weight_read": weight_read}
        planned = float(predict(shape, num_slots=8, efficiency=efficiency)[0][0])
        return truth.seconds(shape, num_slots=8, at_s=0.0) / planned - 1

    low, high = 0.01, 1.0  # the excess grows with the efficiency the planner assumes
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (low, middle) if excess(middle, 1, 1) > 0 else (middle, high)
    assert abs(excess(middle, 1, 1)) < 1e-9 and abs(excess(middle, 1, 4)) < 1e-6
    assert 0.01 < excess(middle, 4, 4) < excess(middle, 4, 1)
