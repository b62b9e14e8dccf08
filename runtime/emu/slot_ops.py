"""What the primitives do on each slot: the only code that touches shard buffers and collectives.

Functions here run inside slot actors through ``SlotPool.run`` (every slot of the pool calls them,
since creating a torch.distributed group is collective over the whole pool); a slot that takes no
part in a primitive returns at once after the group step. A unit's shards live in
``ctx.state["units"][unit_id]`` as ``{key: tensor}``.
"""

from __future__ import annotations

import gc
import time
import weakref
import zlib

import torch
import torch.distributed as dist

from runtime.emu.integrity import combine, shard_checksum
from runtime.emu.layout import ShardSpec
from runtime.emu.primitives import Extend, Merge, Split, Unit
from runtime.emu.reshard import plan_copies
from runtime.engine.slots import SlotContext

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _units(ctx: SlotContext) -> dict[str, dict[str, torch.Tensor]]:
    return ctx.state.setdefault("units", {})


def _my_shards(unit: Unit, slot: int) -> list[ShardSpec]:
    return unit.layout.shards(unit.position_of(slot))


def _state_bytes(ctx: SlotContext) -> int:
    return sum(
        t.numel() * t.element_size() for state in _units(ctx).values() for t in state.values()
    )


def ensure_groups(ctx: SlotContext, *, groups: list[tuple[int, ...]]) -> dict:
    """Create the process groups not yet cached, all slots in the same order; returns the count."""
    cache = ctx.state.setdefault("groups", {})
    started, created = time.perf_counter(), 0
    for ranks in groups:
        key = tuple(sorted(ranks))
        if key not in cache and len(key) > 1:
            cache[key] = dist.new_group(list(key))
            created += 1
    return {"created": created, "seconds": time.perf_counter() - started}


def _group(ctx: SlotContext, ranks) -> dist.ProcessGroup:
    return ctx.state["groups"][tuple(sorted(ranks))]


def reference_values(shard: ShardSpec, seed: int) -> torch.Tensor:
    """Deterministic values for a shard that depend only on each element's global index, the
    tensor's key and the seed, so every layout of a unit holds the same logical state."""
    from runtime.emu.integrity import _global_indices, _mix

    salt = (zlib.crc32(shard.key.encode()) ^ seed) & 0x7FFFFFFF  # not hash(): salted per process
    bits = _mix(_global_indices(shard) * 6364136223846793005 + salt)
    values = ((bits >> 11) & ((1 << 24) - 1)).to(torch.float64) / float(1 << 23) - 1.0
    return values.to(_DTYPES[shard.dtype])


def fill_unit(ctx: SlotContext, *, unit: Unit, seed: int) -> int:
    """Give this slot's shards of ``unit`` their reference values (a stand-in for loading a
    checkpoint, so tests and benchmarks know what every element must be)."""
    if ctx.rank not in unit.slots:
        return 0
    state = {s.key: reference_values(s, seed).to(ctx.device) for s in _my_shards(unit, ctx.rank)}
    _units(ctx)[unit.unit_id] = state
    return sum(t.numel() * t.element_size() for t in state.values())


def unit_checksum(ctx: SlotContext, *, unit: Unit) -> int:
    """This slot's contribution to the unit's logical checksum (0 if it holds none of it)."""
    if ctx.rank not in unit.slots:
        return 0
    state = _units(ctx)[unit.unit_id]
    return combine(*(shard_checksum(s, state[s.key]) for s in _my_shards(unit, ctx.rank)))


def read_unit(ctx: SlotContext, *, unit: Unit) -> dict[str, tuple[ShardSpec, torch.Tensor]]:
    """This slot's shards of a unit, copied to CPU (tests and checkpoint baselines)."""
    if ctx.rank not in unit.slots:
        return {}
    state = _units(ctx)[unit.unit_id]
    return {s.key: (s, state[s.key].detach().cpu().clone()) for s in _my_shards(unit, ctx.rank)}


def _pack(state: dict[str, torch.Tensor], shards: list[ShardSpec]) -> torch.Tensor:
    parts = [state[s.key].contiguous().view(-1).view(torch.uint8) for s in shards]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def _nbytes(shards: list[ShardSpec]) -> int:
    return sum(s.numel * torch.empty((), dtype=_DTYPES[s.dtype]).element_size() for s in shards)


