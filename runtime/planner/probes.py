"""Calibration probes: each communication class timed alone, on the job's own slots, before plans
are weighed.

A step times whole model-stages. A class that no step of the running plan exercises (the weight
sync inside a node, when the pool spans several; pipeline traffic, when no model-stage is
pipelined) is never measured, and calibration borrows a relative's correction for it, which
may be far from the cluster's (a PCIe box catalogued as NVLink: the links inside a node are
slow, those between nodes as listed); classes whose time grows alike with the length (decode and
generation's tensor-parallel all-reduce, both per token) are told apart only as far as the
layouts that ran differ. Like NCCL's tests or Alpa's profiler, the job times each class's
collective alone first, at the size the job's own operations of that class have (one
micro-batch's activations for tensor-parallel and pipeline traffic, one layer's gradients or
weights for the data-parallel all-reduce and the weight sync): inside a node (``intra``: the
node with the most live slots) and across nodes (``inter``: the first live slot of each). Each
probe's efficiency (ideal seconds over the median measured) is what calibration starts from for
that class; the running job's stage samples then correct whatever they determine
(``Calibrator.measure``).

A class whose link the pool cannot exercise (one node: no ``inter``) is not probed; the
transitions' classes are learned from the transitions themselves, whose primitives do more than
move bytes (pack, checksum).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Sequence

from runtime.planner import cost
from runtime.planner.catalog import Accelerator
from runtime.planner.shapes import FP32_GRADIENT_BYTES_PER_PARAM
from runtime.planner.workload import PpoWorkload

PATTERNS = ("all_reduce", "send")
"""``all_reduce``: a ring all-reduce among the probe's slots; ``send``: its first slot sends
the bytes to its second."""
FAMILIES = {
    "tp_allreduce": "all_reduce",
    "dp_allreduce": "all_reduce",
    "pp_p2p": "send",
    "weight_sync": "send",
}
"""The probed families, and the collective each one's operations are."""
PROBED_CLASSES = tuple(
    f"{family}:{link}"
    for family in FAMILIES
    for link in ("intra", "inter")
    # placement keeps a tensor-parallel group inside a node: the cost model never prices one
    # across nodes
    if (family, link) != ("tp_allreduce", "inter")
)
LINK_GAUGES = {"intra": "tp_allreduce:intra", "inter": "dp_allreduce:inter"}
"""The class probed again and again, every ``policy.link_probe_every_s``, to follow the load on
each link type: other tenants' traffic on the links (or a degraded switch) slows every class
that crosses them alike, over hours, and the samples of the steps cannot tell that slowing from
what the running plan's mix of classes does. What the gauge measures then against what it first
measured is the link's load (``Calibrator.observe_link``)."""
REPEATS = 5
"""Timed runs of each probe (after one untimed warm-up); calibration takes their median."""
MAX_PROBE_BYTES = 1 << 30
"""No probe moves more than this (the largest model's layer would take long on a slow link)."""
MAX_INTER_NODES = 8
"""An inter-node all-reduce probe spans at most this many nodes (one slot of each)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Probe:
    """One collective timed alone: ``op_class``'s pattern among ``slots``, ``nbytes`` each."""

    op_class: str
    slots: tuple[int, ...]
    nbytes: int
    repeats: int = REPEATS

    def __post_init__(self) -> None:
        if not isinstance(self.op_class, str) or self.op_class not in PROBED_CLASSES:
            raise ValueError(
                f"op_class: {self.op_class!r} is not probed; valid: {', '.join(PROBED_CLASSES)}"
            )
        for field in ("nbytes", "repeats"):
            if not _whole(getattr(self, field)):
                raise ValueError(f"{field}: must be an integer, got {getattr(self, field)!r}")
        if not isinstance(self.slots, tuple) or not all(_whole(s) for s in self.slots):
            raise ValueError(f"slots: must be a tuple of slot indices, got {self.slots!r}")
        if len(self.slots) < 2 or len(set(self.slots)) != len(self.slots):
            raise ValueError(f"slots: a probe needs two or more distinct slots, got {self.slots}")
        if self.pattern == "send" and len(self.slots) != 2:
            raise ValueError(f"slots: a send probe has a sender and a receiver, got {self.slots}")
        if not 0 < self.nbytes <= MAX_PROBE_BYTES:
            raise ValueError(f"nbytes: must be in (0, {MAX_PROBE_BYTES}], got {self.nbytes}")
        if not 1 <= self.repeats <= 100:
            raise ValueError(f"repeats: must be in [1, 100], got {self.repeats}")

    @property
    def pattern(self) -> str:
        return FAMILIES[self.op_class.partition(":")[0]]

    @property
    def link(self) -> str:
        return self.op_class.partition(":")[2]

    def efficiency(self, acc: Accelerator, runs: Sequence[float]) -> float:
        """What ``runs`` (its timed seconds) say of the link: ideal seconds over their median,
        not capped at 1 (alone, a collective may reach the catalog's peak or pass it, and a
        link's load is measured from the ratio itself)."""
        if not runs or not all(isinstance(r, int | float) and 0 < r < math.inf for r in runs):
            raise ValueError(f"measured_s: {self.op_class}: runs must be positive, got {runs}")
        return self.ideal_s(acc) / statistics.median(runs)

    @property
    def gauge(self) -> tuple[int, int]:
        """Its shape, as a link's load compares gauges of one shape: (ranks, bytes)."""
        return len(self.slots), self.nbytes

    def ideal_s(self, acc: Accelerator) -> float:
        """Seconds at the link's peak, in the cost model's own form for the class (a ring
        all-reduce, or bytes over the link plus its latency)."""
        bandwidth, latency = acc.bandwidth(self.link), acc.latency(self.link)
        if self.pattern == "all_reduce":
            return float(cost.ring_seconds(len(self.slots), self.nbytes, bandwidth, latency))
        return self.nbytes / bandwidth + latency


