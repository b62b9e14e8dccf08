"""The simulated cluster: the engine interface over the cluster twin (``runtime/twin``).

Everything it reports is labelled simulated. The twin's physics is its own: the planner's cost
and memory models are never asked what a step, a primitive, a build or a restart takes, so the
planner starts wrong about this world and must learn it online (and may never learn all of it:
its model has one length per step, this world a long tail of responses; its memory model has
no padding to the longest sequence of a micro-batch, this world does).

Each step draws every response's length from the trace (``Trace.response_lengths``, seeded by
the step alone, so two policies on the same trace and seed see the same sequences) and the twin
plays the step: generation as a serving engine batches it, pipelines micro-batch by micro-batch,
the collectives over the links the units span, and an allocator that fails a step whose slot
outgrows its device (the job goes back to its last checkpoint). Transitions play the compiled
DAG with the twin's time for each primitive; checkpoint/restart costs the twin's restart plus
saving and loading the whole persistent state at the storage bandwidth. The trace's pool changes
and failures revoke the highest slots or the named one; a failed slot stays lost until the
trace's next pool record replaces it. A slot the plan uses that is lost in the middle of a step
fails the step there, as on the Ray engine: before the training stage the units on the other
slots are kept, after it began every unit's state is written off.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence

from runtime.engine.interface import ProbeReport, StepReport, TransitionOutcome
from runtime.engine.traces import Trace
from runtime.planner.calibration import TRAINING, samples_from_stages
from runtime.planner.catalog import Accelerator
from runtime.planner.plan import Plan
from runtime.planner.probes import Probe, check_probes
from runtime.planner.workload import PpoWorkload
from runtime.transition.compiler import DEFAULT_REBUILD_S
from runtime.transition.dag import TransitionDag, in_build_order
from runtime.transition.simulate import simulate
from runtime.transition.units import Units, bytes_on, persists, units_not_held, units_of
from runtime.twin import (
    ClusterTwin,
    build_seconds,
    device,
    primitive_seconds,
    probe_seconds,
    restart_seconds,
)

STALL_S = 60.0
"""Simulated seconds a job that cannot run on its pool waits before trying again."""
CHECKPOINT_EVERY = 20
"""Steps between the simulated job's committed checkpoints."""
PROBE_SETUP_S = 2.0
"""Simulated seconds of making the probes' process groups (once per ``run_probes`` call that
needs a group not made before, as the Ray engine keeps its groups)."""
BACKENDS = ("continuous", "static")
"""How the simulated generation units decode: as a serving engine (vLLM) or a plain loop."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ran:
    """A step the simulated engine ran to its end."""

    plan: Plan
    at_s: float
    """The simulated clock when it started."""
    gen_len: float
    """The mean generated length it ran at."""
    lengths: tuple[int, ...] = ()
    """Every response's length (``hindsight`` replays the step with them)."""


def on_ready(plan: Plan, building) -> Plan | None:
    """``plan`` as it runs while its units ``building`` ((model-stage, slots)) are still being
    built: each generation model-stage among them on its built units only, which share its
    sequences (each a serving engine that takes as many at once as its cache holds). None when
    some generation model-stage has no unit built yet."""
    changed = {}
    for ms in plan.model_stages:
        if not ms.name.endswith("@generation") or not any(
            (ms.name, u) in building for u in ms.units
        ):
            continue
        units = tuple(u for u in ms.units if (ms.name, u) not in building)
        if not units:
            return None
        layout = dataclasses.replace(ms.layout, dp=len(units))
        changed[ms.name] = dataclasses.replace(ms, layout=layout, units=units, micro_batch=0)
    return dataclasses.replace(
        plan, model_stages=tuple(changed.get(ms.name, ms) for ms in plan.model_stages)
    )


