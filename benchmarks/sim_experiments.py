"""The seed's scale experiments, and where adaptation pays, on the cluster twin. Every figure
here is SIMULATED.

The controller, planner, admission and transition compiler are the real ones; the cluster is the
cluster twin (``runtime/twin``: a simulated GPU cluster whose physics is its own, priced from the
shapes of the work and published hardware figures, never from the planner's cost or memory
models), driven by a trace (``runtime/engine/sim.py``). Plans are judged by playing them in the
twin (noise and other tenants' traffic off), never by the planner's formula. Writes
``sim_experiments.{json,md}`` and plotly HTML figures under ``sim/`` in the results folder
(``benchmarks/results`` unless ``--results``).

1. ``adaptation``: online TP/PP adaptation against the seed's baseline, the initial TP/PP
   layouts with DP scaling (the layouts and micro-batches the controller picks at step 0 for
   step-0 conditions, kept; a micro-batch halved only after an out-of-memory step has cost a
   restart, as a static framework's), on one growth trace and four clusters (seed: 27.7% lower
   mean step latency).
2. ``scale``: a 1,000-step run growing to 1,024 GPUs: transitions and their share of run time
   (seed: six, 0.079%).
3. ``plan_quality``: the plan the online-calibrated controller selects against the best plan
   under the twin's physics by exhaustive evaluation (every candidate of a large set played in
   the twin), 18 settings (seed: within 5% in all).
4. ``admission``: payback admission against DynaRL-style admission (whatever is predicted
   faster), never adapting, and adapting by checkpoint/restart, on three held-out trace shapes
   (seed: 858.7 vs 928.3 s/step).
5. ``calibration``: an offline-calibrated predictor (catalog defaults, no memory learning)
   against the online one at 8 to 256 GPUs on clusters the catalog misjudges (seed: offline
   picks an infeasible plan at 8 GPUs, up to 1.56× slower plans at 64–256).
6. ``map``: where adaptation pays: Nereus's gain over the seed's baseline across model × pool ×
   length growth × pool volatility (no seed figure: new). Hours of runs: only ``--only map``
   makes it, a cell at a time, each written to ``adaptation_map_cells.jsonl`` as it finishes
   (a cell already there is not run again; ``--map-*`` pick cells); any run's tables show the
   cells made so far.

The misjudged clusters (``CALIBRATION_SCENARIOS``) are twin devices changed with
``dataclasses.replace``: collectives congested everywhere, between nodes only, or PCIe-class
links inside nodes catalogued as NVLink. Exp5 also takes 12 GiB of each GPU for another tenant's
process (``Device.reserved_bytes``): the older simulator's "activations and KV caches take 1.5×
the memory the model says" cannot be said of the twin, whose memory is its own arithmetic, so the
memory the planner does not know of is memory the device does not give.

    python benchmarks/sim_experiments.py [--quick] [--only NAME] [--full-exp2] [--results DIR]
        [--map-steps N] [--map-models M,...] [--map-pools N,...] [--map-growth G,...]
        [--map-volatility V,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _report
from runtime.control import Controller, JobPolicy, run_job
from runtime.control.policy import RUNWAYS
from runtime.engine import hindsight
from runtime.engine.sim import SimulatedEngine
from runtime.engine.traces import Trace, generate
from runtime.planner import Plan, PlanningError, PpoWorkload, default_catalog, plan
from runtime.planner.space import only_layouts
from runtime.twin import ClusterTwin, Device, device

CATALOG = default_catalog()
GIB = 2**30
FORMAT = "twin-1"
"""What the JSON's results are made on: ``--only`` keeps stored results of this format alone."""
WORLD_SEED = 7
"""The twin's seed (the phase of other tenants' traffic) wherever an experiment names none."""
ENGINE_SEED = 3
"""The engine's seed (each step's response lengths and noise) wherever an experiment names none."""


class _Out:
    """Where results go (``--results``)."""

    results: Path = _report.RESULTS

    @classmethod
    def figures(cls) -> Path:
        return cls.results / "sim"


class _Recording(SimulatedEngine):
    """The simulated engine, noting the pool each step ran on (exp1's oracle replans there)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pools: dict[int, int] = {}

    def step(self, plan_, workload, step):
        self.pools[step] = self.pool_size()
        return super().step(plan_, workload, step)


def world(
    accelerator: str,
    change: Callable[[Device], Device] | None = None,
    *,
    seed: int = WORLD_SEED,
    **overrides,
) -> ClusterTwin:
    """The twin of a cluster of ``accelerator``: its device changed by ``change`` (a cluster the
    catalog misjudges), ``overrides`` for the twin's own fields (``interference=0.0``: links
    whose speed does not shift over the hours)."""
    dev = device(accelerator)
    return ClusterTwin.draw(change(dev) if change else dev, seed, **overrides)


def _starter(
    trace,
    accelerator,
    workload,
    policy: JobPolicy,
    *,
    twin: ClusterTwin | None = None,
    engine_seed: int = ENGINE_SEED,
    fixed=None,
):
    """Makes the simulated job afresh, from the same seeds each time (``hindsight.Start``)."""
    acc = CATALOG.accelerator(accelerator)
    twin = twin or world(accelerator)

    def start():
        engine = _Recording(trace, acc, twin=twin, seed=engine_seed)
        return engine, Controller(workload, acc, policy, fixed=fixed)

    return start


def _run(trace, accelerator, workload, policy: JobPolicy, **world_):
    engine, controller = _starter(trace, accelerator, workload, policy, **world_)()
    summary = run_job(engine, controller, trace.steps)
    return summary, controller, engine


def seed_baseline() -> JobPolicy:
    """The seed's baseline: the first plan's TP/PP layouts kept (DP follows the pool), and the
    micro-batches chosen at launch (halved only after an out-of-memory step)."""
    if "fixed_micro_batches" not in {f.name for f in dataclasses.fields(JobPolicy)}:
        raise SystemExit(
            "sim_experiments: runtime/control/policy.py has no JobPolicy.fixed_micro_batches "
            "yet; the seed's baseline (exp1 and the adaptation map) needs "
            "JobPolicy(fixed_layouts=True, fixed_micro_batches=True)"
        )
    return JobPolicy(fixed_layouts=True, fixed_micro_batches=True)


def _log(what: str, started: float) -> None:
    print(f"[{what}: {time.perf_counter() - started:.0f} s]", flush=True)


def _layouts(found: Plan) -> dict[str, tuple[int, int]]:
    return {ms.name: (ms.layout.tp, ms.layout.pp) for ms in found.model_stages}


def _relaxed(controller) -> int:
    return sum(e["event"] == "control.relaxed" for e in controller.events)


def _pool_changes(trace: Trace, seconds: float) -> int:
    """The trace's pool records that fell within a run of ``seconds``."""
    return sum(at <= seconds for at, _ in trace.pool)


# --- judging plans in the twin -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Judged:
    """A plan played in the twin with noise and other tenants' traffic off."""

    seconds: float
    failure: str
    peak: float
    """The fullest slot's peak over its device's memory."""

    @property
    def fits(self) -> bool:
        return not self.failure


def fixed_lengths(trace: Trace, step: int, count: int, tag: str = "judge") -> list[int]:
    """``count`` response lengths at ``step``, drawn once from a stream of their own (every
    candidate judged there plays the same sequences)."""
    return trace.response_lengths(step, count, random.Random(f"{tag}:{step}"))


def judge(twin: ClusterTwin, plan_: Plan, workload: PpoWorkload, lengths) -> Judged:
    """``plan_``'s step in ``twin`` for sequences of ``lengths``, its noise and interference
    off (contention between its own model-stages stays: it is the plan's)."""
    still = dataclasses.replace(twin, interference=0.0)
    mean = max(1, round(statistics.fmean(lengths)))
    played = still.step(plan_, workload.with_gen_len(mean), lengths=list(lengths))
    return Judged(played.seconds, played.failure, played.peak_fraction)


def _shape(p: Plan) -> tuple:
    """What the twin plays of a plan: its layouts, units, micro-batches and stage modes."""
    return (
        tuple(
            (ms.name, ms.layout.dp, ms.layout.tp, ms.layout.pp, ms.units, ms.micro_batch)
            for ms in p.model_stages
        ),
        tuple((s.stage, s.mode) for s in p.stages),
    )


def _rebatched(p: Plan, micro_batch: int) -> Plan:
    """``p`` with every training and inference model-stage in micro-batches of that many."""
    return dataclasses.replace(
        p,
        model_stages=tuple(
            ms
            if ms.name.endswith("@generation")
            else dataclasses.replace(ms, micro_batch=micro_batch)
            for ms in p.model_stages
        ),
    )


def candidate_plans(
    workload: PpoWorkload,
    accelerator: str,
    num_slots: int,
    *,
    budgets: Sequence[float],
    alternatives: int,
    efficiencies: Sequence[dict | None] = (None,),
    micro_batches: Sequence[int] = (),
    fixed: dict[str, tuple[int, int]] | None = None,
    extra: Sequence[Plan] = (),
) -> list[Plan]:
    """The planner's candidates: its best plan and ``alternatives`` next-best ones at each
    memory budget (fractions of the device's memory: which budget gives the fastest plan that
    truly fits is found by trying them) under each of ``efficiencies`` (None: the catalog's),
    each also with its training and inference micro-batches set to each of ``micro_batches``;
    with ``fixed``, keeping those (tp, pp) layouts; plus ``extra``. Distinct plans only."""
    acc = CATALOG.accelerator(accelerator)
    found = list(extra)
    for efficiency in efficiencies:
        for scale in budgets:
            sized = dataclasses.replace(acc, memory_bytes=acc.memory_bytes * scale)
            excluded = only_layouts(fixed, workload, sized, num_slots) if fixed else frozenset()
            try:
                result = plan(
                    workload,
                    sized,
                    num_slots,
                    efficiency=efficiency,
                    num_alternatives=alternatives,
                    excluded=excluded,
                )
            except PlanningError:
                continue
            for p in (result.best, *result.alternatives):
                p = dataclasses.replace(p, accelerator=acc.name)
                found.append(p)
                if workload.adaptive_micro_batch:
                    found += [_rebatched(p, m) for m in micro_batches if m <= workload.micro_batch]
    seen, out = set(), []
    for p in found:
        if _shape(p) not in seen:
            seen.add(_shape(p))
            out.append(p)
    return out


