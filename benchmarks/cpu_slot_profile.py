"""A profile of this machine's CPU slots as the real engine runs them, for the cluster twin.

Every figure is measured inside slot actors made by ``SlotPool.create`` (one Ray actor per slot,
``num_cpus=1``, ``torch.set_num_threads(1)`` set by ``SlotWorker``, joined into one gloo group on
loopback), through ``SlotPool.run`` as the PPO job's work reaches them, in fp32 (the PPO job's
slots compute in fp32: ``PpoJobConfig.workload`` says ``precision="fp32"`` and ``build_model``
makes fp32 models). Timings are medians of repeats after a warm-up; the machine is shared, so
its load average is written beside them. Writes ``runtime/twin/profiles/cpu-slot.json`` (the
twin's ``device("cpu-slot")``) and a copy with the machine's description in
``benchmarks/results/cpu_slot_profile.json``.

Fields (seconds, bytes and FLOP/s throughout):

- ``gemm_flops``: FLOP/s of one slot on a large fp32 GEMM (``torch.mm``, the fastest of the
  square sizes in ``gemm_large``), the other slots idle.
- ``gemm_half_rows``: the row count M at which ``torch.mm`` of ``(M, K) @ (K, N)`` with N = K
  reaches half of ``gemm_flops``, taken at N = K = 256 (the middle of the 64..512 sweep), log-
  interpolated between sweep points. ``gemm_half_rows_by_nk`` gives it for every N = K of the
  sweep (null where the rate never reaches half: at small N = K the call's overhead caps it);
  ``gemm_sweep`` the raw points (``nk``, ``m``, seconds per call, FLOP/s). A GEMM of M rows
  then takes about ``2·M·N·K / (gemm_flops · M / (M + gemm_half_rows))``, and never less than
  ``op_overhead_s``.
- ``gemm_plateau_by_nk``: the best rate each N = K reaches in the sweep.
- ``op_overhead_s``: one tiny eager op (the median of a 1-element ``torch.add`` and an
  ``(1, 8) @ (8, 8)`` matmul, per op in a loop); the two alone are ``tiny_add_s`` and
  ``tiny_matmul_s``; ``linear_op_s`` is ``F.linear`` on (1, 8) × (8, 8).
- ``module_call_s``: an ``nn.Linear(8, 8)`` call on a (1, 8) input (the op plus the Module's
  ``__call__`` machinery); ``autograd_op_s``: per op, the forward with autograd recording plus
  its share of the backward, on a chain of 200 tiny ops.
- ``memcpy_bytes_per_s``: ``dst.copy_(src)`` of 128 MiB fp32 buffers already touched, bytes of
  ``src`` per second; ``memcpy_by_size`` at 1, 16 and 128 MiB.
- ``cores`` (``os.sched_getaffinity`` of a slot), ``slot_threads`` (``torch.get_num_threads()``
  in a slot), ``slot_interop_threads``, ``slot_env`` (the thread variables a slot sees).
- ``gloo``: for 2 and 4 slot processes, each collective's ``alpha_s`` and ``beta_bytes_per_s``
  of ``t = alpha + bytes / beta``, fitted (least squares of the relative error) to a sweep of
  per-rank message sizes from 1 KiB to 16 MiB; ``points`` are the raw medians. ``bytes`` is the
  size of each rank's own tensor: the reduced tensor (``all_reduce``), each rank's contribution
  (``all_gather``: every rank receives ``(n - 1) ×`` it), the broadcast tensor (``broadcast``,
  from the group's first rank), the message (``send_recv``: with 2 processes one pair, with 4
  two disjoint pairs at once, 0→1 and 2→3). A run's time is the slowest rank's, each run started
  together by a barrier, buffers reused (warm pages); the sizes are swept in 3 rounds (30 runs
  of a size up to 64 KiB, 9 up to 1 MiB, 3 above), each point is the median (``p25_s`` its
  first quartile: the machine is shared, and a rank descheduled by another process's work
  costs a time slice, milliseconds). ``gloo[op]`` (op named directly) gives the
  2-process fit in a collective library's convention: ``latency_s`` per hop (a 2-rank ring
  all-reduce is 2 hops, the others 1) and ``bytes_per_s`` the bus bandwidth (at 2 ranks it
  equals ``beta``: the bus factors 2(k-1)/k and k-1 are 1).
- ``ray_call_s``: the round trip of ``SlotPool.run`` of a trivial slot function
  (``slot_work.workspaces``, pickled by reference as the job's functions are) on one slot;
  ``ray_call_parallel_s`` the same call on every slot at once (4) and on 2
  (``ray_call_parallel_2_s``); ``ray_actor_method_s`` a bare actor method (the liveness probe
  the engine sends every slot before each step); ``ray_call_by_value_s`` a function that Ray
  must pickle by value; ``ray_arg_bytes_per_s`` the extra seconds per byte of a tensor argument
  (4 MiB) and ``ray_result_bytes_per_s`` of a returned tensor.
- ``concurrency``: how much slower a GEMM-bound loop (256³ ``torch.mm``) runs on each slot when
  1..4 slots run it at once, ``[{"slots", "slowdown"}]`` (the median slot's time over the
  solo time of the same round, the median of 5 rounds; ``slowest`` the slowest slot's);
  ``concurrency_dispatch`` the same for a loop of tiny ops (the PPO job's models are
  so small that their steps are mostly such ops).
- ``reference``: the job's own slot code (``runtime.ppo.slot_work``) on a one-slot unit of
  ``tiny-sft`` and ``tiny-llama``, batch 8, prompts of 5 tokens, 16 new tokens: seconds and
  eager (ATen) ops of one decode step (``decode_step_s``/``_ops``: the cached one-token forward
  of the whole batch and its sampling), of the prefill with the first sample, of a scoring
  forward and of a training micro-batch's forward and backward; ``seconds_per_op_decoding``
  is the decode step's seconds per op (dispatch, Module calls and Python included).
- ``measured_on``: date, torch and Ray versions, ``nproc``, the load average at the start and
  the end (and the 1-minute figure as each section ended, ``loadavg_by_section``), the host's
  ``platform``; ``command``.

    python benchmarks/cpu_slot_profile.py [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import runtime.engine  # noqa: E402, F401 - keeps Ray on loopback (before anything imports ray)
from benchmarks import _report  # noqa: E402
from runtime.emu import slot_ops  # noqa: E402
from runtime.engine.ray_cluster import ray_connection  # noqa: E402
from runtime.engine.slots import SlotPool  # noqa: E402
from runtime.ppo import slot_work  # noqa: E402

PROFILE = ROOT / "runtime" / "twin" / "profiles" / "cpu-slot.json"
SLOTS = 4
KIB, MIB = 1024, 1024 * 1024
NK_SWEEP = (64, 128, 256, 512)
M_SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
GLOO_SIZES = (KIB, 4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB)
GLOO_OPS = ("all_reduce", "all_gather", "broadcast", "send_recv")
HALF_AT_NK = 256
REFERENCE_MODELS = ("tiny-sft", "tiny-llama")
REFERENCE = {"batch": 8, "prompt_len": 5, "new_tokens": 16}


def _one_slot_unit(model: str):
    """A one-slot unit of ``model``'s actor generation stage (fp32), on slot 0."""
    from runtime.emu.primitives import Unit
    from runtime.planner import default_catalog
    from runtime.planner.plan import Layout
    from runtime.planner.workload import ModelStage
    from runtime.transition.units import unit_layout

    ms = ModelStage(role="actor", stage="generation", model=default_catalog().model(model))
    layout = unit_layout(ms, Layout(dp=1, tp=1, pp=1), "fp32")
    return Unit(unit_id=f"profile/{model}", model_stage=ms.name, layout=layout, slots=(0,))


