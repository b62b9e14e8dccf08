"""What the primitives do on each slot: the only code that touches shard buffers and collectives.

Functions here run inside slot actors through ``SlotPool.run`` (every slot of the pool calls them,
since creating a torch.distributed group is collective over the whole pool); a slot that takes no
part in a primitive returns at once after the group step. A unit's shards live in
``ctx.state["units"][unit_id]`` as ``{key: tensor}``, views into one or a few flat buffers.

Memory. On a CPU slot the first touch of every page of a fresh buffer is a page fault (in a virtual
machine possibly one of the host's too), and a receive into fresh memory runs at a fraction of the
speed of one into memory already touched. So each CPU slot keeps the flat buffers its units release
in an arena (``_Arena``, a caching allocator like CUDA's) and hands them out again as receive
buffers and new units' storage. The arena is bounded: it never lets the slot hold more than the
most its units and in-flight buffers have held at once, ``release`` says how much of what it freed
the arena kept, and ``empty_cache`` gives all of it back. CUDA slots leave caching to PyTorch's own
caching allocator.
"""

from __future__ import annotations

import functools
import gc
import itertools
import mmap
import threading
import time
import weakref
import zlib

import torch
import torch.distributed as dist

from runtime import kernels
from runtime.emu.integrity import combine, shard_checksum
from runtime.emu.layout import ShardSpec
from runtime.emu.primitives import BUCKET_BYTES, Extend, Merge, Split, Unit
from runtime.emu.reshard import Copy, plan_copies
from runtime.engine.slots import SlotContext

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

MAX_RUNS = 64
"""Contiguous runs a sender describes in the header it broadcasts first; with more, it packs."""
SLACK = 8
"""A cached buffer at most 1/SLACK larger than asked for may become a unit's storage."""
ARENA_MAX_BUFFERS = 16
PREFAULT = True
"""Fault fresh receive buffers in from a helper thread (CPU slots): a receive into pages already
there runs faster than one that faults every page itself."""


def _units(ctx: SlotContext) -> dict[str, dict[str, torch.Tensor]]:
    return ctx.state.setdefault("units", {})


def _my_shards(unit: Unit, slot: int) -> list[ShardSpec]:
    return unit.layout.shards(unit.position_of(slot))


def _storages(ctx: SlotContext) -> dict[int, int]:
    """The storages the slot's units hold, each once: {data pointer: bytes}."""
    return {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for state in _units(ctx).values()
        for t in state.values()
    }


def _state_bytes(ctx: SlotContext) -> int:
    """Bytes the slot's units hold, counting a buffer that two units share once."""
    return sum(_storages(ctx).values())


# --- the arena ------------------------------------------------------------------------------------