def fastest(
    twin: ClusterTwin, plans: Sequence[Plan], workload: PpoWorkload, lengths
) -> tuple[Judged, Plan] | None:
    """The fastest of ``plans`` that fits, as the twin plays them (None: none fits)."""
    fitting = [(j, p) for p in plans if (j := judge(twin, p, workload, lengths)).fits]
    return min(fitting, key=lambda item: item[0].seconds) if fitting else None


def _at(workload: PpoWorkload, lengths) -> PpoWorkload:
    """``workload`` at the mean of ``lengths`` (what the planner plans for)."""
    return workload.with_gen_len(max(1, round(statistics.fmean(lengths))))


CALIBRATION_SCENARIOS: dict[str, tuple[str, Callable[[Device], Device]]] = {
    # name: (what the catalog gets wrong, the twin's device as it truly is)
    "congested network": (
        "intra-node bus bandwidth and every network card at half their published figures "
        "(RoCE and NVLink shared with other tenants)",
        lambda d: dataclasses.replace(
            d,
            intra=dataclasses.replace(d.intra, bus_bytes_per_s=d.intra.bus_bytes_per_s / 2),
            nic_bytes_per_s=d.nic_bytes_per_s / 2,
        ),
    ),
    "congested inter-node links": (
        "network cards at a quarter of their published bandwidth, NVLink as listed",
        lambda d: dataclasses.replace(d, nic_bytes_per_s=d.nic_bytes_per_s / 4),
    ),
    "PCIe-class intra-node links": (
        "intra-node bus bandwidth at 1/8 of the catalogued NVLink (PCIe A100 nodes catalogued "
        "as SXM)",
        lambda d: dataclasses.replace(
            d, intra=dataclasses.replace(d.intra, bus_bytes_per_s=d.intra.bus_bytes_per_s / 8)
        ),
    ),
}
"""Ways an offline profile misjudges a cluster (exp1 runs on each; so does exp5, where another
tenant's process also holds ``TENANT_BYTES`` of each GPU)."""
TENANT_BYTES = 12 * GIB
"""Exp5: what another tenant's process holds of each GPU (``Device.reserved_bytes``)."""


def _as_catalogued(d: Device) -> Device:
    return d


# --- 1 -----------------------------------------------------------------------------------------


ONLINE = "online TP/PP adaptation"
SEED_BASELINE = "initial TP/PP, DP scaling (seed's baseline)"
HINDSIGHT = "layouts for the longest length (hindsight), DP scaling"
RELAXED = "initial TP/PP, relaxed"
LEARNED = "layouts for the longest length, learned efficiencies, DP scaling"
ADAPTATION_POLICIES = (ONLINE, SEED_BASELINE, HINDSIGHT, RELAXED, LEARNED)
SPREAD_ENGINE_SEEDS = (4, 5, 6)
"""Engine seeds of exp1's as-catalogued comparison run again (the table's is 3)."""
BOUND_BUDGETS = (1.0, 0.9, 0.8, 0.7, 0.6)
BOUND_ALTERNATIVES = 8


def experiment_adaptation(opts) -> dict:
    """The same growth trace (500 to 8,000 tokens, a spot-like 64-GPU pool) on four clusters: one
    the catalog describes (the twin's published figures) and the three that exp5 defines, which
    the catalog misjudges. Five policies:

    - online TP/PP adaptation: Nereus;
    - initial TP/PP, DP scaling (the seed's baseline): the layouts the controller picks at step 0
      for step-0 conditions, kept (DP follows the pool; where a shrunken pool cannot hold them
      the controller relaxes them: counted), and the micro-batches chosen at launch (halved
      only after an out-of-memory step has cost a restart);
    - layouts for the longest length (hindsight), DP scaling: the layouts planned once, before
      anything is measured, for the trace's longest mean length (so that they fit all the way),
      micro-batches planned;
    - initial TP/PP, relaxed: the first plan's layouts kept until they no longer fit and then
      replanned (counted), micro-batches planned;
    - layouts for the longest length, learned efficiencies: as hindsight's, planned with the
      efficiencies and memory the online run's calibrator had learned by its end (as if the
      cluster had been profiled before the run): on a misjudged cluster, what adaptation wins
      over these is its own share, the rest of what it wins over hindsight's is calibration's.

    The oracle (``_bound``) replans at a sample of the seed's baseline run's steps."""
    baseline = seed_baseline()
    steps = 40 if opts.quick else 1000
    every = 20 if opts.quick else 50
    trace = generate("growth", seed=1, steps=steps, gpus=64, accelerator="h100-sxm", spot=True)
    workload = PpoWorkload.for_model(CATALOG.model("llama-3.1-8b"), gen_len=500)
    acc = CATALOG.accelerator("h100-sxm")
    longest = round(max(v for _, v in trace.gen_len))
    hindsight_layouts = _layouts(plan(workload.with_gen_len(longest), acc, 64).best)
    clusters = {"as catalogued": ("", _as_catalogued), **CALIBRATION_SCENARIOS}
    rows = []
    for cluster, (_, change) in list(clusters.items())[:2] if opts.quick else clusters.items():
        twin = world("h100-sxm", change)
        runs: dict[str, dict] = {}

        def go(name, policy, fixed, twin=twin, runs=runs, cluster=cluster):
            started = time.perf_counter()
            summary, controller, engine = _run(
                trace, "h100-sxm", workload, policy, twin=twin, fixed=fixed
            )
            _log(f"adaptation, {cluster}, {name}", started)
            runs[name] = {
                **summary.to_json(),
                "relaxed": _relaxed(controller),
                "pool_changes_in_run": _pool_changes(trace, summary.seconds),
                "layouts": dict(controller.fixed) if policy.fixed_layouts else None,
            }
            return controller, engine

        online, engine = go(ONLINE, JobPolicy(), None)
        if cluster == "as catalogued":
            # Why online adaptation moved, and what its moves made for a saving bought
            # (replayed from its seeds without them).
            started = time.perf_counter()
            seen = hindsight.moves(online.events, engine, workload)
            runs[ONLINE]["hindsight"] = hindsight.summary(seen)
            start = _starter(trace, "h100-sxm", workload, JobPolicy(), twin=twin)
            runs[ONLINE]["counterfactual"] = hindsight.replayed(
                start, trace.steps, seen, engine.now()
            )
            _log(f"adaptation, {cluster}, hindsight and counterfactual replays", started)
        base, base_engine = go(SEED_BASELINE, baseline, None)
        go(HINDSIGHT, JobPolicy(fixed_layouts=True), hindsight_layouts)
        go(RELAXED, JobPolicy(fixed_layouts=True), None)
        learned = online.calibrator.efficiency()
        learned_acc = dataclasses.replace(acc, memory_bytes=acc.memory_bytes / online.memory_factor)
        try:
            learned_layouts = _layouts(
                plan(workload.with_gen_len(longest), learned_acc, 64, efficiency=learned).best
            )
        except PlanningError as exc:  # what it learned of memory leaves no plan for 8,000
            runs[LEARNED] = {"error": str(exc)}
        else:
            go(LEARNED, JobPolicy(fixed_layouts=True), learned_layouts)
        online_s = runs[ONLINE]["mean_step_s"]

        def cut(name, runs=runs, online_s=online_s):
            other = runs[name].get("mean_step_s")
            return None if other is None else 1 - online_s / other

        started = time.perf_counter()
        bound = _bound(trace, base_engine.pools, workload, twin, dict(base.fixed), learned, every)
        _log(f"adaptation, {cluster}, oracle at {bound.get('points', 0)} points", started)
        rows.append(
            {
                "cluster": cluster,
                "runs": runs,
                "reduction": cut(SEED_BASELINE),
                "reduction_vs_hindsight": cut(HINDSIGHT),
                "reduction_vs_initial": cut(RELAXED),
                "reduction_vs_learned": cut(LEARNED),
                "bound": bound,
            }
        )
    # The same comparison where the catalog describes the cluster, under other engine seeds
    # (each step's response lengths and noise, and so every decision they tip): how much of the
    # row's figure is the world and how much that one draw.
    spread = [
        {"engine_seed": seed, **_online_vs_seed(trace, workload, world("h100-sxm"), seed)}
        for seed in (() if opts.quick else SPREAD_ENGINE_SEEDS)
    ]
    # On links whose speed does not shift over the hours (no interference): how much of the
    # figure comes from calibrating against a moving target.
    steady = None
    if not opts.quick:
        steady = _online_vs_seed(trace, workload, world("h100-sxm", interference=0.0))
    return {
        "trace": trace.name,
        "steps": steps,
        "rows": rows,
        "seed": 0.277,
        "spread": spread,
        "steady_links": steady,
        "hindsight_layouts": hindsight_layouts,
    }


def _online_vs_seed(trace, workload, twin: ClusterTwin, engine_seed: int = ENGINE_SEED) -> dict:
    """Online TP/PP adaptation against the seed's baseline in one world and engine seed: each
    run's mean step seconds and transitions, and the reduction."""
    online, fixed_run = (
        _run(trace, "h100-sxm", workload, policy, twin=twin, engine_seed=engine_seed)[0]
        for policy in (JobPolicy(), seed_baseline())
    )
    return {
        "online_s": online.mean_step_s,
        "fixed_s": fixed_run.mean_step_s,
        "online_transitions": online.transitions,
        "fixed_transitions": fixed_run.transitions,
        "reduction": 1 - online.mean_step_s / fixed_run.mean_step_s,
    }