# --- on the slots (functions Ray pickles by value from this script) ------------------------------


def _per_call(fn, *, least_s: float = 0.02, repeats: int = 5) -> float:
    """Median seconds of one ``fn()`` over ``repeats`` timed loops, each long enough to be timed
    (at least ``least_s``), after a warm-up."""
    fn()
    fn()
    started = time.perf_counter()
    fn()
    once = max(time.perf_counter() - started, 1e-7)
    loops = max(1, min(100_000, int(least_s / once)))
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(loops):
            fn()
        runs.append((time.perf_counter() - started) / loops)
    return statistics.median(runs)


def slot_environment(ctx) -> dict:
    """What a slot runs with: its threads, cores and the thread variables it sees."""
    import torch.__config__ as config  # imported here: Ray pickles this function by value

    keys = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GLOO_SOCKET_IFNAME")
    return {
        "rank": ctx.rank,
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "cores": len(os.sched_getaffinity(0)),
        "env": {k: os.environ.get(k) for k in keys},
        "parallel_info": config.parallel_info().splitlines()[:6],
    }


@torch.no_grad()
def gemm_large(ctx, *, sizes: list[int]) -> list[dict]:
    out = []
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        seconds = _per_call(lambda a=a, b=b: torch.mm(a, b), least_s=0.05, repeats=5)
        out.append({"n": n, "seconds": seconds, "flops": 2 * n**3 / seconds})
    return out


