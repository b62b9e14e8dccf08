"""The memory model: bytes per slot of one model-stage in one layout, by component.

Components: parameters, gradients and Adam state (fp32 master weights and two moments) for training,
and the fp32 gradients the update makes once the backward is done (only what they need beyond the
activations and logits the backward released); activations (Korthikanti et al.'s per-layer count
with flash attention, ``s·b·h·(10 + 24/tp)``, or the layer inputs only under full recomputation; a
1F1B first stage holds up to ``pp`` micro-batches of its ``L/pp`` layers, the last stage one
micro-batch and the logits with what the loss derives from them, and the fuller of the two
counts); the KV cache of the sequences generation decodes at once (all of a unit's, or a wave of
them); a workspace (2% of the device, for cuBLAS/attention scratch and allocator slack); 64 MiB of
buffers per communicator; and the co-resident state of the other models: the frozen models'
weights, which rest sharded evenly over the pool between uses, and the training units' weights,
gradients and Adam state, which stay on their slots through the whole step. Feasible means the
total fits in the device with 10% headroom.
"""

from __future__ import annotations

import numpy as np

from runtime.planner.shapes import ADAM_BYTES_PER_PARAM, FP32_GRADIENT_BYTES_PER_PARAM, LayoutShape

HEADROOM = 0.10
WORKSPACE_FRACTION = 0.02
COLLECTIVE_BUFFER_BYTES = 64 * 2**20

# Bytes per (token × vocabulary column a tensor-parallel rank holds) that the LM head's logits and
# what the loss derives from them take on the last stage, counted in fp32 copies of the logits as
# ``runtime/ppo``'s ``token_logprobs`` and ``entropy`` keep them (measured with autograd's
# saved-tensor hooks on bf16 logits):
TRAINING_LOGITS_BYTES = 14
"""3.5 copies: the bf16 logits (half a copy), their fp32 upcast, the log-softmax and the
entropy's softmax saved for the backward (three), and the logits' gradient while the backward
frees them."""
INFERENCE_LOGITS_BYTES = 10
"""2.5 copies: the bf16 logits, their fp32 upcast and the log-softmax of the log-probabilities
and the entropy, with no backward to keep anything for."""
SCALAR_HEAD_BYTES = 4
"""A critic's or reward model's head: one fp32 value per token."""


def memory_budget(capacity_bytes: float) -> float:
    """Bytes a slot may plan to use: its capacity less the headroom."""
    return capacity_bytes * (1.0 - HEADROOM)


def co_resident_bytes(shape: LayoutShape, num_slots: int) -> float:
    """State of the other models that stays on a slot while this model-stage runs: the frozen
    models' weights (reference, reward), which rest sharded evenly over the pool between uses,
    and the training units' state (``training_state_beside``)."""
    workload, ms = shape.workload, shape.ms
    trained = {t.role for t in workload.model_stages("training")}
    frozen = sum(
        model.num_params(scalar_head=role in ("critic", "reward"))
        for role, model in workload.models.items()
        if role not in trained and role != ms.role
    )
    return frozen * workload.bytes_per_value / max(1, num_slots) + training_state_beside(
        shape, num_slots
    )


def training_state_beside(shape: LayoutShape, num_slots: int) -> float:
    """The training units' state (actor, critic: weights, gradients, Adam) on a slot of this
    model-stage, which stays where those units are through the whole step (a training
    model-stage counts its own in its components). A training unit is placed over the pool like
    any unit, so the fullest slot of one model-stage may hold a shard of each: its bytes per
    slot are counted as they are on the fullest slot of the training units
    (``shape.resident``), or, not knowing their layout, at their least (the whole state spread
    evenly over the pool)."""
    ms = shape.ms
    resident = dict(shape.resident) if shape.resident is not None else {}
    total = 0.0
    for training in shape.workload.model_stages("training"):
        if ms.stage == "training" and training.role == ms.role:
            continue  # its own: weights, gradients and optimizer in its components
        if training.role in resident:
            total += resident[training.role]
            continue
        least = LayoutShape(
            ms=training,
            workload=shape.workload,
            accelerator=shape.accelerator,
            tp=1,
            pp=1,
            dp=np.array([1.0]),
        )
        total += training.num_params * float(least.training_bytes_per_param[0]) / max(1, num_slots)
    return total