def _unpack(buffer: torch.Tensor, shards: list[ShardSpec]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for s in shards:
        dtype = _DTYPES[s.dtype]
        size = s.numel * torch.empty((), dtype=dtype).element_size()
        out[s.key] = buffer[offset : offset + size].view(dtype).view(s.local_shape)
        offset += size
    return out


def _assemble(
    dst_shards: list[ShardSpec],
    sources: dict[int, dict[str, tuple[ShardSpec, torch.Tensor]]],
    slot: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Build this slot's new shards from source shards (already local or received)."""
    copies = plan_copies(
        {s: [spec for spec, _ in held.values()] for s, held in sources.items()}, {slot: dst_shards}
    )
    new = {
        s.key: torch.empty(s.local_shape, dtype=_DTYPES[s.dtype], device=device) for s in dst_shards
    }
    by_key = {s.key: s for s in dst_shards}
    for c in copies:
        src_spec, src_data = sources[c.src_slot][c.key]
        dst_spec = by_key[c.key]
        src_view = _narrow(src_data, src_spec, c.dim, c.start, c.stop)
        _narrow(new[c.key], dst_spec, c.dim, c.start, c.stop).copy_(src_view)
    return new


def _narrow(data: torch.Tensor, spec: ShardSpec, dim: int, start: int, stop: int) -> torch.Tensor:
    if data.dim() == 0:
        return data
    return data.narrow(dim, start - spec.global_offset[dim], stop - start)


def split(ctx: SlotContext, *, spec: Split) -> dict:
    """Split on this slot: AllGather with its position-wise peers, then build its new shards."""
    if ctx.rank not in spec.unit.slots:
        return {"bytes_received": 0}
    targets = spec.targets()
    group = next(g for g in spec.peer_groups() if ctx.rank in g)
    members = sorted(group)
    old = spec.unit
    state = _units(ctx)[old.unit_id]
    packed = _pack(state, _my_shards(old, ctx.rank))
    sizes = {m: _nbytes(_my_shards(old, m)) for m in members}
    width = max(sizes.values())
    send = torch.zeros(width, dtype=torch.uint8, device=ctx.device)
    send[: packed.numel()] = packed
    received = [torch.empty(width, dtype=torch.uint8, device=ctx.device) for _ in members]
    dist.all_gather(received, send, group=_group(ctx, members))
    sources = {}
    for member, buffer in zip(members, received, strict=True):
        shards = _my_shards(old, member)
        data = _unpack(buffer[: sizes[member]], shards)
        sources[member] = {s.key: (s, data[s.key]) for s in shards}
    new_unit = next(u for u in targets if ctx.rank in u.slots)
    _units(ctx)[new_unit.unit_id] = _assemble(
        _my_shards(new_unit, ctx.rank), sources, ctx.rank, ctx.device
    )
    peak = _state_bytes(ctx) + width * (len(members) + 1)
    return {"bytes_received": width * (len(members) - 1), "peak_bytes": peak}


def merge(ctx: SlotContext, *, spec: Merge) -> dict:
    """Merge on this slot: slice what its new position owns out of what it holds; no communication."""
    target = spec.target()
    if ctx.rank not in target.slots:
        return {"bytes_received": 0}
    source = next(u for u in spec.units if ctx.rank in u.slots)
    state = _units(ctx)[source.unit_id]
    held = {s.key: (s, state[s.key]) for s in _my_shards(source, ctx.rank)}
    new = _assemble(_my_shards(target, ctx.rank), {ctx.rank: held}, ctx.rank, ctx.device)
    _units(ctx)[target.unit_id] = new
    return {"bytes_received": 0, "peak_bytes": _state_bytes(ctx)}


def extend(ctx: SlotContext, *, spec: Extend) -> dict:
    """Extend on this slot: the source position broadcasts its packed shards to the new position."""
    target = spec.target()
    pair = next((p for p in spec.broadcast_groups() if ctx.rank in p), None)
    if pair is None:
        return {"bytes_received": 0}
    src, dst = pair
    shards = _my_shards(spec.source, src)
    size = _nbytes(shards)
    if ctx.rank == src:
        buffer = _pack(_units(ctx)[spec.source.unit_id], shards)
    else:
        buffer = torch.empty(size, dtype=torch.uint8, device=ctx.device)
    dist.broadcast(buffer, src=src, group=_group(ctx, pair))
    if ctx.rank == dst:
        data = _unpack(buffer, shards)
        _units(ctx)[target.unit_id] = {k: v.clone() for k, v in data.items()}
        return {"bytes_received": size, "peak_bytes": _state_bytes(ctx) + size}
    return {"bytes_received": 0, "peak_bytes": _state_bytes(ctx) + size}


def release(ctx: SlotContext, *, unit_ids: list[str]) -> dict:
    """Drop units' shards and check the memory really came back (no tensor outlives the release)."""
    units = _units(ctx)
    refs, freed = [], 0
    for unit_id in unit_ids:
        state = units.pop(unit_id, None) or {}
        freed += sum(t.untyped_storage().nbytes() for t in state.values())
        refs += [weakref.ref(t) for t in state.values()]
        state.clear()
    gc.collect()
    alive = sum(ref() is not None for ref in refs)
    return {"freed_bytes": freed, "still_referenced": alive, "state_bytes": _state_bytes(ctx)}