def _sizes(workload: PpoWorkload) -> dict[str, int]:
    """Bytes of one operation of each family, for the largest model of the job."""
    model = max((ms.model for ms in workload.model_stages()), key=lambda m: m.params_per_layer)
    activation = workload.micro_batch * workload.seq_len * model.hidden_size
    activation *= workload.bytes_per_value
    layer = model.params_per_layer
    out = {
        "tp_allreduce": activation,
        "pp_p2p": activation,
        "dp_allreduce": layer * FP32_GRADIENT_BYTES_PER_PARAM,
        "weight_sync": layer * workload.bytes_per_value,
    }
    return {family: int(min(MAX_PROBE_BYTES, max(1, n))) for family, n in out.items()}


def probes_for(
    workload: PpoWorkload,
    acc: Accelerator,
    alive: Iterable[int],
    *,
    skip: Iterable[str] = (),
) -> list[Probe]:
    """The probes of every probed class but ``skip`` that the ``alive`` slots can run: within
    the node with the most live slots (an all-reduce over as many of them as a power of two
    allows, as a tensor-parallel group is placed), and across the first live slot of each node
    (up to ``MAX_INTER_NODES``)."""
    nodes: dict[int, list[int]] = {}
    for slot in sorted(set(alive)):
        nodes.setdefault(slot // acc.gpus_per_node, []).append(slot)
    groups: dict[str, tuple[int, ...]] = {}
    fullest = max(nodes.values(), key=len, default=[])
    if len(fullest) >= 2:
        width = 1 << (len(fullest).bit_length() - 1)
        groups["intra"] = tuple(fullest[:width])
    if len(nodes) >= 2:
        groups["inter"] = tuple(members[0] for members in nodes.values())[:MAX_INTER_NODES]
    sizes = _sizes(workload)
    skipped = set(skip)
    out = []
    for family, pattern in FAMILIES.items():
        for link, group in groups.items():
            op_class = f"{family}:{link}"
            if op_class in skipped or op_class not in PROBED_CLASSES:
                continue
            slots = group if pattern == "all_reduce" else group[:2]
            out.append(Probe(op_class=op_class, slots=slots, nbytes=sizes[family]))
    return out


def link_probes(workload: PpoWorkload, acc: Accelerator, alive: Iterable[int]) -> list[Probe]:
    """The gauge probe (``LINK_GAUGES``) of each link type the ``alive`` slots span."""
    gauges = set(LINK_GAUGES.values())
    return [p for p in probes_for(workload, acc, alive) if p.op_class in gauges]


def check_probes(probes: Sequence[Probe], num_slots: int, lost: Iterable[int] = ()) -> None:
    """What an engine checks before running ``probes``: every slot in its pool and alive."""
    gone = set(lost)
    for i, probe in enumerate(probes):
        if not isinstance(probe, Probe):
            raise ValueError(f"probes[{i}]: not a Probe: {probe!r}")
        bad = [s for s in probe.slots if not 0 <= s < num_slots or s in gone]
        if bad:
            raise ValueError(
                f"probes[{i}].slots: slot {bad[0]} is not a live slot of the pool of {num_slots}"
            )


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
