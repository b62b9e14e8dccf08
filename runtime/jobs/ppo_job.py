"""A PPO job on real slots through the Ray engine, driven like the simulated one: the controller
watches each step, replans, admits or asks for approval, and the engine applies transitions that
move the training units between steps.

The job's events: ``step.finished`` (timings by stage, response length, peak memory, the slot
pool and PPO's statistics), ``engine.*`` (slots lost, revoked, granted; resumed from a
checkpoint), ``transition.node`` (each node of a running transition DAG, live), and the
controller's own events through ``emit_control``. ``revoke_at_step``/``grant_at_step`` play a
cluster taking a slot away and giving one; an operator's ``resize`` commands change the pool as
the job runs (``RayEngine.resize``), a shrink announced ahead included.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from runtime.control import Controller, JobPolicy, RunSummary, run_job
from runtime.engine.ray_cluster import ray_connection
from runtime.engine.ray_engine import RayEngine
from runtime.engine.slots import SlotPool
from runtime.events import EventSink, RuntimeEvent
from runtime.jobs.driver import Command, JobOutcome, apply_commands
from runtime.jobs.spec import PpoJobSpec
from runtime.planner import default_catalog
from runtime.ppo import export
from runtime.ppo.export import read_manifest
from runtime.ppo.job import PpoRuntime, SupersededError


def run_ppo_job(
    spec: PpoJobSpec,
    *,
    sink: EventSink,
    emit_control: Callable[[dict], None],
    commands: Callable[[], list[Command]] = list,
    should_stop: Callable[[], bool] = lambda: False,
    ray_address: str | None = None,
    workdir: str | Path | None = None,
    still_current: Callable[[], bool] = lambda: True,
    num_slots: int | None = None,
) -> JobOutcome:
    """Run the job to its last step (or a stop). ``still_current``: whether this driver still
    owns the job, asked before each write of its checkpoints and export (``PpoRuntime.fence``:
    a driver taken over in the middle of a step raises ``SupersededError`` there).
    ``num_slots``: the pool the job starts on, if not the spec's (an operator resized the pool
    of the driver this one takes over from); ``resize`` commands change it as the job runs."""
    num_slots = spec.num_slots if num_slots is None else num_slots
    if not 1 <= num_slots <= spec.max_slots:
        raise ValueError(f"num_slots: must be in [1, {spec.max_slots}], got {num_slots}")
    config = spec.job_config()
    policy = JobPolicy.from_json(spec.policy)
    accelerator = default_catalog().accelerator(spec.gpu)
    sink.emit(RuntimeEvent(kind="job.started", data={"spec": spec.to_json(), "simulated": False}))
    workdir = Path(workdir or tempfile.mkdtemp(prefix="nereus-ppo-"))
    # The job (its folder) before the slots: a folder it cannot use fails the job before any
    # slot is reserved.
    job = PpoRuntime(config, workdir=workdir, still_current=still_current)
    with ray_connection(ray_address, num_cpus=spec.max_slots) as connection:
        pool = SlotPool.create(
            spec.max_slots,
            use_gpus=spec.uses_gpus,
            spread=ray_address is not None,
            master_addr=None if ray_address is not None else "127.0.0.1",
        )
        seen = {"engine": 0}

        def forward_engine_events() -> None:
            for event in engine.events[seen["engine"] :]:
                kind = event.get("event", "engine.event")
                data = {k: v for k, v in event.items() if k != "event"}
                sink.emit(RuntimeEvent(kind=kind, data=data))
            seen["engine"] = len(engine.events)

        engine = RayEngine(pool, checkpoint_dir=workdir / "restart", job=job, pool_size=num_slots)
        engine.on_event = lambda _event: forward_engine_events()
        controller = Controller(job.workload(), accelerator, policy, emit=emit_control)
        sink.emit(
            RuntimeEvent(
                kind="slots.ready",
                data={
                    "num_slots": num_slots,
                    "max_slots": pool.num_slots,
                    "backend": pool.backend,
                    "setup_s": round(pool.setup_s, 3),
                    "ray_address": connection.address,
                    "nodes": len({n["node_id"] for n in pool.nodes()}),
                },
            )
        )

        # A job that ran before (its driver was lost) goes on from its last checkpoint. The loop
        # counts loop steps (a failed step and a resume from a checkpoint are loop steps too);
        # events and the scenario count the job's own steps (``JobState.next_step``).
        played: set[str] = set()  # the scenario's moves made: each once, though the job
        # may come to its step again (after a failed step, or a resume from a checkpoint)

        def between_steps(loop_step: int) -> bool:
            step = job.state.next_step  # the step the job runs next, whatever the loop's count
            if loop_step and spec.pace_s:
                time.sleep(spec.pace_s)
            if should_stop():
                return False
            for move, at in (("revoke", spec.revoke_at_step), ("grant", spec.grant_at_step)):
                if step == at and move not in played:
                    played.add(move)
                    try:
                        getattr(engine, move)()
                    except ValueError as exc:  # an operator's resize left no slot to move
                        sink.emit(
                            RuntimeEvent(
                                kind="scenario.skipped", data={"move": move, "reason": str(exc)}
                            )
                        )
            apply_commands(controller, engine, commands(), sink)
            forward_engine_events()
            return True

        def on_step(report) -> None:
            forward_engine_events()
            # The job's step this loop step ran: the update's own (a resume between steps can
            # have sent the job back), or for a failed step, which made none, the one it tried.
            step = report.extra.get("ppo_step", job.state.next_step)
            sink.emit(
                RuntimeEvent(
                    kind="step.finished",
                    data={
                        "step": step,
                        "ok": report.ok,
                        "step_s": round(report.seconds, 4),
                        "gen_len": round(report.gen_len, 2),
                        "stage_s": {k: round(v, 4) for k, v in report.stage_seconds.items()},
                        "peak_memory": round(report.peak_memory, 4),
                        "num_slots": engine.pool_size(),
                        "failure": report.failure,
                        "ppo": report.extra.get("stats", {}),
                        "ppo_step": report.extra.get("ppo_step"),
                        "simulated": False,
                    },
                )
            )

        try:
            run = run_ppo_steps(
                engine,
                controller,
                job,
                spec.num_steps,
                between_steps=between_steps,
                on_step=on_step,
            )
            summary = run.summary
            forward_engine_events()
            _export(job, engine, sink)
            engine.stop()
        finally:
            pool.close()
    status = "failed" if run.failure else "cancelled" if run.stopped else "succeeded"
    last = job.stats[-1] if job.stats else None
    sink.emit(
        RuntimeEvent(
            kind="job.finished",
            data={
                "status": status,
                "steps": run.steps_done,
                "resumed_from": engine.started_from,
                "failure": run.failure,
                "wall_s": round(summary.seconds, 2),
                "transitions": summary.transitions,
                "transition_s": round(summary.transition_seconds, 3),
                "restarts": summary.restarts,
                "mean_reward": round(last.mean_reward, 4) if last else None,
                "simulated": False,
            },
        )
    )
    if run.failure:
        raise RuntimeError(
            f"the PPO job gave up after {run.steps_done} of {spec.num_steps} steps: {run.failure}"
        )
    return JobOutcome(status=status, steps_done=run.steps_done, final_loss=None)


RETRIES = 3
"""Setbacks (a failed step, a resume from an earlier checkpoint) a PPO job takes without getting
past the furthest step it reached before it gives up."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PpoRun:
    """How a PPO job's step loop ended (``run_ppo_steps``)."""

    summary: RunSummary
    """The loop's: its ``steps`` count loop steps, repeated and failed ones included."""
    steps_done: int
    """The job's own count: the PPO updates its state holds (``JobState.next_step``)."""
    stopped: bool
    """Told to stop (``between_steps`` said so) before its last step."""
    failure: str
    """Why the job gave up before its last step; empty if it did not."""


