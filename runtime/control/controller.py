"""The controller: watches each step, replans on triggers, admits, gates and applies transitions.

It runs above the engine interface, so the simulated cluster and the Ray engine get the same
decisions. Every decision is an event carrying its inputs and reasons (the trigger, the candidate,
predicted saving and cost, H, gamma, the verdict). ``run_job`` is the step loop around it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from runtime.bytesize import byte_size, byte_sizes
from runtime.control.admission import (
    CONTESTED,
    Option,
    Verdict,
    decide,
    why_moved,
    windowed_step_s,
)
from runtime.control.monitor import POOL, Monitor, Trigger
from runtime.control.policy import JobPolicy
from runtime.engine.interface import Engine, ProbeReport, StepReport
from runtime.events import finite
from runtime.planner import PlanningError, plan
from runtime.planner import cost as cost_model
from runtime.planner.calibration import Calibrator
from runtime.planner.catalog import Accelerator
from runtime.planner.cost import OPERATION_CLASSES
from runtime.planner.memory import memory_breakdown, memory_budget, total_bytes
from runtime.planner.plan import Plan
from runtime.planner.probes import LINK_GAUGES, Probe, link_probes, probes_for
from runtime.planner.search import (
    PlanResult,
    on_ready,
    price_plan,
    rebatched,
    stage_prices,
    stage_time,
)
from runtime.planner.shapes import LayoutShape, batchings, training_state
from runtime.planner.space import only_layouts
from runtime.planner.workload import PpoWorkload
from runtime.transition import Cluster, TransitionRefusedError, diff
from runtime.transition.units import bytes_on, units_of

logger = logging.getLogger(__name__)

RESTART_ESTIMATE_S = 120.0
"""The controller's estimate of a restart's fixed part (the engine knows the truth)."""
STORAGE_ESTIMATE_BYTES_PER_S = 2e9
"""Checkpoint bandwidth per node the controller assumes."""
REACHABLE_ALTERNATIVES = 3
"""Next-best plans tried when the best one cannot be reached by a live transition."""
PLAN_CLASSES = frozenset(c for c in OPERATION_CLASSES if not c.startswith("transition"))
"""The operation classes that rank plans (the transitions' price moves only)."""

Event = dict[str, Any]


OUTLOOK_WINDOW = 64
"""Steps of generated-length and calibration history behind a move's outlook, and of length
history behind the memory envelope."""


PROBE_ATTEMPTS = 3
"""Probings in a row that may fail (a slot lost, units building ahead) before the job stops
trying until the pool next spans more nodes."""


CALIBRATION_EVERY = 10
"""Steps between two ``control.calibration`` events at most (one each step would drown the
job's log)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outlook:
    """The signals whose horizon a candidate's saving lasts for, and why."""

    signals: tuple[str, ...]
    lengths: tuple[float, ...] = ()
    robust: bool = False
    """Faster at every one of ``lengths`` (the recent range of the generated length) and at
    ``trend_length``, and under every one of the recent calibrations (``calibrations``)."""
    trend_length: float | None = None
    """The length the trend reaches by the end of the longer horizon's repayment window."""
    calibrations: tuple[int, ...] = ()
    """The steps whose calibrated efficiencies the candidate was also priced under (the
    recent range of what calibration has learned), at the latest length."""
    slower_under: tuple[int, float] | None = None
    """The first of those calibrations under which the candidate is not faster: its step, and
    what the candidate saves under it (not positive). None: faster under all of them."""

    @property
    def contested(self) -> str:
        """Why the saving is not the calibration's consensus (empty: it is)."""
        return _contested(self.slower_under)

    def to_json(self) -> dict:
        return {
            "signals": list(self.signals),
            "lengths": list(self.lengths),
            "trend_length": self.trend_length,
            "calibrations": list(self.calibrations),
            "slower_under": list(self.slower_under) if self.slower_under else None,
            "robust": self.robust,
        }


def _contested(slower_under: tuple[int, float] | None) -> str:
    """``decide``'s ``contested``: the calibration under which a candidate is not faster."""
    if slower_under is None:
        return ""
    step, saving = slower_under
    return f"as calibrated after step {step}, saves {saving:.3f} s/step"


def _quantiles(values: list[float]) -> list[float]:
    """Minimum, quartiles and maximum of ``values`` (nearest rank)."""
    ordered = sorted(values)
    last = len(ordered) - 1
    return [ordered[round(q * last)] for q in (0.0, 0.25, 0.5, 0.75, 1.0)]


@dataclasses.dataclass
class Proposal:
    """A transition waiting for a person."""

    proposal_id: int
    plan: Plan
    verdict: Verdict
    trigger: Trigger
    created_s: float
    units_at: frozenset[str]
    """The unit ids it was compiled against: if they changed, the proposal is stale."""
    route: str = "live"
    """``live`` (a transition DAG) or ``restart`` (no live route: checkpoint/restart)."""
    ahead: frozenset[tuple[str, tuple[int, ...]]] = frozenset()
    """Its new units on slots the running plan leaves idle, built while it waits: approved, the
    transition waits only for what is left of their build."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Deferred:
    """A candidate refused as too slow to repay, or as faster only as calibrated now, kept while
    its signals stay calm: admission runs again each step with the horizon, both plans' prices
    and the recent calibrations as they are then."""

    plan: Plan
    cost_s: float
    trigger: Trigger
    signals: tuple[str, ...]
    route: str
    ahead: bool = False
    """Priced with its new units on idle slots built during one more step (``Staged``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Staged:
    """An admitted transition whose new derived units on idle slots are being built while the
    job takes one more step on the running plan; it runs after that step."""

    plan: Plan
    trigger: Trigger
    ahead: frozenset[tuple[str, tuple[int, ...]]]


def staged_cost(dag, current_s: float, candidate_s: float, joining_s: float = 0.0) -> float:
    """What a transition costs when its ``ahead`` units are built during one more step on the
    running plan (``current_s``): the moves and the other builds, whatever of the ahead builds
    outlasts that step, that step's forgone saving, and ``joining_s`` (what the first step on
    the target loses while the units joining then build)."""
    return (
        dag.moving_s
        + dag.rebuild_makespan(skip=dag.ahead | dag.joining_for(dag.ahead))
        + max(0.0, dag.ahead_makespan() - current_s)
        + max(0.0, current_s - candidate_s)
        + joining_s
    )


def place(
    candidate: Plan, alive: list[int], num_slots: int, gpus_per_node: int | None = None
) -> Plan:
    """A plan made for ``len(alive)`` slots, moved onto the live slots of a pool of ``num_slots``.

    The planner lays a plan out on contiguous nodes of ``gpus_per_node`` slots (TP groups, and
    the units and blocks it prices inside a node, never straddle one). With ``gpus_per_node``,
    each of those planned nodes goes whole onto one real node with enough live slots, the
    fullest first, so a node that lost a slot takes the planned node with fewer; where the live
    slots cannot hold the planned nodes so, or without ``gpus_per_node``, the plan's slot ``i``
    goes to the ``i``-th live slot."""
    where = (_by_node(alive, gpus_per_node) if gpus_per_node else None) or alive
    return onto(candidate, where, num_slots)


def onto(candidate: Plan, where: list[int], num_slots: int) -> Plan:
    """``candidate`` with its slot ``i`` moved to ``where[i]``, in a pool of ``num_slots``."""
    return dataclasses.replace(
        candidate,
        num_slots=num_slots,
        model_stages=tuple(
            dataclasses.replace(ms, units=tuple(tuple(where[s] for s in unit) for unit in ms.units))
            for ms in candidate.model_stages
        ),
    )


def _real_nodes(alive: list[int], gpus_per_node: int) -> list[list[int]]:
    """The live slots by real node (slot // gpus_per_node), the fullest node first."""
    real: dict[int, list[int]] = {}
    for slot in sorted(alive):
        real.setdefault(slot // gpus_per_node, []).append(slot)
    return sorted(real.values(), key=lambda slots: (-len(slots), slots[0]))


def _by_node(alive: list[int], gpus_per_node: int) -> list[int] | None:
    """The live slot each planned slot goes to, planned node by planned node onto real nodes;
    None when some planned node fits on no real node left."""
    nodes = _real_nodes(alive, gpus_per_node)
    full, rest = divmod(len(alive), gpus_per_node)
    sizes = [gpus_per_node] * full + ([rest] if rest else [])
    where: list[int] = []
    for size, slots in zip(sizes, nodes, strict=False):
        if len(slots) < size:
            return None
        where += slots[:size]
    return where if len(where) == len(alive) else None


def node_packings(alive: list[int], gpus_per_node: int) -> list[tuple[int, list[int]]]:
    """The ways to lay a plan over the live slots so that no node the planner lays it out on
    straddles two real ones: ``(node size g, where)``, the plan made for ``len(where)`` slots in
    nodes of ``g`` and its slot ``i`` placed on ``where[i]``.

    When the live slots hold the planner's nodes whole (``_by_node``), that is the only way: the
    plan uses every live slot. Otherwise (several nodes each lost a slot: four nodes of seven
    cannot hold planned nodes of eight) each power of two ``g`` below the node size packs as
    many nodes of ``g`` into each real node as it holds, leaving the rest of that node idle:
    fewer slots, TP up to ``g``, and every group the planner prices as inside a node really is.
    ``g`` = 1 uses every live slot without tensor parallelism. A smaller ``g`` that reaches no
    more slots than a larger one is not offered."""
    if not alive:
        return []
    where = _by_node(alive, gpus_per_node)
    if where is not None:
        return [(gpus_per_node, where)]
    nodes = _real_nodes(alive, gpus_per_node)
    out: list[tuple[int, list[int]]] = []
    size = gpus_per_node
    while size >= 1:
        packed = [s for slots in nodes for s in slots[: len(slots) // size * size]]
        if packed and (not out or len(packed) > len(out[-1][1])):
            out.append((size, packed))
        size //= 2
    return out


class Controller:
    def __init__(
        self,
        workload: PpoWorkload,
        accelerator: Accelerator,
        policy: JobPolicy,
        *,
        emit: Callable[[Event], None] | None = None,
        calibrator: Calibrator | None = None,
        capacity_bytes: float | None = None,
        fixed: dict[str, tuple[int, int]] | None = None,
    ):
        self.workload = workload
        self.acc = accelerator
        self.policy = policy
        self.calibrator = calibrator or Calibrator()
        self.monitor = Monitor(policy)
        self.capacity = capacity_bytes or memory_budget(accelerator.memory_bytes)
        self.plan: Plan | None = None
        self.fixed: dict[str, tuple[int, int]] = dict(fixed or {})
        """With ``policy.fixed_layouts``: each model-stage's (tp, pp); default: the first plan's."""
        self.kept_micro_batches: dict[str, int] = {}
        """With ``policy.fixed_micro_batches``: each model-stage's micro-batch (generation: the
        sequences a unit decodes at once, 0 all of them), the first plan's until a step runs
        out of memory (``_halve_micro_batches``)."""
        self.pending: Proposal | None = None
        self.veto: Callable[[Plan, Plan, int], str] | None = None
        """Refuses a move admission found worth its cost (one hindsight would call ``saving``:
        not urgent nor off a plan that can no longer run, not away from a plan forecast to
        outgrow memory, not onto a changed pool):
        called with the running plan, the candidate and the step, it returns why (empty: no
        veto). None in a job; hindsight's counterfactual replays set it (``counterfactuals``)."""
        self.events: list[Event] = []
        self._emit_to = emit
        self._ids = itertools.count(1)
        self._calibration_shown: tuple[int, dict[str, float]] | None = None
        """The step and efficiencies of the last ``control.calibration`` event."""
        self._weighed_with: dict[str, float] = {}
        """The calibrated efficiencies plans were last weighed with (the ``calibration``
        signal measures from them)."""
        self._calibrated: collections.deque[tuple[int, dict[str, float]]] = collections.deque(
            maxlen=OUTLOOK_WINDOW
        )
        """What calibration had learned after each of the last ``OUTLOOK_WINDOW`` steps that
        brought it samples, oldest first: the efficiencies of the classes it had learned then
        (settled by the samples, or probed), which ``_calibration_check`` prices under. Kept
        from the job's ``OUTLOOK_WINDOW``-th such step on: before it, calibration is still
        learning the cluster (from the catalog's defaults and the probes' optimistic figures
        towards what the steps measure), which moves the efficiencies one way, not back and
        forth."""
        self._sampled_steps = 0
        self.transitions = 0
        self.rebatches = 0
        self.restarts = 0
        self.transition_s = 0.0
        self.restart_s = 0.0
        self._gen_len = float(workload.gen_len)
        self.memory_factor = 1.0
        """Measured peak memory over the planner's prediction (learned; never below 1)."""
        self._memory_quiet_until = -1
        self._memory_escalated_until = -2
        """The quiet period whose one escalation (a device violation) has fired."""
        self.deferred: Deferred | None = None
        """A candidate refused as too slow to repay, reconsidered while its signal stays calm."""
        self.last_step: int | None = None
        """The run's last step (``run_job`` sets it); a move must repay before then."""
        self.at_step = 0
        """The step the job is at: the one about to run (``before_step``) or just run."""
        self.ran_step = -1
        """The last step run (-1: none yet)."""
        self._moving_for: Event | None = None
        """The decision the next transition carries out: the last one emitted that admitted a
        move, a salvage or a person's override (a transition names it: ``because``)."""
        self.staged: Staged | None = None
        """An admitted transition building its units ahead; it runs after the next step."""
        self._settling = False
        """The next step follows a transition whose new units join during it (``joining``)."""
        self.probe_s = 0.0
        """Seconds spent timing calibration probes (``_run_probes``)."""
        self._probed_nodes = 0
        """How many nodes the live pool spanned when it was last probed."""
        self._probe_attempts = 0
        """Probings that did not finish since the last that did."""
        self._links_probed_at = 0.0
        """Job seconds when the links' gauges were last timed (``_probe_links``)."""

    # --- events ---------------------------------------------------------------------------------

    def emit_step(self, report: StepReport) -> None:
        self.emit(
            {
                "event": "step",
                "step": report.step,
                "ok": report.ok,
                "seconds": report.seconds,
                "gen_len": report.gen_len,
                "stage_seconds": report.stage_seconds,
                "peak_memory": report.peak_memory,
                "failure": report.failure,
                "simulated": report.simulated,
            }
        )

    def _emit_calibration(self, report: StepReport) -> None:
        """Say what the cost model has learned of this job (``control.calibration``: the
        efficiency of each operation class, 1 being the catalog's peak): at the first step that
        measured something, then at most every ``CALIBRATION_EVERY`` steps while any class moves
        by more than 2%."""
        efficiency = self.calibrator.efficiency()
        shown = self._calibration_shown
        if shown is not None:
            since, before = shown
            moved = any(
                abs(value / before[c] - 1) > 0.02 for c, value in efficiency.items() if before[c]
            )
            if report.step - since < CALIBRATION_EVERY or not moved:
                return
        self._calibration_shown = (report.step, efficiency)
        self.emit(
            {
                "event": "control.calibration",
                "step": report.step,
                "efficiency": efficiency,
                "simulated": report.simulated,
            }
        )

    def emit(self, event: Event) -> None:
        event = finite(event)  # strict JSON for every reader: no NaN, no infinities
        if event["event"] == "control.decision" and (
            event["admit"] or str(event["reason"]).startswith(_MOVES_WITHOUT_VERDICT)
        ):
            self._moving_for = event
        elif event["event"] == "control.restart":
            self._moving_for = None  # the decision went that way
        self.events.append(event)
        if self._emit_to is not None:
            self._emit_to(event)

    # --- planning -------------------------------------------------------------------------------

    def _alive(self, engine: Engine) -> list[int]:
        lost = engine.lost_slots()
        return [s for s in range(engine.pool_size()) if s not in lost]

    def _workload(self, gen_len: float) -> PpoWorkload:
        return self.workload.with_gen_len(max(1, round(gen_len)))

    def _same_plan(self, a: Plan, b: Plan) -> bool:
        """The same layouts on the same slots with the same micro-batches."""
        mb = self.workload.micro_batch
        return a.places_like(b) and a.micro_batches(mb) == b.micro_batches(mb)

    def _candidate(self, engine: Engine, workload: PpoWorkload, *, fits_at: float = 0.0) -> Plan:
        return self._plans(engine, workload, fits_at=fits_at)[0]

    def _measured_accelerator(self) -> Accelerator:
        """The accelerator as the planner should see it: with the memory the device really
        gives, as measured so far."""
        return dataclasses.replace(
            self.acc, memory_bytes=self.acc.memory_bytes / self.memory_factor
        )

    def _plans(
        self,
        engine: Engine,
        workload: PpoWorkload,
        *,
        keep: Mapping[str, tuple[int, int]] | None = None,
        alternatives: int = 0,
        fits_at: float = 0.0,
    ) -> list[Plan]:
        """The planner's best plan on the live slots, then up to ``alternatives`` next-best ones
        (each changing some model-stage's layout); with ``keep``, the named model-stages keep
        those (tp, pp) (their data parallelism alone is replanned). Fastest at ``workload``,
        and fitting in memory up to the generated length ``fits_at`` as well."""
        alive = self._alive(engine)
        acc = self._measured_accelerator()
        if not alive:
            raise PlanningError(
                "no slot is alive",
                constraint="slots",
                model_stage="",
                shortfall=0.0,
            )
        packings = node_packings(alive, acc.gpus_per_node)
        fixed = self.policy.fixed_layouts and bool(self.fixed)
        try:
            result, where = self._search_packings(
                packings, workload, acc, alternatives, keep, fits_at, fixed=fixed
            )
        except PlanningError:
            if not fixed or keep is not None:
                raise
            # Not on any of the ways to lay the plan out: the fixed layouts give way, once.
            self.emit({"event": "control.relaxed", "reason": "the fixed layouts no longer fit"})
            result, where = self._search_packings(
                packings, workload, acc, alternatives, keep, fits_at, fixed=False
            )
        return [
            onto(dataclasses.replace(p, accelerator=self.acc.name), where, engine.pool_size())
            for p in (result.best, *result.alternatives)
        ]

    def _search_packings(
        self,
        packings: list[tuple[int, list[int]]],
        workload: PpoWorkload,
        acc: Accelerator,
        alternatives: int,
        keep: Mapping[str, tuple[int, int]] | None,
        fits_at: float,
        *,
        fixed: bool,
    ) -> tuple[PlanResult, list[int]]:
        """The planner's fastest result over ``node_packings``, with where its slots go; the
        first packing's refusal when none has a plan."""
        found: list[tuple[PlanResult, list[int]]] = []
        refusals: list[PlanningError] = []
        for size, where in packings:
            sized = (
                acc if size == acc.gpus_per_node else dataclasses.replace(acc, gpus_per_node=size)
            )
            try:
                result = self._search(
                    workload, sized, len(where), alternatives, keep, fits_at, fixed=fixed
                )
            except PlanningError as exc:
                refusals.append(exc)
                continue
            found.append((result, where))
        if not found:
            raise refusals[0]
        return min(found, key=lambda pair: pair[0].best.predicted_step_s)

    def _search(
        self,
        workload: PpoWorkload,
        acc: Accelerator,
        num_slots: int,
        alternatives: int,
        keep: Mapping[str, tuple[int, int]] | None,
        fits_at: float,
        *,
        fixed: bool,
    ) -> PlanResult:
        """The planner's search on ``num_slots`` slots of ``acc``; with ``fixed``, every
        model-stage keeps its fixed (tp, pp); with ``keep``, the named ones keep those."""
        excluded = frozenset()
        if fixed:
            excluded = only_layouts(self.fixed, workload, acc, num_slots)
        if keep is not None:
            excluded |= only_layouts(keep, workload, acc, num_slots)
        result = plan(
            workload,
            acc,
            num_slots,
            efficiency=self.calibrator.efficiency(),
            num_alternatives=alternatives,
            excluded=excluded,
            fits_at=self._workload(fits_at) if fits_at > workload.gen_len else None,
        )
        if not (self.policy.fixed_micro_batches and self.kept_micro_batches):
            return result
        return dataclasses.replace(
            result,
            best=self._pinned(result.best, workload, acc),
            alternatives=tuple(self._pinned(p, workload, acc) for p in result.alternatives),
        )

    def _pinned(self, plan_: Plan, workload: PpoWorkload, acc: Accelerator) -> Plan:
        """With ``policy.fixed_micro_batches``: ``plan_`` with every model-stage in its kept
        micro-batch (``kept_micro_batches``), priced and sized at it. The search chose the layouts
        and data parallelism at the micro-batches it would pick; the plan runs the kept ones,
        even where the memory model says they will not fit (a static framework finds out by
        running out of memory)."""
        eff = {**cost_model.DEFAULT_EFFICIENCY, **self.calibrator.efficiency()}
        resident = training_state(plan_, workload)
        chosen = {}
        for ms in workload.model_stages():
            running = plan_.model_stage(ms.name)
            size = self.kept_micro_batches.get(ms.name, running.micro_batch)
            shape = LayoutShape.of_layout(ms, workload, acc, running.layout, size, resident)
            total, breakdown = cost_model.predict(shape, num_slots=plan_.num_slots, efficiency=eff)
            held = memory_breakdown(shape, num_slots=plan_.num_slots)
            chosen[ms.name] = dataclasses.replace(
                running,
                micro_batch=size,
                predicted_s=float(total[0]),
                breakdown=tuple((k, float(v[0])) for k, v in breakdown.items() if v[0] > 0),
                memory_per_slot=tuple((k, float(v[0])) for k, v in held.items() if v[0] > 0),
            )
        stages = tuple(
            dataclasses.replace(
                stage,
                predicted_s=stage_time(
                    stage.mode,
                    [chosen[ms.name].predicted_s for ms in workload.model_stages(stage.stage)],
                ),
            )
            for stage in plan_.stages
        )
        return dataclasses.replace(
            plan_,
            model_stages=tuple(chosen[ms.name] for ms in plan_.model_stages),
            stages=stages,
            predicted_step_s=sum(s.predicted_s for s in stages),
        )

    def _halve_micro_batches(self, report: StepReport) -> None:
        """With ``policy.fixed_micro_batches``, after a step ran out of memory: halve the kept
        micro-batch of the model-stage the failure names (of every training and inference one
        when it names none), as it ran in the running plan: training and inference to half
        their sequences per micro-batch (at least one), generation to half the sequences a unit
        decodes at once (twice the waves). The replan that follows restarts the job on them."""
        assert self.plan is not None
        named = re.match(r"out of memory (?:on slot \d+ )?in (\S+@\w+)", report.failure)
        names = [ms.name for ms in self.plan.model_stages]
        if named and named.group(1) in names:
            names = [named.group(1)]
        else:
            names = [n for n in names if not n.endswith("@generation")]
        workload = self._workload(report.gen_len or self._gen_len)
        changed = {}
        for ms in workload.model_stages():
            if ms.name not in names:
                continue
            shape = LayoutShape.of_plan(ms, workload, self.acc, self.plan)
            if ms.stage == "generation":
                now = int(shape.concurrent[0])
                halved = max(1, -(-now // 2))
            else:
                now = int(shape.mb[0])
                halved = max(1, now // 2)
            before = self.kept_micro_batches.get(
                ms.name, self.plan.model_stage(ms.name).micro_batch
            )
            self.kept_micro_batches[ms.name] = halved
            if halved != before:
                changed[ms.name] = [before, halved]
        self.emit(
            {
                "event": "control.micro_batches_halved",
                "step": report.step,
                "failure": report.failure,
                "changed": changed,
            }
        )

    def _weigh(self) -> None:
        """Plans are weighed now: the ``calibration`` signal measures from here."""
        self._weighed_with = {
            c: e for c, e in self.calibrator.efficiency().items() if c in PLAN_CLASSES
        }

    def _calibration_moved(self) -> tuple[float, str]:
        """The ``calibration`` signal, and what moved (``class was -> now``): the largest
        factor by which an operation class that ranks plans (every class but the
        transitions') and that the job's samples settle has moved since plans were last
        weighed, either way (a halving and a doubling count alike); 1 where none moved. A class
        the samples do not settle moves with its relatives, or on noise: it does not count."""
        now = self.calibrator.efficiency()
        settled = self.calibrator.settled()
        moves = [
            (max(now[c] / was, was / now[c]), c, was)
            for c, was in self._weighed_with.items()
            if c in settled and was > 0 and now.get(c, 0.0) > 0
        ]
        if not moves:
            return 1.0, ""
        factor, op_class, was = max(moves)
        moved = f"{op_class} {was:.3g} -> {now[op_class]:.3g}"
        load = self.calibrator.link_load(op_class.partition(":")[2])
        if load != 1.0:  # say how much of it is the links' load
            moved += f" (its link's load now x{load:.2f})"
        return factor, moved

    def _run_probes(self, engine: Engine) -> None:
        """Time alone each communication class that the live pool can run and calibration has
        not learned (``runtime/planner/probes.py``), before plans are weighed: at the start,
        and when the pool first spans more nodes than it did (a link no probe could reach
        before). A class that no step of the running plan exercises (the weight sync inside a
        node, on a pool of several) would otherwise borrow a relative's correction, and
        classes whose time grows alike with the length (decode and generation's all-reduce)
        are told apart by stage samples only as far as the layouts that ran differ; a probe
        measures each, and the fit starts from what it measured. Probing that the engine could
        not finish (a slot lost, units building ahead) is tried again at later replans, up to
        ``PROBE_ATTEMPTS`` in all; the job goes on meanwhile. Each link type's gauge class is
        timed even when learned (a calibration saved by an earlier job): the link's load now,
        against the reference that job measured with a gauge of the same shape, is what the
        first plans are priced at."""
        if not self.policy.calibration_probes:
            return
        alive = self._alive(engine)
        nodes = len({s // self.acc.gpus_per_node for s in alive})
        if nodes <= self._probed_nodes:
            return
        learned, referenced = self.calibrator.learned(), self.calibrator.referenced()
        gauges = set(LINK_GAUGES.values())
        probes = probes_for(self.workload, self.acc, alive, skip=learned - gauges)
        if not probes:
            self._probed_nodes = nodes
            return
        self._probe_attempts += 1
        try:
            report = engine.run_probes(probes)
        except ValueError as exc:  # a slot lost since the pool was read: nothing ran
            report = ProbeReport(
                measured_s=(), seconds=0.0, simulated=engine.simulated, failure=f"not probed: {exc}"
            )
        self.probe_s += report.seconds
        measured, load = {}, {}
        ran = list(zip(probes, report.measured_s, strict=False))
        # the gauges first: the other classes of a link are learned at the load they measure
        for probe, runs in sorted(ran, key=lambda pair: pair[0].op_class not in gauges):
            try:
                if probe.op_class in gauges:  # the load what it measures is learned under
                    load[probe.link] = self._observe_link(engine, probe, runs)
                if probe.op_class in learned and probe.link in referenced:
                    continue  # a gauge known, against a reference known: the load only
                measured[probe.op_class] = self.calibrator.measure(
                    probe.op_class, ideal_s=probe.ideal_s(self.acc), measured_s=runs
                )
            except ValueError as exc:
                logger.info("calibration probe dropped: %s", exc)
        if not report.failure or self._probe_attempts >= PROBE_ATTEMPTS:
            self._probed_nodes, self._probe_attempts = nodes, 0
        self.emit(
            {
                "event": "control.probes",
                "step": self.at_step,
                "efficiency": measured,
                "load": load,
                "slots": {p.op_class: list(p.slots) for p in probes},
                "seconds": report.seconds,
                "failure": report.failure,
                "simulated": report.simulated,
            }
        )

    def _probe_links(self, engine: Engine) -> None:
        """Every ``policy.link_probe_every_s`` of the job, between steps: time each link type's
        gauge class alone again (``probes.LINK_GAUGES``), and let calibration take the links'
        load from it, so that the samples of the steps that follow are learned at the load
        they ran under and plans are priced at the load now (``Calibrator.observe_link``). Not
        while units build ahead (the engine would refuse); a round that fails is tried again
        after the same while."""
        every = self.policy.link_probe_every_s
        if not (self.policy.calibration_probes and every > 0):
            return
        if engine.now() - self._links_probed_at < every or self.staged is not None:
            return  # a staged transition runs after the next step: the round waits for it
        probes = link_probes(self.workload, self.acc, self._alive(engine))
        if not probes:
            self._links_probed_at = engine.now()
            return
        try:
            report = engine.run_probes(probes)
        except ValueError as exc:  # a slot lost since the pool was read: nothing ran
            logger.info("links not probed: %s", exc)
            return  # tried again after the next step
        self.probe_s += report.seconds
        load = {}
        for probe, runs in zip(probes, report.measured_s, strict=False):
            try:
                load[probe.link] = self._observe_link(engine, probe, runs)
            except ValueError as exc:
                logger.info("link probe dropped: %s", exc)
        self.emit(
            {
                "event": "control.links",
                "step": self.at_step,
                "load": load,
                "seconds": report.seconds,
                "failure": report.failure,
                "simulated": report.simulated,
            }
        )

    def _observe_link(self, engine: Engine, probe: Probe, runs: Sequence[float]) -> float:
        """A link's gauge ``probe`` ran ``runs``: its load, as calibration takes it (the next
        round of ``_probe_links`` is due ``policy.link_probe_every_s`` from now)."""
        efficiency = probe.efficiency(self.acc, runs)
        load = self.calibrator.observe_link(probe.link, efficiency, gauge=probe.gauge)
        self._links_probed_at = engine.now()
        return load

    def initial_plan(self, engine: Engine) -> Plan:
        self._run_probes(engine)
        self._weigh()
        candidate = self._candidate(engine, self.workload)
        if not self.fixed:
            self.fixed = {ms.name: (ms.layout.tp, ms.layout.pp) for ms in candidate.model_stages}
        if not self.kept_micro_batches:
            self.kept_micro_batches = candidate.micro_batches(self.workload.micro_batch)
        self.plan = candidate
        self.monitor.pool = len(self._alive(engine))
        engine.start(candidate, self.workload)
        self.emit({"event": "control.plan", "plan": candidate.to_json(), "reason": "initial"})
        return candidate

    # --- each step ------------------------------------------------------------------------------

    def after_step(self, report: StepReport, engine: Engine) -> None:
        """Learn from the step, fire triggers, and act on the most pressing one."""
        assert self.plan is not None
        self.at_step = report.step
        self.ran_step = report.step
        if report.ok:  # the load the step's samples are learned under: the links' right after
            self._probe_links(engine)
        for sample in report.samples:
            try:
                self.calibrator.observe_sample(sample)
            except ValueError as exc:
                logger.info("calibration sample dropped: %s", exc)
        if report.samples:
            self._emit_calibration(report)
            self._sampled_steps += 1
            if self._sampled_steps >= OUTLOOK_WINDOW:
                efficiency, learned = self.calibrator.efficiency(), self.calibrator.learned()
                self._calibrated.append((report.step, {c: efficiency[c] for c in learned}))
        triggers: list[Trigger] = []
        # The first step after a transition whose new units joined during it generated on part
        # of its units while they built: its time, efficiency and peak are not the plan's, and
        # neither drift nor the memory model learns from them.
        settling = self._settling and report.ok
        self._settling = self._settling and not report.ok
        if not settling:
            self._learn_memory(report)
        if report.ok:
            self._gen_len = report.gen_len
            signals = {"gen_len": report.gen_len}
            moved = ""
            if not settling:
                calibration, moved = self._calibration_moved()
                predicted = self._price(self.plan, self._workload(report.gen_len))
                signals |= {
                    "step_time": report.seconds,
                    "peak_memory": report.peak_memory,
                    "efficiency": predicted / report.seconds if report.seconds > 0 else 1.0,
                    "calibration": calibration,
                }
            # The pool signal counts the live slots: one lost outside the plan (an idle slot
            # failing) changes what the job may use as a revocation does.
            fired = self.monitor.observe(report.step, signals, pool=len(self._alive(engine)))
            triggers += [
                dataclasses.replace(
                    t,
                    spared=t.kind == "pool" and not self._off_pool(engine),
                    # which efficiency moved, not only by how much
                    detail=(
                        f"calibration: {moved} (x{t.value:.2f} since plans were weighed)"
                        if t.signal == "calibration"
                        else t.detail
                    ),
                )
                for t in fired
            ]
            triggers += self._memory_ahead(report.step)
        else:
            if report.gen_len > 0 and "out of memory" in report.failure:
                self._gen_len = report.gen_len  # the length that did not fit
            if self.policy.fixed_micro_batches and "out of memory" in report.failure:
                self._halve_micro_batches(report)
            triggers.append(Trigger(kind="failure", step=report.step, detail=report.failure))
            self.monitor.observe(report.step, {}, pool=len(self._alive(engine)))
        self._expire_pending(engine)
        if self.staged is not None:
            self._run_staged(report, triggers, engine)
        if not triggers:
            if self.deferred is not None and report.ok:
                self._reconsider(report.step, engine)
            return
        for trigger in triggers:
            self.emit({"event": "control.trigger", **trigger.to_json()})
        trigger = min(triggers, key=lambda t: (not t.urgent, t.kind != "failure"))
        self.replan(trigger, engine)

    def before_step(self, engine: Engine, step: int) -> None:
        """Slots revoked or failed since the last step: the urgent path, before the plan runs."""
        self.at_step = step
        if self._off_pool(engine):
            lost, size = engine.lost_slots(), engine.pool_size()
            used = {s for ms in self.plan.model_stages for s in ms.slots}
            gone, leaving = sorted(used & lost), sorted(s for s in used - lost if s >= size)
            detail = "; ".join(
                [f"slots {gone} gone"] * bool(gone)
                + [f"slots {leaving} leave the pool"] * bool(leaving)
            )
            trigger = Trigger(kind="failure", step=step, detail=detail)
            self.emit({"event": "control.trigger", **trigger.to_json()})
            self.replan(trigger, engine)

    def _off_pool(self, engine: Engine, plan_: Plan | None = None) -> bool:
        """Whether ``plan_`` (the running plan) uses a slot that is lost or out of the pool."""
        plan_ = plan_ or self.plan
        assert plan_ is not None
        lost, size = engine.lost_slots(), engine.pool_size()
        return any(s in lost or s >= size for ms in plan_.model_stages for s in ms.slots)

    def _learn_memory(self, report: StepReport) -> None:
        """Keep the largest measured-over-predicted peak (an out-of-memory step reports its peak
        too, above 100% of the device)."""
        assert self.plan is not None
        if not report.ok and "out of memory" not in report.failure:
            return
        if report.peak_memory <= 0:
            return
        workload = self._workload(report.gen_len)
        predicted = max(
            float(
                total_bytes(
                    memory_breakdown(
                        LayoutShape.of_plan(ms, workload, self.acc, self.plan),
                        num_slots=self.plan.num_slots,
                    )
                )[0]
            )
            for ms in workload.model_stages()
        )
        ratio = report.peak_memory * self.acc.memory_bytes / predicted
        # After an out-of-memory step, keep 5% beyond what was seen: the next plan must not fail.
        self.memory_factor = max(self.memory_factor, ratio * (1.0 if report.ok else 1.05))

    def _price(
        self, plan_: Plan, workload: PpoWorkload, efficiency: Mapping[str, float] | None = None
    ) -> float:
        """Predicted step seconds of ``plan_`` at ``workload``, calibrated as now (or with
        ``efficiency``: as calibrated at some earlier step)."""
        if efficiency is None:
            efficiency = self.calibrator.efficiency()
        return price_plan(plan_, workload, self.acc, efficiency=efficiency)

    def _memory_ahead(self, step: int) -> list[Trigger]:
        """A violation predicted from the generated length's trend, at the next step or within
        the lookahead (never beyond the run's end; a lookahead of 0 turns it off); once fired,
        it waits a lookahead before firing again for the same plan."""
        horizon = self._memory_horizon(step)
        if self.plan is None or horizon < 1:
            return []
        if self._memory_quiet_until > step:
            # Quiet, but not deaf: a step the devices themselves cannot hold fails and loses
            # the state since the last checkpoint, which the move refused before (only the
            # budget was outgrown then) did not weigh; the replan restarts on feasibility alone.
            # Once per quiet period, and only for a policy that moves: a replan that cannot
            # move either is not asked again every step (each would reset every reference).
            if (
                self.policy.admission == "never"
                or self._memory_escalated_until == self._memory_quiet_until
            ):
                return []
            found = self._violation(step, horizon, headroom=False)
            if found is None:
                return []
            self._memory_escalated_until = self._memory_quiet_until
            return [found]
        found = self._violation(step, 1) or self._violation(step, horizon)
        if found is None:
            return []
        # Once fired for this plan, quiet for a lookahead (a move resets it): a refused move is
        # not asked again every step, which would reset every drift reference each time.
        self._memory_quiet_until = step + max(1, self.policy.lookahead_steps)
        return [found]

    def _violation(self, step: int, steps_ahead: int, *, headroom: bool = True) -> Trigger | None:
        """A memory trigger if the running plan does not fit (its budget, or with ``headroom``
        False the devices) the length the trend reaches ``steps_ahead`` steps on."""
        ahead = self._forecast(steps_ahead)
        if ahead is None or ahead <= self._gen_len:
            return None
        for ms, need in self._needs(self.plan, ahead):
            if not self._within(need, headroom):
                return Trigger(
                    kind="memory",
                    signal="gen_len",
                    value=ahead,
                    reference=self._gen_len,
                    step=step,
                    detail=f"{ms.name} needs {byte_size(need * self.memory_factor)} "
                    f"at gen_len {ahead:.0f}",
                )
        return None

    def _memory_horizon(self, step: int) -> int:
        """Steps a memory forecast looks ahead: the lookahead, or the steps the run has left."""
        left = self._steps_left(step)
        return int(min(self.policy.lookahead_steps, left))

    def _forecast(self, steps_ahead: int) -> float | None:
        """The generated length ``steps_ahead`` steps on, by the trend of the last 16."""
        return self.monitor.trend("gen_len", steps_ahead, window=16)

    def _needs(self, plan_: Plan, gen_len: float, *, least: bool = False):
        """Each model-stage and the bytes its fullest slot needs at ``gen_len``, by the
        planner's memory model on the device as the planner sees it (its memory shrunk by the
        measured factor: ``_measured_accelerator``); with ``least``, at its smallest micro-batch
        (what its layout needs at the least)."""
        workload = self._workload(gen_len)
        acc = self._measured_accelerator()
        for ms in workload.model_stages():
            shape = LayoutShape.of_plan(ms, workload, acc, plan_)
            if least and not self.policy.fixed_micro_batches:  # else its own is its least
                shape = dataclasses.replace(shape, micro_batch=batchings(shape)[-1])
            yield ms, float(total_bytes(memory_breakdown(shape, num_slots=plan_.num_slots))[0])

    def _fits(self, plan_: Plan, gen_len: float, *, headroom: bool = True) -> bool:
        """Whether ``plan_`` fits its slots' budget at ``gen_len``, by the measured factor;
        ``headroom`` False: whether it fits the devices at all (else a step runs out)."""
        return all(self._within(need, headroom) for _, need in self._needs(plan_, gen_len))

    def _within(self, need: float, headroom: bool = True) -> bool:
        """Whether a slot needing ``need`` bytes (from ``_needs``) fits the device as the
        planner sees it: in its planning budget, or (``headroom`` False) at all. The planner's
        own test, so that a plan it picks is one the controller calls fitting."""
        capacity = self._measured_accelerator().memory_bytes
        return need <= (memory_budget(capacity) if headroom else capacity)

    def _runway(self, step: int) -> int:
        """Steps a new plan is expected to last: the longer of the generated length's and the
        slot pool's effective drift horizons (a plan is replaced when one of them moves it, and
        a replan often keeps it), at least twice the lookahead and at most what the run has
        left; 0 with forecasting off."""
        if self.policy.lookahead_steps == 0:
            return 0
        drift = self._horizon(("gen_len", POOL), step)
        return int(min(self._steps_left(step), max(2 * self.policy.lookahead_steps, drift)))

    def _lasts(self, plan_: Plan, runway: int) -> int:
        """Steps, up to ``runway``, before a memory trigger would fire for ``plan_``: until the
        trend comes within the lookahead of outgrowing what it fits."""
        if not self._fits(plan_, self._forecast(runway) or 0.0):
            low, high = 0, runway  # fits at low (or nowhere), not at high: bisect
            while high - low > 1:
                middle = (low + high) // 2
                low, high = (
                    (middle, high)
                    if self._fits(plan_, self._forecast(middle) or 0.0)
                    else (low, middle)
                )
            return max(0, low - self.policy.lookahead_steps)
        return runway

    def _cheapest(
        self,
        engine: Engine,
        workload: PpoWorkload,
        trigger: Trigger,
        candidate: Plan,
        floor: float,
    ) -> tuple[Plan, bool]:
        """The plan to move to, and whether only a checkpoint/restart reaches it: of the
        planner's ``candidate`` and the other options, the one
        with the least step time plus its move's cost spread over the steps it lasts (before
        memory forces the next move, or the runway ends), over one window for all
        (``windowed_step_s``: one that must move sooner pays for that move too). When no live
        move reaches the planner's plan, the fastest plan one reaches is weighed beside it, and
        it is weighed at a checkpoint/restart's cost (a restart to a much faster plan can repay
        where the live moves left save too little). The other options: for each length
        the memory runway asks a plan to fit, the fastest plan that fits it, the fastest
        that changes only the model-stages whose layouts no longer fit it (so rebuilding no
        engine it need not), which is the running plan itself when every layout still fits,
        and the running layouts in the micro-batches (generation: waves) that fit it, which
        moves no state: staying costs nothing, so a move that would not repay within the
        steps its plan lasts is not asked for. A plan that must move again in ten steps
        carries a tenth of its move's cost in each step; a plan for a longer length, its
        slower steps; a plan that rebuilds the generation engines, their start-up. When no
        live move reaches any, the planner's plan goes on to admission, which weighs a
        checkpoint/restart."""
        assert self.plan is not None
        # A move away from a plan about to outgrow memory is not staged (admission's rule).
        stage = trigger.kind != "memory"
        candidate_cost = self._move_cost(engine, candidate, workload, stage=stage)
        runway = self._runway(trigger.step)
        shortest = self.policy.memory_runway == "shortest"
        options = [candidate] if shortest and candidate_cost is not None else []
        restart_cost = None
        if candidate_cost is None:
            # No live move reaches the planner's plan: the fastest that one reaches is weighed
            # (else staying, which costs nothing, might be all that is left), and so is a
            # checkpoint/restart to the planner's plan.
            found = self._reachable(engine, workload, candidate, broken=False, fits_at=floor)
            if found is not None:
                options.append(found[0])
            if self.policy.admission == "payback":
                restart_cost = self._restart_estimate(candidate, workload)
                options.append(candidate)
        for length in self._runway_lengths(floor, runway):
            kept = self._still_fitting(length)
            found = []
            for keep in ([] if shortest else [None]) + ([kept] if kept else []):
                try:
                    found.append(self._plans(engine, workload, keep=keep, fits_at=length)[0])
                except PlanningError:
                    continue
            again = self._rebatched(workload, length)
            if again is not None and not self._same_plan(again, self.plan):
                found.append(again)
            options += found
            if found and self.policy.memory_runway == "longest":
                break  # the furthest length that some plan fits
        weighed: list[tuple[Plan, Option]] = []
        for option in options:
            if any(self._same_plan(option, p) for p, _ in weighed):
                continue
            if option is candidate:
                cost = candidate_cost if candidate_cost is not None else restart_cost
            else:
                cost = self._move_cost(engine, option, workload, stage=stage)
            if cost is None:
                continue
            step_s = self._price(option, workload)
            weighed.append((option, Option(step_s, cost, self._lasts(option, runway))))
        if not weighed:
            return candidate, False
        rates = windowed_step_s([o for _, o in weighed])
        chosen = weighed[min(range(len(rates)), key=rates.__getitem__)][0]
        return chosen, chosen is candidate and candidate_cost is None

    def _rebatched(self, workload: PpoWorkload, fits_at: float) -> Plan | None:
        """The running layouts, each in the micro-batch (generation: the waves) that the
        planner would give it at ``workload``, fitting ``fits_at`` as well in the memory the
        devices really give; None if some layout fits in none (or the policy keeps the
        micro-batches: ``fixed_micro_batches``)."""
        assert self.plan is not None
        if self.policy.fixed_micro_batches:
            return None
        return rebatched(
            self.plan,
            workload,
            self._measured_accelerator(),
            efficiency=self.calibrator.efficiency(),
            fits_at=self._workload(fits_at) if fits_at > workload.gen_len else None,
        )

    def _runway_lengths(self, floor: float, runway: int) -> list[float]:
        """The generated lengths a new plan may be asked to fit, by the memory runway policy:
        ``floor``; what the trend reaches 2, 4, 8, … lookaheads on, up to the runway; or those
        from the furthest down (the first that some plan fits is taken)."""
        if self.policy.memory_runway == "shortest":
            return [floor]
        ahead = sorted({min(runway, self.policy.lookahead_steps << i) for i in range(1, 16)})
        lengths = [max(floor, self._forecast(steps) or 0.0) for steps in ahead]
        return lengths[::-1] if self.policy.memory_runway == "longest" else lengths

    def _move_cost(
        self, engine: Engine, option: Plan, workload: PpoWorkload, *, stage: bool = True
    ) -> float | None:
        """What moving to ``option`` costs as admission will price it (with ``stage``, the
        cheaper of building its new units in the transition or ahead of it; 0 to stay); None
        when no live move reaches it."""
        assert self.plan is not None
        if option.places_like(self.plan):  # the same plan, or other micro-batches: nothing moves
            return 0.0
        try:
            dag = self._compile(engine, option, workload)
        except TransitionRefusedError:
            return None
        if not (stage and dag.ahead):
            return dag.cost_s
        current_s = self._price(self.plan, workload)
        return min(dag.cost_s, self._staged_cost(dag, option, workload, current_s))

    def _staged_cost(self, dag, option: Plan, workload: PpoWorkload, current_s: float) -> float:
        """``staged_cost`` of moving to ``option`` by ``dag``, priced under calibration."""
        joining_s = self._joining_s(dag, option, workload, built=dag.ahead)
        return staged_cost(dag, current_s, self._price(option, workload), joining_s)

    def _still_fitting(self, gen_len: float) -> dict[str, tuple[int, int]]:
        """The running (tp, pp) of every model-stage whose layout still fits ``gen_len`` (at
        its smallest micro-batch: a smaller micro-batch moves no state)."""
        assert self.plan is not None
        running = _layouts(self.plan)
        return {
            ms.name: running[ms.name]
            for ms, need in self._needs(self.plan, gen_len, least=True)
            if self._within(need)
        }

    def _envelope(self) -> float:
        """The longest generated length of the last ``OUTLOOK_WINDOW`` steps: a plan chosen
        when the length is low must still fit when it comes back up."""
        return max([self._gen_len, *self._recent_lengths()])

    def _recent_lengths(self) -> list[float]:
        """The generated lengths of the last ``OUTLOOK_WINDOW`` steps."""
        return [v for _, v in self.monitor.history["gen_len"][-OUTLOOK_WINDOW:]]

    # --- replanning and admission ---------------------------------------------------------------

    def replan(self, trigger: Trigger, engine: Engine) -> None:
        assert self.plan is not None
        # A memory move plans for the length the trend reaches within the lookahead (or what
        # is left of the run), whichever trigger brought it: the one admission weighs.
        horizon = self._memory_horizon(trigger.step) if trigger.kind == "memory" else 0
        nearest = self._forecast(horizon) if horizon > 0 else None
        gen_len = self._gen_len
        if trigger.kind == "memory":
            gen_len = max(gen_len, trigger.value, nearest or 0.0)
        workload = self._workload(gen_len)
        self.monitor.replanned()
        building = self.staged is not None or (self.pending is not None and self.pending.ahead)
        if not building:  # else units are building ahead: the probes would wait for them
            self._run_probes(engine)
        self._weigh()
        self.deferred = None
        self.staged = None
        broken = trigger.kind == "failure" or self._off_pool(engine)
        if self.policy.admission == "never" and not broken:
            self.emit(self._decision(trigger, None, None, "the policy never adapts"))
            return
        # Whatever brought the replan, its plan must not be one the memory lookahead would
        # move straight back: the length the trend reaches within the lookahead bounds it too.
        lookahead = self._memory_horizon(trigger.step)
        envelope = max(self._envelope(), (self._forecast(lookahead) if lookahead else None) or 0.0)
        try:
            candidate = self._candidate(engine, workload)
            if not trigger.urgent and not broken and not self._fits(candidate, envelope):
                # Best at this length but too big for lengths the job has just seen or is
                # about to: the fastest that fits the longest of them instead (the swing is
                # likely to come back; the trend, to go on).
                candidate = self._candidate(engine, workload, fits_at=envelope)
        except PlanningError as exc:
            self.emit(self._decision(trigger, None, None, f"no feasible plan: {exc}"))
            return
        by_restart = False
        if not (trigger.urgent or broken) and self.policy.admission == "payback":
            floor = max(gen_len, envelope)
            candidate, by_restart = self._cheapest(engine, workload, trigger, candidate, floor)
        if not broken and candidate.places_like(self.plan):
            if self._same_plan(candidate, self.plan):
                self.emit(
                    self._decision(trigger, candidate, None, "the running plan is still best")
                )
            else:
                self._rebatch(candidate, trigger)
            return
        current_s = math.inf if broken else self._price(self.plan, workload)
        candidate_s = self._price(candidate, workload)
        route = "restart" if self.policy.admission in ("restart", "never") else "live"
        infeasible, dag, no_live_route = "", None, ""
        if route == "live":
            try:
                dag = self._compile(engine, candidate, workload)
            except TransitionRefusedError as exc:
                # Weighed already against the plans a live move reaches, and chosen at a
                # restart's cost: no alternative is looked for.
                found = None if by_restart else self._reachable(engine, workload, candidate, broken)
                if found is None and not broken:
                    # No order of the primitives reaches the candidate, nor any alternative:
                    # a checkpoint/restart still can. It is one more route with its own (much
                    # larger) cost, and admission weighs it like any other.
                    route, no_live_route = "restart", str(exc)
                elif found is None:
                    infeasible = str(exc)
                else:
                    self.emit(
                        self._decision(
                            trigger, candidate, None, f"unreachable, trying the next best: {exc}"
                        )
                    )
                    (candidate, dag), candidate_s = found, self._price(found[0], workload)
                    if not broken and candidate.places_like(self.plan):
                        self._rebatch(candidate, trigger)  # other micro-batches: nothing moves
                        return
        urgent = trigger.urgent
        # A violation ahead: at the length the trend reaches within the lookahead, the running
        # plan will not fit. Staying risks an out-of-memory step, and with it the state since the
        # last checkpoint, so a feasible move is made on feasibility alone: a live one when the
        # plan outgrows its planning budget (the headroom is for noise, not for growth), a
        # restart only when it outgrows the devices themselves.
        outgrown = (
            not broken
            and nearest is not None
            and nearest > self._gen_len
            and (
                not self._fits(self.plan, nearest, headroom=False)
                or (route == "live" and not self._fits(self.plan, nearest))
            )
        )
        overflows = trigger.detail if outgrown else ""
        ahead = False
        if route == "restart":
            cost = self._restart_estimate(candidate, workload)
        else:
            cost = math.inf if dag is None else dag.cost_s
            if dag is not None and dag.ahead and not (urgent or broken or overflows):
                # Build the new units on idle slots during one more step, when that is cheaper.
                staged = self._staged_cost(dag, candidate, workload, current_s)
                ahead = staged < cost
                cost = min(cost, staged)
        outlook = Outlook(signals=(trigger.signal,))
        if not broken and trigger.kind in ("drift", "pool") and candidate_s < current_s:
            outlook = self._outlook(candidate, trigger)
        verdict = decide(
            admission=self.policy.admission,
            current_s=current_s,
            candidate_s=candidate_s,
            cost_s=cost,
            horizon_steps=self._horizon(outlook.signals, trigger.step),
            gamma=self.policy.gamma,
            urgent=urgent,
            infeasible=infeasible,
            steps_left=self._steps_left(trigger.step),
            overflows=overflows,
            min_saving=self.policy.min_saving,
            contested=outlook.contested,
        )
        if not broken:  # a move off a broken plan is forced, whatever its trigger
            verdict = self._vetoed(verdict, candidate, trigger)
        if no_live_route:
            verdict = dataclasses.replace(
                verdict,
                reason=f"{verdict.reason}, by checkpoint/restart (no live route: {no_live_route})",
            )
        self.emit(
            self._decision(
                trigger,
                candidate,
                verdict,
                verdict.reason,
                dag=dag,
                outlook=outlook,
                route=route,
                ahead=ahead,
                forced=broken,
            )
        )
        if not verdict.admit and verdict.reason.startswith(("pays back", CONTESTED)):
            # Too slow to repay now, or faster only as calibration stands now: keep it, and
            # admit it if the signal stays calm long enough (and calibration comes to agree:
            # the replan has reset the signals, so a lasting change would not trigger again).
            self.deferred = Deferred(
                plan=candidate,
                cost_s=cost,
                trigger=trigger,
                signals=outlook.signals,
                route=route,
                ahead=ahead,
            )
        if not verdict.admit:
            salvaged = self._off_pool(engine) and self._salvage(trigger, workload, engine)
            if broken and not salvaged:
                # The urgent path's fallback: no feasible live transition from the intact units.
                self._restart(candidate, workload, engine, because=verdict.reason)
            return
        if self._needs_approval(verdict, urgent):
            self._propose(candidate, verdict, trigger, engine, route=route, dag=dag)
            return
        if route == "restart":
            self._restart(candidate, workload, engine, because=verdict.reason)
        elif ahead:
            self._stage(candidate, workload, dag, trigger, engine, step=trigger.step)
        else:
            self._apply(candidate, workload, dag, engine)

    def _stage(
        self, candidate: Plan, workload: PpoWorkload, dag, trigger, engine, *, step: int
    ) -> None:
        """Start building ``dag.ahead`` on the engine and run the transition after the step
        that follows ``step``."""
        self._build_ahead(candidate, workload, dag, engine, step=step)
        self.staged = Staged(plan=candidate, trigger=trigger, ahead=dag.ahead)

    def _build_ahead(self, candidate, workload, dag, engine, *, step: int, **about) -> None:
        """Start building ``dag.ahead`` (new units on slots the running plan leaves idle)."""
        units: dict[str, list[tuple[int, ...]]] = {}
        for name, slots in sorted(dag.ahead):
            units.setdefault(name, []).append(slots)
        engine.build_ahead(candidate, workload, {n: tuple(us) for n, us in units.items()})
        self.emit(
            {
                "event": "control.building_ahead",
                "units": len(dag.ahead),
                "predicted_s": dag.ahead_makespan(),
                "step": step,
                "simulated": bool(getattr(engine, "simulated", False)),
                **about,
            }
        )

    def _run_staged(self, report: StepReport, triggers: list[Trigger], engine: Engine) -> None:
        """After the step that built units ahead: run the staged transition, unless the step
        failed or something urgent came up (then the replan that follows decides afresh)."""
        assert self.staged is not None
        staged, self.staged = self.staged, None
        if (
            not report.ok
            or any(t.urgent for t in triggers)
            or self._off_pool(engine)
            or self._off_pool(engine, staged.plan)  # slots it was to move onto went
        ):
            engine.drop_ahead()
            self.emit(
                self._decision(
                    staged.trigger,
                    staged.plan,
                    None,
                    "staged transition dropped: replanning",
                    step=report.step,
                )
            )
            return
        workload = self._workload(self._gen_len)
        try:
            dag = self._compile(engine, staged.plan, workload, built_ahead=staged.ahead)
        except TransitionRefusedError as exc:
            self.emit(
                self._decision(
                    staged.trigger, staged.plan, None, f"infeasible now: {exc}", step=report.step
                )
            )
            if not triggers:  # else the replan for them follows
                self._replan_now(staged.trigger, report.step, engine)
            return
        self._apply(staged.plan, workload, dag, engine)

    def _replan_now(self, trigger: Trigger, step: int, engine: Engine) -> None:
        """A move in hand that became infeasible (slots it counted on were lost): replan on
        the live slots at once. No later trigger need come: a lost idle slot may be the only
        change, and the job would stay on its plan for good."""
        self.replan(dataclasses.replace(trigger, step=step), engine)

    def _outlook(self, candidate: Plan, trigger: Trigger) -> Outlook:
        """The horizon a non-urgent move's saving lasts for: which signals it rests on.

        The seed's rule repays a move within the triggering signal's horizon: the saving is
        assumed to end when that signal next crosses its threshold. That holds when the saving
        comes from the signal's value (a layout that is faster at a longer length). It does not
        when the candidate is faster at *every* generated length of the last ``OUTLOOK_WINDOW``
        steps (typically: it uses slots the pool just gave): the length swinging within that
        range again will not end the saving, and the move repays over the slot pool's horizon
        as well as the trigger's own (the larger of the two). The saving itself is the one at
        the latest length either way.

        The same holds of what calibration has learned over those steps: interference that
        comes and goes moves the learned efficiencies of the links back and forth, and a
        candidate faster only under the latest of them (a layout with more tensor parallelism
        once the all-reduce looks fast again) loses its saving when they swing back. So the
        candidate must also be faster, at the latest length, under the calibrations of the
        window's oldest, quartiles and latest steps. A candidate that is not rests on the
        calibration as it is now, which the window has seen otherwise: admission does not make
        that move now (``decide``'s ``contested``), but keeps it (``Deferred``) and weighs it
        again each calm step: a lasting change is taken once the window has seen only it. (The
        window leaves out calibration's learning: see ``_calibrated``.)

        A length that trends rather than swings leaves that range: the candidate must also be
        faster at the length the trend reaches by the end of the longer window it would be
        granted (gamma times that horizon, within the run), else a saving that the growth
        erodes before the move repays would be admitted on a horizon it does not last for,
        and undone by the next move."""
        assert self.plan is not None
        recent = self._recent_lengths()
        lengths = sorted({*_quantiles(recent), self._gen_len}) if recent else [self._gen_len]
        longer = self._horizon((trigger.signal, POOL), trigger.step)
        window = int(min(self.policy.gamma * longer, self._steps_left(trigger.step)))
        ahead = self._forecast(window) if window > 0 else None
        trend = None if ahead is None else max(1.0, ahead)
        robust = all(
            self._price(self.plan, w) > self._price(candidate, w)
            for w in map(self._workload, [*lengths, *([trend] if trend else [])])
        )
        calibrations, slower_under = self._calibration_check(candidate)
        robust = robust and slower_under is None
        signals = (trigger.signal, POOL) if robust else (trigger.signal,)
        return Outlook(
            signals=tuple(dict.fromkeys(signals)),
            lengths=tuple(lengths),
            robust=robust,
            trend_length=trend,
            calibrations=calibrations,
            slower_under=slower_under,
        )

    def _calibration_check(
        self, candidate: Plan
    ) -> tuple[tuple[int, ...], tuple[int, float] | None]:
        """Price the running plan and ``candidate`` at the latest length under the calibrations
        of the oldest, quartiles and latest steps of ``_calibrated``: those steps, and the first
        under which the candidate saves nothing (its step and saving; None if none). A class
        not yet learned at one of those steps takes its efficiency as calibrated now: what
        calibration did not know then (a default, a relative's correction) is not a state the
        cluster was in, and learning it is no swing."""
        assert self.plan is not None
        history = self._calibrated
        if not history:
            return (), None
        last = len(history) - 1
        picked = dict(history[round(q * last)] for q in (0.0, 0.25, 0.5, 0.75, 1.0))
        now = self._workload(self._gen_len)
        current = self.calibrator.efficiency()
        for step, learned in picked.items():
            efficiency = {**current, **learned}
            saving = self._price(self.plan, now, efficiency) - self._price(
                candidate, now, efficiency
            )
            if saving <= 0:
                return tuple(picked), (step, saving)
        return tuple(picked), None

    def _horizon(self, signals: tuple[str, ...], step: int) -> float:
        """H for admission: the longest effective horizon among the signals the saving rests on."""
        return max(self.monitor.effective_horizon(s, step) for s in signals)

    def _reachable(
        self,
        engine: Engine,
        workload: PpoWorkload,
        refused: Plan,
        broken: bool,
        *,
        fits_at: float = 0.0,
    ):
        """The planner's best plan could not be reached live (no order of the primitives fits
        the slots' memory): the fastest plan that can, among the planner's next alternatives and
        the running layouts with data parallelism replanned (fitting up to ``fits_at`` too).
        Feasibility is the transition's as much as the target's. None when no such plan differs
        from the running one."""
        assert self.plan is not None
        plans: list[Plan] = []
        for keep, count in ((None, REACHABLE_ALTERNATIVES), (_layouts(self.plan), 0)):
            try:
                plans += self._plans(
                    engine, workload, keep=keep, alternatives=count, fits_at=fits_at
                )
            except PlanningError:
                continue
        found = []
        seen = [refused]
        for option in plans:
            if any(self._same_plan(option, p) for p in seen):
                continue
            seen.append(option)
            if not broken and self._same_plan(option, self.plan):
                continue
            try:
                dag = self._compile(engine, option, workload)
            except TransitionRefusedError:
                continue
            found.append((self._price(option, workload), len(found), option, dag))
        if not found:
            return None
        _, _, option, dag = min(found)
        return option, dag

    def _cluster(self, engine: Engine) -> Cluster:
        """The slots a transition may touch: the pool, plus slots out of it that units still
        name: written off where the engine reports them lost (revoked), and moved off as
        sources where it does not (a shrink announced ahead: they hold their state until it)."""
        named = [s for us in engine.units().values() for u in us for s in u.slots]
        size = max([engine.pool_size(), *(s + 1 for s in named)])
        lost = {s for s in engine.lost_slots() if s < size}
        free = self._transition_capacity(engine.pool_size())
        extra = {}
        if getattr(engine, "rebuild_s", None):  # an engine that measures its own rebuilds
            extra["rebuild_s"] = tuple(engine.rebuild_s)
        return Cluster(
            accelerator=self.acc,
            num_slots=size,
            capacity_bytes=(free,) * size,
            lost_slots=frozenset(lost),
            **extra,
        )

    def _transition_capacity(self, pool: int) -> float:
        """What a slot can give the training units during a transition: its budget less the
        frozen models' resting shards (spread over the pool, as the planner assumes)."""
        frozen = sum(
            self.workload.models[role].num_params(scalar_head=role == "reward")
            for role in ("ref", "reward")
        )
        return self.capacity / self.memory_factor - frozen * self.workload.bytes_per_value / pool

    def _compile(
        self,
        engine: Engine,
        candidate: Plan,
        workload: PpoWorkload,
        *,
        built_ahead: frozenset[tuple[str, tuple[int, ...]]] = frozenset(),
    ):
        """The transition to ``candidate``, of which ``built_ahead`` units (when they are among
        its ``ahead``) were started before it, priced with what its joining units cost."""
        dag = diff(
            engine.units(),
            candidate,
            self._cluster(engine),
            workload,
            efficiency=self.calibrator.efficiency(),
            tag=f"t{self.transitions + self.restarts + 1}",
            derived_from=self.plan,
        )
        dag.built_ahead = dag.ahead & built_ahead
        dag.joining_s = self._joining_s(dag, candidate, workload, built=dag.built_ahead)
        return dag

    def _joining_s(
        self, dag, candidate: Plan, workload: PpoWorkload, *, built: frozenset = frozenset()
    ) -> float:
        """What the first step on ``candidate`` loses while the units joining when ``built``
        were built ahead build: its generation on the units built (or the builds, if they take
        longer) against generation on every unit."""
        joining = dag.joining_for(built)
        if not joining:
            return 0.0
        eff = self.calibrator.efficiency()
        partial = on_ready(candidate, workload, self._measured_accelerator(), joining)
        assert partial is not None  # units join only beside generation units that are built
        whole_s = stage_prices(candidate, workload, self.acc, efficiency=eff)["generation"]
        ready_s = stage_prices(partial, workload, self.acc, efficiency=eff)["generation"]
        # Never a gain: the whole plan's units could decode as the built ones do.
        return max(0.0, max(ready_s, dag.build_makespan(joining)) - whole_s)

    def _salvage(self, trigger: Trigger, workload: PpoWorkload, engine: Engine) -> bool:
        """When the planner's candidate cannot be reached live: keep running on what survived.
        Every model-stage keeps its intact units (fewer data-parallel replicas, same layouts), so
        the transition only releases the broken units' remains; a normal replan can improve on it
        later, when it pays. False when some model-stage has no intact unit left."""
        assert self.plan is not None
        lost, size = engine.lost_slots(), engine.pool_size()
        layouts = {}
        for ms in self.plan.model_stages:
            kept = tuple(u for u in ms.units if not any(s in lost or s >= size for s in u))
            if not kept:
                return False
            layouts[ms.name] = (dataclasses.replace(ms.layout, dp=len(kept)), kept)
        salvage = dataclasses.replace(
            Plan.of_units(accelerator=self.acc.name, num_slots=size, layouts=layouts),
            stages=self.plan.stages,
            models=self.plan.models,
        )
        if self.policy.fixed_micro_batches and self.kept_micro_batches:
            salvage = self._pinned(salvage, workload, self.acc)
        try:
            dag = self._compile(engine, salvage, workload)
        except TransitionRefusedError as exc:
            self.emit(self._decision(trigger, salvage, None, f"salvage impossible: {exc}"))
            return False
        self.emit(self._decision(trigger, salvage, None, "salvage: keep the intact units", dag=dag))
        self._apply(salvage, workload, dag, engine)
        return True

    def _vetoed(self, verdict: Verdict, candidate: Plan, trigger: Trigger) -> Verdict:
        """``verdict``, refused where ``veto`` refuses the move: one admitted for its saving
        (``why_moved``), asked at the step of the decision. A refusal is not kept for later: a
        veto is not a price that may change."""
        if self.veto is None or not verdict.admit or self.plan is None:
            return verdict
        if why_moved(trigger.kind, verdict.reason) != "saving":
            return verdict
        why = self.veto(self.plan, candidate, trigger.step)
        return (
            dataclasses.replace(verdict, admit=False, reason=f"vetoed: {why}") if why else verdict
        )

    def _steps_left(self, step: int) -> float:
        """Steps the run has after ``step`` (no known end: infinitely many)."""
        return math.inf if self.last_step is None else max(0, self.last_step - step)

    def _reconsider(self, step: int, engine: Engine) -> None:
        """Re-run admission for the deferred candidate with the horizon as it is now, and both
        plans priced at the length as it is now (the signal stayed calm, but a trend within
        the threshold can still carry a layout past where it was faster)."""
        assert self.deferred is not None
        deferred = self.deferred
        candidate, trigger, route = deferred.plan, deferred.trigger, deferred.route
        now = self._workload(self._gen_len)
        verdict = decide(
            admission=self.policy.admission,
            current_s=self._price(self.plan, now),
            candidate_s=self._price(candidate, now),
            cost_s=deferred.cost_s,
            horizon_steps=self._horizon(deferred.signals, step),
            gamma=self.policy.gamma,
            urgent=False,
            steps_left=self._steps_left(step),
            min_saving=self.policy.min_saving,
            contested=_contested(self._calibration_check(candidate)[1]),
        )
        verdict = self._vetoed(verdict, candidate, dataclasses.replace(trigger, step=step))
        if verdict.reason.startswith("vetoed:"):  # refused for good: not priced again
            self.deferred = None
            self.emit(self._decision(trigger, candidate, verdict, verdict.reason, step=step))
            return
        if not verdict.admit:
            return  # kept: priced again next step (even one that the run's end outruns now)
        self.deferred = None
        workload = self._workload(self._gen_len)
        self.emit(
            self._decision(
                trigger,
                candidate,
                verdict,
                f"deferred, now {verdict.reason}",
                route=route,
                step=step,
            )
        )
        if self._needs_approval(verdict, False):
            self._propose(candidate, verdict, trigger, engine, route=route)
        elif route == "restart":
            self._restart(candidate, workload, engine, because=verdict.reason)
        else:
            try:
                dag = self._compile(engine, candidate, workload)
            except TransitionRefusedError as exc:
                # Its verdict priced a live move; a restart would cost far more, so it is not
                # taken on that verdict: a replan weighs every route afresh.
                self.emit(
                    self._decision(trigger, candidate, None, f"infeasible now: {exc}", step=step)
                )
                self._replan_now(trigger, step, engine)
                return
            if deferred.ahead and dag.ahead:
                self._stage(candidate, workload, dag, trigger, engine, step=step)
            else:
                self._apply(candidate, workload, dag, engine)

    def _restart_estimate(self, candidate: Plan, workload: PpoWorkload) -> float:
        state = sum(
            sum(bytes_on(u).values()) for us in units_of(candidate, workload).values() for u in us
        )
        nodes = max(1, math.ceil(candidate.num_slots / self.acc.gpus_per_node))
        return RESTART_ESTIMATE_S + 2 * state / (STORAGE_ESTIMATE_BYTES_PER_S * nodes)

    def _apply(self, candidate: Plan, workload: PpoWorkload, dag, engine: Engine) -> None:
        self.staged = None  # whatever was staged was compiled against the units this replaces
        # The compiled DAG before it runs, so that a page can draw its edges and critical path
        # while the engine reports the nodes one by one.
        self.emit(
            {
                "event": "control.transition_started",
                "predicted_s": dag.predicted_s,
                "nodes": len(dag.nodes),
                "simulated": bool(getattr(engine, "simulated", False)),
                "dag": dag.to_json(),
            }
        )
        outcome = engine.transition(dag)
        self.transitions += 1
        self.transition_s += outcome.seconds
        for sample in outcome.samples:
            try:
                self.calibrator.observe_sample(sample)
            except ValueError as exc:
                logger.info("calibration sample dropped: %s", exc)
        self.emit(
            {
                "event": "control.transition",
                "step": self.ran_step,  # the last step run before it
                "because": _because(self._moving_for),
                "ok": outcome.ok,
                "predicted_s": dag.predicted_s,
                "actual_s": outcome.seconds,
                "rebuild_s": outcome.rebuild_s,
                "nodes": len(dag.nodes),
                "failure": outcome.failure,
                "simulated": outcome.simulated,
                "dag": dag.to_json(),
                "target": candidate.to_json(),
            }
        )
        self._moving_for = None
        if outcome.ok:
            self.plan = candidate
            self.monitor.plan_changed()
            self._memory_quiet_until = -1
            self._memory_escalated_until = -2
            self._settling = bool(dag.joining)
            return
        # Replan from the intact units; where none can be made, the urgent path restarts.
        trigger = Trigger(kind="failure", step=self.at_step, detail=outcome.failure)
        self.emit({"event": "control.trigger", **trigger.to_json()})
        self.replan(trigger, engine)

    def _rebatch(self, candidate: Plan, trigger: Trigger) -> None:
        """Take a plan that differs from the running one only in micro-batches: no state moves
        (the next step runs its training and inference in the new micro-batches), so there is
        nothing to admit, stage or approve, and it is not a transition."""
        assert self.plan is not None
        mb = self.workload.micro_batch
        before, after = self.plan.micro_batches(mb), candidate.micro_batches(mb)
        self.plan = candidate
        self.monitor.plan_changed()
        self.staged = None
        self.rebatches += 1
        self._memory_quiet_until = -1  # a new plan: its own forecasts
        self._memory_escalated_until = -2
        self.emit(
            {
                "event": "control.micro_batches",
                "trigger": trigger.to_json(),
                "changed": {
                    name: [before[name], after[name]]
                    for name in sorted(after)
                    if before.get(name) != after[name]
                },
                "predicted_step_s": candidate.predicted_step_s,
            }
        )

    def _restart(self, candidate: Plan, workload: PpoWorkload, engine: Engine, *, because: str):
        self.staged = None
        self._memory_quiet_until = -1  # a new plan: its own forecasts
        self._memory_escalated_until = -2
        seconds = engine.restart(candidate, workload)
        self.restarts += 1
        self.restart_s += seconds
        self.plan = candidate
        self.monitor.plan_changed()
        self._settling = False  # every unit was placed anew
        self.emit(
            {
                "event": "control.restart",
                "seconds": seconds,
                "reason": because,
                "from_checkpoint": True,
                "target": candidate.to_json(),
            }
        )

    # --- the approval gate ----------------------------------------------------------------------

    def _needs_approval(self, verdict: Verdict, urgent: bool) -> bool:
        if urgent or self.policy.approval == "auto":
            return False
        if self.policy.approval == "manual":
            return True
        return verdict.cost_s > self.policy.approval_above_s

    def _propose(
        self, candidate, verdict, trigger, engine, *, route: str = "live", dag=None
    ) -> None:
        """Ask a person; meanwhile build the move's new units on idle slots (``dag.ahead``):
        the job runs on as it would anyway, and if the move is approved its transition waits
        only for what is left of them (rejected, expired or superseded, the engine frees
        them)."""
        pending = self.pending
        if (
            pending is not None
            and self._same_plan(pending.plan, candidate)
            and pending.units_at == _unit_ids(engine)
            and pending.route == route
        ):
            # The same change asked for again: the person keeps the proposal they are reading.
            self.emit(
                {
                    "event": "control.proposal_still_waiting",
                    "proposal": pending.proposal_id,
                    "trigger": trigger.to_json(),
                }
            )
            return
        if pending is not None:  # a different candidate replaces the one still waiting
            engine.drop_ahead()  # its units built ahead will not be used
            self.emit(
                {
                    "event": "control.stale",
                    "proposal": self.pending.proposal_id,
                    "reason": "superseded by a newer proposal",
                }
            )
        ahead = dag.ahead if dag is not None and route == "live" else frozenset()
        self.pending = Proposal(
            proposal_id=next(self._ids),
            plan=candidate,
            verdict=verdict,
            trigger=trigger,
            created_s=engine.now(),
            units_at=_unit_ids(engine),
            route=route,
            ahead=ahead,
        )
        self.emit(
            {
                "event": "control.proposal",
                "proposal": self.pending.proposal_id,
                "plan": candidate.to_json(),
                "verdict": verdict.to_json(),
                "route": route,
            }
        )
        if ahead:
            workload = self._workload(self._gen_len)
            self._build_ahead(
                candidate,
                workload,
                dag,
                engine,
                step=trigger.step,
                proposal=self.pending.proposal_id,
            )

    def command(self, kind: str, proposal_id: int, engine: Engine) -> str:
        """``approve`` or ``reject`` a pending proposal, or let it go as ``stale`` (a person
        proposed a plan of their own after it: only the newest proposal can be approved);
        returns what happened."""
        if kind not in ("approve", "reject", "stale"):
            raise ValueError(f"command: expected 'approve', 'reject' or 'stale', got {kind!r}")
        pending = self.pending
        if pending is None or pending.proposal_id != proposal_id:
            raise ValueError(f"proposal: {proposal_id} is not waiting")
        self.pending = None
        if kind == "stale":
            engine.drop_ahead()  # its units built ahead will not be used
            self.emit(
                {
                    "event": "control.stale",
                    "proposal": proposal_id,
                    "reason": "superseded by a person's newer proposal",
                }
            )
            return "stale"
        if kind == "reject":
            engine.drop_ahead()
            self.emit({"event": "control.rejected", "proposal": proposal_id})
            return "rejected"
        if _unit_ids(engine) != pending.units_at:
            engine.drop_ahead()  # built for a move from units that are no longer there
            self.emit({"event": "control.stale", "proposal": proposal_id})
            return "stale"
        workload = self._workload(self._gen_len)
        self.emit({"event": "control.approved", "proposal": proposal_id})
        if pending.route == "restart":
            self._restart(pending.plan, workload, engine, because="approved")
            return "restarted"
        try:
            dag = self._compile(engine, pending.plan, workload, built_ahead=pending.ahead)
        except TransitionRefusedError as exc:
            engine.drop_ahead()
            self.emit({"event": "control.stale", "proposal": proposal_id, "reason": str(exc)})
            return "stale"
        self._apply(pending.plan, workload, dag, engine)
        return "applied"

    def override(self, plan_json: Mapping[str, Any], engine: Engine) -> str:
        """Move to a person's plan (an override another person approved), between steps;
        returns what happened: ``applied``, ``rebatched`` (only its micro-batches differ),
        ``unchanged`` (the job runs it already), ``failed: …`` (its transition failed; the
        controller replanned from what survived) or ``refused: …``.

        The plan is placed on the alive slots: as written when every slot it names is alive,
        else as a plan made for the alive slots (its slot ``i`` on the ``i``-th alive one, as
        the planner's plans are). It is refused, with a ``control.override_refused`` event
        saying why, and the job runs on as it was (a waiting proposal still waits), when it is
        not a plan, is for another accelerator or models, has other model-stages than the
        job's, uses more slots than are alive, does not fit a slot's memory budget at the
        generated length now, or no live transition reaches it. Otherwise it supersedes what
        the controller had in hand (a waiting proposal, which goes ``control.stale``; a staged
        or deferred move), is recorded as a ``control.decision`` admitted on the person's word
        (trigger ``override``), and its transition runs."""
        assert self.plan is not None
        trigger = Trigger(kind="override", step=self.at_step, detail="approved by a person")

        def refuse(reason: str) -> str:
            self.emit({"event": "control.override_refused", "reason": reason, "step": self.at_step})
            return f"refused: {reason}"

        try:
            wanted = Plan.from_json(dict(plan_json))
        except (KeyError, TypeError, ValueError) as exc:
            return refuse(f"not a plan: {exc}")
        if wanted.accelerator != self.acc.name:
            return refuse(f"it is for {wanted.accelerator}; the job runs on {self.acc.name}")
        models = {role: model.name for role, model in self.workload.models.items()}
        if wanted.models and dict(wanted.models) != models:
            return refuse(f"it is for the models {dict(wanted.models)}; the job's are {models}")
        names = sorted(ms.name for ms in wanted.model_stages)
        running = sorted(ms.name for ms in self.plan.model_stages)
        if names != running:
            return refuse(f"its model-stages {names} are not the job's {running}")
        alive, pool = self._alive(engine), engine.pool_size()
        used = sorted({s for ms in wanted.model_stages for s in ms.slots})
        if len(used) > len(alive):
            return refuse(f"it uses {len(used)} slots; {len(alive)} are alive")
        try:
            if set(used) <= set(alive):
                candidate = dataclasses.replace(wanted, num_slots=pool)
            elif used[-1] < len(alive):
                candidate = place(wanted, alive, pool, self.acc.gpus_per_node)
            else:
                gone = next(s for s in used if s not in alive)
                return refuse(f"it uses slot {gone}, which is not alive")
            workload = self._workload(self._gen_len)
            over = [(ms.name, need) for ms, need in self._needs(candidate, self._gen_len)]
        except (KeyError, ValueError, TypeError, ArithmeticError, PlanningError) as exc:
            return refuse(f"it cannot be placed on this job's slots: {exc}")
        budget = memory_budget(self.acc.memory_bytes)
        over = [(name, need) for name, need in over if not self._within(need)]
        if over:
            name, need = over[0]
            needs, room = byte_sizes(need * self.memory_factor, budget)
            return refuse(
                f"it does not fit in memory: {name} needs {needs} of a slot's {room} at gen_len "
                f"{self._gen_len:.0f}"
            )
        moves = not candidate.places_like(self.plan)
        dag = None
        if moves:
            try:
                dag = self._compile(engine, candidate, workload)
            except (
                TransitionRefusedError,
                KeyError,
                ValueError,
                TypeError,
                ArithmeticError,
            ) as exc:
                return refuse(f"no live transition reaches it: {exc}")
        # The person's plan wins over whatever the controller had in hand, the running plan
        # too: a move staged (or deferred, or waiting for approval) is not made after it.
        if self.pending is not None or self.staged is not None:
            engine.drop_ahead()  # units built ahead for a move that will not be made
        if self.pending is not None:
            self.emit(
                {
                    "event": "control.stale",
                    "proposal": self.pending.proposal_id,
                    "reason": "superseded by an approved override",
                }
            )
        self.pending, self.staged, self.deferred = None, None, None
        if self.policy.fixed_layouts:
            self.fixed = _layouts(candidate)  # the layouts a person chose are the ones to keep
        if self.policy.fixed_micro_batches:  # and so are the micro-batches
            self.kept_micro_batches = candidate.micro_batches(self.workload.micro_batch)
        if not moves and self._same_plan(candidate, self.plan):
            self.emit(self._decision(trigger, candidate, None, "override: the job runs it already"))
            return "unchanged"
        decision = self._decision(trigger, candidate, None, "override approved by a person", dag)
        decision["admit"] = True
        self.emit(decision)
        if dag is None:
            self._rebatch(candidate, trigger)  # other micro-batches only: nothing moves
            return "rebatched"
        self._apply(candidate, workload, dag, engine)
        if self.plan is candidate:
            return "applied"
        return "failed: its transition did not complete; the controller replanned"

    def _expire_pending(self, engine: Engine) -> None:
        if self.pending and engine.now() - self.pending.created_s > self.policy.approval_timeout_s:
            engine.drop_ahead()
            self.emit({"event": "control.expired", "proposal": self.pending.proposal_id})
            self.pending = None

    def _decision(
        self,
        trigger,
        candidate,
        verdict,
        reason,
        dag=None,
        outlook=None,
        route=None,
        step=None,
        ahead=False,
        forced=False,
    ) -> Event:
        """``step``: when the decision is taken, if not at its trigger (a deferred one);
        ``ahead``: the verdict priced building the new units ahead (its cost is then not the
        DAG's ``cost_s``); ``forced``: a move off a plan that can no longer run (``why``:
        urgent, unless the slots changed or a person chose the plan)."""
        step = trigger.step if step is None else step
        said = (verdict.reason if verdict is not None else "") or reason
        return {
            "event": "control.decision",
            "trigger": trigger.to_json(),
            "candidate": None if candidate is None else candidate.to_json(),
            "current": self.plan.to_json() if self.plan else None,
            "verdict": None if verdict is None else verdict.to_json(),
            "admit": bool(verdict and verdict.admit),
            "reason": reason,
            # The H admission weighed (the longest effective horizon of the signals the saving
            # rests on); where nothing was admitted or refused, the trigger's signal's.
            "horizon_steps": (
                verdict.horizon_steps
                if verdict is not None
                else self.monitor.horizon_of(trigger.signal)
            ),
            "gamma": self.policy.gamma,
            "predicted_transition_s": None if dag is None else dag.predicted_s,
            "joining_s": None if dag is None else dag.joining_s,
            "outlook": None if outlook is None else outlook.to_json(),
            "route": route,
            "built_ahead": ahead,
            "steps_left": None if self.last_step is None else self._steps_left(step),
            "step": step,
            # What a move it admits is made for (``admission.MOVE_REASONS``): what the veto
            # refuses and hindsight replays are the ``saving`` ones.
            "why": why_moved(trigger.kind, said, forced=forced),
        }


_MOVES_WITHOUT_VERDICT = ("salvage:", "override approved")
"""How the reasons of decisions that move without an admission verdict begin (the intact
units kept after a loss; a person's plan)."""


def _because(decision: Event | None) -> dict | None:
    """What a transition event says of the decision it carries out: its trigger's kind, its
    reason, and the saving per step its verdict priced (None without a verdict)."""
    if decision is None:
        return None
    verdict = decision.get("verdict") or {}
    return {
        "trigger": decision["trigger"]["kind"],
        "reason": (verdict.get("reason") or decision["reason"]),
        "saving_s": verdict.get("saving_s"),
        "step": decision.get("step"),  # when it was decided (a staged move runs a step later)
        "why": decision.get("why"),
    }


def _layouts(plan_: Plan) -> dict[str, tuple[int, int]]:
    return {ms.name: (ms.layout.tp, ms.layout.pp) for ms in plan_.model_stages}


def _unit_ids(engine: Engine) -> frozenset[str]:
    return frozenset(u.unit_id for us in engine.units().values() for u in us)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSummary:
    steps: int
    seconds: float
    step_seconds: float
    transitions: int
    transition_seconds: float
    restarts: int
    rebatches: int = 0
    """Plan changes of micro-batches alone (no state moved; not transitions)."""
    restart_seconds: float
    failed_steps: int
    probe_seconds: float = 0.0
    """Of ``seconds``, the calibration probes' (``Controller._run_probes``)."""
    simulated: bool
    stopped: bool = False
    """The job was told to stop before its last step."""

    @property
    def mean_step_s(self) -> float:
        """All the run's time (steps, transitions, restarts, lost work) per completed step."""
        return self.seconds / max(1, self.steps - self.failed_steps)

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "mean_step_s": self.mean_step_s}


def run_job(
    engine: Engine,
    controller: Controller,
    steps: int,
    *,
    between_steps: Callable[[int], bool] | None = None,
    on_step: Callable[[StepReport], None] | None = None,
    resume_at: int | None = None,
) -> RunSummary:
    """The step loop: run a step on the current plan, let the controller act between steps.

    ``between_steps(step)`` runs before each step (a driver applies commands there) and returns
    False to stop the job; ``on_step(report)`` receives each step's report (by default it becomes
    a ``step`` event of the controller). ``resume_at``: go on with a job copied
    (``copy.deepcopy`` of its engine and controller) in its ``between_steps`` of that step, from
    that step's own hooks on, with no initial plan. Its summary's ``steps``, ``step_seconds`` and
    ``failed_steps`` count the steps run here; the clock and the controller's counts are the
    job's, from its start."""
    if resume_at is None:
        controller.initial_plan(engine)
        controller.last_step = steps - 1
    failed = 0
    step_seconds = 0.0
    done = 0
    for step in range(resume_at or 0, steps):
        if resume_at is not None and step == resume_at:
            between = True  # the copy was made in this step's between_steps
        else:
            between = between_steps is None or between_steps(step)
        if not between:
            break
        controller.before_step(engine, step)
        assert controller.plan is not None
        report = engine.step(controller.plan, controller._workload(controller._gen_len), step)
        step_seconds += report.seconds
        if not report.ok:
            failed += 1
        (on_step or controller.emit_step)(report)
        controller.after_step(report, engine)
        done += 1
    return RunSummary(
        steps=done,
        seconds=engine.now(),
        step_seconds=step_seconds,
        transitions=controller.transitions,
        transition_seconds=controller.transition_s,
        restarts=controller.restarts,
        restart_seconds=controller.restart_s,
        rebatches=controller.rebatches,
        failed_steps=failed,
        probe_seconds=controller.probe_s,
        simulated=engine.simulated,
        stopped=done < steps - (resume_at or 0),
    )