class _Arena:
    """Flat buffers a slot released, kept to be handed out again instead of fresh memory.

    Invariant: what the units hold, plus buffers in flight, plus the arena, never exceeds
    ``high_water``, the most the units and in-flight buffers have held at once (or the slot's
    footprint when first seen). Releasing a unit into the arena and taking a buffer back out move
    bytes without changing the footprint; when a request finds nothing that fits and fresh memory
    must be allocated, cached buffers are freed first (oldest first) so that the footprint after
    the allocation stays within the mark. At most ``ARENA_MAX_BUFFERS`` buffers are kept."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.buffers: list[torch.Tensor] = []
        self.high_water = 0

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def take(self, nbytes: int, *, pinned: bool) -> torch.Tensor | None:
        """The smallest cached buffer of at least ``nbytes`` (at most 1/SLACK more when it is to
        become a unit's storage), removed from the arena; None if none fits."""
        limit = nbytes + nbytes // SLACK if pinned else None
        fits = [
            (b.numel(), i)
            for i, b in enumerate(self.buffers)
            if b.numel() >= nbytes and (limit is None or b.numel() <= limit)
        ]
        return self.buffers.pop(min(fits)[1]) if fits else None

    def put(self, buffer: torch.Tensor) -> bool:
        if not self.enabled:
            return False
        self.buffers.append(buffer)
        while len(self.buffers) > ARENA_MAX_BUFFERS:
            self.buffers.pop(0)
        return True

    def trim(self, keep: int) -> int:
        """Free cached buffers, oldest first, until at most ``keep`` bytes stay; returns bytes freed."""
        freed = 0
        while self.buffers and self.nbytes > keep:
            freed += self.buffers.pop(0).numel()
        return freed

    def observe(self, footprint: int) -> None:
        self.high_water = max(self.high_water, footprint)


_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_PREFAULT_STEP = 4 * 2**20


@functools.cache
def _madvise():
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _populate(buffer: torch.Tensor) -> None:
    """Fault in every page of ``buffer`` without writing it (MADV_POPULATE_WRITE), front to back
    in steps, so that a receive into it that starts at the same time finds its pages there."""
    madvise = _madvise()
    page = mmap.PAGESIZE
    start = (buffer.data_ptr() + page - 1) // page * page
    end = (buffer.data_ptr() + buffer.numel()) // page * page
    while madvise is not None and start < end:
        step = min(_PREFAULT_STEP, end - start)
        if madvise(start, step, _MADV_POPULATE_WRITE) != 0:
            return  # an older kernel: the receive faults the pages in itself
        start += step


def _arena(ctx: SlotContext) -> _Arena:
    arena = ctx.state.get("arena")
    if arena is None:
        arena = ctx.state["arena"] = _Arena(enabled=ctx.device.type == "cpu")
    return arena


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over the whole of ``t``'s storage."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)


def _only_holder(buffer: torch.Tensor) -> bool:
    """Whether ``buffer`` is the only tensor left on its storage (so reusing it aliases nothing)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    # The tensor, and the storage object made here to ask.
    return use_count(buffer.untyped_storage()._cdata) <= 2


class _Buffers:
    """The buffers of one slot op: taken from the arena when one fits, else allocated; counted
    while in flight for the op's peak; handed back to the arena at the end unless a unit kept them."""

    def __init__(self, ctx: SlotContext):
        self.ctx = ctx
        self.arena = _arena(ctx)
        self.live: list[torch.Tensor] = []
        self.reused = 0
        self.threads: list[threading.Thread] = []
        held = self.held()
        self.arena.observe(held + self.arena.nbytes)
        self.peak = held

    def held(self) -> int:
        """Bytes the units and the buffers in flight hold, each storage once (no arena)."""
        storages = _storages(self.ctx)
        for b in self.live:
            storages[b.untyped_storage().data_ptr()] = b.numel()
        return sum(storages.values())

    def empty(self, nbytes: int, *, pinned: bool = False, prefault: bool = False) -> torch.Tensor:
        """A contiguous uint8 buffer of ``nbytes``; ``pinned`` if it may become a unit's storage;
        ``prefault``: if it is fresh CPU memory, a helper thread faults its pages in meanwhile
        (for a buffer that will be received into while the slot is busy with something else)."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8, device=self.ctx.device)
        buffer = self.arena.take(nbytes, pinned=pinned)
        if buffer is not None:
            self.reused += buffer.numel()
        else:
            after = self.held() + nbytes
            self.arena.observe(after)
            self.arena.trim(self.arena.high_water - after)
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.ctx.device)
            if prefault and PREFAULT and buffer.device.type == "cpu":
                thread = threading.Thread(target=_populate, args=(buffer,), daemon=True)
                thread.start()
                self.threads.append(thread)
        self.live.append(buffer)
        self.peak = max(self.peak, self.held())
        return buffer[:nbytes]

    def finish(self) -> dict:
        """Give back to the arena the buffers no unit kept; the op's memory figures."""
        for thread in self.threads:
            thread.join()
        kept = set(_storages(self.ctx))
        self.peak = max(self.peak, self.held())
        for b in self.live:
            if b.untyped_storage().data_ptr() not in kept:
                self.arena.put(b)
        self.live.clear()
        return {"peak_bytes": self.peak, "reused_bytes": self.reused}


# --- groups, reference state, checksums -----------------------------------------------------------


def ensure_groups(ctx: SlotContext, *, groups: list[tuple[int, ...]]) -> dict:
    """Create the process groups not yet cached, all slots in the same order; returns the count."""
    cache = ctx.state.setdefault("groups", {})
    started, created = time.perf_counter(), 0
    for ranks in groups:
        key = tuple(sorted(ranks))
        if key not in cache and len(key) > 1:
            cache[key] = dist.new_group(list(key), timeout=ctx.group_timeout())
            created += 1
            if ctx.rank in key:
                # gloo connects a group's members lazily on first use; do it now, so that cost
                # is counted as group setup rather than as moving state.
                dist.barrier(group=cache[key])
    return {"created": created, "seconds": time.perf_counter() - started}


def _group(ctx: SlotContext, ranks) -> dist.ProcessGroup:
    return ctx.state["groups"][tuple(sorted(ranks))]


def time_collective(
    ctx: SlotContext, *, pattern: str, slots: tuple[int, ...], nbytes: int, repeats: int
) -> list[float]:
    """A calibration probe on this slot (``runtime/planner/probes.py``): one untimed run, then
    ``repeats`` timed runs of ``pattern`` among ``slots`` over ``nbytes``, each started together
    (a barrier) and timed to its end on the device. Returns this rank's seconds of each run."""
    group = _group(ctx, slots)
    buffer = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=ctx.device)
    cuda = ctx.device.type == "cuda"

    def once(buffer: torch.Tensor) -> None:
        if pattern == "all_reduce":
            dist.all_reduce(buffer, group=group)
        elif ctx.rank == slots[0]:
            dist.send(buffer, dst=slots[1], group=group)
        else:
            dist.recv(buffer, src=slots[0], group=group)
        if cuda:
            torch.cuda.synchronize(ctx.device)

    if pattern not in ("all_reduce", "send"):
        raise ValueError(f"pattern: {pattern!r} is not a probe's collective")
    once(buffer)
    out = []
    for _ in range(repeats):
        dist.barrier(group=group)
        started = time.perf_counter()
        once(buffer)
        out.append(time.perf_counter() - started)
    del buffer
    if cuda:  # the units' memory is resident: give the probe's buffer back at once
        torch.cuda.empty_cache()
    return out


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
    buffers = _Buffers(ctx)
    state = _unpack(buffers.empty(_nbytes(shards), pinned=True), shards)
    for s in shards:
        state[s.key].copy_(reference_values(s, seed))
    _units(ctx)[unit.unit_id] = state
    buffers.finish()
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


