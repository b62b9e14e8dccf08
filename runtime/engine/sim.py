"""The simulated cluster: the engine interface in simulated time, with a hidden true model.

Everything it reports is labelled simulated. What it hides from the planner:

- **True efficiencies.** Each operation class runs at the planner's default efficiency times a
  factor drawn per cluster (0.6–1.2), so the planner starts wrong and must learn online.
- **Interference** that shifts over time: communication classes slow by up to ``interference``
  along a slow wave (other tenants on the links), and per-step noise (``noise``, lognormal).
- **True memory.** Activations and KV caches take ``memory_factor`` of what the planner's model
  says, and the device has no headroom: a plan the planner thought feasible can run out of memory
  and fail its step.

Steps cost what the true model says for the plan's layouts at the trace's generated length.
Transitions play the compiled DAG with true primitive times (bytes over links at true
efficiencies, plus the per-primitive overhead the EMU benchmark measures on real slots);
checkpoint/restart costs a restart plus saving and loading the whole persistent state at the
storage bandwidth. The trace's pool changes and failures revoke the highest slots or the named one.
A slot the plan uses that is lost in the middle of a step fails the step there, as on the Ray
engine: before the training stage the units on the other slots are kept, after it began every
unit's state is written off.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence

from runtime.engine.interface import ProbeReport, StepReport, TransitionOutcome
from runtime.engine.traces import Trace
from runtime.planner import cost, memory
from runtime.planner.calibration import TRAINING, samples_from_stages
from runtime.planner.catalog import Accelerator
from runtime.planner.cost import DEFAULT_EFFICIENCY
from runtime.planner.plan import Plan
from runtime.planner.probes import Probe, check_probes
from runtime.planner.search import on_ready, stage_time
from runtime.planner.shapes import LayoutShape
from runtime.planner.workload import PpoWorkload
from runtime.transition import cost as transition_cost
from runtime.transition.compiler import DEFAULT_REBUILD_S
from runtime.transition.dag import TransitionDag, in_build_order
from runtime.transition.simulate import simulate
from runtime.transition.units import Units, bytes_on, persists, units_not_held, units_of

COMMUNICATION = ("tp_allreduce", "pp_p2p", "dp_allreduce", "weight_sync", "transition")
STALL_S = 60.0
"""Simulated seconds a job that cannot run on its pool waits before trying again."""
CHECKPOINT_EVERY = 20
"""Steps between the simulated job's committed checkpoints."""
REBUILD_TRUTH = 1.25
"""True time to build a derived unit over the compiler's default (which the engine learns)."""
EMU_OVERHEAD = 1.6
"""True primitive time over the ideal one (the EMU benchmark measures 1.25–2× on real slots)."""
PROBE_SETUP_S = 2.0
"""Simulated seconds of making the probes' process groups (once per ``run_probes`` call that
needs a group not made before, as the Ray engine keeps its groups)."""


