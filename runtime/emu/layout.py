"""Shard layouts of a model-stage's state: which slice of every tensor each slot of a unit holds.

A unit is a ``tp × pp`` grid of slots; its slot at position ``p * tp + t`` is pipeline stage ``p``,
tensor rank ``t``. For a Llama-architecture decoder with Hugging Face parameter names:

- column-parallel (``q/k/v/gate/up_proj`` weights and biases): split along dim 0 (output features);
- row-parallel (``o_proj``, ``down_proj``): split along dim 1 (input features);
- vocabulary-parallel (``embed_tokens``, ``lm_head``): split along dim 0 (the vocabulary);
- replicated (RMSNorm weights, the critic's scalar ``score`` head): whole on every tensor rank;
- pipeline stage ``p`` holds layers ``[p·L/pp, (p+1)·L/pp)``, the embedding on the first stage and
  the final norm and head on the last.

Splits follow ``torch.chunk`` (earlier ranks get the ceiling), which is how DTensor's ``Shard(dim)``
places data, so ``placement`` gives the DTensor placement each tensor runs under. Training units
add Adam state per parameter, sharded like it: fp32 master weights and the two moments.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

from runtime.planner.catalog import ModelConfig

COLWISE, ROWWISE, VOCAB, REPLICATED = "colwise", "rowwise", "vocab", "replicated"
OPTIMIZER_STATES = ("master", "exp_avg", "exp_avg_sq")


class ShardError(ValueError):
    """Shard metadata that contradicts itself or its tensor."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TensorSpec:
    """One logical tensor of a model-stage's state."""

    key: str
    global_shape: tuple[int, ...]
    style: str
    dtype: str
    pp_stage: int
    """The pipeline stage (of ``pp``) that holds it."""

    @property
    def shard_dim(self) -> int | None:
        if self.style in (COLWISE, VOCAB):
            return 0
        if self.style == ROWWISE:
            return 1
        return None

    @property
    def numel(self) -> int:
        return math.prod(self.global_shape)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ShardSpec:
    """The slice of one tensor that one slot holds (key, global shape, offset, local shape, replica)."""

    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    replica_id: int
    """0 for the canonical copy; replicated tensors have one per tensor rank."""
    dtype: str
    num_replicas: int = 1
    """How many copies of this slice the unit holds (a replicated tensor's: the tensor ranks)."""

    def __post_init__(self) -> None:
        if not (len(self.global_shape) == len(self.global_offset) == len(self.local_shape)):
            raise ShardError(f"{self}: global shape, offset and local shape differ in rank")
        for dim, (size, offset, local) in enumerate(
            zip(self.global_shape, self.global_offset, self.local_shape, strict=True)
        ):
            if offset < 0 or local < 0 or offset + local > size:
                raise ShardError(
                    f"{self}: dim {dim} slice [{offset}, {offset + local}) outside [0, {size})"
                )
        if not 0 <= self.replica_id < self.num_replicas:
            raise ShardError(
                f"{self}: replica_id {self.replica_id} outside [0, {self.num_replicas})"
            )

    def __str__(self) -> str:
        return (
            f"ShardSpec({self.key} {self.global_offset}+{self.local_shape} of {self.global_shape})"
        )

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    def region(self) -> tuple[tuple[int, int], ...]:
        """Half-open [start, stop) per dimension, in global coordinates."""
        return tuple((o, o + n) for o, n in zip(self.global_offset, self.local_shape, strict=True))

    def view_of(self, full):
        """The slice of a whole tensor ``full`` (of ``global_shape``) this shard covers, as a view."""
        for dim, (start, stop) in enumerate(self.region()):
            full = full.narrow(dim, start, stop - start)
        return full


def assemble(pieces) -> dict:
    """Whole tensors from shards: ``{key: [(ShardSpec, local tensor), ...]}`` (what
    ``UnitEngine.read`` returns) → ``{key: tensor of the global shape}``."""
    import torch

    out = {}
    for key, held in pieces.items():
        full = torch.empty(held[0][0].global_shape, dtype=held[0][1].dtype)
        for spec, tensor in held:
            spec.view_of(full).copy_(tensor)
        out[key] = full
    return out


