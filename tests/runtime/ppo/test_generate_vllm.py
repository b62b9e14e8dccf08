"""The vLLM backend's parts that need no GPU: the Hugging Face folder it starts from. The backend
itself runs where vLLM and a GPU exist (``-m gpu`` on the device machine)."""

import importlib.util
import json

import pytest
import torch

from runtime.planner.catalog import default_catalog
from runtime.ppo.export import write_hf_folder
from runtime.ppo.generate import SamplingParams
from runtime.ppo.model import build_model
from runtime.ppo.weights import read_state_dict


def test_the_folder_holds_a_llama_config_and_every_weight(tmp_path):
    config = default_catalog().model("tiny-sft")
    model = build_model(config, scalar_head=False, seed=3)
    folder = write_hf_folder(tmp_path / "actor", config, model.state_dict())
    hf = json.loads((folder / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLM"]
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["num_key_value_heads"]) == (
        config.hidden_size,
        config.num_layers,
        config.num_kv_heads,
    )
    weights = read_state_dict(folder)
    assert weights.keys() == model.state_dict().keys()
    for key, tensor in model.state_dict().items():
        assert weights[key].dtype == torch.bfloat16
        torch.testing.assert_close(weights[key].float(), tensor.to(torch.bfloat16).float())


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and importlib.util.find_spec("vllm")),
    reason="needs a CUDA GPU and vLLM (the device machine)",
)
def test_vllm_samples_and_takes_new_weights(tmp_path):
    from runtime.ppo.generate_vllm import VllmGenerationBackend

    config = default_catalog().model("tiny-llama")
    model = build_model(config, scalar_head=False, seed=0)
    backend = VllmGenerationBackend(
        write_hf_folder(tmp_path / "a", config, model.state_dict()), pad_token_id=0
    )
    params = SamplingParams(max_new_tokens=8, eos_token_id=None, temperature=0.0)
    before = backend.generate([[1, 5, 6, 3]], params)
    assert before.response_tokens.shape == (1, 8)
    backend.load_weights(build_model(config, scalar_head=False, seed=1).state_dict())
    after = backend.generate([[1, 5, 6, 3]], params)
    assert not torch.equal(before.response_tokens, after.response_tokens)
