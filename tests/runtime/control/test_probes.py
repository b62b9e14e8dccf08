"""The controller's calibration probes on the simulated cluster: each communication class timed
alone before plans are weighed, at the start and when the pool first spans another node."""

import dataclasses
import itertools

import pytest

from runtime.control import Controller, JobPolicy, PolicyError, run_job
from runtime.engine.sim import PROBE_SETUP_S, SimulatedEngine
from runtime.engine.traces import Trace
from runtime.planner import PpoWorkload, default_catalog
from runtime.planner.calibration import Calibrator
from runtime.planner.probes import LINK_GAUGES, PROBED_CLASSES, link_probes, probes_for
from runtime.twin import ClusterTwin, Link, device, probe_seconds

CATALOG = default_catalog()
ACC = CATALOG.accelerator("a100-80gb")
WORKLOAD = PpoWorkload.for_model(CATALOG.model("llama-3.1-8b"), gen_len=2048)


def _pcie_twin() -> ClusterTwin:
    """Links inside a node at an eighth of NVLink's bandwidth: PCIe-class nodes catalogued as
    SXM."""
    sxm = device(ACC.name)
    intra = Link(bus_bytes_per_s=sxm.intra.bus_bytes_per_s / 8, latency_s=sxm.intra.latency_s)
    return ClusterTwin.draw(dataclasses.replace(sxm, intra=intra), 13, interference=0.0, noise=0.0)


def _alone(twin: ClusterTwin, op_class: str, *, at_s: float = 0.0) -> float:
    """The efficiency a probe of ``op_class`` on 16 slots measures on ``twin`` at ``at_s`` (no
    noise): the cost model's ideal seconds over the seconds the twin's links take for it alone."""
    [probe] = [p for p in probes_for(WORKLOAD, ACC, range(16)) if p.op_class == op_class]
    took = probe_seconds(twin, probe.pattern, probe.slots, probe.nbytes, at_s=at_s)
    return probe.ideal_s(ACC) / took


def _run(policy: JobPolicy, *, gpus=16, pool=(), steps=30, calibrator=None, engine=SimulatedEngine):
    trace = Trace(
        name="flat", steps=steps, accelerator=ACC.name, gpus=gpus, gen_len=((0, 2048.0),), pool=pool
    )
    engine = engine(trace, ACC, twin=_pcie_twin(), seed=2)
    controller = Controller(WORKLOAD, ACC, policy, calibrator=calibrator)
    return controller, run_job(engine, controller, steps)


def _of(controller, kind):
    return [e for e in controller.events if e["event"] == kind]


def test_a_job_probes_its_links_first_and_runs_shorter_for_it():
    probed, with_probes = _run(JobPolicy())
    unprobed, without = _run(JobPolicy(calibration_probes=False))
    kinds = [e["event"] for e in probed.events]
    assert kinds.index("control.probes") < kinds.index("control.plan")  # before plans are weighed
    [probes] = _of(probed, "control.probes")
    assert probes["simulated"] and not probes["failure"] and probes["step"] == 0
    # 16 slots, two nodes: every probed class, each measured as the twin's links run it alone
    # (no noise; an efficiency is capped at 1)
    assert set(probes["efficiency"]) == set(PROBED_CLASSES)
    twin = _pcie_twin()
    for op_class, value in probes["efficiency"].items():
        assert value == pytest.approx(min(1.0, _alone(twin, op_class)), rel=1e-9)
    # the slow links inside a node measured slow: below what the same class measures across
    assert probes["efficiency"]["pp_p2p:intra"] < probes["efficiency"]["pp_p2p:inter"]
    assert probes["slots"]["pp_p2p:inter"] == [0, 8]
    # The first plan already knows the links inside a node are slow: it is not the one the
    # catalog's figures choose, and the whole run, probes included, takes less time.
    first = {e["plan"]["num_slots"]: e["plan"] for e in _of(probed, "control.plan")}
    unprobed_first = {e["plan"]["num_slots"]: e["plan"] for e in _of(unprobed, "control.plan")}
    assert first != unprobed_first
    assert with_probes.probe_seconds > 0 and without.probe_seconds == 0
    assert with_probes.seconds < without.seconds
    assert _of(unprobed, "control.probes") == []


def test_the_step_loop_accounts_for_the_probes_time():
    _, summary = _run(JobPolicy(), steps=4)
    assert summary.probe_seconds > 0
    assert summary.seconds == pytest.approx(
        summary.step_seconds
        + summary.transition_seconds
        + summary.restart_seconds
        + summary.probe_seconds
    )


