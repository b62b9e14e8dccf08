"""The cost model: seconds one model-stage spends per PPO step in one layout, by operation class.

Every class is priced at hardware peak ("ideal" seconds) and divided by an efficiency for that class
(and link type) that calibration learns from the running job. Classes inside the pipeline (GEMMs
and their weight reads, attention, decode, tensor-parallel all-reduces, pipeline point-to-point)
are per-slot times of the slowest pipeline stage under perfect pipelining (a pipeline moves at
the pace of its slowest stage: with layers split evenly, the last, which also holds the head),
stretched by the pipeline's idle time: in training and inference the 1F1B bubble adds
``(pp - 1) / m`` of them for ``m`` micro-batches per flush, as it does to generation's prefill;
generation's decode fills and drains once per wave, but a micro-batch's next token waits for its
last one to leave the last stage, so with fewer micro-batches than stages every token idles
``pp - m`` stage-times.
A decode step is a roofline: its matrix multiplies and attention overlap its reads of the weights
and the KV cache, so it takes the longer of the two (at the achieved rates), not their sum; its
collectives come on top. In training and inference a GEMM falls further short of its peak the
fewer rows its micro-batch has: the part of its work that does not shrink with them (streaming the
stage's weights from memory once per micro-batch and pass, the tiles' fill and drain) is hidden less
behind the arithmetic. The model counts those reads on top of the arithmetic (``weight_read``), at
an efficiency calibration learns: a learned stand-in for that shortfall, which is proportional to
the number of micro-batches. Without it, halving the micro-batch would look free (a pipeline even
drains faster), and calibration would put the lost time on whatever class grows alike with the
number of micro-batches (the tensor-parallel all-reduce).
Data-parallel gradient all-reduce, the optimizer step and the weight sync (to generation, and to
the actor's and critic's inference units) run outside the pipeline. Collectives follow the
alpha-beta model of a ring: ``2(n-1)/n · bytes / bandwidth + 2(n-1) · latency``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from runtime.planner.shapes import FP32_GRADIENT_BYTES_PER_PARAM, LayoutShape

PIPELINED = ("gemm", "weight_read", "attention", "decode", "tp_allreduce", "pp_p2p")

DEFAULT_EFFICIENCY: dict[str, float] = {
    "gemm": 0.55,
    "weight_read": 0.60,
    "attention": 0.40,
    "decode": 0.60,
    "tp_allreduce:intra": 0.70,
    "tp_allreduce:inter": 0.60,
    "pp_p2p:intra": 0.70,
    "pp_p2p:inter": 0.60,
    "dp_allreduce:intra": 0.70,
    "dp_allreduce:inter": 0.60,
    "weight_sync:intra": 0.60,
    "weight_sync:inter": 0.50,
    "optimizer": 0.70,
    # The transition primitives (runtime/transition/cost.py): state moved between slots, and state
    # copied, packed and checksummed on one slot.
    "transition:intra": 0.60,
    "transition:inter": 0.50,
    "transition_copy": 0.50,
}
OPERATION_CLASSES = tuple(DEFAULT_EFFICIENCY)
OPTIMIZER_BYTES_PER_PARAM = 32  # read grads, master, moments; write master, moments, weights


def ring_seconds(n: int | np.ndarray, nbytes, bandwidth: float, latency: float):
    """Seconds of one ring all-reduce among ``n`` ranks."""
    n = np.asarray(n, dtype=float)
    return np.where(n > 1, 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency, 0.0)


def ideal_breakdown(
    shape: LayoutShape, *, num_slots: int, efficiency: Mapping[str, float] | None = None
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Ideal seconds per operation class (keys as in DEFAULT_EFFICIENCY), and how much the
    pipeline's idle time stretches the classes inside it, for every dp in
    ``shape.dp``.

    Decode's compute and its memory reads overlap: only the side that takes longer at
    ``efficiency`` is counted (the other is hidden behind it, and takes no time of its own).
    ``efficiency`` None: one efficiency for every class, so the side with more ideal seconds."""
    w, ms, acc, model = shape.workload, shape.ms, shape.accelerator, shape.ms.model
    tp, pp, b = shape.tp, shape.pp, w.bytes_per_value
    slots = tp * pp
    h, num_layers = model.hidden_size, model.num_layers
    batch = shape.batch_per_unit
    zeros = np.zeros_like(shape.dp)
    out: dict[str, np.ndarray] = {}
    # Placement keeps a tensor-parallel group inside a node, and a unit or a model-stage's whole
    # block inside one when its size is a power of two up to a node (see Accelerator.link).
    tp_link, pp_link = "intra", acc.link(slots)

    def tp_allreduce(count, nbytes):
        return count * ring_seconds(tp, nbytes, acc.bandwidth(tp_link), acc.latency(tp_link))

    def p2p(count, nbytes):
        if pp == 1:
            return zeros
        return count * (nbytes / tp / acc.bandwidth(pp_link) + acc.latency(pp_link))

    if ms.stage in ("training", "inference"):
        seq = w.seq_len
        passes = 3.0 + (1.0 if w.recompute else 0.0) if ms.stage == "training" else 1.0
        epochs = w.ppo_epochs if ms.stage == "training" else 1
        tokens = batch * seq * epochs
        # Each tensor-parallel rank of the slowest stage multiplies its share of that stage.
        out["gemm"] = 2 * shape.stage_dense_params * tokens * passes / (tp * acc.peak_flops)
        micro = np.ceil(batch / shape.mb) * epochs
        stage_weights = shape.stage_dense_params * b / tp
        out["weight_read"] = micro * passes * stage_weights / acc.memory_bandwidth
        attention_flops = 2 * num_layers * seq * seq * h * batch * epochs * passes
        out["attention"] = attention_flops / (slots * acc.peak_flops)
        per_layer = (4 + (2 if w.recompute else 0)) if ms.stage == "training" else 2
        activation = shape.mb * seq * h * b
        out[f"tp_allreduce:{tp_link}"] = tp_allreduce(
            micro * num_layers / pp * per_layer, activation
        )
        out[f"pp_p2p:{pp_link}"] = p2p(micro * (2 if ms.stage == "training" else 1), activation)
        if ms.stage == "training":
            flushes = w.ppo_epochs * w.ppo_minibatches
            m = shape.micro_batches(shape.mb, per_flush=w.ppo_minibatches)
            block = (shape.dp * slots).astype(np.int64)
            inside = (block <= acc.gpus_per_node) & ((block & (block - 1)) == 0)
            crosses_nodes = np.where(inside, 0.0, 1.0)
            grads = shape.params_per_slot * FP32_GRADIENT_BYTES_PER_PARAM
            intra = ring_seconds(shape.dp, grads, acc.intra_node_bandwidth, acc.intra_node_latency)
            inter = ring_seconds(shape.dp, grads, acc.inter_node_bandwidth, acc.inter_node_latency)
            out["dp_allreduce:intra"] = flushes * intra * (1 - crosses_nodes)
            out["dp_allreduce:inter"] = flushes * inter * crosses_nodes
            shards = shape.dp if w.distributed_optimizer else 1.0
            optimizer_bytes = shape.params_per_slot * OPTIMIZER_BYTES_PER_PARAM / shards
            out["optimizer"] = flushes * optimizer_bytes / acc.memory_bandwidth + zeros
        else:
            m = shape.micro_batches(shape.mb)
        stretch = 1.0 + (pp - 1) / m
    else:  # generation: prefill the prompts, then decode gen_len tokens, in waves of
        # ``concurrent`` sequences when the KV cache cannot hold them all (each wave reads the
        # weights for every token again); a pipeline runs each wave in micro-batches
        prompt, gen = w.prompt_len, w.gen_len
        concurrent, waves = shape.concurrent, shape.waves
        ones = np.ones_like(concurrent)
        m = np.maximum(ones, np.ceil(concurrent / w.gen_micro_batch)) if pp > 1 else ones
        seqs_per_micro = concurrent / m
        flops = slots * acc.peak_flops  # attention: the same layers on every stage
        stage_flops = tp * acc.peak_flops  # GEMMs: the slowest stage's, over its ranks
        prefill = {  # once through the pipeline per wave
            "gemm": 2 * shape.stage_dense_params * batch * prompt / stage_flops,
            "attention": 2 * num_layers * h * batch * prompt * prompt / flops,
            f"tp_allreduce:{tp_link}": tp_allreduce(
                2 * num_layers / pp * m * waves, seqs_per_micro * prompt * h * b
            ),
        }
        kv_per_token = 2 * num_layers / pp * shape.kv_dim_per_slot * b
        avg_context = prompt + gen / 2
        weights = shape.params_per_slot * b
        steps = gen * m * waves  # decode steps each tensor-parallel group takes, in all
        attention_flops = 2 * num_layers * h * batch * 2 * (prompt * gen + gen * gen / 2)
        decode = _roofline(  # a token at a time through the pipeline
            compute={
                "gemm": 2 * shape.stage_dense_params * batch * gen / stage_flops,
                "attention": attention_flops / flops,
            },
            reads={
                "decode": gen
                * (waves * m * weights + batch * avg_context * kv_per_token)
                / acc.memory_bandwidth
            },
            efficiency=efficiency,
        )
        decode[f"tp_allreduce:{tp_link}"] = tp_allreduce(
            steps * 2 * num_layers / pp, seqs_per_micro * h * b
        )
        decode[f"pp_p2p:{pp_link}"] = p2p(steps, seqs_per_micro * h * b)
        for part in (prefill, decode):
            for op_class, seconds in part.items():
                out[op_class] = out.get(op_class, 0.0) + seconds
        out.update(_weight_sync(shape, num_slots))
        stretch = generation_stretch(pp, m, gen, sum(prefill.values()), sum(decode.values()))
    if ms.stage == "inference" and ms.role in TRAINED:
        # The actor's and the critic's inference units take the weights just trained, every
        # step, as generation does.
        out.update(_weight_sync(shape, num_slots))
    return out, stretch


