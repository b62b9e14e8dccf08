"""The hardware the twin simulates: devices, links and hosts, from public measurements.

Every figure is what a device *achieves* where a measurement exists, and comes from the public
source listed; nothing here is read from the planner's catalog (whose peaks the planner divides
by efficiencies it learns), and nothing is fitted to a result of the twin.

| figure | a100-80gb | h100-sxm | h200 | mi300x | source |
| --- | --- | --- | --- | --- | --- |
| dense BF16 peak (TFLOP/s) | 312 | 989 | 989 | 1307 | [1][2][3][4] |
| best achieved BF16 GEMM (TFLOP/s) | 271.2 | 794.5 | 794.5 | 668.4 | MAMF [5] |
| HBM (GB) | 80 GiB | 80 GiB | 141 | 192 | [1][2][3][4] |
| HBM bandwidth (TB/s) | 2.039 | 3.35 | 4.8 | 5.3 | [1][2][3][4] |
| achieved fraction, streaming weights | 0.78 | 0.82 | 0.82 (+) | 0.82 (+) | [6] |
| SMs / CUs | 108 | 132 | 132 | 304 | datasheets |
| all-reduce bus bandwidth, one node (GB/s) | 232 | 370 | 370 | 370 (+) | [7][9] |
| per-hop latency, one node (µs) | 2.5 | 2.5 | 2.5 | 2.5 (+) | [9][10] |
| network card per GPU (GB/s) | 23 | 47 | 47 | 47 (+) | [8] |
| per-hop latency across nodes (µs) | 3 | 3 | 3 | 3 | [10] |
| eager host launch per kernel (µs) | 9.4 | 9.4 | 9.4 | 9.4 | [11] |
| least device time of a kernel (µs) | 7 | 7 | 7 | 7 | [13] |
| serving host time per decode iteration | 1.6 ms + 35 µs a sequence | = | = | = | [12] |

(+) no measurement of this device found: the H100's is used.

How the figures are read: MAMF is the best GEMM rate over a sweep of shapes ("H200 is the same");
the streaming fraction is Vidur's projections at M=1-8 (2.37-2.86 TB/s on H100, 1.55-1.63 on
A100); the one-node bus bandwidth is nccl-tests' ring (8xH100 370 GB/s, NVLS 480; Vidur's 8xH100
all-reduce 365 GB/s at 64 MiB); 8 GPUs' small all-reduce takes 15 µs, six tree hops; a card gives
"46-48 GB/s" at NDR 400 Gb/s, half at HDR 200 Gb/s; NCCL's latency model puts 2x8 GPUs' tree at
about 25 µs.

[1] NVIDIA A100 datasheet ("BFLOAT16 Tensor Core 312 TFLOPS", "2,039GB/s"). [2] NVIDIA H100
(SXM) product page ("1,979 teraFLOPS" with sparsity, "3.35TB/s"). [3] NVIDIA H200 product page
(141 GB HBM3e, 4.8 TB/s). [4] AMD Instinct MI300X page ("Peak bfloat16 1307.4 TFLOPs", 192 GB,
5.3 TB/s). [5] github.com/stas00/ml-engineering ``compute/accelerator/README.md``, "Maximum
Achievable Matmul FLOPS comparison table". [6] github.com/microsoft/vidur
``data/profiling/compute/{h100,a100}/meta-llama/Llama-2-7b-hf/mlp.csv`` (fp16 projections at
M=1-8: 2.37-2.86 TB/s on H100, 1.55-1.63 TB/s on A100). [7] NVIDIA GTC24 S62129, "NCCL Tests
Allreduce Bus Bandwidth" (8xA100 232 GB/s; 8xH100 ring 370 GB/s, NVLS 480). [8] NVIDIA/nccl-tests
issue #290 (maintainer: "46-48GB/s per NIC" at NDR). [9] microsoft/vidur
``data/profiling/network/h100_dgx/all_reduce.csv`` (64 MiB: 322 µs; ≤64 KiB: 15-37 µs).
[10] NVIDIA/nccl ``src/graph/tuning.cc`` latency model (v2.30.7). [11] NVIDIA/Fuser issue #3507
(65 kernels, 0.616 ms of CPU time on a DGX H100). [12] microsoft/vidur
``data/profiling/a100/cpu_overheads.csv`` (vLLM V0, batch 8-32: schedule 0.2-0.55 ms,
prepare_inputs 0.8, sampler 0.6, process_outputs 0.23-0.69). [13] meta-pytorch/autoparallel pull
request #146 (a cost model fitted on H100); consistent with torchao's end-to-end batch-1 decode of
Llama-3.1-8B on H100 at 126.9 tokens/s, 57% of HBM bandwidth (pytorch/ao
``torchao/quantization/README.md``), against 82% for its projections alone.

Estimates with no public measurement found, named as such: a serving engine's start-up (15 s:
weights, KV-cache allocation, CUDA-graph capture), a forward-only unit's (1.5 s), a
communicator's set-up (0.3 s), a restart's fixed part (120 s), checkpoint storage (2 GB/s per
node), a Ray call (1 ms), and what the runtime reserves per device (2 GiB).

The **CPU slot** (a worker process standing in for a GPU on this kind of machine) is measured, not
cited: ``benchmarks/cpu_slot_profile.py`` writes ``profiles/cpu-slot.json`` (its GEMM rate and
how it falls for few rows, memcpy, gloo's latency and bandwidth, Ray's call round trip, how slots
slow each other down when more of them compute than the machine has cores, and the job's own
slot code timed and its operations counted for two models: a slot's passes run op by op, so an
operation's host time and their number per layer decide its small models' time).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

GB = 1e9
GIB = 2**30
PROFILES = Path(__file__).resolve().parent / "profiles"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Link:
    """A collective's path: seconds = ``latency_s`` + bytes moved per rank / ``bus_bytes_per_s``
    (bus bandwidth as nccl-tests reports it, so a ring all-reduce of ``n`` bytes moves
    ``2 (k-1)/k · n`` per rank)."""

    bus_bytes_per_s: float
    latency_s: float
    """Per hop of the ring or tree (a small all-reduce among ``k`` takes ``2 log2(k)`` hops)."""
    inter: bool = False
    """Whether the group crosses nodes (other tenants' traffic slows it)."""

    @property
    def key(self) -> tuple:
        return (self.bus_bytes_per_s, self.latency_s, self.inter)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Device:
    """One kind of slot and the links between slots."""

    name: str
    peak_flops: float
    gemm_flops: float
    """The best rate a large GEMM achieves (MAMF): tiles, clocks and power included."""
    compute_units: int
    """SMs (CUs): a GEMM's output tiles run in waves of this many."""
    tile: tuple[int, int] = (128, 256)
    """The output tile (rows, columns) a GEMM kernel computes per SM."""
    hbm_bytes: float
    hbm_bytes_per_s: float
    hbm_fraction: float
    """Of ``hbm_bytes_per_s``, what streaming kernels achieve."""
    attention_fraction: float = 0.6
    """Flash attention's forward rate over ``gemm_flops`` (its backward runs at 0.8 of that)."""
    intra: Link
    nic_bytes_per_s: float
    """What one GPU's network card achieves across nodes."""
    inter_latency_s: float
    gpus_per_node: int = 8
    launch_s: float
    """Host seconds to launch one kernel in an eager pass (training and inference)."""
    kernel_floor_s: float = 7e-6
    """Device seconds a kernel takes at least, however little it does."""
    decode_host_s: float = 1.6e-3
    decode_host_per_seq_s: float = 35e-6
    """Host seconds a serving engine spends per decode iteration (scheduling, preparing inputs,
    sampling, processing outputs), and per sequence in the batch, beside its captured graph."""
    reserved_bytes: float = 2.0 * GIB
    """Per device: the runtime's context, the collective library's buffers, the allocator's
    fragmentation."""
    storage_bytes_per_s: float = 2 * GB
    """Checkpoint read and write bandwidth per node (a shared file system)."""
    restart_s: float = 120.0
    """A restart's fixed part: processes, communicators, a model's first load."""
    cores: float = math.inf
    """Host cores the slots of one node share (a GPU slot: each has its own device)."""
    op_s: float = 0.0
    """Seconds of host work per operation where the host computes (a CPU slot's dispatch)."""
    call_s: float = 1e-3
    """Seconds of one remote call from the job's driver to a slot (a Ray actor call)."""
    eager_ops: tuple[float, float, float, float, float, float] | None = None
    """Where the passes run unfused, op by op (a CPU slot's eager PyTorch): operations per layer
    and per pass besides, of a decode step, a forward and a forward-and-backward, in that order
    (None: the kernels ``layers`` counts)."""
    sharing: tuple[float, ...] = ()
    """How much slower each slot computes with 1, 2, ... slots computing at once on the host
    (measured); past the table, in proportion to the slots over the cores."""
    group_s: float = 0.3
    """Seconds to set up a communicator among a primitive's slots (NCCL's init)."""
    serving_start_s: float = 15.0
    """Seconds to start a generation unit's serving engine once its weights are there (memory
    profiling, KV-cache allocation, CUDA-graph capture)."""
    unit_start_s: float = 1.5
    """Seconds to start a forward-only inference unit once its weights are there."""

    @functools.cached_property
    def key(self) -> tuple:
        """The device as a tuple of its figures (hashed once)."""
        return dataclasses.astuple(self)

    @property
    def hbm_rate(self) -> float:
        return self.hbm_bytes_per_s * self.hbm_fraction

    def link(self, slots) -> Link:
        """The link a group of slots communicates over: inside a node, or across nodes, where
        the collective library drives one network card per rank of the group on each node
        (so a group with one rank per node has one card's bandwidth)."""
        per_node: dict[int, int] = {}
        for s in slots:
            per_node[s // self.gpus_per_node] = per_node.get(s // self.gpus_per_node, 0) + 1
        if len(per_node) <= 1:
            return self.intra
        cards = min(per_node.values())
        return Link(
            bus_bytes_per_s=min(self.intra.bus_bytes_per_s, cards * self.nic_bytes_per_s),
            latency_s=self.inter_latency_s,
            inter=True,
        )


A100 = Device(
    name="a100-80gb",
    peak_flops=312e12,
    gemm_flops=271.2e12,
    compute_units=108,
    tile=(128, 128),
    hbm_bytes=80 * GIB,
    hbm_bytes_per_s=2.039e12,
    hbm_fraction=0.78,
    intra=Link(bus_bytes_per_s=232 * GB, latency_s=2.5e-6),
    nic_bytes_per_s=23 * GB,
    inter_latency_s=3e-6,
    launch_s=9.4e-6,
)
H100 = Device(
    name="h100-sxm",
    peak_flops=989e12,
    gemm_flops=794.5e12,
    compute_units=132,
    hbm_bytes=80 * GIB,
    hbm_bytes_per_s=3.35e12,
    hbm_fraction=0.82,
    intra=Link(bus_bytes_per_s=370 * GB, latency_s=2.5e-6),
    nic_bytes_per_s=47 * GB,
    inter_latency_s=3e-6,
    launch_s=9.4e-6,
)
H200 = dataclasses.replace(H100, name="h200", hbm_bytes=141 * GB, hbm_bytes_per_s=4.8e12)
MI300X = dataclasses.replace(
    H100,
    name="mi300x",
    peak_flops=1307.4e12,
    gemm_flops=668.4e12,
    compute_units=304,
    hbm_bytes=192 * GB,
    hbm_bytes_per_s=5.3e12,
)

CPU_SLOT = "cpu-slot"


def _cpu_slot(path: Path = PROFILES / "cpu-slot.json") -> Device:
    """This machine's CPU slots, from the profile ``benchmarks/cpu_slot_profile.py`` measured."""
    p = json.loads(path.read_text())
    gloo = p["gloo"]

    def link(kind: str) -> Link:
        fit = gloo.get(kind) or gloo["all_reduce"]
        return Link(bus_bytes_per_s=float(fit["bytes_per_s"]), latency_s=float(fit["latency_s"]))

    ops = _eager_ops(p["reference"])
    per_op = p["reference"][min(p["reference"], key=lambda m: p["reference"][m]["decode_step_ops"])]
    return Device(
        name=CPU_SLOT,
        peak_flops=float(p["gemm_flops"]),
        gemm_flops=float(p["gemm_flops"]),
        compute_units=1,
        tile=(int(p["gemm_half_rows"]), 1 << 30),
        hbm_bytes=4 * GIB,
        hbm_bytes_per_s=float(p["memcpy_bytes_per_s"]),
        hbm_fraction=1.0,
        attention_fraction=float(p.get("attention_fraction", 1.0)),
        intra=link("all_reduce"),
        nic_bytes_per_s=link("all_reduce").bus_bytes_per_s,
        inter_latency_s=link("all_reduce").latency_s,
        gpus_per_node=64,
        launch_s=float(per_op["seconds_per_op_decoding"]),
        decode_host_s=0.0,
        kernel_floor_s=0.0,
        decode_host_per_seq_s=0.0,
        reserved_bytes=0.25 * GIB,
        storage_bytes_per_s=float(p.get("storage_bytes_per_s", 1 * GB)),
        restart_s=float(p.get("restart_s", 5.0)),
        cores=float(p["cores"]),
        op_s=float(per_op["seconds_per_op_decoding"]),
        call_s=float(p["ray_call_s"]),
        eager_ops=ops,
        sharing=tuple(float(c["slowdown"]) for c in p.get("concurrency", ())),
    )


def _eager_ops(reference: dict) -> tuple[float, ...]:
    """Operations per layer and per pass of the job's own slot code, from the profile's counts
    for two models of different depth (a line through the two)."""
    from runtime.planner.catalog import MODELS  # the models' depth: a description, not a model

    (a, ra), (b, rb) = sorted(
        ((MODELS[name].num_layers, counts) for name, counts in reference.items()),
        key=lambda item: item[0],
    )[:2]
    out = []
    for field in ("decode_step_ops", "score_ops", "train_forward_backward_ops"):
        per_layer = (rb[field] - ra[field]) / (b - a)
        out += [per_layer, max(0.0, ra[field] - per_layer * a)]
    return tuple(out)


DEVICES: dict[str, Device] = {d.name: d for d in (A100, H100, H200, MI300X)}


def device(name: str) -> Device:
    """The device named ``name`` (the planner's accelerator names), or ValueError naming it."""
    if name == CPU_SLOT:
        return _cpu_slot()
    try:
        return DEVICES[name]
    except KeyError:
        known = ", ".join([*DEVICES, CPU_SLOT])
        raise ValueError(f"accelerator: the twin has no device {name!r}; known: {known}") from None