PLANNER_ONLY = ("weight_read",)
"""Classes of the planner's cost model that the true model prices in its own form instead
(``TrueModel.small_gemm_tokens``): a term whose time it gives 0."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ran:
    """A step the simulated engine ran to its end."""

    plan: Plan
    at_s: float
    """The simulated clock when it started."""
    gen_len: float
    """The mean generated length it ran at (the trace's, with the step's jitter)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrueModel:
    """What the cluster really does; the planner never reads it."""

    efficiency: dict[str, float]
    noise: float = 0.03
    interference: float = 0.3
    interference_period_s: float = 4 * 3600.0
    memory_factor: float = 1.15
    restart_fixed_s: float = 120.0
    """Process start, NCCL/Ray set-up, model load warm-up."""
    storage_bytes_per_s: float = 2e9
    """Checkpoint bandwidth per node."""
    small_gemm_tokens: float = 256.0
    """A GEMM over fewer rows runs further from its peak: in training and inference its
    efficiency is the class's times ``tokens / (tokens + small_gemm_tokens)`` for the tokens of
    one micro-batch. The planner prices this its own way, as the weights each micro-batch's pass
    streams (``weight_read``, at an efficiency it learns): the truth has no such class, and
    ``seconds`` leaves the planner's term out."""
    launch_s: float = 40e-6
    """Fixed seconds per layer, pass and micro-batch in training and inference (an eager step's
    kernel launches; generation replays captured graphs). The planner's model has none."""
    isolated: float = 1.1
    """A collective timed alone (a calibration probe) runs this much faster than the same
    class inside a step, where compute contends with it for memory bandwidth and SMs: a probe's
    efficiency is optimistic, and the stage samples must correct it."""

    @classmethod
    def draw(cls, seed: int, **overrides) -> TrueModel:
        rng = random.Random(seed)
        family = {}
        efficiency = {}
        for op_class, default in DEFAULT_EFFICIENCY.items():
            if op_class in PLANNER_ONLY:
                continue
            name = op_class.partition(":")[0]
            family.setdefault(name, rng.uniform(0.6, 1.2))
            efficiency[op_class] = min(1.0, default * family[name] * rng.uniform(0.95, 1.05))
        return cls(efficiency=efficiency, **overrides)

    def seconds(self, shape: LayoutShape, *, num_slots: int, at_s: float) -> float:
        """True seconds of a model-stage's step as ``shape`` runs it at simulated time
        ``at_s``, noise aside: the cost model's form at the true efficiencies, plus what that
        form lacks (small GEMMs' lower efficiency, launch overheads), which calibration with one
        efficiency per class can only average over the plans it has seen."""
        efficiency = {**self.efficiency_at(at_s), **dict.fromkeys(PLANNER_ONLY, math.inf)}
        total, breakdown = cost.predict(shape, num_slots=num_slots, efficiency=efficiency)
        seconds = float(total[0])
        ms, w = shape.ms, shape.workload
        if ms.stage in ("training", "inference"):
            mb = float(shape.mb[0])
            seconds += float(breakdown["gemm"][0]) * self.small_gemm_tokens / (mb * w.seq_len)
            passes = (3 + (1 if w.recompute else 0)) if ms.stage == "training" else 1
            epochs = w.ppo_epochs if ms.stage == "training" else 1
            micro = math.ceil(float(shape.batch_per_unit[0]) / mb) * epochs
            seconds += micro * ms.model.num_layers / shape.pp * passes * self.launch_s
        return seconds

    def plan_seconds(
        self,
        plan: Plan,
        workload: PpoWorkload,
        accelerator: Accelerator,
        *,
        at_s: float,
        num_slots: int | None = None,
    ) -> tuple[dict[str, float], float]:
        """Each model-stage's true seconds as ``plan`` runs it at ``at_s``, noise aside, and the
        fullest slot's true memory as a fraction of a device (over 1: it does not fit).
        ``num_slots``: the pool the plan's collectives span (the plan's own by default)."""
        pool = plan.num_slots if num_slots is None else num_slots
        seconds: dict[str, float] = {}
        peak = 0.0
        for ms in workload.model_stages():
            shape = LayoutShape.of_plan(ms, workload, accelerator, plan)
            seconds[ms.name] = self.seconds(shape, num_slots=pool, at_s=at_s)
            use = memory.memory_breakdown(shape, num_slots=pool)
            scaled = sum(
                float(v[0]) * (self.memory_factor if k in ("activations", "kv_cache") else 1)
                for k, v in use.items()
            )
            peak = max(peak, scaled / accelerator.memory_bytes)
        return seconds, peak

    def step_seconds(
        self, plan: Plan, workload: PpoWorkload, accelerator: Accelerator, *, at_s: float
    ) -> tuple[float, float]:
        """A step's true seconds as ``plan`` runs it at ``at_s``, noise aside (its stages one
        after another, each stage's model-stages as its mode says), and its fullest slot's true
        memory as a fraction of a device."""
        seconds, peak = self.plan_seconds(plan, workload, accelerator, at_s=at_s)
        modes = {s.stage: s.mode for s in plan.stages}
        per_stage: dict[str, list[float]] = {}
        for ms in workload.model_stages():
            per_stage.setdefault(ms.stage, []).append(seconds[ms.name])
        return sum(stage_time(modes[s], ts) for s, ts in per_stage.items()), peak

    def efficiency_at(self, seconds: float) -> dict[str, float]:
        """True efficiencies at a simulated time: communication slowed by the interference wave."""
        wave = 0.5 * (1 - math.cos(2 * math.pi * seconds / self.interference_period_s))
        slow = 1 + self.interference * wave
        return {
            c: e / slow if c.partition(":")[0] in COMMUNICATION else e
            for c, e in self.efficiency.items()
        }


