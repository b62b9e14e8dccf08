"""``diff``: the primitives that take a job from its current units to a target plan, as one DAG.

Only the persistent model-stages move (training units, frozen models; see units.py): the derived
ones are rebuilt by the next step in the target's layout.

Per model-stage (a local DAG, in the order Split → Destroy → Extend → Merge):

1. Units that already sit where the target wants them, in the target's layout, are kept.
2. Both layouts are refined to their common grain ``(gcd(tp, tp'), gcd(pp, pp'))``. A current
   unit splits down to it (tp first, then pp), which moves data only among its own slots.
3. Each target unit is the Merge of grain-sized replicas at slots fixed by Merge's assignment
   (Merge is Split's inverse). A replica already produced by a Split is used in place; any other
   is Extended from a live replica, chosen by list scheduling on predicted times, so sources
   fan out as a tree and newly made replicas serve as sources too.
4. Current units whose replicas nobody needs are destroyed whole, without splitting; split
   replicas nobody needs are destroyed once the Extends that read them are done.

Globally, the local DAGs share slots. ``worst_case`` (dag.py) finds, per slot, the fullest state
any admitted order can reach; while one exceeds the slot's capacity, the compiler adds a
resource edge from a node that releases memory there to the node whose acquisition overflows,
and refuses the transition when no such edge exists.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence

from runtime.bytesize import byte_sizes
from runtime.emu.layout import ShardError, UnitLayout
from runtime.emu.primitives import BUCKET_BYTES, Destroy, Extend, Merge, Split, Unit
from runtime.planner.catalog import CPU_SLOT, Accelerator
from runtime.planner.memory import memory_budget
from runtime.planner.plan import Plan
from runtime.planner.space import shard_rule
from runtime.planner.workload import PpoWorkload
from runtime.transition import cost
from runtime.transition.dag import Node, TransitionDag, primitive_kind
from runtime.transition.simulate import simulate
from runtime.transition.units import (
    Units,
    bytes_on,
    largest_shard_bytes,
    occupancy,
    persistent_stages,
    unit_layout,
    units_of,
)


class TransitionRefusedError(ValueError):
    """The transition cannot be made; nothing has moved. The message names the field."""

    def __init__(self, message: str, *, needs_restore: bool = False, memory: bool = False):
        super().__init__(message)
        self.needs_restore = needs_restore
        """No intact unit is left for some model-stage: only a checkpoint can bring it back."""
        self.memory = memory
        """No order of the primitives fits the slots' memory (another route might)."""


