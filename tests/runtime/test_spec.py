"""Job specs validate themselves and name the field that is wrong."""

import pytest

from runtime.jobs.spec import SftJobSpec


def test_round_trip_through_json():
    spec = SftJobSpec(num_slots=3, num_steps=7, lr=0.01)
    assert SftJobSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"num_slots": 0}, "num_slots"),
        ({"num_steps": -1}, "num_steps"),
        ({"hidden": 30, "num_heads": 4}, "hidden"),
        ({"lr": 2.0}, "lr"),
        ({"kind": "ppo"}, "kind"),
        ({"num_slots": "two"}, "num_slots"),
        ({"num_slots": True}, "num_slots"),
        ({"slots": 2}, "slots"),
    ],
)
def test_bad_fields_are_named(data, field):
    with pytest.raises(ValueError) as info:
        SftJobSpec.from_json(data)
    assert str(info.value).startswith(f"{field}: ")


def test_integers_are_accepted_for_floats_but_still_range_checked():
    with pytest.raises(ValueError, match="lr: expected 0 < lr < 1"):
        SftJobSpec.from_json({"lr": 0})
    assert SftJobSpec.from_json({"seed": 3}).seed == 3


def test_non_object_is_refused():
    with pytest.raises(ValueError, match="spec: expected a JSON object"):
        SftJobSpec.from_json([1, 2])


def test_a_ppo_job_whose_models_cannot_fit_its_cpu_slots_is_refused_at_submission():
    from runtime.jobs.spec import PpoJobSpec

    with pytest.raises(ValueError) as info:
        PpoJobSpec.from_json({"kind": "ppo", "model": "llama-3.1-8b", "num_slots": 4})
    message = str(info.value)
    assert message.startswith("model: llama-3.1-8b does not fit 4 CPU slots in any layout")
    assert "GiB" in message  # the planner's reason: what a slot would need against its budget
    assert PpoJobSpec.from_json({"kind": "ppo", "model": "tiny-sft", "num_slots": 4}).num_slots == 4


def test_a_simulated_job_has_room_for_its_trace_shape():
    """A 'step' trace cuts three times: a 3-step simulated job of that shape is refused up front
    (it used to fail inside the worker), a 3-step growth job is fine."""
    from runtime.jobs.spec import spec_from_json

    with pytest.raises(ValueError, match=r"num_steps: expected 4 <= num_steps"):
        spec_from_json({"kind": "ppo-sim", "trace": "step", "num_steps": 3})
    assert spec_from_json({"kind": "ppo-sim", "trace": "growth", "num_steps": 3}).num_steps == 3


def test_a_simulated_job_that_fits_nowhere_is_refused_at_submission():
    from runtime.jobs.spec import spec_from_json

    with pytest.raises(ValueError, match=r"^gpus: no feasible plan for llama-3.1-70b on 16 × "):
        spec_from_json({"kind": "ppo-sim", "gpu": "cpu-slot", "model": "llama-3.1-70b"})
    assert spec_from_json({"kind": "ppo-sim", "model": "llama-3.1-70b", "gpus": 64}).gpus == 64


def test_a_ppo_job_runs_on_the_accelerator_it_names_and_is_planned_for_it():
    """``gpu`` chooses the slots: a model that fits no layout of 3 CPU slots fits 8 H100s, and
    the job then reserves one GPU per slot; an unknown accelerator is named."""
    from runtime.jobs.spec import PpoJobSpec

    with pytest.raises(ValueError, match=r"^model: llama-3.1-8b does not fit 8 CPU slots"):
        PpoJobSpec(model="llama-3.1-8b", num_slots=8, max_slots=8)
    spec = PpoJobSpec(model="llama-3.1-8b", num_slots=8, max_slots=8, gpu="h100-sxm")
    assert spec.uses_gpus and not PpoJobSpec().uses_gpus
    assert PpoJobSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match=r"^gpu: "):
        PpoJobSpec(gpu="tpu-v9")
    with pytest.raises(ValueError, match=r"^model: llama-3.1-8b does not fit 1 × h100-sxm"):
        PpoJobSpec(model="llama-3.1-8b", num_slots=1, max_slots=1, gpu="h100-sxm")


def test_a_gpu_ppo_job_reserves_a_gpu_per_slot(monkeypatch, tmp_path):
    """The driver's wiring, up to where a GPU is needed: the pool asks Ray for a GPU per slot
    (stopped there: this machine has none) after the job's folder is set up."""
    from runtime.events import ListSink
    from runtime.jobs import ppo_job
    from runtime.jobs.spec import PpoJobSpec

    asked = {}

    class NoGpuHereError(Exception):
        pass

    def create(num_slots, **kwargs):
        asked.update(kwargs, num_slots=num_slots)
        raise NoGpuHereError

    monkeypatch.setattr(ppo_job.SlotPool, "create", staticmethod(create))
    monkeypatch.setattr(ppo_job, "ray_connection", _no_ray)
    spec = PpoJobSpec(num_slots=2, max_slots=3, gpu="h200", num_steps=2)
    with pytest.raises(NoGpuHereError):
        ppo_job.run_ppo_job(spec, sink=ListSink(), emit_control=lambda e: None, workdir=tmp_path)
    assert asked["use_gpus"] is True and asked["num_slots"] == 3
    monkeypatch.setattr(ppo_job.SlotPool, "create", staticmethod(create))
    with pytest.raises(NoGpuHereError):
        ppo_job.run_ppo_job(
            PpoJobSpec(num_slots=2, max_slots=3, num_steps=2),
            sink=ListSink(),
            emit_control=lambda e: None,
            workdir=tmp_path / "cpu",
        )
    assert asked["use_gpus"] is False


def _no_ray(address, **kwargs):
    import contextlib

    from runtime.engine.ray_cluster import RayConnection

    return contextlib.nullcontext(RayConnection(address="none", started_locally=False, num_cpus=0))


def test_an_sft_job_that_cannot_fit_a_cpu_slot_is_refused_naming_what_to_change():
    """Found by audit: {"hidden": 65536} (about 1.3 TB of training state per slot) and 4096
    sequences of 8192 tokens were accepted, to fail or be killed once running."""
    with pytest.raises(
        ValueError, match=r"^hidden: .*about 128\d\.\d GiB per slot.*CPU slot's 4 GiB"
    ):
        SftJobSpec.from_json({"hidden": 65536})
    with pytest.raises(ValueError, match=r"^micro_batch: 4096 sequences of seq_len=8192"):
        SftJobSpec.from_json({"seq_len": 8192, "micro_batch": 4096})
    assert SftJobSpec.from_json({"hidden": 512, "num_layers": 4, "micro_batch": 32})


def test_the_sft_parameter_count_is_the_models():
    """What the fit check counts is what the slots build."""
    from runtime.jobs.sft import TinyDecoder

    spec = SftJobSpec(hidden=96, num_layers=3, vocab_size=50, num_heads=4)
    model = TinyDecoder(vocab_size=50, hidden=96, num_layers=3, num_heads=4)
    assert spec.params() == sum(p.numel() for p in model.parameters())