def _with_checksums(ctx: SlotContext, result: dict, units: list[Unit], verify: bool) -> dict:
    """Add this slot's contributions to the new units' checksums (timed) when asked to verify."""
    if verify:
        started = time.perf_counter()
        result["checksums"] = units_checksums(ctx, units=units)
        result["checksum_s"] = time.perf_counter() - started
    return result


def read_unit(ctx: SlotContext, *, unit: Unit) -> dict[str, tuple[ShardSpec, torch.Tensor]]:
    """This slot's shards of a unit, copied to CPU (tests and checkpoint baselines)."""
    if ctx.rank not in unit.slots:
        return {}
    state = _units(ctx)[unit.unit_id]
    return {s.key: (s, state[s.key].detach().cpu().clone()) for s in _my_shards(unit, ctx.rank)}


def install_unit(
    ctx: SlotContext, *, unit: Unit, shards: dict[str, tuple[ShardSpec, torch.Tensor]]
) -> int:
    """Put back this slot's shards of ``unit`` as ``read_unit`` gave them (a unit carried over
    to a new process); returns the bytes placed."""
    if ctx.rank not in unit.slots:
        return 0
    mine = _my_shards(unit, ctx.rank)
    missing = [s.key for s in mine if s.key not in shards]
    if missing:
        raise ValueError(f"{unit.unit_id}: shard {missing[0]} was not given for slot {ctx.rank}")
    state = _allocate(mine, ctx.device)
    for spec in mine:
        state[spec.key].copy_(shards[spec.key][1])
    _units(ctx)[unit.unit_id] = state
    return sum(t.numel() * t.element_size() for t in state.values())


# --- flat buffers ---------------------------------------------------------------------------------


def _allocate(shards: list[ShardSpec], device: torch.device) -> dict[str, torch.Tensor]:
    """New shards as views into one fresh flat buffer, in shard order (as FSDP keeps flat
    parameters): packing them for a collective is then free, and releasing them frees one
    allocation. (Slot ops allocate through ``_Buffers``, which reuses the arena's buffers.)"""
    return _unpack(torch.empty(_nbytes(shards), dtype=torch.uint8, device=device), shards)


