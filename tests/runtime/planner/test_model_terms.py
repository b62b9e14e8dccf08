"""Terms of the cost and memory models checked against their first-principles figures: a pipeline
priced at its slowest stage, the logits and what the loss derives from them, fp32 gradients in the
data-parallel all-reduce and the update, and decode as a roofline."""

import dataclasses

import numpy as np
import pytest

from runtime.planner import PpoWorkload, cost, default_catalog, memory, plan
from runtime.planner.shapes import LayoutShape, batchings
from tests.runtime.planner.oracle import exact_slot_times

CATALOG = default_catalog()
LLAMA_8B = CATALOG.model("llama-3.1-8b")
H100 = CATALOG.accelerator("h100-sxm")
EFF = cost.DEFAULT_EFFICIENCY


def _shape(workload, name, *, dp, tp, pp, micro_batch=0, resident=None):
    ms = next(m for m in workload.model_stages() if m.name == name)
    return LayoutShape(
        ms=ms,
        workload=workload,
        accelerator=H100,
        tp=tp,
        pp=pp,
        dp=np.array([float(dp)]),
        micro_batch=micro_batch,
        resident=resident,
    )


def _predicted(shape, num_slots=16) -> float:
    return float(cost.predict(shape, num_slots=num_slots, efficiency=EFF)[0][0])


def test_a_pipeline_is_priced_at_its_last_stage_which_holds_the_head():
    """Layers are split evenly, so the last stage multiplies its ``L/pp`` layers and the LM head:
    at pp=8 Llama-3.1-8B's last stage does 1.49x the average stage's GEMMs, and the pipeline,
    bubble included, runs at its pace."""
    workload = PpoWorkload.for_model(LLAMA_8B, gen_len=2048)
    dp, tp, pp = 2, 1, 8
    shape = _shape(workload, "actor@training", dp=dp, tp=tp, pp=pp)
    model = LLAMA_8B
    h = model.hidden_size
    last_stage = model.num_layers / pp * model.params_per_layer + h + model.vocab_size * h
    tokens = workload.global_batch / dp * workload.seq_len * workload.ppo_epochs
    gemm = 2 * last_stage * tokens * 3 / (tp * H100.peak_flops)  # forward + 2x backward

    average = (model.num_layers * model.params_per_layer + h + model.vocab_size * h) / pp
    assert last_stage / average == pytest.approx(1.49, abs=0.01)

    ideal, stretch = cost.ideal_breakdown(shape, num_slots=16)
    assert float(ideal["gemm"][0]) == pytest.approx(gemm)
    stretch = float(stretch[0])
    assert stretch > 1  # the bubble is a share of the slowest stage's time
    expected = sum(
        (gemm if c == "gemm" else float(t[0])) / EFF[c] * (stretch if cost.in_pipeline(c) else 1)
        for c, t in ideal.items()
    )
    assert _predicted(shape) == pytest.approx(expected)

    # At pp=1 the one stage holds the whole model: the same figure as the whole model's GEMMs.
    whole = _shape(workload, "actor@training", dp=dp, tp=tp, pp=1)
    dense = model.num_layers * model.params_per_layer + h + model.vocab_size * h
    assert float(cost.ideal_breakdown(whole, num_slots=16)[0]["gemm"][0]) == pytest.approx(
        2 * dense * tokens * 3 / H100.peak_flops
    )


def test_the_planner_takes_no_deep_pipeline_whose_last_stage_is_slower():
    """Llama-3.1-8B on 16 H100s: priced at the average stage, the actor trained on one
    (1,1,8) pipeline; at its last stage, that layout takes over twice as long as the (2,4,2) the
    planner now takes, which is the fastest training layout that fits beside the plan's state
    (a deeper pipeline needs more, smaller micro-batches to drain, each streaming its weights).
    The critic's head is a scalar, its stages even, and a pp=8 pipeline stays its fastest."""
    workload = PpoWorkload.for_model(LLAMA_8B, gen_len=2048)
    best = plan(workload, H100, 16, num_alternatives=0).best
    chosen = {ms.name: ms for ms in best.model_stages}
    actor, critic = chosen["actor@training"], chosen["critic@training"]
    assert (actor.layout.dp, actor.layout.tp, actor.layout.pp) == (2, 4, 2)
    assert (critic.layout.dp, critic.layout.tp, critic.layout.pp) == (2, 1, 8)
    for ms in workload.model_stages("training"):
        fastest = min(exact_slot_times(ms, workload, H100, 16, EFF, best.training_state))
        assert chosen[ms.name].predicted_s == pytest.approx(fastest)

    one_pipeline = _shape(
        workload, "actor@training", dp=1, tp=1, pp=8, resident=best.training_state
    )
    fitting = [
        _predicted(dataclasses.replace(one_pipeline, micro_batch=mb))
        for mb in batchings(one_pipeline)
        if memory.total_bytes(
            memory.memory_breakdown(dataclasses.replace(one_pipeline, micro_batch=mb), num_slots=16)
        )[0]
        <= memory.memory_budget(H100.memory_bytes)
    ]
    assert fitting and min(fitting) > 2 * actor.predicted_s