def run_ppo_steps(
    engine: RayEngine,
    controller: Controller,
    job: PpoRuntime,
    num_steps: int,
    *,
    between_steps: Callable[[int], bool] | None = None,
    on_step: Callable | None = None,
    retries: int = RETRIES,
) -> PpoRun:
    """The job's step loop (``run_job``), run until the job has made ``num_steps`` PPO updates by
    its own count (``JobState.next_step``), however many loop steps that takes: a failed step
    makes no update, and a resume from a checkpoint (a slot died with the only copy of a unit's
    state) sends the job back to the checkpoint's step, whose successors run again.

    A loop step that does not take the job exactly one step on is a setback. After ``retries``
    setbacks without getting past the furthest step it had reached, the loop gives up and says
    why in ``failure``: a step that fails every time, or a slot that dies every step, ends the
    job. The controller's horizon (``last_step``) is the loop step at which the job, from where
    it is, would reach ``num_steps``."""
    seen = {"at": -1, "ok": True, "furthest": -1, "setbacks": 0, "why": ""}
    ended = {"stopped": False, "failure": ""}

    def before(loop_step: int) -> bool:
        at = job.state.next_step  # after the last loop step, and any resume it led to
        if loop_step:
            if not seen["ok"] or at != seen["at"] + 1:
                seen["setbacks"] += 1
                if seen["ok"]:
                    seen["why"] = (
                        f"resumed from a checkpoint (a step begun at step {seen['at']} ended at {at})"
                    )
            elif at > seen["furthest"]:
                seen["setbacks"] = 0
        seen["at"], seen["furthest"] = at, max(seen["furthest"], at)
        if at >= num_steps:
            return False
        if seen["setbacks"] >= retries:
            ended["failure"] = (
                f"{seen['setbacks']} setbacks without getting past step {seen['furthest']}; "
                f"the last: {seen['why']}"
            )
            return False
        if between_steps is not None and not between_steps(loop_step):
            ended["stopped"] = True
            return False
        controller.last_step = loop_step + (num_steps - at) - 1
        return True

    def after(report) -> None:
        seen["ok"] = report.ok
        if not report.ok:
            seen["why"] = f"step {seen['at']} failed: {report.failure}"
        (on_step or controller.emit_step)(report)

    # ``before`` ends the loop: at most num_steps loop steps get past the furthest step, and
    # between two of them come fewer than ``retries`` setbacks, each followed by fewer than
    # num_steps steps back to it. The bound is a safeguard, never reached.
    bound = (num_steps + 1) * (retries * (num_steps + 1) + 1) + 1
    summary = run_job(engine, controller, bound, between_steps=before, on_step=after)
    done = job.state.next_step
    failure = ended["failure"]
    if done < num_steps and not ended["stopped"] and not failure:
        failure = f"the loop ended after {summary.steps} steps with {done} of {num_steps} done"
    return PpoRun(summary=summary, steps_done=done, stopped=ended["stopped"], failure=failure)


