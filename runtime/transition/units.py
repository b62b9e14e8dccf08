"""A job's units as values: each model-stage's units, and the bytes each holds on each slot.

What persists between two PPO steps (where transitions happen) and cannot be rebuilt is the
*mutable* state: the training units of the actor and the critic (parameters and Adam state).
Everything else is rebuilt by the next step in the target's layout: the actor's generation and
inference units and the critic's inference unit from the training units (the weight sync the
planner prices), and the frozen reference and reward models from their immutable weights, which
rest sharded evenly over the pool between uses (the planner's co-resident term) and are reloaded
whenever the pool changes. So a transition moves the training units, and its memory check counts
their state against what the resting shards leave free.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from runtime.emu.layout import UnitLayout
from runtime.emu.primitives import Unit
from runtime.planner.plan import Layout, Plan
from runtime.planner.workload import ModelStage, PpoWorkload

Units = Mapping[str, tuple[Unit, ...]]
"""Model-stage name -> its units (data-parallel replicas)."""

_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def unit_layout(ms: ModelStage, layout: Layout, precision: str = "bf16") -> UnitLayout:
    """The shard layout of one unit of ``ms`` at ``layout``'s (tp, pp); raises ShardError."""
    return UnitLayout(
        model=ms.model,
        tp=layout.tp,
        pp=layout.pp,
        training=ms.stage == "training",
        scalar_head=ms.scalar_head,
        dtype=precision,
    )


def persists(ms: ModelStage) -> bool:
    """Whether a model-stage's units hold state across steps (see the module's docstring)."""
    return ms.stage == "training"


def persistent_stages(workload: PpoWorkload) -> tuple[ModelStage, ...]:
    return tuple(ms for ms in workload.model_stages() if persists(ms))


def units_not_held(
    plan: Plan, workload: PpoWorkload, held: Units
) -> list[tuple[str, tuple[int, ...]]]:
    """The persistent units ``plan`` names (model-stage, slots) that ``held`` has not: a plan
    cannot run its step on them (a slot given back after a revocation comes back empty)."""
    persistent = {ms.name for ms in persistent_stages(workload)}
    have = {(name, u.slots) for name, units in held.items() for u in units}
    return [
        (ms.name, slots)
        for ms in plan.model_stages
        if ms.name in persistent
        for slots in ms.units
        if (ms.name, slots) not in have
    ]


def units_of(plan: Plan, workload: PpoWorkload, *, tag: str = "u") -> dict[str, tuple[Unit, ...]]:
    """A plan's persistent units, named ``<model-stage>/<tag><index>``."""
    out = {}
    for ms in persistent_stages(workload):
        msp = plan.model_stage(ms.name)
        layout = unit_layout(ms, msp.layout, workload.precision)
        out[ms.name] = tuple(
            Unit(unit_id=f"{ms.name}/{tag}{i}", model_stage=ms.name, layout=layout, slots=slots)
            for i, slots in enumerate(msp.units)
        )
    return out


@functools.lru_cache(maxsize=8192)
def position_bytes(layout: UnitLayout, position: int) -> int:
    """Bytes of state the slot at ``position`` of a unit holds."""
    return sum(s.numel * _BYTES[s.dtype] for s in layout.shards(position))


@functools.lru_cache(maxsize=8192)
def largest_shard_bytes(layout: UnitLayout, position: int) -> int:
    """The largest single shard the slot at ``position`` holds."""
    return max((s.numel * _BYTES[s.dtype] for s in layout.shards(position)), default=0)


def bytes_on(unit: Unit) -> dict[int, int]:
    """{slot: bytes of ``unit``'s state on it}."""
    return {slot: position_bytes(unit.layout, i) for i, slot in enumerate(unit.slots)}


def occupancy(units: Units, num_slots: int) -> list[int]:
    """Bytes of state on every slot of the pool."""
    out = [0] * num_slots
    for group in units.values():
        for unit in group:
            for slot, nbytes in bytes_on(unit).items():
                out[slot] += nbytes
    return out
