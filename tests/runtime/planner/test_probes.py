"""Calibration probes: which collectives a pool can time alone, and what calibration makes of
them."""

import math

import pytest

from runtime.planner import PpoWorkload, default_catalog
from runtime.planner.calibration import Calibrator, Sample
from runtime.planner.probes import MAX_INTER_NODES, PROBED_CLASSES, Probe, check_probes, probes_for

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
