"""A PPO job's ``generation_backend``: the spec takes ``torch`` (the default) anywhere and ``vllm``
on GPU slots only, naming the field for anything else; the field reaches the job's runtime, where
``vllm`` selects the vLLM generator (``runtime/ppo/generate_vllm.py``). vLLM is not installed
here: these tests check the choice, with the vLLM engine replaced, not a vLLM run."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from runtime.jobs.spec import VLLM_NEEDS_GPUS, PpoJobSpec, spec_from_json
from runtime.planner.catalog import default_catalog
from runtime.ppo import generate_vllm, slot_work
from runtime.ppo.generate import SamplingParams
from runtime.ppo.job import GENERATION_BACKENDS, PpoConfigError, PpoJobConfig, PpoRuntime
from runtime.ppo.model import build_model
from runtime.ppo.slot_work import row_seed

GPU = "h100-sxm"


# --- the spec ---------------------------------------------------------------------------------


def test_the_default_is_torch_and_a_spec_stored_before_the_field_reads_as_torch():
    spec = spec_from_json({"kind": "ppo"})
    assert spec.generation_backend == "torch" and spec.to_json()["generation_backend"] == "torch"
    assert spec.job_config().generation_backend == "torch"
    old = {k: v for k, v in PpoJobSpec().to_json().items() if k != "generation_backend"}
    assert PpoJobSpec.from_json(old).generation_backend == "torch"


def test_torch_is_taken_on_cpu_slots_and_on_gpus():
    for gpu in ("cpu-slot", GPU):
        spec = spec_from_json({"kind": "ppo", "gpu": gpu, "generation_backend": "torch"})
        assert spec.job_config().generation_backend == "torch"


def test_vllm_is_refused_on_cpu_slots_naming_the_field():
    with pytest.raises(ValueError) as info:
        spec_from_json({"kind": "ppo", "generation_backend": "vllm"})
    assert str(info.value) == VLLM_NEEDS_GPUS
    assert str(info.value) == (
        "generation_backend: vllm needs GPU slots; this job runs on CPU slots (gpu=cpu-slot): "
        "name a GPU kind in gpu, or use torch"
    )


def test_vllm_on_gpu_slots_is_taken_and_reaches_the_runtime_config():
    spec = spec_from_json({"kind": "ppo", "gpu": GPU, "generation_backend": "vllm"})
    assert spec.uses_gpus and spec.generation_backend == "vllm"
    assert PpoJobSpec.from_json(spec.to_json()) == spec
    assert spec.job_config().generation_backend == "vllm"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("tensorrt", "generation_backend: expected one of torch, vllm, got 'tensorrt'"),
        ("", "generation_backend: expected one of torch, vllm, got ''"),
        ("VLLM", "generation_backend: expected one of torch, vllm, got 'VLLM'"),
        (3, "generation_backend: expected str, got 3"),
        (None, "generation_backend: expected str, got None"),
        (True, "generation_backend: expected str, got True"),
        (["vllm"], "generation_backend: expected str, got ['vllm']"),
    ],
)
def test_an_unknown_value_is_refused_naming_the_field(value, message):
    for gpu in ("cpu-slot", GPU):
        with pytest.raises(ValueError) as info:
            spec_from_json({"kind": "ppo", "gpu": gpu, "generation_backend": value})
        assert str(info.value) == message


def test_only_a_ppo_job_has_the_field():
    for kind in ("sft", "ppo-sim"):
        with pytest.raises(ValueError, match=r"^generation_backend: unknown field"):
            spec_from_json({"kind": kind, "generation_backend": "torch"})


def test_the_runtime_config_refuses_an_unknown_backend_itself():
    with pytest.raises(PpoConfigError, match=r"^generation_backend: expected one of torch, vllm"):
        PpoJobConfig(generation_backend="tensorrt").validate()
    assert GENERATION_BACKENDS == slot_work.GENERATION_BACKENDS == ("torch", "vllm")


# --- where the runtime chooses the generator --------------------------------------------------


def test_vllm_selects_the_vllm_generator_without_importing_vllm():
    assert slot_work.generator_for("vllm") is slot_work._generate_vllm
    assert slot_work.generator_for("torch") is slot_work._generate_torch
    for bad in ("tensorrt", None, 3):
        with pytest.raises(ValueError, match=r"^generation_backend: expected one of torch, vllm"):
            slot_work.generator_for(bad)
    assert "vllm" not in sys.modules


class _FakeVllm:
    """``VllmGenerationBackend`` without vLLM: what it was made from, the weights it was given
    and the prompts it sampled; each response is its row's seed, as a token."""

    made: list[_FakeVllm] = []

    def __init__(self, folder, *, pad_token_id):
        self.folder, self.pad_token_id = folder, pad_token_id
        self.loaded: list[dict] = []
        self.calls: list[tuple] = []
        _FakeVllm.made.append(self)

    def load_weights(self, state_dict):
        self.loaded.append(dict(state_dict))

    def generate(self, prompts, params, *, seeds=None):
        self.calls.append((list(prompts), params, list(seeds)))
        rows = len(prompts)
        return SimpleNamespace(
            response_tokens=torch.tensor(seeds)[:, None] % 50,
            response_mask=torch.ones(rows, 1, dtype=torch.long),
            logprobs=torch.zeros(rows, 1),
        )


