"""A real PPO job on CPU slots, adaptive against a fixed plan, side by side in one run.

Both runs are the same job (tiny-sft decoders for actor, critic, reference and reward; the
``length`` reward, so responses grow from ~3 to ~20 tokens: real drift) on the same slot
scenario: the job starts on ``--slots`` slots, one is revoked at ``--revoke-at`` (its process is
killed with its state) and two are granted at ``--grant-at``. The controller runs in both; the
fixed run's admission is ``never`` (it keeps its plan and, when a revoked slot forces a change,
checkpoints and restarts as a system without live resharding does), the adaptive run's is
``payback`` (live transitions, admitted when they repay within ``gamma × H``). A short untimed
run first takes the slot processes' first-use costs; the policies then alternate, ``--repeats``
times each, and the table shows their means. Reported: steps per hour, mean seconds per step, and where the
wall time went (each stage, transitions, restarts, the rest: planning, probing, checkpoints),
plus the learning curves (mean reward, response length), drawn to
``benchmarks/results/ppo_adaptive.svg``.

    python benchmarks/ppo_adaptive.py [--steps 40] [--slots 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import runtime.engine  # noqa: F401 - keeps Ray on loopback
from benchmarks import _report
from runtime.control import Controller, JobPolicy, run_job
from runtime.engine.ray_cluster import ray_connection
from runtime.engine.ray_engine import RayEngine
from runtime.engine.slots import SlotPool
from runtime.planner import default_catalog
from runtime.ppo.algorithm import PPOConfig
from runtime.ppo.job import PpoJobConfig, PpoRuntime

STAGES = ("generation", "inference", "training")


def run(policy: str, args, pool: SlotPool) -> dict:
    config = PpoJobConfig(
        batch_size=args.batch,
        max_new_tokens=args.max_new_tokens,
        warmup_steps=30,
        checkpoint_every=10,
        seed=args.seed,
        ppo=PPOConfig(kl_coef=0.01, epochs=2, minibatch_size=args.batch // 2),
    )
    job = PpoRuntime(config, workdir=tempfile.mkdtemp(prefix=f"nereus-bench-{policy}-"))
    job.initial_weights()  # the supervised warm-up on the driver: the same for both, not timed
    engine = RayEngine(pool, job=job, pool_size=args.slots)
    events: list[dict] = []
    controller = Controller(
        job.workload(),
        default_catalog().accelerator("cpu-slot"),
        JobPolicy(admission=policy),
        emit=events.append,
    )
    stage_s = dict.fromkeys(STAGES, 0.0)
    steps: list[dict] = []

    def between_steps(step: int) -> bool:
        if step == args.revoke_at >= 0:
            engine.revoke()
        if step == args.grant_at >= 0:
            engine.grant()
            engine.grant()
        return True

    def on_step(report) -> None:
        for stage, seconds in report.stage_seconds.items():
            stage_s[stage] += seconds
        stats = report.extra.get("stats", {})
        steps.append(
            {
                "step": report.step,
                "ok": report.ok,
                "seconds": report.seconds,
                "slots": engine.pool_size(),
                "reward": stats.get("mean_reward"),
                "length": stats.get("mean_response_length"),
            }
        )
        controller.emit_step(report)

    started = time.perf_counter()
    summary = run_job(engine, controller, args.steps, between_steps=between_steps, on_step=on_step)
    wall = time.perf_counter() - started
    engine.stop()
    accounted = sum(stage_s.values()) + summary.transition_seconds + summary.restart_seconds
    return {
        "policy": policy,
        "steps": summary.steps,
        "failed_steps": summary.failed_steps,
        "wall_s": wall,
        "steps_per_hour": 3600 * summary.steps / wall,
        "mean_step_s": summary.step_seconds / max(1, summary.steps),
        "time_s": {
            **stage_s,
            "transitions": summary.transition_seconds,
            "restarts": summary.restart_seconds,
            "other": wall - accounted,
        },
        "transitions": summary.transitions,
        "built_ahead": sum(
            e["event"] == "control.transition" and e["dag"]["built_ahead"] > 0 for e in events
        ),
        "restarts": summary.restarts,
        "decisions": [
            {"trigger": e["trigger"]["kind"], "reason": e.get("reason", "")}
            for e in events
            if e["event"] == "control.decision"
        ],
        "curve": steps,
        "final_reward": statistics.fmean(
            s["reward"] for s in steps[-5:] if s["reward"] is not None
        ),
        "first_length": statistics.fmean(s["length"] for s in steps[:5] if s["length"] is not None),
        "final_length": statistics.fmean(
            s["length"] for s in steps[-5:] if s["length"] is not None
        ),
    }


def _combine(trials: list[dict]) -> dict:
    """One row per policy: the mean over its runs (the curves and decisions of the first)."""
    out = dict(trials[0])
    for key in ("wall_s", "steps_per_hour", "mean_step_s", "final_reward", "final_length"):
        out[key] = statistics.fmean(t[key] for t in trials)
    out["time_s"] = {k: statistics.fmean(t["time_s"][k] for t in trials) for k in out["time_s"]}
    out["runs"] = [
        {k: t[k] for k in ("wall_s", "steps_per_hour", "mean_step_s", "transitions", "restarts")}
        for t in trials
    ]
    return out


def svg(runs: list[dict], path: Path) -> None:
    """Two small line charts (mean reward, response length) per step, one line per run."""
    width, height, pad = 360, 200, 36
    colours = {"payback": "#1f77b4", "never": "#d62728"}
    panels = []
    for index, (key, title) in enumerate(
        (("reward", "mean reward"), ("length", "response tokens"))
    ):
        values = [s[key] for r in runs for s in r["curve"] if s[key] is not None]
        top = max(values) * 1.1 or 1.0
        steps = max(len(r["curve"]) for r in runs) - 1 or 1
        x0 = index * (width + 20)
        lines = []
        for r in runs:
            points = " ".join(
                f"{x0 + pad + (width - 2 * pad) * s['step'] / steps:.1f},"
                f"{height - pad - (height - 2 * pad) * s[key] / top:.1f}"
                for s in r["curve"]
                if s[key] is not None
            )
            lines.append(
                f'<polyline fill="none" stroke="{colours.get(r["policy"], "#333")}" '
                f'stroke-width="2" points="{points}"/>'
            )
        panels.append(
            f'<text x="{x0 + pad}" y="20" font-size="13">{title} per step</text>'
            f'<line x1="{x0 + pad}" y1="{height - pad}" x2="{x0 + width - pad}" '
            f'y2="{height - pad}" stroke="#888"/>'
            f'<line x1="{x0 + pad}" y1="{pad}" x2="{x0 + pad}" y2="{height - pad}" stroke="#888"/>'
            f'<text x="{x0 + 4}" y="{pad + 4}" font-size="10">{top:.2g}</text>'
            f'<text x="{x0 + 4}" y="{height - pad}" font-size="10">0</text>'
            f'<text x="{x0 + width - pad - 30}" y="{height - 8}" font-size="10">step {steps}</text>'
            + "".join(lines)
        )
    legend = "".join(
        f'<text x="{10 + i * 200}" y="{height + 16}" font-size="12" '
        f'fill="{colours.get(r["policy"], "#333")}">{r["policy"]} admission</text>'
        for i, r in enumerate(runs)
    )
    path.write_text(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * width + 20}" '
        f'height="{height + 24}" font-family="sans-serif">{"".join(panels)}{legend}</svg>\n'
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--revoke-at", type=int, default=12)
    parser.add_argument("--grant-at", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each policy, alternating")
    args = parser.parse_args()
    pool_size = args.slots + 1  # revoke one, grant two
    with ray_connection(None, num_cpus=pool_size):
        pool = SlotPool.create(pool_size, call_timeout_s=120)
        try:
            # Slot processes pay their first-use costs (imports, first collectives) once: a short
            # untimed run takes them, then the policies alternate, twice each.
            warm = argparse.Namespace(**{**vars(args), "steps": 3, "revoke_at": -1, "grant_at": -1})
            run("never", warm, pool)
            trials = [run(policy, args, pool) for policy in ("never", "payback") * args.repeats]
        finally:
            pool.close()
    runs = [_combine([t for t in trials if t["policy"] == p]) for p in ("never", "payback")]
    headers = [
        "admission",
        "steps/h",
        "s/step",
        "gen s",
        "inf s",
        "train s",
        "trans s",
        "restart s",
        "other s",
        "transitions (built ahead)",
        "reward(last5)",
        "length first5->last5",
    ]
    rows = [
        [
            r["policy"],
            f"{r['steps_per_hour']:.0f}",
            f"{r['mean_step_s']:.3f}",
            *(f"{r['time_s'][k]:.1f}" for k in (*STAGES, "transitions", "restarts", "other")),
            f"{r['transitions']} ({r['built_ahead']})",
            f"{r['final_reward']:.3f}",
            f"{r['first_length']:.1f}->{r['final_length']:.1f}",
        ]
        for r in runs
    ]
    _report.print_table(headers, rows)
    ratio = runs[1]["steps_per_hour"] / runs[0]["steps_per_hour"]
    print(f"adaptive/fixed steps per hour: {ratio:.3f}")
    figure = _report.RESULTS / "ppo_adaptive.svg"
    svg(runs, figure)
    path = _report.write(
        "ppo_adaptive",
        {"args": vars(args), "runs": runs, "adaptive_over_fixed_steps_per_hour": ratio},
    )
    print(f"wrote {path} and {figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
