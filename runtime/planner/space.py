"""The plan space of one model-stage: which (tp, pp) a model and an accelerator allow, and why the
others are refused."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

from runtime.planner.catalog import Accelerator, ModelConfig

if TYPE_CHECKING:
    from runtime.planner.workload import PpoWorkload


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Rejection:
    """A candidate the planner did not take, and the constraint that ruled it out."""

    model_stage: str
    tp: int
    pp: int
    reason: str

    def __str__(self) -> str:
        return f"{self.model_stage} tp={self.tp} pp={self.pp}: {self.reason}"


def layout_rule(
    model: ModelConfig, accelerator: Accelerator, tp: int, pp: int, *, lm_head: bool = True
) -> str | None:
    """Why a model cannot take tensor degree ``tp`` and pipeline degree ``pp``; None if it can."""
    if tp > accelerator.gpus_per_node:
        return f"tp={tp} exceeds the {accelerator.gpus_per_node} GPUs of a node (TP stays inside a node)"
    return shard_rule(model, tp, pp, lm_head=lm_head)


def shard_rule(model: ModelConfig, tp: int, pp: int, *, lm_head: bool = True) -> str | None:
    """Why a model's state cannot be cut ``tp`` by ``pp`` ways (the model layer and the EMU
    primitives cut only evenly); None if it can. The transition compiler checks a plan by it.
    ``lm_head``: the model-stage ends in the vocabulary head (not a scalar one), which tied
    embeddings share with the first stage's embedding table."""
    if lm_head and model.tie_embeddings and (tp > 1 or pp > 1):
        # The head is the embedding table: under TP it would need a vocabulary-parallel
        # embedding, and with pp > 1 it lives on the first stage, not the last that needs it.
        return f"tie_embeddings: a tied LM head runs only at tp=1 and pp=1, got tp={tp} pp={pp}"
    if model.num_heads % tp:
        return f"{model.num_heads} attention heads are not divisible by tp={tp}"
    if model.num_kv_heads % tp:
        # Shard KV heads, never replicate them: the EMU layouts split whole heads across ranks.
        return f"{model.num_kv_heads} KV heads are not divisible by tp={tp}"
    for field, size in (
        ("intermediate_size", model.intermediate_size),
        ("vocab_size", model.vocab_size),
    ):
        if size % tp:
            # DTensor's Shard(dim) of an uneven size computes wrong results (vocabulary) or
            # fails (MLP); the model layer refuses them, so the planner never proposes them.
            return f"{field}={size} is not divisible by tp={tp}"
    if model.num_layers % pp:
        return f"{model.num_layers} layers are not divisible by pp={pp}"
    return None


def candidate_degrees(model: ModelConfig, accelerator: Accelerator, num_slots: int):
    """The (tp, pp) grid the planner considers: tp a power of two up to twice a node, pp every
    divisor of the layer count and every power of two, both bounded by the pool."""
    tps, tp = [], 1
    while tp <= min(2 * accelerator.gpus_per_node, max(num_slots, 1)):
        tps.append(tp)
        tp *= 2
    limit = min(model.num_layers, num_slots)
    pps = {p for p in range(1, limit + 1) if model.num_layers % p == 0}
    p = 1
    while p <= limit:
        pps.add(p)
        p *= 2
    return [(t, p) for t in tps for p in sorted(pps) if t * p <= num_slots]


def valid_layouts(
    model: ModelConfig, accelerator: Accelerator, num_slots: int, *, lm_head: bool = True
):
    """The (tp, pp) pairs allowed, and the rule-based rejections of the rest of the grid."""
    allowed, refused = [], []
    for tp, pp in candidate_degrees(model, accelerator, num_slots):
        reason = layout_rule(model, accelerator, tp, pp, lm_head=lm_head)
        if reason is None:
            allowed.append((tp, pp))
        else:
            refused.append((tp, pp, reason))
    return allowed, refused


def check_layout(
    model: ModelConfig, accelerator: Accelerator, *, dp: int, tp: int, pp: int, num_slots: int
) -> None:
    """Refuse a requested layout the model or the pool cannot take, naming the field and why."""
    for field, value in (("dp", dp), ("tp", tp), ("pp", pp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{field}: must be a positive integer, got {value!r}")
    if tp & (tp - 1):
        raise ValueError(f"tp: must be a power of two, got {tp}")
    reason = layout_rule(model, accelerator, tp, pp)
    if reason is not None:
        field = "pp" if "pp=" in reason and "tp=" not in reason else "tp"
        raise ValueError(f"{field}: {reason}")
    if dp * tp * pp > num_slots:
        raise ValueError(
            f"dp: (dp,tp,pp)=({dp},{tp},{pp}) needs {dp * tp * pp} slots, the pool has {num_slots}"
        )


def only_layouts(
    layouts: Mapping[str, tuple[int, int]],
    workload: PpoWorkload,
    accelerator: Accelerator,
    num_slots: int,
) -> frozenset[tuple[str, int, int]]:
    """The planner's exclusions that leave each named model-stage only its given (tp, pp): every
    other pair of the grid the planner searches for that model-stage (``candidate_degrees``,
    which holds every divisor of the layer count, not only powers of two)."""
    return frozenset(
        (ms.name, tp, pp)
        for ms in workload.model_stages()
        if ms.name in layouts
        for tp, pp in candidate_degrees(ms.model, accelerator, num_slots)
        if (tp, pp) != tuple(layouts[ms.name])
    )