def test_a_pool_that_first_spans_another_node_has_its_new_links_probed_before_the_replan():
    controller, _ = _run(JobPolicy(), gpus=8, pool=((600.0, 16),), steps=12)
    first, second = _of(controller, "control.probes")
    assert set(first["efficiency"]) == {c for c in PROBED_CLASSES if c.endswith(":intra")}
    assert set(second["efficiency"]) == {c for c in PROBED_CLASSES if c.endswith(":inter")}
    assert second["step"] > 0
    kinds = [e["event"] for e in controller.events]
    after = kinds[kinds.index("control.probes", kinds.index("control.probes") + 1) :]
    assert "control.decision" in after  # the pool's replan weighed plans on what they measured
    decision = next(e for e in controller.events[-len(after) :] if e["event"] == "control.decision")
    assert decision["trigger"]["kind"] == "pool"


def test_classes_a_saved_calibration_has_learned_are_not_probed_again_but_its_links_load_is():
    calibrator = Calibrator()
    for op_class in PROBED_CLASSES:
        if op_class.endswith(":intra"):
            calibrator.measure(op_class, ideal_s=1.0, measured_s=[10.0])
    controller, _ = _run(JobPolicy(), steps=2, calibrator=calibrator)
    [probes] = _of(controller, "control.probes")
    # the gauge inside a node is measured again: learned, but with no reference to measure
    # the link's load against (a file written before the gauges)
    assert set(probes["efficiency"]) == {c for c in PROBED_CLASSES if c.endswith(":inter")} | {
        LINK_GAUGES["intra"]
    }
    assert probes["load"] == {"intra": 1.0, "inter": 1.0}  # each the reference from now on
    everything = Calibrator()
    for op_class in PROBED_CLASSES:
        everything.measure(op_class, ideal_s=1.0, measured_s=[2.0])
    # what the gauge inside a node measured when the file was saved, on the same slots and bytes
    [gauge] = [p for p in link_probes(WORKLOAD, ACC, range(16)) if p.link == "intra"]
    everything.observe_link("intra", 0.2, gauge=gauge.gauge)
    controller, summary = _run(JobPolicy(), steps=2, calibrator=everything)
    [probes] = _of(controller, "control.probes")
    assert set(probes["slots"]) == set(LINK_GAUGES.values())
    assert set(probes["efficiency"]) == {LINK_GAUGES["inter"]}  # no reference saved for it
    # The saved reference is the gauge's: the links inside a node are timed as loaded against it.
    now = _alone(_pcie_twin(), LINK_GAUGES["intra"])
    assert probes["load"]["intra"] == pytest.approx(0.2 / now, rel=1e-6)
    assert probes["load"]["inter"] == 1.0  # first measured now: the reference
    assert 0 < summary.probe_seconds < 2 * PROBE_SETUP_S


class _ProbingFails(SimulatedEngine):
    """Probing refused at first (a slot lost since the pool was read), then cut short by a slot
    failing after two probes, then whole."""

    calls = 0

    def run_probes(self, probes):
        self.calls += 1
        if self.calls == 1:
            raise ValueError("probes[0].slots: slot 3 is not a live slot of the pool of 16")
        if self.calls == 2:
            report = super().run_probes(probes[:2])
            return dataclasses.replace(report, failure="probing stopped: slot 9 failed")
        return super().run_probes(probes)


def test_probing_the_engine_could_not_finish_is_tried_again_at_the_next_replans():
    # the pool loses a slot now and then (on the same two nodes): a replan each time
    shrinking = ((200.0, 15), (600.0, 14), (1000.0, 13), (1400.0, 12))
    controller, summary = _run(JobPolicy(), pool=shrinking, engine=_ProbingFails)
    assert summary.steps == 30 and not summary.stopped  # the job went on meanwhile
    refused, cut, whole = _of(controller, "control.probes")[:3]
    assert (
        refused["failure"].startswith("not probed: probes[0].slots") and not refused["efficiency"]
    )
    between = controller.events[controller.events.index(refused) : controller.events.index(cut)]
    assert "control.trigger" in [e["event"] for e in between]  # retried at the next replan
    # what ran before the failure is kept, and not probed again
    assert cut["failure"] == "probing stopped: slot 9 failed"
    # two probes ran, one of them the gauge inside a node: its first measurement, the link's
    # reference (it was settled by the steps by now, but nothing had measured the link alone)
    assert len(cut["efficiency"]) == 2 and LINK_GAUGES["intra"] in cut["efficiency"]
    assert cut["load"] == {"intra": 1.0}
    assert not whole["failure"] and not set(whole["efficiency"]) & set(cut["efficiency"])
    # what no round probed, the steps had settled meanwhile
    unprobed = set(PROBED_CLASSES) - set(cut["efficiency"]) - set(whole["efficiency"])
    assert unprobed <= controller.calibrator.settled() and len(whole["efficiency"]) >= 3
    assert len(_of(controller, "control.probes")) == 3  # done: not again at later replans


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_the_probes_switch_must_be_a_boolean(value):
    with pytest.raises(PolicyError, match=r"policy\.calibration_probes: must be true or false"):
        JobPolicy.from_json({"calibration_probes": value})


