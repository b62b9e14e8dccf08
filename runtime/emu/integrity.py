"""A checksum of a unit's logical state, independent of how it is sharded.

Each element contributes ``mix(global_index, bits)`` and contributions add modulo 2**64, so any
partition of a tensor into shards sums to the same value: the per-shard sums of a unit (counting a
replicated tensor once, from its replica 0) combine into the checksum of the logical tensor, and two
units in different layouts agree exactly when every element agrees bit for bit. ``mix`` is the
SplitMix64 finaliser, computed in wrapping int64 arithmetic.
"""

from __future__ import annotations

import torch

from runtime.emu.layout import ShardSpec

_MASK64 = (1 << 64) - 1
_CHUNK_ELEMENTS = 1 << 22
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685  # 0x94D049BB133111EB
_BITS = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.int64: torch.int64,
    torch.int32: torch.int32,
}
_WIDTH_MASK = {torch.int16: 0xFFFF, torch.int32: 0xFFFFFFFF}


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shift_right(x, 30)) * _M1
    x = (x ^ _shift_right(x, 27)) * _M2
    return x ^ _shift_right(x, 31)


def _global_indices(shard: ShardSpec) -> torch.Tensor:
    """Flat row-major index in the global tensor of every element of the shard."""
    index = torch.zeros((), dtype=torch.int64)
    stride = 1
    for dim in range(len(shard.global_shape) - 1, -1, -1):
        axis = (
            torch.arange(
                shard.global_offset[dim],
                shard.global_offset[dim] + shard.local_shape[dim],
                dtype=torch.int64,
            )
            * stride
        )
        view = [1] * len(shard.global_shape)
        view[dim] = -1
        index = index + axis.view(view)
        stride *= shard.global_shape[dim]
    return index.expand(shard.local_shape) if shard.global_shape else index


def shard_checksum(shard: ShardSpec, data: torch.Tensor) -> int:
    """This shard's contribution (0 for a replica other than 0, so replicas count once)."""
    if tuple(data.shape) != shard.local_shape:
        raise ValueError(f"{shard.key}: data shape {tuple(data.shape)} is not {shard.local_shape}")
    if shard.replica_id != 0 or data.numel() == 0:
        return 0
    bits_dtype = _BITS.get(data.dtype)
    if bits_dtype is None:
        raise ValueError(f"{shard.key}: no checksum for dtype {data.dtype}")
    raw = data.detach().cpu().contiguous().view(bits_dtype)
    index = _global_indices(shard)
    total = 0
    # In slices along dim 0, so the int64 temporaries stay small beside the shard itself.
    rows = max(1, _CHUNK_ELEMENTS // max(1, data[0].numel() if data.dim() else 1))
    for start in range(0, data.shape[0] if data.dim() else 1, rows):
        part = raw[start : start + rows] if data.dim() else raw
        bits = part.to(torch.int64)
        if bits_dtype in _WIDTH_MASK:
            bits = bits & _WIDTH_MASK[bits_dtype]
        where = index[start : start + rows] if data.dim() else index
        terms = _mix((where * _GOLDEN) ^ bits)
        # Sum the low and high 32-bit halves apart: neither sum can overflow int64 below 2**31
        # elements, and Python integers put them back together modulo 2**64.
        total += int((terms & 0xFFFFFFFF).sum()) + (int(_shift_right(terms, 32).sum()) << 32)
    return total & _MASK64


def combine(*checksums: int) -> int:
    """Combine per-shard (or per-slot) contributions."""
    return sum(checksums) & _MASK64