@pytest.mark.parametrize(
    ("name", "tp", "pp", "bytes_per_column", "columns"),
    [
        ("actor@training", 2, 1, 14, LLAMA_8B.vocab_size),
        ("actor@training", 1, 4, 14, LLAMA_8B.vocab_size),
        ("actor@inference", 4, 1, 10, LLAMA_8B.vocab_size),
        ("ref@inference", 1, 2, 10, LLAMA_8B.vocab_size),
        ("critic@training", 2, 1, 4, 1),
        ("critic@inference", 1, 1, 4, 1),
    ],
)
def test_logits_take_what_the_loss_keeps_of_them(name, tp, pp, bytes_per_column, columns):
    """The executor's loss keeps about 3.5 fp32 copies of the logits in training (bf16 logits,
    their fp32 upcast, log-softmax and entropy saved for the backward, then the gradient) and
    2.5 in inference: 14 and 10 bytes per token and vocabulary column of a rank, on the last
    stage. A scalar head's one fp32 value per token is unaffected."""
    # One micro-batch in all: a pipeline's first stage holds no more in flight than its last,
    # so the last, with the head and the logits, is the fullest slot.
    workload = PpoWorkload.for_model(LLAMA_8B, gen_len=1024, global_batch=2, micro_batch=2)
    shape = _shape(workload, name, dp=1, tp=tp, pp=pp)
    breakdown = memory.memory_breakdown(shape, num_slots=16)
    tokens = workload.seq_len * 2
    assert float(breakdown["logits"][0]) == pytest.approx(tokens * columns / tp * bytes_per_column)


@pytest.mark.parametrize(("dp", "link"), [(4, "intra"), (8, "inter")])
def test_data_parallel_replicas_all_reduce_fp32_gradients(dp, link):
    """The executor upcasts the gradients and all-reduces them in one fp32 buffer: 4 bytes a
    parameter in the ring, whatever the weights' precision."""
    workload = PpoWorkload.for_model(LLAMA_8B, gen_len=1024)
    assert workload.bytes_per_value == 2
    shape = _shape(workload, "actor@training", dp=dp, tp=2, pp=1)
    ideal, _ = cost.ideal_breakdown(shape, num_slots=16)
    nbytes = shape.params_per_slot * 4
    ring = 2 * (dp - 1) / dp * nbytes / H100.bandwidth(link) + 2 * (dp - 1) * H100.latency(link)
    flushes = workload.ppo_epochs * workload.ppo_minibatches
    assert float(ideal[f"dp_allreduce:{link}"][0]) == pytest.approx(flushes * ring)


@pytest.mark.parametrize(("dp", "copies"), [(1, 1), (4, 2)])
def test_the_update_s_fp32_gradients_count_where_the_activations_are_gone(dp, copies):
    """The update copies the bf16 gradients to fp32 and, with data parallelism, concatenates
    them into one more fp32 buffer for the all-reduce; it runs after the backward released the
    activations and logits, so the slot's peak is the larger of the two phases."""
    workload = PpoWorkload.for_model(LLAMA_8B, gen_len=512)
    for micro_batch in (1, 4):
        shape = _shape(workload, "actor@training", dp=dp, tp=4, pp=1, micro_batch=micro_batch)
        parts = {k: float(v[0]) for k, v in memory.memory_breakdown(shape, num_slots=16).items()}
        update = shape.params_per_slot * 4 * copies
        backward = parts["activations"] + parts["logits"]
        kept = sum(v for k, v in parts.items() if k not in ("activations", "logits"))
        kept -= parts["gradient_update"]
        assert parts["gradients"] == pytest.approx(shape.params_per_slot * 2)  # bf16, kept
        assert kept + backward + parts["gradient_update"] == pytest.approx(
            kept + max(backward, update)
        )
        if micro_batch == 1:  # a short sequence's activations leave the update the larger
            assert parts["gradient_update"] > 0