@torch.no_grad()
def gemm_sweep(ctx, *, nks: list[int], ms: list[int]) -> list[dict]:
    out = []
    for nk in nks:
        b = torch.randn(nk, nk)
        for m in ms:
            a = torch.randn(m, nk)
            seconds = _per_call(lambda a=a, b=b: torch.mm(a, b), least_s=0.01, repeats=5)
            out.append({"nk": nk, "m": m, "seconds": seconds, "flops": 2 * m * nk * nk / seconds})
    return out


def op_overheads(ctx) -> dict:
    one = torch.ones(1)
    x, w = torch.randn(1, 8), torch.randn(8, 8)
    linear = torch.nn.Linear(8, 8)
    loop = 1000

    def many(fn):
        def run():
            for _ in range(loop):
                fn()

        return _per_call(run, least_s=0.02, repeats=7) / loop

    with torch.no_grad():
        tiny_add = many(lambda: torch.add(one, one))
        tiny_matmul = many(lambda: torch.mm(x, w))
        linear_op = many(lambda: torch.nn.functional.linear(x, w))
        module = many(lambda: linear(x))
    chain = 200
    leaf = torch.ones(8, requires_grad=True)

    def autograd_chain():
        y = leaf
        for _ in range(chain):
            y = y * 1.0001
        y.sum().backward()

    autograd = _per_call(autograd_chain, least_s=0.02, repeats=7) / chain
    return {
        "tiny_add_s": tiny_add,
        "tiny_matmul_s": tiny_matmul,
        "linear_op_s": linear_op,
        "module_call_s": module,
        "autograd_op_s": autograd,
    }


