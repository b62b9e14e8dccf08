"""Calibration probes: which collectives a pool can time alone, and what calibration makes of
them."""

import math

import pytest

from runtime.planner import PpoWorkload, default_catalog
from runtime.planner.calibration import Calibrator, Sample
from runtime.planner.probes import (
    LINK_GAUGES,
    MAX_INTER_NODES,
    PROBED_CLASSES,
    Probe,
    check_probes,
    link_probes,
    probes_for,
)

CATALOG = default_catalog()
ACC = CATALOG.accelerator("h100-sxm")  # 8 GPUs a node
WORKLOAD = PpoWorkload.for_model(CATALOG.model("llama-3.1-8b"), gen_len=1024)


def _by_class(probes):
    return {p.op_class: p for p in probes}


def test_one_node_is_probed_inside_only_and_an_all_reduce_spans_a_power_of_two():
    probes = _by_class(probes_for(WORKLOAD, ACC, [0, 1, 2, 4, 5, 6]))  # slot 3 and 7 are gone
    assert set(probes) == {c for c in PROBED_CLASSES if c.endswith(":intra")}
    # six live slots: the largest power of two of them, as a tensor-parallel group is placed
    assert probes["tp_allreduce:intra"].slots == (0, 1, 2, 4)
    assert probes["pp_p2p:intra"].slots == (0, 1)
    assert probes["weight_sync:intra"].pattern == "send"
    # the sizes are the job's own operations': one micro-batch's activations, one layer's
    # fp32 gradients, one layer's weights
    model = CATALOG.model("llama-3.1-8b")
    activation = WORKLOAD.micro_batch * WORKLOAD.seq_len * model.hidden_size * 2
    assert probes["tp_allreduce:intra"].nbytes == activation
    assert probes["dp_allreduce:intra"].nbytes == model.params_per_layer * 4
    assert probes["weight_sync:intra"].nbytes == model.params_per_layer * 2


def test_several_nodes_add_the_inter_node_probes_one_slot_a_node():
    probes = _by_class(probes_for(WORKLOAD, ACC, range(8 * 12)))
    assert set(probes) == set(PROBED_CLASSES)
    # a tensor-parallel group is placed inside a node: no plan runs that all-reduce across
    assert "tp_allreduce:inter" not in probes
    assert probes["dp_allreduce:inter"].slots == tuple(8 * n for n in range(MAX_INTER_NODES))
    assert probes["pp_p2p:inter"].slots == (0, 8)
    # what calibration has learned already is not probed again
    again = probes_for(WORKLOAD, ACC, range(16), skip={"tp_allreduce:inter", "pp_p2p:intra"})
    assert {p.op_class for p in again} == set(PROBED_CLASSES) - {
        "tp_allreduce:inter",
        "pp_p2p:intra",
    }
    assert probes_for(WORKLOAD, ACC, [5]) == []  # one slot: nothing to time


def test_a_probe_is_priced_in_the_cost_models_form():
    ring = Probe(op_class="dp_allreduce:inter", slots=(0, 8, 16, 24), nbytes=1 << 20)
    expected = 2 * 3 / 4 * (1 << 20) / ACC.inter_node_bandwidth + 2 * 3 * ACC.inter_node_latency
    assert ring.ideal_s(ACC) == pytest.approx(expected)
    send = Probe(op_class="weight_sync:intra", slots=(0, 1), nbytes=1 << 20)
    expected = (1 << 20) / ACC.intra_node_bandwidth + ACC.intra_node_latency
    assert send.ideal_s(ACC) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"op_class": "gemm"}, "op_class: 'gemm' is not probed"),
        ({"op_class": "transition:intra"}, "op_class: 'transition:intra' is not probed"),
        ({"op_class": "tp_allreduce:inter"}, "op_class: 'tp_allreduce:inter' is not probed"),
        ({"op_class": None}, "op_class: None is not probed"),
        ({"slots": (0, 1.5)}, "slots: must be a tuple of slot indices"),
        ({"slots": [0, 1]}, "slots: must be a tuple of slot indices"),
        ({"nbytes": 1024.0}, "nbytes: must be an integer"),
        ({"repeats": True}, "repeats: must be an integer"),
        ({"slots": (3,)}, "slots: a probe needs two or more"),
        ({"slots": (1, 1)}, "slots: a probe needs two or more distinct"),
        ({"op_class": "pp_p2p:intra", "slots": (0, 1, 2)}, "slots: a send probe"),
        ({"nbytes": 0}, "nbytes: must be in"),
        ({"repeats": 0}, "repeats: must be in"),
    ],
)
def test_a_malformed_probe_is_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        Probe(**{"op_class": "tp_allreduce:intra", "slots": (0, 1), "nbytes": 1024, **fields})


