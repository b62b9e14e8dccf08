"""Checks of the twin against published measurements of real systems.

``VLLM_LLAMA3_8B_H100``: vLLM's offline throughput benchmark on one H100 (vllm-project/vllm pull
request #7117, "On H100", vLLM main of 2024-08-04): ``benchmarks/benchmark_throughput.py
--input-len 256 --output-len 256 --model meta-llama/Meta-Llama-3-8B``, 1,000 prompts (the
script's default), every response exactly 256 tokens (``ignore_eos``), BF16, CUDA graphs,
``gpu_memory_utilization`` 0.9, ``max_num_seqs`` 256 (the engine's defaults then): 24.32
requests/s, 12,453 tokens/s (prompt and output together). Llama-3.1-8B has Meta-Llama-3-8B's
shapes.

``VIDUR_H100_LLAMA2_7B_GEMMS``: the median times Vidur profiled for Llama-2-7B's projections on one
H100 (github.com/microsoft/vidur ``data/profiling/compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv``,
fp16, tensor parallel 1), by rows ``M``: (QKV 4096→12288, gate-and-up 4096→22016, down
11008→4096) in microseconds.
"""

from __future__ import annotations

from runtime.planner.catalog import ModelConfig
from runtime.twin import kernels, layers
from runtime.twin.hardware import Device
from runtime.twin.twin import SERVING_UTILISATION, ClusterTwin, serve_unit

VLLM_LLAMA3_8B_H100 = {
    "tokens_per_s": 12453.04,
    "requests_per_s": 24.32,
    "prompts": 1000,
    "input_len": 256,
    "output_len": 256,
    "max_num_seqs": 256,
    "source": "vllm-project/vllm#7117 (benchmark_throughput.py on H100, vLLM 2024-08-04)",
}

VIDUR_H100_LLAMA2_7B_GEMMS = {
    1: (38, 64, 38),
    8: (36, 64, 36),
    64: (40, 66, 40),
    128: (41, 71, 48),
    256: (52, 130, 56),
    512: (90, 134, 76),
    1024: (151, 256, 109),
    4096: (584, 987, 441),
}
LLAMA2_7B_PROJECTIONS = ((4096, 12288), (4096, 22016), (11008, 4096))
"""(k, n) of each profiled projection."""


def vllm_offline(device: Device, model: ModelConfig, *, bench=VLLM_LLAMA3_8B_H100) -> dict:
    """The twin's run of ``bench`` on one ``device`` slot: its tokens/s beside the published."""
    twin = ClusterTwin(device=device, noise=0.0, interference=0.0)
    shard = layers.Shard.of(model, 1, 1, 0, scalar_head=False, nbytes=2)
    free = device.hbm_bytes * SERVING_UTILISATION - device.reserved_bytes - shard.params * 2
    seconds, preempted, _ = serve_unit(
        twin,
        [shard],
        (0,),
        [bench["output_len"]] * bench["prompts"],
        prompt=bench["input_len"],
        max_seqs=bench["max_num_seqs"],
        free_bytes=free,
    )
    tokens = bench["prompts"] * (bench["input_len"] + bench["output_len"])
    return {
        "twin_tokens_per_s": tokens / seconds,
        "published_tokens_per_s": bench["tokens_per_s"],
        "ratio": tokens / seconds / bench["tokens_per_s"],
        "seconds": seconds,
        "preempted": preempted,
        "source": bench["source"],
    }


def vidur_gemms(device: Device) -> list[dict]:
    """The twin's GEMM times beside Vidur's profile, by rows and projection."""
    out = []
    for m, measured in VIDUR_H100_LLAMA2_7B_GEMMS.items():
        for (k, n), us in zip(LLAMA2_7B_PROJECTIONS, measured, strict=True):
            twin_us = kernels.gemm(device, m, n, k).device_s * 1e6
            out.append({"m": m, "k": k, "n": n, "vidur_us": us, "twin_us": twin_us})
    return out
