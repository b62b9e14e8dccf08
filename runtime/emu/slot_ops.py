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

from runtime import kernels
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
    """Bytes the slot's units hold, counting a buffer that two units share once."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for state in _units(ctx).values()
        for t in state.values()
    }
    return sum(storages.values())


def ensure_groups(ctx: SlotContext, *, groups: list[tuple[int, ...]]) -> dict:
    """Create the process groups not yet cached, all slots in the same order; returns the count."""
    cache = ctx.state.setdefault("groups", {})
    started, created = time.perf_counter(), 0
    for ranks in groups:
        key = tuple(sorted(ranks))
        if key not in cache and len(key) > 1:
            cache[key] = dist.new_group(list(key))
            created += 1
            if ctx.rank in key:
                # gloo connects a group's members lazily on first use; do it now, so that cost
                # is counted as group setup rather than as moving state.
                dist.barrier(group=cache[key])
    return {"created": created, "seconds": time.perf_counter() - started}


def _group(ctx: SlotContext, ranks) -> dist.ProcessGroup:
    return ctx.state["groups"][tuple(sorted(ranks))]


def reference_values(shard: ShardSpec, seed: int) -> torch.Tensor:
    """Deterministic values for a shard that depend only on each element's global index, the
    tensor's key and the seed, so every layout of a unit holds the same logical state."""
    from runtime.kernels.reference import global_indices, mix

    salt = (zlib.crc32(shard.key.encode()) ^ seed) & 0x7FFFFFFF  # not hash(): salted per process
    index = global_indices(shard.local_shape, shard.global_shape, shard.global_offset)
    bits = mix(index * 6364136223846793005 + salt)
    values = ((bits >> 11) & ((1 << 24) - 1)).to(torch.float64) / float(1 << 23) - 1.0
    return values.to(_DTYPES[shard.dtype])


def fill_unit(ctx: SlotContext, *, unit: Unit, seed: int) -> int:
    """Give this slot's shards of ``unit`` their reference values (a stand-in for loading a
    checkpoint, so tests and benchmarks know what every element must be)."""
    if ctx.rank not in unit.slots:
        return 0
    shards = _my_shards(unit, ctx.rank)
    state = _allocate(shards, ctx.device)
    for s in shards:
        state[s.key].copy_(reference_values(s, seed))
    _units(ctx)[unit.unit_id] = state
    return sum(t.numel() * t.element_size() for t in state.values())


def unit_checksum(ctx: SlotContext, *, unit: Unit) -> int:
    """This slot's contribution to the unit's logical checksum (0 if it holds none of it)."""
    if ctx.rank not in unit.slots:
        return 0
    state = _units(ctx)[unit.unit_id]
    return combine(*(shard_checksum(s, state[s.key]) for s in _my_shards(unit, ctx.rank)))


def units_checksums(ctx: SlotContext, *, units: list[Unit]) -> list[int]:
    """This slot's contributions to several units' checksums at once."""
    return [unit_checksum(ctx, unit=unit) for unit in units]


def read_unit(ctx: SlotContext, *, unit: Unit) -> dict[str, tuple[ShardSpec, torch.Tensor]]:
    """This slot's shards of a unit, copied to CPU (tests and checkpoint baselines)."""
    if ctx.rank not in unit.slots:
        return {}
    state = _units(ctx)[unit.unit_id]
    return {s.key: (s, state[s.key].detach().cpu().clone()) for s in _my_shards(unit, ctx.rank)}


def _allocate(shards: list[ShardSpec], device: torch.device) -> dict[str, torch.Tensor]:
    """New shards as views into one flat buffer, in shard order (as FSDP keeps flat parameters):
    packing them for a collective is then free, and releasing them frees one allocation."""
    return _unpack(torch.empty(_nbytes(shards), dtype=torch.uint8, device=device), shards)


def _flat(state: dict[str, torch.Tensor], shards: list[ShardSpec]) -> torch.Tensor | None:
    """The one buffer ``state`` lives in, if its shards lie back to back in shard order."""
    if not shards:
        return None
    first = state[shards[0].key]
    storage = first.untyped_storage()
    base, offset = first.data_ptr(), 0
    for s in shards:
        t = state[s.key]
        if t.untyped_storage().data_ptr() != storage.data_ptr() or not t.is_contiguous():
            return None
        if t.data_ptr() != base + offset:
            return None
        offset += t.numel() * t.element_size()
    start = base - storage.data_ptr()
    whole = torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage)
    return whole[start : start + offset]