# --- the links' load, followed ---------------------------------------------------------------


class _Clocked(SimulatedEngine):
    """The simulated engine, noting the job seconds of each probing."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.probed_at: list[float] = []

    def run_probes(self, probes):
        self.probed_at.append(self.now())
        return super().run_probes(probes)


def _busy_links() -> ClusterTwin:
    """Other tenants' traffic on the links between nodes building up and easing off twice an
    hour (up to 1.3 times slower), and no noise."""
    return ClusterTwin.draw(
        device(ACC.name), 13, noise=0.0, interference=0.3, interference_period_s=1800.0
    )


def test_the_links_are_timed_again_every_while_and_calibration_prices_them_at_their_load():
    """Other tenants' traffic loads the links between nodes (the twin's links inside a node
    carry the job's alone): each round of the gauges measures that load against the first
    probing, and calibration prices the links between nodes at it."""
    trace = Trace(
        name="flat",
        steps=60,
        accelerator=ACC.name,
        gpus=16,
        gen_len=((0, 2048.0),),
        len_sigma=0.0,  # every response at the mean: no step outgrows memory, no move
    )
    twin = _busy_links()
    engine = _Clocked(trace, ACC, twin=twin, seed=2)
    controller = Controller(WORKLOAD, ACC, JobPolicy(link_probe_every_s=300.0))
    summary = run_job(engine, controller, trace.steps)
    rounds = _of(controller, "control.links")
    first, *again = engine.probed_at
    assert first == 0.0 and len(again) == len(rounds) >= 4
    gaps = [b - a for a, b in itertools.pairwise(engine.probed_at)]
    assert min(gaps) >= 300.0 and max(gaps) < 300.0 + 2 * max(_step_seconds(controller))
    # Each round measures both links' load against the first probing: exactly the twin's, as
    # there is no noise: how much longer the gauge takes alone now than it took then.
    gauges = {p.link: p for p in link_probes(WORKLOAD, ACC, range(16))}

    def took(link: str, at: float) -> float:
        probe = gauges[link]
        return probe_seconds(twin, probe.pattern, probe.slots, probe.nbytes, at_s=at)

    for at, event in zip(again, rounds, strict=True):
        assert event["simulated"] and not event["failure"]
        assert set(event["load"]) == {"intra", "inter"}
        assert event["load"]["intra"] == pytest.approx(1.0, rel=1e-9)
        assert event["load"]["inter"] == pytest.approx(
            took("inter", at) / took("inter", 0.0), rel=1e-9
        )
        # the groups were made at the first probing: a round costs its collectives alone
        assert 0 < event["seconds"] < PROBE_SETUP_S
    loads = [e["load"]["inter"] for e in rounds]
    assert max(loads) / min(loads) > 1.15  # the wave was seen
    # Calibration prices each link at the last round's load.
    assert controller.calibrator.link_load("inter") == pytest.approx(rounds[-1]["load"]["inter"])
    assert controller.calibrator.link_load("intra") == pytest.approx(1.0)
    assert summary.probe_seconds == pytest.approx(
        sum(e["seconds"] for e in _of(controller, "control.probes") + rounds)
    )
    # The all-reduce between nodes is priced as the twin's links run it at the load now ...
    gauge = LINK_GAUGES["inter"]
    learned = controller.calibrator.efficiency()
    assert learned[gauge] == pytest.approx(_alone(twin, gauge, at_s=engine.now()), rel=0.03)
    blind_engine = _Clocked(trace, ACC, twin=twin, seed=2)
    off = Controller(WORKLOAD, ACC, JobPolicy(link_probe_every_s=0))
    run_job(blind_engine, off, trace.steps)
    assert _of(off, "control.links") == [] and off.calibrator.link_load("inter") == 1.0
    # ... and without the rounds, at the load of the first probing: off by now.
    blind = off.calibrator.efficiency()
    assert abs(blind[gauge] / _alone(twin, gauge, at_s=blind_engine.now()) - 1) > 0.05


def _step_seconds(controller):
    return [e["seconds"] for e in controller.events if e["event"] == "step"]


@pytest.mark.parametrize("value", [-1, "often", True, None, 100_000])
def test_the_link_probing_interval_is_refused_out_of_range_naming_the_field(value):
    with pytest.raises(PolicyError, match=r"policy\.link_probe_every_s: must be a number"):
        JobPolicy.from_json({"link_probe_every_s": value})
