"""Replan time of the global search against pool size, on one core.

Plans a PPO job (Llama-3.1-8B for all four models, three stages, seven model-stages) on 8 to 4,096
H100 slots. "search" is the DP alone (``num_alternatives=0``); "full" adds three alternatives and
the reasons for every rejected candidate, as ``nereus plan`` prints them; "pinned" is the search
with micro-batches pinned to the workload's (one micro-batch per training and inference
layout instead of up to three), side by side. Prints a table, fits the
growth law t ∝ N^k by least squares on log-log, and writes benchmarks/results/planner_scale.json.

    python benchmarks/planner_scale.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks import _report  # noqa: E402
from runtime.planner import PpoWorkload, default_catalog, plan  # noqa: E402

SIZES = (8, 64, 256, 1024, 4096)


def _time(workload, acc, n: int, alternatives: int, repeats: int) -> tuple[float, float]:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = plan(workload, acc, n, num_alternatives=alternatives)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples), result.best.predicted_step_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    catalog = default_catalog()
    workload = PpoWorkload.for_model(catalog.model("llama-3.1-8b"), gen_len=2048)
    pinned = dataclasses.replace(workload, adaptive_micro_batch=False)
    acc = catalog.accelerator("h100-sxm")
    plan(workload, acc, 8)  # warm imports and caches
    rows, records = [], []
    for n in SIZES:
        search_s, step_s = _time(workload, acc, n, 0, args.repeats)
        full_s, _ = _time(workload, acc, n, 3, max(1, args.repeats // 2))
        pinned_s, pinned_step_s = _time(pinned, acc, n, 0, args.repeats)
        rows.append(
            [
                n,
                f"{search_s * 1000:.1f}",
                f"{full_s * 1000:.1f}",
                f"{pinned_s * 1000:.1f}",
                f"{search_s / pinned_s:.2f}",
                f"{step_s:.2f}",
                f"{pinned_step_s:.2f}",
            ]
        )
        records.append(
            {
                "gpus": n,
                "search_s": search_s,
                "full_s": full_s,
                "pinned_search_s": pinned_s,
                "predicted_step_s": step_s,
                "pinned_predicted_step_s": pinned_step_s,
            }
        )
    sizes = np.log([r["gpus"] for r in records])
    growth = {
        key: float(np.polyfit(sizes, np.log([r[key] for r in records]), 1)[0])
        for key in ("search_s", "full_s")
    }
    _report.print_table(
        [
            "gpus",
            "search ms",
            "full ms",
            "pinned search ms",
            "search / pinned",
            "predicted step s",
            "pinned step s",
        ],
        rows,
    )
    print(
        f"growth law: search ∝ N^{growth['search_s']:.2f}, full ∝ N^{growth['full_s']:.2f} "
        "(least squares on log-log, 8..4096 GPUs)"
    )
    path = _report.write(
        "planner_scale",
        {
            "model": "llama-3.1-8b",
            "accelerator": acc.name,
            "model_stages": 7,
            "repeats": args.repeats,
            "results": records,
            "growth_exponent": growth,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
