"""The transition DAG: primitives as nodes, data and resource edges, and its memory analysis.

Memory model. A node *acquires* bytes on its slots when it starts (what it builds, plus transient
receive buffers) and *releases* bytes when it finishes (what it consumes, plus those buffers). The
executor runs at most one node per slot at a time (a slot executes one call at a time anyway), so a
reachable state of slot ``s`` is: a set ``D`` of finished nodes closed under predecessors, plus at
most one running node on ``s`` whose predecessors are all in ``D``. ``worst_case(s)`` finds the
largest occupancy over every such state exactly: the largest sum of net changes over a
predecessor-closed set is a maximum-weight closure, solved as a minimum cut. Only nodes that touch
``s`` carry weight, so each slot's problem has a handful of nodes, with the DAG's reachability
standing in for the paths through the others.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from runtime.bytesize import byte_sizes
from runtime.emu.primitives import Destroy, Extend, Merge, Primitive, Split, Unit
from runtime.planner.calibration import Sample
from runtime.transition.cost import OVERHEAD_S

STAGE_ORDER = {"generation": 0, "inference": 1, "training": 2}
NODE_STATES = ("pending", "running", "done", "failed", "skipped")


class MemoryUnsafeError(RuntimeError):
    """Some order the DAG admits would push a slot over its capacity."""

    def __init__(self, message: str, *, slot: int, worst_bytes: int, capacity_bytes: float):
        super().__init__(message)
        self.slot = slot
        self.worst_bytes = worst_bytes
        self.capacity_bytes = capacity_bytes


@dataclasses.dataclass(kw_only=True, slots=True)
class Node:
    """One primitive of a transition, with its resources, prediction and (once run) outcome."""

    node_id: str
    kind: str
    model_stage: str
    primitive: Primitive
    consumes: tuple[str, ...]
    """Unit ids it releases when it succeeds."""
    produces: tuple[Unit, ...]
    slots: tuple[int, ...]
    acquire: dict[int, int]
    release: dict[int, int]
    predicted_s: float
    predicted_bytes: int
    ideal_s: dict[str, float] = dataclasses.field(default_factory=dict)
    state: str = "pending"
    started_s: float | None = None
    finished_s: float | None = None
    actual_bytes: int | None = None
    error: str | None = None

    @property
    def stage(self) -> str:
        return self.model_stage.partition("@")[2]

    def delta(self, slot: int) -> int:
        """Net bytes on ``slot`` once the node is done."""
        return self.acquire.get(slot, 0) - self.release.get(slot, 0)

    @property
    def releasing(self) -> bool:
        """Frees more than it takes (Destroy, Merge, most Splits of optimizer-free units)."""
        return sum(self.release.values()) > sum(self.acquire.values())

    @property
    def actual_s(self) -> float | None:
        if self.started_s is None or self.finished_s is None:
            return None
        return self.finished_s - self.started_s

    def sample(self, seconds: float | None = None) -> Sample | None:
        """What calibration learns from this node having taken ``seconds`` (default: what it
        took): its classes' ideal seconds beside that time, net of the fixed overhead the cost
        model adds to every primitive; None for a node without classes or without a time."""
        seconds = self.actual_s if seconds is None else seconds
        if not self.ideal_s or seconds is None or seconds <= OVERHEAD_S:
            return None
        return Sample(f"transition.{self.kind}", dict(self.ideal_s), seconds - OVERHEAD_S)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.node_id,
            "kind": self.kind,
            "model_stage": self.model_stage,
            "consumes": list(self.consumes),
            "produces": [u.unit_id for u in self.produces],
            "slots": list(self.slots),
            "acquire": {str(s): b for s, b in sorted(self.acquire.items())},
            "release": {str(s): b for s, b in sorted(self.release.items())},
            "predicted_s": self.predicted_s,
            "predicted_bytes": self.predicted_bytes,
            "state": self.state,
            "started_s": self.started_s,
            "finished_s": self.finished_s,
            "actual_s": self.actual_s,
            "actual_bytes": self.actual_bytes,
            "error": self.error,
        }


def primitive_kind(primitive: Primitive) -> str:
    return {Split: "split", Merge: "merge", Extend: "extend", Destroy: "destroy"}[type(primitive)]


def max_closure(
    weights: Mapping[Any, int], requires: Mapping[Any, Iterable[Any]]
) -> tuple[int, set]:
    """The largest total weight of a set closed under ``requires`` (x in the set => each of
    ``requires[x]`` in it), and one such set; by minimum cut (Picard 1976)."""
    positive = sum(w for w in weights.values() if w > 0)
    if positive == 0:
        return 0, set()
    source, sink, infinite = object(), object(), positive + 1
    capacity: dict[Any, dict[Any, int]] = collections.defaultdict(dict)
    for node, weight in weights.items():
        if weight > 0:
            capacity[source][node] = weight
        elif weight < 0:
            capacity[node][sink] = -weight
        for needed in requires.get(node, ()):
            capacity[node][needed] = infinite
    flow = 0
    while True:  # Edmonds-Karp: the graphs here have a few dozen nodes
        parent = {source: None}
        queue = collections.deque([source])
        while queue and sink not in parent:
            u = queue.popleft()
            for v, c in capacity[u].items():
                if c > 0 and v not in parent:
                    parent[v] = u
                    queue.append(v)
        if sink not in parent:
            break
        path, v = [], sink
        while parent[v] is not None:
            path.append((parent[v], v))
            v = parent[v]
        push = min(capacity[u][v] for u, v in path)
        for u, v in path:
            capacity[u][v] -= push
            capacity[v][u] = capacity[v].get(u, 0) + push
        flow += push
    chosen = {n for n in parent if n is not source and n is not sink}
    return positive - flow, chosen


def build_order(model_stage: str) -> tuple[bool, str]:
    """The order engines build new derived units in: by model-stage name, generation's last (a
    generation unit can join a running stage once built, so the units a step must wait for come
    first). A model-stage's units share no slot, so their order among themselves is free."""
    return (model_stage.endswith("@generation"), model_stage)


