"""Quantities shared by the cost and memory models for one model-stage in one (tp, pp) layout,
vectorised over the data-parallel degree so that a whole column of the plan space is priced at once."""

from __future__ import annotations

import dataclasses

import numpy as np

from runtime.planner.catalog import Accelerator
from runtime.planner.workload import ModelStage, PpoWorkload


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LayoutShape:
    """One model-stage, one (tp, pp), and every dp in ``dp`` (a float array)."""

    ms: ModelStage
    workload: PpoWorkload
    accelerator: Accelerator
    tp: int
    pp: int
    dp: np.ndarray
    micro_batch: int | np.ndarray = 0
    """Sequences per micro-batch in training and inference (0: the workload's); in generation,
    the sequences a unit decodes at once, as many as its KV cache holds (0: all of its
    sequences; an array: one value per dp)."""
    resident: tuple[tuple[str, float], ...] | None = None
    """(training role, bytes per slot): the state each training model keeps on the fullest slot
    of its units through the whole step (its weights, gradients and Adam state), as the plan
    lays it out (``training_state``); None: each at its least, its whole state spread evenly
    over the pool."""

    @classmethod
    def of_layout(
        cls,
        ms: ModelStage,
        workload: PpoWorkload,
        accelerator: Accelerator,
        layout,
        micro_batch: int = 0,
        resident: tuple[tuple[str, float], ...] | None = None,
    ) -> LayoutShape:
        """The shape of one concrete layout (anything with ``dp``, ``tp`` and ``pp``)."""
        return cls(
            ms=ms,
            workload=workload,
            accelerator=accelerator,
            tp=layout.tp,
            pp=layout.pp,
            dp=np.array([float(layout.dp)]),
            micro_batch=micro_batch,
            resident=resident,
        )

    @classmethod
    def of_plan(
        cls, ms: ModelStage, workload: PpoWorkload, accelerator: Accelerator, plan_
    ) -> LayoutShape:
        """The shape of ``ms`` as ``plan_`` runs it: its layout, its micro-batch, and the training
        state the plan's training units keep on the slots."""
        ms_plan = plan_.model_stage(ms.name)
        return cls.of_layout(
            ms,
            workload,
            accelerator,
            ms_plan.layout,
            ms_plan.micro_batch,
            resident=training_state(plan_, workload),
        )

    @property
    def mb(self) -> np.ndarray:
        """Sequences per micro-batch in training and inference, as a unit runs them: the plan's
        (or the workload's) size, but never more than the unit has at once (its share of a PPO
        minibatch in training, of the batch in inference)."""
        size = self.micro_batch or self.workload.micro_batch
        has = self.batch_per_unit
        if self.ms.stage == "training":
            has = np.ceil(has / self.workload.ppo_minibatches)
        return np.minimum(float(size), has)

    @property
    def concurrent(self) -> np.ndarray:
        """Generation: sequences a unit decodes at once (the rest wait for a later wave)."""
        everything = self.batch_per_unit
        limit = np.asarray(self.micro_batch, dtype=float)
        return np.where(limit > 0, np.minimum(everything, np.maximum(limit, 1.0)), everything)

    @property
    def waves(self) -> np.ndarray:
        """Generation: rounds a unit decodes its sequences in, ``concurrent`` at a time."""
        return np.ceil(self.batch_per_unit / self.concurrent)

    @property
    def unit_slots(self) -> int:
        return self.tp * self.pp

    @property
    def batch_per_unit(self) -> np.ndarray:
        """Sequences each data-parallel replica processes per step."""
        return np.ceil(self.workload.global_batch / self.dp)

    @property
    def stage_params(self) -> float:
        """Parameters of the largest pipeline stage (embedding on the first, head on the last)."""
        model = self.ms.model
        layers = model.num_layers / self.pp * model.params_per_layer
        head = model.head_params(scalar_head=self.ms.scalar_head) + model.hidden_size
        if self.pp == 1:
            return model.embedding_params + layers + head
        return max(model.embedding_params, head) + layers

    @property
    def params_per_slot(self) -> float:
        """Parameters one slot holds: its pipeline stage split over tensor-parallel ranks."""
        return self.stage_params / self.tp

    @property
    def kv_dim_per_slot(self) -> float:
        """Key/value width one tensor-parallel rank caches (heads replicate when tp > kv heads)."""
        model = self.ms.model
        return model.kv_dim / min(self.tp, model.num_kv_heads)

    def micro_batches(self, micro_batch: int, *, per_flush: int = 1) -> np.ndarray:
        """Micro-batches between pipeline flushes."""
        return np.maximum(1.0, np.ceil(self.batch_per_unit / (micro_batch * per_flush)))

    @property
    def training_bytes_per_param(self) -> np.ndarray:
        """Bytes a training unit keeps per parameter it holds: weights, gradients (kept until
        the next update) and Adam's fp32 master weights and two moments (sharded over the data-
        parallel replicas with a distributed optimizer)."""
        b = self.workload.bytes_per_value
        shards = self.dp if self.workload.distributed_optimizer else 1.0
        return 2 * b + ADAM_BYTES_PER_PARAM / shards + np.zeros_like(self.dp)

    @property
    def kept_per_slot(self) -> np.ndarray:
        """Training: the bytes its units keep on their fullest slot through the whole step."""
        return self.params_per_slot * self.training_bytes_per_param

    @property
    def dense_params(self) -> float:
        """Parameters that do matrix multiplies for every token (all but the embedding table)."""
        return self.ms.num_params - self.ms.model.embedding_params

    @property
    def stage_dense_params(self) -> float:
        """``dense_params`` of the slowest pipeline stage, which sets the pace of the whole
        pipeline. Layers are split evenly (``space.shard_rule``), so that is the last stage: its
        ``L/pp`` layers, the final norm and the head. The first stage's extra work, the
        embedding lookup, is a gather that does no matrix multiply. At pp=1 the whole model's."""
        if self.pp == 1:
            return self.dense_params
        model = self.ms.model
        layers = model.num_layers / self.pp * model.params_per_layer
        return layers + model.hidden_size + model.head_params(scalar_head=self.ms.scalar_head)


