"""The job driver: runs one job on its slots and reports everything as events.

The driver is the only long-lived piece of a job. It attaches to Ray, starts the slots, runs steps
until done or told to stop, checks that the data-parallel replicas still agree, and always releases
its slots. ``should_stop`` is polled between steps: cancellation takes effect at a step boundary.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

from runtime.engine.ray_cluster import ray_connection
from runtime.engine.slots import SlotPool
from runtime.events import EventSink, RuntimeEvent
from runtime.jobs import sft
from runtime.jobs.spec import SftJobSpec

Command = tuple[str, Any]
"""What people send a running job: (``approve`` or ``reject``, the controller's proposal id);
(``stale``, the controller's proposal id) for a proposal a person's newer override made stale;
(``override``, ``{"plan": the plan's JSON, "proposal": the override's id as people know it}``)
for a person's plan that another person approved (a rejected override asks nothing of the job);
or (``resize``, ``{"slots": n, "notice_s": seconds}``), an operator's change of the job's slot
pool (``RayEngine.resize``)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class JobOutcome:
    """How a run ended."""

    status: str
    """``succeeded`` or ``cancelled``; failures raise."""
    steps_done: int
    final_loss: float | None


def apply_commands(controller, engine, commands: list[Command], sink: EventSink) -> None:
    """Hand people's approvals, rejections and approved overrides to the controller, and pool
    changes to the engine, between steps; each outcome becomes a ``command.applied`` event (a
    proposal that stopped waiting is ignored, an override the controller cannot take is refused
    saying why, and so is a pool change the engine cannot make). The controller sees a changed
    pool before the next step (``Controller.before_step``).

    Of the overrides approved since the last step only the last is taken: each was approved
    while it was the job's newest proposal, so a later one was proposed after it and supersedes
    it (``stale: …``, and the job moves once, to the newest)."""
    overrides = [i for i, (kind, _) in enumerate(commands) if kind == "override"]
    for i, (kind, argument) in enumerate(commands):
        if kind == "resize":
            _resize(engine, argument, sink)
            continue
        override = kind == "override"
        proposal = argument.get("proposal") if override else argument
        try:
            if override and i != overrides[-1]:
                newer = commands[overrides[-1]][1].get("proposal")
                outcome = f"stale: superseded by override {newer}, approved after it"
            elif override:
                outcome = controller.override(argument.get("plan"), engine)
            else:
                outcome = controller.command(kind, proposal, engine)
        except ValueError as exc:  # not waiting any more (expired, superseded)
            outcome = f"ignored: {exc}"
        sink.emit(
            RuntimeEvent(
                kind="command.applied",
                data={"command": kind, "proposal": proposal, "outcome": outcome},
            )
        )


def _resize(engine, argument: dict, sink: EventSink) -> None:
    resize = getattr(engine, "resize", None)
    try:
        if resize is None:
            raise ValueError(f"slots: the {engine.kind} engine's pool follows its trace")
        outcome = resize(argument.get("slots"), notice_s=argument.get("notice_s", 0.0))
    except ValueError as exc:
        outcome = f"refused: {exc}"
    sink.emit(
        RuntimeEvent(
            kind="command.applied",
            data={"command": "resize", **argument, "outcome": outcome},
        )
    )


def run_sft_job(
    spec: SftJobSpec,
    *,
    sink: EventSink,
    ray_address: str | None,
    should_stop: Callable[[], bool] = lambda: False,
    use_gpus: bool = False,
    call_timeout_s: float = 120.0,
) -> JobOutcome:
    """Run an SFT job to completion (or cancellation) and return how it ended."""
    sink.emit(RuntimeEvent(kind="job.started", data={"spec": spec.to_json()}))
    with ray_connection(ray_address) as connection:
        # On a cluster the slots are placed as a PPO job's are (a placement group spread over
        # the nodes, the group meeting at slot 0's node): the driver's own node offers no slot.
        pool = SlotPool.create(
            spec.num_slots,
            use_gpus=use_gpus,
            call_timeout_s=call_timeout_s,
            spread=ray_address is not None,
            master_addr=None if ray_address is not None else "127.0.0.1",
        )
        try:
            num_params = pool.run(sft.setup_replica, spec_json=spec.to_json())[0]
            sink.emit(
                RuntimeEvent(
                    kind="slots.ready",
                    data={
                        "num_slots": pool.num_slots,
                        "backend": pool.backend,
                        "setup_s": round(pool.setup_s, 3),
                        "ray_address": connection.address,
                        "ray_started_locally": connection.started_locally,
                        "num_params": num_params,
                    },
                )
            )
            return _train(spec, pool, sink, should_stop)
        finally:
            pool.close()


def _train(
    spec: SftJobSpec, pool: SlotPool, sink: EventSink, should_stop: Callable[[], bool]
) -> JobOutcome:
    loss = None
    for step in range(spec.num_steps):
        if should_stop():
            sink.emit(
                RuntimeEvent(kind="job.finished", data={"status": "cancelled", "steps": step})
            )
            return JobOutcome(status="cancelled", steps_done=step, final_loss=loss)
        started = time.perf_counter()
        results = pool.run(sft.train_step, step=step)
        step_s = time.perf_counter() - started
        memory = pool.memory()
        loss = statistics.fmean(r["loss"] for r in results)
        if not all(r["finite"] for r in results) or not math.isfinite(loss):
            losses = [r["loss"] for r in results]
            raise ArithmeticError(
                f"step {step}: the loss or its gradients are not finite (losses per replica "
                f"{losses}); the update was not made"
            )
        tokens = sum(r["tokens"] for r in results)
        sink.emit(
            RuntimeEvent(
                kind="step.finished",
                data={
                    "step": step,
                    "loss": round(loss, 5),
                    "step_s": round(step_s, 4),
                    "tokens_per_s": round(tokens / step_s, 1),
                    "compute_s": round(max(r["compute_s"] for r in results), 4),
                    "comm_s": round(max(r["comm_s"] for r in results), 4),
                    "allreduce_bytes": results[0]["allreduce_bytes"],
                    "peak_memory_bytes": [m["peak_bytes"] for m in memory],
                    "num_slots": pool.num_slots,
                },
            )
        )
    checksums = pool.run(sft.replica_checksum)
    identical = len(set(checksums)) == 1
    sink.emit(
        RuntimeEvent(
            kind="replicas.verified", data={"identical": identical, "checksum": checksums[0]}
        )
    )
    if not identical:
        raise RuntimeError(f"data-parallel replicas diverged: checksums {checksums}")
    sink.emit(
        RuntimeEvent(
            kind="job.finished",
            data={"status": "succeeded", "steps": spec.num_steps, "final_loss": round(loss, 5)},
        )
    )
    return JobOutcome(status="succeeded", steps_done=spec.num_steps, final_loss=loss)