def oracle_pair(
    twin: ClusterTwin,
    workload: PpoWorkload,
    accelerator: str,
    num_slots: int,
    lengths,
    kept: dict[str, tuple[int, int]],
    efficiencies: Sequence[dict | None] = (None,),
) -> tuple[Judged, Judged, int, bool] | None:
    """The best of the planner's candidates, judged by the twin, for the sequences ``lengths``
    on ``num_slots`` slots: the planner's best plan and its ``BOUND_ALTERNATIVES`` next-best at
    each of ``BOUND_BUDGETS`` (under each of ``efficiencies``; None: the catalog's) played in
    the twin (noise and interference off), the fastest that fits taken, once with any layouts
    and once keeping ``kept`` (DP and micro-batches replanned). The free one may keep them
    too. Returns the two, how many candidates were played, and whether the kept layouts fit
    nowhere (then the kept oracle is the free one, as a baseline that relaxes them); None
    where no candidate fits at all."""
    at = _at(workload, lengths)
    options = dict(
        budgets=BOUND_BUDGETS, alternatives=BOUND_ALTERNATIVES, efficiencies=efficiencies
    )
    keeping = candidate_plans(at, accelerator, num_slots, fixed=kept, **options)
    anything = candidate_plans(at, accelerator, num_slots, extra=keeping, **options)
    best_any = fastest(twin, anything, at, lengths)
    if best_any is None:
        return None
    best_kept = fastest(twin, keeping, at, lengths)
    relaxed = best_kept is None
    return best_any[0], (best_any if relaxed else best_kept)[0], len(anything), relaxed


def _bound(
    trace: Trace,
    pools: dict[int, int],
    workload: PpoWorkload,
    twin: ClusterTwin,
    kept: dict[str, tuple[int, int]],
    learned: dict[str, float],
    every: int,
) -> dict:
    """``oracle_pair`` at every ``every``-th step of the seed's baseline run, on the pool it had
    then and one draw of that step's response lengths, with the catalog's efficiencies and
    those the online run learned, keeping the baseline's ``kept`` layouts: their mean seconds
    over the sample, and 1 minus their ratio."""
    free, fixed, relaxed, unfit, counted = [], [], 0, 0, []
    for step in range(0, trace.steps, every):
        if step not in pools:
            continue
        lengths = fixed_lengths(trace, step, workload.global_batch, "oracle")
        pair = oracle_pair(
            twin, workload, trace.accelerator, pools[step], lengths, kept, (None, learned)
        )
        if pair is None:
            unfit += 1
            continue
        best_any, best_kept, count, gave_way = pair
        counted.append(count)
        relaxed += gave_way
        free.append(best_any.seconds)
        fixed.append(best_kept.seconds)
    if not free:
        return {"points": 0, "every": every, "unfit_points": unfit}
    any_s, kept_s = statistics.fmean(free), statistics.fmean(fixed)
    return {
        "points": len(free),
        "every": every,
        "candidates_per_point": statistics.fmean(counted),
        "any_layouts_s": any_s,
        "kept_layouts_s": kept_s,
        "reduction": 1 - any_s / kept_s,
        "relaxed_points": relaxed,
        "unfit_points": unfit,
    }


# --- 2 -----------------------------------------------------------------------------------------


def experiment_scale(opts) -> dict:
    """One run growing from 64 to 1,024 GPUs at 8,192 sequences a step (the twin takes about a
    second a step there), and the same run with every micro-batch pinned to the workload's;
    ``--full-exp2`` adds the memory runways, the run without admission's dead band and the
    counterfactual replays of its moves made for a saving."""
    steps = 40 if opts.quick else 1000
    # The seed's: the pool doubles towards 1,024 over six hours of a 1,000-step run (a shorter
    # run gets its share of them, so that it still grows).
    trace = generate(
        "growth",
        seed=2,
        steps=steps,
        gpus=64,
        grow_to=1024,
        hours=6.0 * steps / 1000,
        accelerator="h100-sxm",
    )
    workload = PpoWorkload.for_model(
        CATALOG.model("llama-3.1-8b"), gen_len=500, global_batch=8192, gen_micro_batch=128
    )
    twin = world("h100-sxm")
    started = time.perf_counter()
    summary, controller, engine = _run(trace, "h100-sxm", workload, JobPolicy(), twin=twin)
    wall = time.perf_counter() - started

    def shared(run) -> dict:
        return {**run.to_json(), "transition_share": run.transition_seconds / run.seconds}

    # The same run with every micro-batch pinned to the workload's: a plan that memory outgrows
    # can then only move state.
    pinned, _, _ = _run(
        trace,
        "h100-sxm",
        dataclasses.replace(workload, adaptive_micro_batch=False),
        JobPolicy(),
        twin=twin,
    )
    extra: dict = {}
    if opts.full_exp2:
        runways = {}
        for runway in RUNWAYS:  # fewer, longer-lasting plans against faster steps
            other = summary
            if runway != JobPolicy().memory_runway:
                other, _, _ = _run(
                    trace, "h100-sxm", workload, JobPolicy(memory_runway=runway), twin=twin
                )
            runways[runway] = shared(other)
        banded, _, _ = _run(trace, "h100-sxm", workload, JobPolicy(min_saving=0.0), twin=twin)
        extra = {"runways": runways, "no_dead_band": shared(banded)}
    steps_ev = [e for e in controller.events if e["event"] == "step"]
    transitions = [e for e in controller.events if e["event"] == "control.transition"]
    ahead = [t for t in transitions if t["dag"]["built_ahead"] > 0]
    share = summary.transition_seconds / summary.seconds
    _figure_scale(steps_ev, trace, share)
    joining = sum(_joining_excess(controller.events, t) for t in transitions)
    audit = hindsight.moves(controller.events, engine, workload)
    if opts.full_exp2:
        start = _starter(trace, "h100-sxm", workload, JobPolicy(), twin=twin)
        extra["counterfactual"] = hindsight.replayed(start, trace.steps, audit, engine.now())
    return {
        "trace": trace.name,
        **extra,
        "summary": summary.to_json(),
        "gpus_reached": engine.pool_size(),
        "transition_share": share,
        # The seed's figure times the state moves; rebuilding the generation and inference
        # engines in their new layouts is counted in ours, and shown apart here.
        "moving_share": sum(t["actual_s"] - t["rebuild_s"] for t in transitions) / summary.seconds,
        # A transition whose new generation units joined during the next step made that step's
        # generation slower than the one after: that excess is the transition's too (it is in
        # the step time, not in the transition's), and the share with it is shown beside.
        "joining_excess_s": joining,
        "share_with_joining": (summary.transition_seconds + joining) / summary.seconds,
        "wall_s": wall,
        "wall_s_per_step": wall / max(1, summary.steps),
        "pinned_micro_batches": shared(pinned),
        "default": shared(summary),
        # Transitions whose new units on granted slots were built during one more step on the
        # old plan (that step's forgone saving is in the step time, not in the transition's).
        "built_ahead": len(ahead),
        "transitions": [
            {
                "predicted_s": t["predicted_s"],
                "actual_s": t["actual_s"],
                "rebuild_s": t["rebuild_s"],
                "nodes": t["nodes"],
                "built_ahead": t["dag"]["built_ahead"],
                # New units built while the first step generated on the built ones, what
                # admission charged that step for it, and that step's generation against the
                # next one's.
                "joining": len(t["dag"]["joining"]),
                "joining_s": t["dag"]["joining_s"],
                "generation_s": _generation_after(controller.events, t),
                **seen.to_json(),
            }
            for t, seen in zip(transitions, audit, strict=True)
        ],
        "seed": {"transitions": 6, "share": 0.00079},
    }


def _counterfactual_lines(replayed: dict | None, steps: int) -> list[str]:
    """Exp2's moves made for their saving, replayed without them (``hindsight.replayed``)."""
    if not replayed:
        return []
    whole = replayed["without_saving_moves"]
    alone = ", ".join(
        f"step {m['step']} {m['net_s']:+.1f} s" for m in replayed["moves"] if m.get("met", True)
    )
    return [
        "Replayed from the run's seeds without them (`hindsight.replayed`: what they bought, "
        "their cost and all that followed included): without every move made for its saving "
        f"the run takes {whole['without_s'] / 3600:.3f} h ({whole['without_s'] / max(1, steps):.2f} "
        f"s/step) against {whole['run_s'] / 3600:.3f} h, so they bought {whole['net_s']:+.1f} s"
        + (f"; each refused alone: {alone}." if alone else "."),
        "",
    ]


def _joining_excess(events: list[dict], transition: dict) -> float:
    """How much longer the first step's generation took than the next one's, after a transition
    whose new units joined during that first step (0 where none did)."""
    if not transition["dag"]["joining"]:
        return 0.0
    first, *rest = _generation_after(events, transition) or [0.0]
    return max(0.0, first - rest[0]) if rest else 0.0


def _generation_after(events: list[dict], transition: dict) -> list[float]:
    """The generation stage's seconds in the two steps after ``transition``."""
    after = events[events.index(transition) + 1 :]
    steps = [e for e in after if e["event"] == "step" and e["ok"]][:2]
    return [e["stage_seconds"]["generation"] for e in steps]


def _figure_scale(steps_ev, trace, share: float) -> None:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        subplot_titles=("step seconds (simulated)", "generated tokens (simulated trace)"),
    )
    fig.add_trace(go.Scatter(y=[e["seconds"] for e in steps_ev], name="step s"), row=1, col=1)
    fig.add_trace(go.Scatter(y=[e["gen_len"] for e in steps_ev], name="gen_len"), row=2, col=1)
    fig.update_layout(
        title=f"SIMULATED (cluster twin): {trace.steps} steps to 1,024 GPUs ({trace.name}); "
        f"transitions {share:.3%} of run time (seed: six, 0.079%)"
    )
    _save(fig, "scale_run")


# --- 3 -----------------------------------------------------------------------------------------