def _roofline(
    *,
    compute: dict[str, np.ndarray],
    reads: dict[str, np.ndarray],
    efficiency: Mapping[str, float] | None,
) -> dict[str, np.ndarray]:
    """Decode's ideal seconds as a roofline: the arithmetic (``compute``) and the memory reads
    (``reads``) of a step run at once, so only the side that takes longer at ``efficiency``
    (None: one efficiency for all) is kept, for each dp; the other's classes get 0 seconds.
    Every decode step of a wave has the same shape (at the wave's mean context), so comparing
    the totals compares the steps."""

    def seconds(part: dict[str, np.ndarray]) -> np.ndarray:
        return sum(t / (efficiency[c] if efficiency else 1.0) for c, t in part.items())

    reads_bind = seconds(reads) > seconds(compute)
    kept = {c: np.where(reads_bind, 0.0, t) for c, t in compute.items()}
    kept.update({c: np.where(reads_bind, t, 0.0) for c, t in reads.items()})
    return kept


def generation_stretch(pp: int, micro_batches, tokens: int, prefill_s, decode_s) -> np.ndarray:
    """How much a generation pipeline's idle time stretches its per-slot time, ``prefill_s`` of
    prefill and ``decode_s`` of decode: prefill idles as training's pipeline does (the fill and
    drain of its ``m`` micro-batches), decode as ``decode_stretch`` says, and the two together
    by their blend."""
    m = np.asarray(micro_batches, dtype=float)
    both = np.maximum(prefill_s + decode_s, 1e-30)
    return (prefill_s * (1.0 + (pp - 1) / m) + decode_s * decode_stretch(pp, m, tokens)) / both


