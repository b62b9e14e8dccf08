"""The memory model: bytes per slot of one model-stage in one layout, by component.

Components: parameters, gradients and Adam state (fp32 master weights and two moments) for training;
activations (Korthikanti et al.'s per-layer count with flash attention, ``s·b·h·(10 + 24/tp)``, or the
layer inputs only under full recomputation; a 1F1B first stage holds up to ``pp`` micro-batches of
its ``L/pp`` layers); fp32 logits; the KV cache of the sequences generation decodes at once (all
of a unit's, or a wave of them); a workspace (2% of the device, for cuBLAS/attention scratch
and allocator slack); 64 MiB of buffers per communicator; and the
co-resident weights of the other models, which stay on the slots between stages while gradients,
optimizer state and KV caches are released. Feasible means the total fits in the device with 10%
headroom.
"""

from __future__ import annotations

import numpy as np

from runtime.planner.shapes import LayoutShape

HEADROOM = 0.10
WORKSPACE_FRACTION = 0.02
COLLECTIVE_BUFFER_BYTES = 64 * 2**20
ADAM_BYTES_PER_PARAM = 12  # fp32 master weights + first and second moments


def memory_budget(capacity_bytes: float) -> float:
    """Bytes a slot may plan to use: its capacity less the headroom."""
    return capacity_bytes * (1.0 - HEADROOM)


def co_resident_bytes(shape: LayoutShape, num_slots: int) -> float:
    """Weights of the other models, kept sharded evenly over the pool between stages."""
    workload = shape.workload
    others = {role: m for role, m in workload.models.items() if role != shape.ms.role}
    total = 0.0
    for role, model in others.items():
        total += (
            model.num_params(scalar_head=role in ("critic", "reward")) * workload.bytes_per_value
        )
    return total / max(1, num_slots)


def memory_breakdown(shape: LayoutShape, *, num_slots: int) -> dict[str, np.ndarray]:
    """Bytes per slot by component, one value per dp in ``shape.dp``."""
    w, ms, model = shape.workload, shape.ms, shape.ms.model
    b = w.bytes_per_value
    zeros = np.zeros_like(shape.dp)
    params = shape.params_per_slot
    h, seq, layers = model.hidden_size, w.seq_len, model.num_layers / shape.pp
    vocab_cols = (1 if ms.scalar_head else model.vocab_size) / shape.tp
    out = {"weights": zeros + params * b}

    if ms.stage == "training":
        out["gradients"] = zeros + params * b
        shards = shape.dp if w.distributed_optimizer else 1.0
        out["optimizer"] = params * ADAM_BYTES_PER_PARAM / shards + zeros
        full_layer = seq * shape.mb * h * (10 + 24 / shape.tp)
        per_layer = 2 * seq * shape.mb * h if w.recompute else full_layer
        in_flight = np.minimum(shape.pp, shape.micro_batches(shape.mb, per_flush=w.ppo_minibatches))
        out["activations"] = in_flight * layers * per_layer + (full_layer if w.recompute else 0.0)
        out["logits"] = zeros + seq * shape.mb * vocab_cols * 4
    elif ms.stage == "inference":
        out["activations"] = zeros + seq * shape.mb * h * (10 + 24 / shape.tp)
        out["logits"] = zeros + seq * shape.mb * vocab_cols * 4
    else:  # generation: every sequence a unit decodes at once keeps its KV cache until it
        # finishes (the unit's others wait for a later wave)
        per_sequence = 2 * layers * shape.kv_dim_per_slot * seq * b
        out["kv_cache"] = shape.concurrent * per_sequence
        out["logits"] = np.minimum(shape.concurrent, w.gen_micro_batch) * vocab_cols * 4
    capacity = shape.accelerator.memory_bytes
    out["workspace"] = zeros + WORKSPACE_FRACTION * capacity
    groups = (shape.tp > 1) + (shape.pp > 1) + (shape.dp > 1)
    out["collective_buffers"] = groups * COLLECTIVE_BUFFER_BYTES
    out["co_resident"] = zeros + co_resident_bytes(shape, num_slots)
    return out


def total_bytes(breakdown: dict[str, np.ndarray]) -> np.ndarray:
    return sum(breakdown.values())