OPTIMUM_BUDGETS = tuple(round(1.0 - 0.05 * i, 2) for i in range(9))
"""Exp3's and exp5's memory budgets: 100% of the device down to 60%."""
OPTIMUM_ALTERNATIVES = 8
OPTIMUM_MICRO_BATCHES = (1, 2, 4)


def optimum(
    twin: ClusterTwin,
    workload: PpoWorkload,
    accelerator: str,
    num_slots: int,
    lengths,
    *,
    learned: dict | None = None,
    extra: Sequence[Plan] = (),
    quick: bool = False,
) -> tuple[Judged, Plan, int] | None:
    """The best plan under the twin's physics by exhaustive evaluation: the planner's best and
    ``OPTIMUM_ALTERNATIVES`` next-best plans at every budget of ``OPTIMUM_BUDGETS`` (with the
    catalog's efficiencies and, given, ``learned`` ones), each with its training and inference
    micro-batches also at each of ``OPTIMUM_MICRO_BATCHES``, plus ``extra``; every one played
    in the twin for the sequences ``lengths`` (noise and interference off), the fastest that
    fits. With how many were played (None: none fits)."""
    budgets, alternatives = optimum_search(quick)
    plans = candidate_plans(
        workload,
        accelerator,
        num_slots,
        budgets=budgets,
        alternatives=alternatives,
        efficiencies=(None,) if learned is None else (None, learned),
        micro_batches=OPTIMUM_MICRO_BATCHES,
        extra=extra,
    )
    best = fastest(twin, plans, workload, lengths)
    return None if best is None else (*best, len(plans))


def optimum_search(quick: bool) -> tuple[tuple[float, ...], int]:
    """``optimum``'s memory budgets and alternatives (``--quick``: fewer)."""
    return (OPTIMUM_BUDGETS[::4], 3) if quick else (OPTIMUM_BUDGETS, OPTIMUM_ALTERNATIVES)


PLAN_QUALITY_STEPS = 40


def experiment_plan_quality(opts) -> dict:
    settings = [
        (model, accelerator, gpus, gen)
        for model, accelerator, pools in (
            ("llama-3.1-8b", "h100-sxm", (16, 64, 256)),
            ("qwen2.5-7b", "a100-80gb", (16, 64, 256)),
            ("qwen2.5-32b", "h200", (64, 128, 256)),
        )
        for gpus in pools
        for gen in (1024, 4096)
    ]
    steps = PLAN_QUALITY_STEPS
    if opts.quick:
        settings, steps = settings[:1] + settings[12:13], 10
    rows = []
    for model, accelerator, gpus, gen in settings:
        acc = CATALOG.accelerator(accelerator)
        workload = PpoWorkload.for_model(CATALOG.model(model), gen_len=gen)
        # The length holds at ``gen``: the plan is judged at the length the job ran at (each
        # response's length still spreads around it, as the engine draws them).
        trace = Trace(
            name=f"flat-{gen}",
            steps=steps,
            accelerator=accelerator,
            gpus=gpus,
            gen_len=((0, float(gen)), (steps, float(gen))),
            pool=(),
        )
        twin = world(accelerator, seed=11, interference=0.0)
        engine = SimulatedEngine(trace, acc, twin=twin, seed=5)
        controller = Controller(workload, acc, JobPolicy(thresholds={"efficiency": 0.05}))
        row = {"model": model, "gpu": accelerator, "gpus": gpus, "gen_len": gen}
        started = time.perf_counter()
        try:
            run_job(engine, controller, trace.steps)
        except PlanningError as exc:
            rows.append({**row, "error": str(exc)})
            continue
        lengths = fixed_lengths(trace, steps, workload.global_batch)
        at = _at(workload, lengths)
        best = optimum(
            twin,
            at,
            accelerator,
            gpus,
            lengths,
            learned=controller.calibrator.efficiency(),
            extra=[controller.plan],
            quick=opts.quick,
        )
        if best is None:
            rows.append({**row, "error": "no candidate fits in the twin (simulated)"})
            continue
        chosen = judge(twin, controller.plan, at, lengths)
        optimum_j, _, count = best
        rows.append(
            {
                **row,
                "selected_s": chosen.seconds,
                "selected_fits": chosen.fits,
                "optimum_s": optimum_j.seconds,
                # A selected plan that does not fit is no plan: it is not within anything.
                "ratio": chosen.seconds / optimum_j.seconds if chosen.fits else None,
                "candidates": count,
                "wall_s": time.perf_counter() - started,
            }
        )
    ok = [r for r in rows if r.get("ratio") is not None]
    budgets, alternatives = optimum_search(opts.quick)
    return {
        "rows": rows,
        "steps": steps,
        "budgets": budgets,
        "alternatives": alternatives,
        "within_5pct": sum(r["ratio"] <= 1.05 for r in ok),
        "within_2pct": sum(r["ratio"] <= 1.02 for r in ok),
        "settings": len(rows),
        "seed": "within 5% in all 18",
    }


# --- 4 -----------------------------------------------------------------------------------------


POLICIES = {
    "Nereus (payback)": JobPolicy(),
    "DynaRL-style (faster)": JobPolicy(admission="always_faster"),
    "never adapt": JobPolicy(admission="never"),
    "checkpoint/restart": JobPolicy(admission="restart"),
}
LOOKED_BACK = ("Nereus (payback)", "DynaRL-style (faster)")
"""The policies whose moves made for a saving exp4 replays in hindsight."""
SWEEP_SEEDS = (1, 2, 3, 4, 5)


def experiment_admission(opts) -> dict:
    steps = 40 if opts.quick else 500
    workload = PpoWorkload.for_model(CATALOG.model("llama-3.1-8b"), gen_len=500)
    twin = world("h100-sxm")
    out = {}
    for shape in ("oscillate", "step", "noisy"):
        trace = generate(shape, seed=9, steps=steps, gpus=32, accelerator="h100-sxm", spot=True)
        out[trace.name] = {}
        for name, policy in POLICIES.items():
            summary, controller, engine = _run(trace, "h100-sxm", workload, policy, twin=twin)
            out[trace.name][name] = {
                **summary.to_json(),
                "pool_changes_in_run": _pool_changes(trace, summary.seconds),
            }
            if name in LOOKED_BACK:
                seen = hindsight.moves(controller.events, engine, workload)
                out[trace.name][name]["hindsight"] = hindsight.summary(seen)
                start = _starter(trace, "h100-sxm", workload, policy, twin=twin)
                out[trace.name][name]["counterfactual"] = hindsight.replayed(
                    start, trace.steps, seen, engine.now()
                )
    means = {name: statistics.fmean(out[t][name]["mean_step_s"] for t in out) for name in POLICIES}
    return {
        "traces": out,
        "steps": steps,
        "average": means,
        "sweep": _admission_sweep(workload, twin, opts.quick),
        "seed": {"Nereus": 858.7, "DynaRL": 928.3},
    }


def _admission_sweep(workload, twin: ClusterTwin, quick: bool) -> dict:
    """Payback against DynaRL-style on more traces of the same shapes (other seeds, shorter):
    how often each wins, and by how much; a tie is the same decisions."""
    pair = LOOKED_BACK
    rows = []
    steps = 30 if quick else 300
    for shape in ("oscillate", "step", "noisy"):
        for seed in SWEEP_SEEDS[:1] if quick else SWEEP_SEEDS:
            trace = generate(
                shape, seed=seed, steps=steps, gpus=32, accelerator="h100-sxm", spot=True
            )
            means = {}
            for name in pair:
                summary, _, _ = _run(trace, "h100-sxm", workload, POLICIES[name], twin=twin)
                means[name] = summary.mean_step_s
            rows.append({"trace": trace.name, **means, "ratio": means[pair[0]] / means[pair[1]]})
    ratios = [r["ratio"] for r in rows]
    return {
        "rows": rows,
        "steps": steps,
        "seeds": list(SWEEP_SEEDS[:1] if quick else SWEEP_SEEDS),
        "payback_wins": sum(r < 1 - 1e-9 for r in ratios),
        "ties": sum(abs(r - 1) <= 1e-9 for r in ratios),
        "payback_loses": sum(r > 1 + 1e-9 for r in ratios),
        "mean_ratio": statistics.fmean(ratios),
        "worst_ratio": max(ratios),
        "best_ratio": min(ratios),
    }


# --- 5 -----------------------------------------------------------------------------------------


CALIBRATION_STEPS = 80


def _with_tenant(change: Callable[[Device], Device]) -> Callable[[Device], Device]:
    """``change``, and another tenant's process holding ``TENANT_BYTES`` of each GPU."""
    return lambda d: dataclasses.replace(change(d), reserved_bytes=TENANT_BYTES)