def in_build_order(keys):
    """(model-stage, slots) keys in ``build_order``, a model-stage's in slot order."""
    return sorted(keys, key=lambda key: (build_order(key[0]), key[1]))


def joining_units(generating, new, sources):
    """Of the new derived units ``new`` ((model-stage, slots)), those that build while a step
    generates on the generation units that are built (on the slots ``generating``): the ones
    off those slots. The generating units take their weights from a training unit off the
    building slots, so one of ``sources`` (the training units' slots, if any) must be; else
    nothing joins. The one rule the compiler prices and the Ray job follows."""
    generating = set(generating)
    if not generating:
        return frozenset()
    joining = frozenset(key for key in new if not generating.intersection(key[1]))
    building = {s for _, unit in joining for s in unit}
    sources = list(sources)
    if sources and all(building.intersection(slots) for slots in sources):
        return frozenset()
    return joining


class TransitionDag:
    """Nodes keyed by id (in creation order), edges with their kind (``data`` or ``resource``)."""

    def __init__(
        self,
        *,
        nodes: Iterable[Node],
        edges: Iterable[tuple[str, str]],
        initial: list[int],
        capacity: list[float],
        current: Mapping[str, tuple[Unit, ...]],
        target: Mapping[str, tuple[Unit, ...]],
        refused: tuple[str, ...] = (),
    ):
        self.nodes: dict[str, Node] = {n.node_id: n for n in nodes}
        self.edges: dict[tuple[str, str], str] = {}
        self.initial = list(initial)
        self.capacity = list(capacity)
        self.current = dict(current)
        self.target = dict(target)
        """Each model-stage's units once the transition is done."""
        self.predicted_makespan_s: float | None = None
        self.rebuilds: dict[str, float] = {}
        """Derived model-stages with new units (a new layout, or new placements): the seconds
        building one of their units takes (they move no state, so they are not nodes)."""
        self.rebuild_units: dict[str, tuple[tuple[int, ...], ...]] = {}
        """For each model-stage in ``rebuilds``, its new units' slots. Engines build them in
        ``build_order``, every slot at once, each unit as soon as all its slots are free (its
        members build it together)."""
        self.ahead: frozenset[tuple[str, tuple[int, ...]]] = frozenset()
        """(model-stage, slots) of the new derived units on slots the running plan leaves idle
        (a granted slot, say): an engine can build them while the job still steps."""
        self.built_ahead: frozenset[tuple[str, tuple[int, ...]]] = frozenset()
        """Those of ``ahead`` that were built before the transition runs: ``predicted_s`` and
        ``rebuild_makespan`` no longer charge them."""
        self.generating: frozenset[int] = frozenset()
        """Slots of the generation units the transition keeps in place (built, so the first
        step can generate on them); see ``joining``."""
        self.joining_s = 0.0
        """What the first step on the target loses while ``joining`` builds: its generation on
        the ready units (or the builds, if longer) against generation on all of them. Set by
        whoever prices plans (the controller); part of ``cost_s``."""
        for a, b in edges:
            self.add_edge(a, b, "data")

    # --- structure ------------------------------------------------------------------------------

    def add_edge(self, before: str, after: str, kind: str) -> None:
        if before not in self.nodes or after not in self.nodes:
            raise KeyError(f"edge: {before} -> {after} names an unknown node")
        if before == after:
            raise ValueError(f"edge: {before} -> {after} is a loop")
        self.edges.setdefault((before, after), kind)
        self._reach = None

    def preds(self, node_id: str) -> list[str]:
        return [a for (a, b) in self.edges if b == node_id]

    def succs(self, node_id: str) -> list[str]:
        return [b for (a, b) in self.edges if a == node_id]

    def topological_order(self) -> list[str]:
        """Kahn's order; raises ValueError on a cycle."""
        indegree = {n: 0 for n in self.nodes}
        out: dict[str, list[str]] = {n: [] for n in self.nodes}
        for a, b in self.edges:
            indegree[b] += 1
            out[a].append(b)
        ready = [n for n in self.nodes if indegree[n] == 0]
        order = []
        while ready:
            n = ready.pop(0)
            order.append(n)
            for m in out[n]:
                indegree[m] -= 1
                if indegree[m] == 0:
                    ready.append(m)
        if len(order) != len(self.nodes):
            stuck = sorted(n for n, d in indegree.items() if d)
            raise ValueError(f"edges: cycle through {', '.join(stuck[:4])}")
        return order

    def ancestors(self) -> dict[str, int]:
        """Every node's ancestors as a bitmask over node indices (cached until an edge is added)."""
        if getattr(self, "_reach", None) is None:
            index = {n: i for i, n in enumerate(self.nodes)}
            preds: dict[str, list[str]] = {n: [] for n in self.nodes}
            for a, b in self.edges:
                preds[b].append(a)
            reach: dict[str, int] = {}
            for n in self.topological_order():
                mask = 0
                for p in preds[n]:
                    mask |= reach[p] | (1 << index[p])
                reach[n] = mask
            self._reach = (index, reach)
        return self._reach[1]

    def is_ancestor(self, a: str, b: str) -> bool:
        """Whether ``a`` must finish before ``b`` can start."""
        reach = self.ancestors()
        return bool(reach[b] >> self._reach[0][a] & 1)

    def critical_path(self) -> tuple[float, list[str]]:
        """The longest chain of predicted seconds: the transition's predicted duration."""
        best: dict[str, tuple[float, str | None]] = {}
        preds: dict[str, list[str]] = {n: [] for n in self.nodes}
        for a, b in self.edges:
            preds[b].append(a)
        for n in self.topological_order():
            before = max(((best[p][0], p) for p in preds[n]), default=(0.0, None))
            best[n] = (before[0] + self.nodes[n].predicted_s, before[1])
        if not best:
            return 0.0, []
        end = max(best, key=lambda n: best[n][0])
        path, cursor = [], end
        while cursor is not None:
            path.append(cursor)
            cursor = best[cursor][1]
        return best[end][0], path[::-1]

    def remaining_path(self) -> dict[str, float]:
        """Per node: predicted seconds from its start to the end of the longest chain after it."""
        succs: dict[str, list[str]] = {n: [] for n in self.nodes}
        for a, b in self.edges:
            succs[a].append(b)
        out: dict[str, float] = {}
        for n in reversed(self.topological_order()):
            after = max((out[m] for m in succs[n]), default=0.0)
            out[n] = self.nodes[n].predicted_s + after
        return out

    def priority(self) -> dict[str, tuple]:
        """The executor's order among ready nodes: releasing nodes first, then generation →
        inference → training, then the longest remaining chain, then creation order."""
        remaining = self.remaining_path()
        return {
            n: (
                0 if node.releasing else 1,
                STAGE_ORDER.get(node.stage, 3),
                -remaining[n],
                i,
            )
            for i, (n, node) in enumerate(self.nodes.items())
        }

    @property
    def joining(self) -> frozenset[tuple[str, tuple[int, ...]]]:
        """``joining_for(built_ahead)``."""
        return self.joining_for(self.built_ahead)

    def joining_for(self, built) -> frozenset[tuple[str, tuple[int, ...]]]:
        """(model-stage, slots) of the new derived units the transition does not wait for when
        ``built`` were built ahead (a transition waits for those: the Ray engine makes its
        groups collectively on every slot, so builds started ahead end first). The first step
        generates on the generation units kept in place (else on those built ahead) while these
        build on other slots: new generation units join once built, and the inference stage
        waits for whatever is still building. The generation units take their weights from a
        training unit off those slots, so there must be one (else nothing joins).
        ``rebuild_makespan`` does not charge them; ``joining_s`` does."""
        generating = self.generating or {
            s for name, unit in built if name.endswith("@generation") for s in unit
        }
        new = [(n, u) for n, us in self.rebuild_units.items() for u in us if (n, u) not in built]
        sources = [u.slots for u in self.target.get("actor@training", ())]
        return joining_units(generating, new, sources)

    @property
    def moving_s(self) -> float:
        """The predicted time of moving state: the executor's schedule on predicted durations
        when the compiler has played it out, else the critical path."""
        if self.predicted_makespan_s is not None:
            return self.predicted_makespan_s
        return self.critical_path()[0]

    @property
    def predicted_s(self) -> float:
        """The predicted transition time: moving state, then the rebuilds it waits for."""
        return self.moving_s + self.rebuild_makespan()

    @property
    def cost_s(self) -> float:
        """What the move costs the job: the transition, and what the first step on the target
        loses while the ``joining`` units build."""
        return self.predicted_s + self.joining_s

    def rebuild_makespan(
        self,
        seconds: dict[str, float] | None = None,
        *,
        skip: frozenset[tuple[str, tuple[int, ...]]] | None = None,
    ) -> float:
        """How long building the new derived units takes, played in the engines' order: a unit
        starts once every one of its slots is done with the units before it. ``seconds``
        overrides ``rebuilds`` (an engine's true per-unit times). Units in ``skip`` (by default
        ``built_ahead`` and ``joining``) are not charged."""
        return self._build_makespan(
            in_build_order((n, u) for n, us in self.rebuild_units.items() for u in us),
            self.rebuilds if seconds is None else seconds,
            skip=self.built_ahead | self.joining if skip is None else skip,
        )

    def ahead_makespan(self, seconds: dict[str, float] | None = None) -> float:
        """How long building the ``ahead`` units takes, in the same order, on their own."""
        return self.build_makespan(self.ahead, seconds)

    def build_makespan(self, units, seconds: dict[str, float] | None = None) -> float:
        """How long building ``units`` ((model-stage, slots)) takes, in the engines' order, on
        their own."""
        return self._build_makespan(
            in_build_order(units),
            self.rebuilds if seconds is None else seconds,
            skip=frozenset(),
        )

    @staticmethod
    def _build_makespan(units, seconds: dict[str, float], *, skip) -> float:
        free: dict[int, float] = {}
        for name, unit in units:  # one model-stage's units share no slot
            if (name, unit) in skip:
                continue
            done = max(free.get(s, 0.0) for s in unit) + seconds.get(name, 0.0)
            free.update(dict.fromkeys(unit, done))
        return max(free.values(), default=0.0)

    # --- memory ---------------------------------------------------------------------------------

    def touching(self, slot: int) -> list[str]:
        return [n for n, node in self.nodes.items() if slot in node.slots]

    def final_occupancy(self) -> list[int]:
        out = list(self.initial)
        for node in self.nodes.values():
            for slot in set(node.acquire) | set(node.release):
                out[slot] += node.delta(slot)
        return out

    def worst_case(self, slot: int) -> tuple[int, str | None, set[str]]:
        """The most bytes ``slot`` can hold in any state the executor can reach: (bytes, the node
        running on it then or None, the finished nodes that touch it then)."""
        relevant = self.touching(slot)
        reach = self.ancestors()
        index = self._reach[0]
        # Lists in node order, not sets: which of several equally full states the search finds
        # (and so which edge excludes it) must not depend on the interpreter's string hashing.
        anc = {n: [m for m in relevant if m != n and reach[n] >> index[m] & 1] for n in relevant}
        delta = {n: self.nodes[n].delta(slot) for n in relevant}
        base = self.initial[slot]
        value, chosen = max_closure(delta, anc)
        best = (base + value, None, chosen)
        for n in relevant:
            acquire = self.nodes[n].acquire.get(slot, 0)
            if acquire <= 0:
                continue
            forced = set(anc[n])
            excluded = {m for m in relevant if n in anc[m]} | {n}
            free = [m for m in relevant if m not in forced and m not in excluded]
            value, chosen = max_closure(
                {m: delta[m] for m in free}, {m: [x for x in anc[m] if x in free] for m in free}
            )
            total = base + sum(delta[m] for m in forced) + acquire + value
            if total > best[0]:
                best = (total, n, forced | chosen)
        return best

    def check_memory(self) -> None:
        """Raise ``MemoryUnsafeError`` naming the first slot some admitted order would overflow."""
        for slot in range(len(self.initial)):
            if not self.touching(slot):
                continue
            worst, running, _ = self.worst_case(slot)
            if worst > self.capacity[slot]:
                what = f" while {running} runs" if running else ""
                held, room = byte_sizes(worst, self.capacity[slot])
                raise MemoryUnsafeError(
                    f"slot {slot}: could hold {held}{what}, over its {room}",
                    slot=slot,
                    worst_bytes=worst,
                    capacity_bytes=self.capacity[slot],
                )

    # --- the form the web pages draw -------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        seconds, path = self.critical_path()
        worst = {}
        for slot in range(len(self.initial)):
            if self.touching(slot):
                worst[str(slot)] = self.worst_case(slot)[0]
        return {
            "nodes": [n.to_json() for n in self.nodes.values()],
            "edges": [{"from": a, "to": b, "kind": k} for (a, b), k in self.edges.items()],
            "critical_path": path,
            "critical_path_s": seconds,
            "predicted_s": self.predicted_s,
            "slots": {
                "capacity": self.capacity,
                "initial": self.initial,
                "final": self.final_occupancy(),
                "worst_case": worst,
            },
            "rebuilds": dict(self.rebuilds),
            "rebuild_units": {ms: [list(u) for u in us] for ms, us in self.rebuild_units.items()},
            "rebuild_s": self.rebuild_makespan(),
            "ahead": [{"model_stage": n, "slots": list(u)} for n, u in sorted(self.ahead)],
            "built_ahead": len(self.built_ahead),
            "joining": [{"model_stage": n, "slots": list(u)} for n, u in sorted(self.joining)],
            "joining_s": self.joining_s,
            "cost_s": self.cost_s,
            "target": {
                ms: [{"id": u.unit_id, "slots": list(u.slots)} for u in units]
                for ms, units in self.target.items()
            },
        }
