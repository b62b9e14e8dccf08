"""Shard layouts of Llama-architecture state: HF names, styles, DTensor placements, exact tiling."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard

from runtime.emu.layout import ShardError, ShardSpec, UnitLayout, chunk_bounds, placement
from runtime.planner.catalog import ModelConfig, default_catalog

CATALOG = default_catalog()


def test_parameters_carry_hugging_face_names_and_count_like_the_catalog():
    model = CATALOG.model("qwen2.5-7b")
    tensors = {t.key: t for t in UnitLayout(model=model, tp=1, pp=1, training=False).tensors()}
    assert tensors["model.layers.0.self_attn.q_proj.weight"].global_shape == (3584, 3584)
    assert tensors["model.layers.27.mlp.down_proj.weight"].global_shape == (3584, 18944)
    assert "model.layers.0.self_attn.k_proj.bias" in tensors and "lm_head.weight" in tensors
    assert sum(t.numel for t in tensors.values()) == model.num_params()
    critic = UnitLayout(model=model, tp=1, pp=1, training=False, scalar_head=True).tensors()
    assert sum(t.numel for t in critic) == model.num_params(scalar_head=True)


def test_styles_map_to_dtensor_placements():
    tensors = {
        t.key: t
        for t in UnitLayout(model=CATALOG.model("tiny-llama"), tp=2, pp=1, training=False).tensors()
    }
    assert placement(tensors["model.layers.0.self_attn.q_proj.weight"]) == Shard(0)
    assert placement(tensors["model.layers.0.self_attn.o_proj.weight"]) == Shard(1)
    assert placement(tensors["model.layers.0.mlp.down_proj.weight"]) == Shard(1)
    assert placement(tensors["model.embed_tokens.weight"]) == Shard(0)
    assert placement(tensors["model.norm.weight"]) == Replicate()


@given(size=st.integers(1, 300), parts=st.integers(1, 16))
def test_chunk_bounds_are_torch_chunk(size, parts):
    chunks = torch.arange(size).chunk(parts)
    for index in range(parts):
        start, stop = chunk_bounds(size, parts, index)
        expected = chunks[index].tolist() if index < len(chunks) else []
        assert list(range(start, stop)) == expected


@st.composite
def layouts(draw):
    heads = draw(st.sampled_from([2, 4, 8]))
    model = ModelConfig(
        name="m",
        vocab_size=draw(st.integers(8, 300)),
        hidden_size=heads * 8,
        intermediate_size=draw(st.integers(8, 100)),
        num_layers=draw(st.sampled_from([1, 2, 4, 6])),
        num_heads=heads,
        num_kv_heads=draw(st.sampled_from([h for h in (1, 2, 4, 8) if heads % h == 0])),
        qkv_bias=draw(st.booleans()),
    )
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if model.num_kv_heads % t == 0]))
    pp = draw(st.sampled_from([p for p in (1, 2, 3, 6) if model.num_layers % p == 0]))
    return UnitLayout(
        model=model, tp=tp, pp=pp, training=draw(st.booleans()), scalar_head=draw(st.booleans())
    )


@given(layouts())
def test_canonical_shards_tile_every_tensor_exactly_once(layout):
    counts = {t.key: torch.zeros(t.global_shape, dtype=torch.int32) for t in layout.tensors()}
    for _, shard in layout.all_shards():
        if shard.replica_id == 0:
            region = tuple(slice(a, b) for a, b in shard.region())
            counts[shard.key][region] += 1
    assert all(bool((c == 1).all()) for c in counts.values())
    if layout.training:
        keys = {t.key for t in layout.tensors()}
        assert all(
            f"{k}::{s}" in keys
            for k in keys
            if "::" not in k
            for s in ("master", "exp_avg", "exp_avg_sq")
        )


def test_shard_metadata_validates_itself():
    with pytest.raises(ShardError, match=r"ShardSpec\(w .*dim 0 slice \[3, 7\) outside \[0, 5\)"):
        ShardSpec(
            key="w",
            global_shape=(5, 2),
            global_offset=(3, 0),
            local_shape=(4, 2),
            replica_id=0,
            dtype="bf16",
        )
    with pytest.raises(ShardError, match="differ in rank"):
        ShardSpec(
            key="w",
            global_shape=(5,),
            global_offset=(0, 0),
            local_shape=(5,),
            replica_id=0,
            dtype="bf16",
        )


def test_layouts_the_model_cannot_take_are_refused():
    model = CATALOG.model("qwen2.5-7b")  # 28 heads, 4 KV heads, 28 layers
    with pytest.raises(
        ShardError, match="tp: 28 heads and 4 KV heads must both be divisible by tp=8"
    ):
        UnitLayout(model=model, tp=8, pp=1, training=False)
    with pytest.raises(ShardError, match="pp: 28 layers are not divisible by pp=3"):
        UnitLayout(model=model, tp=1, pp=3, training=False)
    layout = UnitLayout(model=model, tp=2, pp=2, training=False)
    with pytest.raises(ShardError, match="position: 4 outside a 2x2 unit"):
        layout.shards(4)
    assert layout.num_positions == 4