def experiment_calibration(opts) -> dict:
    rows = []
    acc = CATALOG.accelerator("a100-80gb")
    workload = PpoWorkload.for_model(CATALOG.model("llama-3.1-8b"), gen_len=2048)
    steps = 20 if opts.quick else CALIBRATION_STEPS
    scenarios = list(CALIBRATION_SCENARIOS.items())
    for scenario, (wrong, change) in scenarios[::2] if opts.quick else scenarios:
        twin = world(acc.name, _with_tenant(change), seed=13, interference=0.0)
        for gpus in (8, 64) if opts.quick else (8, 16, 64, 256):
            row = {"scenario": scenario, "wrong": wrong, "gpus": gpus}
            # The length stays at 2,048 tokens: both predictors plan for what the run does.
            trace = generate(
                "growth",
                seed=6,
                steps=steps,
                gpus=gpus,
                start_len=2048,
                end_len=2048,
                accelerator=acc.name,
            )
            try:
                offline = plan(workload, acc, gpus, num_alternatives=0).best
                engine = SimulatedEngine(trace, acc, twin=twin, seed=2)
                controller = Controller(workload, acc, JobPolicy(thresholds={"efficiency": 0.05}))
                run_job(engine, controller, trace.steps)
                # What the online-calibrated predictor selects once it has measured the job,
                # and what the job runs at the end (admission may not have moved there yet: a
                # move that needs a checkpoint/restart waits until it pays back).
                chosen = controller._candidate(engine, workload)
            except PlanningError as exc:
                rows.append({**row, "error": str(exc)})
                continue
            lengths = fixed_lengths(trace, steps, workload.global_batch)
            at = _at(workload, lengths)
            off = judge(twin, offline, at, lengths)
            sel = judge(twin, chosen, at, lengths)
            on = judge(twin, controller.plan, at, lengths)
            best = optimum(
                twin,
                at,
                acc.name,
                gpus,
                lengths,
                learned=controller.calibrator.efficiency(),
                extra=(offline, chosen, controller.plan),
                quick=opts.quick,
            )
            if best is None:
                rows.append({**row, "error": "no candidate fits in the twin (simulated)"})
                continue
            best_j, _, count = best

            def over(a: Judged, b: Judged) -> float | None:
                return a.seconds / b.seconds if a.fits and b.fits else None

            rows.append(
                {
                    **row,
                    "offline_s": off.seconds,
                    "offline_fits": off.fits,
                    "offline_peak": off.peak,
                    "selected_s": sel.seconds,
                    "selected_fits": sel.fits,
                    "selected_peak": sel.peak,
                    "restarts": controller.restarts,
                    "transitions": controller.transitions,
                    "online_s": on.seconds,
                    "online_fits": on.fits,
                    "online_peak": on.peak,
                    "optimum_s": best_j.seconds,
                    "candidates": count,
                    "offline_over_online": over(off, on),
                    "offline_over_selected": over(off, sel),
                    "selected_over_optimum": over(sel, best_j),
                    "online_over_optimum": over(on, best_j),
                }
            )
    return {
        "rows": rows,
        "steps": steps,
        "tenant_gib": TENANT_BYTES / GIB,
        "seed": "offline infeasible at 8 GPUs; up to 1.56x slower at 64-256",
    }


# --- where adaptation pays ---------------------------------------------------------------------


MAP_MODELS = ("llama-3.1-8b", "qwen2.5-32b", "llama-3.1-70b")
MAP_POOLS = (16, 64, 256, 1024)
MAP_GROWTH = {"none": (1000, 1000), "4x": (1000, 4000), "16x": (500, 8000)}
"""Length growth over a cell's steps: (first, last) mean generated tokens."""
MAP_VOLATILITY = ("none", "spot")
MAP_STEPS = 60
MAP_STEPS_QUICK = 10


def _map_key(cell: dict) -> tuple:
    return (cell["model"], cell["gpus"], cell["growth"], cell["volatility"], cell["steps"])


def _cells_path() -> Path:
    return _Out.results / "adaptation_map_cells.jsonl"


def _stored_cells() -> dict[tuple, dict]:
    path = _cells_path()
    if not path.exists():
        return {}
    cells = {}
    for line in path.read_text().splitlines():
        if line.strip():
            cell = json.loads(line)
            cells[_map_key(cell)] = cell
    return cells


def _expected_hours(workload, acc, gpus: int, lengths: tuple[int, int], steps: int) -> float:
    """How long the planner expects ``steps`` steps to take from the first length to the last
    (the mean of its predicted step seconds at the two): a spot pool's changes are spread over
    it, so that a short run sees them. 10 hours where it has no plan."""
    predicted = []
    for n in lengths:
        try:
            found = plan(workload.with_gen_len(n), acc, gpus, num_alternatives=0).best
        except PlanningError:
            continue
        predicted.append(found.predicted_step_s)
    if not predicted:
        return 10.0
    return max(0.05, steps * statistics.fmean(predicted) / 3600)


def map_cell(model: str, gpus: int, growth: str, volatility: str, steps: int) -> dict:
    """One cell of the map: Nereus and the seed's baseline on the same trace and twin."""
    baseline = seed_baseline()
    first, last = MAP_GROWTH[growth]
    acc = CATALOG.accelerator("h100-sxm")
    workload = PpoWorkload.for_model(
        CATALOG.model(model), gen_len=first, global_batch=max(256, 8 * gpus)
    )
    spot = volatility == "spot"
    hours = _expected_hours(workload, acc, gpus, (first, last), steps) if spot else 10.0
    trace = generate(
        "growth",
        seed=1,
        steps=steps,
        gpus=gpus,
        accelerator="h100-sxm",
        start_len=first,
        end_len=last,
        spot=spot,
        hours=hours,
    )
    twin = world("h100-sxm")
    cell = {
        "model": model,
        "gpus": gpus,
        "growth": growth,
        "volatility": volatility,
        "steps": steps,
        "global_batch": workload.global_batch,
        "lengths": [first, last],
        "pool_hours": hours if spot else None,
        "runs": {},
    }
    started = time.perf_counter()
    for name, policy in (("nereus", JobPolicy()), ("seed_baseline", baseline)):
        t = time.perf_counter()
        try:
            summary, controller, _ = _run(trace, "h100-sxm", workload, policy, twin=twin)
        except PlanningError as exc:
            cell["runs"][name] = {"state": "no plan fits", "error": str(exc)}
            if name == "nereus":  # the same first plan: the baseline has none either
                cell["runs"]["seed_baseline"] = {"state": "no plan fits", "error": str(exc)}
                break
            continue
        completed = summary.steps > summary.failed_steps
        cell["runs"][name] = {
            **summary.to_json(),
            "state": "ran" if completed else "completed no step",
            "relaxed": _relaxed(controller),
            "pool_changes_in_run": _pool_changes(trace, summary.seconds),
            "wall_s": time.perf_counter() - t,
        }
    runs = cell["runs"]
    nereus, base = runs["nereus"]["state"], runs["seed_baseline"]["state"]
    cell["gain"] = None
    if nereus == base == "ran":
        cell["verdict"] = "both run"
        cell["gain"] = 1 - runs["nereus"]["mean_step_s"] / runs["seed_baseline"]["mean_step_s"]
    elif nereus == base == "no plan fits":
        cell["verdict"] = "neither fits"
    else:  # a run whose every step failed (out of memory, its slots gone) has no step time
        cell["verdict"] = f"Nereus: {nereus}; baseline: {base}"
    cell["wall_s"] = time.perf_counter() - started
    return cell


def _choose(given: str | None, known: Sequence, kind=str) -> list:
    if not given:
        return list(known)
    chosen = [kind(v.strip()) for v in given.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in known]
    if unknown:
        raise SystemExit(f"sim_experiments: unknown {unknown[0]!r}; known: {list(known)}")
    return chosen


def experiment_map(opts, *, run: bool = True) -> dict:
    """Where adaptation pays: each cell of model × pool × length growth × pool volatility not
    already in ``adaptation_map_cells.jsonl`` (at this many steps) is run and appended there as
    it finishes; the result is every stored cell at this many steps. ``run=False``: the stored
    cells alone."""
    steps = opts.map_steps or (MAP_STEPS_QUICK if opts.quick else MAP_STEPS)
    models = _choose(opts.map_models, MAP_MODELS)
    pools = _choose(opts.map_pools, MAP_POOLS, int)
    growths = _choose(opts.map_growth, tuple(MAP_GROWTH))
    volatilities = _choose(opts.map_volatility, MAP_VOLATILITY)
    if run:
        seed_baseline()  # before any cell: the baseline must exist
    stored = _stored_cells()
    path = _cells_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    selected = [
        (m, g, growth, v, steps)
        for m in models
        for g in pools
        for growth in growths
        for v in volatilities
    ]
    for key in selected:
        if key in stored or not run:
            continue
        cell = map_cell(*key)
        stored[key] = cell
        with path.open("a") as out:
            out.write(json.dumps(cell) + "\n")
        gain = "–" if cell["gain"] is None else f"{cell['gain']:+.1%}"
        print(
            f"[map {key[0]} {key[1]} GPUs, growth {key[2]}, {key[3]}: {cell['verdict']}, "
            f"gain {gain}, {cell['wall_s']:.0f} s]",
            flush=True,
        )
    order = [
        (m, g, growth, v, steps)
        for m in MAP_MODELS
        for g in MAP_POOLS
        for growth in MAP_GROWTH
        for v in MAP_VOLATILITY
    ]
    cells = [stored[k] for k in order if k in stored]
    return {"steps": steps, "cells": cells, "grid": len(order)}


# --- output ------------------------------------------------------------------------------------


def _save(fig, name: str) -> None:
    _Out.figures().mkdir(parents=True, exist_ok=True)
    fig.write_html(_Out.figures() / f"{name}.html", include_plotlyjs="directory")


def _bars(
    name: str,
    title: str,
    groups: list[str],
    series: dict[str, list[float | None]],
    y: str,
    seed: tuple[float, str] | None = None,
) -> None:
    """Grouped bars; ``seed``: the seed's figure, as a dashed line with its label."""
    import plotly.graph_objects as go

    fig = go.Figure([go.Bar(name=label, x=groups, y=values) for label, values in series.items()])
    if seed is not None:
        fig.add_hline(y=seed[0], line_dash="dash", annotation_text=seed[1])
    fig.update_layout(barmode="group", title=f"SIMULATED (cluster twin): {title}", yaxis_title=y)
    _save(fig, name)