def decode_stretch(pp: int, micro_batches, tokens: int) -> np.ndarray:
    """How much a generation pipeline's idle time stretches its per-slot time: ``m`` micro-
    batches each decode ``tokens`` tokens through ``pp`` stages of one stage-time each. A token of
    a micro-batch enters the first stage once its previous token has left the last, so a round of
    tokens takes ``max(m, pp)`` stage-times, and the pipeline fills and drains once:
    ``(tokens * max(m, pp) + min(m, pp) - 1) / (m * tokens)``. With ``m >= pp`` this is the fill
    and drain alone, paid once per wave rather than once per token."""
    m = np.asarray(micro_batches, dtype=float)
    n = max(1, tokens)
    return (n * np.maximum(m, pp) + np.minimum(m, pp) - 1) / (m * n)


TRAINED = ("actor", "critic")
"""The roles with a training model-stage, whose other model-stages take its weights each step."""


def _weight_sync(shape: LayoutShape, num_slots: int) -> dict[str, np.ndarray]:
    """Ideal seconds of refreshing a unit's weights from the training units: the pool's slots
    are placed from the first slot of a node, so a pool no larger than a node syncs inside it."""
    acc = shape.accelerator
    link = "intra" if num_slots <= acc.gpus_per_node else "inter"
    nbytes = shape.params_per_slot * shape.workload.bytes_per_value
    return {
        f"weight_sync:{link}": nbytes / acc.bandwidth(link)
        + acc.latency(link)
        + np.zeros_like(shape.dp)
    }


def in_pipeline(op_class: str) -> bool:
    """Whether an operation class (``gemm``, ``pp_p2p:intra``, ...) runs inside the pipeline, where
    the 1F1B bubble stretches it."""
    return op_class.split(":")[0] in PIPELINED


def predict(
    shape: LayoutShape, *, num_slots: int, efficiency: Mapping[str, float]
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Calibrated seconds per step, and the breakdown by class plus ``pipeline_bubble``."""
    ideal, stretch = ideal_breakdown(shape, num_slots=num_slots, efficiency=efficiency)
    breakdown = {cls: seconds / efficiency[cls] for cls, seconds in ideal.items()}
    pipelined = sum(
        (t for cls, t in breakdown.items() if in_pipeline(cls)), start=np.zeros_like(shape.dp)
    )
    breakdown["pipeline_bubble"] = pipelined * (stretch - 1)
    total = sum(breakdown.values(), start=np.zeros_like(shape.dp))
    return total, breakdown
