"""An exhaustive reference planner for small pools: the tests' oracle for the DP search.

It prices every (tp, pp, dp) of every model-stage with the same cost and memory models, then tries
every split of the slots among a stage's model-stages (and the colocated alternative), beside a
given allowance of training state per slot (no training layout keeping more). Slow and obviously
correct; only for pools of a few dozen slots."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from runtime.planner import cost, memory
from runtime.planner.shapes import LayoutShape, batchings
from runtime.planner.space import valid_layouts
from runtime.planner.workload import STAGES


def exact_slot_times(ms, workload, acc, num_slots, efficiency, resident) -> list[float]:
    """best[g]: the fastest feasible layout of ``ms`` using exactly g slots (inf if none), each
    layout at whichever of its micro-batches (generation: waves) that fits is fastest."""
    best = [math.inf] * (num_slots + 1)
    budget = memory.memory_budget(acc.memory_bytes)
    allowed = dict(resident)
    for tp, pp in valid_layouts(ms.model, acc, num_slots)[0]:
        if ms.stage == "training":
            one = LayoutShape(
                ms=ms, workload=workload, accelerator=acc, tp=tp, pp=pp, dp=np.array([1.0])
            )
            if one.params_per_slot * one.training_bytes_per_param[0] > allowed[ms.role] * (
                1 + 1e-9
            ):
                continue
        for dp in range(1, num_slots // (tp * pp) + 1):
            if dp > workload.global_batch:
                continue
            layout = LayoutShape(
                ms=ms,
                workload=workload,
                accelerator=acc,
                tp=tp,
                pp=pp,
                dp=np.array([float(dp)]),
                resident=resident,
            )
            for micro_batch in batchings(layout):
                shape = dataclasses.replace(layout, micro_batch=micro_batch)
                need = memory.total_bytes(memory.memory_breakdown(shape, num_slots=num_slots))[0]
                if need > budget:
                    continue
                seconds = float(
                    cost.predict(shape, num_slots=num_slots, efficiency=efficiency)[0][0]
                )
                best[dp * tp * pp] = min(best[dp * tp * pp], seconds)
    return best


def exhaustive_step_seconds(workload, acc, num_slots, resident, efficiency=None) -> float:
    """The fastest plan beside ``resident`` ((training role, bytes per slot)), by enumeration."""
    eff = {**cost.DEFAULT_EFFICIENCY, **(efficiency or {})}
    total = 0.0
    for stage in STAGES:
        tables = [
            exact_slot_times(ms, workload, acc, num_slots, eff, resident)
            for ms in workload.model_stages(stage)
        ]
        colocated = sum(min(t) for t in tables)
        disjoint = math.inf
        for split in itertools.product(range(1, num_slots + 1), repeat=len(tables)):
            if sum(split) <= num_slots:
                disjoint = min(disjoint, max(t[g] for t, g in zip(tables, split, strict=True)))
        total += min(colocated, disjoint)
    return total