def _pack(
    state: dict[str, torch.Tensor],
    shards: list[ShardSpec],
    *,
    width: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The shards' bytes, back to back, in one buffer of ``width`` bytes (default: just enough);
    no copy when they already live that way in one flat buffer."""
    size = _nbytes(shards)
    flat = _flat(state, shards)
    if flat is not None and (width is None or width == size):
        return flat
    buffer = torch.empty(size if width is None else width, dtype=torch.uint8, device=device)
    tensors = [state[s.key] for s in shards]
    whole = torch.tensor(
        [[i, 0, 0, t.shape[0] if t.dim() else 1] for i, t in enumerate(tensors)], dtype=torch.int64
    )
    kernels.pack(tensors, whole, out=buffer)  # one pass over every shard (csrc/ when built)
    return buffer


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
    """Build this slot's new shards from source shards (already local or received).

    A destination shard that is exactly one whole source shard (a pipeline Split hands each slot
    whole tensors) is taken as it is, without a copy; the rest are assembled in one new buffer.
    """
    copies = plan_copies(
        {s: [spec for spec, _ in held.values()] for s, held in sources.items()}, {slot: dst_shards}
    )
    by_key = {s.key: s for s in dst_shards}
    pieces: dict[str, list] = {}
    for c in copies:
        pieces.setdefault(c.key, []).append(c)
    candidates = {}
    for key, cs in pieces.items():
        src_spec, src_data = sources[cs[0].src_slot][key]
        if len(cs) == 1 and src_spec.region() == by_key[key].region():
            candidates[key] = src_data
    # Take a source buffer over only if every tensor in it is taken: a few small views must not
    # pin a large buffer that should be freed.
    in_buffer: dict[int, set[str]] = {}
    for held in sources.values():
        for key, (_, data) in held.items():
            in_buffer.setdefault(data.untyped_storage().data_ptr(), set()).add(key)
    taken_from = {key: data.untyped_storage().data_ptr() for key, data in candidates.items()}
    used_bytes: dict[int, int] = {}
    for key, data in candidates.items():
        used_bytes[taken_from[key]] = (
            used_bytes.get(taken_from[key], 0) + data.numel() * data.element_size()
        )
    # ... and only if the buffer is no larger than what is taken (a padded all-gather buffer is).
    reused = {
        key: data
        for key, data in candidates.items()
        if all(taken_from.get(k) == taken_from[key] for k in in_buffer[taken_from[key]])
        and data.untyped_storage().nbytes() <= used_bytes[taken_from[key]]
    }
    new = _allocate([s for s in dst_shards if s.key not in reused], device)
    new.update(reused)
    for c in copies:
        if c.key in reused:
            continue
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
    sizes = {m: _nbytes(_my_shards(old, m)) for m in members}
    width = max(sizes.values())
    group = _group(ctx, members)
    if dist.get_backend(group) == "gloo":
        # The same exchange as an all-gather, as one broadcast per member: gloo's broadcast moves
        # several times the bytes per second of its all_gather (benchmarks/transition_cost.py).
        own = _pack(state, _my_shards(old, ctx.rank), device=ctx.device)
        received = []
        for member in members:
            buffer = (
                own
                if member == ctx.rank
                else torch.empty(sizes[member], dtype=torch.uint8, device=ctx.device)
            )
            dist.broadcast(buffer, src=member, group=group)
            received.append(buffer)
    else:
        send = _pack(state, _my_shards(old, ctx.rank), width=width, device=ctx.device)
        received = [torch.empty(width, dtype=torch.uint8, device=ctx.device) for _ in members]
        dist.all_gather(received, send, group=group)
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
    """Extend on this slot: each source position broadcasts its packed shards to the new position.

    A slot takes part in at most two pairs when the new slots overlap the source's (sending one
    position, receiving another); every slot walks its pairs in position order, so the earliest
    unfinished pair always has both its members at it and the broadcasts cannot deadlock.
    """
    target = spec.target()
    pairs = [(i, p) for i, p in enumerate(spec.broadcast_groups()) if ctx.rank in p]
    received, peak = 0, 0
    for position, (src, dst) in pairs:
        shards = _my_shards(spec.source, src)
        size = _nbytes(shards)
        if ctx.rank == src:
            buffer = _pack(_units(ctx)[spec.source.unit_id], shards, device=ctx.device)
            if dst == src:  # the same position on the same slot: a local copy
                buffer = buffer.clone()
        else:
            buffer = torch.empty(size, dtype=torch.uint8, device=ctx.device)
        if dst != src:
            dist.broadcast(buffer, src=src, group=_group(ctx, (src, dst)))
        if ctx.rank == dst:
            # The new shards are views into the one receive buffer: no second copy.
            assert target.slots[position] == dst
            _units(ctx)[target.unit_id] = _unpack(buffer, shards)
            received += size if dst != src else 0
        peak = max(peak, _state_bytes(ctx) + size)
    return {"bytes_received": received, "peak_bytes": peak} if pairs else {"bytes_received": 0}


def release(ctx: SlotContext, *, unit_ids: list[str]) -> dict:
    """Drop units' shards and check the memory really came back (no tensor outlives the release)."""
    units = _units(ctx)
    refs, dropped = [], {}
    for unit_id in unit_ids:
        state = units.pop(unit_id, None) or {}
        dropped.update(
            {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state.values()}
        )
        refs += [weakref.ref(t) for t in state.values()]
        state.clear()
    # Storage that a remaining unit still uses (a Split may hand whole buffers on) is not freed.
    kept = {t.untyped_storage().data_ptr() for state in units.values() for t in state.values()}
    freed = sum(size for ptr, size in dropped.items() if ptr not in kept)
    alive = sum(ref() is not None for ref in refs)
    if alive:  # only a reference cycle could still hold them; a full collection is slow
        gc.collect()
        alive = sum(ref() is not None for ref in refs)
    return {"freed_bytes": freed, "still_referenced": alive, "state_bytes": _state_bytes(ctx)}