def figures(results: dict) -> None:
    """One plotly figure per experiment present besides exp2's run (``experiment_scale`` draws
    it), each beside the seed's figure where the seed has one."""
    if e1 := results.get("adaptation"):
        clusters = [r["cluster"] for r in e1["rows"]]
        _bars(
            "adaptation",
            f"mean s/step per policy on trace {e1['trace']}",
            clusters,
            {p: [r["runs"][p].get("mean_step_s") for r in e1["rows"]] for p in ADAPTATION_POLICIES},
            "mean s/step",
        )
        _bars(
            "adaptation_reduction",
            "online TP/PP adaptation: reduction of mean s/step vs the seed's baseline",
            clusters,
            {
                "measured": [r["reduction"] for r in e1["rows"]],
                "oracle (best of the planner's candidates, judged by the twin)": [
                    r["bound"].get("reduction") for r in e1["rows"]
                ],
            },
            "1 - online / baseline",
            seed=(e1["seed"], "seed: 27.7%"),
        )
    if e3 := results.get("plan_quality"):
        rows = [r for r in e3["rows"] if r.get("ratio") is not None]
        _bars(
            "plan_quality",
            "selected plan over the best of every candidate, judged by the twin",
            [f"{r['model']} {r['gpus']}x{r['gpu']} {r['gen_len']}" for r in rows],
            {"selected / optimum": [r["ratio"] for r in rows]},
            "ratio (1 is the optimum)",
            seed=(1.05, "seed: within 5% in all 18"),
        )
    if e4 := results.get("admission"):
        traces = e4["traces"]
        _bars(
            "admission",
            "admission policies on held-out traces (seed: Nereus 858.7 vs DynaRL 928.3 s/step, "
            "a ratio of 0.925, on its own traces)",
            list(traces),
            {p: [traces[t][p]["mean_step_s"] for t in traces] for p in POLICIES},
            "mean s/step",
        )
    if e5 := results.get("calibration"):
        rows = [r for r in e5["rows"] if "offline_s" in r]
        _bars(
            "calibration",
            "offline vs online-calibrated predictor, step seconds judged by the twin "
            "(seed: offline infeasible at 8 GPUs, up to 1.56x slower at 64-256)",
            [f"{r['scenario']}, {r['gpus']} GPUs" for r in rows],
            {
                "offline": [r["offline_s"] if r["offline_fits"] else None for r in rows],
                "online-selected": [r["selected_s"] if r["selected_fits"] else None for r in rows],
                "optimum": [r["optimum_s"] for r in rows],
            },
            "s/step (a missing bar: the plan does not fit)",
        )
    if (em := results.get("map")) and em["cells"]:
        _figure_map(em)


def _figure_map(em: dict) -> None:
    """Heat maps of adaptation's gain: a row per pool volatility, a column per model, pools
    across and length growth down; a cell where neither fits is blank and says so."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    cells = {(c["model"], c["gpus"], c["growth"], c["volatility"]): c for c in em["cells"]}
    models = [m for m in MAP_MODELS if any(k[0] == m for k in cells)]
    volatilities = [v for v in MAP_VOLATILITY if any(k[3] == v for k in cells)]
    pools = [g for g in MAP_POOLS if any(k[1] == g for k in cells)]
    growths = [g for g in MAP_GROWTH if any(k[2] == g for k in cells)]
    fig = make_subplots(
        rows=len(volatilities),
        cols=len(models),
        subplot_titles=[f"{m}, pool volatility: {v}" for v in volatilities for m in models],
        horizontal_spacing=0.06,
        vertical_spacing=0.12,
    )
    for i, v in enumerate(volatilities, 1):
        for j, m in enumerate(models, 1):
            z, text = [], []
            for growth in growths:
                zr, tr = [], []
                for g in pools:
                    c = cells.get((m, g, growth, v))
                    if c is None:
                        zr.append(None)
                        tr.append("not run")
                    elif c["gain"] is None:
                        zr.append(None)
                        tr.append(c["verdict"])
                    else:
                        zr.append(100 * c["gain"])
                        tr.append(f"{c['gain']:+.1%}")
                z.append(zr)
                text.append(tr)
            fig.add_trace(
                go.Heatmap(
                    z=z,
                    x=[f"{g} GPUs" for g in pools],
                    y=[f"growth {g}" for g in growths],
                    text=text,
                    texttemplate="%{text}",
                    coloraxis="coloraxis",
                ),
                row=i,
                col=j,
            )
    fig.update_layout(
        title=f"SIMULATED (cluster twin): where adaptation pays, 1 - Nereus / seed's baseline "
        f"mean s/step, {em['steps']} steps a cell on h100-sxm (no seed figure: new)",
        coloraxis={"colorscale": "RdBu", "cmid": 0, "colorbar": {"title": "gain %"}},
    )
    _save(fig, "adaptation_map")


TWIN = (
    "**What the twin models** (`runtime/twin`, whose docstrings cite every figure): each step is "
    "played from the plan's units and the step's sequences, each response with its own length "
    "drawn from the trace (lognormal around the step's mean, σ 0.6, cut at 4× the mean): "
    "generation as a serving engine batches it (continuous batching into a paged KV cache sized "
    "from what each unit's fullest slot has free, preemption, captured decode graphs and the "
    "host's time per iteration); inference and training micro-batch by micro-batch through "
    "their pipelines (1F1B), each micro-batch padded to its longest sequence; GEMMs in tile "
    "waves at the best rate a GEMM achieves, flash attention, memory-bound decode; ring and "
    "tree collectives over the links a group spans (NVLink inside a node, one network card per "
    "rank across nodes); the actor's weights resharded into the generation and inference "
    "layouts; model-stages whose groups cross nodes at once slowing each other; other tenants' "
    "traffic slowing inter-node links in a four-hour wave; lognormal noise on every "
    "model-stage; and an allocator that fails a step whose fullest slot passes its device's "
    "memory less what the runtime reserves. Its hardware figures are public measurements "
    "(`runtime/twin/hardware.py`). It leaves out overlap of the data-parallel all-reduce with "
    "the backward pass, sequence packing, speculative decoding, prefix caching, the optimizer's "
    "all-gather under ZeRO, link failures (only whole slots fail), NUMA and PCIe topology "
    "inside a node, and GPU clock throttling. The planner never reads it: it starts wrong "
    "about this world (its cost model has one length per step and no padding) and learns it "
    "online. The twin is never tuned toward a figure: where a result here differs from the "
    "seed's, that is how it came out."
)


def _run_cell(r: dict) -> str:
    if "mean_step_s" not in r:
        return "– (no plan fits)" if "error" in r else "–"
    if r.get("state") == "completed no step":
        return f"– (no step completed: {r['failed_steps']} failed, {r['restarts']}r)"
    return (
        f"{r['mean_step_s']:.2f} ({r['transitions']}t/{r['restarts']}r"
        + (f", relaxed {r['relaxed']}" if r.get("relaxed") else "")
        + ")"
    )


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.1%}"


def _versus(r: dict) -> str:
    """An ``_online_vs_seed`` result as the table's notes show it."""
    return (
        f"{r['online_s']:.2f} ({r['online_transitions']}t) vs "
        f"{r['fixed_s']:.2f} ({r['fixed_transitions']}t), {r['reduction']:.1%}"
    )


def _pair(seconds: list[float]) -> str:
    if len(seconds) < 2:
        return "–"
    return f"{seconds[0]:.1f} ({seconds[1]:.1f})"


def _md_adaptation(e1: dict) -> list[str]:
    lines = [
        "## 1. Online TP/PP adaptation vs the initial TP/PP layouts with DP scaling",
        "",
        f"Trace `{e1['trace']}` ({e1['steps']} steps, 500 to 8,000 tokens, spot-like 64-GPU "
        "pool whose reclaims are announced two minutes ahead, as EC2 Spot's are; a slot lost "
        "unannounced cuts its step short), Llama-3.1-8B, 256 sequences a step, h100-sxm; mean "
        "s/step, all time included (t: transitions, r: restarts; relaxed: replans in which the "
        "kept layouts no longer fitted, so that the planner chose freely).",
        "",
        "| cluster | "
        + " | ".join(ADAPTATION_POLICIES)
        + " | reduction vs seed's baseline | vs hindsight layouts | vs initial, relaxed "
        "| vs learned layouts | oracle: best of the planner's candidates, judged by the twin |",
        "| --- |" + " --- |" * (len(ADAPTATION_POLICIES) + 5),
    ]
    for row in e1["rows"]:
        cells = [_run_cell(row["runs"].get(name, {})) for name in ADAPTATION_POLICIES]
        b = row["bound"]
        bound = (
            f"{b['reduction']:.1%} ({b['any_layouts_s']:.2f} vs {b['kept_layouts_s']:.2f} s)"
            if b.get("points")
            else "–"
        )
        lines.append(
            f"| {row['cluster']} | {' | '.join(cells)} | **{_pct(row['reduction'])}** | "
            f"{_pct(row['reduction_vs_hindsight'])} | {_pct(row['reduction_vs_initial'])} | "
            f"{_pct(row['reduction_vs_learned'])} | {bound} |"
        )
    first = e1["rows"][0]
    changes = first["runs"][SEED_BASELINE].get("pool_changes_in_run")
    lines += [
        "",
        "Seed: **27.7%** lower mean step latency than the initial fixed TP/PP layout with DP "
        "scaling. The seed's baseline here: the layouts the controller picks at step 0 for "
        "step-0 conditions, kept (DP follows the pool), and the micro-batches chosen at launch, "
        "halved only after an out-of-memory step has cost a restart "
        "(`JobPolicy(fixed_layouts=True, fixed_micro_batches=True)`). Hindsight layouts: "
        "planned once for the trace's longest mean length, before anything is measured "
        "("
        + ", ".join(f"{n} TP{tp}/PP{pp}" for n, (tp, pp) in e1["hindsight_layouts"].items())
        + "), micro-batches planned. Initial, relaxed: the first plan's layouts kept until they "
        "no longer fit, micro-batches planned. Learned layouts: planned for the longest length "
        "with the efficiencies and memory the online run's calibrator had learned by its end "
        "(as if the cluster had been profiled before the run; it replaces the older "
        "simulator's row planned with the true efficiencies, which the twin does not have: "
        "on a misjudged cluster, what "
        "adaptation wins over these is its own share, the rest of what it wins over the "
        "hindsight layouts is calibration's). The clusters other than the first are exp5's "
        f"scenarios (below). Pool changes within the baseline's run: {changes} (the trace's "
        "spot pool changes 14 times in its first 10 hours).",
        "",
        "Oracle: at every "
        f"{first['bound'].get('every', '?')}th step of the seed's baseline run, on the pool it "
        "had then and one draw of that step's response lengths, the planner's best plan and its "
        f"{BOUND_ALTERNATIVES} next-best at memory budgets "
        + ", ".join(f"{b:.0%}" for b in BOUND_BUDGETS)
        + " of the device (with the catalog's efficiencies and with those the online run "
        "learned) are played in the twin, noise and interference off, and the fastest that "
        "fits is taken: with any layouts, and keeping the baseline's (DP and micro-batches "
        "replanned). 1 minus the ratio of their mean seconds is the most that replanning the "
        "layouts among the planner's candidates could cut, for free and knowing the twin; it "
        "is no bound on plans the planner never proposes ("
        + "; ".join(
            f"{r['cluster']}: {r['bound'].get('points', 0)} points, "
            f"{r['bound'].get('candidates_per_point', 0):.0f} candidates a point, "
            f"{r['bound'].get('relaxed_points', 0)} where the kept layouts fit nowhere"
            for r in e1["rows"]
        )
        + ").",
    ]
    online = first["runs"][ONLINE]
    if online.get("counterfactual"):
        why = online["hindsight"]["transitions"]
        whole = online["counterfactual"]["without_saving_moves"]
        base_s = first["runs"][SEED_BASELINE]["mean_step_s"]
        without_s = whole["without_s"] / max(1, online["steps"] - online["failed_steps"])
        lines += [
            "",
            f"As catalogued, online adaptation's {online['transitions']} transitions were made "
            "for: " + (", ".join(f"{n} {w}" for w, n in why.items() if n) or "nothing") + ". "
            "Replayed from its seeds without its moves made for a saving "
            f"(`hindsight.replayed`), the run takes {without_s:.2f} s/step "
            f"({1 - without_s / base_s:.1%} under the seed's baseline): those moves bought "
            f"{whole['net_s']:+.1f} s.",
        ]
    if e1.get("spread"):
        lines += [
            "",
            "As catalogued, under other engine seeds (each step's response lengths and noise; "
            "online vs the seed's baseline, mean s/step, transitions): "
            + "; ".join(f"seed {r['engine_seed']}: {_versus(r)}" for r in e1["spread"])
            + ".",
        ]
    if e1.get("steady_links"):
        lines += [
            "",
            "As catalogued, on links whose speed does not shift over the hours (no "
            f"interference; engine seed {ENGINE_SEED}): {_versus(e1['steady_links'])}.",
        ]
    return [*lines, ""]