def _decode_parts(workload, shape):
    """Ideal seconds of a tp=1, pp=1 generation unit decoding all its sequences in one wave:
    (prefill GEMM, prefill attention, decode GEMM, decode attention, decode reads)."""
    model, peak = LLAMA_8B, H100.peak_flops
    batch, prompt, gen = float(shape.batch_per_unit[0]), workload.prompt_len, workload.gen_len
    h, layers, b = model.hidden_size, model.num_layers, workload.bytes_per_value
    dense = model.num_layers * model.params_per_layer + h + model.vocab_size * h
    weights = model.num_params() * b
    kv_per_token = 2 * layers * model.kv_dim * b
    return (
        2 * dense * batch * prompt / peak,
        2 * layers * h * batch * prompt * prompt / peak,
        2 * dense * batch * gen / peak,
        2 * layers * h * batch * 2 * (prompt * gen + gen * gen / 2) / peak,
        gen * (weights + batch * (prompt + gen / 2) * kv_per_token) / H100.memory_bandwidth,
    )


@pytest.mark.parametrize(
    ("decode_efficiency", "binds"), [(EFF["decode"], "reads"), (1.0, "compute")]
)
def test_a_decode_step_takes_the_longer_of_its_compute_and_its_reads(decode_efficiency, binds):
    """A decode step's matrix multiplies and attention overlap its reads of the weights and the
    KV cache: it takes the longer of the two at the achieved rates, not their sum. Here 512
    sequences at once make the two comparable: the reads bind at the default efficiencies, the
    compute once the reads run at the memory's peak."""
    workload = PpoWorkload.for_model(LLAMA_8B, global_batch=1024, prompt_len=256, gen_len=256)
    shape = _shape(workload, "actor@generation", dp=2, tp=1, pp=1)
    assert float(shape.concurrent[0]) == float(shape.batch_per_unit[0]) == 512
    eff = {**EFF, "decode": decode_efficiency}
    pre_gemm, pre_attn, dec_gemm, dec_attn, reads = _decode_parts(workload, shape)
    compute_s = dec_gemm / eff["gemm"] + dec_attn / eff["attention"]
    reads_s = reads / eff["decode"]
    assert 0.4 < compute_s / reads_s < 2.5  # comparable: a sum would be far off the max
    assert ("reads" if reads_s > compute_s else "compute") == binds

    total, breakdown = cost.predict(shape, num_slots=16, efficiency=eff)
    priced = sum(float(breakdown[c][0]) for c in ("gemm", "attention", "decode"))
    prefill_s = pre_gemm / eff["gemm"] + pre_attn / eff["attention"]
    assert priced == pytest.approx(prefill_s + max(compute_s, reads_s))
    # Nothing else in the step changed: only the weight sync is left (one slot, no pipeline).
    others = float(total[0]) - priced
    assert others == pytest.approx(sum(float(v[0]) for k, v in breakdown.items() if "sync" in k))


@pytest.mark.parametrize(("name", "passes"), [("actor@training", 3), ("ref@inference", 1)])
def test_each_micro_batch_pass_streams_the_stage_s_weights(name, passes):
    """Training and inference read the slowest stage's weights (its share on each tensor-
    parallel rank) from memory once per micro-batch and pass: halving the micro-batch doubles
    the reads and leaves the arithmetic as it was, so without a pipeline to drain the smaller
    micro-batch is the slower one. Generation's reads are decode's roofline, not this class."""
    workload = PpoWorkload.for_model(LLAMA_8B, gen_len=1024, recompute=False)
    dp, tp, pp = 4, 2, 1
    big = _shape(workload, name, dp=dp, tp=tp, pp=pp, micro_batch=4)
    small = dataclasses.replace(big, micro_batch=2)
    (ideal_big, _), (ideal_small, _) = (cost.ideal_breakdown(s, num_slots=16) for s in (big, small))
    micro = np.ceil(workload.global_batch / dp / 4) * (
        workload.ppo_epochs if name.endswith("training") else 1
    )
    weights = big.stage_dense_params * workload.bytes_per_value / tp
    assert float(ideal_big["weight_read"][0]) == pytest.approx(
        micro * passes * weights / H100.memory_bandwidth
    )
    assert float(ideal_small["weight_read"][0]) == pytest.approx(
        2 * float(ideal_big["weight_read"][0])
    )
    assert float(ideal_small["gemm"][0]) == pytest.approx(float(ideal_big["gemm"][0]))
    assert _predicted(small) > _predicted(big)
    generation = _shape(workload, "actor@generation", dp=dp, tp=tp, pp=pp)
    assert "weight_read" not in cost.ideal_breakdown(generation, num_slots=16)[0]
