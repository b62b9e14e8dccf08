"""The Llama decoders: Hugging Face names and shapes, seeded init, masks, KV cache and heads."""

import pytest
import torch

from runtime.emu.layout import model_tensors
from runtime.planner.catalog import ModelConfig, default_catalog
from runtime.ppo.model import apply_rotary, attention_mask_4d, build_model, rotary_cos_sin

CATALOG = default_catalog()
QWEN_LIKE = ModelConfig(
    name="tiny-qwen",
    vocab_size=40,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    qkv_bias=True,
)
TIED = ModelConfig(
    name="tiny-tied",
    vocab_size=40,
    hidden_size=32,
    intermediate_size=48,
    num_layers=1,
    num_heads=4,
    num_kv_heads=1,
    tie_embeddings=True,
)


@pytest.mark.parametrize("scalar_head", [False, True])
@pytest.mark.parametrize(
    "config", [CATALOG.model("tiny-llama"), CATALOG.model("tiny-sft"), QWEN_LIKE, TIED]
)
def test_state_dict_equals_the_layout_tensor_specs(config, scalar_head):
    model = build_model(config, scalar_head=scalar_head, seed=0)
    got = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    specs = model_tensors(config, scalar_head=scalar_head, pp=1)
    assert got == {spec.key: spec.global_shape for spec in specs}
    assert sum(p.numel() for p in model.parameters()) == config.num_params(scalar_head=scalar_head)


def test_initialisation_is_seeded():
    config = CATALOG.model("tiny-sft")
    first, again, other = (
        build_model(config, scalar_head=False, seed=s).state_dict() for s in (7, 7, 8)
    )
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["lm_head.weight"], other["lm_head.weight"])
    assert torch.equal(first["model.norm.weight"], torch.ones(config.hidden_size))
    assert abs(float(first["model.embed_tokens.weight"].std()) - 0.02) < 0.002


def test_rotary_rotates_pairs_split_in_halves_by_position_times_frequency():
    x = torch.tensor([1.0, 0.0, 0.0, 1.0]).view(1, 1, 1, 4)
    cos, sin = rotary_cos_sin(torch.tensor([[2]]), head_dim=4, theta=100.0)
    # Pairs are (x0, x2) and (x1, x3) with frequencies 1 and 1/10: angles 2 and 0.2 radians.
    a, b = torch.tensor(2.0), torch.tensor(0.2)
    expected = torch.stack([a.cos(), -b.sin(), a.sin(), b.cos()]).view(1, 1, 1, 4)
    torch.testing.assert_close(apply_rotary(x, cos, sin), expected)


def test_attention_mask_is_causal_over_real_keys_and_always_sees_itself():
    mask = attention_mask_4d(torch.tensor([[0, 1, 1]]), num_queries=3)[0, 0]
    assert mask.tolist() == [[True, False, False], [False, True, False], [False, True, True]]
    last = attention_mask_4d(torch.tensor([[0, 1, 1]]), num_queries=1)[0, 0]
    assert last.tolist() == [[False, True, True]]


def test_left_padding_does_not_change_a_sequence_outputs():
    model = build_model(CATALOG.model("tiny-llama"), scalar_head=False, seed=1)
    tokens = torch.tensor([[5, 6, 7, 8]])
    alone = model(tokens)
    padded = model(
        torch.tensor([[0, 0, 5, 6, 7, 8]]), attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1]])
    )
    torch.testing.assert_close(padded[:, 2:], alone, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("config", [CATALOG.model("tiny-llama"), QWEN_LIKE, TIED])
def test_kv_cache_decoding_equals_the_full_forward(config):
    model = build_model(config, scalar_head=False, seed=2)
    tokens = torch.randint(3, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(tokens)
    mask[1, :3] = 0
    full = model(tokens, attention_mask=mask)
    cache = model.new_cache(max_len=9)
    steps = [model(tokens[:, :5], attention_mask=mask[:, :5], cache=cache)]
    for end in range(6, 10):
        steps.append(model(tokens[:, end - 1 : end], attention_mask=mask[:, :end], cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)
    with pytest.raises(RuntimeError, match="KV cache overflow"):
        model(tokens[:, :1], attention_mask=torch.ones(2, 10, dtype=torch.long), cache=cache)


def test_mask_of_the_wrong_length_names_the_argument():
    model = build_model(CATALOG.model("tiny-sft"), scalar_head=False, seed=0)
    with pytest.raises(ValueError, match="attention_mask"):
        model(torch.ones(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 3))


def test_score_head_gives_per_token_values_and_the_reward_at_the_last_real_token():
    config = CATALOG.model("tiny-sft")
    critic = build_model(config, scalar_head=True, seed=3)
    tokens = torch.tensor([[0, 5, 6, 7, 0], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    values = critic(tokens, attention_mask=mask)
    assert values.shape == (2, 5)
    reward = critic.last_token_score(tokens, mask)
    torch.testing.assert_close(reward, torch.stack([values[0, 3], values[1, 4]]))
    # The score is the score head applied to the final hidden state.
    hidden = critic.model(tokens, attention_mask=mask)
    torch.testing.assert_close(values, hidden @ critic.score.weight[0])
