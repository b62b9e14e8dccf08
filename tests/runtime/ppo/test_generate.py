"""The torch generation backend: seeded sampling, EOS and length limits, log-probs, filters."""

import math

import pytest
import torch

from runtime.planner.catalog import default_catalog
from runtime.ppo.algorithm import token_logprobs
from runtime.ppo.generate import (
    SamplingParams,
    TorchGenerationBackend,
    filter_logits,
)
from runtime.ppo.model import build_model

CONFIG = default_catalog().model("tiny-sft")
PROMPTS = [[1, 5, 6, 3], [1, 7, 3], [1, 8, 9, 10, 11, 3]]


def _backend(seed: int = 0) -> TorchGenerationBackend:
    return TorchGenerationBackend(build_model(CONFIG, scalar_head=False, seed=seed), pad_token_id=0)


def test_same_seed_same_tokens_other_seed_other_tokens():
    backend = _backend()
    params = SamplingParams(max_new_tokens=8, eos_token_id=None, seed=3)
    first = backend.generate(PROMPTS, params)
    again = backend.generate(PROMPTS, params)
    other = backend.generate(PROMPTS, SamplingParams(max_new_tokens=8, eos_token_id=None, seed=4))
    assert torch.equal(first.response_tokens, again.response_tokens)
    assert torch.equal(first.logprobs, again.logprobs)
    assert not torch.equal(first.response_tokens, other.response_tokens)


def test_logprobs_equal_a_full_forward_over_the_rollout():
    backend = _backend()
    rollout = backend.generate(PROMPTS, SamplingParams(max_new_tokens=7, eos_token_id=None, seed=1))
    logits = backend.model(rollout.sequences, attention_mask=rollout.attention_mask)
    start = rollout.prompt_length - 1
    expected = token_logprobs(logits[:, start:-1], rollout.response_tokens)
    torch.testing.assert_close(rollout.logprobs, expected, atol=1e-5, rtol=1e-4)
    assert rollout.response_tokens.shape == (3, 7)
    assert rollout.response_lengths.tolist() == [7, 7, 7]


def test_temperature_scales_the_reported_logprobs():
    backend = _backend()
    params = SamplingParams(max_new_tokens=3, eos_token_id=None, temperature=0.5, seed=1)
    rollout = backend.generate(PROMPTS, params)
    logits = backend.model(rollout.sequences, attention_mask=rollout.attention_mask)
    start = rollout.prompt_length - 1
    expected = token_logprobs(logits[:, start:-1] / 0.5, rollout.response_tokens)
    torch.testing.assert_close(rollout.logprobs, expected, atol=1e-5, rtol=1e-4)


def test_greedy_follows_the_argmax_and_top_k_one_is_greedy():
    backend = _backend()
    greedy = backend.generate(
        PROMPTS, SamplingParams(max_new_tokens=5, eos_token_id=None, temperature=0)
    )
    top1 = backend.generate(
        PROMPTS, SamplingParams(max_new_tokens=5, eos_token_id=None, top_k=1, seed=9)
    )
    assert torch.equal(greedy.response_tokens, top1.response_tokens)
    logits = backend.model(greedy.sequences, attention_mask=greedy.attention_mask)
    start = greedy.prompt_length - 1
    assert torch.equal(logits[:, start:-1].argmax(-1), greedy.response_tokens)


def test_eos_ends_a_response_and_pads_the_rest():
    backend = _backend()
    params = SamplingParams(max_new_tokens=6, eos_token_id=None, temperature=0)
    free = backend.generate(PROMPTS, params)
    eos = int(free.response_tokens[1, 2])  # make the third token of row 1 the EOS
    rollout = backend.generate(
        PROMPTS, SamplingParams(max_new_tokens=6, eos_token_id=eos, temperature=0)
    )
    row = rollout.response_tokens[1].tolist()
    assert row[:3] == free.response_tokens[1, :3].tolist() and row[2] == eos
    assert row[3:] == [0] * (len(row) - 3)
    assert rollout.response_mask[1].tolist() == [1, 1, 1] + [0] * (len(row) - 3)
    assert rollout.logprobs[1, 3:].abs().sum() == 0
    assert rollout.response_lengths[1] == 3
    assert rollout.responses()[1] == row[:3]
    for r, response in enumerate(rollout.responses()):  # other rows stop at their own first EOS
        first = response.index(eos) + 1 if eos in response else 6
        assert len(response) == first and rollout.response_lengths[r] == first


def test_generation_stops_early_when_every_response_ended():
    backend = _backend()
    greedy = backend.generate(
        [[1, 5, 3]], SamplingParams(max_new_tokens=4, eos_token_id=None, temperature=0)
    )
    eos = int(greedy.response_tokens[0, 0])
    rollout = backend.generate(
        [[1, 5, 3]], SamplingParams(max_new_tokens=4, eos_token_id=eos, temperature=0)
    )
    assert rollout.response_tokens.tolist() == [[eos]]


