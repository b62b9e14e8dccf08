"""A checksum of a unit's logical state, independent of how it is sharded.

Each element contributes ``mix(global_index * G ^ bits)`` and contributions add modulo 2**64, so
any partition of a tensor into shards sums to the same value: the per-shard sums of a unit (counting
a replicated tensor once, from its replica 0) combine into the checksum of the logical tensor, and
two units in different layouts agree exactly when every element agrees bit for bit. ``mix`` is the
SplitMix64 finaliser. The sum is computed by the ``nereus::checksum`` kernel (csrc/) when it is
built, else by its pure-PyTorch reference (runtime/kernels/reference.py).
"""

from __future__ import annotations

import torch

from runtime import kernels
from runtime.emu.layout import ShardSpec

_MASK64 = (1 << 64) - 1


def shard_checksum(shard: ShardSpec, data: torch.Tensor) -> int:
    """This shard's contribution (0 for a replica other than 0, so replicas count once)."""
    if tuple(data.shape) != shard.local_shape:
        raise ValueError(f"{shard.key}: data shape {tuple(data.shape)} is not {shard.local_shape}")
    if shard.replica_id != 0 or data.numel() == 0:
        return 0
    return kernels.checksum(data, shard.global_shape, shard.global_offset)


def combine(*checksums: int) -> int:
    """Combine per-shard (or per-slot) contributions."""
    return sum(checksums) & _MASK64
