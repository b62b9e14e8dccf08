"""The Ray engine behind the engine interface: real units on slot actors, real transitions.

Units live on ``SlotPool`` actors through a ``UnitEngine``; transitions run through the DAG
executor; checkpoint/restart goes through torch.distributed.checkpoint (save every persistent
model-stage once, release everything, load into the new plan's layouts, which DCP reshards).
The step is the job's: a ``PpoRuntime`` (``runtime/ppo/job.py``) places its training units from
its initial weights and runs PPO's three stages on the plan's units. Without a job, units are
filled with reference values and the engine serves transitions and restarts only (the shared
interface tests and the transition benchmarks).
"""

from __future__ import annotations

import tempfile
import time
import zlib
from pathlib import Path

from runtime.emu import checkpoint
from runtime.emu.engine import IntegrityError, UnitEngine
from runtime.emu.primitives import Destroy
from runtime.engine.interface import StepReport, TransitionOutcome
from runtime.engine.slots import SlotPool
from runtime.planner.plan import Plan
from runtime.planner.workload import PpoWorkload
from runtime.transition.dag import TransitionDag
from runtime.transition.executor import Executor
from runtime.transition.units import Units, units_of


def state_seed(model_stage: str) -> int:
    """The deterministic initial state of a model-stage (every replica holds the same)."""
    return zlib.crc32(model_stage.encode()) & 0xFFFF


class RayEngine:
    kind = "ray"
    simulated = False

    def __init__(self, pool: SlotPool, *, checkpoint_dir: str | Path | None = None, job=None):
        self.engine = UnitEngine(pool)
        self.job = job
        """A ``PpoRuntime``, or None for an engine that only moves units."""
        self._t0 = time.monotonic()
        self._checkpoints = Path(checkpoint_dir or tempfile.mkdtemp(prefix="nereus-ckpt-"))
        self.events: list[dict] = []

    def now(self) -> float:
        return time.monotonic() - self._t0

    def pool_size(self) -> int:
        return self.engine.pool.num_slots

    def lost_slots(self) -> frozenset[int]:
        return frozenset(self.engine.lost_slots)

    def start(self, plan: Plan, workload: PpoWorkload) -> None:
        self._release_all()
        if self.job is not None:
            self.job.check_plan(plan, workload)
            self.job.place(self.engine, units_of(plan, workload))
            return
        for name, units in units_of(plan, workload).items():
            for unit in units:
                self.engine.create(unit, seed=state_seed(name))

    def units(self) -> Units:
        out: dict[str, list] = {}
        for unit in self.engine.units.values():
            out.setdefault(unit.model_stage, []).append(unit)
        return {name: tuple(sorted(us, key=lambda u: u.slots)) for name, us in out.items()}

    def step(self, plan: Plan, workload: PpoWorkload, step: int) -> StepReport:
        if self.job is None:
            raise RuntimeError("step: this engine has no job (RayEngine(pool, job=PpoRuntime))")
        return self.job.step(self.engine, plan, workload, step)

    def transition(self, dag: TransitionDag) -> TransitionOutcome:
        result = Executor(dag, self.engine, on_event=self.events.append).run()
        failure = "" if result.ok else f"nodes {result.failed} failed"
        return TransitionOutcome(
            ok=result.ok,
            seconds=result.duration_s,
            units=result.units,
            lost_slots=tuple(result.lost_slots),
            failure=failure,
        )

    def restart(self, plan: Plan, workload: PpoWorkload) -> float:
        """Save one replica of each persistent model-stage with DCP, release every unit, load
        the new plan's units from the checkpoint (resharded by DCP)."""
        if self.engine.lost_slots:
            raise RuntimeError(
                "restart: slots are lost; a new slot pool is needed (the job driver makes one)"
            )
        started = time.monotonic()
        held = self.units()
        targets = units_of(plan, workload)
        pool = self.engine.pool
        every = [u for us in held.values() for u in us] + [u for us in targets.values() for u in us]
        pool.run(checkpoint.ensure_unit_groups, units=every)
        saved, expected = {}, {}
        for name, units in held.items():
            path = self._checkpoints / name.replace("@", "_")
            pool.run(checkpoint.save_unit, on=units[0].slots, unit=units[0], path=str(path))
            saved[name], expected[name] = path, self.engine.checksum(units[0])
        self._release_all()
        for name, units in targets.items():
            for unit in units:
                pool.run(checkpoint.load_unit, on=unit.slots, unit=unit, path=str(saved[name]))
                self.engine.units[unit.unit_id] = unit
                got = self.engine.checksum(unit)
                if got != expected[name]:
                    raise IntegrityError(
                        f"restart: {unit.unit_id} loaded checksum {got:#x} != saved "
                        f"{expected[name]:#x}"
                    )
                self.engine.verified[unit.unit_id] = got
        return time.monotonic() - started

    def stop(self) -> None:
        """Free the job's units and workspaces; the pool stays for another job."""
        self._release_all()
        if self.job is not None:
            self.job.release(self.engine)

    def _release_all(self) -> None:
        for unit in list(self.engine.units.values()):
            self.engine.destroy(Destroy(unit=unit))