@pytest.fixture
def fake_vllm(monkeypatch):
    _FakeVllm.made = []
    monkeypatch.setattr(generate_vllm, "VllmGenerationBackend", _FakeVllm)
    return _FakeVllm


class _Pool:
    """``SlotPool.run`` in this process: each call of ``fn`` on its slot's context."""

    def __init__(self, contexts):
        self.contexts = contexts
        self.runs: list[dict] = []

    def run(self, fn, per_call, *, on, **common):
        self.runs.append(common)
        return [
            fn(self.contexts[slot], **kw, **common) for kw, slot in zip(per_call, on, strict=True)
        ]


def test_a_vllm_job_s_generation_runs_on_the_vllm_backend(tmp_path, monkeypatch, fake_vllm):
    """From the spec to the slot: the job's runtime asks the slots to generate with ``vllm``;
    each one-slot unit starts a vLLM engine from the actor's Hugging Face folder, on its first
    step, and feeds it the actor's weights on the next."""
    spec = spec_from_json({"kind": "ppo", "gpu": GPU, "generation_backend": "vllm"})
    job = PpoRuntime(spec.job_config(), workdir=tmp_path / "job")
    config = default_catalog().model(spec.model)
    model = build_model(config, scalar_head=False, seed=0)
    units = [SimpleNamespace(slots=(slot,), unit_id=f"actor@generation/{slot}") for slot in (0, 1)]
    workspaces = {u.unit_id: SimpleNamespace(unit=u, model=model) for u in units}
    monkeypatch.setattr(slot_work, "workspace", lambda ctx, unit: workspaces[unit.unit_id])
    monkeypatch.setattr(
        slot_work, "_generate_torch", lambda *a: pytest.fail("generated with torch")
    )
    monkeypatch.setitem(slot_work._GENERATORS, "torch", slot_work._generate_torch)
    pool = _Pool({slot: SimpleNamespace(state={}, device="cpu") for slot in (0, 1)})
    engine = SimpleNamespace(pool=pool)
    prompts = job.tasks.sample(4, seed=0)
    params = job.config.sampling(7)

    rollout = job._generate(engine, units, prompts, params, micro_batch=0)

    assert pool.runs[0]["backend"] == "vllm"
    assert len(fake_vllm.made) == 2  # one engine per unit (slot)
    for slot, engine_made in enumerate(fake_vllm.made):
        assert (engine_made.folder / "config.json").is_file()
        ((sampled, got_params, seeds),) = engine_made.calls
        rows = range(2 * slot, 2 * slot + 2)
        assert sampled == [list(prompts[r].tokens) for r in rows]
        assert got_params is params and seeds == [row_seed(7, r) for r in rows]
    assert rollout["responses"] == [[row_seed(7, r) % 50] for r in range(4)]

    job._generate(engine, units, prompts, params, micro_batch=0)
    assert len(fake_vllm.made) == 2  # the engines stay; the new weights go in place
    for engine_made in fake_vllm.made:
        assert len(engine_made.calls) == 2 and len(engine_made.loaded) == 1
        assert engine_made.loaded[0].keys() == model.state_dict().keys()
    assert "vllm" not in sys.modules


def test_the_vllm_backend_refuses_a_generation_unit_of_several_slots(fake_vllm):
    unit = SimpleNamespace(slots=(0, 1), unit_id="actor@generation/0")
    ws = SimpleNamespace(unit=unit, model=None)
    ctx = SimpleNamespace(state={}, device="cpu")
    with pytest.raises(ValueError, match="the vLLM backend runs one-slot generation units"):
        slot_work.generator_for("vllm")(
            ctx, ws, [[1]], [0], SamplingParams(max_new_tokens=4, eos_token_id=None), 0
        )
    assert not fake_vllm.made
