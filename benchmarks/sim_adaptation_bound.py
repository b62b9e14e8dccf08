"""How much online TP/PP adaptation could win in the simulated world, by setting. SIMULATED.

Exp1 of sim_experiments.py measures adaptation on one setting (Llama-3.1-8B, 256 sequences a
step, a 64-GPU spot pool) and finds almost nothing to win where the catalog describes the cluster.
This asks where there is something: for each pool size, batch and micro-batch mode, an oracle that
knows the true model replans at each generated length for free, once with any layouts and once
keeping the layouts planned for the longest length (the fixed-TP/PP baseline of exp1, data
parallelism replanned), and reports 1 minus the ratio of their true step seconds. Micro-batches
"planned" are Nereus's (a layout memory outgrows first takes smaller micro-batches or more
generation waves, which moves no state); "pinned" are fixed, as a planner choosing only DP/TP/PP
has them.

    python benchmarks/sim_adaptation_bound.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _report
from benchmarks.sim_experiments import CATALOG, oracle_pair
from runtime.engine.sim import TrueModel
from runtime.planner import PlanningError, PpoWorkload, plan

LENGTHS = (500, 2000, 8000)
POOLS = (16, 64)
BATCHES = (256, 1024, 4096)


def _layouts(found) -> dict[str, tuple[int, int]]:
    return {ms.name: (ms.layout.tp, ms.layout.pp) for ms in found.model_stages}


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()  # no options: --help says what it does instead of running it
    acc = CATALOG.accelerator("h100-sxm")
    truth = TrueModel.draw(7)  # exp1's world
    rows, records = [], []
    for gpus in POOLS:
        for batch in BATCHES:
            for pinned in (False, True):
                workload = PpoWorkload.for_model(
                    CATALOG.model("llama-3.1-8b"),
                    gen_len=LENGTHS[0],
                    global_batch=batch,
                    adaptive_micro_batch=not pinned,
                )
                mode = "pinned" if pinned else "planned"
                try:
                    fixed = _layouts(plan(workload.with_gen_len(LENGTHS[-1]), acc, gpus).best)
                except PlanningError:  # nothing to keep fixed: the longest length fits nowhere
                    rows.append([gpus, batch, mode, *(["fits nowhere"] * len(LENGTHS)), "-"])
                    records.append(
                        {"gpus": gpus, "global_batch": batch, "micro_batches": mode, "fits": False}
                    )
                    continue
                cuts = {}
                for n in LENGTHS:
                    at = workload.with_gen_len(n)
                    try:
                        free, kept = oracle_pair(at, acc, truth, gpus, fixed)
                    except PlanningError:
                        cuts[n] = None
                        continue
                    cuts[n] = 1 - free / kept
                rows.append(
                    [gpus, batch, mode]
                    + ["fits nowhere" if cuts[n] is None else f"{cuts[n]:.1%}" for n in LENGTHS]
                    + [f"{fixed['actor@generation']}/{fixed['actor@training']}"]
                )
                records.append(
                    {
                        "gpus": gpus,
                        "global_batch": batch,
                        "micro_batches": mode,
                        "reduction_by_gen_len": {str(n): cuts[n] for n in LENGTHS},
                        "fixed_layouts": fixed,
                    }
                )
    print("SIMULATED: the most TP/PP adaptation could cut from the fixed layouts, per length")
    _report.print_table(
        [
            "gpus",
            "batch",
            "micro-batches",
            *(f"at {n}" for n in LENGTHS),
            "fixed gen/train (tp,pp)",
        ],
        rows,
    )
    path = _report.write(
        "sim_adaptation_bound",
        {"simulated": True, "model": "llama-3.1-8b", "gpu": acc.name, "rows": records},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
