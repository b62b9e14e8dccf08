"""Seconds of the operations a step is made of, from their shapes and the device.

- **GEMM**: an ``m × k`` by ``k × n`` product runs as output tiles, one per compute unit at a
  time, so its time is its waves of tiles at the device's best GEMM rate (a partial tile or a
  partial wave costs a whole one: few rows run far from the peak); it can also be bound by
  reading its operands and writing its output. On a CPU slot, whose rate falls with few rows
  as the profile measured, the rate is ``gemm_flops · m / (m + half_rows)``.
- **Attention** (flash): causal ``2 s² d`` FLOPs per head forward at the device's attention
  rate, 2.5 times that backward at 0.8 of the rate; in decode, reading every cached key and value.
- **Streaming** work (norms, activations, residuals, the optimizer, copies): bytes over the
  achieved HBM bandwidth.
- **Collectives**: the faster of a ring and a tree at the link's latency and bus bandwidth
  (NCCL picks between them by message size).

Every kernel takes at least ``kernel_floor_s`` on the device (its launch inside a stream or a
graph, the units' ramp-up and tail). A kernel also costs its launch on the host; a pass takes the
longer of its kernels' device time and its launches (a host that launches slower than the device
computes leaves the device idle).
"""

from __future__ import annotations

import dataclasses
import math

from runtime.twin.hardware import Device, Link

ATTENTION_BACKWARD_FLOPS = 2.5
ATTENTION_BACKWARD_RATE = 0.8


@dataclasses.dataclass
class Work:
    """What a pass does on one slot: device seconds, host seconds and kernels launched, and
    seconds of collectives (which wait for every rank and overlap nothing)."""

    device_s: float = 0.0
    kernels: int = 0
    comm_s: float = 0.0
    host_s: float = 0.0

    def add(self, other: Work, times: float = 1.0) -> Work:
        self.device_s += other.device_s * times
        self.kernels += round(other.kernels * times)
        self.comm_s += other.comm_s * times
        self.host_s += other.host_s * times
        return self

    def seconds(self, dev: Device, *, slowdown: float = 1.0) -> float:
        """Its wall time: device work behind the host's launches, then the collectives.
        ``slowdown``: how much slower the host and a CPU slot's arithmetic run (slots sharing
        too few cores)."""
        compute = self.device_s * (slowdown if math.isfinite(dev.cores) else 1.0)
        launches = self.kernels * dev.launch_s * slowdown + self.host_s * slowdown
        if math.isfinite(dev.cores):  # a CPU slot computes on the host: dispatch adds up
            return compute + launches + self.comm_s
        return max(compute, launches) + self.comm_s


def gemm(dev: Device, m: float, n: float, k: float, nbytes: int = 2) -> Work:
    """One GEMM of an ``m × k`` and a ``k × n`` operand."""
    if m <= 0 or n <= 0 or k <= 0:
        return Work()
    flops = 2.0 * m * n * k
    if math.isfinite(dev.cores):
        half = dev.tile[0]
        compute = flops / (dev.gemm_flops * m / (m + half))
        reads = (m * k + k * n + m * n) * nbytes / dev.hbm_rate
    else:
        # The library picks a tile no taller than it must be (16 rows at least, a tensor core's
        # granularity), splits the reduction over idle units when the tiles cannot fill them,
        # and every wave of tiles takes as long as a full one.
        tm = min(dev.tile[0], max(16, 1 << math.ceil(math.log2(max(m, 1)))))
        tn = dev.tile[1]
        rows, cols = math.ceil(m / tm), math.ceil(n / tn)
        tiles = rows * cols
        split = max(1, min(dev.compute_units // tiles, math.ceil(k / 256)))
        waves = math.ceil(tiles * split / dev.compute_units)
        per_unit = dev.gemm_flops / dev.compute_units
        compute = waves * 2.0 * tm * tn * (k / split) / per_unit
        reads = (m * k + k * n + m * n) * nbytes / dev.hbm_rate
    return Work(device_s=max(compute, reads, dev.kernel_floor_s), kernels=1)


def attention(dev: Device, lengths_sq: float, hidden_per_rank: float, *, backward=False) -> Work:
    """Flash attention over sequences whose squared lengths sum to ``lengths_sq``, causal, for
    the heads of ``hidden_per_rank`` width one rank holds."""
    flops = 2.0 * lengths_sq * hidden_per_rank
    rate = dev.gemm_flops * dev.attention_fraction
    if backward:
        flops *= ATTENTION_BACKWARD_FLOPS
        rate *= ATTENTION_BACKWARD_RATE
    return Work(device_s=max(flops / rate, dev.kernel_floor_s), kernels=1)


def stream(dev: Device, nbytes: float, kernels: int = 1) -> Work:
    """Memory-bound work touching ``nbytes``."""
    return Work(device_s=max(nbytes / dev.hbm_rate, kernels * dev.kernel_floor_s), kernels=kernels)


def all_reduce(link: Link, nbytes: float, ranks: int, *, slow: float = 1.0) -> float:
    """Seconds of an all-reduce of ``nbytes`` among ``ranks``; ``slow`` divides the bandwidth
    (contention, interference)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    bw = link.bus_bytes_per_s / slow
    ring = 2 * (ranks - 1) * link.latency_s + 2 * (ranks - 1) / ranks * nbytes / bw
    tree = 2 * math.ceil(math.log2(ranks)) * link.latency_s + 2 * nbytes / bw
    return min(ring, tree)


def all_gather(link: Link, nbytes_out: float, ranks: int, *, slow: float = 1.0) -> float:
    """Seconds of an all-gather whose result is ``nbytes_out`` on each of ``ranks``."""
    if ranks <= 1 or nbytes_out <= 0:
        return 0.0
    bw = link.bus_bytes_per_s / slow
    return (ranks - 1) * link.latency_s + (ranks - 1) / ranks * nbytes_out / bw


def broadcast(link: Link, nbytes: float, ranks: int, *, slow: float = 1.0) -> float:
    """Seconds of a pipelined broadcast of ``nbytes`` to ``ranks`` (the sender included)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    bw = link.bus_bytes_per_s / slow
    return math.ceil(math.log2(ranks)) * link.latency_s + nbytes / bw


def send(link: Link, nbytes: float, *, slow: float = 1.0) -> float:
    """Seconds of one point-to-point message."""
    if nbytes <= 0:
        return 0.0
    return link.latency_s + nbytes / (link.bus_bytes_per_s / slow)
