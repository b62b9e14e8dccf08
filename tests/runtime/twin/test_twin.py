"""The cluster twin: its physics is its own, its parts behave as their models say, and it is
checked against published measurements of real systems."""

from __future__ import annotations

import ast
import dataclasses
import random
from pathlib import Path

import pytest

from runtime.planner import PpoWorkload, default_catalog
from runtime.planner.plan import Layout, Plan
from runtime.twin import ClusterTwin, device, kernels, layers, pipeline, serving
from runtime.twin.published import vidur_gemms, vllm_offline

ROOT = Path(__file__).resolve().parents[3]
FORBIDDEN = (
    "runtime.planner.cost",
    "runtime.planner.memory",
    "runtime.planner.shapes",
    "runtime.planner.search",
    "runtime.planner.calibration",
    "runtime.planner.probes",
    "runtime.transition.cost",
    "runtime.transition.compiler",
)
"""The planner's models of time and memory (and what is built on them): the twin may not use
them, or the planner could not be wrong about the world."""
CATALOG = default_catalog()
H100 = device("h100-sxm")
LLAMA_8B = CATALOG.models["llama-3.1-8b"]


def _module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.exists():
            return path
    return None


def _imports(path: Path) -> set[str]:
    """The project modules ``path`` names in its import statements (``from a import b`` names
    ``a`` and, where it is a module, ``a.b``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {m for m in out if m.startswith("runtime") and _module_file(m)}


def reached(start: list[str]) -> set[str]:
    """Every project module the code of ``start`` imports, directly or through another."""
    seen: set[str] = set()
    stack = list(start)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        stack += sorted(_imports(_module_file(name)))
    return seen


def test_the_twin_imports_nothing_of_the_planners_models():
    twin = [f"runtime.twin.{p.stem}" for p in (ROOT / "runtime" / "twin").glob("*.py")]
    assert "runtime.twin.twin" in twin
    assert sorted(reached(twin) & set(FORBIDDEN)) == []


def test_the_import_check_sees_what_the_planner_uses():
    # The same walk over the planner's search finds its cost model: the check can fail.
    assert {"runtime.planner.cost", "runtime.planner.memory"} <= reached(["runtime.planner.search"])


def test_an_unknown_device_is_named():
    with pytest.raises(ValueError, match="accelerator: the twin has no device 'tpu-v5'"):
        device("tpu-v5")


# --- kernels ----------------------------------------------------------------------------------


def test_few_rows_run_far_from_the_gemm_peak():
    big = kernels.gemm(H100, 8192, 8192, 8192).device_s
    rate_big = 2 * 8192**3 / big
    assert 0.7 * H100.gemm_flops < rate_big <= H100.gemm_flops
    skinny = kernels.gemm(H100, 8, 8192, 8192).device_s
    assert 2 * 8 * 8192**2 / skinny < 0.05 * H100.gemm_flops  # bound by reading the weights
    assert skinny == pytest.approx(8192 * 8192 * 2 / H100.hbm_rate, rel=0.01)


def test_gemm_times_match_vidurs_h100_profile():
    rows = vidur_gemms(H100)
    ratios = [r["twin_us"] / r["vidur_us"] for r in rows]
    assert len(rows) == 24
    assert all(0.6 < r < 1.4 for r in ratios), rows
    assert sum(abs(r - 1) for r in ratios) / len(ratios) < 0.15


def test_collectives_take_the_faster_of_ring_and_tree_and_cross_nodes_slower():
    intra = H100.link(range(8))
    across = H100.link([0, 8])  # one rank on each of two nodes: one network card
    assert not intra.inter and across.inter
    small, big = 4096, 1 << 30
    assert kernels.all_reduce(intra, small, 8) < kernels.all_reduce(across, small, 2) * 4
    assert kernels.all_reduce(across, big, 2) > 5 * kernels.all_reduce(intra, big, 2)
    # eight ranks on each of two nodes drive eight cards
    assert H100.link(range(16)).bus_bytes_per_s == pytest.approx(
        min(H100.intra.bus_bytes_per_s, 8 * H100.nic_bytes_per_s)
    )


# --- schedules --------------------------------------------------------------------------------


@pytest.mark.parametrize(("pp", "m"), [(1, 4), (2, 2), (4, 8), (4, 3), (8, 16)])
def test_1f1b_bubble_emerges_from_the_schedule(pp, m):
    fwd = [[1.0] * m for _ in range(pp)]
    bwd = [[2.0] * m for _ in range(pp)]
    # With equal times and free messages, 1F1B takes (m + pp - 1)(f + b).
    assert pipeline.one_f_one_b(fwd, bwd, 0.0) == pytest.approx((m + pp - 1) * 3.0)
    assert pipeline.forward_only(fwd, 0.0) == pytest.approx((m + pp - 1) * 1.0)
    if pp > 1:
        assert pipeline.one_f_one_b(fwd, bwd, 0.5) > (m + pp - 1) * 3.0


def test_a_slow_micro_batch_holds_up_the_pipeline():
    fwd = [[1.0, 1.0, 4.0, 1.0] for _ in range(2)]
    bwd = [[2.0, 2.0, 8.0, 2.0] for _ in range(2)]
    even = pipeline.one_f_one_b([[1.0] * 4] * 2, [[2.0] * 4] * 2, 0.0)
    assert pipeline.one_f_one_b(fwd, bwd, 0.0) >= even + 9.0


def _costs(fixed=1e-3, kv=0.0):
    return serving.Costs(fixed_s=lambda b: fixed, kv_s=lambda b: kv, prefill_s=lambda contexts: 0.0)


def test_continuous_batching_ends_with_the_longest_response():
    lengths = [10] * 63 + [400]
    took, preempted, _ = serving.continuous(_costs(), 8, lengths, max_seqs=0, kv_tokens=1 << 20)
    assert preempted == 0
    assert took == pytest.approx(400 * 1e-3)
    # a plain loop in waves of 16 decodes every wave to its longest
    static = serving.static(_costs(), 8, lengths, max_seqs=16, kv_tokens=1 << 20)
    assert static == pytest.approx((10 + 10 + 10 + 400) * 1e-3)
    # seats are refilled as responses end: 64 responses of 10 through 16 seats
    took, _, _ = serving.continuous(_costs(), 8, [10] * 64, max_seqs=16, kv_tokens=1 << 20)
    assert took == pytest.approx(40 * 1e-3)


def test_a_small_cache_preempts_and_a_tiny_one_does_not_fit():
    lengths = [200] * 8
    roomy, pre, held = serving.continuous(_costs(), 16, lengths, max_seqs=0, kv_tokens=1 << 16)
    assert pre == 0 and held <= 1 << 16
    tight, pre, held = serving.continuous(_costs(), 16, lengths, max_seqs=0, kv_tokens=600)
    assert pre > 0 and held <= 600 and tight > roomy
    with pytest.raises(serving.DoesNotFitError):
        serving.continuous(_costs(), 16, [500], max_seqs=0, kv_tokens=300)


def test_decode_reads_the_cache_per_token_held():
    costs = _costs(fixed=0.0, kv=1e-6)
    took, _, _ = serving.continuous(costs, 100, [10], max_seqs=0, kv_tokens=1 << 20)
    # contexts 100, 101, ..., 109
    assert took == pytest.approx(sum(range(100, 110)) * 1e-6)


# --- a whole step -----------------------------------------------------------------------------


def _plan(num_slots, layouts: dict[str, tuple[int, int, int]], micro=None) -> Plan:
    units = {}
    for name, (dp, tp, pp) in layouts.items():
        size = tp * pp
        units[name] = (
            Layout(dp=dp, tp=tp, pp=pp),
            tuple(tuple(range(i * size, (i + 1) * size)) for i in range(dp)),
        )
    plan_ = Plan.of_units(accelerator="h100-sxm", num_slots=num_slots, layouts=units)
    if micro:
        plan_ = dataclasses.replace(
            plan_,
            model_stages=tuple(
                dataclasses.replace(ms, micro_batch=micro.get(ms.name, ms.micro_batch))
                for ms in plan_.model_stages
            ),
        )
    return plan_


EIGHT = {
    "actor@generation": (4, 2, 1),
    "actor@inference": (8, 1, 1),
    "ref@inference": (8, 1, 1),
    "critic@inference": (8, 1, 1),
    "reward@inference": (8, 1, 1),
    "actor@training": (1, 4, 2),
    "critic@training": (1, 4, 2),
}


def _lengths(mean, count, sigma, seed=0):
    rng = random.Random(seed)
    mu = -(sigma**2) / 2
    return [
        max(1, min(4 * mean, round(mean * 2.718281828 ** (mu + sigma * rng.gauss(0, 1)))))
        for _ in range(count)
    ]


def test_the_long_tail_decides_generation():
    workload = PpoWorkload.for_model(LLAMA_8B, global_batch=128, gen_len=1000)
    twin = ClusterTwin(device=H100, noise=0.0, interference=0.0)
    plan_ = _plan(8, EIGHT, micro={"actor@training": 1, "critic@training": 1})
    even = twin.step(plan_, workload, lengths=[1000] * 128)
    tail = twin.step(plan_, workload, lengths=_lengths(1000, 128, 0.6))
    assert not even.failure and not tail.failure
    assert tail.stage_seconds["generation"] > 1.5 * even.stage_seconds["generation"]


def test_a_plan_that_fits_short_responses_runs_out_of_memory_on_long_ones():
    workload = PpoWorkload.for_model(LLAMA_8B, global_batch=128, gen_len=500)
    twin = ClusterTwin(device=H100, noise=0.0, interference=0.0)
    plan_ = _plan(8, EIGHT, micro={"actor@training": 4, "critic@training": 4})
    short = twin.step(plan_, workload, lengths=[500] * 128)
    assert short.failure == "" and short.peak_fraction < 1.0
    long = twin.step(plan_, workload.with_gen_len(6000), lengths=[6000] * 128)
    assert long.failure.startswith("out of memory on slot")
    assert "(simulated)" in long.failure
    # one sequence per micro-batch holds fewer activations: the same lengths fit
    smaller = _plan(8, EIGHT, micro={n: 1 for n in EIGHT if n != "actor@generation"})
    assert twin.step(smaller, workload.with_gen_len(6000), lengths=[6000] * 128).failure == ""


def test_tensor_parallelism_across_nodes_is_priced_as_such():
    workload = PpoWorkload.for_model(LLAMA_8B, global_batch=64, gen_len=300)
    twin = ClusterTwin(device=H100, noise=0.0, interference=0.0)
    inside = {**{k: (2, 8, 1) for k in EIGHT}, "actor@generation": (2, 8, 1)}
    across = {**{k: (1, 16, 1) for k in EIGHT}}
    a = twin.step(_plan(16, inside), workload, lengths=[300] * 64)
    b = twin.step(_plan(16, across), workload, lengths=[300] * 64)
    # half the arithmetic per rank, but every layer's all-reduces cross the nodes' cards
    assert b.stage_seconds["training"] > 1.2 * a.stage_seconds["training"]


def test_noise_and_interference_move_the_step():
    workload = PpoWorkload.for_model(LLAMA_8B, global_batch=64, gen_len=300)
    plan_ = _plan(16, {k: (1, 8, 2) for k in EIGHT})
    quiet = ClusterTwin(device=H100, noise=0.0, interference=0.0)
    busy = ClusterTwin(device=H100, noise=0.0, interference=0.5, phase=0.0)
    crest = busy.interference_period_s / 2
    lengths = [300] * 64
    assert (
        busy.step(plan_, workload, lengths=lengths, at_s=crest).seconds
        > quiet.step(plan_, workload, lengths=lengths).seconds
    )
    noisy = ClusterTwin(device=H100, noise=0.05, interference=0.0)
    one = noisy.step(plan_, workload, lengths=lengths, rng=random.Random(1)).seconds
    two = noisy.step(plan_, workload, lengths=lengths, rng=random.Random(2)).seconds
    assert one != two


def test_a_step_refuses_a_batch_of_the_wrong_size_and_an_unknown_backend():
    workload = PpoWorkload.for_model(LLAMA_8B, global_batch=64, gen_len=300)
    twin = ClusterTwin(device=H100)
    plan_ = _plan(8, EIGHT)
    with pytest.raises(ValueError, match="lengths: 3 responses for a batch of 64"):
        twin.step(plan_, workload, lengths=[1, 2, 3])
    with pytest.raises(ValueError, match="backend"):
        twin.step(plan_, workload, lengths=[300] * 64, backend="tensorrt")


# --- published figures ------------------------------------------------------------------------


def test_generation_throughput_is_of_the_order_vllm_publishes():
    """The twin's run of vLLM's offline benchmark on one H100 (Llama-3-8B, 1,000 prompts of
    256 tokens, 256 out). The goal is 15%; the figure and why it is missed are in
    ``benchmarks/results/twin_published.json``. This guards the order of magnitude."""
    found = vllm_offline(H100, LLAMA_8B)
    assert found["preempted"] == 0
    assert 0.5 < found["ratio"] < 2.0


def test_a_layer_shard_holds_its_share_of_the_parameters():
    whole = sum(
        layers.Shard.of(LLAMA_8B, 1, 4, p, scalar_head=False, nbytes=2).params for p in range(4)
    )
    assert whole == pytest.approx(LLAMA_8B.num_params(scalar_head=False), rel=1e-6)
    split = layers.Shard.of(LLAMA_8B, 4, 1, 0, scalar_head=False, nbytes=2)
    assert split.params * 4 == pytest.approx(whole, rel=0.01)