def test_an_engine_refuses_probes_on_slots_it_does_not_have_before_running_any():
    probes = probes_for(WORKLOAD, ACC, range(8))
    check_probes(probes, 8)
    with pytest.raises(ValueError, match=r"probes\[0\]\.slots: slot 7 is not a live slot"):
        check_probes(probes, 7)
    with pytest.raises(ValueError, match=r"probes\[0\]\.slots: slot 2 is not a live slot"):
        check_probes(probes, 8, lost={2})
    with pytest.raises(ValueError, match=r"probes\[1\]: not a Probe"):
        check_probes([probes[0], "tp"], 8)


def _steps_over_the_network(calibrator):
    """A pool of several nodes: every step syncs the weights over the network (true efficiency
    0.5, as the catalog says), never inside a node; decode (true 0.6) runs beside it."""
    for i in range(6):
        decode_s = 1.0 + 0.1 * i
        calibrator.observe_sample(
            Sample(
                "actor@generation",
                {"decode": decode_s, "weight_sync:inter": 0.2},
                decode_s / 0.6 + 0.2 / 0.5,
            )
        )


def test_a_class_no_step_exercises_keeps_what_its_probe_measured():
    """PCIe-class nodes catalogued as NVLink: the weight sync inside a node truly runs at 0.05,
    but no step of a pool of several nodes syncs inside one, so the steps never measure it.
    Unprobed, it borrows the network sync's correction (none: the network is as listed) and
    keeps the catalog's 0.6, twelve times too fast: a plan that fits one node would be
    weighed on that. Probed, it keeps what was measured."""
    unprobed = Calibrator()
    _steps_over_the_network(unprobed)
    probed = Calibrator()
    value = probed.measure("weight_sync:intra", ideal_s=0.1, measured_s=[2.2, 1.9, 2.0, 2.1, 1.8])
    assert value == pytest.approx(0.05)
    assert probed.learned() == {"weight_sync:intra"}
    _steps_over_the_network(probed)
    wrong, right = unprobed.efficiency(), probed.efficiency()
    assert wrong["weight_sync:intra"] == pytest.approx(0.6, rel=0.05)
    assert right["weight_sync:intra"] == pytest.approx(0.05, rel=0.01)
    for efficiency in (wrong, right):  # what the steps do measure, both learn
        assert efficiency["decode"] == pytest.approx(0.6, rel=0.02)
        assert efficiency["weight_sync:inter"] == pytest.approx(0.5, rel=0.05)


def test_a_probe_the_steps_contradict_is_corrected_by_them():
    """A probe times a class alone, where it runs faster than inside a step: where the stage
    samples do determine the class, they win."""
    calibrator = Calibrator()
    calibrator.measure("dp_allreduce:intra", ideal_s=1.0, measured_s=[1.25])  # 0.8 alone
    for i in range(8):  # inside the steps it runs at 0.5, beside an optimizer of changing size
        calibrator.observe_sample(
            Sample(
                "training",
                {"dp_allreduce:intra": 1.0, "optimizer": 0.2 * (i + 1)},
                1.0 / 0.5 + 0.2 * (i + 1) / 0.7,
            )
        )
    assert calibrator.efficiency()["dp_allreduce:intra"] == pytest.approx(0.5, rel=0.02)


def test_what_a_probe_measured_is_saved_with_the_calibration(tmp_path):
    calibrator = Calibrator()
    calibrator.measure("pp_p2p:inter", ideal_s=0.01, measured_s=[0.04, 0.05, 0.05])
    path = tmp_path / "cluster.json"
    calibrator.save(path)
    loaded = Calibrator.load(path)
    assert loaded.efficiency()["pp_p2p:inter"] == pytest.approx(0.2)
    assert "pp_p2p:inter" in loaded.learned()