def memory_breakdown(shape: LayoutShape, *, num_slots: int) -> dict[str, np.ndarray]:
    """Bytes per slot by component on the fullest slot, one value per dp in ``shape.dp``.

    With a pipeline, the first and the last stage are each accounted for as they are (the first
    holds the embedding and, in training, up to ``pp`` micro-batches in flight; the last holds
    the head, one micro-batch and the logits) and the fuller of the two is the answer: no slot
    holds both ends' loads. Stages between them hold no more than the first."""
    if shape.pp == 1:
        return _slot_bytes(shape, num_slots, shape.stage_params / shape.tp, first=True, last=True)
    model = shape.ms.model
    layers = model.num_layers / shape.pp * model.params_per_layer
    head = model.head_params(scalar_head=shape.ms.scalar_head) + model.hidden_size
    first = _slot_bytes(
        shape, num_slots, (model.embedding_params + layers) / shape.tp, first=True, last=False
    )
    last = _slot_bytes(shape, num_slots, (head + layers) / shape.tp, first=False, last=True)
    first_fuller = total_bytes(first) >= total_bytes(last)
    return {k: np.where(first_fuller, first[k], last[k]) for k in first}


def _slot_bytes(
    shape: LayoutShape, num_slots: int, params: float, *, first: bool, last: bool
) -> dict[str, np.ndarray]:
    """Bytes by component of a slot of the pipeline stage holding ``params`` parameters per
    slot; ``first``/``last``: whether that stage is the pipeline's first (the most micro-batches
    in flight) and its last (the logits)."""
    w, ms, model = shape.workload, shape.ms, shape.ms.model
    b = w.bytes_per_value
    zeros = np.zeros_like(shape.dp)
    h, seq, layers = model.hidden_size, w.seq_len, model.num_layers / shape.pp
    out = {"weights": zeros + params * b}

    def logits(tokens, bytes_per_column: float):
        """The last stage's logits for ``tokens`` tokens, at ``bytes_per_column`` per (token ×
        vocabulary column of a rank); a scalar head's one value per token."""
        if not last:
            return zeros
        if ms.scalar_head:
            return zeros + tokens * SCALAR_HEAD_BYTES / shape.tp
        return zeros + tokens * model.vocab_size / shape.tp * bytes_per_column

    if ms.stage == "training":
        # Accumulated in the weights' precision through the backward, and kept until the next
        # step's update.
        out["gradients"] = zeros + params * b
        shards = shape.dp if w.distributed_optimizer else 1.0
        out["optimizer"] = params * ADAM_BYTES_PER_PARAM / shards + zeros
        full_layer = seq * shape.mb * h * (10 + 24 / shape.tp)
        per_layer = 2 * seq * shape.mb * h if w.recompute else full_layer
        in_flight = (
            np.minimum(shape.pp, shape.micro_batches(shape.mb, per_flush=w.ppo_minibatches))
            if first
            else 1.0
        )
        out["activations"] = in_flight * layers * per_layer + (full_layer if w.recompute else 0.0)
        out["logits"] = logits(seq * shape.mb, TRAINING_LOGITS_BYTES)
        # The update (``runtime/ppo/slot_work.py``, ``_gradients``) copies the gradients to fp32
        # (no copy when the weights are fp32) and, with data parallelism, concatenates them into
        # one more fp32 buffer for the all-reduce, both alive at once. It runs after the
        # backward, which has released the activations and the logits: only what it needs
        # beyond them raises the slot's peak.
        copies = float(b != FP32_GRADIENT_BYTES_PER_PARAM) + np.where(shape.dp > 1, 1.0, 0.0)
        update = params * FP32_GRADIENT_BYTES_PER_PARAM * copies
        out["gradient_update"] = np.maximum(0.0, update - out["activations"] - out["logits"])
    elif ms.stage == "inference":
        out["activations"] = zeros + seq * shape.mb * h * (10 + 24 / shape.tp)
        out["logits"] = logits(seq * shape.mb, INFERENCE_LOGITS_BYTES)
    else:  # generation: every sequence a unit decodes at once keeps its KV cache until it
        # finishes (the unit's others wait for a later wave); it samples one token of each
        # sequence of a micro-batch at a time, from fp32 logits
        per_sequence = 2 * layers * shape.kv_dim_per_slot * seq * b
        out["kv_cache"] = shape.concurrent * per_sequence
        out["logits"] = logits(np.minimum(shape.concurrent, w.gen_micro_batch), 4)
    capacity = shape.accelerator.memory_bytes
    out["workspace"] = zeros + WORKSPACE_FRACTION * capacity
    groups = (shape.tp > 1) + (shape.pp > 1) + (shape.dp > 1)
    out["collective_buffers"] = groups * COLLECTIVE_BUFFER_BYTES
    out["co_resident"] = zeros + co_resident_bytes(shape, num_slots)
    return out


def total_bytes(breakdown: dict[str, np.ndarray]) -> np.ndarray:
    return sum(breakdown.values())
