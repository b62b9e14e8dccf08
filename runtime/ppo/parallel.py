"""Tensor parallelism for the decoders of ``runtime.ppo.model`` through PyTorch DTensor.

Megatron-style sharding on a 1-D device mesh, the placements ``runtime.emu.layout`` records:

- ``q/k/v_proj`` and ``gate/up_proj`` are column-parallel: each rank computes a slice of the heads
  or of the MLP's inner features, with no communication;
- ``o_proj`` and ``down_proj`` are row-parallel: each rank multiplies its slice and the partial
  sums are all-reduced, so every layer costs two all-reduces;
- ``embed_tokens`` and ``lm_head`` are vocabulary-parallel: each rank holds a slice of the
  vocabulary; embedding lookups are masked and all-reduced, logits are all-gathered;
- norms and the scalar ``score`` head stay whole (replicated) on every rank.

Every sharded dimension must split evenly (``check_tensor_parallel``).

Activations between blocks are plain replicated tensors, so the model's forward code, its KV cache
and generation run unchanged on the local shards. Load weights before parallelizing: afterwards the
parameters are DTensors holding only their local shard.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from runtime.planner.catalog import ModelConfig
from runtime.ppo.model import LlamaForCausalLM, LlamaForScore


def tensor_parallel_plan(model: LlamaForCausalLM | LlamaForScore) -> dict[str, object]:
    """``parallelize_module``'s plan for the model: module path → parallel style."""
    plan: dict[str, object] = {
        # Row-wise on an embedding shards its table by vocabulary row (dim 0).
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
    }
    for i in range(model.config.num_layers):
        prefix = f"model.layers.{i}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            plan[f"{prefix}.{name}"] = ColwiseParallel()
        plan[f"{prefix}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"{prefix}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"{prefix}.mlp.up_proj"] = ColwiseParallel()
        plan[f"{prefix}.mlp.down_proj"] = RowwiseParallel()
    if isinstance(model, LlamaForCausalLM):
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def check_tensor_parallel(config: ModelConfig, *, tp: int, lm_head: bool) -> None:
    """Raise ``ValueError`` naming the field when ``config`` cannot be split ``tp`` ways.

    Every sharded dimension must divide evenly: DTensor's parallel styles assume equal local
    shards (an uneven vocabulary silently gives wrong embeddings, an uneven MLP fails to run).
    """
    if config.num_heads % tp or config.num_kv_heads % tp:
        raise ValueError(
            f"tp: {config.num_heads} heads and {config.num_kv_heads} KV heads must both be "
            f"divisible by tp={tp}"
        )
    for field in ("vocab_size", "intermediate_size"):
        if getattr(config, field) % tp:
            raise ValueError(
                f"{config.name}.{field}: {getattr(config, field)} is not divisible by tp={tp}"
            )
    if config.tie_embeddings and lm_head:
        # The tied head would multiply replicated activations by a vocabulary-sharded table.
        raise ValueError(
            f"{config.name}.tie_embeddings: tied embeddings are not supported under tensor parallelism"
        )


def apply_tensor_parallel(
    model: LlamaForCausalLM | LlamaForScore, mesh: DeviceMesh
) -> LlamaForCausalLM | LlamaForScore:
    """Shard ``model`` in place over the 1-D ``mesh``; returns it."""
    if mesh.ndim != 1:
        raise ValueError(f"mesh: tensor parallelism needs a 1-D mesh, got {mesh.ndim} dimensions")
    check_tensor_parallel(model.config, tp=mesh.size(), lm_head=isinstance(model, LlamaForCausalLM))
    return parallelize_module(model, mesh, tensor_parallel_plan(model))
