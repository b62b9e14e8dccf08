"""Run a short PPO job against the Ray cluster at ``RAY_ADDRESS`` and print what happened as JSON.

``python -m runtime.ppo.cluster_run --slots 4 --steps 3`` places the slots as one placement group
spread over the cluster's nodes (the same job code as on one machine; only the pool is made for a
cluster) and prints each step's statistics and the node each slot ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import runtime.engine  # noqa: F401  (before ray: keeps a local instance on loopback)
from runtime.engine.ray_cluster import ray_connection
from runtime.engine.ray_engine import RayEngine
from runtime.engine.slots import SlotPool
from runtime.ppo.algorithm import PPOConfig
from runtime.ppo.job import PpoJobConfig, PpoRuntime, plan_by_hand

LAYOUTS = {
    "actor@training": (2, 1, 1),
    "critic@training": (1, 2, 1),
    "actor@generation": (2, 1, 1),
    "actor@inference": (1, 2, 1),
    "critic@inference": (1, 1, 2),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    address = os.environ.get("RAY_ADDRESS") or None
    config = PpoJobConfig(
        batch_size=16,
        max_new_tokens=8,
        warmup_steps=10,
        checkpoint_every=0,
        seed=args.seed,
        ppo=PPOConfig(kl_coef=0.01, epochs=1, minibatch_size=8),
    )
    with ray_connection(address, num_cpus=args.slots) as connection:
        pool = SlotPool.create(
            args.slots,
            call_timeout_s=120,
            spread=address is not None,
            master_addr=None if address is not None else "127.0.0.1",
        )
        try:
            job = PpoRuntime(config, workdir=tempfile.mkdtemp(prefix="nereus-ppo-"))
            engine = RayEngine(pool, job=job)
            workload = job.workload()
            plan = plan_by_hand(workload, LAYOUTS, num_slots=args.slots)
            engine.start(plan, workload)
            stats = [engine.step(plan, workload, s).extra["stats"] for s in range(args.steps)]
            nodes = pool.nodes()
            engine.stop()
        finally:
            pool.close()
    json.dump(
        {
            "address": connection.address,
            "slots": nodes,
            "cluster_nodes": len({n["node_id"] for n in nodes}),
            "stats": stats,
        },
        sys.stdout,
    )
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
