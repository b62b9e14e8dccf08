"""What a reclaim notice is worth: the same real PPO job, the same shrink, with and without notice.

The job (tiny-sft decoders on CPU slots, the ``length`` reward) trains with each trained model as
one tensor-parallel unit over every slot, so the last slot holds a shard of the only copy of the
actor's and critic's state. Before ``--shrink-at`` an operator's resize takes that slot away
(``RayEngine.resize`` through the driver's ``apply_commands``):

- with notice: the pool shrinks at once while the slot keeps its state; the controller moves the
  job off it live (a transition) and the slot is released;
- without notice: the slot is taken at once with its shard; the job goes back to its last
  committed checkpoint (every ``--checkpoint-every`` steps), restarts onto the smaller pool and
  does the steps since the checkpoint again.

Both runs take the job to the same number of PPO updates. A short untimed run first takes the
slot processes' first-use costs; the two then alternate, ``--repeats`` times each. Reported:
wall seconds, loop steps (a repeated step counts), transitions and restarts with their seconds,
and the ratio of wall times.

    python benchmarks/pool_notice.py [--slots 4] [--steps 8] [--shrink-at 5]
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
from runtime.control import Controller, JobPolicy
from runtime.engine.ray_cluster import ray_connection
from runtime.engine.ray_engine import RayEngine
from runtime.engine.slots import SlotPool
from runtime.events import ListSink
from runtime.jobs.driver import apply_commands
from runtime.jobs.ppo_job import run_ppo_steps
from runtime.planner import default_catalog
from runtime.ppo.algorithm import PPOConfig
from runtime.ppo.job import PpoJobConfig, PpoRuntime


def run(notice_s: float, args, pool: SlotPool) -> dict:
    config = PpoJobConfig(
        batch_size=args.batch,
        max_new_tokens=args.max_new_tokens,
        warmup_steps=30,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        ppo=PPOConfig(kl_coef=0.01, epochs=1, minibatch_size=args.batch // 2),
    )
    job = PpoRuntime(config, workdir=tempfile.mkdtemp(prefix="nereus-bench-notice-"))
    job.initial_weights()  # the supervised warm-up on the driver: the same for both, not timed
    engine = RayEngine(pool, job=job, pool_size=args.slots)
    across = {name: (args.slots, 1) for name in ("actor@training", "critic@training")}
    fixed = {
        **{
            name: (1, 1)
            for name in (
                "actor@generation",
                "actor@inference",
                "ref@inference",
                "critic@inference",
                "reward@inference",
            )
        },
        **across,
    }
    events: list[dict] = []
    controller = Controller(
        job.workload(),
        default_catalog().accelerator("cpu-slot"),
        JobPolicy(fixed_layouts=True),
        emit=events.append,
        fixed=fixed,
    )
    sink = ListSink()

    def between_steps(loop_step: int) -> bool:
        if job.state.next_step == args.shrink_at and not sink.of_kind("command.applied"):
            command = ("resize", {"slots": args.slots - 1, "notice_s": notice_s})
            apply_commands(controller, engine, [command], sink)
        return True

    started = time.perf_counter()
    try:
        result = run_ppo_steps(engine, controller, job, args.steps, between_steps=between_steps)
    finally:
        engine.stop()
    wall = time.perf_counter() - started
    summary = result.summary
    if result.failure:
        raise RuntimeError(result.failure)
    return {
        "wall_s": wall,
        "loop_steps": summary.steps,
        "failed_steps": summary.failed_steps,
        "transitions": summary.transitions,
        "transition_s": summary.transition_seconds,
        "restarts": summary.restarts,
        "restart_s": summary.restart_seconds,
        "ppo_steps": job.state.next_step,
        "outcome": [e.data["outcome"] for e in sink.of_kind("command.applied")],
        "engine_events": [e["event"] for e in engine.events],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--shrink-at", type=int, default=5)
    parser.add_argument("--checkpoint-every", type=int, default=3)
    parser.add_argument("--notice-s", type=float, default=120.0)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    runs: dict[str, list[dict]] = {"with notice": [], "without notice": []}
    notices = {"with notice": args.notice_s, "without notice": 0.0}
    with ray_connection(None, num_cpus=args.slots):
        pool = SlotPool.create(args.slots, call_timeout_s=60)
        try:
            warm = argparse.Namespace(**{**vars(args), "steps": 2, "shrink_at": 99})
            run(args.notice_s, warm, pool)  # untimed: the processes' first-use costs
            for _ in range(args.repeats):
                for name in runs:
                    runs[name].append(run(notices[name], args, pool))
        finally:
            pool.close()

    def mean(name: str, key: str) -> float:
        return statistics.fmean(r[key] for r in runs[name])

    rows = [
        [
            name,
            f"{mean(name, 'wall_s'):.1f}",
            f"{mean(name, 'loop_steps'):.1f}",
            f"{mean(name, 'failed_steps'):.1f}",
            f"{mean(name, 'transitions'):.1f} / {mean(name, 'transition_s'):.2f} s",
            f"{mean(name, 'restarts'):.1f} / {mean(name, 'restart_s'):.2f} s",
        ]
        for name in runs
    ]
    _report.print_table(
        [
            "shrink",
            "wall s",
            "loop steps",
            "failed steps",
            "transitions / s",
            "restarts / s",
        ],
        rows,
    )
    ratio = mean("without notice", "wall_s") / mean("with notice", "wall_s")
    print(f"\nwithout notice / with notice, wall time: {ratio:.2f}x (real Ray slots, CPU)")
    _report.write(
        "pool_notice",
        {
            "simulated": False,
            "args": vars(args),
            "runs": runs,
            "wall_ratio_without_over_with": ratio,
        },
    )


if __name__ == "__main__":
    main()