def _md_scale(e2: dict) -> list[str]:
    s = e2["summary"]
    lines = [
        "## 2. Growing to 1,024 GPUs",
        "",
        f"Trace `{e2['trace']}`, {s['steps']} steps, Llama-3.1-8B, 8,192 sequences a step. "
        f"GPUs reached: {e2['gpus_reached']}; transitions: {s['transitions']} taking "
        f"{s['transition_seconds']:.1f} s = **{e2['transition_share']:.3%}** of "
        f"{s['seconds'] / 3600:.1f} h (seed: six, 0.079%); restarts: {s['restarts']}; "
        f"simulated in {e2['wall_s']:.0f} s of wall time ({e2['wall_s_per_step']:.1f} s a "
        "step). Moving state alone (without rebuilding the generation and inference engines in "
        f"their new layouts): **{e2['moving_share']:.3%}**. With the steps that generated while "
        "new units joined counted too (their generation's excess over the next step's, "
        f"{e2['joining_excess_s']:.1f} s): **{e2['share_with_joining']:.3%}**. In "
        f"{e2['built_ahead']} of the transitions the new units on granted slots were built "
        "during one more step on the old plan (that step's forgone saving is in the step time, "
        "and admission priced it).",
        "",
        "| memory runway | micro-batches | least saving | transitions | micro-batch changes | "
        "restarts | transition share | run h | mean s/step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    variants = [("shortest", "planned", "1%", e2["default"])]
    if "runways" in e2:
        variants += [(n, "planned", "1%", r) for n, r in e2["runways"].items() if n != "shortest"]
    variants.append(("shortest", "pinned", "1%", e2["pinned_micro_batches"]))
    if "no_dead_band" in e2:
        variants.append(("shortest", "planned", "0", e2["no_dead_band"]))
    lines += [
        f"| {name} | {mb} | {band} | {r['transitions']} | {r['rebatches']} | {r['restarts']} | "
        f"{r['transition_share']:.3%} | {r['seconds'] / 3600:.3f} | {r['mean_step_s']:.2f} |"
        for name, mb, band, r in variants
    ]
    lines += [
        "",
        "Planned micro-batches: training and inference run in the fastest micro-batch that "
        "fits each layout, generation decodes in waves where its KV cache cannot hold a unit's "
        "sequences at once, and a layout memory outgrows is first given smaller micro-batches "
        "or more waves, which moves no state. Pinned: every micro-batch is the workload's and "
        "every sequence is decoded at once (`adaptive_micro_batch: false`). "
        + (
            ""
            if "runways" in e2
            else "(The memory runways and the run without admission's dead band: `--full-exp2`.)"
        ),
        "",
        "| # | step | why | predicted s | actual s | of which rebuilding s | nodes | "
        "units built ahead | units joining | charged s | generation s, first step (next) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *(
            f"| {i} | {t.get('step', '')} | {t.get('why', '')} | {t['predicted_s']:.1f} | "
            f"{t['actual_s']:.1f} | {t['rebuild_s']:.1f} | "
            f"{t['nodes']} | {t['built_ahead']} | {t.get('joining', 0)} | "
            f"{t.get('joining_s', 0.0):.1f} | {_pair(t.get('generation_s', []))} |"
            for i, t in enumerate(e2["transitions"], 1)
        ),
        "",
        "Why: the slots changed (`slots`), the running plan would not fit the length the trend "
        "reaches within the lookahead (`memory`), or admission found that the move repays "
        "itself (`saving`). What each move made for its saving truly saved over its life "
        "(`runtime/engine/hindsight.py`: at every later step, the plan that step ran against "
        "the same plan with the model-stages the move changed back as they were, both played "
        "in the twin with that step's sequences and link load, noise aside, until the pool "
        "changes, those model-stages move again or their old layouts would no longer fit):",
        "",
        "| # | step | moved | predicted saving s/step | true saving s/step | over steps | "
        "true saving s | move s (with the joining charge) | net s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *(
            f"| {i} | {t['step']} | "
            + ", ".join(
                f"{m['model_stage']} TP{m['before'][0]}/PP{m['before'][1]} → "
                f"TP{m['after'][0]}/PP{m['after'][1]}"
                for m in t["moved"]
            )
            + f" | {t['predicted_saving_s'] or 0:.3f} | "
            f"{t['true_saving_s'] / max(1, t['steps']):.3f} | {t['steps']} ({t['until']}) | "
            f"{t['true_saving_s']:.1f} | {t['cost_s']:.1f} | {t['net_s']:+.1f} |"
            for i, t in enumerate(e2["transitions"], 1)
            if t.get("true_saving_s") is not None
        ),
        "",
        *_counterfactual_lines(e2.get("counterfactual"), s["steps"]),
    ]
    return lines