def _export(job: PpoRuntime, engine: RayEngine, sink: EventSink) -> None:
    """The trained actor, as a Hugging Face folder in the job's directory (``export/actor``),
    whether the job ran to its end or was stopped. A failed export is said and leaves the job's
    outcome alone (a committed checkpoint can be exported later: ``nereus export``)."""
    if not any(u.model_stage == "actor@training" for u in engine.engine.units.values()):
        sink.emit(RuntimeEvent(kind="job.export_failed", data={"reason": "no actor state held"}))
        return
    try:
        folder = job.export(engine.engine, "actor")
        manifest = read_manifest(folder)
        if manifest is None:
            raise export.ExportError(f"{folder}: written without a readable manifest")
    except SupersededError:
        raise  # the new driver writes the job's files and events now
    except Exception as exc:  # the weights stay in the checkpoints; the job's result stands
        sink.emit(
            RuntimeEvent(kind="job.export_failed", data={"reason": f"{type(exc).__name__}: {exc}"})
        )
        return
    sink.emit(
        RuntimeEvent(
            kind="job.exported",
            data={
                "artifact": folder.name,
                "architecture": manifest["architecture"],
                "step": manifest["source"]["step"],
                "bytes": sum(f["bytes"] for f in manifest["files"]),
            },
        )
    )