def test_top_k_and_top_p_filters_keep_the_expected_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isfinite(filter_logits(logits, top_k=2, top_p=1.0)).tolist() == [
        [True, True, False, False]
    ]
    # 0.5 < 0.7 so the second token is needed; 0.5 + 0.3 >= 0.7 so the third is not.
    kept = torch.isfinite(filter_logits(logits, top_k=0, top_p=0.7))
    assert kept.tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, top_k=0, top_p=0.4)).tolist() == [
        [True, False, False, False]
    ]


def test_sampling_never_leaves_the_filtered_set():
    backend = _backend()
    params = SamplingParams(max_new_tokens=6, eos_token_id=None, top_k=2, seed=5)
    rollout = backend.generate(PROMPTS, params)
    logits = backend.model(rollout.sequences, attention_mask=rollout.attention_mask)
    start = rollout.prompt_length - 1
    top2 = logits[:, start:-1].topk(2, dim=-1).indices
    assert (top2 == rollout.response_tokens[..., None]).any(-1).all()


def test_load_weights_changes_what_is_generated():
    backend = _backend(seed=0)
    params = SamplingParams(max_new_tokens=6, eos_token_id=None, temperature=0)
    before = backend.generate(PROMPTS, params).response_tokens
    other = build_model(CONFIG, scalar_head=False, seed=1)
    backend.load_weights(other.state_dict())
    after = backend.generate(PROMPTS, params).response_tokens
    expected = TorchGenerationBackend(other, pad_token_id=0).generate(PROMPTS, params)
    assert torch.equal(after, expected.response_tokens) and not torch.equal(before, after)


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("max_new_tokens", {"max_new_tokens": 0}),
        ("temperature", {"temperature": -1.0}),
        ("temperature", {"temperature": math.inf}),
        ("top_k", {"top_k": -1}),
        ("top_p", {"top_p": 0.0}),
    ],
)
def test_bad_sampling_params_name_the_field(field, kwargs):
    values = {"max_new_tokens": 4, "eos_token_id": None, **kwargs}
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**values)


def test_empty_prompts_are_refused():
    params = SamplingParams(max_new_tokens=2, eos_token_id=None)
    with pytest.raises(ValueError, match="prompts: need at least one"):
        _backend().generate([], params)
    with pytest.raises(ValueError, match="prompts: every prompt"):
        _backend().generate([[1], []], params)


def _head_positions(model) -> list[int]:
    """Record the positions each call of the LM head computes logits for."""
    seen: list[int] = []
    model.lm_head.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[1]))
    return seen


def test_generation_computes_logits_at_the_last_position_only():
    """Sampling needs the last position's logits: a prompt's logits at every position would be
    batch × prompt × vocab floats (16 GiB for 64 prompts of 512 tokens at a 128K vocabulary)."""
    backend = _backend()
    seen = _head_positions(backend.model)
    params = SamplingParams(max_new_tokens=5, eos_token_id=None, seed=2)
    rollout = backend.generate(PROMPTS, params)
    assert seen == [1] * 5
    logits = backend.model(rollout.sequences, attention_mask=rollout.attention_mask)
    start = rollout.prompt_length - 1
    expected = token_logprobs(logits[:, start:-1], rollout.response_tokens)
    torch.testing.assert_close(rollout.logprobs, expected, atol=1e-5, rtol=1e-4)


def test_a_slot_generates_from_the_last_position_and_a_response_depends_on_its_row_only():
    """The slots' own generation (``slot_work.generate``, here on one in-process slot, no group
    needed at tp = pp = 1): one logits position per call, and each row's response the same
    whether its wave held every prompt or one (noise is drawn a step at a time per row)."""
    from runtime.emu.primitives import Unit
    from runtime.engine.slots import SlotContext
    from runtime.planner import Layout
    from runtime.planner.workload import ModelStage
    from runtime.ppo import slot_work
    from runtime.transition.units import unit_layout

    ms = ModelStage(role="actor", stage="generation", model=CONFIG)
    layout = unit_layout(ms, Layout(dp=1, tp=1, pp=1), "fp32")
    unit = Unit(unit_id="g", model_stage=ms.name, layout=layout, slots=(0,))
    params = SamplingParams(max_new_tokens=6, eos_token_id=None, seed=4)

    def run(micro_batch: int):
        ctx = SlotContext(slot_index=0, rank=0, world_size=1)
        seen = _head_positions(slot_work.workspace(ctx, unit).model)
        out = slot_work.generate(
            ctx,
            unit=unit,
            prompts=PROMPTS,
            rows=[7, 8, 9],
            params=params,
            pad_token_id=0,
            micro_batch=micro_batch,
        )
        return out, seen

    whole, seen = run(0)
    assert seen == [1] * params.max_new_tokens
    one_by_one, _ = run(1)
    assert torch.equal(whole["response_tokens"], one_by_one["response_tokens"])
    torch.testing.assert_close(whole["logprobs"], one_by_one["logprobs"])
