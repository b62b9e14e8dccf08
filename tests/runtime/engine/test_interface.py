"""One suite, both engines: the simulated cluster honours the engine interface the Ray engine
honours (placing a plan's units, transitions to a target, checkpoint/restart onto another plan).

The Ray engine runs on 6 CPU slots (Ray actors standing in for GPUs, which this machine lacks)
joined by gloo; the simulated one on a 6-slot trace. The PPO step itself is covered per engine
(the simulated step here; the Ray one with the PPO runtime)."""

import pytest

from runtime.engine.ray_cluster import ray_connection
from runtime.engine.ray_engine import RayEngine
from runtime.engine.sim import PROBE_SETUP_S, STALL_S, SimulatedEngine
from runtime.engine.slots import SlotPool
from runtime.engine.traces import Trace
from runtime.planner import default_catalog
from runtime.planner.plan import Layout, Plan
from runtime.planner.probes import Probe, link_probes, probes_for
from runtime.planner.workload import PpoWorkload
from runtime.transition import Cluster, diff
from runtime.transition.units import bytes_on, units_of
from runtime.twin import ClusterTwin, device, restart_seconds

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
        return SimulatedEngine(trace, ACC, twin=ClusterTwin.draw(device(ACC.name), 1), seed=1)
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
    the Ray engine's processes; the cluster twin's links, alone, on the simulated one)."""
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
    engine = SimulatedEngine(trace, ACC, twin=ClusterTwin.draw(device(ACC.name), 1), seed=1)
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
    twin = ClusterTwin.draw(device(ACC.name), 1, interference=0.0)  # the same links at any clock
    one = SimulatedEngine(trace, ACC, twin=twin, seed=5)
    other = SimulatedEngine(trace, ACC, twin=twin, seed=5)
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
        trace,
        ACC,
        twin=ClusterTwin.draw(device(ACC.name), 1),
        seed=1,
        checkpoint_every=checkpoint_every,
    )
    engine.start(FIRST, WORKLOAD)
    return engine


def _state_bytes(plan: Plan) -> float:
    """The persistent state a restart onto ``plan`` saves and loads."""
    return sum(sum(bytes_on(u).values()) for us in units_of(plan, WORKLOAD).values() for u in us)


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
    # What a restart of an intact job costs: the twin's fixed part, saving and loading the state.
    intact = _simulated(((0, 64.0),))
    assert intact.restart(FIRST, WORKLOAD) == pytest.approx(
        restart_seconds(intact.twin, _state_bytes(FIRST), SLOTS, passes=2)
    )
    seconds = engine.restart(FIRST, WORKLOAD)
    # Here nothing is left to save, only the checkpoint to load; steps 3 and 4 came after the
    # checkpoint of step 2.
    redo = took[3].seconds + took[4].seconds
    expected = restart_seconds(engine.twin, _state_bytes(FIRST), SLOTS, passes=1) + redo
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
    state = _state_bytes(FIRST)
    assert with_copies == pytest.approx(restart_seconds(kept.twin, state, SLOTS, passes=2))
    engine._lost.update({2, 3})  # as the trace's revocation would leave them
    seconds = engine.restart(FIRST, WORKLOAD)
    load_only = restart_seconds(engine.twin, state, SLOTS, passes=1)
    expected = load_only + took[3].seconds + took[4].seconds
    assert seconds == pytest.approx(expected)
    # Loading once costs less than saving and loading: the fixed part, and half the trips.
    fixed = engine.twin.device.restart_s
    assert load_only - fixed == pytest.approx((with_copies - fixed) / 2)


def test_checkpoint_every_is_checked():
    with pytest.raises(ValueError, match="checkpoint_every: must be at least 1"):
        _simulated(((0, 64.0),), checkpoint_every=0)


def test_the_twin_is_not_the_planners_model_at_any_efficiencies():
    """Calibration learns one efficiency per class from the running plan's steps, which then
    prices that plan's steps close to what the twin plays; but the twin's physics is not the
    planner's cost formula at some efficiencies (its decode batches sequences as a serving
    engine does, its collectives run over the links the units span), so what prices one
    generation layout misprices another, and a fit over both layouts' steps still errs on one."""
    from runtime.planner.calibration import Calibrator
    from runtime.planner.search import stage_prices
    from tests.support.plans import LLAMA_8B, generation_over

    acc = CATALOG.accelerator("h100-sxm")
    trace = Trace(
        name="c", steps=8, accelerator=acc.name, gpus=16, gen_len=((0, 1024.0),), len_sigma=0.0
    )
    twin = ClusterTwin.draw(device(acc.name), 2, interference=0.0, noise=0.0)
    tp2, tp4 = generation_over(16, 2), generation_over(16, 4)
    engines = {}
    for plan in (tp2, tp4):
        engines[plan] = SimulatedEngine(trace, acc, twin=twin, seed=0)
        engines[plan].start(plan, LLAMA_8B)
    played = {plan: engines[plan].step(plan, LLAMA_8B, 0) for plan in engines}

    def error(plan, calibrator=None, stage="generation") -> float:
        """How far the planner's price of ``plan``'s stage is from what the twin played."""
        efficiency = calibrator.efficiency() if calibrator else None
        price = stage_prices(plan, LLAMA_8B, acc, efficiency=efficiency)[stage]
        return price / played[plan].stage_seconds[stage] - 1

    def price_error(plan, calibrator=None) -> float:
        return (
            sum(
                (error(plan, calibrator, stage) + 1) * played[plan].stage_seconds[stage]
                for stage in played[plan].stage_seconds
            )
            / played[plan].seconds
            - 1
        )

    on_tp2 = Calibrator()
    for step in range(1, 6):
        for sample in engines[tp2].step(tp2, LLAMA_8B, step).samples:
            on_tp2.observe_sample(sample)
    # The catalog's efficiencies misprice the running plan; the ones learned from its steps
    # price it close to the twin ...
    assert abs(price_error(tp2)) > 0.10
    assert abs(price_error(tp2, on_tp2)) < 0.03 and abs(error(tp2, on_tp2)) < 0.03
    # ... but not generation over another tensor-parallel degree.
    assert abs(error(tp4, on_tp2)) > 0.10
    on_both = Calibrator()
    for step in range(1, 6):
        for plan in (tp2, tp4):
            for sample in engines[plan].step(plan, LLAMA_8B, step).samples:
                on_both.observe_sample(sample)
    assert max(abs(error(tp2, on_both)), abs(error(tp4, on_both))) > 0.05