@pytest.mark.parametrize(
    ("op_class", "ideal_s", "runs", "message"),
    [
        ("tp_allreduce:mars", 1.0, [1.0], "op_class: unknown"),
        ("gemm", 1.0, [], "measured_s: gemm: runs must be positive"),
        ("gemm", 1.0, [1.0, math.nan], "measured_s: gemm: runs must be positive"),
        ("gemm", 1.0, [-1.0], "measured_s: gemm: runs must be positive"),
        ("gemm", 0.0, [1.0], "ideal_s: gemm: must be positive"),
        ("gemm", 1e-30, [1e30], "measured_s: gemm: .* not plausible"),
    ],
)
def test_a_broken_probe_measurement_is_refused_naming_the_field(op_class, ideal_s, runs, message):
    calibrator = Calibrator()
    with pytest.raises(ValueError, match=message):
        calibrator.measure(op_class, ideal_s=ideal_s, measured_s=runs)
    assert calibrator.learned() == frozenset()


# --- the links' load -------------------------------------------------------------------------


def test_each_link_type_is_gauged_by_one_class_timed_on_the_slots_its_probe_uses():
    one_node = link_probes(WORKLOAD, ACC, range(8))
    assert [p.op_class for p in one_node] == ["tp_allreduce:intra"]
    two = {p.link: p for p in link_probes(WORKLOAD, ACC, range(16))}
    assert {link: p.op_class for link, p in two.items()} == LINK_GAUGES
    assert two["inter"].slots == (0, 8) and two["intra"].slots == tuple(range(8))
    probe = two["inter"]
    assert probe.efficiency(ACC, [4.0, 1.0, 2.0]) == pytest.approx(probe.ideal_s(ACC) / 2.0)
    # not capped at the peak: a link's load is measured from the ratio itself
    assert probe.efficiency(ACC, [probe.ideal_s(ACC) / 3]) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="measured_s: dp_allreduce:inter: runs must be positive"):
        probe.efficiency(ACC, [])


TRUE = {"decode": 0.55, "tp_allreduce:intra": 0.44, "gemm": 0.5}


def _rising_load(calibrator: Calibrator, *, gauged: bool) -> float:
    """25 steps while other traffic on the links inside a node builds up (each step's
    classes crossing them up to 1.3 times slower): generation runs decode and its
    tensor-parallel all-reduce in one unchanging mix, training a changing GEMM beside a small
    all-reduce. Gauged: the link's gauge class timed alone before each step (alone it runs a
    tenth faster, at any load). Returns the load at the end."""
    for i in range(25):
        load = 1 + 0.3 * 0.5 * (1 - math.cos(math.pi * i / 24))
        if gauged:
            calibrator.observe_link("intra", TRUE["tp_allreduce:intra"] * 1.1 / load)
        mixes = {
            "actor@generation": {"decode": 1.0, "tp_allreduce:intra": 0.35},
            "training": {"gemm": 1.0 + 0.5 * (i % 4), "tp_allreduce:intra": 0.1},
        }
        for source, terms in mixes.items():
            slowed = {c: s * (load if c.endswith(":intra") else 1) for c, s in terms.items()}
            measured = sum(s / TRUE[c] for c, s in slowed.items())
            calibrator.observe_sample(Sample(source, terms, measured))
    return load


def test_samples_are_learned_at_the_link_load_they_ran_under_and_priced_at_the_load_now():
    gauged, blind = Calibrator(), Calibrator()
    load = _rising_load(gauged, gauged=True)
    _rising_load(blind, gauged=False)
    assert gauged.link_load("intra") == pytest.approx(load) == pytest.approx(1.3)
    now = TRUE["tp_allreduce:intra"] / load
    learned = gauged.efficiency()
    assert learned["tp_allreduce:intra"] == pytest.approx(now, rel=1e-6)
    assert learned["decode"] == pytest.approx(TRUE["decode"], rel=1e-6)
    assert learned["gemm"] == pytest.approx(TRUE["gemm"], rel=1e-6)
    # every class crossing the link is priced at its load (the fit holds them at the first)
    assert learned["dp_allreduce:intra"] < Calibrator().efficiency()["dp_allreduce:intra"]
    # Without the gauge, the window's steps average the load: the all-reduce is priced as if
    # the links were a tenth and more less busy than they are.
    assert blind.efficiency()["tp_allreduce:intra"] > 1.1 * now
    assert blind.link_load("intra") == 1.0