def _md_plan_quality(e3: dict) -> list[str]:
    lines = [
        "## 3. Selected plan vs the best plan under the twin's physics",
        "",
        "| model | GPUs | gen len | candidates played | selected s | optimum s | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in e3["rows"]:
        where = f"| {r['model']} | {r['gpus']} × {r['gpu']} | {r['gen_len']} |"
        if "optimum_s" in r:
            ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "does not fit"
            lines.append(
                f"{where} {r['candidates']} | {r['selected_s']:.2f} | {r['optimum_s']:.2f} | "
                f"{ratio} |"
            )
        else:
            lines.append(f"{where} – | – | – | {r['error']} |")
    counts = [r["candidates"] for r in e3["rows"] if "candidates" in r]
    lines += [
        "",
        f"Within 5%: {e3['within_5pct']}/{e3['settings']}; within 2%: {e3['within_2pct']} "
        "(seed: within 5% in all 18). Each job runs "
        f"{e3['steps']} steps at its length (each response's length drawn around it), "
        "calibration learning from the start; its plan after the last step is judged against "
        "the optimum, the best plan under the twin's physics by exhaustive evaluation, not "
        "under the planner's formula: the planner's best plan and its "
        f"{e3.get('alternatives', OPTIMUM_ALTERNATIVES)} next-best at memory budgets of "
        + ", ".join(f"{b:.0%}" for b in e3.get("budgets", OPTIMUM_BUDGETS))
        + " of the device, with the catalog's efficiencies and with those the job learned, "
        "each also with its training and inference micro-batches at "
        + ", ".join(map(str, OPTIMUM_MICRO_BATCHES))
        + ", plus the selected plan; every candidate played in the twin with one draw of the "
        "step's response lengths (noise and interference off), the fastest that fits winning. "
        + (
            f"Candidates played per setting: {min(counts)} to {max(counts)} "
            f"(mean {statistics.fmean(counts):.0f})."
            if counts
            else ""
        )
        + " The selected plan is judged the same way; one that does not fit is no ratio.",
        "",
    ]
    return lines


def _md_admission(e4: dict) -> list[str]:
    names = list(POLICIES)
    lines = [
        "## 4. Admission on held-out traces (mean s/step, all time included)",
        "",
        "| trace | " + " | ".join(names) + " |",
        "| --- | " + " | ".join("---" for _ in names) + " |",
    ]
    for trace, runs in e4["traces"].items():
        cells = [
            f"{runs[n]['mean_step_s']:.2f} ({runs[n]['transitions']}t/{runs[n]['restarts']}r)"
            for n in names
        ]
        lines.append(f"| {trace} | " + " | ".join(cells) + " |")
    lines.append("| average | " + " | ".join(f"{e4['average'][n]:.2f}" for n in names) + " |")
    lines += [
        "",
        f"({e4['steps']} steps a trace, Llama-3.1-8B on 32 h100-sxm; t: transitions, r: "
        "restarts; spot-like pools, reclaims announced two minutes ahead; seed: 858.7 vs "
        "928.3 s/step on its own traces, a ratio of 0.925; ours: "
        f"{e4['average'][names[0]] / e4['average'][names[1]]:.3f})",
        "",
    ]
    looked = [
        f"{trace}: "
        + "; ".join(
            f"{name.split(' ')[0]} {h['moves_for_saving']} made, {h['repaid']} repaid, "
            f"net {h['net_s']:+.0f} s"
            for name in LOOKED_BACK
            if (h := runs[name].get("hindsight"))
        )
        for trace, runs in e4["traces"].items()
    ]
    if any("made" in line for line in looked):
        lines += [
            "The moves each made for its saving, in hindsight (`runtime/engine/hindsight.py`: "
            "what it truly saved over its life, against its cost; a life ends where the pool "
            "changes): " + " · ".join(looked) + ".",
            "",
        ]
    replays = [
        (trace, name, runs[name]["counterfactual"], runs[name]["steps"])
        for trace, runs in e4["traces"].items()
        for name in LOOKED_BACK
        if runs[name].get("counterfactual")
    ]
    if replays:
        lines += [
            "What those moves bought, by replaying each run from its seeds without them "
            "(`hindsight.replayed`; the replays share the run's per-step draws, so what differs "
            "is what the moves did, their cost and everything that followed from them "
            "included). Each alone: the run copied before the decision the move carried out "
            "goes on with that move refused. All: the run again with every move for a saving "
            "refused (moves for slots, memory and failures made as before).",
            "",
            "| trace | policy | moves for a saving, replayed | each alone: paid | each alone: "
            "best, worst net s | all refused: s/step | all: bought s |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *(
                f"| {trace} | {name} | {len(met)} | {c['paid']} | "
                + (
                    f"{max(m['net_s'] for m in met):+.0f}, {min(m['net_s'] for m in met):+.0f}"
                    if met
                    else "–"
                )
                + f" | {c['without_saving_moves']['without_s'] / max(1, steps):.2f} | "
                f"{c['without_saving_moves']['net_s']:+.0f} |"
                for trace, name, c, steps in replays
                for met in [[m for m in c["moves"] if m.get("met", True)]]
            ),
            "",
        ]
    sweep = e4["sweep"]
    lines += [
        f"Over {len(sweep['rows'])} more traces (seeds {sweep['seeds'][0]}-{sweep['seeds'][-1]} "
        f"of each shape, {sweep['steps']} steps), payback vs DynaRL-style: "
        f"{sweep['payback_wins']} wins, {sweep['ties']} ties (the same decisions), "
        f"{sweep['payback_loses']} losses; mean ratio {sweep['mean_ratio']:.4f} (best "
        f"{sweep['best_ratio']:.4f}, worst {sweep['worst_ratio']:.4f}).",
        "",
    ]
    return lines


def _md_calibration(e5: dict) -> list[str]:
    lines = [
        "## 5. Offline-calibrated vs online-calibrated predictor",
        "",
        "Llama-3.1-8B at 2,048 tokens on a100-80gb. Step seconds, judged by the twin (one "
        "draw of the step's response lengths, noise and interference off), of the offline "
        "predictor's plan (the catalog's figures, no memory learning), of the plan the "
        f"online-calibrated predictor selects after {e5['steps']} steps, of the plan the job "
        "runs then (a move that needs a checkpoint/restart waits until it repays), and of the "
        "optimum (as exp3's, with these three among the candidates).",
        "",
        "| scenario | GPUs | offline s (fits, peak) | online-selected s (fits, peak) | running s | "
        "optimum s | candidates | offline/online-selected | online-selected/optimum |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def ratio(v):
        return "–" if v is None else f"{v:.3f}"

    for r in e5["rows"]:
        if "offline_s" not in r:
            lines.append(f"| {r['scenario']} | {r['gpus']} | {r['error']} | | | | | | |")
            continue
        lines.append(
            f"| {r['scenario']} | {r['gpus']} | {r['offline_s']:.2f} ({r['offline_fits']}, "
            f"{r['offline_peak']:.0%}) | {r['selected_s']:.2f} ({r['selected_fits']}, "
            f"{r['selected_peak']:.0%}) | {r['online_s']:.2f} | {r['optimum_s']:.2f} | "
            f"{r['candidates']} | {ratio(r['offline_over_selected'])} | "
            f"{ratio(r['selected_over_optimum'])} |"
        )
    lines += [
        "",
        "Seed: offline picks an infeasible plan at 8 GPUs, up to 1.56× slower plans at 64–256. "
        "(peak: the fullest slot's over its device's memory; a ratio with a plan that does "
        "not fit is –.) Scenarios: the twin's device changed, each with another tenant's "
        f"process holding {e5['tenant_gib']:.0f} GiB of every GPU (`Device.reserved_bytes`; "
        "the older simulator's activations at 1.5× the model's memory cannot be said of the "
        "twin, whose memory is its own arithmetic):",
    ]
    lines += [f"- {name}: {wrong}." for name, (wrong, _) in CALIBRATION_SCENARIOS.items()]
    return [*lines, ""]


def _md_map(em: dict) -> list[str]:
    lines = [
        "## 6. Where adaptation pays",
        "",
        "Adaptation's gain, 1 − Nereus's mean s/step over the seed's baseline's (both with all "
        f"time included), {em['steps']} steps a cell on h100-sxm, "
        "global batch max(256, 8 × GPUs), a growth trace from the first length to the last; "
        "volatility spot: the spot-like pool of exps 1 and 4 (14 changes of an eighth or a "
        "quarter of the pool, reclaims announced two minutes ahead) spread over the time the "
        "planner expects the cell's steps to take. "
        f"{len(em['cells'])} of {em['grid']} cells run (no seed figure: the map is new).",
        "",
        "| model | GPUs | growth | volatility | Nereus s/step | seed's baseline s/step | gain |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in em["cells"]:
        first, last = c["lengths"]
        runs = c["runs"]
        gain = f"**{c['gain']:+.1%}**" if c["gain"] is not None else c["verdict"]
        lines.append(
            f"| {c['model']} | {c['gpus']} | {c['growth']} ({first}→{last}) | "
            f"{c['volatility']} | {_run_cell(runs.get('nereus', {}))} | "
            f"{_run_cell(runs.get('seed_baseline', {}))} | {gain} |"
        )
    return [*lines, ""]


def markdown(results: dict, *, quick: bool = False) -> str:
    lines = [
        "# Simulated experiments on the cluster twin (SIMULATED: no figure here comes from "
        "hardware)",
        "",
        TWIN,
        "",
    ]
    if quick:
        lines += ["(`--quick`: fewer steps and settings, a check that the code runs.)", ""]
    for key, section in (
        ("adaptation", _md_adaptation),
        ("scale", _md_scale),
        ("plan_quality", _md_plan_quality),
        ("admission", _md_admission),
        ("calibration", _md_calibration),
        ("map", _md_map),
    ):
        if key in results:
            lines += section(results[key])
    return "\n".join(lines) + "\n"


EXPERIMENTS = {
    "adaptation": experiment_adaptation,
    "scale": experiment_scale,
    "plan_quality": experiment_plan_quality,
    "admission": experiment_admission,
    "calibration": experiment_calibration,
    "map": experiment_map,
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer steps and settings")
    parser.add_argument(
        "--only",
        choices=sorted(EXPERIMENTS),
        help="run this experiment alone; the others' results are those last written (on the twin)",
    )
    parser.add_argument(
        "--full-exp2",
        action="store_true",
        help="exp2 also runs the memory runways, no dead band, and counterfactual replays",
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=_report.RESULTS,
        help="where results go (default: %(default)s)",
    )
    parser.add_argument(
        "--map-steps", type=int, help=f"steps a map cell (default {MAP_STEPS}; --quick: 10)"
    )
    parser.add_argument("--map-models", help="comma list of " + ", ".join(MAP_MODELS))
    parser.add_argument("--map-pools", help="comma list of " + ", ".join(map(str, MAP_POOLS)))
    parser.add_argument("--map-growth", help="comma list of " + ", ".join(MAP_GROWTH))
    parser.add_argument("--map-volatility", help="comma list of " + ", ".join(MAP_VOLATILITY))
    args = parser.parse_args()
    if args.map_steps is not None and args.map_steps < 1:
        parser.error("--map-steps: at least 1")
    _Out.results = args.results
    started = time.perf_counter()
    results: dict = {}
    experiments = EXPERIMENTS
    stored = args.results / "sim_experiments.json"
    if args.only:
        if stored.exists():
            data = json.loads(stored.read_text())
            if data.get("format") == FORMAT:  # results of the older simulator are not kept
                results = data["results"]
        experiments = {args.only: EXPERIMENTS[args.only]}
    else:  # the five; the map (hours: ``--only map``) as far as its cells have been run
        experiments = {k: v for k, v in EXPERIMENTS.items() if k != "map"}
    for name, fn in experiments.items():
        t = time.perf_counter()
        results[name] = fn(args)
        print(f"[{name}: {time.perf_counter() - t:.0f} s]", flush=True)
    if "map" not in experiments and (stored_map := experiment_map(args, run=False))["cells"]:
        results["map"] = stored_map
    # The results first: the figures and tables are made from them, and can be made again.
    args.results.mkdir(parents=True, exist_ok=True)
    stored.write_text(
        json.dumps(
            {
                "machine": _report.machine(),
                "simulated": True,
                "format": FORMAT,
                "quick": args.quick,
                "results": results,
                "elapsed_s": time.perf_counter() - started,
            },
            indent=2,
        )
    )
    figures(results)
    text = markdown(results, quick=args.quick)
    print(text)
    (args.results / "sim_experiments.md").write_text(text)
    print(f"wrote {stored}")


if __name__ == "__main__":
    main()
