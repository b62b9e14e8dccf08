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
