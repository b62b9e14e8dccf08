"""A unit's state through torch.distributed.checkpoint (DCP): the checkpoint/restart path.

Each slot wraps its shards as DTensors on its pipeline stage's tensor-parallel mesh (the placements
of ``layout.placement``), so DCP records global shapes and offsets and reshards on load into any
other layout. It is the baseline the primitives are measured against, and the oracle that their
resulting shards are checked with.
"""

from __future__ import annotations

import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from runtime.emu.layout import UnitLayout, placement
from runtime.emu.primitives import Unit
from runtime.emu.slot_ops import _DTYPES, _allocate, _units
from runtime.engine.slots import SlotContext


class UnusableCheckpointError(RuntimeError):
    """A committed checkpoint that cannot be loaded (a torn file, a checksum that does not match
    what was saved): a restart falls back to the one before it."""


def unit_groups(unit: Unit) -> list[tuple[int, ...]]:
    """Groups DCP needs: the whole unit (coordination) and each pipeline stage's TP ranks (meshes)."""
    tp = unit.layout.tp
    stages = [tuple(unit.slots[p * tp : (p + 1) * tp]) for p in range(unit.layout.pp)]
    return [tuple(unit.slots), *stages]


def _mesh(ctx: SlotContext, unit: Unit) -> DeviceMesh:
    tp = unit.layout.tp
    position = unit.position_of(ctx.rank)
    stage = tuple(unit.slots[(position // tp) * tp : (position // tp + 1) * tp])
    return ctx.state["dcp_meshes"][stage]


def _group(ctx: SlotContext, ranks: tuple[int, ...]):
    return ctx.state["dcp_groups"][tuple(sorted(ranks))]


def ensure_unit_groups(ctx: SlotContext, *, units: list[Unit]) -> int:
    """Create (collectively, on every slot) the groups of ``unit_groups`` not yet made."""
    import torch.distributed as dist

    cache = ctx.state.setdefault("dcp_groups", {})
    meshes = ctx.state.setdefault("dcp_meshes", {})
    created = 0
    for unit in units:
        whole, *stages = unit_groups(unit)
        key = tuple(sorted(whole))
        if key not in cache:
            cache[key] = dist.new_group(list(key), timeout=ctx.group_timeout())
            created += 1
        for stage in stages:
            # A mesh lists a stage's slots in tensor-rank order, which need not be ascending (a
            # merged unit's are not); building one is collective over the pool, like new_group.
            if stage not in meshes:
                # A mesh over the whole pool uses the default group; any other gets a group of
                # its own, with the pool's call timeout (torch's default would be 30 min).
                whole_pool = len(stage) == ctx.world_size
                meshes[stage] = DeviceMesh(
                    ctx.device.type,
                    torch.tensor(stage),
                    backend_override=None if whole_pool else ctx.mesh_backend_override(),
                )
                created += 1
    return created


def _dtensors(ctx: SlotContext, unit: Unit, layout: UnitLayout, local: dict[str, torch.Tensor]):
    mesh = _mesh(ctx, unit)
    tensors = {t.key: t for t in layout.tensors()}
    out = {}
    for shard in layout.shards(unit.position_of(ctx.rank)):
        spec = tensors[shard.key]
        full = torch.empty(spec.global_shape, dtype=_DTYPES[spec.dtype], device="meta")
        out[shard.key] = DTensor.from_local(
            local[shard.key],
            mesh,
            [placement(spec)],
            run_check=False,
            shape=full.shape,
            stride=full.stride(),
        )
    return out


def save_unit(ctx: SlotContext, *, unit: Unit, path: str) -> float:
    """Every slot of the unit writes its shards; returns the seconds this slot spent."""
    if ctx.rank not in unit.slots:
        return 0.0
    started = time.perf_counter()
    state = _dtensors(ctx, unit, unit.layout, _units(ctx)[unit.unit_id])
    dcp.save(state, checkpoint_id=path, process_group=_group(ctx, tuple(unit.slots)))
    return time.perf_counter() - started


def load_unit(ctx: SlotContext, *, unit: Unit, path: str) -> float:
    """Every slot of ``unit`` reads its shards in the unit's layout (DCP reshards); returns seconds."""
    if ctx.rank not in unit.slots:
        return 0.0
    started = time.perf_counter()
    local = _allocate(unit.layout.shards(unit.position_of(ctx.rank)), ctx.device)
    state = _dtensors(ctx, unit, unit.layout, local)
    dcp.load(state, checkpoint_id=path, process_group=_group(ctx, tuple(unit.slots)))
    _units(ctx)[unit.unit_id] = {key: tensor.to_local() for key, tensor in state.items()}
    return time.perf_counter() - started