ADAM_BYTES_PER_PARAM = 12  # fp32 master weights + first and second moments
FP32_GRADIENT_BYTES_PER_PARAM = 4
"""Bytes per parameter of the gradients the update sums over data-parallel replicas and applies:
fp32, whatever the weights' precision. The executor upcasts each gradient and all-reduces them in
one flat fp32 buffer (``runtime/ppo/slot_work.py``, ``_gradients``), as Megatron keeps fp32 main
gradients."""


def training_state(plan_, workload: PpoWorkload) -> tuple[tuple[str, float], ...]:
    """(training role, bytes per slot) of training state ``plan_``'s model-stages run beside: what
    the plan recorded it keeps room for, else what each training model keeps on the fullest
    slot of its units through the whole step, as the plan lays it out."""
    if plan_.training_state:
        return tuple(plan_.training_state)
    return tuple(
        (
            ms.role,
            float(
                LayoutShape.of_layout(
                    ms, workload, None, plan_.model_stage(ms.name).layout
                ).kept_per_slot[0]
            ),
        )
        for ms in workload.model_stages("training")
    )


GENERATION_WAVES = (1, 2, 4, 8, 16)
"""The rounds a generation unit may decode its sequences in when its KV cache cannot hold them
all at once (as vLLM's ``max_num_seqs`` caps the sequences it runs together)."""


def batchings(shape: LayoutShape) -> list:
    """The ``micro_batch`` values a model-stage may run its layout in, from the one needing the
    most memory to the one needing the least: for training and inference, the sizes of
    ``micro_batch_sizes``; for generation, all of a unit's sequences at once (0), then as many
    as decode in 2, 4, ... waves (one value per dp: a unit's share of the batch depends on it).
    Every wave reads the weights again, so a unit decodes in more only to fit."""
    ms, workload = shape.ms, shape.workload
    if ms.stage != "generation":
        return list(micro_batch_sizes(ms, workload))
    if not workload.adaptive_micro_batch:
        return [0]
    return [0, *(np.ceil(shape.batch_per_unit / waves) for waves in GENERATION_WAVES[1:])]


def micro_batch_sizes(ms: ModelStage, workload: PpoWorkload) -> tuple[int, ...]:
    """The micro-batches a training or inference model-stage may run, largest first: the
    workload's, halved down to one sequence (fewer sequences per micro-batch hold fewer
    activations; the gradient is the same, accumulated over more of them). A workload that pins
    its micro-batch has only its own."""
    if ms.stage == "generation" or not workload.adaptive_micro_batch:
        return (workload.micro_batch,)
    sizes, size = [workload.micro_batch], workload.micro_batch
    while size > 1:
        size = -(-size // 2)
        sizes.append(size)
    return tuple(sizes)
