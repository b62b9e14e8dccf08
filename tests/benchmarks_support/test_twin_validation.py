"""The pure parts of the CPU-slot profile and the twin's validation (no Ray, no slots)."""

from __future__ import annotations

import base64
import pickle
import sys
import types

import pytest

from benchmarks import cpu_slot_profile, twin_validation
from runtime.ppo.job import PpoJobConfig, plan_by_hand


def test_fit_alpha_beta_recovers_a_line():
    alpha, beta = 300e-6, 2e9
    points = [(n, alpha + n / beta) for n in (1024, 65536, 1 << 20, 16 << 20)]
    fit = cpu_slot_profile.fit_alpha_beta(points)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-6)
    assert fit["beta_bytes_per_s"] == pytest.approx(beta, rel=1e-6)
    assert fit["max_rel_error"] < 1e-9


def test_half_rows_interpolates_in_log_space():
    peak = 100.0
    sweep = [{"nk": 64, "m": m, "flops": r} for m, r in ((1, 10.0), (4, 40.0), (16, 80.0))]
    got = cpu_slot_profile.half_rows(sweep, 64, peak)
    assert 4 < got < 16
    assert cpu_slot_profile.half_rows(sweep, 64, 1000.0) is None  # never reaches half


def test_workload_round_trips_through_json():
    workload = PpoJobConfig(model="tiny-sft", batch_size=8).workload()
    data = twin_validation.workload_json(workload)
    assert data["models"]["actor"] == "tiny-sft"
    assert twin_validation.workload_from_json(data) == workload


def _record(workload, plan, *, seconds: float, warmup: bool = False, after: bool = False):
    return {
        "warmup": warmup,
        "ok": True,
        "after_move": after,
        "plan": plan.to_json(),
        "workload": twin_validation.workload_json(workload),
        "lengths": [3] * workload.global_batch,
        "gen_len": 3.0,
        "seconds": 3 * seconds,
        "stage_seconds": dict.fromkeys(twin_validation.STAGES, seconds),
        "model_stage_seconds": {"actor@generation": seconds},
    }


class _FakeTwin:
    """Answers every stage with 0.11 s and every transition with 0.5 s."""

    def __init__(self):
        self.lengths = []

    def step(self, plan, workload, *, lengths, at_s, backend):
        assert backend == "torch" and at_s == 0.0
        self.lengths.append(list(lengths))
        stages = dict.fromkeys(twin_validation.STAGES, 0.11)
        return types.SimpleNamespace(
            stage_seconds=stages, model_stage_seconds={"actor@generation": 0.11}
        )

    def transition_seconds(self, dag):
        assert dag == {"nodes": 2}
        return 0.5


def test_compare_against_a_fake_twin():
    workload = PpoJobConfig(model="tiny-sft", batch_size=8).workload()
    plan = plan_by_hand(workload, {}, num_slots=2)
    steps = [
        _record(workload, plan, seconds=9.0, warmup=True),  # left out: warm-up
        _record(workload, plan, seconds=0.1),
        _record(workload, plan, seconds=0.1),
    ]
    dag = base64.b64encode(pickle.dumps({"nodes": 2})).decode()
    raw = {
        "shapes": [
            {
                "shape": {"name": "s"},
                "steps": steps,
                "transitions": [
                    {
                        "seconds": 0.4,
                        "predicted_s": 0.3,
                        "dag_pickle": dag,
                        "dag": {"nodes": []},
                        "after_step": 1,
                    }
                ],
            }
        ]
    }
    twin = _FakeTwin()
    result = twin_validation.compare(raw, twin)
    stages = [r for r in result["rows"] if r["kind"] == "stage"]
    assert [r["key"] for r in stages] == list(twin_validation.STAGES)
    assert all(r["steps"] == 2 and r["ratio"] == pytest.approx(1.1) for r in stages)
    assert result["met"] and result["stages_within_goal"] == 3
    assert twin.lengths == [[3] * 8, [3] * 8]
    (move,) = result["transitions"]
    assert move["twin_predicted_s"] == 0.5 and move["ratio"] == pytest.approx(1.25)


def test_segments_split_where_the_plan_changes_and_drop_the_step_after_a_move():
    workload = PpoJobConfig(model="tiny-sft", batch_size=8).workload()
    one = plan_by_hand(workload, {}, num_slots=2)
    two = plan_by_hand(workload, {"actor@generation": (2, 1, 1)}, num_slots=2)
    steps = [
        _record(workload, one, seconds=0.1),
        _record(workload, two, seconds=0.2, after=True),
        _record(workload, two, seconds=0.2),
    ]
    segments = twin_validation._segments(steps)
    assert [len(s) for s in segments] == [1, 1]


def test_a_missing_twin_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "runtime.twin", None)  # import fails
    with pytest.raises(twin_validation.TwinUnavailableError, match="ClusterTwin"):
        twin_validation.load_twin()


def test_raw_records_keep_their_plans_through_the_file(tmp_path):
    workload = PpoJobConfig(model="tiny-sft", batch_size=8).workload()
    one = plan_by_hand(workload, {}, num_slots=2)
    two = plan_by_hand(workload, {"actor@generation": (2, 1, 1)}, num_slots=2)
    steps = [_record(workload, p, seconds=0.1) for p in (one, one, two)]
    raw = {"shapes": [{"shape": {"name": "s"}, "steps": steps, "transitions": []}]}
    path = tmp_path / "raw.json"
    twin_validation.save_raw(raw, path)
    back = twin_validation.load_raw(path)
    assert len(back["shapes"][0]["plans"]) == 2
    assert [s["plan"] for s in back["shapes"][0]["steps"]] == [s["plan"] for s in steps]
