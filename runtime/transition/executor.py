"""Run a compiled transition DAG on a ``UnitEngine``: ready nodes concurrently, releasing first.

Before the first primitive, every process group the DAG needs is created in one collective step
over the pool (creating a torch.distributed group involves every rank, so it cannot happen while
some slots are busy in a primitive). Then a node starts when its predecessors are done and none
of its slots is busy with another node; among ready nodes the DAG's priority decides. Each node
state change is an event. On a failure no further node starts; running nodes finish, the rest are
``skipped``, and the result lists the units that are intact (every slot alive, verified) so that
the controller can replan from them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from runtime.emu.engine import UnitEngine
from runtime.emu.primitives import Destroy, Extend, Merge, Split, Unit
from runtime.engine.slots import SlotError
from runtime.planner.calibration import Calibrator
from runtime.transition.dag import Node, TransitionDag

logger = logging.getLogger(__name__)

Event = dict[str, Any]


@dataclasses.dataclass(kw_only=True, slots=True)
class ExecutionResult:
    ok: bool
    duration_s: float
    units: dict[str, tuple[Unit, ...]]
    """Each model-stage's intact units now: the target's when ``ok``."""
    failed: list[str]
    lost_slots: list[int]
    group_setup_s: float
    groups_created: int
    events: list[Event]
    error: str = ""
    """Why the transition failed before any node ran (its group set-up), if it did."""


class Executor:
    """Runs one DAG once."""

    def __init__(
        self,
        dag: TransitionDag,
        engine: UnitEngine,
        *,
        on_event: Callable[[Event], None] | None = None,
        calibrator: Calibrator | None = None,
        max_concurrency: int | None = None,
    ):
        self.dag = dag
        self.engine = engine
        self.on_event = on_event
        self.calibrator = calibrator
        self.max_concurrency = max_concurrency or max(1, engine.pool.num_slots)
        self.events: list[Event] = []
        self._t0 = 0.0

    def run(self) -> ExecutionResult:
        self._preflight()
        self._t0 = time.monotonic()
        try:
            setup = self.engine.prepare_groups(_groups(self.dag))
        except SlotError as exc:
            # A slot died (or failed) since the last probe: nothing ran; the controller replans
            # from the units that are intact.
            return self._failed_setup(exc)
        self._emit(
            {"event": "transition.groups", "created": setup["created"], "seconds": setup["seconds"]}
        )
        preds: dict[str, set[str]] = {n: set() for n in self.dag.nodes}
        for a, b in self.dag.edges:
            preds[b].add(a)
        priority = self.dag.priority()
        done: set[str] = set()
        failed: list[str] = []
        running: dict[concurrent.futures.Future, str] = {}
        busy: set[int] = set()
        for node in self.dag.nodes.values():
            self._emit_node(node)
        with concurrent.futures.ThreadPoolExecutor(
            max_workers=self.max_concurrency, thread_name_prefix="transition"
        ) as pool:
            while True:
                if not failed:
                    ready = sorted(
                        (
                            n
                            for n, node in self.dag.nodes.items()
                            if node.state == "pending" and preds[n] <= done
                        ),
                        key=priority.__getitem__,
                    )
                    for n in ready:
                        node = self.dag.nodes[n]
                        if busy & set(node.slots) or len(running) >= self.max_concurrency:
                            continue
                        busy |= set(node.slots)
                        node.state, node.started_s = "running", self._now()
                        self._emit_node(node)
                        running[pool.submit(self._execute, node)] = n
                if not running:
                    break
                finished, _ = concurrent.futures.wait(
                    running, return_when=concurrent.futures.FIRST_COMPLETED
                )
                for future in finished:
                    node = self.dag.nodes[running.pop(future)]
                    busy -= set(node.slots)
                    node.finished_s = self._now()
                    error = future.exception()
                    if error is None:
                        node.state = "done"
                        done.add(node.node_id)
                        self._calibrate(node)
                    else:
                        node.state, node.error = "failed", f"{type(error).__name__}: {error}"
                        failed.append(node.node_id)
                        logger.warning("transition node %s failed: %s", node.node_id, error)
                    self._emit_node(node)
        for node in self.dag.nodes.values():
            if node.state == "pending":
                node.state = "skipped"
                self._emit_node(node)
        lost = self._lost_slots() if failed else []
        units = self._intact_units(lost)
        # The slots' buffer arenas sped up this transition; the next step allocates outside the
        # units, so the memory goes back now (the DAG's memory check never counted it).
        cached = self._empty_cache()
        result = ExecutionResult(
            ok=not failed,
            duration_s=self._now(),
            units=units,
            failed=failed,
            lost_slots=lost,
            group_setup_s=setup["seconds"],
            groups_created=setup["created"],
            events=self.events,
        )
        self._emit(
            {
                "event": "transition.finished",
                "ok": result.ok,
                "duration_s": result.duration_s,
                "predicted_s": self.dag.predicted_s,
                "failed": failed,
                "lost_slots": lost,
                "cache_released_bytes": cached,
            }
        )
        return result

    def _failed_setup(self, exc: SlotError) -> ExecutionResult:
        logger.warning("transition group set-up failed: %s", exc)
        for node in self.dag.nodes.values():
            node.state = "skipped"
            self._emit_node(node)
        lost = self._lost_slots()
        error = f"group set-up failed: {exc}"
        result = ExecutionResult(
            ok=False,
            duration_s=self._now(),
            units=self._intact_units(lost),
            failed=[],
            lost_slots=lost,
            group_setup_s=self._now(),
            groups_created=0,
            events=self.events,
            error=error,
        )
        self._emit(
            {
                "event": "transition.finished",
                "ok": False,
                "duration_s": result.duration_s,
                "predicted_s": self.dag.predicted_s,
                "failed": [],
                "lost_slots": lost,
                "error": error,
                "cache_released_bytes": 0,
            }
        )
        return result

    # --- one node -------------------------------------------------------------------------------

    def _execute(self, node: Node) -> None:
        p = node.primitive
        if isinstance(p, Split):
            produced, report = self.engine.split(p)
        elif isinstance(p, Merge):
            unit, report = self.engine.merge(p)
            produced = [unit]
        elif isinstance(p, Extend):
            unit, report = self.engine.extend(p)
            produced = [unit]
        elif isinstance(p, Destroy):
            report, produced = self.engine.destroy(p), []
        else:
            raise TypeError(f"node {node.node_id}: not a primitive")
        if [u.unit_id for u in produced] != [u.unit_id for u in node.produces]:
            raise RuntimeError(f"node {node.node_id}: produced {produced}, planned {node.produces}")
        node.actual_bytes = report.bytes_moved

    def _calibrate(self, node: Node) -> None:
        """Feed the node's measured time back: one sample of the classes it ran."""
        if self.calibrator is None or (sample := node.sample()) is None:
            return
        try:
            self.calibrator.observe_sample(sample)
        except ValueError as exc:  # an implausible sample is dropped, never fatal
            logger.info("calibration sample dropped: %s", exc)

    # --- state ----------------------------------------------------------------------------------

    def _preflight(self) -> None:
        """Every current unit must exist on the engine as the DAG assumes."""
        for units in self.dag.current.values():
            for unit in units:
                if set(unit.slots) & self.engine.lost_slots:
                    continue
                if self.engine.units.get(unit.unit_id) != unit:
                    raise RuntimeError(
                        f"current: unit {unit.unit_id} is not on the engine as the DAG expects"
                    )

    def _empty_cache(self) -> int:
        touched = {s for node in self.dag.nodes.values() for s in node.slots}
        try:
            return self.engine.empty_cache(sorted(touched))
        except SlotError as exc:  # a slot that died with its cache; the failure is reported
            logger.warning("emptying the slots' buffer caches failed: %s", exc)
            return 0

    def _lost_slots(self) -> list[int]:
        alive = self.engine.pool.alive()
        lost = [slot for slot, ok in enumerate(alive) if not ok]
        self.engine.lost_slots.update(lost)
        return lost

    def _intact_units(self, lost: list[int]) -> dict[str, tuple[Unit, ...]]:
        """The units no lost slot touches (lost now or before: a revoked slot's units stay
        registered until a transition releases them)."""
        gone = set(lost) | self.engine.lost_slots
        out: dict[str, list[Unit]] = {ms: [] for ms in self.dag.target}
        for unit in self.engine.units.values():
            if unit.model_stage in out and not set(unit.slots) & gone:
                out[unit.model_stage].append(unit)
        return {ms: tuple(sorted(us, key=lambda u: u.slots)) for ms, us in out.items()}

    def _now(self) -> float:
        return time.monotonic() - self._t0

    def _emit_node(self, node: Node) -> None:
        self._emit(
            {
                "event": "transition.node",
                "node": node.node_id,
                "kind": node.kind,
                "model_stage": node.model_stage,
                "state": node.state,
                "t": self._now(),
                "predicted_s": node.predicted_s,
                "actual_s": node.actual_s,
                "bytes": node.actual_bytes,
                "error": node.error,
            }
        )

    def _emit(self, event: Event) -> None:
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)


def _groups(dag: TransitionDag) -> list[tuple[int, ...]]:
    groups: set[tuple[int, ...]] = set()
    for node in dag.nodes.values():
        p = node.primitive
        if isinstance(p, Split):
            groups.update(tuple(sorted(g)) for g in p.peer_groups())
        elif isinstance(p, Extend):
            groups.update(tuple(sorted(g)) for g in p.broadcast_groups() if g[0] != g[1])
    return sorted(groups)