class SimulatedEngine:
    """The engine interface over a simulated cluster driven by a trace."""

    kind = "simulated"
    simulated = True

    def __init__(
        self,
        trace: Trace,
        accelerator: Accelerator,
        *,
        twin: ClusterTwin | None = None,
        seed: int = 0,
        checkpoint_every: int = CHECKPOINT_EVERY,
        backend: str = "continuous",
    ):
        if accelerator.name != trace.accelerator:
            raise ValueError(
                f"accelerator: the trace is for {trace.accelerator}, not {accelerator.name}"
            )
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
        self.trace = trace
        self.acc = accelerator
        self.twin = twin or ClusterTwin.draw(device(accelerator.name), seed)
        """The world: the planner never reads it."""
        if self.twin.device.name != accelerator.name:
            raise ValueError(
                f"twin: its device is {self.twin.device.name}, the cluster's {accelerator.name}"
            )
        self.backend = backend
        self.seed = seed
        self._workload: PpoWorkload | None = None
        # Each step's draws (its responses' lengths, its model-stages' noise) come from
        # a stream of that step alone, so that two policies run on the same trace and seed see
        # the same step-to-step noise however their plans differ; transitions and builds have
        # streams of their own.
        self._transition_rng = random.Random(f"{seed}:transitions")
        self._build_rng = random.Random(f"{seed}:builds")
        self._probe_rng = random.Random(f"{seed}:probes")
        self._probe_groups: set[tuple[int, ...]] = set()
        self.clock = 0.0
        self._units: dict = {}
        self._lost: set[int] = set()
        self._pool = trace.gpus_at(0.0)
        self._rebuild = dict(DEFAULT_REBUILD_S)
        """Seconds one new unit of each derived stage takes to build, as this engine has
        measured its rebuilds (the compiler's GPU defaults until it has seen one)."""
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every: must be at least 1, got {checkpoint_every}")
        self.checkpoint_every = checkpoint_every
        self._since_checkpoint: list[float] = []
        """Seconds of each step done since the job last committed a checkpoint."""
        self._redo: list[float] = []
        """Steps lost with the state (those since the checkpoint): a restart does them again."""
        self._ahead: dict[tuple[str, tuple[int, ...]], float] = {}
        """Units being built ahead of a transition: when each is ready (simulated seconds)."""
        self.history: dict[int, Ran] = {}
        """Each step that ran to its end: its plan, clock and length (``hindsight`` replays
        them)."""
        self._joining: dict[tuple[str, tuple[int, ...]], float] = {}
        """Derived units a transition did not wait for (``TransitionDag.joining``): when each is
        ready. The next step generates on the others meanwhile (``on_ready``)."""

    @property
    def rebuild_s(self) -> tuple[tuple[str, float], ...]:
        """What the transition compiler should charge for building a new unit of each stage."""
        return tuple(sorted(self._rebuild.items()))

    # --- the interface --------------------------------------------------------------------------

    def now(self) -> float:
        return self.clock

    def pool_size(self) -> int:
        """The slots the job may plan on: the pool, less those whose reclaiming the trace has
        announced (they hold their state, and can be moved off, until it happens)."""
        return min(self._pool, self.trace.announced_gpus_at(self.clock))

    def lost_slots(self) -> frozenset[int]:
        return frozenset(self._lost)

    def start(self, plan: Plan, workload: PpoWorkload) -> None:
        self._check_fits(plan)
        self._workload = workload
        self._units = units_of(plan, workload)
        self._lost.clear()
        self._joining.clear()

    def units(self) -> Units:
        return dict(self._units)

    def step(self, plan: Plan, workload: PpoWorkload, step: int) -> StepReport:
        self._check_fits(plan)
        gone = sorted(
            {s for ms in plan.model_stages for s in ms.slots if s >= self._pool or s in self._lost}
        )
        if gone:  # the job cannot run here: it waits a minute for the pool to change
            return self._stalled(step, f"slot {gone[0]} is gone (simulated)")
        missing = sorted(
            ms.name
            for ms in workload.model_stages()
            if persists(ms) and not self._units.get(ms.name)
        )
        if missing:  # the state was lost (an out-of-memory step) and nothing has restored it:
            # the job waits for a plan it can restart on
            return self._stalled(step, f"{missing[0]}: no units hold its state (simulated)")
        gone_units = units_not_held(plan, workload, self._units)
        if gone_units:  # slots given back after a revocation came back empty: the step fails
            # at its first collective, and the controller replans from the units that are left
            name, unit = gone_units[0]
            return StepReport(
                step=step,
                ok=False,
                seconds=0.0,
                gen_len=float(self.trace.gen_len_at(step)),
                failure=f"{name}: the unit on slots {list(unit)} is gone (simulated)",
                simulated=True,
            )
        rng = random.Random(f"{self.seed}:step:{step}")
        lengths = self.trace.response_lengths(step, workload.global_batch, rng)
        gen_len = sum(lengths) / len(lengths)
        now = workload.with_gen_len(max(1, round(gen_len)))
        self._workload = workload
        runs_on, building_s, blocked_s = self._joined(plan)
        played = self.twin.step(
            runs_on, now, lengths=lengths, at_s=self.clock, backend=self.backend, rng=rng
        )
        measured = dict(played.model_stage_seconds)  # what the slots time: each model-stage
        stage_seconds = dict(played.stage_seconds)
        # The units still building hold their slots until they are built: the next stage
        # (on every slot) waits for them.
        stage_seconds["generation"] = max(stage_seconds["generation"], building_s) + blocked_s
        seconds = sum(stage_seconds.values())
        peak = played.peak_fraction
        out_of_memory = played.failure
        used = {s for ms in plan.model_stages for s in ms.slots}
        lost_at = self.trace.first_loss(self.clock, self.clock + seconds, used)
        if lost_at is not None and (not out_of_memory or lost_at - self.clock < 0.5 * seconds):
            # A slot the plan uses was revoked or failed part-way: the step fails there, as on
            # the Ray engine. Before the training stage no unit's state has changed: the units
            # on the lost slots are gone and the others are kept, at the step's start. Once
            # training began every unit may be mid-update: the job goes back to its last
            # checkpoint, as after running out of memory.
            elapsed = lost_at - self.clock
            training = elapsed >= seconds - stage_seconds.get("training", 0.0)
            stage = "training" if training else "generation or inference"
            self._advance(elapsed)
            if training:
                self._lose_state()
            return StepReport(
                step=step,
                ok=False,
                seconds=elapsed,
                gen_len=gen_len,
                failure=f"a slot was lost during the step's {stage} (simulated)",
                simulated=True,
            )
        ok, failure = True, ""
        if out_of_memory:
            # Out of memory part-way: one rank fails inside the step's collectives, the others
            # time out and the group is torn down, as the Ray engine does on any failed step.
            # Every unit is mid-update: the job goes back to its last checkpoint, and the steps
            # since then are done again after the restart.
            ok, failure = False, out_of_memory
            seconds *= 0.5
            self._lose_state()
        else:
            self._since_checkpoint.append(seconds)
            if len(self._since_checkpoint) >= self.checkpoint_every:
                self._since_checkpoint.clear()  # committed
            self.history[step] = Ran(
                plan=plan, at_s=self.clock, gen_len=gen_len, lengths=tuple(lengths)
            )
        self._advance(seconds)
        return StepReport(
            step=step,
            ok=ok,
            seconds=seconds,
            gen_len=gen_len,
            stage_seconds=stage_seconds,
            samples=samples_from_stages(
                runs_on,
                now,
                self.acc,
                measured=measured,
                training_s=sum(measured.get(name, 0.0) for name in TRAINING),
            )
            if ok
            else (),
            peak_memory=peak,
            failure=failure,
            simulated=True,
            extra={"preempted": played.preempted} if played.preempted else {},
        )

    def _lose_state(self) -> None:
        """Every unit's state is gone mid-update: the steps since the last checkpoint are
        done again after the restart."""
        self._units = {}
        self._redo = self._redo + self._since_checkpoint
        self._since_checkpoint = []

    def replay(self, plan: Plan, workload: PpoWorkload, ran: Ran) -> tuple[float, str]:
        """What ``plan`` would have taken for the step ``ran`` (its sequences, its clock),
        noise aside: seconds, and why it would have failed (empty: it fits)."""
        at = workload.with_gen_len(max(1, round(ran.gen_len)))
        lengths = list(ran.lengths) or [max(1, round(ran.gen_len))] * workload.global_batch
        played = self.twin.step(plan, at, lengths=lengths, at_s=ran.at_s, backend=self.backend)
        return played.seconds, played.failure

    def _joined(self, plan: Plan) -> tuple[Plan, float, float]:
        """The plan this step runs (generation on the units that are built: those a transition
        did not wait for are built by the end of this step's generation), how long the last of
        them still builds, and how long the step waits before it can start (no generation unit
        of a model-stage built yet)."""
        building = {
            key: ready
            for key, ready in self._joining.items()
            if ready > self.clock and key[1] in plan.model_stage(key[0]).units
        }
        self._joining = {}
        if not building:
            return plan, 0.0, 0.0
        last = max(building.values()) - self.clock
        runs_on = on_ready(plan, building)
        if runs_on is None:  # none built yet (a second transition before any step): the
            return plan, 0.0, last  # step waits for every build, as a transition would
        return runs_on, last, 0.0

    def _stalled(self, step: int, failure: str) -> StepReport:
        """A step the job cannot run: it waits ``STALL_S`` for the world to change."""
        self._advance(STALL_S)
        return StepReport(
            step=step,
            ok=False,
            seconds=STALL_S,
            gen_len=float(self.trace.gen_len_at(step)),
            failure=failure,
            simulated=True,
        )

    def transition(self, dag: TransitionDag) -> TransitionOutcome:
        took_s: dict[str, float] = {}  # each node's seconds, as the executor times them

        def true_seconds(node) -> float:
            seconds = primitive_seconds(self.twin, node.primitive, at_s=self.clock)
            noise = self._transition_rng.gauss(0, self.twin.noise)
            took_s[node.node_id] = seconds * math.exp(noise)
            return took_s[node.node_id]

        result = simulate(dag, durations=true_seconds)
        samples = tuple(
            sample
            for node_id, seconds in took_s.items()
            if result.ok and (sample := dag.nodes[node_id].sample(seconds)) is not None
        )
        took = {name: self._build_s(name, units) for name, units in dag.rebuild_units.items()}
        rebuild = dag.rebuild_makespan(took)
        built_here = {
            name
            for name, units in dag.rebuild_units.items()
            for u in units
            if (name, u) not in dag.built_ahead | dag.joining
        }
        for key in dag.built_ahead:  # waited for where still building
            ready = self._ahead.get(key, self.clock + self._build_s(key[0], (key[1],)))
            rebuild = max(rebuild, ready - self.clock)
        for name in built_here:  # those built ahead or joining are learned from as they build
            self._learn_build(name, took[name])
        result = dataclasses.replace(result, makespan_s=result.makespan_s + rebuild)
        end = self.clock + result.makespan_s
        joining = self._schedule(dag.joining, start=end)
        self._ahead.clear()
        # Slots its nodes use that failed, or were revoked (even if given back before it ended),
        # while it ran took what was on them; a slot no node uses failing meanwhile leaves it be,
        # as on the Ray engine (the units on that slot are lost all the same).
        touched = {s for node in dag.nodes.values() for s in node.slots}
        failed = [s for s in self.trace.failures_between(self.clock, end) if s in touched]
        fewest = self.trace.fewest_gpus_between(self.clock, end)
        revoked = sorted(s for s in touched if s >= fewest)
        self._advance(result.makespan_s)
        if not result.ok or failed or revoked:
            return TransitionOutcome(
                ok=False,
                seconds=result.makespan_s,
                units=self._intact(),
                lost_slots=tuple(sorted(self._lost)),
                failure=result.reason
                or (
                    f"slot {failed[0]} failed during the transition"
                    if failed
                    else f"slot {revoked[0]} was revoked during the transition"
                ),
                simulated=True,
                rebuild_s=rebuild,
            )
        self._units = dict(dag.target)
        self._joining.update(joining)
        return TransitionOutcome(
            ok=True,
            seconds=result.makespan_s,
            units=self.units(),
            simulated=True,
            rebuild_s=rebuild,
            samples=samples,
        )

    def build_ahead(
        self, plan: Plan, workload: PpoWorkload, units: dict[str, tuple[tuple[int, ...], ...]]
    ) -> None:
        """Start the builds now, in the engines' order; the clock does not wait for them."""
        keys = [(name, tuple(slots)) for name, group in units.items() for slots in group]
        self._ahead.update(self._schedule(keys, start=self.clock))

    def drop_ahead(self) -> None:
        self._ahead.clear()

    def _schedule(self, keys, *, start: float) -> dict[tuple[str, tuple[int, ...]], float]:
        """When each of these units ((model-stage, slots)) is built, the builds starting at
        ``start`` in the engines' order: each as soon as all its slots are free."""
        keys = in_build_order(keys)
        seconds = {
            name: self._build_s(name, [u for n, u in keys if n == name])
            for name in sorted({n for n, _ in keys})
        }
        for name, took in seconds.items():
            self._learn_build(name, took)
        free: dict[int, float] = {}
        out = {}
        for name, slots in keys:
            ready = max(free.get(s, start) for s in slots) + seconds[name]
            free.update(dict.fromkeys(slots, ready))
            out[(name, slots)] = ready
        return out

    def _build_s(self, model_stage: str, units: Sequence[tuple[int, ...]] = ()) -> float:
        """The seconds one unit of ``model_stage`` takes to build now (its largest, on the
        twin's links), with the noise of builds."""
        stage = model_stage.partition("@")[2]
        role = model_stage.partition("@")[0]
        size = max((len(u) for u in units), default=1)
        slots = max(units, key=len, default=(0,))
        nbytes = 0.0
        if self._workload is not None:
            model = self._workload.models[role]
            nbytes = (
                model.num_params(scalar_head=role in ("critic", "reward"))
                * self._workload.bytes_per_value
                / size
            )
        noise = math.exp(self._build_rng.gauss(0, self.twin.noise))
        return build_seconds(self.twin, stage, nbytes, slots) * noise

    def _learn_build(self, model_stage: str, seconds: float) -> None:
        """As the Ray engine learns from its timings."""
        stage = model_stage.partition("@")[2]
        self._rebuild[stage] = 0.5 * self._rebuild[stage] + 0.5 * seconds

    def restart(self, plan: Plan, workload: PpoWorkload) -> float:
        """Save every persistent unit, restart the processes, load onto ``plan``; after a lost
        state, load the last checkpoint and do the steps since it again."""
        state = sum(
            sum(bytes_on(u).values()) for us in units_of(plan, workload).values() for u in us
        )
        intact = self._intact()
        redo = 0.0
        if all(intact.get(name) for name in units_of(plan, workload)):
            passes = 2  # saved from the intact units, then loaded (the job's own checkpoints
            # go on as before: this save is not one of them)
        else:  # some state has no intact copy: the job's last checkpoint is loaded, and the
            passes = 1  # steps since it are done again, after which they are still steps
            # since that checkpoint
            self._since_checkpoint = self._redo + self._since_checkpoint
            self._redo = []
            redo = sum(self._since_checkpoint)
        seconds = restart_seconds(self.twin, state, plan.num_slots, passes) + redo
        # A restart replaces no slot: failed slots stay lost until the trace's next pool
        # record, and the plan it restarts onto must avoid them.
        self._advance(seconds)
        self._units = units_of(plan, workload)
        self._joining.clear()
        return seconds

    def run_probes(self, probes: Sequence[Probe]) -> ProbeReport:
        """Each probe's runs on the twin's links now (other tenants' traffic included, nothing
        of the job's own beside it), with the step's noise; the clock moves by the group
        set-up, a warm-up run and the timed runs of each."""
        check_probes(probes, self._pool, self._lost)
        measured = []
        groups = {p.slots for p in probes}
        seconds = PROBE_SETUP_S if groups - self._probe_groups else 0.0
        self._probe_groups |= groups
        for probe in probes:
            true_s = probe_seconds(
                self.twin, probe.pattern, probe.slots, probe.nbytes, at_s=self.clock
            )
            runs = tuple(
                true_s * math.exp(self._probe_rng.gauss(0, self.twin.noise))
                for _ in range(probe.repeats)
            )
            seconds += true_s + sum(runs)
            measured.append(runs)
        self._advance(seconds)
        return ProbeReport(measured_s=tuple(measured), seconds=seconds, simulated=True)

    # --- the world moving on ----------------------------------------------------------------------

    def _advance(self, seconds: float) -> None:
        start, self.clock = self.clock, self.clock + seconds
        pool = self.trace.gpus_at(self.clock)
        fewest = self.trace.fewest_gpus_between(start, self.clock)
        # Reclaimed, even if only for a moment: the highest slots go, with their state.
        self._lost.update(range(fewest, self._pool))
        if pool > fewest:  # slots (back) in the pool arrive empty and usable: the units they
            # held are gone (the plan that names them fails its next step)
            back = set(range(fewest, pool))
            self._lost.difference_update(back)
            self._units = {
                name: tuple(u for u in units if not set(u.slots) & back)
                for name, units in self._units.items()
            }
        self._pool = pool
        for slot in self.trace.failures_between(start, self.clock):
            if slot < self._pool:
                self._lost.add(slot)
        if any(start < at <= self.clock for at, _ in self.trace.pool):
            # A pool record: the cluster's allocation is renewed, slots that failed before it
            # replaced (empty), whether or not a step boundary fell between the two.
            self._replace_failed(start)

    def _replace_failed(self, start: float) -> None:
        """Slots that failed before the latest pool record since ``start`` come back empty."""
        record = max(at for at, _ in self.trace.pool if start < at <= self.clock)
        failed = {slot for at, slot in self.trace.failures if at <= record}
        back = self._lost & failed & set(range(self.trace.gpus_at(record)))
        if back:
            self._lost -= back
            self._units = {
                name: tuple(u for u in units if not set(u.slots) & back)
                for name, units in self._units.items()
            }

    def _intact(self) -> dict:
        return {
            name: tuple(u for u in units if not set(u.slots) & self._lost)
            for name, units in self._units.items()
        }

    def _check_fits(self, plan: Plan) -> None:
        if plan.accelerator != self.acc.name:
            raise ValueError(f"plan.accelerator: {plan.accelerator} on a {self.acc.name} cluster")
