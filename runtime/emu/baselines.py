"""Shard-level resharding: the baseline that has no unit boundary.

Without knowing that a model-stage's replicas are whole units, a shard-level system moves each
tensor on its own: the canonical shards are sent to one root, which reassembles the tensor and
broadcasts it to every participant, and each destination slices what its new layout owns. It is
correct (tests check it like the primitives) and slow for the reasons the EMU exists: one round of
collectives per tensor, and every byte broadcast to every participant.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from runtime.emu.primitives import Unit
from runtime.emu.slot_ops import _DTYPES, _units
from runtime.engine.slots import SlotContext


def participants(source: Unit, targets: list[Unit]) -> tuple[int, ...]:
    return tuple(sorted({*source.slots, *(s for t in targets for s in t.slots)}))


def reshard_per_tensor(ctx: SlotContext, *, source: Unit, targets: list[Unit]) -> dict:
    """Rebuild ``targets`` from ``source`` one tensor at a time; returns bytes this slot received."""
    members = participants(source, targets)
    if ctx.rank not in members:
        return {"bytes_received": 0}
    group = ctx.state["groups"][members]
    held = {}
    if ctx.rank in source.slots:
        state = _units(ctx)[source.unit_id]
        held = {
            s.key: (s, state[s.key]) for s in source.layout.shards(source.position_of(ctx.rank))
        }
    mine = [t for t in targets if ctx.rank in t.slots]
    new_states = {t.unit_id: {} for t in mine}
    received = 0
    for tensor in source.layout.tensors():
        holders = [
            (slot, shard)
            for slot in source.slots
            for shard in source.layout.shards(source.position_of(slot))
            if shard.key == tensor.key and shard.replica_id == 0
        ]
        root = holders[0][0]
        full = torch.empty(tensor.global_shape, dtype=_DTYPES[tensor.dtype], device=ctx.device)
        if ctx.rank == root:
            for slot, shard in holders:
                region = tuple(slice(a, b) for a, b in shard.region())
                if slot == root:
                    full[region] = held[tensor.key][1]
                else:
                    part = torch.empty(shard.local_shape, dtype=full.dtype, device=ctx.device)
                    dist.recv(part, src=slot, group=group)
                    received += part.numel() * part.element_size()
                    full[region] = part
        elif tensor.key in held and held[tensor.key][0].replica_id == 0:
            dist.send(held[tensor.key][1].contiguous(), dst=root, group=group)
        dist.broadcast(full, src=root, group=group)
        if ctx.rank != root:
            received += full.numel() * full.element_size()
        for target in mine:
            for shard in target.layout.shards(target.position_of(ctx.rank)):
                if shard.key == tensor.key:
                    region = tuple(slice(a, b) for a, b in shard.region())
                    new_states[target.unit_id][shard.key] = full[region].clone()
    for target in mine:
        _units(ctx)[target.unit_id] = new_states[target.unit_id]
    return {"bytes_received": received}


def measure_collective(
    ctx: SlotContext, *, ranks: tuple[int, ...], nbytes: int, kind: str, repeats: int = 3
) -> float:
    """Best seconds of one broadcast or all-gather of ``nbytes`` per rank among ``ranks``."""
    import time

    if ctx.rank not in ranks:
        return 0.0
    group = ctx.state["groups"][tuple(sorted(ranks))]
    buffer = torch.ones(nbytes, dtype=torch.uint8, device=ctx.device)
    outputs = [torch.empty_like(buffer) for _ in ranks]
    best = float("inf")
    for _ in range(repeats):
        dist.barrier(group=group)
        started = time.perf_counter()
        if kind == "broadcast":
            dist.broadcast(buffer, src=min(ranks), group=group)
        else:
            dist.all_gather(outputs, buffer, group=group)
        best = min(best, time.perf_counter() - started)
    return best


def measure_pattern(
    ctx: SlotContext, *, groups: list[tuple[int, ...]], nbytes: int, kind: str, repeats: int = 3
) -> float:
    """Best seconds of a primitive's communication pattern on raw buffers of ``nbytes`` per rank,
    all groups at once, as the primitive runs them: ``broadcast`` from each group's first rank
    (Extend), ``exchange``, each member broadcasting in turn (a TP Split on gloo), or
    ``p2p_exchange``, every member sending to and receiving from every other at once, point to
    point (a pipeline Split on gloo). Every slot calls it."""
    import time

    group = next((g for g in groups if ctx.rank in g), None)
    handle = ctx.state["groups"][tuple(sorted(group))] if group else None
    buffer = torch.ones(nbytes, dtype=torch.uint8, device=ctx.device)
    peers = [m for m in group if m != ctx.rank] if group else []
    inboxes = [torch.ones(nbytes, dtype=torch.uint8, device=ctx.device) for _ in peers]
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        if group is not None and kind == "p2p_exchange":
            works = [
                dist.irecv(b, src=p, group=handle) for p, b in zip(peers, inboxes, strict=True)
            ]
            works += [dist.isend(buffer, dst=p, group=handle) for p in peers]
            for work in works:
                work.wait()
        elif group is not None:
            senders = group[:1] if kind == "broadcast" else group
            for src in senders:
                dist.broadcast(buffer, src=src, group=handle)
        best = min(best, time.perf_counter() - started)
    return best