def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of chunk ``index`` of ``parts`` as ``torch.chunk`` cuts ``size`` (may be empty)."""
    step = -(-size // parts)
    start = min(size, index * step)
    return start, min(size, start + step)


def model_tensors(
    model: ModelConfig, *, scalar_head: bool, pp: int, dtype: str = "bf16"
) -> list[TensorSpec]:
    """Every parameter of the model with its parallel style and pipeline stage."""
    if model.num_layers % pp:
        raise ShardError(f"pp: {model.num_layers} layers are not divisible by pp={pp}")
    h, kv, inter = model.hidden_size, model.kv_dim, model.intermediate_size
    per_stage = model.num_layers // pp
    out = [
        TensorSpec(
            key="model.embed_tokens.weight",
            global_shape=(model.vocab_size, h),
            style=VOCAB,
            dtype=dtype,
            pp_stage=0,
        )
    ]
    for layer in range(model.num_layers):
        stage = layer // per_stage
        prefix = f"model.layers.{layer}"
        shapes = [
            ("self_attn.q_proj.weight", (h, h), COLWISE),
            ("self_attn.k_proj.weight", (kv, h), COLWISE),
            ("self_attn.v_proj.weight", (kv, h), COLWISE),
            ("self_attn.o_proj.weight", (h, h), ROWWISE),
            ("mlp.gate_proj.weight", (inter, h), COLWISE),
            ("mlp.up_proj.weight", (inter, h), COLWISE),
            ("mlp.down_proj.weight", (h, inter), ROWWISE),
            ("input_layernorm.weight", (h,), REPLICATED),
            ("post_attention_layernorm.weight", (h,), REPLICATED),
        ]
        if model.qkv_bias:
            shapes += [
                ("self_attn.q_proj.bias", (h,), COLWISE),
                ("self_attn.k_proj.bias", (kv,), COLWISE),
                ("self_attn.v_proj.bias", (kv,), COLWISE),
            ]
        out += [
            TensorSpec(
                key=f"{prefix}.{name}", global_shape=shape, style=style, dtype=dtype, pp_stage=stage
            )
            for name, shape, style in shapes
        ]
    last = pp - 1
    out.append(
        TensorSpec(
            key="model.norm.weight", global_shape=(h,), style=REPLICATED, dtype=dtype, pp_stage=last
        )
    )
    if scalar_head:
        out.append(
            TensorSpec(
                key="score.weight",
                global_shape=(1, h),
                style=REPLICATED,
                dtype=dtype,
                pp_stage=last,
            )
        )
    elif not model.tie_embeddings:
        out.append(
            TensorSpec(
                key="lm_head.weight",
                global_shape=(model.vocab_size, h),
                style=VOCAB,
                dtype=dtype,
                pp_stage=last,
            )
        )
    return out


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class UnitLayout:
    """The state of one unit of a model-stage: tensors and, per slot position, the shards it holds."""

    model: ModelConfig
    tp: int
    pp: int
    training: bool
    scalar_head: bool = False
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ShardError(f"tp, pp: must be positive, got tp={self.tp} pp={self.pp}")
        if self.model.num_heads % self.tp or self.model.num_kv_heads % self.tp:
            raise ShardError(
                f"tp: {self.model.num_heads} heads and {self.model.num_kv_heads} KV heads must both "
                f"be divisible by tp={self.tp}"
            )
        if self.model.num_layers % self.pp:
            raise ShardError(
                f"pp: {self.model.num_layers} layers are not divisible by pp={self.pp}"
            )

    @property
    def num_positions(self) -> int:
        return self.tp * self.pp

    def tensors(self) -> list[TensorSpec]:
        """Every logical tensor of the unit's state (parameters, then optimizer state)."""
        params = model_tensors(
            self.model, scalar_head=self.scalar_head, pp=self.pp, dtype=self.dtype
        )
        if not self.training:
            return params
        states = [
            dataclasses.replace(t, key=f"{t.key}::{state}", dtype="fp32")
            for t in params
            for state in OPTIMIZER_STATES
        ]
        return params + states

    def shards(self, position: int) -> list[ShardSpec]:
        """The shards slot ``position`` (= pp_rank * tp + tp_rank) holds."""
        if not 0 <= position < self.num_positions:
            raise ShardError(f"position: {position} outside a {self.tp}x{self.pp} unit")
        pp_rank, tp_rank = divmod(position, self.tp)
        return [
            s
            for t in self.tensors()
            if t.pp_stage == pp_rank
            if (s := shard_of(t, tp_rank, self.tp)) is not None
        ]

    def all_shards(self) -> Iterator[tuple[int, ShardSpec]]:
        for position in range(self.num_positions):
            for shard in self.shards(position):
                yield position, shard


def shard_of(tensor: TensorSpec, tp_rank: int, tp: int) -> ShardSpec | None:
    """The slice of ``tensor`` tensor rank ``tp_rank`` of ``tp`` holds (None when its chunk is empty)."""
    dim = tensor.shard_dim
    if dim is None:
        return ShardSpec(
            key=tensor.key,
            global_shape=tensor.global_shape,
            global_offset=(0,) * len(tensor.global_shape),
            local_shape=tensor.global_shape,
            replica_id=tp_rank,
            dtype=tensor.dtype,
            num_replicas=tp,
        )
    start, stop = chunk_bounds(tensor.global_shape[dim], tp, tp_rank)
    if stop <= start:
        return None
    offset = [0] * len(tensor.global_shape)
    local = list(tensor.global_shape)
    offset[dim], local[dim] = start, stop - start
    return ShardSpec(
        key=tensor.key,
        global_shape=tensor.global_shape,
        global_offset=tuple(offset),
        local_shape=tuple(local),
        replica_id=0,
        dtype=tensor.dtype,
    )


def placement(tensor: TensorSpec):
    """The DTensor placement (on a 1-D tensor-parallel mesh) under which a tensor runs."""
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if tensor.shard_dim is None else Shard(tensor.shard_dim)
