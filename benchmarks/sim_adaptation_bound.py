"""How much online TP/PP adaptation could win on the cluster twin, by setting. SIMULATED.

Exp1 of sim_experiments.py measures adaptation on one setting (Llama-3.1-8B, 256 sequences a
step, a 64-GPU spot pool), and its map measures what Nereus wins over the seed's baseline across
models, pools and traces. This asks what there is to win at all, for free: for each pool size,
batch and micro-batch mode, the oracle of exp1 (``sim_experiments.oracle_pair``: the best of the
planner's candidates, judged by the twin) replans at each generated length once with any layouts
and once keeping the layouts planned for the longest length (the hindsight layouts of exp1, data
parallelism and micro-batches replanned), each candidate played in the twin with one draw of the
step's response lengths (noise and interference off), and reports 1 minus the ratio of their
step seconds. It is no bound on plans the planner never proposes. Micro-batches "planned" are
Nereus's (a layout memory outgrows first takes smaller micro-batches or more generation waves,
which moves no state); "pinned" are fixed, as a planner choosing only DP/TP/PP has them.

    python benchmarks/sim_adaptation_bound.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _report
from benchmarks.sim_experiments import CATALOG, fixed_lengths, oracle_pair, world
from runtime.engine.traces import Trace
from runtime.planner import PlanningError, PpoWorkload, plan

LENGTHS = (500, 2000, 8000)
POOLS = (16, 64)
BATCHES = (256, 1024, 4096)
GPU = "h100-sxm"


def _layouts(found) -> dict[str, tuple[int, int]]:
    return {ms.name: (ms.layout.tp, ms.layout.pp) for ms in found.model_stages}


def _lengths(n: int, count: int) -> list[int]:
    """``count`` responses around a mean of ``n`` tokens, as the simulated engine draws them
    (the traces' default spread), drawn once."""
    flat = Trace(
        name=f"flat-{n}", steps=1, accelerator=GPU, gpus=1, gen_len=((0, float(n)),), pool=()
    )
    return fixed_lengths(flat, 0, count, "bound")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="16 GPUs, 256 sequences, the shortest and longest"
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=_report.RESULTS,
        help="where results go (default: %(default)s)",
    )
    args = parser.parse_args()
    pools, batches, lengths = (
        ((16,), (256,), (LENGTHS[0], LENGTHS[-1])) if args.quick else (POOLS, BATCHES, LENGTHS)
    )
    acc = CATALOG.accelerator(GPU)
    twin = world(GPU)  # exp1's world, as catalogued
    rows, records = [], []
    for gpus in pools:
        for batch in batches:
            for pinned in (False, True):
                workload = PpoWorkload.for_model(
                    CATALOG.model("llama-3.1-8b"),
                    gen_len=lengths[0],
                    global_batch=batch,
                    adaptive_micro_batch=not pinned,
                )
                mode = "pinned" if pinned else "planned"
                try:
                    kept = _layouts(plan(workload.with_gen_len(lengths[-1]), acc, gpus).best)
                except PlanningError:  # nothing to keep: the longest length fits nowhere
                    rows.append([gpus, batch, mode, *(["no plan"] * len(lengths)), "-"])
                    records.append(
                        {"gpus": gpus, "global_batch": batch, "micro_batches": mode, "fits": False}
                    )
                    continue
                cuts: dict[int, float | None] = {}
                for n in lengths:
                    pair = oracle_pair(twin, workload, GPU, gpus, _lengths(n, batch), kept)
                    cuts[n] = None if pair is None else 1 - pair[0].seconds / pair[1].seconds
                rows.append(
                    [gpus, batch, mode]
                    + ["fits nowhere" if cuts[n] is None else f"{cuts[n]:.1%}" for n in lengths]
                    + [f"{kept['actor@generation']}/{kept['actor@training']}"]
                )
                records.append(
                    {
                        "gpus": gpus,
                        "global_batch": batch,
                        "micro_batches": mode,
                        "reduction_by_gen_len": {str(n): cuts[n] for n in lengths},
                        "kept_layouts": kept,
                    }
                )
    print(
        "SIMULATED (cluster twin): the most replanning TP/PP among the planner's candidates "
        "could cut from the layouts for the longest length, per length"
    )
    _report.print_table(
        ["gpus", "batch", "micro-batches", *(f"at {n}" for n in lengths), "kept gen/train (tp,pp)"],
        rows,
    )
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / "sim_adaptation_bound.json"
    payload = {
        "machine": _report.machine(),
        "simulated": True,
        "twin": True,
        "quick": args.quick,
        "model": "llama-3.1-8b",
        "gpu": GPU,
        "rows": records,
    }
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
