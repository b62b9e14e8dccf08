"""SIMULATED: the cluster twin against published measurements of real systems.

1. vLLM's offline throughput benchmark on one H100 (Llama-3-8B, 1,000 prompts of 256 tokens,
   256 out, vLLM of 2024-08-04: 12,453 tokens/s; vllm-project/vllm pull request #7117) played by
   the twin's serving engine: the goal is within 15%.
2. Vidur's profiled times of Llama-2-7B's projections on one H100 (microsoft/vidur
   ``data/profiling/compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv``) against the twin's GEMMs.

Nothing of the twin is fitted to either: its constants are those of ``runtime/twin/hardware.py``.
Prints both tables and writes benchmarks/results/twin_published.json.

    python benchmarks/twin_published.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _report
from runtime.planner import default_catalog
from runtime.twin import device
from runtime.twin.published import VLLM_LLAMA3_8B_H100, vidur_gemms, vllm_offline

GOAL = 0.15


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    h100 = device("h100-sxm")
    found = vllm_offline(h100, default_catalog().model("llama-3.1-8b"))
    met = abs(found["ratio"] - 1) <= GOAL
    print("SIMULATED: vLLM offline throughput, Llama-3-8B on one H100")
    _report.print_table(
        ["published tok/s", "twin tok/s", "twin/published", f"within {GOAL:.0%}"],
        [
            [
                f"{found['published_tokens_per_s']:.0f}",
                f"{found['twin_tokens_per_s']:.0f}",
                f"{found['ratio']:.2f}",
                "yes" if met else "no",
            ]
        ],
    )
    gemms = vidur_gemms(h100)
    print("\nSIMULATED: GEMM microseconds, Llama-2-7B projections on one H100 (Vidur's profile)")
    _report.print_table(
        ["M", "K", "N", "Vidur us", "twin us", "twin/Vidur"],
        [
            [
                g["m"],
                g["k"],
                g["n"],
                g["vidur_us"],
                f"{g['twin_us']:.0f}",
                f"{g['twin_us'] / g['vidur_us']:.2f}",
            ]
            for g in gemms
        ],
    )
    ratios = [g["twin_us"] / g["vidur_us"] for g in gemms]
    path = _report.write(
        "twin_published",
        {
            "simulated": True,
            "vllm": {**found, "bench": VLLM_LLAMA3_8B_H100, "goal": GOAL, "met": met},
            "vidur_gemms": gemms,
            "vidur_mean_abs_error": sum(abs(r - 1) for r in ratios) / len(ratios),
            "vidur_worst_ratio": max(ratios, key=lambda r: abs(r - 1)),
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
