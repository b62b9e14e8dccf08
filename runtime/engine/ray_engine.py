"""The Ray engine behind the engine interface: real units on slot actors, real transitions.

Units live on ``SlotPool`` actors through a ``UnitEngine``; transitions run through the DAG
executor; checkpoint/restart goes through torch.distributed.checkpoint (save every persistent
model-stage once, release everything, load into the new plan's layouts, which DCP reshards).
The step is the job's: a ``PpoRuntime`` (``runtime/ppo/job.py``) places its training units from
its initial weights and runs PPO's three stages on the plan's units. Without a job, units are
filled with reference values and the engine serves transitions and restarts only (the shared
interface tests and the transition benchmarks).

The pool moves as a cluster's does. The job may use the first ``pool_size()`` slots; ``revoke``
takes the highest one away (its process is killed, as a reclaimed spot GPU's would be) and ``grant``
gives one (back); ``resize`` is an operator's change of the pool, a shrink announced ahead included
(the slots to go keep their state until the job is off them, or a deadline). A slot whose process
died, revoked or failed, is found before the controller next asks (``lost_slots``): a communicator
that lost a member cannot be used again, so the engine re-forms the group on new processes
(``SlotPool.renew``), carrying the intact units over; the dead slot counts as lost (it holds
nothing) until a restart places units again or a grant gives it back.
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
import time
import uuid
import zlib
from collections.abc import Sequence
from pathlib import Path

from ray import exceptions as ray_exceptions

from runtime.emu import checkpoint, slot_ops
from runtime.emu.checkpoint import UnusableCheckpointError
from runtime.emu.engine import _POOL_GROUPS, IntegrityError, UnitEngine
from runtime.emu.primitives import Destroy
from runtime.engine.interface import ProbeReport, StepReport, TransitionOutcome
from runtime.engine.slots import SlotError, SlotPool
from runtime.planner.plan import Plan
from runtime.planner.probes import Probe, check_probes
from runtime.planner.workload import PpoWorkload
from runtime.transition.dag import TransitionDag
from runtime.transition.executor import Executor
from runtime.transition.units import Units, persists, units_not_held, units_of

logger = logging.getLogger(__name__)

RESTART_ATTEMPTS = 3
"""How many times a restart loads its units when slots die while it does."""


def _slots_of(plan: Plan) -> frozenset[int]:
    return frozenset(s for ms in plan.model_stages for s in ms.slots)


def state_seed(model_stage: str) -> int:
    """The deterministic initial state of a model-stage (every replica holds the same)."""
    return zlib.crc32(model_stage.encode()) & 0xFFFF


class RayEngine:
    kind = "ray"
    simulated = False

    def __init__(
        self,
        pool: SlotPool,
        *,
        checkpoint_dir: str | Path | None = None,
        job=None,
        pool_size: int | None = None,
    ):
        self.engine = UnitEngine(pool)
        self.job = job
        """A ``PpoRuntime``, or None for an engine that only moves units."""
        self.visible = pool.num_slots if pool_size is None else pool_size
        if not 1 <= self.visible <= pool.num_slots:
            raise ValueError(f"pool_size: must be in [1, {pool.num_slots}], got {pool_size}")
        self._t0 = time.monotonic()
        self._checkpoints = Path(checkpoint_dir or tempfile.mkdtemp(prefix="nereus-ckpt-"))
        self.events: list[dict] = []
        self.on_event = None
        """Called with each event as it happens (a transition's nodes live, slots lost)."""
        self._renewing: dict | None = None
        """A re-forming of the group that has not succeeded yet: ``lost`` (the slots whose state
        is gone for good) and ``kept`` (the intact units' shards, held on the driver until the
        new processes take them back). While it is pending every slot counts as lost."""
        self._reclaims: dict[int, float] = {}
        """Slots beyond the pool whose reclaiming was announced (``resize`` with a notice), each
        with its deadline in engine seconds: they hold their state, and can be moved off, until
        then."""
        self._in_use: frozenset[int] = frozenset()
        """The slots of the plan the job last started, stepped or restarted on (after a
        transition, until the next step: the plan it left)."""
        self._rebuild = {"generation": 1.0, "inference": 0.5}
        """Seconds one new unit of each derived stage takes to build (groups, modules,
        workspaces): learned from the builds the job reports, first step included."""
        self.started_from = 0
        """The job's step this engine started it at: that of the checkpoint it resumed from
        (not always the newest: one that cannot be loaded is passed over), or 0."""

    @property
    def rebuild_s(self) -> tuple[tuple[str, float], ...]:
        """What the transition compiler should charge for building a new unit of each stage."""
        return tuple(sorted(self._rebuild.items()))

    def _learn_rebuild(self, report: StepReport) -> None:
        for stage, seconds in report.rebuild_seconds.items():
            if stage in self._rebuild:
                self._rebuild[stage] = 0.5 * self._rebuild[stage] + 0.5 * seconds

    def now(self) -> float:
        return time.monotonic() - self._t0

    def pool_size(self) -> int:
        return self.visible

    def lost_slots(self) -> frozenset[int]:
        self._settle_reclaims()
        self._probe()  # one small call per slot: a process may die at any moment
        return frozenset(self.engine.lost_slots)

    # --- the pool moving --------------------------------------------------------------------------

    def revoke(self) -> int:
        """Reclaim the highest slot the job may use: its process is killed with its state."""
        if self.visible <= 1:
            raise ValueError("revoke: the job's last slot cannot be taken")
        self.visible -= 1
        self._take(self.visible)
        self._event({"event": "engine.revoked", "slot": self.visible})
        return self.visible

    def _take(self, slot: int) -> None:
        """End ``slot``'s process, whatever it holds (the next probe re-forms the group)."""
        self.engine.pool.kill(slot)
        if self._renewing is not None:
            # A re-form is pending (no probe runs until it succeeds): the slot is lost with
            # it, and the shards carried over for units on it have nowhere to go back to.
            self._renewing["lost"].add(slot)
            self._renewing["kept"] = {
                unit_id: held
                for unit_id, held in self._renewing["kept"].items()
                if slot not in held[0].slots
            }

    def resize(self, slots: int, *, notice_s: float = 0.0) -> str:
        """Make the job's pool ``slots`` (an operator's or a cluster scheduler's change); returns
        what changed, in words.

        Growing grants slots; one whose reclaiming was announced is kept instead, with what it
        holds. Shrinking without notice takes the slots at once, their processes killed with
        their state (``revoke``). With ``notice_s``, ``pool_size`` reports the smaller pool at
        once while the slots to go live on: the controller moves the job off them before its
        next step, using what they hold, and each is released as soon as nothing the job runs
        is on it (``_settle_reclaims``), or taken, state and all, once its deadline has passed.
        Both are settled whenever the engine is asked for its lost slots (before every step);
        a deadline that passes during a step takes its slot when the step ends."""
        num = self.engine.pool.num_slots
        if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= num:
            raise ValueError(f"slots: expected a whole number from 1 to {num}, got {slots!r}")
        if (
            isinstance(notice_s, bool)
            or not isinstance(notice_s, int | float)
            or not math.isfinite(notice_s)
            or notice_s < 0
        ):
            raise ValueError(f"notice_s: expected a number of seconds >= 0, got {notice_s!r}")
        before = self.visible
        if slots > before:
            given = [self.grant() for _ in range(slots - before)]
            return f"pool {before} -> {slots} slots: slots {given} given"
        if slots == before:
            return f"pool stays at {slots} slots"
        if notice_s == 0:
            taken = sorted(self.revoke() for _ in range(before - slots))
            return f"pool {before} -> {slots} slots: slots {taken} taken at once"
        going = list(range(slots, before))
        deadline = self.now() + notice_s
        self._reclaims.update(dict.fromkeys(going, deadline))
        self.visible = slots
        self._event({"event": "engine.reclaim_announced", "slots": going, "notice_s": notice_s})
        return (
            f"pool {before} -> {slots} slots: slots {going} released once the job is off them, "
            f"taken in {notice_s:g} s at the latest"
        )

    def _settle_reclaims(self) -> None:
        """Release each announced slot nothing the job runs is on any more, and take each whose
        deadline has passed while something still is, with what it holds (as ``revoke``).

        A released slot's process lives on as an idle member of the job's group (the group is
        made over every process of the pool, and its workspaces are dropped at the job's next
        step like any unused slot's): ending it would make the group be re-formed on new
        processes, and a Ray placement group reserves its ``max_slots`` whole anyway, until the
        job ends or the cluster takes the node."""
        now = self.now()
        for slot, deadline in sorted(self._reclaims.items()):
            held = slot in self._in_use or any(
                slot in unit.slots for unit in self.engine.units.values()
            )
            if held and now < deadline:
                continue
            del self._reclaims[slot]
            if held:
                self._take(slot)
            self._event({"event": "engine.reclaimed" if held else "engine.released", "slot": slot})

    def grant(self) -> int:
        """One more slot for the job (a revoked one comes back empty)."""
        if self.visible >= self.engine.pool.num_slots:
            raise ValueError(f"grant: all {self.engine.pool.num_slots} slots are in use already")
        slot = self.visible
        announced = self._reclaims.pop(slot, None) is not None
        self.lost_slots()  # a killed process is replaced before the slot is handed out
        self.visible += 1
        lost = self._renewing["lost"] if self._renewing is not None else self.engine.lost_slots
        if announced and slot not in lost:
            # Announced for reclaiming but not taken yet: it stays, with what it holds.
            self._event({"event": "engine.reclaim_withdrawn", "slot": slot})
            return slot
        # The slot comes back empty: the units that named it are gone with its old process, and
        # must not look intact once it is no longer lost.
        for unit in [u for u in self.engine.units.values() if slot in u.slots]:
            self._forget(unit)
        self.engine.lost_slots.discard(slot)
        if self._renewing is not None:
            self._renewing["lost"].discard(slot)
        self._event({"event": "engine.granted", "slot": slot})
        return slot

    def _probe(self) -> bool:
        """Find slots whose process died; re-form the group on new processes, keeping the units
        that no lost slot touches. If the group cannot be re-formed (a slot's capacity went with
        it), the intact units' shards stay on the driver, every slot counts as lost, and the
        next probe tries again; nothing raises. Returns whether the group was re-formed."""
        # A dead process answers at once; a live one between steps within moments, even when
        # the machine is busy: the patience is for the latter (and one that stays silent is
        # busy, not dead, unless a call on it already ran past the call timeout: then it is
        # hung, and killed; see ``SlotPool.alive``).
        pool = self.engine.pool
        busy = self.job.building_ahead() if self.job is not None else frozenset()
        patience = min(30.0, pool.call_timeout_s)
        dead = []
        if self._renewing is None:  # else every process is replaced anyway
            alive = pool.alive(timeout_s=patience, busy=busy)
            dead = [i for i, ok in enumerate(alive) if not ok]
        if not dead and self._renewing is None:
            return False
        started = time.monotonic()
        if self._renewing is None:
            # A communicator that lost a member cannot be used again, and torch keeps
            # per-process state about the groups it made (names, meshes) that a re-initialised
            # process would carry over: every slot gets a new process. The intact units' shards
            # wait on the driver meanwhile (as they would in host memory on a GPU node).
            lost = set(dead) | self.engine.lost_slots
            kept = {}
            for unit in list(self.engine.units.values()):
                if set(unit.slots) & lost:
                    continue  # marked lost through its slots; the controller writes it off
                try:
                    shards = pool.run(slot_ops.read_unit, on=unit.slots, unit=unit)
                    kept[unit.unit_id] = (unit, shards)
                except (SlotError, KeyError) as exc:  # a unit no process holds is lost
                    logger.warning("%s: unreadable, counted as lost (%s)", unit.unit_id, exc)
                    self._forget(unit)
            self._renewing = {"lost": lost, "kept": kept}
        renewing = self._renewing
        renewing["lost"].update(dead)
        self.engine.lost_slots.update(renewing["lost"])
        try:
            pool.renew()
            for unit_id, (unit, shards) in renewing["kept"].items():
                if self.engine.units.get(unit_id) is not unit:
                    continue  # released or forgotten since it was read (a grant, a stop)
                pool.run(
                    slot_ops.install_unit,
                    [{"shards": held} for held in shards],
                    on=unit.slots,
                    unit=unit,
                )
        except (SlotError, ray_exceptions.RayError) as exc:
            # No process holds anything now: every slot counts as lost until a probe succeeds.
            self.engine.lost_slots.update(range(pool.num_slots))
            self._regrouped()
            self._event({"event": "engine.renew_failed", "slots": dead, "error": str(exc)})
            return False
        self._renewing = None
        self.engine.lost_slots.clear()
        self.engine.lost_slots.update(renewing["lost"])
        self._regrouped()
        seconds = time.monotonic() - started
        self._event({"event": "engine.slots_lost", "slots": dead, "reform_s": round(seconds, 3)})
        return True

    def _regrouped(self) -> None:
        self.engine._groups.clear()
        _POOL_GROUPS.pop(self.engine.pool, None)
        if self.job is not None:
            self.job.regrouped()

    def _forget(self, unit) -> None:
        """Unregister a unit whose state is gone (its slots' processes hold none of it)."""
        self.engine.units.pop(unit.unit_id, None)
        self.engine.verified.pop(unit.unit_id, None)

    # --- the interface ----------------------------------------------------------------------------

    def start(self, plan: Plan, workload: PpoWorkload) -> None:
        self._in_use = _slots_of(plan)
        self._release_all()
        if self.job is not None:
            self.job.check_plan(plan, workload)
            if self.job.last_checkpoint() is not None:
                # The job ran before (its driver was lost): go on from its last checkpoint.
                self.restart(plan, workload)
                self.started_from = self.job.state.next_step
                return
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
        self._in_use = _slots_of(plan)
        out = set(range(self.visible, self.engine.pool.num_slots)) - set(self._reclaims)
        gone = sorted(self._in_use & (set(self.lost_slots()) | out))
        if gone:
            return self._failed(step, f"slots {gone} are not in the pool")
        held = {u.model_stage for u in self.engine.units.values()}
        missing = sorted(
            ms.name for ms in workload.model_stages() if persists(ms) and ms.name not in held
        )
        if missing:  # a failed step took the state; only a restart brings it back
            return self._failed(step, f"{missing[0]}: no units hold its state")
        gone = units_not_held(plan, workload, self.units())
        if gone:  # a slot given back after a revocation came back empty: the controller
            # replans from the units that are left (the job would train on fewer replicas)
            name, unit = gone[0]
            return self._failed(step, f"{name}: the unit on slots {list(unit)} is gone")
        started = time.monotonic()
        try:
            report = self.job.step(self.engine, plan, workload, step)
            self._learn_rebuild(report)
            return report
        except SlotError as exc:
            # A call on a slot failed during the step: the slot died (the survivors'
            # collectives time out and the group is re-formed), or a function raised on a live
            # one (a disk full under a checkpoint). Outside the update, no unit's state is
            # between two steps: the units no lost slot touches are kept, and the controller
            # moves the job off the lost slots (if any) as after a failure between steps.
            # During the update, no unit's state can be trusted to be at a step boundary.
            probed = False
            try:
                self._probe()
                probed = True
            except Exception as probe_exc:  # the failed report must still come back
                logger.warning("probing the slots after a failed step failed: %s", probe_exc)
            kept = probed and not self.job.updating
            if not kept:
                self._release_all()
                self.job.lost_state()
            self._event(
                {"event": "engine.step_failed", "step": step, "error": str(exc), "kept": kept}
            )
            return self._failed(step, f"a slot failed during the step: {exc}", started)

    def _failed(self, step: int, why: str, started: float | None = None) -> StepReport:
        seconds = time.monotonic() - started if started is not None else 0.0
        return StepReport(step=step, ok=False, seconds=seconds, gen_len=0.0, failure=why)

    def transition(self, dag: TransitionDag) -> TransitionOutcome:
        if self.job is not None:
            # The executor makes groups on every slot: the builds started ahead end first.
            self.job.finish_ahead()
        result = Executor(dag, self.engine, on_event=self._event).run()
        failure = "" if result.ok else result.error or f"nodes {result.failed} failed"
        if result.lost_slots:
            # Re-form the group now, keeping the intact units; a failure here is retried later.
            try:
                self._probe()
            except Exception as exc:
                logger.warning("probing the slots after a transition failed: %s", exc)
        return TransitionOutcome(
            ok=result.ok,
            seconds=result.duration_s,
            units=result.units,
            lost_slots=tuple(result.lost_slots),
            failure=failure,
            samples=tuple(
                sample
                for node in dag.nodes.values()
                if node.state == "done" and (sample := node.sample()) is not None
            ),
        )

    def build_ahead(
        self, plan: Plan, workload: PpoWorkload, units: dict[str, tuple[tuple[int, ...], ...]]
    ) -> None:
        """The job starts the builds on their slots and returns; its next step runs on the
        others, and the first step that uses these slots waits for them. An engine without a job
        has no derived units to build."""
        if self.job is None:
            return
        try:
            started = self.job.build_ahead(self.engine, plan, workload, units)
        except SlotError as exc:
            # Nothing is lost: the transition builds what was not built ahead. A dead slot is
            # found by the probe before the next step.
            self._event({"event": "engine.building_ahead_failed", "error": str(exc)})
            return
        self._event({"event": "engine.building_ahead", "units": started})

    def drop_ahead(self) -> None:
        """The job frees the units built ahead at its first step after their builds end."""
        if self.job is not None:
            self.job.drop_ahead()

    def restart(self, plan: Plan, workload: PpoWorkload) -> float:
        """Checkpoint/restart onto ``plan``. Each persistent model-stage is saved with DCP from
        one intact unit, everything is released, and the new plan's units load it (DCP reshards).
        A model-stage with no intact unit left comes, with the job's own state, from the job's
        last committed checkpoint instead, and the job goes back to that step."""
        started = time.monotonic()
        self.lost_slots()
        self._in_use = _slots_of(plan)
        lost = self.engine.lost_slots
        held = {
            name: [u for u in units if not set(u.slots) & lost]
            for name, units in self.units().items()
        }
        targets = units_of(plan, workload)
        pool = self.engine.pool
        if self.job is not None:
            self.job.check_plan(plan, workload)
        sources: list = [None]  # None: the intact units, saved below
        if any(not held.get(name) for name in targets):
            if self.job is None:
                raise RuntimeError("restart: a model-stage has no intact unit and no checkpoint")
            sources = self.job.checkpoints()  # newest first
            if not sources:
                raise RuntimeError("restart: a model-stage has no intact unit and no checkpoint")
            held = {}
        intact = [u for us in held.values() for u in us[:1]]
        every = intact + [u for us in targets.values() for u in us]
        pool.run(checkpoint.ensure_unit_groups, units=every)  # collective over every slot
        saved, expected = {}, {}
        # A folder of this restart's own: another driver of the job (one being taken over) may
        # be restarting into the same job folder at the same moment.
        folder = self._checkpoints / uuid.uuid4().hex
        for name, units in held.items():
            path = folder / name.replace("@", "_")
            pool.run(checkpoint.save_unit, on=units[0].slots, unit=units[0], path=str(path))
            saved[name], expected[name] = path, self.engine.checksum(units[0])
        self._release_all()
        unusable = []
        for resume in sources:
            if resume is None:
                self._load(targets, saved, expected)
                break
            try:
                self.job.read_state(resume.state)  # whole, before any unit is touched
                paths = {name: resume.units[name] for name in targets}
                self._load(targets, paths, dict(resume.checksums))
                break
            except (UnusableCheckpointError, IntegrityError, SlotError) as exc:
                if isinstance(exc, SlotError) and not all(pool.alive()):
                    raise  # a slot died (``_load`` tried again): the checkpoint may be whole
                # Torn or altered since it was saved: the one before it, if any, is used.
                self._release_all()
                unusable.append(f"step {resume.step} ({exc})")
                self._event(
                    {
                        "event": "engine.checkpoint_unusable",
                        "step": resume.step,
                        "folder": str(resume.state.parent),
                        "error": str(exc)[:500],
                    }
                )
                logger.warning("checkpoint %s unusable: %s", resume.state.parent, exc)
        else:
            raise UnusableCheckpointError(
                f"restart: no committed checkpoint under {self.job.checkpoint_root} can be "
                f"loaded: {'; '.join(unusable)}"
            )
        shutil.rmtree(folder, ignore_errors=True)  # loaded and verified: no longer needed
        if resume is not None:
            self.job.resume(resume)
            self._event({"event": "engine.resumed", "step": resume.step})
        self.engine.lost_slots.clear()  # every unit was placed anew on live processes
        self._renewing = None
        if self.job is not None:
            self.job.regrouped()
        return time.monotonic() - started

    def _load(self, targets: dict, paths: dict, expected: dict[str, int]) -> None:
        """``_load_once``; a slot that dies meanwhile is replaced (the group re-formed on new
        processes, as after any loss) and the whole load is made again, from the same files:
        a restart is what a job falls back on, and one lost slot must not end it."""
        for attempt in range(1, RESTART_ATTEMPTS + 1):
            try:
                self._load_once(targets, paths, dict(expected))
                return
            except SlotError as exc:
                if attempt == RESTART_ATTEMPTS or all(self.engine.pool.alive()):
                    raise
                logger.warning("restart: a slot died while loading (%s); loading again", exc)
                self._release_all()
                self.lost_slots()  # the group, re-formed on new processes
                units = [u for us in targets.values() for u in us]
                self.engine.pool.run(checkpoint.ensure_unit_groups, units=units)
                if self.job is not None:
                    self.job.regrouped()
                self._event({"event": "engine.restart_retried", "error": str(exc)[:500]})

    def _load_once(self, targets: dict, paths: dict, expected: dict[str, int]) -> None:
        """Load every unit of ``targets`` from its model-stage's folder in ``paths`` and check
        its checksum against ``expected`` (what was saved), or where none is given, against
        the model-stage's first unit loaded (every replica must hold the same state)."""
        pool = self.engine.pool
        for name, units in targets.items():
            for unit in units:
                pool.run(checkpoint.load_unit, on=unit.slots, unit=unit, path=str(paths[name]))
                self.engine.units[unit.unit_id] = unit
                got = self.engine.checksum(unit)
                want = expected.get(name)
                if want is None:
                    want = expected[name] = got
                if got != want:
                    raise IntegrityError(
                        f"restart: {unit.unit_id} loaded checksum {got:#x} from "
                        f"{paths[name]}, saved {want:#x}"
                    )
                self.engine.verified[unit.unit_id] = got

    def run_probes(self, probes: Sequence[Probe]) -> ProbeReport:
        """Time each probe's collective on its slots' processes (gloo here, NCCL on GPUs), the
        groups made first over the whole pool (so nothing runs while units build ahead: the
        report says so); a slot failing stops the probing, and the next liveness check finds
        it."""
        started = time.monotonic()
        check_probes(probes, self.visible, self.lost_slots())
        building = self.job.building_ahead() if self.job is not None else frozenset()
        if building:  # groups are made over the whole pool: not while some slots build
            return ProbeReport(
                measured_s=(),
                seconds=time.monotonic() - started,
                failure=f"slots {sorted(building)} are building units ahead: not probed now",
            )
        measured: list[tuple[float, ...]] = []
        failure = ""
        try:
            self.engine.prepare_groups([probe.slots for probe in probes])
            for probe in probes:
                per_rank = self.engine.pool.run(
                    slot_ops.time_collective,
                    on=probe.slots,
                    pattern=probe.pattern,
                    slots=probe.slots,
                    nbytes=probe.nbytes,
                    repeats=probe.repeats,
                )
                measured.append(tuple(max(runs) for runs in zip(*per_rank, strict=True)))
        except SlotError as exc:
            failure = f"probing stopped: {exc}"
            logger.warning("%s", failure)
        return ProbeReport(
            measured_s=tuple(measured), seconds=time.monotonic() - started, failure=failure
        )

    def save_checkpoint(self) -> Path:
        """Commit the job's checkpoint now (DCP of one replica of each training model-stage)."""
        if self.job is None:
            raise RuntimeError("save_checkpoint: this engine has no job")
        return self.job.save_checkpoint(self.engine)

    def _event(self, event: dict) -> None:
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)

    def stop(self) -> None:
        """Free the job's units and workspaces; the pool stays for another job. Best effort: a
        slot that died after the job's last step costs what it held, never the job's outcome
        (its steps are made and its model exported by now)."""
        self._release_all()
        if self.job is not None:
            try:
                self.job.release(self.engine)
            except SlotError as exc:
                logger.warning("dropping the job's workspaces failed: %s", exc)

    def _release_all(self) -> None:
        for unit in list(self.engine.units.values()):
            try:
                self.engine.destroy(Destroy(unit=unit))
            except SlotError as exc:  # a dead or silent slot: its state is gone either way
                logger.warning("releasing %s failed: %s", unit.unit_id, exc)
                self._forget(unit)
