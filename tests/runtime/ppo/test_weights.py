"""Loading weights by Hugging Face name: state dicts, safetensors and torch files, strict errors."""

import json
import struct

import pytest
import torch

from runtime.planner.catalog import default_catalog
from runtime.ppo.model import build_model
from runtime.ppo.weights import CheckpointError, load_weights, read_safetensors

CONFIG = default_catalog().model("tiny-sft")
_DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64"}


def _write_safetensors(path, tensors: dict[str, torch.Tensor]) -> None:
    """The file format as the safetensors specification writes it (header, then raw bytes)."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, tensor in tensors.items():
        blob = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": _DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_safetensors_roundtrip_keeps_names_dtypes_and_values(tmp_path):
    tensors = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "c": torch.tensor([[7]], dtype=torch.int64),
    }
    _write_safetensors(tmp_path / "t.safetensors", tensors)
    loaded = read_safetensors(tmp_path / "t.safetensors")
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_model_loads_a_checkpoint_file_by_name(tmp_path, suffix):
    source = build_model(CONFIG, scalar_head=False, seed=1)
    path = tmp_path / f"model{suffix}"
    if suffix == ".safetensors":
        _write_safetensors(path, source.state_dict())
    else:
        torch.save(source.state_dict(), path)
    target = build_model(CONFIG, scalar_head=False, seed=2)
    assert not _same_weights(source, target)
    load_weights(target, path)
    assert _same_weights(source, target)


def test_bf16_checkpoint_is_converted_to_the_model_dtype():
    source = build_model(CONFIG, scalar_head=True, seed=1)
    state = {k: v.to(torch.bfloat16) for k, v in source.state_dict().items()}
    target = build_model(CONFIG, scalar_head=True, seed=2)
    load_weights(target, state)
    assert target.score.weight.dtype == torch.float32
    assert torch.equal(target.score.weight, state["score.weight"].float())


def test_shape_mismatch_names_the_tensor_and_both_shapes():
    state = build_model(CONFIG, scalar_head=False, seed=1).state_dict()
    state["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    target = build_model(CONFIG, scalar_head=False, seed=2)
    before = target.state_dict()["model.embed_tokens.weight"].clone()
    with pytest.raises(
        CheckpointError, match=r"layers\.1\.self_attn\.k_proj\.weight.*\(32, 64\).*\(64, 64\)"
    ):
        load_weights(target, state)
    assert torch.equal(target.model.embed_tokens.weight, before), "nothing is copied on failure"


def test_missing_and_unexpected_tensors_are_named_and_derived_buffers_ignored():
    state = build_model(CONFIG, scalar_head=False, seed=1).state_dict()
    target = build_model(CONFIG, scalar_head=True, seed=2)
    with pytest.raises(CheckpointError, match=r"lm_head\.weight: not a parameter"):
        load_weights(target, state)
    del state["lm_head.weight"]
    with pytest.raises(CheckpointError, match=r"score\.weight: missing"):
        load_weights(target, state)
    state["score.weight"] = torch.zeros(1, CONFIG.hidden_size)
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    load_weights(target, state)
    assert torch.equal(target.score.weight, torch.zeros(1, CONFIG.hidden_size))


def test_a_folder_of_safetensors_shards_loads_as_one_checkpoint(tmp_path):
    state = build_model(CONFIG, scalar_head=True, seed=1).state_dict()
    keys = list(state)
    _write_safetensors(
        tmp_path / "model-00001-of-00002.safetensors", {k: state[k] for k in keys[:5]}
    )
    _write_safetensors(
        tmp_path / "model-00002-of-00002.safetensors", {k: state[k] for k in keys[5:]}
    )
    target = build_model(CONFIG, scalar_head=True, seed=2)
    load_weights(target, tmp_path)
    assert all(torch.equal(target.state_dict()[k], state[k]) for k in keys)


def test_a_truncated_safetensors_file_names_the_tensor(tmp_path):
    path = tmp_path / "t.safetensors"
    _write_safetensors(path, {"x": torch.zeros(4), "y": torch.ones(3)})
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(CheckpointError, match=r"^y: byte range \[16, 28\)"):
        read_safetensors(path)