DEFAULT_REBUILD_S: tuple[tuple[str, float], ...] = (("generation", 20.0), ("inference", 2.0))
"""Per derived stage, seconds to build one new unit on a GPU before any was measured."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    """The slots a transition runs on: their accelerator, count and usable bytes."""

    accelerator: Accelerator
    num_slots: int
    capacity_bytes: tuple[float, ...] | None = None
    """Per slot; default: the device's memory less the planner's 10% headroom."""
    lost_slots: frozenset[int] = frozenset()
    """Slots revoked or failed: what they held is gone and no target may use them."""
    rebuild_s: tuple[tuple[str, float], ...] = DEFAULT_REBUILD_S
    """Seconds to build one new unit of a derived model-stage of each stage (a generation
    engine's start-up and graph capture, an inference unit's set-up)."""

    def __post_init__(self) -> None:
        if isinstance(self.num_slots, bool) or not isinstance(self.num_slots, int):
            raise TransitionRefusedError(
                f"cluster.num_slots: must be an integer, got {self.num_slots!r}"
            )
        if self.num_slots < 1:
            raise TransitionRefusedError(
                f"cluster.num_slots: must be positive, got {self.num_slots}"
            )
        if self.capacity_bytes is not None:
            if len(self.capacity_bytes) != self.num_slots:
                raise TransitionRefusedError(
                    f"cluster.capacity_bytes: {len(self.capacity_bytes)} values for "
                    f"{self.num_slots} slots"
                )
            if any(not (c > 0 and math.isfinite(c)) for c in self.capacity_bytes):
                raise TransitionRefusedError("cluster.capacity_bytes: every value must be positive")
        bad = [s for s in self.lost_slots if not 0 <= s < self.num_slots]
        if bad:
            raise TransitionRefusedError(f"cluster.lost_slots: slot {bad[0]} is not in the pool")

    def capacity(self) -> list[float]:
        if self.capacity_bytes is not None:
            return list(self.capacity_bytes)
        return [memory_budget(self.accelerator.memory_bytes)] * self.num_slots


def diff(
    current: Plan | Units,
    target: Plan,
    cluster: Cluster,
    workload: PpoWorkload,
    *,
    efficiency: Mapping[str, float] | None = None,
    tag: str = "t1",
    derived_from: Plan | None = None,
) -> TransitionDag:
    """Compile the transition from ``current`` (a plan, or the units a job holds now) to
    ``target``; raises ``TransitionRefusedError`` before anything moves when it cannot be made.

    Layout changes go through the common grain first (fewest bytes moved). When no order of that
    route fits the slots' memory, the compiler tries the route through the coarsest common layout
    (merge replicas first, then split), whose slots never hold more than the larger of the
    current and target shards."""
    try:
        return _diff(current, target, cluster, workload, efficiency, tag, derived_from, "grain")
    except TransitionRefusedError as exc:
        if not exc.memory:
            raise
        try:
            return _diff(
                current, target, cluster, workload, efficiency, tag, derived_from, "coarsen"
            )
        except TransitionRefusedError as again:
            if not again.memory:
                raise exc from None
            raise


def _diff(current, target, cluster, workload, efficiency, tag, derived_from, route):
    _check_plan(target, cluster, workload, "target")
    if isinstance(current, Plan):
        _check_same_job(current, target)
        _check_plan(current, cluster, workload, "current", allow_lost=True)
        held = units_of(current, workload)
    else:
        held = {ms: tuple(units) for ms, units in current.items()}
        _check_units(held, cluster, workload)
    target_layouts = {
        ms.name: unit_layout(ms, target.model_stage(ms.name).layout, workload.precision)
        for ms in persistent_stages(workload)
    }
    builder = _Builder(cluster, efficiency, tag, route=route)
    final: dict[str, tuple[Unit, ...]] = {}
    for ms in persistent_stages(workload):
        intact = [u for u in held[ms.name] if not set(u.slots) & cluster.lost_slots]
        broken = [u for u in held[ms.name] if set(u.slots) & cluster.lost_slots]
        for unit in broken:  # release what the survivors of a broken unit still hold
            builder.destroy(unit, slots=tuple(s for s in unit.slots if s not in cluster.lost_slots))
        wanted = target.model_stage(ms.name).units
        intact, surplus = _usable(intact, target_layouts[ms.name], wanted)
        for unit in surplus:
            builder.destroy(unit)
        if wanted and not intact:
            raise TransitionRefusedError(
                f"current.{ms.name}: no intact unit is left; restore it from a checkpoint",
                needs_restore=True,
            )
        final[ms.name] = builder.model_stage(ms.name, intact, target_layouts[ms.name], wanted)
    initial = occupancy(held, cluster.num_slots)
    for slot, (used, cap) in enumerate(zip(initial, cluster.capacity(), strict=True)):
        if used > cap:
            raise TransitionRefusedError(
                "cluster.capacity_bytes: slot {} already holds {}, over its {}".format(
                    slot, *byte_sizes(used, cap)
                )
            )
    dag = TransitionDag(
        nodes=builder.nodes,
        edges=builder.edges,
        initial=initial,
        capacity=cluster.capacity(),
        current=held,
        target=final,
    )
    _check_final(dag, final)
    before = current if isinstance(current, Plan) else derived_from
    rebuild = dict(cluster.rebuild_s)
    # Slots the running plan uses (its units of every model-stage, and the held ones): a new
    # derived unit on none of them can be built while the job still steps on the others. Without
    # the plan the units came from, where its derived units run is unknown: nothing is ahead.
    busy = {s for units in held.values() for u in units for s in u.slots}
    if before is not None:
        busy.update(s for ms in before.model_stages for u in ms.units for s in u)
    ahead = set()
    generating: set[int] = set()  # slots of the generation units kept in place
    for ms in workload.model_stages():
        if ms.name in final:
            continue
        was = None if before is None else before.model_stage(ms.name)
        now = target.model_stage(ms.name)
        same_shape = was is not None and (was.layout.tp, was.layout.pp) == (
            now.layout.tp,
            now.layout.pp,
        )
        kept = set(was.units) if same_shape else set()
        new_units = [u for u in now.units if u not in kept]
        if ms.stage == "generation":
            generating.update(s for u in kept.intersection(now.units) for s in u)
        if new_units:  # units kept in place keep what they have built
            dag.rebuilds[ms.name] = rebuild.get(ms.stage, 0.0)
            dag.rebuild_units[ms.name] = tuple(new_units)
            if before is not None:
                ahead.update((ms.name, u) for u in new_units if not busy.intersection(u))
    dag.ahead = frozenset(ahead)
    # Generation units are independent engines: the first step can generate on those kept in
    # place while the new units elsewhere build (``TransitionDag.joining``).
    dag.generating = frozenset(generating)
    _add_resource_edges(dag)
    # What admission uses: the executor's policy played out on predicted times (slots run one
    # primitive at a time, so this is at least the critical path).
    dag.predicted_makespan_s = simulate(dag).makespan_s
    return dag


def _usable(
    intact: list[Unit], layout: UnitLayout, wanted: tuple[tuple[int, ...], ...]
) -> tuple[list[Unit], list[Unit]]:
    """The intact replicas a model-stage's local DAG starts from, and the surplus to destroy.

    A job's units form replicas of one layout on disjoint slots, but a transition that failed
    part-way leaves what its nodes had made by then: an Extend's copy beside the source it never
    destroyed (two replicas on one slot), a few replicas Split and the rest not (two layouts).
    Every one of them is a whole replica, so any subset is a correct start: those already in
    the target's layout and place, then the most numerous other layout, each kept only if its
    slots are free of those kept before it."""
    others: dict[UnitLayout, int] = {}
    for unit in intact:
        if unit.layout != layout or unit.slots not in wanted:
            others[unit.layout] = others.get(unit.layout, 0) + 1
    source = max(others, key=lambda lay: others[lay], default=None)

    def rank(unit: Unit) -> int:
        return 0 if unit.layout == layout and unit.slots in wanted else 1

    usable, surplus, taken = [], [], set()
    for unit in sorted(intact, key=rank):  # stable: the job's own order within each rank
        if (rank(unit) == 1 and unit.layout != source) or taken.intersection(unit.slots):
            surplus.append(unit)
        else:
            usable.append(unit)
            taken.update(unit.slots)
    return usable, surplus


# --- validation ------------------------------------------------------------------------------------


def _check_same_job(current: Plan, target: Plan) -> None:
    if current.job and target.job and current.job != target.job:
        raise TransitionRefusedError(
            f"target.job: the plans belong to different jobs ({current.job!r}, {target.job!r})"
        )
    if current.models and target.models and current.models != target.models:
        theirs = dict(target.models)
        role, name = next((r, n) for r, n in current.models if theirs.get(r) != n)
        raise TransitionRefusedError(
            f"target.models: the plans are for different models ({role}: {name} now, "
            f"{theirs.get(role, 'none')} in the target)"
        )
    if current.accelerator != target.accelerator:
        raise TransitionRefusedError(
            f"target.accelerator: {target.accelerator} differs from the running plan's "
            f"{current.accelerator}"
        )


def _check_plan(
    plan: Plan, cluster: Cluster, workload: PpoWorkload, name: str, *, allow_lost: bool = False
) -> None:
    ours = tuple(sorted((role, model.name) for role, model in workload.models.items()))
    if plan.models and plan.models != ours:
        raise TransitionRefusedError(
            f"{name}.models: the plan is for {dict(plan.models)}, the job runs {dict(ours)}"
        )
    if plan.accelerator != cluster.accelerator.name:
        raise TransitionRefusedError(
            f"{name}.accelerator: {plan.accelerator}, but the cluster has "
            f"{cluster.accelerator.name}"
        )
    names = {ms.name for ms in plan.model_stages}
    for ms in workload.model_stages():
        if ms.name not in names:
            raise TransitionRefusedError(f"{name}.model_stages: {ms.name} is missing")
        msp = plan.model_stage(ms.name)
        try:
            unit_layout(ms, msp.layout, workload.precision)
        except ShardError as exc:
            raise TransitionRefusedError(f"{name}.{ms.name}.layout: {exc}") from None
        # Sizes a Split cannot cut evenly would fail at that node, after others have moved.
        reason = shard_rule(ms.model, msp.layout.tp, msp.layout.pp, lm_head=not ms.scalar_head)
        if reason:
            raise TransitionRefusedError(f"{name}.{ms.name}.layout: {reason}")
        for unit in msp.units:
            for slot in unit:
                if not 0 <= slot < cluster.num_slots:
                    raise TransitionRefusedError(
                        f"{name}.{ms.name}.units: slot {slot} is outside the cluster's "
                        f"{cluster.num_slots} slots"
                    )
                if slot in cluster.lost_slots and not allow_lost:
                    raise TransitionRefusedError(f"{name}.{ms.name}.units: slot {slot} is lost")
    extra = names - {ms.name for ms in workload.model_stages()}
    if extra:
        raise TransitionRefusedError(f"{name}.model_stages: {sorted(extra)[0]} is not in the job")


def _check_units(held: dict[str, tuple[Unit, ...]], cluster: Cluster, workload) -> None:
    seen: set[str] = set()
    for ms in persistent_stages(workload):
        if ms.name not in held:
            raise TransitionRefusedError(f"current.{ms.name}: the job's units are missing")
        for unit in held[ms.name]:
            if unit.unit_id in seen:
                raise TransitionRefusedError(
                    f"current.{ms.name}: unit id {unit.unit_id} appears twice"
                )
            seen.add(unit.unit_id)
            if unit.model_stage != ms.name:
                raise TransitionRefusedError(
                    f"current.{ms.name}: unit {unit.unit_id} belongs to {unit.model_stage}"
                )
            if any(not 0 <= s < cluster.num_slots for s in unit.slots):
                raise TransitionRefusedError(
                    f"current.{ms.name}: unit {unit.unit_id} lies outside the cluster's slots"
                )


def _check_final(dag: TransitionDag, final: dict[str, tuple[Unit, ...]]) -> None:
    """The target itself must fit: every slot's state once the transition is done."""
    after = dag.final_occupancy()
    for slot, (used, cap) in enumerate(zip(after, dag.capacity, strict=True)):
        if used > cap:
            holders = sorted(
                {u.model_stage for us in final.values() for u in us if slot in u.slots}
            )
            held, room = byte_sizes(used, cap)
            raise TransitionRefusedError(
                f"target: slot {slot} would hold {held} of state "
                f"({', '.join(holders)}), over its {room}"
            )


