"""Predicted seconds and bytes of each primitive, from the planner's link model and efficiencies.

Movement between slots is priced like the planner's collectives (alpha-beta, per link type, divided
by the calibrated ``transition:<link>`` efficiency); work on one slot (packing, assembling, the
verification checksum) by memory bandwidth and ``transition_copy``. Every primitive also pays a
fixed dispatch-and-verify overhead. Groups of a primitive run in parallel, so it takes as long as
its slowest group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from runtime.emu.primitives import Destroy, Extend, Merge, Primitive, Split
from runtime.planner.catalog import Accelerator
from runtime.planner.cost import DEFAULT_EFFICIENCY
from runtime.transition.units import bytes_on

OVERHEAD_S = 2e-3
"""Dispatch to the slots, the checksum round and the release call, per primitive."""


@dataclasses.dataclass(frozen=True, slots=True)
class Prediction:
    seconds: float
    bytes_moved: int
    """Bytes received over links by all slots together."""
    ideal_s: dict[str, float]
    """Seconds per efficiency class at peak (what calibration compares measurements with)."""


def _link(acc: Accelerator, slots) -> str:
    nodes = {s // acc.gpus_per_node for s in slots}
    return "intra" if len(nodes) == 1 else "inter"


def predict(
    primitive: Primitive, acc: Accelerator, efficiency: Mapping[str, float] | None = None
) -> Prediction:
    eff = {**DEFAULT_EFFICIENCY, **(efficiency or {})}
    ideal: dict[str, float] = {}
    moved = 0
    slowest_move = {"intra": 0.0, "inter": 0.0}
    local_bytes = 0
    if isinstance(primitive, Split):
        old = bytes_on(primitive.unit)
        for group in primitive.peer_groups():
            link = _link(acc, group)
            k = len(group)
            width = max(old[s] for s in group)
            # ring all-gather of k equal blocks: every member receives k-1 of them
            seconds = (k - 1) * width / acc.bandwidth(link) + (k - 1) * acc.latency(link)
            slowest_move[link] = max(slowest_move[link], seconds)
            moved += sum(old[m] for m in group) * (k - 1)
            local_bytes = max(local_bytes, 2 * k * width)  # assemble, then checksum the new shard
    elif isinstance(primitive, Extend):
        source = bytes_on(primitive.source)
        per_slot: dict[int, dict[str, float]] = {}
        for src, dst in primitive.broadcast_groups():
            if src == dst:
                local_bytes = max(local_bytes, 2 * source[src])
                continue
            link = _link(acc, (src, dst))
            seconds = source[src] / acc.bandwidth(link) + acc.latency(link)
            for slot in (src, dst):  # a slot in two pairs does them one after the other
                per_slot.setdefault(slot, {"intra": 0.0, "inter": 0.0})[link] += seconds
            moved += source[src]
            local_bytes = max(local_bytes, source[src])  # the checksum of the new copy
        for times in per_slot.values():
            for link, seconds in times.items():
                slowest_move[link] = max(slowest_move[link], seconds)
    elif isinstance(primitive, Merge):
        target = primitive.target()
        local_bytes = 2 * max(bytes_on(target).values())
    elif not isinstance(primitive, Destroy):
        raise TypeError(f"primitive: not a primitive: {primitive!r}")
    for link, seconds in slowest_move.items():
        if seconds:
            ideal[f"transition:{link}"] = seconds
    if local_bytes:
        ideal["transition_copy"] = local_bytes / acc.memory_bandwidth
    total = OVERHEAD_S + sum(s / eff[c] for c, s in ideal.items())
    return Prediction(seconds=total, bytes_moved=moved, ideal_s=ideal)
