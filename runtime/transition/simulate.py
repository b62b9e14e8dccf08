"""Run a transition DAG against its memory model in simulated time (no slots, no tensors).

Used by the property tests (every order the executor may pick must stay within capacity and end
with exactly the target units) and by ``benchmarks/transition_overlap.py`` (the coordinated DAG
against per-component migration). Durations are the nodes' predicted seconds, optionally jittered,
so every figure it produces is simulated.

Policies:

- ``coordinated``: every edge, releasing nodes first, generation → inference → training.
- ``per_component``: each model-stage migrates on its own, as frameworks without a global view
  do: data edges only, no release priority (ready nodes start in a random interleaving). A node
  whose acquisition does not fit fails the transition (``on_oom="fail"``, a device OOM) or waits
  for memory to come back (``on_oom="wait"``), which fails only when nothing can move.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from runtime.emu.primitives import Destroy, Extend, Merge, Split
from runtime.transition.dag import Node, TransitionDag


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SimulationResult:
    ok: bool
    reason: str
    makespan_s: float
    """Simulated seconds until the last node finished (or the failure)."""
    peak: list[int]
    """Most bytes each slot held at any moment."""
    order: list[str]
    """Nodes in the order they started."""


class SemanticError(AssertionError):
    """The DAG used a unit that did not exist or did not end with the target units (a bug)."""


def _uses(node) -> list[str]:
    p = node.primitive
    if isinstance(p, Split | Destroy):
        return [p.unit.unit_id]
    if isinstance(p, Extend):
        return [p.source.unit_id]
    if isinstance(p, Merge):
        return [u.unit_id for u in p.units]
    raise TypeError(p)


def simulate(
    dag: TransitionDag,
    *,
    policy: str = "coordinated",
    on_oom: str = "fail",
    rng: random.Random | None = None,
    jitter: float = 0.0,
    random_order: bool = False,
    durations: Callable[[Node], float] | None = None,
) -> SimulationResult:
    """Run ``dag`` once; ``random_order`` lets the coordinated policy pick any ready node (to test
    that every order it may pick is safe), ``jitter`` scales each duration by up to ±that, and
    ``durations`` replaces the predicted seconds (the simulated engine's true model)."""
    if policy not in ("coordinated", "per_component"):
        raise ValueError(f"policy: expected 'coordinated' or 'per_component', got {policy!r}")
    if on_oom not in ("fail", "wait"):
        raise ValueError(f"on_oom: expected 'fail' or 'wait', got {on_oom!r}")
    rng = rng or random.Random(0)
    edges = [e for e, kind in dag.edges.items() if policy == "coordinated" or kind == "data"]
    preds: dict[str, set[str]] = {n: set() for n in dag.nodes}
    for a, b in edges:
        preds[b].add(a)
    priority = dag.priority()
    live = {u.unit_id for units in dag.current.values() for u in units}
    occupancy = list(dag.initial)
    peak = list(occupancy)
    busy: set[int] = set()
    running: dict[str, float] = {}
    done: set[str] = set()
    order: list[str] = []
    now = 0.0

    def fail(reason: str) -> SimulationResult:
        return SimulationResult(ok=False, reason=reason, makespan_s=now, peak=peak, order=order)

    while len(done) < len(dag.nodes):
        ready = [n for n in dag.nodes if n not in done and n not in running and preds[n] <= done]
        if policy == "coordinated" and not random_order:
            ready.sort(key=priority.__getitem__)
        else:
            rng.shuffle(ready)
        for n in ready:
            node = dag.nodes[n]
            if busy & set(node.slots):
                continue
            over = [s for s, b in node.acquire.items() if occupancy[s] + b > dag.capacity[s]]
            if over:
                if policy == "coordinated":
                    return fail(f"memory check violated: {n} overflows slot {over[0]}")
                if on_oom == "fail":
                    return fail(f"out of memory: {n} on slot {over[0]}")
                continue
            missing = [u for u in _uses(node) if u not in live]
            if missing:
                raise SemanticError(f"{n} uses {missing[0]}, which does not exist then")
            for s, b in node.acquire.items():
                occupancy[s] += b
                peak[s] = max(peak[s], occupancy[s])
            busy |= set(node.slots)
            scale = 1.0 + (rng.uniform(-jitter, jitter) if jitter else 0.0)
            seconds = node.predicted_s if durations is None else durations(node)
            running[n] = now + seconds * scale
            order.append(n)
        if not running:
            blocked = sorted(set(dag.nodes) - done)
            return fail(f"deadlock: {len(blocked)} nodes cannot start ({blocked[0]}, ...)")
        n = min(running, key=lambda m: (running[m], m))
        now = running.pop(n)
        node = dag.nodes[n]
        for s, b in node.release.items():
            occupancy[s] -= b
        busy -= set(node.slots)
        done.add(n)
        live -= set(node.consumes)
        live |= {u.unit_id for u in node.produces}
    expected = {u.unit_id for units in dag.target.values() for u in units}
    if live != expected:
        raise SemanticError(
            f"ended with units {sorted(live ^ expected)[:4]} differing from the target"
        )
    return SimulationResult(ok=True, reason="", makespan_s=now, peak=peak, order=order)