def _runs(state: dict[str, torch.Tensor], shards: list[ShardSpec]) -> list[torch.Tensor] | None:
    """The shards' bytes as contiguous uint8 views, in shard order, shards that lie back to back in
    one storage sharing a view (one view for a unit in one flat buffer); None if one is strided."""
    spans: list[list] = []  # [storage pointer, start pointer, end pointer, a tensor on it]
    for s in shards:
        t = state[s.key]
        if not t.is_contiguous():
            return None
        size = t.numel() * t.element_size()
        if size == 0:
            continue
        storage, start = t.untyped_storage().data_ptr(), t.data_ptr()
        if spans and spans[-1][0] == storage and spans[-1][2] == start:
            spans[-1][2] = start + size
        else:
            spans.append([storage, start, start + size, t])
    return [_whole(t)[a - base : b - base] for base, a, b, t in spans]


def _flat(state: dict[str, torch.Tensor], shards: list[ShardSpec]) -> torch.Tensor | None:
    """The one buffer ``state`` lives in, if its shards lie back to back in shard order."""
    runs = _runs(state, shards)
    return runs[0] if runs is not None and len(runs) == 1 else None


def _pack(
    state: dict[str, torch.Tensor],
    shards: list[ShardSpec],
    *,
    width: int | None = None,
    device: torch.device | None = None,
    buffers: _Buffers | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The shards' bytes, back to back, at the start of a buffer of ``width`` bytes (default: just
    enough): ``out``, else a new one, else, when they already live that way in one flat buffer
    and no width is asked for, that buffer itself (no copy)."""
    size = _nbytes(shards)
    flat = _flat(state, shards)
    if out is None and flat is not None and width in (None, size):
        return flat
    if out is None:
        width = size if width is None else width
        out = (
            buffers.empty(width)
            if buffers is not None
            else torch.empty(width, dtype=torch.uint8, device=device)
        )
    if flat is not None:
        out[:size].copy_(flat)
        return out
    tensors = [state[s.key] for s in shards]
    if tensors:
        whole = torch.tensor(
            [[i, 0, 0, t.shape[0] if t.dim() else 1] for i, t in enumerate(tensors)],
            dtype=torch.int64,
        )
        kernels.pack(tensors, whole, out=out)  # one pass over every shard (csrc/ when built)
    return out


def _nbytes(shards: list[ShardSpec]) -> int:
    return sum(s.numel * _DTYPES[s.dtype].itemsize for s in shards)


def _unpack(buffer: torch.Tensor, shards: list[ShardSpec]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for s in shards:
        dtype = _DTYPES[s.dtype]
        size = s.numel * dtype.itemsize
        out[s.key] = buffer[offset : offset + size].view(dtype).view(s.local_shape)
        offset += size
    return out


def _broadcast_shards(
    ctx: SlotContext,
    buffers: _Buffers,
    *,
    src: int,
    group: dist.ProcessGroup,
    state: dict[str, torch.Tensor] | None = None,
    shards: list[ShardSpec],
    out: torch.Tensor | None = None,
) -> None:
    """Broadcast ``src``'s ``shards`` (from its ``state``) into every receiver's ``out``, a
    contiguous buffer of their bytes back to back. The sender first broadcasts how its bytes are
    cut (the contiguous runs they lie in, as a unit split before lies in a few buffers), so each
    run goes out without a copy and lands in place."""
    runs: list[torch.Tensor] = []
    if ctx.rank == src:
        runs = _runs(state, shards) or []
        if len(runs) > MAX_RUNS or (not runs and _nbytes(shards)):
            runs = [_pack(state, shards, buffers=buffers)]
    header = _header(runs, ctx.device)
    dist.broadcast(header, src=src, group=group)
    if ctx.rank != src:
        runs = _cut(out, header, src)
    for run in runs:
        dist.broadcast(run, src=src, group=group)


# --- building new shards --------------------------------------------------------------------------


def _narrow(data: torch.Tensor, spec: ShardSpec, dim: int, start: int, stop: int) -> torch.Tensor:
    if data.dim() == 0:
        return data
    return data.narrow(dim, start - spec.global_offset[dim], stop - start)


def _whole_copies(copies: list[Copy], held: dict[int, list[ShardSpec]], dst: list[ShardSpec]):
    """{key: source slot} for destination shards that are exactly one whole source shard."""
    by_key = {s.key: s for s in dst}
    held_by = {(slot, s.key): s for slot, shards in held.items() for s in shards}
    pieces: dict[str, list[Copy]] = {}
    for c in copies:
        pieces.setdefault(c.key, []).append(c)
    out = {}
    for key, cs in pieces.items():
        if len(cs) == 1 and held_by[cs[0].src_slot, key].region() == by_key[key].region():
            out[key] = cs[0].src_slot
    return out


def _assemble(
    dst_shards: list[ShardSpec],
    sources: dict[int, dict[str, tuple[ShardSpec, torch.Tensor]]],
    slot: int,
    buffers: _Buffers,
) -> dict[str, torch.Tensor]:
    """Build this slot's new shards from source shards (already local or received).

    A destination shard that is exactly one whole source shard is taken as it is, without a copy,
    when every tensor of its source buffer is taken and the buffer is no larger than what is
    taken (beyond the arena's slack): a few small views must not pin a large buffer that should
    be freed. The rest are assembled in one new buffer.
    """
    held = {s: [spec for spec, _ in h.values()] for s, h in sources.items()}
    copies = plan_copies(held, {slot: dst_shards})
    candidates = {
        key: sources[src][key][1] for key, src in _whole_copies(copies, held, dst_shards).items()
    }
    in_buffer: dict[int, set[str]] = {}
    for h in sources.values():
        for key, (_, data) in h.items():
            in_buffer.setdefault(data.untyped_storage().data_ptr(), set()).add(key)
    taken_from = {key: data.untyped_storage().data_ptr() for key, data in candidates.items()}
    used_bytes: dict[int, int] = {}
    for key, data in candidates.items():
        used_bytes[taken_from[key]] = (
            used_bytes.get(taken_from[key], 0) + data.numel() * data.element_size()
        )
    reused = {
        key: data
        for key, data in candidates.items()
        if all(taken_from.get(k) == taken_from[key] for k in in_buffer[taken_from[key]])
        and data.untyped_storage().nbytes() <= used_bytes[taken_from[key]] * (SLACK + 1) // SLACK
    }
    rest = [s for s in dst_shards if s.key not in reused]
    new = _unpack(buffers.empty(_nbytes(rest), pinned=True), rest)
    by_key = {s.key: s for s in dst_shards}
    for c in copies:
        if c.key in reused:
            continue
        src_spec, src_data = sources[c.src_slot][c.key]
        src_view = _narrow(src_data, src_spec, c.dim, c.start, c.stop)
        _narrow(new[c.key], by_key[c.key], c.dim, c.start, c.stop).copy_(src_view)
    new.update({key: data.view(data.shape) for key, data in reused.items()})
    return {s.key: new[s.key] for s in dst_shards}


# --- the primitives -------------------------------------------------------------------------------


def split(ctx: SlotContext, *, spec: Split, verify: bool = False) -> dict:
    """Split on this slot: exchange shards with its position-wise peers, then build its new shards.

    On gloo, a peer's shards that become new shards whole (a pipeline Split) arrive point to point,
    all members sending and receiving at once, into one buffer per peer that the new unit keeps
    as it is; the slot's own shards stay where they are. Otherwise (a tensor Split) each member
    broadcasts its shards in turn, bucket by bucket, and the receivers cut each bucket into their
    new shards as it comes, so a slot never holds a peer's whole shard set besides its new one.
    Other backends use one padded all-gather. With ``verify`` the result carries this slot's
    contributions to the new units' checksums.
    """
    if ctx.rank not in spec.unit.slots:
        return {"bytes_received": 0}
    targets = spec.targets()
    members = sorted(next(g for g in spec.peer_groups() if ctx.rank in g))
    group = _group(ctx, members)
    buffers = _Buffers(ctx)
    if dist.get_backend(group) == "gloo":
        new, received = _split_point_to_point(ctx, spec, members, group, buffers)
    else:
        new, received = _split_by_all_gather(ctx, spec, members, group, buffers)
    new_unit = next(u for u in targets if ctx.rank in u.slots)
    _units(ctx)[new_unit.unit_id] = new
    result = {"bytes_received": received, **buffers.finish()}
    return _with_checksums(ctx, result, targets, verify)


@functools.lru_cache(maxsize=64)
def _split_plan(spec: Split, members: tuple[int, ...]) -> dict:
    """What each member of a peer group holds and builds, the copies between them, and per member
    whether every peer keeps all its shards whole (a pipeline Split: they are sent in one go and
    kept as received) or cuts them up (a tensor Split: they go out in buckets). Every member
    computes the same plan, so their broadcasts match."""
    held = {m: _my_shards(spec.unit, m) for m in members}
    dst = {m: _my_shards(u, m) for u in spec.targets() for m in members if m in u.slots}
    copies = {r: plan_copies(held, {r: dst[r]}) for r in members}
    whole = {r: _whole_copies(copies[r], held, dst[r]) for r in members}
    keep = {
        m: bool(held[m])
        and all(whole[r].get(s.key) == m for r in members if r != m for s in held[m])
        for m in members
    }
    return {"held": held, "dst": dst, "copies": copies, "whole": whole, "keep": keep}


def _buckets(shards: list[ShardSpec]) -> list[list[ShardSpec]]:
    """Consecutive shards in groups of at most BUCKET_BYTES (a larger shard goes alone)."""
    out: list[list[ShardSpec]] = []
    size = 0
    for s in shards:
        n = _nbytes([s])
        if not out or size + n > BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append(s)
        size += n
    return [b for b in out if _nbytes(b)]


def _copy_pieces(new, by_key, copies: list[Copy], src_slot: int, available: dict) -> None:
    """Apply the copies from ``src_slot`` whose source shard is in ``available``."""
    for c in copies:
        if c.src_slot == src_slot and c.key in available:
            src_spec, src_data = available[c.key]
            _narrow(new[c.key], by_key[c.key], c.dim, c.start, c.stop).copy_(
                _narrow(src_data, src_spec, c.dim, c.start, c.stop)
            )


def _split_point_to_point(ctx: SlotContext, spec: Split, members, group, buffers: _Buffers):
    me = ctx.rank
    plan = _split_plan(spec, tuple(members))
    held, keep = plan["held"], plan["keep"]
    dst, copies, whole = plan["dst"][me], plan["copies"][me], plan["whole"][me]
    state = _units(ctx)[spec.unit.unit_id]
    by_key = {s.key: s for s in dst}
    # Own shards that all become new shards whole are kept where they are (their buffer is then
    # wholly used); peers' kept shards arrive in a buffer of their own; the rest is built in one
    # new buffer.
    own_kept = bool(held[me]) and all(whole.get(s.key) == me for s in held[me])
    taken = {k for k, src in whole.items() if (keep[src] if src != me else own_kept)}
    rest = [s for s in dst if s.key not in taken]
    new = _unpack(buffers.empty(_nbytes(rest), pinned=True), rest)
    if own_kept:  # new views on the same memory: the old unit's tensors die with it
        new.update({s.key: state[s.key].view(s.local_shape) for s in held[me]})
    else:
        _copy_pieces(new, by_key, copies, me, {s.key: (s, state[s.key]) for s in held[me]})
    cut = [m for m in members if held[m] and not keep[m]]
    # One bucket-sized buffer receives every peer's buckets (and packs own ones that are not
    # contiguous, if any).
    sizes = [
        _nbytes(bucket)
        for m in cut
        if m != me or _flat(state, held[me]) is None
        for bucket in _buckets(held[m])
    ]
    scratch = buffers.empty(max(sizes)) if sizes else None
    # Every buffer to keep is allocated up front: fresh memory is faulted in by helper threads
    # while the slot sends its own shards or receives earlier ones.
    inbox = {
        m: buffers.empty(_nbytes(held[m]), pinned=True, prefault=True)
        for m in members
        if m != me and held[m] and keep[m]
    }
    received = 0
    senders = [m for m in members if held[m] and keep[m]]
    if senders:
        _exchange(ctx, buffers, group, members, senders, state, held[me], inbox)
        for member, buffer in inbox.items():
            new.update(_unpack(buffer, held[member]))
            received += buffer.numel()
    for member in cut:
        for bucket in _buckets(held[member]):
            size = _nbytes(bucket)
            if member == me:
                data = _flat(state, bucket)
                if data is None:
                    data = _pack(state, bucket, out=scratch[:size])
                dist.broadcast(data, src=me, group=group)
            else:
                data = scratch[:size]
                dist.broadcast(data, src=member, group=group)
                pieces = _unpack(data, bucket)
                available = {s.key: (s, pieces[s.key]) for s in bucket}
                _copy_pieces(new, by_key, copies, member, available)
                received += size
    return {s.key: new[s.key] for s in dst}, received


def _exchange(ctx: SlotContext, buffers: _Buffers, group, members, senders, state, mine, inbox):
    """Every member of ``senders`` sends its shards (``mine`` on this slot) to every other member
    at once, point to point, each receiver taking them into its ``inbox`` buffer for that sender:
    loopback TCP (and NVLink) carry both directions together, where broadcasts in turn leave one
    idle. Senders first send how their bytes are cut (the contiguous runs they lie in), so each
    run goes out without a copy and lands in place."""
    me = ctx.rank
    peers = [m for m in members if m != me]
    runs: list[torch.Tensor] = []
    works = []
    if me in senders:
        runs = _runs(state, mine) or []
        if len(runs) > MAX_RUNS or (not runs and _nbytes(mine)):
            runs = [_pack(state, mine, buffers=buffers)]
        header = _header(runs, ctx.device)
        works += [dist.isend(header, dst=p, group=group) for p in peers]
    headers = {m: _header([], ctx.device) for m in senders if m != me}
    works += [dist.irecv(h, src=m, group=group) for m, h in headers.items()]
    for work in works:
        work.wait()
    works = []
    for member, header in headers.items():
        works += [
            dist.irecv(run, src=member, group=group) for run in _cut(inbox[member], header, member)
        ]
    works += [dist.isend(run, dst=p, group=group) for run in runs for p in peers]
    for work in works:
        work.wait()


def _header(runs: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """How a sender's bytes are cut: [number of runs, their lengths..., 0...]."""
    header = torch.zeros(MAX_RUNS + 1, dtype=torch.int64, device=device)
    if runs:
        header[0] = len(runs)
        header[1 : len(runs) + 1] = torch.tensor([r.numel() for r in runs], dtype=torch.int64)
    return header


def _cut(out: torch.Tensor, header: torch.Tensor, src: int) -> list[torch.Tensor]:
    """``out`` cut as the sender's header says its bytes are."""
    lengths = header[1 : int(header[0]) + 1].tolist()
    offsets = list(itertools.accumulate(lengths, initial=0))
    if offsets[-1] != out.numel():
        raise RuntimeError(f"slot {src} sends {offsets[-1]} bytes, {out.numel()} expected")
    return [out[a:b] for a, b in itertools.pairwise(offsets)]


def _split_by_all_gather(ctx: SlotContext, spec: Split, members, group, buffers: _Buffers):
    """Split where the backend's all-gather is the fast way (NCCL): one padded all-gather."""
    old = spec.unit
    state = _units(ctx)[old.unit_id]
    sizes = {m: _nbytes(_my_shards(old, m)) for m in members}
    width = max(sizes.values())
    send = _pack(state, _my_shards(old, ctx.rank), width=width, buffers=buffers)
    received = [buffers.empty(width) for _ in members]
    dist.all_gather(received, send, group=group)
    sources = {}
    for member, buffer in zip(members, received, strict=True):
        shards = _my_shards(old, member)
        data = _unpack(buffer[: sizes[member]], shards)
        sources[member] = {s.key: (s, data[s.key]) for s in shards}
    new_unit = next(u for u in spec.targets() if ctx.rank in u.slots)
    new = _assemble(_my_shards(new_unit, ctx.rank), sources, ctx.rank, buffers)
    return new, width * (len(members) - 1)


def merge(ctx: SlotContext, *, spec: Merge, verify: bool = False) -> dict:
    """Merge on this slot: slice what its new position owns out of what it holds; no communication."""
    target = spec.target()
    if ctx.rank not in target.slots:
        return {"bytes_received": 0}
    source = next(u for u in spec.units if ctx.rank in u.slots)
    state = _units(ctx)[source.unit_id]
    held = {s.key: (s, state[s.key]) for s in _my_shards(source, ctx.rank)}
    buffers = _Buffers(ctx)
    new = _assemble(_my_shards(target, ctx.rank), {ctx.rank: held}, ctx.rank, buffers)
    _units(ctx)[target.unit_id] = new
    result = {"bytes_received": 0, **buffers.finish()}
    return _with_checksums(ctx, result, [target], verify)


def extend(ctx: SlotContext, *, spec: Extend, verify: bool = False) -> dict:
    """Extend on this slot: each source position broadcasts its shards to the new position, which
    receives them into one buffer its new shards are views of (no second copy).

    A slot takes part in at most two pairs when the new slots overlap the source's (sending one
    position, receiving another); every slot walks its pairs in position order, so the earliest
    unfinished pair always has both its members at it and the broadcasts cannot deadlock.
    """
    target = spec.target()
    pairs = [(i, p) for i, p in enumerate(spec.broadcast_groups()) if ctx.rank in p]
    if not pairs:
        return _with_checksums(ctx, {"bytes_received": 0}, [target], verify)
    buffers = _Buffers(ctx)
    received = 0
    for position, (src, dst) in pairs:
        shards = _my_shards(spec.source, src)
        size = _nbytes(shards)
        if ctx.rank == src:
            state = _units(ctx)[spec.source.unit_id]
            if dst != src:
                group = _group(ctx, (src, dst))
                _broadcast_shards(ctx, buffers, src=src, group=group, state=state, shards=shards)
                continue
            # The same position on the same slot: a local copy.
            buffer = buffers.empty(size, pinned=True)
            _pack(state, shards, buffers=buffers, out=buffer)
        else:
            buffer = buffers.empty(size, pinned=True, prefault=True)
            group = _group(ctx, (src, dst))
            _broadcast_shards(ctx, buffers, src=src, group=group, shards=shards, out=buffer)
            received += size
        assert target.slots[position] == dst
        _units(ctx)[target.unit_id] = _unpack(buffer, shards)
    result = {"bytes_received": received, **buffers.finish()}
    return _with_checksums(ctx, result, [target], verify)


def _drop(units: dict, unit_ids: list[str]) -> tuple[dict[int, torch.Tensor], list]:
    """Remove units' shards; returns their storages (as whole flat tensors) and weak references
    to the shard tensors, which must die with the units."""
    wholes: dict[int, torch.Tensor] = {}
    refs = []
    for unit_id in unit_ids:
        state = units.pop(unit_id, None) or {}
        for t in state.values():
            ptr = t.untyped_storage().data_ptr()
            if ptr not in wholes:
                wholes[ptr] = _whole(t)
            refs.append(weakref.ref(t))
        state.clear()
    return wholes, refs


def release(ctx: SlotContext, *, unit_ids: list[str], cache: bool = True) -> dict:
    """Drop units' shards and check the memory really came back (no tensor outlives the release).

    ``freed_bytes``: storage no remaining unit uses (a Split may hand whole buffers on). Of it,
    ``cached_bytes`` stays in the slot's arena for the next primitive to reuse (``cache``, on a CPU
    slot, when nothing else holds the storage); ``empty_cache`` returns that too.
    """
    units = _units(ctx)
    arena = _arena(ctx)
    arena.observe(_state_bytes(ctx) + arena.nbytes)
    wholes, refs = _drop(units, unit_ids)
    kept = set(_storages(ctx))
    alive = sum(ref() is not None for ref in refs)
    if alive:  # only a reference cycle could still hold them; a full collection is slow
        gc.collect()
        alive = sum(ref() is not None for ref in refs)
    freed, put = 0, set()
    for ptr, whole in wholes.items():
        if ptr in kept:
            continue
        freed += whole.numel()
        if cache and not alive and _only_holder(whole) and arena.put(whole):
            put.add(id(whole))
    wholes.clear()
    cached = sum(b.numel() for b in arena.buffers if id(b) in put)
    return {
        "freed_bytes": freed,
        "cached_bytes": cached,
        "arena_bytes": arena.nbytes,
        "still_referenced": alive,
        "state_bytes": _state_bytes(ctx),
    }


def empty_cache(ctx: SlotContext) -> dict:
    """Free every buffer the slot's arena keeps (and, on a GPU, the blocks PyTorch's caching
    allocator keeps, which work allocating outside the units cannot otherwise use), and restart
    the arena's high-water mark from the units' bytes now; returns ``{"freed_bytes",
    "state_bytes"}``."""
    arena = _arena(ctx)
    freed = arena.trim(0)
    if ctx.device.type == "cuda":
        before = torch.cuda.memory_reserved(ctx.device)
        torch.cuda.empty_cache()
        freed += before - torch.cuda.memory_reserved(ctx.device)
    state = _state_bytes(ctx)
    arena.high_water = state
    return {"freed_bytes": freed, "state_bytes": state}


def memory_stats(ctx: SlotContext) -> dict:
    """What the slot holds: its units' bytes, its arena's (bytes and buffers) and the arena's
    high-water mark."""
    arena = _arena(ctx)
    return {
        "state_bytes": _state_bytes(ctx),
        "arena_bytes": arena.nbytes,
        "arena_buffers": len(arena.buffers),
        "high_water": arena.high_water,
    }
