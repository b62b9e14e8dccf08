"""SIMULATED: jobs whose generation KV cache outgrows memory, with generation waves and without.

Each row is a Llama-3.1-8B PPO job on the simulated cluster while the generated length grows
(60 steps, a linear trace), run twice side by side on the same cluster twin: planned (training
and inference micro-batches and generation waves chosen by the planner) and pinned
(``adaptive_micro_batch: false``: the workload's micro-batch, every sequence decoded at once).
Many sequences per step make the KV cache, not training, what memory binds first. Prints a table
and writes benchmarks/results/generation_waves.json; every figure is from the simulated engine.

    python benchmarks/generation_waves.py
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _report
from runtime.control import JobPolicy
from runtime.control.controller import Controller, run_job
from runtime.engine.sim import SimulatedEngine
from runtime.engine.traces import Trace
from runtime.planner import PpoWorkload, default_catalog
from runtime.twin import ClusterTwin, device

STEPS = 60
SCENARIOS = (  # (GPUs, sequences per step, generated length from, to)
    (16, 1024, 1000, 8000),
    (16, 2048, 2000, 8000),
    (32, 4096, 2000, 8000),
)


def run(gpus: int, batch: int, start: int, end: int, *, planned: bool) -> dict:
    catalog = default_catalog()
    acc = catalog.accelerator("h100-sxm")
    workload = PpoWorkload.for_model(
        catalog.model("llama-3.1-8b"), gen_len=start, global_batch=batch
    )
    if not planned:
        workload = dataclasses.replace(workload, adaptive_micro_batch=False)
    trace = Trace(
        name=f"grow-{gpus}-{batch}",
        steps=STEPS,
        accelerator=acc.name,
        gpus=gpus,
        gen_len=((0, float(start)), (STEPS, float(end))),
        pool=(),
    )
    twin = ClusterTwin.draw(device(acc.name), 3, noise=0.0)
    engine = SimulatedEngine(trace, acc, twin=twin, seed=1)
    controller = Controller(workload, acc, JobPolicy())
    summary = run_job(engine, controller, STEPS)
    waves = [
        e["changed"]["actor@generation"]
        for e in controller.events
        if e["event"] == "control.micro_batches" and "actor@generation" in e["changed"]
    ]
    # A failed step (out of memory, or a stall with no plan that fits) takes time and updates
    # nothing; mean_step_s is all the run's time per completed step. A job that stalls at the
    # long lengths completes only its cheaper, shorter steps: compare completed steps too.
    return {
        **summary.to_json(),
        "completed_steps": summary.steps - summary.failed_steps,
        "generation_changes": waves,
    }


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()  # no options: --help says what it does instead of running it
    rows, table = [], []
    for gpus, batch, start, end in SCENARIOS:
        planned = run(gpus, batch, start, end, planned=True)
        pinned = run(gpus, batch, start, end, planned=False)
        rows.append(
            {
                "gpus": gpus,
                "sequences": batch,
                "gen_len": [start, end],
                "planned": planned,
                "pinned": pinned,
            }
        )
        for name, r in (("planned", planned), ("pinned", pinned)):
            table.append(
                [
                    f"{gpus} x h100, {batch} seqs, {start}->{end}",
                    name,
                    r["transitions"],
                    r["restarts"],
                    r["rebatches"],
                    r["failed_steps"],
                    f"{r['completed_steps']}/{STEPS}",
                    f"{r['mean_step_s']:.1f}",
                ]
            )
    print("SIMULATED (the cluster twin, not hardware)")
    _report.print_table(
        [
            "job",
            "batching",
            "transitions",
            "restarts",
            "rebatches",
            "failed",
            "completed",
            "s per completed step",
        ],
        table,
    )
    path = _report.write("generation_waves", {"simulated": True, "steps": STEPS, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