# --- the local DAGs -------------------------------------------------------------------------------


class _Builder:
    """Accumulates nodes and data edges for every model-stage."""

    def __init__(self, cluster: Cluster, efficiency, tag: str, *, route: str = "grain"):
        self.route = route
        """``grain`` (split to the common grain, then merge) or ``coarsen`` (merge to the
        coarsest common layout, then split): see ``diff``."""
        self.acc = cluster.accelerator
        # CPU slots exchange over gloo (bucketed, zero-copy pipeline splits); GPUs over NCCL.
        self.gloo = cluster.accelerator.name == CPU_SLOT
        self.efficiency = efficiency
        self.tag = tag
        self.nodes: list[Node] = []
        self.edges: list[tuple[str, str]] = []
        self._ids = itertools.count()

    def _add(self, primitive, *, model_stage, consumes, produces, slots, acquire, release, after):
        prediction = cost.predict(primitive, self.acc, self.efficiency)
        kind = primitive_kind(primitive)
        node = Node(
            node_id=f"{self.tag}.{next(self._ids)}.{kind}",
            kind=kind,
            model_stage=model_stage,
            primitive=primitive,
            consumes=tuple(consumes),
            produces=tuple(produces),
            slots=tuple(slots),
            acquire={s: b for s, b in acquire.items() if b},
            release={s: b for s, b in release.items() if b},
            predicted_s=prediction.seconds,
            predicted_bytes=prediction.bytes_moved,
            ideal_s=prediction.ideal_s,
        )
        self.nodes.append(node)
        self.edges += [(a, node.node_id) for a in sorted({a for a in after if a})]
        return node

    def destroy(self, unit: Unit, *, slots: Sequence[int] | None = None, after=()) -> Node:
        slots = tuple(unit.slots if slots is None else slots)
        held = bytes_on(unit)
        return self._add(
            Destroy(unit=unit),
            model_stage=unit.model_stage,
            consumes=[unit.unit_id],
            produces=[],
            slots=slots,
            acquire={},
            release={s: held[s] for s in slots},
            after=after,
        )

    def split(self, unit: Unit, axis: str, k: int, after: str | None) -> tuple[Node, list[Unit]]:
        spec = Split(unit=unit, axis=axis, k=k)
        parts = spec.targets()
        old = bytes_on(unit)
        new = {s: b for part in parts for s, b in bytes_on(part).items()}
        group_of = {s: g for g in spec.peer_groups() for s in g}
        acquire, release = {}, {}
        for s in unit.slots:
            peers = [m for m in group_of[s] if m != s]
            if not self.gloo:  # NCCL: one padded all-gather, a send and k receive buffers
                transient = (len(peers) + 2) * max(old[m] for m in group_of[s])
                acquire[s], release[s] = new[s] + transient, old[s] + transient
            elif axis == "pp":  # peers' stages arrive beside the slot's own: nothing copied
                acquire[s], release[s] = new[s] - old[s], 0
            else:  # tp over gloo: cut from one bucket at a time into the new buffer (a
                # bucket holds no more than the peer sends: all of a small model's at once)
                bucket = min(
                    max(
                        BUCKET_BYTES,
                        *(largest_shard_bytes(unit.layout, unit.position_of(m)) for m in peers),
                    ),
                    max(old[m] for m in peers),
                )
                acquire[s], release[s] = new[s] + bucket, old[s] + bucket
        node = self._add(
            spec,
            model_stage=unit.model_stage,
            consumes=[unit.unit_id],
            produces=parts,
            slots=unit.slots,
            acquire=acquire,
            release=release,
            after=[after] if after else [],
        )
        return node, parts

    def extend(self, source: Unit, slots: tuple[int, ...], unit_id: str, after) -> Node:
        spec = Extend(source=source, slots=slots, unit_id=unit_id)
        target = spec.target()
        return self._add(
            spec,
            model_stage=source.model_stage,
            consumes=[],
            produces=[target],
            slots=sorted(set(source.slots) | set(slots)),
            acquire=bytes_on(target),
            release={},
            after=after,
        )

    def merge(self, units: list[Unit], axis: str, unit_id: str, after) -> tuple[Node, Unit]:
        spec = Merge(units=tuple(units), axis=axis, unit_id=unit_id)
        target = spec.target()
        old: dict[int, int] = {}
        for unit in units:
            old.update(bytes_on(unit))
        node = self._add(
            spec,
            model_stage=target.model_stage,
            consumes=[u.unit_id for u in units],
            produces=[target],
            slots=target.slots,
            acquire=bytes_on(target),
            release=old,
            after=after,
        )
        return node, target

    # --- one model-stage ------------------------------------------------------------------------

    def model_stage(
        self,
        name: str,
        intact: list[Unit],
        layout: UnitLayout,
        wanted: tuple[tuple[int, ...], ...],
    ) -> tuple[Unit, ...]:
        """Add the local DAG of one model-stage; returns its units once it is done."""
        kept = [u for u in intact if u.layout == layout and u.slots in wanted]
        kept_slots = {u.slots for u in kept}
        leaving = [u for u in intact if u not in kept]
        todo = [
            Unit(unit_id=f"{name}/{self.tag}.u{i}", model_stage=name, layout=layout, slots=w)
            for i, w in enumerate(wanted)
            if w not in kept_slots
        ]
        if not todo:
            for unit in leaving:
                self.destroy(unit)
            return tuple(kept)
        current = leaving[0].layout if leaving else kept[0].layout
        k_tp, r_tp = divmod(layout.tp, current.tp)
        k_pp, r_pp = divmod(layout.pp, current.pp)
        coarse = dataclasses.replace(
            current, tp=math.lcm(current.tp, layout.tp), pp=math.lcm(current.pp, layout.pp)
        )
        m = (coarse.tp // current.tp) * (coarse.pp // current.pp)
        if leaving and not r_tp and not r_pp and k_tp * k_pp > 1 and len(leaving) >= k_tp * k_pp:
            built = self._by_merging_first(name, leaving, kept, todo, k_tp * k_pp)
        elif self.route == "coarsen" and coarse != layout and m > 1 and len(leaving) >= m:
            built = self._by_coarsening(name, leaving, kept, todo, coarse, m)
        else:
            built = self._by_grain(name, leaving, kept, todo)
        return tuple(kept) + tuple(built)

    def _by_coarsening(self, name, leaving, kept, todo, coarse: UnitLayout, m: int) -> list[Unit]:
        """Merge groups of ``m`` current replicas into the coarsest common layout (local
        slicing: every slot's share shrinks), split each down to the target layout on its own
        slots, then extend target replicas where they are wanted and destroy the rest.

        Moves about as many bytes as the grain route, but a slot never holds more than the
        larger of its current and target shards, where the grain route holds the grain's (up to
        ``k`` times the current shard) on every slot at once. The route for a full device."""
        layout = todo[0].layout
        producer: dict[tuple[int, ...], tuple[Unit, str | None]] = {
            u.slots: (u, None) for u in kept
        }
        ready = {u.slots: 0.0 for u in kept}
        groups = len(leaving) // m
        for j in range(groups):
            group = leaving[j * m : (j + 1) * m]
            merging = {u.slots: (u, None) for u in group}
            tree = _group_tree(group, coarse, f"{name}/{self.tag}.c{j}")
            whole = self._merge_up(tree, merging, {})
            pieces = self._split_down_after(whole, layout, merging[whole.slots][1])
            split_s = self._split_time(whole, layout)
            for piece, node_id in pieces:
                producer[piece.slots] = (piece, node_id)
                ready[piece.slots] = split_s
        for unit in leaving[groups * m :]:
            self.destroy(unit)
        needed = [w.slots for w in todo]
        extends = self._schedule_extends(name, layout, ready, needed, set(), set())
        readers = self._emit_extends(name, needed, extends, producer)
        self._destroy_unused(producer, set(needed), kept, readers)
        return [producer[w.slots][0] for w in todo]

    def _by_grain(self, name, leaving, kept, todo) -> list[Unit]:
        """Split every current unit down to the common grain, move grain replicas, merge up.

        The general path: any pair of layouts has the grain ``(gcd(tp, tp'), gcd(pp, pp'))``.
        """
        current = leaving[0].layout if leaving else kept[0].layout
        layout = todo[0].layout
        grain = dataclasses.replace(
            current, tp=math.gcd(current.tp, layout.tp), pp=math.gcd(current.pp, layout.pp)
        )
        trees = [_refine(whole, grain) for whole in todo]
        needed = [g.slots for tree in trees for g in _leaves(tree)]
        offers = {u.unit_id: _leaves(_refine(u, grain)) for u in leaving}
        by_slots = {g.slots: u for u in leaving for g in offers[u.unit_id]}
        activated = {by_slots[s].unit_id for s in needed if s in by_slots}
        ready = {u.slots: 0.0 for u in kept if u.layout == grain}
        for unit in leaving:
            split_s = self._split_time(unit, grain)
            ready.update({g.slots: split_s for g in offers[unit.unit_id]})
        preferred = {g.slots for u in leaving if u.unit_id in activated for g in offers[u.unit_id]}
        extends = self._schedule_extends(name, grain, ready, needed, set(by_slots), preferred)
        for source_slots in extends.values():
            if source_slots in by_slots:
                activated.add(by_slots[source_slots].unit_id)
        producer: dict[tuple[int, ...], tuple[Unit, str | None]] = {
            u.slots: (u, None) for u in kept
        }
        for unit in leaving:
            if unit.unit_id not in activated:
                self.destroy(unit)
                continue
            for part, node_id in self._split_down(unit, grain):
                producer[part.slots] = (part, node_id)
        readers = self._emit_extends(name, needed, extends, producer)
        self._destroy_unused(producer, set(needed), kept, readers)
        return [self._merge_up(tree, producer, readers) for tree in trees]

    def _by_merging_first(self, name, leaving, kept, todo, m) -> list[Unit]:
        """The target is the current layout merged ``m``-fold: merge replicas where they are
        (local slicing: memory goes down, nothing moves), then extend target-layout replicas.

        Moves ``m`` times fewer bytes than going through the grain and never holds a piece
        larger than the target's on a destination slot.
        """
        current = leaving[0].layout
        by_slots = {u.slots: u for u in leaving}
        producer: dict[tuple[int, ...], tuple[Unit, str | None]] = {
            u.slots: (u, None) for u in kept
        }
        used: set[str] = set()
        out: dict[str, Unit] = {}
        remaining = []
        for whole in todo:  # targets whose pieces all sit in place: merge them there
            tree = _refine(whole, current)
            pieces = [by_slots.get(g.slots) for g in _leaves(tree)]
            if all(p is not None and p.unit_id not in used for p in pieces):
                for p in pieces:
                    used.add(p.unit_id)
                    producer[p.slots] = (p, None)
                out[whole.unit_id] = self._merge_up(tree, producer, {})
            else:
                remaining.append(whole)
        rest = [u for u in leaving if u.unit_id not in used]
        sources: list[Unit] = []
        if remaining:
            for j in range(len(rest) // m):
                group = rest[j * m : (j + 1) * m]
                for u in group:
                    producer[u.slots] = (u, None)
                tree = _group_tree(group, todo[0].layout, f"{name}/{self.tag}.g{j}")
                sources.append(self._merge_up(tree, producer, {}))
            rest = rest[len(sources) * m :]
        for unit in rest:
            self.destroy(unit)
        # Sources: merged groups, kept units and targets already merged in place.
        ready = {u.slots: 0.0 for u in [*sources, *kept, *out.values()]}
        needed = [w.slots for w in remaining]
        extends = self._schedule_extends(name, todo[0].layout, ready, needed, set(), set())
        readers = self._emit_extends(name, needed, extends, producer)
        self._destroy_unused(producer, set(needed), kept, readers, only={u.slots for u in sources})
        for whole in remaining:
            out[whole.unit_id] = producer[whole.slots][0]
        return [out[whole.unit_id] for whole in todo]

    def _schedule_extends(self, name, layout, ready, needed, in_place, preferred):
        """List scheduling: each missing replica from the live one that frees up first; a replica
        made by an earlier Extend is a source too, so copies fan out as a tree. Returns
        ``{target slots: source slots}``."""
        ready = dict(ready)
        busy: dict[int, float] = {}
        extends: dict[tuple[int, ...], tuple[int, ...]] = {}
        for slots in needed:
            if slots in in_place or slots in ready:  # already there, or made where it belongs
                continue
            best = None
            for source_slots, at in ready.items():
                if source_slots == slots:
                    continue
                # a replica of a unit that must split anyway beats splitting one more unit
                penalty = 0.0 if not preferred or source_slots in preferred else 1e-9
                sample = Unit(unit_id="?", model_stage=name, layout=layout, slots=source_slots)
                seconds = cost.predict(
                    Extend(source=sample, slots=slots, unit_id="?"), self.acc, self.efficiency
                ).seconds
                start = max([at, *(busy.get(s, 0.0) for s in set(source_slots) | set(slots))])
                key = (start + seconds + penalty, bool(set(source_slots) & set(slots)))
                if best is None or key < best[0]:
                    best = (key, source_slots, start + seconds)
            if best is None:
                raise TransitionRefusedError(f"target.{name}: no live replica to extend from")
            _, source_slots, finish = best
            extends[slots] = source_slots
            ready[slots] = finish
            for s in set(source_slots) | set(slots):
                busy[s] = finish
        return extends

    def _emit_extends(self, name, needed, extends, producer) -> dict:
        """Extend nodes in schedule order; returns ``{source slots: [reading node ids]}``."""
        readers: dict[tuple[int, ...], list[str]] = {}
        ids = itertools.count()
        for slots in needed:
            if slots not in extends:
                continue
            source, after = producer[extends[slots]]
            node = self.extend(source, slots, f"{name}/{self.tag}.x{next(ids)}", [after])
            producer[slots] = (node.produces[0], node.node_id)
            readers.setdefault(extends[slots], []).append(node.node_id)
        return readers

    def _destroy_unused(self, producer, needed, kept, readers, only=None) -> None:
        """Destroy produced replicas nobody needs, once the Extends reading them are done."""
        for slots, (unit, after) in list(producer.items()):
            if slots in needed or unit in kept or (only is not None and slots not in only):
                continue
            self.destroy(unit, after=[after, *readers.get(slots, [])])

    def _split_time(self, unit: Unit, grain: UnitLayout) -> float:
        total, current = 0.0, unit
        for axis in ("tp", "pp"):
            k = getattr(current.layout, axis) // getattr(grain, axis)
            if k > 1:
                spec = Split(unit=current, axis=axis, k=k)
                total += cost.predict(spec, self.acc, self.efficiency).seconds
                current = spec.targets()[0]
        return total

    def _split_down(self, unit: Unit, grain: UnitLayout) -> list[tuple[Unit, str | None]]:
        """Split ``unit`` to the grain (tp first, then pp): its pieces and their producing nodes."""
        return self._split_down_after(unit, grain, None)

    def _split_down_after(self, unit: Unit, grain: UnitLayout, after: str | None):
        """``_split_down`` of a unit that ``after`` produces (None: it exists already)."""
        pieces: list[tuple[Unit, str | None]] = [(unit, after)]
        for axis in ("tp", "pp"):
            k = getattr(unit.layout, axis) // getattr(grain, axis)
            if k == 1:
                continue
            nxt = []
            for piece, after in pieces:
                node, parts = self.split(piece, axis, k, after)
                nxt += [(p, node.node_id) for p in parts]
            pieces = nxt
        return pieces

    def _merge_up(self, tree, producer, readers) -> Unit:
        """Build one target unit from its tree ``(unit, axis, children)``; returns it."""
        whole, axis, children = tree
        if not children:
            return producer[whole.slots][0]
        parts, after = [], []
        for child in children:
            unit = self._merge_up(child, producer, readers)
            parts.append(unit)
            after.append(producer[unit.slots][1])
            after += readers.get(unit.slots, [])  # let Extends read it before it is merged away
        node, merged = self.merge(parts, axis, whole.unit_id, after)
        producer[merged.slots] = (merged, node.node_id)
        return merged


def _refine(unit: Unit, grain: UnitLayout):
    """``unit`` as a tree of grain replicas: ``(unit, axis, children)``, pp outermost, so that
    merging tp first and pp last rebuilds it."""
    k_pp = unit.layout.pp // grain.pp
    k_tp = unit.layout.tp // grain.tp
    if k_pp > 1:
        parts = Split(unit=unit, axis="pp", k=k_pp).targets()
        return (unit, "pp", [_refine(p, grain) for p in parts])
    if k_tp > 1:
        parts = Split(unit=unit, axis="tp", k=k_tp).targets()
        return (unit, "tp", [(p, None, []) for p in parts])
    return (unit, None, [])


def _group_tree(group: list[Unit], layout: UnitLayout, unit_id: str):
    """A merge tree that turns ``group`` (replicas, in order) into one unit of ``layout``:
    consecutive runs merge along tp first, then those along pp."""
    k_tp = layout.tp // group[0].layout.tp
    leaves = [(u, None, []) for u in group]
    if k_tp > 1:
        rows = [leaves[i : i + k_tp] for i in range(0, len(leaves), k_tp)]
        leaves = [
            (_merged(unit_id if len(rows) == 1 else f"{unit_id}.r{i}", row, "tp"), "tp", row)
            for i, row in enumerate(rows)
        ]
    if len(leaves) > 1:
        return (_merged(unit_id, leaves, "pp"), "pp", leaves)
    return leaves[0]


def _merged(unit_id: str, children, axis: str) -> Unit:
    return Merge(units=tuple(c[0] for c in children), axis=axis, unit_id=unit_id).target()


def _leaves(tree) -> list[Unit]:
    if isinstance(tree, Unit):
        return [tree]
    unit, _, children = tree
    if not children:
        return [unit]
    return [leaf for child in children for leaf in _leaves(child)]


def _add_resource_edges(dag: TransitionDag) -> None:
    """Order releases before acquisitions wherever some admitted order would overflow a slot.

    While slot ``s``'s worst reachable state (finished set ``D``, running node ``n``) overflows,
    exclude that state with one edge: preferably ``r → n`` from a node ``r`` outside ``D`` that
    frees memory on ``s`` (it must finish first); else ``n → a`` for an acquisition ``a`` in ``D``
    that need not precede ``n`` (it must wait until ``n`` is done). Each edge removes at least the
    witness state and keeps the DAG acyclic, so the loop ends: safe, or refused.
    """
    data_edges = dict(dag.edges)
    for slot in range(len(dag.initial)):
        if not dag.touching(slot):
            continue
        while True:
            worst, running, finished = dag.worst_case(slot)
            if worst <= dag.capacity[slot]:
                break
            edge = _excluding_edge(dag, slot, running, finished)
            if edge is None:
                dag.edges = dict(data_edges)
                dag._reach = None
                if _serialise(dag):
                    return
                what = f" while {running} runs" if running else ""
                need, room = byte_sizes(worst, dag.capacity[slot])
                raise TransitionRefusedError(
                    f"target: slot {slot} would need {need}{what}, over its {room}, and no "
                    "order of the primitives fits",
                    memory=True,
                )
            dag.add_edge(*edge, "resource")


SERIAL_SEARCH_BUDGET = 4096
"""States (sets of primitives done) the search for a fitting order visits before it refuses."""


def _serialise(dag: TransitionDag) -> bool:
    """The fallback when edge by edge gets stuck: one primitive at a time, each started only
    when it fits; if some order reaches the end, chain the DAG in that order.

    A greedy pass follows the executor's priority, then passes that run the releasing
    primitives first and each model-stage's chain whole in turn (one model-stage's move can
    need another's memory freed first: a greedy pass by chain length took the longer chain
    first and stuck), then a search that backtracks from dead ends (the memory a set of done
    primitives holds does not depend on their order, so each dead set is tried once), up to
    ``SERIAL_SEARCH_BUDGET`` sets."""
    priority = dag.priority()
    stages = sorted({node.model_stage for node in dag.nodes.values()})
    keys = [priority.__getitem__]
    if len(stages) <= 4:
        for turn in itertools.permutations(stages):
            rank = {name: i for i, name in enumerate(turn)}
            keys.append(
                lambda n, rank=rank: (
                    not dag.nodes[n].releasing,
                    rank[dag.nodes[n].model_stage],
                    priority[n],
                )
            )
    order = None
    for key in keys:
        order = _fitting_order(dag, key, budget=1)
        if order is not None:
            break
    if order is None:
        order = _fitting_order(dag, priority.__getitem__, budget=SERIAL_SEARCH_BUDGET)
    if order is None:
        return False
    for before, after in itertools.pairwise(order):
        if (before, after) not in dag.edges:
            dag.add_edge(before, after, "resource")
    return True


def _fitting_order(dag: TransitionDag, key, *, budget: int) -> list[str] | None:
    """An order of all of ``dag``'s primitives, one at a time after their predecessors, in which
    each fits its slots when it starts: depth first, candidates by ``key``, giving up after
    ``budget`` dead ends (1: the greedy pass alone)."""
    nodes = sorted(dag.nodes, key=key)
    preds = {n: set(dag.preds(n)) for n in nodes}
    held, done, order = list(dag.initial), set(), []
    dead: set[frozenset[str]] = set()

    def fits(n: str) -> bool:
        return all(held[s] + b <= dag.capacity[s] for s, b in dag.nodes[n].acquire.items())

    def apply(n: str, sign: int) -> None:
        for s in set(dag.nodes[n].acquire) | set(dag.nodes[n].release):
            held[s] += sign * dag.nodes[n].delta(s)

    def candidates() -> list[str]:
        return [n for n in nodes if n not in done and preds[n] <= done and fits(n)]

    stack = [iter(candidates())]
    while stack:
        if len(done) == len(nodes):
            return order
        n = next(stack[-1], None)
        if n is not None:
            if frozenset(done | {n}) in dead:
                continue
            apply(n, +1)
            done.add(n)
            order.append(n)
            stack.append(iter(candidates()))
            continue
        stack.pop()  # every candidate of this state dead-ended
        if not order:
            return None
        dead.add(frozenset(done))
        if len(dead) >= budget:
            return None
        last = order.pop()
        done.discard(last)
        apply(last, -1)
    return None


def _excluding_edge(dag: TransitionDag, slot: int, running: str | None, finished: set[str]):
    nodes = dag.nodes
    acquirers = [running] if running else []
    acquirers += sorted(
        (n for n in finished if nodes[n].delta(slot) > 0), key=lambda n: (-nodes[n].delta(slot), n)
    )
    count = {n: bin(mask).count("1") for n, mask in dag.ancestors().items()}
    for acquirer in acquirers:
        releases = [
            n
            for n in dag.touching(slot)
            if n not in finished
            and n != acquirer
            and nodes[n].release.get(slot, 0) > 0
            and not dag.is_ancestor(acquirer, n)
        ]
        if releases:
            best = min(releases, key=lambda n: (nodes[n].delta(slot), count[n], n))
            return best, acquirer
    if running:
        later = [
            n for n in finished if nodes[n].delta(slot) > 0 and not dag.is_ancestor(n, running)
        ]
        if later:
            return running, max(later, key=lambda n: (nodes[n].delta(slot), n))
    return None