def memcpy(ctx, *, sizes: list[int]) -> list[dict]:
    out = []
    for nbytes in sizes:
        src = torch.ones(nbytes // 4)
        dst = torch.zeros(nbytes // 4)
        seconds = _per_call(lambda src=src, dst=dst: dst.copy_(src), least_s=0.05, repeats=5)
        out.append({"bytes": nbytes, "seconds": seconds, "bytes_per_s": nbytes / seconds})
        del src, dst
    return out


def collective(ctx, *, op: str, ranks: list[int], sizes: list[int], repeats: list[int]) -> list:
    """This rank's seconds of each timed run of ``op`` among ``ranks``, per size."""
    import torch.distributed as dist

    if ctx.rank not in ranks:
        return []
    whole = len(ranks) == ctx.world_size
    group = None if whole else slot_ops._group(ctx, ranks)
    out = []
    for nbytes, runs in zip(sizes, repeats, strict=True):
        buffer = torch.ones(max(1, nbytes // 4))
        gathered = (
            [torch.empty_like(buffer) for _ in ranks] if op == "all_gather" else None
        )  # allocated once: warm pages, as the arena gives the real primitives

        def once(buffer=buffer, gathered=gathered):
            if op == "all_reduce":
                dist.all_reduce(buffer, group=group)
            elif op == "all_gather":
                dist.all_gather(gathered, buffer, group=group)
            elif op == "broadcast":
                dist.broadcast(buffer, src=ranks[0], group=group)
            else:  # pairs (r0 -> r1), (r2 -> r3): global ranks on the default group
                position = ranks.index(ctx.rank)
                peer = ranks[position ^ 1]
                if position % 2 == 0:
                    dist.send(buffer, dst=peer)
                else:
                    dist.recv(buffer, src=peer)

        once()
        times = []
        for _ in range(runs):
            dist.barrier(group=group)
            started = time.perf_counter()
            once()
            times.append(time.perf_counter() - started)
        out.append(times)
        del buffer, gathered
    return out


@torch.no_grad()
def gemm_loop(ctx, *, n: int, iterations: int) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    started = time.perf_counter()
    for _ in range(iterations):
        torch.mm(a, b)
    return time.perf_counter() - started


@torch.no_grad()
def dispatch_loop(ctx, *, iterations: int) -> float:
    x, w = torch.randn(4, 16), torch.randn(16, 16)
    torch.mm(x, w)
    started = time.perf_counter()
    for _ in range(iterations):
        torch.mm(x, w).add_(1.0)
    return time.perf_counter() - started


def reference_model(ctx, *, unit, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """The job's own slot code on a one-slot unit of a catalog model: seconds and eager ops of
    one decode step (``slot_work._generate_torch``: the KV-cached forward of one token for the
    whole batch, sampling included), of the prefill with the first sample, of a scoring
    forward (``slot_work.score``, log-probabilities) and of a training micro-batch's forward and
    backward over ``batch`` sequences of ``prompt_len + new_tokens``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from runtime.ppo import slot_work as work
    from runtime.ppo.generate import SamplingParams

    class Count(TorchDispatchMode):
        # (not named ``ops``: Ray's pickler would take that for ``torch.ops`` and fail)
        seen = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.seen += 1
            return func(*args, **(kwargs or {}))

    ws = work.workspace(ctx, unit)
    prompts = [[1 + (i + j) % 7 for j in range(prompt_len)] for i in range(batch)]
    rows = list(range(batch))
    width = prompt_len + new_tokens
    sequences = torch.randint(1, 8, (batch, width))
    mask = torch.ones(batch, width, dtype=torch.long)

    def generate(tokens: int):
        params = SamplingParams(max_new_tokens=tokens, eos_token_id=None, seed=0)
        return lambda: work._generate_torch(ctx, ws, prompts, rows, params, 0)

    def score():
        work.score(
            ctx,
            unit=unit,
            sequences=sequences,
            attention_mask=mask,
            prompt_length=prompt_len,
            output="logprobs",
        )

    def train():
        head = work._stage_forward(ws, sequences, mask)
        head.float().logsumexp(-1).mean().backward()
        ws.model.zero_grad(set_to_none=True)

    out = {}
    for name, fn in (
        ("first_token", generate(1)),
        ("generate", generate(1 + new_tokens)),
        ("score", score),
        ("train", train),
    ):
        seconds = _per_call(fn, least_s=0.05, repeats=5)
        Count.seen = 0
        with Count():
            fn()
        out[name] = {"seconds": seconds, "ops": Count.seen}
    decode_s = (out["generate"]["seconds"] - out["first_token"]["seconds"]) / new_tokens
    decode_ops = (out["generate"]["ops"] - out["first_token"]["ops"]) / new_tokens
    ctx.state.get("ppo_workspaces", {}).clear()
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "decode_step_s": decode_s,
        "decode_step_ops": decode_ops,
        "prefill_and_first_token_s": out["first_token"]["seconds"],
        "prefill_and_first_token_ops": out["first_token"]["ops"],
        "score_s": out["score"]["seconds"],
        "score_ops": out["score"]["ops"],
        "train_forward_backward_s": out["train"]["seconds"],
        "train_forward_backward_ops": out["train"]["ops"],
        "seconds_per_op_decoding": decode_s / decode_ops,
    }


def echo(ctx, *, tensor=None, nbytes: int = 0):
    """Takes a tensor argument, or returns one of ``nbytes``."""
    return torch.ones(nbytes // 4) if nbytes else None


# --- on the driver ------------------------------------------------------------------------------


def _median_call(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - started)
    return statistics.median(runs)


def fit_alpha_beta(points: list[tuple[int, float]]) -> dict:
    """``t = alpha + bytes / beta`` by least squares of the relative error (weights 1/t²), so
    that the small messages (latency) count as much as the large ones (bandwidth)."""
    sw = swx = swxx = swy = swxy = 0.0
    for x, t in points:
        w = 1.0 / (t * t)
        sw, swx, swxx = sw + w, swx + w * x, swxx + w * x * x
        swy, swxy = swy + w * t, swxy + w * x * t
    det = sw * swxx - swx * swx
    slope = (sw * swxy - swx * swy) / det
    alpha = (swy - slope * swx) / sw
    if slope <= 0 or alpha < 0:  # degenerate (noise): latency of the smallest, rate of the largest
        alpha = min(t for _, t in points)
        big, t_big = max(points)
        slope = max(t_big - alpha, 1e-12) / big
    worst = max(abs(alpha + slope * x - t) / t for x, t in points)
    return {"alpha_s": alpha, "beta_bytes_per_s": 1.0 / slope, "max_rel_error": worst}


def half_rows(sweep: list[dict], nk: int, peak: float) -> float | None:
    """The M at which the rate of N = K = ``nk`` first reaches ``peak / 2`` (log-interpolated)."""
    points = sorted((p["m"], p["flops"]) for p in sweep if p["nk"] == nk)
    target = peak / 2
    for (m0, r0), (m1, r1) in itertools.pairwise(points):
        if r0 >= target:
            return float(m0)
        if r1 >= target:
            f = (math.log(target) - math.log(r0)) / (math.log(r1) - math.log(r0))
            return math.exp(math.log(m0) + f * (math.log(m1) - math.log(m0)))
    return None


def _slowdowns(pool: SlotPool, fn, kwargs: dict, repeats: int) -> list[dict]:
    """Per k, rounds of (the loop alone on slot 0, then on slots 0..k-1 at once): a round's
    slowdown is the median slot's time over that round's solo time, so that load from outside
    that drifts during the measurement cancels; the figure is the median over rounds."""
    out = []
    for k in range(1, SLOTS + 1):
        rounds, slowest, seconds = [], [], []
        for _ in range(repeats):
            solo = pool.run(fn, on=[0], **kwargs)[0]
            together = pool.run(fn, on=list(range(k)), **kwargs)
            rounds.append(statistics.median(together) / solo)
            slowest.append(max(together) / solo)
            seconds.append(statistics.median(together))
        out.append(
            {
                "slots": k,
                "slowdown": statistics.median(rounds),
                "slowest": statistics.median(slowest),
                "seconds": statistics.median(seconds),
            }
        )
    return out


def measure(quick: bool) -> dict:
    load_start = os.getloadavg()
    started = time.perf_counter()
    out: dict = {}
    loads: dict[str, float] = {}  # the 1-minute load average as each section ends
    with ray_connection(None, num_cpus=SLOTS):
        pool = SlotPool.create(SLOTS, call_timeout_s=300)
        try:
            out["pool_setup_s"] = pool.setup_s
            env = pool.run(slot_environment)
            out["cores"] = env[0]["cores"]
            out["slot_threads"] = env[0]["threads"]
            out["slot_interop_threads"] = env[0]["interop_threads"]
            out["slot_env"] = env[0]["env"]
            out["slot_parallel_info"] = env[0]["parallel_info"]
            print(
                f"slots: {SLOTS}, threads {out['slot_threads']}, cores {out['cores']}", flush=True
            )

            large = pool.run(gemm_large, on=[0], sizes=[512, 1024] if quick else [512, 1024, 1536])
            out["gemm_large"] = large[0]
            out["gemm_flops"] = max(p["flops"] for p in large[0])
            ms = [m for m in M_SWEEP if not quick or m in (1, 16, 256, 4096)]
            sweep = pool.run(gemm_sweep, on=[0], nks=list(NK_SWEEP), ms=ms)[0]
            out["gemm_sweep"] = sweep
            by_nk = {str(nk): half_rows(sweep, nk, out["gemm_flops"]) for nk in NK_SWEEP}
            out["gemm_half_rows_by_nk"] = by_nk
            out["gemm_half_rows"] = by_nk[str(HALF_AT_NK)]
            out["gemm_plateau_by_nk"] = {
                str(nk): max(p["flops"] for p in sweep if p["nk"] == nk) for nk in NK_SWEEP
            }
            loads["gemm"] = os.getloadavg()[0]
            print(f"gemm: {out['gemm_flops'] / 1e9:.1f} GFLOP/s, half at {by_nk}", flush=True)

            ops = pool.run(op_overheads, on=[0])[0]
            out.update(ops)
            out["op_overhead_s"] = statistics.fmean((ops["tiny_add_s"], ops["tiny_matmul_s"]))
            copies = pool.run(memcpy, on=[0], sizes=[MIB, 16 * MIB, 128 * MIB])[0]
            out["memcpy_by_size"] = copies
            out["memcpy_bytes_per_s"] = copies[-1]["bytes_per_s"]
            loads["ops_memcpy"] = os.getloadavg()[0]
            print(f"ops: {ops}; memcpy {out['memcpy_bytes_per_s'] / 1e9:.1f} GB/s", flush=True)

            out["reference"] = {}
            for model in REFERENCE_MODELS:
                ref = pool.run(reference_model, on=[0], unit=_one_slot_unit(model), **REFERENCE)[0]
                out["reference"][model] = ref
                print(
                    f"{model}: decode step {ref['decode_step_s'] * 1e3:.2f} ms "
                    f"({ref['decode_step_ops']:.0f} ops), score {ref['score_s'] * 1e3:.2f} ms, "
                    f"train fwd+bwd {ref['train_forward_backward_s'] * 1e3:.2f} ms",
                    flush=True,
                )
            loads["reference"] = os.getloadavg()[0]

            out["gloo"] = gloo(pool, quick)

            loads["gloo"] = os.getloadavg()[0]
            calls = 20 if quick else 60
            call = lambda on: pool.run(slot_work.workspaces, on=on)  # noqa: E731
            out["ray_call_s"] = _median_call(lambda: call([0]), calls)
            out["ray_call_parallel_s"] = _median_call(lambda: call(list(range(SLOTS))), calls)
            out["ray_call_parallel_2_s"] = _median_call(lambda: call([0, 1]), calls)
            out["ray_actor_method_s"] = _median_call(
                lambda: pool.memory(), calls
            )  # every slot, as the liveness probe
            out["ray_call_by_value_s"] = _median_call(lambda: pool.run(echo, on=[0]), calls)
            arg = torch.ones(4 * MIB // 4)
            with_arg = _median_call(lambda: pool.run(echo, on=[0], tensor=arg), calls // 2)
            out["ray_arg_bytes_per_s"] = 4 * MIB / max(with_arg - out["ray_call_by_value_s"], 1e-9)
            with_result = _median_call(lambda: pool.run(echo, on=[0], nbytes=4 * MIB), calls // 2)
            out["ray_result_bytes_per_s"] = (
                4 * MIB / max(with_result - out["ray_call_by_value_s"], 1e-9)
            )
            print(
                f"ray: call {out['ray_call_s'] * 1e3:.2f} ms, all {SLOTS} "
                f"{out['ray_call_parallel_s'] * 1e3:.2f} ms",
                flush=True,
            )

            loads["ray"] = os.getloadavg()[0]
            repeats = 2 if quick else 5
            out["concurrency"] = _slowdowns(
                pool, gemm_loop, {"n": 256, "iterations": 150 if quick else 400}, repeats
            )
            out["concurrency_dispatch"] = _slowdowns(
                pool, dispatch_loop, {"iterations": 5000 if quick else 20000}, repeats
            )
            loads["concurrency"] = os.getloadavg()[0]
            print(f"concurrency: {[round(c['slowdown'], 2) for c in out['concurrency']]}")
        finally:
            pool.close()
    out["measured_on"] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "torch": torch.__version__,
        "ray": __import__("ray").__version__,
        "nproc": int(subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()),
        "loadavg_start": list(load_start),
        "loadavg_end": list(os.getloadavg()),
        "loadavg_by_section": loads,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "wall_s": time.perf_counter() - started,
        "quick": quick,
    }
    return out


def gloo(pool: SlotPool, quick: bool) -> dict:
    pool.run(slot_ops.ensure_groups, groups=[(0, 1)])
    sizes = [s for s in GLOO_SIZES if not quick or s in (KIB, 64 * KIB, MIB, 16 * MIB)]
    # Rounds over every op and size, so that load from outside, which comes and goes, falls on
    # all of them alike; each round takes a share of each size's runs.
    rounds = 2 if quick else 3
    repeats = [10 if s <= 64 * KIB else 3 if s <= MIB else 1 for s in sizes]
    out: dict = {}
    for n in (2, SLOTS):
        ranks = list(range(n))
        runs: dict[str, list[list[float]]] = {op: [[] for _ in sizes] for op in GLOO_OPS}
        for _ in range(rounds):
            for op in GLOO_OPS:
                per_rank = pool.run(
                    collective, on=ranks, op=op, ranks=ranks, sizes=sizes, repeats=repeats
                )
                for i in range(len(sizes)):
                    # a run lasts until its slowest rank is done
                    runs[op][i] += [max(r[i][j] for r in per_rank) for j in range(repeats[i])]
        per_op = {}
        for op in GLOO_OPS:
            points = [
                {
                    "bytes": nbytes,
                    "seconds": statistics.median(times),
                    "p25_s": statistics.quantiles(times, n=4)[0] if len(times) > 1 else times[0],
                    "runs": len(times),
                }
                for nbytes, times in zip(sizes, runs[op], strict=True)
            ]
            fit = fit_alpha_beta([(p["bytes"], p["seconds"]) for p in points])
            per_op[op] = {**fit, "points": points}
            print(
                f"gloo {n} {op}: alpha {fit['alpha_s'] * 1e6:.0f} us, "
                f"beta {fit['beta_bytes_per_s'] / 1e9:.2f} GB/s",
                flush=True,
            )
        out[str(n)] = per_op
    # The same fits in the convention of a collective library's tests (nccl-tests): a per-hop
    # latency and a bus bandwidth, from the 2-process fits (2 processes on the 2 cores; with
    # more processes than cores the 4-process fits hold the oversubscription too).
    two = out["2"]
    # With 2 ranks every bus factor (2(k-1)/k, k-1, 1) is 1; a ring all-reduce is 2 hops.
    hops = {"all_reduce": 2.0, "all_gather": 1.0, "broadcast": 1.0, "send_recv": 1.0}
    for op in GLOO_OPS:
        out[op] = {
            "latency_s": two[op]["alpha_s"] / hops[op],
            "bytes_per_s": two[op]["beta_bytes_per_s"],
            "from": "2 processes",
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer points (a smoke run)")
    parser.add_argument(
        "--profile", type=Path, default=PROFILE, help="where the twin's profile is written"
    )
    args = parser.parse_args()
    profile = measure(args.quick)
    profile["command"] = shlex.join(["python", "benchmarks/cpu_slot_profile.py", *sys.argv[1:]])
    profile = {"device": "cpu-slot", **profile}
    args.profile.parent.mkdir(parents=True, exist_ok=True)
    args.profile.write_text(json.dumps(profile, indent=2) + "\n")
    rows = [
        ["gemm_flops", f"{profile['gemm_flops'] / 1e9:.2f} GFLOP/s"],
        ["gemm_half_rows (N=K=256)", _shown(profile["gemm_half_rows"])],
        *(
            [f"  half rows N=K={nk}", _shown(v)]
            for nk, v in profile["gemm_half_rows_by_nk"].items()
        ),
        *(
            [f"  plateau N=K={nk}", f"{v / 1e9:.2f} GFLOP/s"]
            for nk, v in profile["gemm_plateau_by_nk"].items()
        ),
        ["op_overhead_s", f"{profile['op_overhead_s'] * 1e6:.1f} us"],
        ["module_call_s", f"{profile['module_call_s'] * 1e6:.1f} us"],
        ["autograd_op_s", f"{profile['autograd_op_s'] * 1e6:.1f} us"],
        ["memcpy_bytes_per_s", f"{profile['memcpy_bytes_per_s'] / 1e9:.2f} GB/s"],
        ["cores / slot_threads", f"{profile['cores']} / {profile['slot_threads']}"],
        ["ray_call_s", f"{profile['ray_call_s'] * 1e3:.2f} ms"],
        ["ray_call_parallel_s (4)", f"{profile['ray_call_parallel_s'] * 1e3:.2f} ms"],
        ["ray_actor_method_s (4)", f"{profile['ray_actor_method_s'] * 1e3:.2f} ms"],
        *(
            [
                f"gloo {n} {op}",
                f"{f['alpha_s'] * 1e6:.0f} us + B / {f['beta_bytes_per_s'] / 1e9:.2f} GB/s",
            ]
            for n, ops in profile["gloo"].items()
            if n.isdigit()
            for op, f in ops.items()
        ),
        [
            "concurrency (gemm)",
            " ".join(f"{c['slots']}:{c['slowdown']:.2f}" for c in profile["concurrency"]),
        ],
        [
            "concurrency (tiny ops)",
            " ".join(f"{c['slots']}:{c['slowdown']:.2f}" for c in profile["concurrency_dispatch"]),
        ],
        [
            "load average start/end",
            f"{profile['measured_on']['loadavg_start']} / {profile['measured_on']['loadavg_end']}",
        ],
    ]
    _report.print_table(["figure", "value"], rows)
    path = _report.write("cpu_slot_profile", {"profile": profile})
    print(f"wrote {args.profile} and {path}")
    return 0


def _shown(value: float | None) -> str:
    return "never (call overhead caps it)" if value is None else f"{value:.0f} rows"


if __name__ == "__main__":
    raise SystemExit(main())