def test_the_link_load_is_saved_with_the_calibration_and_its_rows_are_not_scaled_twice(tmp_path):
    calibrator = Calibrator()
    _rising_load(calibrator, gauged=True)
    calibrator.measure("dp_allreduce:intra", ideal_s=1.0, measured_s=[2.0])  # 0.5 under load
    path = tmp_path / "cluster.json"
    calibrator.save(path)
    loaded = Calibrator.load(path)
    assert loaded.link_load("intra") == pytest.approx(calibrator.link_load("intra"))
    assert loaded.to_json()["links"] == calibrator.to_json()["links"]
    for op_class, value in calibrator.efficiency().items():
        assert loaded.efficiency()[op_class] == pytest.approx(value, rel=1e-9), op_class
    assert loaded.efficiency()["dp_allreduce:intra"] == pytest.approx(0.5)
    # the next gauge is measured against the first job's reference
    assert loaded.observe_link("intra", TRUE["tp_allreduce:intra"] * 1.1) == pytest.approx(1.0)
    assert loaded.efficiency()["dp_allreduce:intra"] == pytest.approx(0.5 * 1.3)


def test_a_gauge_of_another_shape_is_not_compared_with_the_reference_but_carries_the_load():
    """A collective's efficiency depends on its ranks and bytes: when the gauge's group
    changes (a node lost a slot) its first measurement re-bases the reference at the load
    last known, and the load goes on from there."""
    calibrator = Calibrator()
    assert calibrator.observe_link("intra", 0.5, gauge=(8, 1 << 20)) == 1.0
    assert calibrator.observe_link("intra", 0.4, gauge=(8, 1 << 20)) == pytest.approx(1.25)
    # four ranks run the collective at another efficiency, at the same load
    assert calibrator.observe_link("intra", 0.3, gauge=(4, 1 << 20)) == pytest.approx(1.25)
    assert calibrator.observe_link("intra", 0.375, gauge=(4, 1 << 20)) == pytest.approx(1.0)
    # alone, a collective may run past the catalog's peak: the ratio is what counts
    assert calibrator.observe_link("intra", 1.5, gauge=(4, 1 << 20)) == pytest.approx(0.25)
    assert calibrator.referenced() == {"intra"}


@pytest.mark.parametrize(
    ("link", "efficiency", "gauge", "message"),
    [
        ("mars", 0.5, None, "link: unknown 'mars'"),
        ("intra", 0.0, None, "efficiency: intra: must be a positive number"),
        ("inter", math.inf, None, "efficiency: inter: must be a positive number"),
        ("inter", True, None, "efficiency: inter: must be a positive number"),
        ("inter", math.nan, None, "efficiency: inter: must be a positive number"),
        ("inter", 1e-30, None, "efficiency: inter: must be a positive number"),
        ("inter", 0.5, (0, 1024), r"gauge: inter: must be \(ranks, bytes\)"),
        ("inter", 0.5, (2,), r"gauge: inter: must be \(ranks, bytes\)"),
    ],
)
def test_a_broken_link_measurement_is_refused_naming_the_field(link, efficiency, gauge, message):
    calibrator = Calibrator()
    with pytest.raises(ValueError, match=message):
        calibrator.observe_link(link, efficiency, gauge=gauge)
    assert calibrator.link_load("intra") == calibrator.link_load("inter") == 1.0
    calibrator.observe_link("intra", 1e-20)
    with pytest.raises(ValueError, match=r"efficiency: intra: .* not plausible"):
        calibrator.observe_link("intra", 1e10)
    assert calibrator.link_load("intra") == 1.0


@pytest.mark.parametrize(
    ("links", "message"),
    [
        ([], "links: must be an object"),
        ({"load": []}, "links.load: must be an object"),
        ({"reference": {"intra": 0.5}, "load": {"intra": -1}}, "links.load.intra: must be a pos"),
        ({"reference": {"intra": 0.5}, "load": {"intra": 1e200}}, "links.load.intra: must be a"),
        ({"load": {"intra": 1.2}}, "links.load.intra: the link has no reference"),
        ({"load": {"mars": 1.0}}, "links.load.mars: unknown link type"),
        ({"reference": {"inter": "fast"}}, "links.reference.inter: must be a positive number"),
        ({"reference": {"inter": 1e-300}}, "links.reference.inter: must be a positive number"),
        ({"reference": {"inter": 0.5}, "gauge": {"inter": [2]}}, "links.gauge.inter: must be"),
        ({"gauge": {"inter": [2, 1024]}}, "links.gauge.inter: the link has no reference"),
    ],
)
def test_a_malformed_link_load_in_a_file_is_refused_naming_it(links, message):
    data = Calibrator().to_json() | {"links": links}
    with pytest.raises(ValueError, match=message):
        Calibrator.from_json(data)
