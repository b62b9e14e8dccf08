"""Coordinated transition DAGs against per-component migration on random overlap trials.

A trial is a PPO job (Llama/Qwen models on A100/H100/H200/MI300X) whose plan changes because the
generated length drifts and/or the pool grows or shrinks: the current and target plans come from
the planner, the target relabelled by a random permutation of whole nodes (an equivalent plan),
and every slot gets the same memory cap: the tightest at which some order of the primitives fits
(found by bisection with the compiler), times a random 1.0–1.3. So every trial can be done, and
the slots are tight enough that the order matters. Only *overlap* trials are kept: some slot
receives one model-stage while another model-stage is leaving it.

Per trial, simulated against the transition memory model with predicted primitive times (±30%
jitter; labelled simulated, since no cluster of this size is here):

- coordinated: the compiled DAG (resource edges, releases first, generation → inference →
  training); refused when the compiler finds no order that fits (nothing moves then);
- per-component (OOM): each model-stage migrates on its own (data edges only, random interleaving,
  no release priority); an acquisition that does not fit is a device OOM and fails the transition;
- per-component (wait): the same, but an acquisition that does not fit waits for memory; it fails
  only when nothing can move (deadlock).

``--real N`` also runs N small trials for real on 8 CPU slots (Ray actors, gloo), coordinated, and
checks every unit's checksum after the transition.

    python benchmarks/transition_overlap.py [--trials 240] [--seed 1] [--real 8]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _report
from runtime.emu.primitives import Destroy
from runtime.planner import PlanningError, PpoWorkload, default_catalog, plan
from runtime.planner.plan import ModelStagePlan, Plan
from runtime.transition import (
    Cluster,
    TransitionRefusedError,
    diff,
    simulate,
)
from runtime.transition.units import occupancy, persistent_stages, units_of

MODELS = ("llama-3.1-8b", "qwen2.5-7b")
ACCELERATORS = ("a100-80gb", "h100-sxm", "h200", "mi300x")
GEN_LENS = (512, 1024, 2048, 4096, 8192)
POOLS = (8, 16, 24, 32, 48, 64)
RUNS = 3  # simulated executions per policy per trial


def _relabel(target: Plan, num_slots: int, gpus_per_node: int, rng: random.Random) -> Plan:
    nodes = list(range(num_slots // gpus_per_node))
    rng.shuffle(nodes)

    def move(slot: int) -> int:
        return nodes[slot // gpus_per_node] * gpus_per_node + slot % gpus_per_node

    return Plan(
        accelerator=target.accelerator,
        num_slots=target.num_slots,
        model_stages=tuple(
            ModelStagePlan(
                name=ms.name,
                layout=ms.layout,
                units=tuple(tuple(move(s) for s in unit) for unit in ms.units),
                predicted_s=ms.predicted_s,
                breakdown=ms.breakdown,
                memory_per_slot=ms.memory_per_slot,
            )
            for ms in target.model_stages
        ),
        stages=target.stages,
        predicted_step_s=target.predicted_step_s,
        models=target.models,
    )


def _overlaps(current: Plan, target: Plan) -> bool:
    """Some slot gains a model-stage that another model-stage is leaving."""
    moving = {
        ms.name
        for ms in persistent_stages(PpoWorkload.for_model(default_catalog().model("tiny-llama")))
    }
    before = {ms.name: ms.slots for ms in current.model_stages if ms.name in moving}
    after = {ms.name: ms.slots for ms in target.model_stages if ms.name in moving}
    for a in after:
        gained = after[a] - before.get(a, frozenset())
        for b in before:
            if b != a and gained & (before[b] - after.get(b, frozenset())):
                return True
    return False


def _trial(rng: random.Random, catalog):
    model = catalog.model(rng.choice(MODELS))
    acc = catalog.accelerator(rng.choice(ACCELERATORS))
    n_before = rng.choice(POOLS)
    n_after = rng.choice([n for n in POOLS if n != n_before] + [n_before] * 3)
    gen_before, gen_after = rng.choice(GEN_LENS), rng.choice(GEN_LENS)
    before_w = PpoWorkload.for_model(model, gen_len=gen_before)
    after_w = PpoWorkload.for_model(model, gen_len=gen_after)
    try:
        current = plan(before_w, acc, n_before, num_alternatives=0).best
        target = plan(after_w, acc, n_after, num_alternatives=0).best
    except PlanningError:
        return None
    target = _relabel(target, n_after, acc.gpus_per_node, rng)
    if not _overlaps(current, target):
        return None
    num_slots = max(n_before, n_after)
    before = occupancy(units_of(current, after_w), num_slots)
    after = occupancy(units_of(target, after_w), num_slots)
    floor = max(max(before), max(after))

    def cluster_at(cap: float) -> Cluster:
        return Cluster(accelerator=acc, num_slots=num_slots, capacity_bytes=(cap,) * num_slots)

    def fits(cap: float) -> bool:
        try:
            diff(current, target, cluster_at(cap), after_w)
        except TransitionRefusedError:
            return False
        return True

    # The tightest cap at which some order of the primitives fits (bisection), then a random
    # margin above it: every trial can be done, and slots are tight enough to overlap.
    lo, hi = floor, floor * 4
    if not fits(hi):
        return None
    for _ in range(12):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    slack = rng.uniform(1.0, 1.3)
    cluster = cluster_at(hi * slack)
    roomy = cluster_at(1e18)
    label = f"{model.name} {acc.name} {n_before}->{n_after} slots, gen {gen_before}->{gen_after}"
    return label, current, target, cluster, roomy, after_w, hi * slack / floor


def run_simulated(trials: int, seed: int) -> dict:
    catalog = default_catalog()
    rng = random.Random(seed)
    rows, attempts = [], 0
    compile_s = []
    while len(rows) < trials and attempts < trials * 50:
        attempts += 1
        made = _trial(rng, catalog)
        if made is None:
            continue
        label, current, target, cluster, roomy, workload, slack = made
        local = diff(current, target, roomy, workload)  # the same primitives, no resource edges
        local.capacity = cluster.capacity()
        row = {"trial": label, "nodes": len(local.nodes), "cap_slack": slack}
        started = time.perf_counter()
        try:
            dag = diff(current, target, cluster, workload)
            compile_s.append(time.perf_counter() - started)
            runs = [simulate(dag, rng=rng, jitter=0.3) for _ in range(RUNS)]
            row["coordinated"] = "ok" if all(r.ok for r in runs) else runs[0].reason
            row["coordinated_s"] = statistics.fmean(r.makespan_s for r in runs)
            row["resource_edges"] = sum(k == "resource" for k in dag.edges.values())
        except TransitionRefusedError as exc:
            row["coordinated"] = "refused"
            row["refused_because"] = str(exc)
        for on_oom in ("fail", "wait"):
            runs = [
                simulate(local, policy="per_component", on_oom=on_oom, rng=rng, jitter=0.3)
                for _ in range(RUNS)
            ]
            row[f"per_component_{on_oom}_ok"] = sum(r.ok for r in runs)
            ok_times = [r.makespan_s for r in runs if r.ok]
            row[f"per_component_{on_oom}_s"] = statistics.fmean(ok_times) if ok_times else None
        rows.append(row)
    return {"rows": rows, "attempts": attempts, "compile_s": compile_s}


def summarise(result: dict) -> dict:
    rows = result["rows"]
    compiled = [r for r in rows if r["coordinated"] != "refused"]
    refused = [r for r in rows if r["coordinated"] == "refused"]
    out = {
        "trials": len(rows),
        "compiled": len(compiled),
        "refused": len(refused),
        "coordinated_success_of_compiled": sum(r["coordinated"] == "ok" for r in compiled)
        / max(1, len(compiled)),
        "coordinated_success_of_all": sum(r["coordinated"] == "ok" for r in rows) / len(rows),
        "median_compile_s": statistics.median(result["compile_s"]) if result["compile_s"] else 0,
        "with_resource_edges": sum(r.get("resource_edges", 0) > 0 for r in compiled),
    }
    for on_oom in ("fail", "wait"):
        key = f"per_component_{on_oom}"
        out[f"{key}_success_of_all"] = sum(r[f"{key}_ok"] for r in rows) / (RUNS * len(rows))
        out[f"{key}_success_of_compiled"] = sum(r[f"{key}_ok"] for r in compiled) / (
            RUNS * max(1, len(compiled))
        )
        out[f"{key}_success_of_refused"] = sum(r[f"{key}_ok"] for r in refused) / (
            RUNS * max(1, len(refused))
        )
        both = [r for r in compiled if r[f"{key}_s"] is not None and r["coordinated"] == "ok"]
        out[f"{key}_time_ratio_median"] = (
            statistics.median(r[f"{key}_s"] / r["coordinated_s"] for r in both) if both else None
        )
        out[f"{key}_time_pairs"] = len(both)
    return out


def _small_pair(rng: random.Random, workload: PpoWorkload, acc):
    """Random layouts and placements of tiny-llama's seven model-stages on 8 CPU slots, a few
    kept where they are so that the others move through their slots."""
    from runtime.planner.plan import Layout

    def random_layouts() -> dict:
        out = {}
        for ms in workload.model_stages():
            tp = rng.choice((1, 2, 4))
            pp = rng.choice([p for p in (1, 2, 4) if tp * p <= 8])
            dp = rng.randint(1, 8 // (tp * pp))
            slots = rng.sample(range(8), 8)
            units = tuple(tuple(slots[i * tp * pp : (i + 1) * tp * pp]) for i in range(dp))
            out[ms.name] = (Layout(dp=dp, tp=tp, pp=pp), units)
        return out

    before = random_layouts()
    kept = rng.sample(sorted(before), 3)
    after = {**random_layouts(), **{name: before[name] for name in kept}}
    current = Plan.of_units(accelerator=acc.name, num_slots=8, layouts=before)
    target = Plan.of_units(accelerator=acc.name, num_slots=8, layouts=after)
    held = occupancy(units_of(current, workload), 8)
    wanted = occupancy(units_of(target, workload), 8)
    cap = max(max(held), max(wanted)) * rng.uniform(1.0, 1.6)
    return current, target, Cluster(accelerator=acc, num_slots=8, capacity_bytes=(cap,) * 8)


def run_real(count: int, seed: int) -> list[dict]:
    """Small overlap trials executed for real on 8 CPU slots, coordinated, checksums verified."""
    from runtime.emu.engine import UnitEngine
    from runtime.engine.ray_cluster import ray_connection
    from runtime.engine.slots import SlotPool
    from runtime.transition import Executor

    catalog = default_catalog()
    acc = catalog.accelerator("cpu-slot")
    workload = PpoWorkload.for_model(catalog.model("tiny-llama"))
    rng = random.Random(seed)
    rows = []
    with ray_connection(None, num_cpus=8):
        pool = SlotPool.create(8, call_timeout_s=120)
        try:
            engine = UnitEngine(pool)
            while len(rows) < count:
                current, target, cluster = _small_pair(rng, workload, acc)
                if not _overlaps(current, target):
                    continue
                try:
                    dag = diff(current, target, cluster, workload, tag=f"t{len(rows)}")
                except TransitionRefusedError:
                    continue
                for unit in list(engine.units.values()):
                    engine.destroy(Destroy(unit=unit))
                checksums = {}
                for name, units in units_of(current, workload).items():
                    for unit in units:
                        engine.create(unit, seed=len(rows))
                    checksums[name] = engine.checksum(units[0])
                result = Executor(dag, engine).run()
                intact = all(
                    engine.checksum(u) == checksums[name]
                    for name, units in result.units.items()
                    for u in units
                )
                rows.append(
                    {
                        "nodes": len(dag.nodes),
                        "resource_edges": sum(k == "resource" for k in dag.edges.values()),
                        "ok": result.ok,
                        "state_unchanged": intact,
                        "predicted_move_s": dag.predicted_makespan_s,
                        "measured_s": result.duration_s,
                        "group_setup_s": result.group_setup_s,
                        "bytes_moved": sum(n.actual_bytes or 0 for n in dag.nodes.values()),
                    }
                )
        finally:
            pool.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=240)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--real", type=int, default=0, help="small trials run on CPU slots too")
    args = parser.parse_args()
    started = time.perf_counter()
    result = run_simulated(args.trials, args.seed)
    summary = summarise(result)
    print(
        f"SIMULATED ({summary['trials']} overlap trials, seed {args.seed}, memory model + "
        "predicted primitive times)"
    )
    _report.print_table(
        ["policy", "success (all)", "success (compiled)", "success (refused)", "time vs coord."],
        [
            [
                "coordinated DAG",
                f"{summary['coordinated_success_of_all']:.1%}",
                f"{summary['coordinated_success_of_compiled']:.1%}",
                "refused: 0 moved",
                "1.00",
            ],
            *[
                [
                    f"per-component ({on_oom})",
                    f"{summary[f'per_component_{on_oom}_success_of_all']:.1%}",
                    f"{summary[f'per_component_{on_oom}_success_of_compiled']:.1%}",
                    f"{summary[f'per_component_{on_oom}_success_of_refused']:.1%}",
                    "-"
                    if summary[f"per_component_{on_oom}_time_ratio_median"] is None
                    else f"{summary[f'per_component_{on_oom}_time_ratio_median']:.2f}",
                ]
                for on_oom in ("fail", "wait")
            ],
        ],
    )
    print(
        f"compiled {summary['compiled']}, refused {summary['refused']} (no order fits the cap); "
        f"{summary['with_resource_edges']} compiled DAGs needed resource edges; median compile "
        f"{summary['median_compile_s'] * 1e3:.1f} ms"
    )
    real = run_real(args.real, args.seed) if args.real else []
    if real:
        print(f"\nREAL (8 CPU slots, gloo, tiny-llama, {len(real)} trials)")
        _report.print_table(
            [
                "nodes",
                "resource edges",
                "ok",
                "state unchanged",
                "predicted s",
                "measured s",
                "MB moved",
            ],
            [
                [
                    r["nodes"],
                    r["resource_edges"],
                    r["ok"],
                    r["state_unchanged"],
                    f"{r['predicted_move_s']:.2f}",
                    f"{r['measured_s']:.2f}",
                    f"{r['bytes_moved'] / 1e6:.1f}",
                ]
                for r in real
            ],
        )
    path = _report.write(
        "transition_overlap",
        {
            "simulated": True,
            "seed": args.seed,
            "summary": summary,
            "trials": result["rows"],
            "real_trials": real,
            "elapsed_s": time.perf_counter() - started,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
