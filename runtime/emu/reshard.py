"""Planning state movement: which slot copies which slice of which tensor to which slot.

Pure functions over shard metadata, validated once; the executor alone touches buffers. Every
tensor of a unit is split along at most one dimension (``TensorSpec.shard_dim``), so each shard is
an interval along that dimension and covering a destination shard is interval covering: sources on
the destination's own slot first (no communication), then the lowest slot. Every destination
element is covered exactly once, or planning fails naming the slice no live shard holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from runtime.emu.layout import ShardError, ShardSpec


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Copy:
    """Move ``[start, stop)`` along ``dim`` of tensor ``key`` from ``src_slot`` to ``dst_slot``."""

    key: str
    dim: int
    start: int
    stop: int
    src_slot: int
    dst_slot: int

    @property
    def local(self) -> bool:
        return self.src_slot == self.dst_slot


def _interval(shard: ShardSpec, dim: int) -> tuple[int, int]:
    if not shard.global_shape:
        return 0, 1
    return shard.global_offset[dim], shard.global_offset[dim] + shard.local_shape[dim]


def split_dim(shard: ShardSpec) -> int:
    """The dimension a shard is cut along (0 for whole tensors)."""
    for dim, (size, local) in enumerate(zip(shard.global_shape, shard.local_shape, strict=True)):
        if local != size:
            return dim
    return 0


def plan_copies(
    sources: Mapping[int, Sequence[ShardSpec]], destinations: Mapping[int, Sequence[ShardSpec]]
) -> list[Copy]:
    """Copies that fill every destination shard exactly once from the source shards.

    ``sources`` and ``destinations`` map slot ids to the shards held there (before and after).
    """
    by_key: dict[str, list[tuple[int, ShardSpec]]] = {}
    for slot, shards in sources.items():
        for shard in shards:
            by_key.setdefault(shard.key, []).append((slot, shard))
    copies: list[Copy] = []
    for dst_slot, shards in sorted(destinations.items()):
        for shard in shards:
            copies += _cover(shard, dst_slot, by_key.get(shard.key, []))
    return copies


def _cover(
    target: ShardSpec, dst_slot: int, holders: Iterable[tuple[int, ShardSpec]]
) -> list[Copy]:
    holders = list(holders)
    for _, shard in holders:
        if shard.global_shape != target.global_shape:
            raise ShardError(
                f"{target.key}: shapes differ, {shard.global_shape} vs {target.global_shape}"
            )
    # A tensor's style fixes the one dimension all its cut shards are cut along.
    cut = {
        split_dim(s) for s in (target, *(h for _, h in holders)) if s.local_shape != s.global_shape
    }
    if len(cut) > 1:
        raise ShardError(f"{target.key}: shards cut along different dimensions {sorted(cut)}")
    dim = cut.pop() if cut else 0
    uncovered = [_interval(target, dim)]
    out: list[Copy] = []
    ranked = sorted(holders, key=lambda h: (h[0] != dst_slot, h[1].replica_id, h[0]))
    for src_slot, shard in ranked:
        lo, hi = _interval(shard, dim)
        remaining = []
        for a, b in uncovered:
            s, e = max(a, lo), min(b, hi)
            if s < e:
                out.append(
                    Copy(
                        key=target.key,
                        dim=dim,
                        start=s,
                        stop=e,
                        src_slot=src_slot,
                        dst_slot=dst_slot,
                    )
                )
                if a < s:
                    remaining.append((a, s))
                if e < b:
                    remaining.append((e, b))
            else:
                remaining.append((a, b))
        uncovered = remaining
        if not uncovered:
            return out
    a, b = uncovered[0]
    raise ShardError(f"{target.key}: [{a}, {b}) along dim {dim} is held by no live shard")
