"""Tensor parallelism over gloo on CPU: two processes give the single-process outputs and hold the
shards ``runtime.emu.layout`` describes."""

import gc
import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from runtime.emu.layout import UnitLayout, placement, shard_of
from runtime.planner.catalog import ModelConfig, default_catalog
from runtime.ppo.generate import SamplingParams, TorchGenerationBackend
from runtime.ppo.model import build_model
from runtime.ppo.parallel import apply_tensor_parallel, check_tensor_parallel

TP = 2


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _inputs(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(3, vocab_size, (3, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(tokens)
    mask[0, :4] = 0  # a left-padded row
    return tokens, mask


def _check_shards(model, *, scalar_head: bool, rank: int) -> None:
    specs = UnitLayout(
        model=model.config, tp=TP, pp=1, training=False, scalar_head=scalar_head
    ).tensors()
    params = dict(model.named_parameters())
    assert set(params) == {spec.key for spec in specs}
    for spec in specs:
        param = params[spec.key]
        if spec.shard_dim is None:  # replicated: left a plain tensor on every rank
            assert not isinstance(param, DTensor), spec.key
            continue
        assert param.placements == (placement(spec),), spec.key
        assert tuple(param.to_local().shape) == shard_of(spec, rank, TP).local_shape, spec.key


def _join(rank: int, port: int) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=TP,
        timeout=timedelta(seconds=60),
    )


def _run(rank: int, port: int, checks) -> None:
    """Join the group, run ``checks(mesh, rank)``, leave cleanly."""
    _join(rank, port)
    checks(init_device_mesh("cpu", (TP,)), rank)
    # Free the mesh and the DTensors before the group: a process group that outlives
    # destroy_process_group is torn down at interpreter exit, where gloo can abort the process.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


@torch.no_grad()
def _check_causal_lm(mesh, rank: int) -> None:
    config = default_catalog().model("tiny-llama")
    tokens, mask = _inputs(config.vocab_size)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, eos_token_id=None)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    model = build_model(config, scalar_head=False, seed=11)
    expected = model(tokens, attention_mask=mask)
    greedy = TorchGenerationBackend(model, pad_token_id=0).generate(prompts, params)
    apply_tensor_parallel(model, mesh)
    _check_shards(model, scalar_head=False, rank=rank)
    logits = model(tokens, attention_mask=mask)
    assert not isinstance(logits, DTensor)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-4)
    rollout = TorchGenerationBackend(model, pad_token_id=0).generate(prompts, params)
    assert torch.equal(rollout.response_tokens, greedy.response_tokens)
    torch.testing.assert_close(rollout.logprobs, greedy.logprobs, atol=1e-5, rtol=0)


@torch.no_grad()
def _check_score_model(mesh, rank: int) -> None:
    config = default_catalog().model("tiny-llama")
    tokens, mask = _inputs(config.vocab_size)
    model = build_model(config, scalar_head=True, seed=12)
    values = model(tokens, attention_mask=mask)
    apply_tensor_parallel(model, mesh)
    _check_shards(model, scalar_head=True, rank=rank)
    torch.testing.assert_close(model(tokens, attention_mask=mask), values, atol=1e-5, rtol=1e-4)
    last = model.last_token_score(tokens, mask)
    torch.testing.assert_close(last, values[:, -1], atol=1e-5, rtol=1e-4)


def _check_forward(mesh, rank: int) -> None:
    _check_causal_lm(mesh, rank)
    _check_score_model(mesh, rank)


def test_tp2_over_gloo_matches_single_process_logits_scores_generation_and_layout():
    mp.spawn(_run, args=(_free_port(), _check_forward), nprocs=TP, join=True)


def _check_gradients(mesh, rank: int) -> None:
    config = default_catalog().model("tiny-sft")
    tokens, mask = _inputs(config.vocab_size)
    reference = build_model(config, scalar_head=False, seed=3)
    reference(tokens, attention_mask=mask).logsumexp(-1).sum().backward()
    model = apply_tensor_parallel(build_model(config, scalar_head=False, seed=3), mesh)
    model(tokens, attention_mask=mask).logsumexp(-1).sum().backward()
    for name in ("model.layers.1.self_attn.o_proj.weight", "model.embed_tokens.weight"):
        grad = dict(model.named_parameters())[name].grad
        full = grad.redistribute(mesh, (Replicate(),)).to_local()
        expected = dict(reference.named_parameters())[name].grad
        torch.testing.assert_close(full, expected, atol=1e-5, rtol=1e-4)


def test_tp2_gradients_equal_single_process_gradients():
    mp.spawn(_run, args=(_free_port(), _check_gradients), nprocs=TP, join=True)


def _config(**overrides) -> ModelConfig:
    values = {
        "name": "odd",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_layers": 1,
        "num_heads": 4,
        "num_kv_heads": 2,
        **overrides,
    }
    return ModelConfig(**values)


@pytest.mark.parametrize(
    ("overrides", "lm_head", "message"),
    [
        ({"hidden_size": 24, "num_heads": 3, "num_kv_heads": 3}, True, "tp: 3 heads"),
        ({"num_kv_heads": 1}, False, "tp: 4 heads and 1 KV heads"),
        ({"vocab_size": 63}, False, "odd.vocab_size: 63"),
        ({"intermediate_size": 47}, True, "odd.intermediate_size: 47"),
        ({"tie_embeddings": True}, True, "odd.tie_embeddings"),
    ],
)
def test_configs_that_do_not_split_evenly_are_refused(overrides, lm_head, message):
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(_config(**overrides), tp=TP, lm_head=lm_head)


def test_a_tied_scalar_head_model_and_even_configs_are_accepted():
    check_tensor_parallel(_config(tie_embeddings=True), tp=TP, lm_head=False)
    check_tensor_parallel(default_catalog().model("llama-3.1-8b"), tp=8, lm_head=True)


@pytest.mark.parametrize(
    ("micro_batches", "stages", "schedule"),
    [
        (8, 4, "Schedule1F1B"),
        (4, 4, "Schedule1F1B"),
        (2, 4, "ScheduleGPipe"),
        (1, 2, "ScheduleGPipe"),
    ],
)
def test_training_pipelines_hold_at_most_a_stage_count_of_micro_batches(
    micro_batches, stages, schedule
):
    """The memory model counts min(pp, micro-batches) in flight on a first stage: 1F1B's count,
    where GPipe would hold every micro-batch until the backward."""
    from runtime.ppo.slot_work import schedule_class

    assert schedule_class(micro_batches, stages).__name__ == schedule