class SimulatedEngine:
    """The engine interface over a simulated cluster driven by a trace."""

    kind = "simulated"
    simulated = True

    def __init__(
        self,
        trace: Trace,
        accelerator: Accelerator,
        *,
        truth: TrueModel,
        seed: int = 0,
        checkpoint_every: int = CHECKPOINT_EVERY,
    ):
        if accelerator.name != trace.accelerator:
            raise ValueError(
                f"accelerator: the trace is for {trace.accelerator}, not {accelerator.name}"
            )
        self.trace = trace
        self.acc = accelerator
        self.truth = truth
        self.seed = seed
        # Each step's draws (its generated length's jitter, its model-stages' noise) come from
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
        self._failures_seen = 0.0
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
        ready. The next step generates on the others meanwhile (``search.on_ready``)."""

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
        gen_len = self.trace.gen_len_at(step) * math.exp(rng.gauss(0, 0.02))
        now = workload.with_gen_len(max(1, round(gen_len)))
        runs_on, building_s, blocked_s = self._joined(plan, now)
        modes = {s.stage: s.mode for s in plan.stages}
        per_stage: dict[str, list[float]] = {}
        measured: dict[str, float] = {}  # what the slots time: each model-stage, whole
        true_s, peak = self.truth.plan_seconds(
            runs_on, now, self.acc, at_s=self.clock, num_slots=plan.num_slots
        )
        for ms in now.model_stages():
            measured[ms.name] = true_s[ms.name] * math.exp(rng.gauss(0, self.truth.noise))
            per_stage.setdefault(ms.stage, []).append(measured[ms.name])
        stage_seconds = {stage: stage_time(modes[stage], ts) for stage, ts in per_stage.items()}
        # The units still building hold their slots until they are built: the next stage
        # (on every slot) waits for them.
        stage_seconds["generation"] = max(stage_seconds["generation"], building_s) + blocked_s
        seconds = sum(stage_seconds.values())
        ok, failure = True, ""
        used = {s for ms in plan.model_stages for s in ms.slots}
        lost_at = self.trace.first_loss(self.clock, self.clock + seconds, used)
        if lost_at is not None and (peak <= 1.0 or lost_at - self.clock < 0.5 * seconds):
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
                self._units = {}
                self._redo = self._redo + self._since_checkpoint
                self._since_checkpoint = []
            return StepReport(
                step=step,
                ok=False,
                seconds=elapsed,
                gen_len=gen_len,
                failure=f"a slot was lost during the step's {stage} (simulated)",
                simulated=True,
            )
        if peak > 1.0:
            # Out of memory part-way: one rank fails inside the step's collectives, the others
            # time out and the group is torn down, as the Ray engine does on any failed step.
            # Every unit is mid-update: the job goes back to its last checkpoint, and the steps
            # since then are done again after the restart.
            ok, failure = False, f"out of memory: {peak:.0%} of a device (simulated)"
            seconds *= 0.5
            self._units = {}
            self._redo = self._redo + self._since_checkpoint
            self._since_checkpoint = []
        else:
            self._since_checkpoint.append(seconds)
            if len(self._since_checkpoint) >= self.checkpoint_every:
                self._since_checkpoint.clear()  # committed
            self.history[step] = Ran(plan=plan, at_s=self.clock, gen_len=gen_len)
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
        )

    def _joined(self, plan: Plan, workload: PpoWorkload) -> tuple[Plan, float, float]:
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
        # The built units decode as many sequences at once as truly fit (as vLLM sizes its KV
        # cache from the memory it finds free): the device as its larger true footprint sees it.
        device = dataclasses.replace(
            self.acc, memory_bytes=self.acc.memory_bytes / self.truth.memory_factor
        )
        runs_on = on_ready(plan, workload, device, building)
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
        eff = self.truth.efficiency_at(self.clock)

        took_s: dict[str, float] = {}  # each node's true seconds, as the executor times them

        def true_seconds(node) -> float:
            predicted = transition_cost.predict(node.primitive, self.acc, eff).seconds
            noise = self._transition_rng.gauss(0, self.truth.noise)
            took_s[node.node_id] = predicted * EMU_OVERHEAD * math.exp(noise)
            return took_s[node.node_id]

        result = simulate(dag, durations=true_seconds)
        samples = tuple(
            sample
            for node_id, seconds in took_s.items()
            if result.ok and (sample := dag.nodes[node_id].sample(seconds)) is not None
        )
        took = {name: self._build_s(name) for name in dag.rebuilds}
        rebuild = dag.rebuild_makespan(took)
        built_here = {
            name
            for name, units in dag.rebuild_units.items()
            for u in units
            if (name, u) not in dag.built_ahead | dag.joining
        }
        for key in dag.built_ahead:  # waited for where still building
            ready = self._ahead.get(key, self.clock + self._build_s(key[0]))
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
        seconds = {name: self._build_s(name) for name in sorted({n for n, _ in keys})}
        for name, took in seconds.items():
            self._learn_build(name, took)
        free: dict[int, float] = {}
        out = {}
        for name, slots in keys:
            ready = max(free.get(s, start) for s in slots) + seconds[name]
            free.update(dict.fromkeys(slots, ready))
            out[(name, slots)] = ready
        return out

    def _build_s(self, model_stage: str) -> float:
        """The true seconds one unit of ``model_stage`` takes to build now."""
        stage = model_stage.partition("@")[2]
        noise = math.exp(self._build_rng.gauss(0, self.truth.noise))
        return dict(DEFAULT_REBUILD_S)[stage] * REBUILD_TRUTH * noise

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
        nodes = max(1, math.ceil(plan.num_slots / self.acc.gpus_per_node))
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
        seconds = self.truth.restart_fixed_s + passes * state / (
            self.truth.storage_bytes_per_s * nodes
        )
        seconds += redo
        # The restarted processes replace the lost ones; a slot lost while they start stays lost.
        before = set(self._lost)
        self._advance(seconds)
        self._units = units_of(plan, workload)
        self._lost -= before
        self._joining.clear()
        return seconds

    def run_probes(self, probes: Sequence[Probe]) -> ProbeReport:
        """Each probe's runs at the true efficiency of its class now (interference included),
        a little faster than inside a step (``TrueModel.isolated``), with the step's noise; the
        clock moves by the group set-up, a warm-up run and the timed runs of each."""
        check_probes(probes, self._pool, self._lost)
        eff = self.truth.efficiency_at(self.clock)
        measured = []
        groups = {p.slots for p in probes}
        seconds = PROBE_SETUP_S if groups - self._probe_groups else 0.0
        self._probe_groups |= groups
        for probe in probes:
            true_s = probe.ideal_s(self.acc) / min(1.0, eff[probe.op_class] * self.truth.isolated)
            runs = tuple(
                true_s * math.exp(self._probe_rng.gauss(0, self.truth.noise))
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

    def _intact(self) -> dict:
        return {
            name: tuple(u for u in units if not set(u.slots) & self._lost)
            for name, units in self._units.items()
        }

    def _check_fits(self, plan: Plan) -> None:
        if plan.accelerator != self.acc.name:
            raise ValueError(f"plan.accelerator: {plan.accelerator} on a {self.acc.name} cluster")
