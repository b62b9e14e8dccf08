"""A checksum of a unit's logical state, independent of how it is sharded.

Each element of a tensor contributes ``mix(global_index * G ^ bits)`` and contributions add modulo
2**64 (the ``nereus::checksum`` kernel of csrc/ when it is built, else its pure-PyTorch reference
in runtime/kernels/reference.py; ``mix`` is the SplitMix64 finaliser), so any partition of a
tensor into shards sums to the same value. A shard's sum is then multiplied, modulo 2**64, by two
weights, which keeps it linear (a split still sums to the whole):

- its tensor's key weight, an odd number hashed from the key, so that two tensors of one shape
  that trade contents (a layer's weights for the next one's, Adam's two moments) change the sum;
- its replica's weight: the copies of a replicated tensor (RMSNorm weights on every tensor rank)
  are weighted ``w_0 .. w_{R-1}`` with ``w_r`` odd for ``r >= 1`` and ``w_0 = 1 - sum(w_r)``, so
  that R equal copies add up to one copy, whatever R the layout has, while a copy that differs
  moves the sum (by ``w_r`` times its difference, which an odd weight never cancels; replica 0's
  weight is even where R is even, so there a difference only in its top bits could cancel).

Two units in different layouts therefore agree exactly when every element of every tensor, every
copy included, agrees bit for bit, barring a 64-bit collision.
"""

from __future__ import annotations

import functools
import hashlib

import torch

from runtime import kernels
from runtime.emu.layout import ShardSpec

_MASK64 = (1 << 64) - 1


@functools.cache
def key_weight(key: str) -> int:
    """An odd 64-bit weight for a tensor key (stable across processes and runs)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") | 1


def _replica_odd(replica: int) -> int:
    return key_weight(f"replica:{replica}")


@functools.cache
def replica_weight(replica_id: int, num_replicas: int) -> int:
    """``w_r``: odd for ``r >= 1``, and ``w_0`` such that all R sum to 1 modulo 2**64."""
    if not 0 <= replica_id < num_replicas:
        raise ValueError(f"replica_id: {replica_id} outside [0, {num_replicas})")
    if replica_id:
        return _replica_odd(replica_id)
    return (1 - sum(_replica_odd(r) for r in range(1, num_replicas))) & _MASK64


def shard_checksum(shard: ShardSpec, data: torch.Tensor) -> int:
    """This shard's contribution to its unit's checksum."""
    if tuple(data.shape) != shard.local_shape:
        raise ValueError(f"{shard.key}: data shape {tuple(data.shape)} is not {shard.local_shape}")
    if data.numel() == 0:
        return 0
    raw = kernels.checksum(data, shard.global_shape, shard.global_offset)
    weight = key_weight(shard.key) * replica_weight(shard.replica_id, shard.num_replicas)
    return (raw * weight) & _MASK64


def combine(*checksums: int) -> int:
    """Combine per-shard (or per-slot) contributions."""
    return sum(checksums) & _MASK64
