"""A PPO job on the simulated cluster, driven like a real one: the controller, planner, admission
and transition compiler run for real against ``SimulatedEngine``; steps are paced in wall time so
that a person can watch triggers, proposals and transitions arrive and approve them.

Every event it emits says ``simulated: true``. Approval commands come in through ``commands``
(the job's log, in the web service) and go to the controller between steps (``apply_commands``:
``Controller.command``, or ``Controller.override`` for a person's approved plan).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from runtime.control import Controller, JobPolicy, run_job
from runtime.engine import hindsight
from runtime.engine.sim import SimulatedEngine
from runtime.engine.traces import generate
from runtime.events import EventSink, RuntimeEvent
from runtime.jobs.driver import Command, JobOutcome, apply_commands
from runtime.jobs.spec import PpoSimJobSpec
from runtime.planner import PpoWorkload, default_catalog


def sim_job_parts(
    spec: PpoSimJobSpec, *, emit: Callable[[dict], None] | None = None
) -> tuple[SimulatedEngine, Controller]:
    """The job's simulated cluster (its generated trace, its cluster twin) and its
    controller: what a run starts from, and what a preview asks for the first plan."""
    catalog = default_catalog()
    accelerator = catalog.accelerator(spec.gpu)
    trace = generate(
        spec.trace,
        seed=spec.seed,
        steps=spec.num_steps,
        gpus=spec.gpus,
        accelerator=accelerator.name,
        spot=True,
        hours=spec.trace_hours,
    )
    workload = PpoWorkload.for_model(catalog.model(spec.model), gen_len=trace.gen_len_at(0))
    engine = SimulatedEngine(trace, accelerator, seed=spec.seed)
    controller = Controller(workload, accelerator, JobPolicy.from_json(spec.policy), emit=emit)
    return engine, controller


def run_sim_ppo_job(
    spec: PpoSimJobSpec,
    *,
    sink: EventSink,
    emit_control: Callable[[dict], None],
    commands: Callable[[], list[Command]] = list,
    should_stop: Callable[[], bool] = lambda: False,
) -> JobOutcome:
    """Run the job to its last step (or a stop); controller events go to ``emit_control``."""
    engine, controller = sim_job_parts(spec, emit=emit_control)
    sink.emit(RuntimeEvent(kind="job.started", data={"spec": spec.to_json(), "simulated": True}))

    def between_steps(step: int) -> bool:
        if step:
            time.sleep(spec.pace_s)
        if should_stop():
            return False
        apply_commands(controller, engine, commands(), sink)
        return True

    def on_step(report) -> None:
        sink.emit(
            RuntimeEvent(
                kind="step.finished",
                data={
                    "step": report.step,
                    "ok": report.ok,
                    "step_s": round(report.seconds, 3),
                    "gen_len": round(report.gen_len, 1),
                    "stage_s": {k: round(v, 3) for k, v in report.stage_seconds.items()},
                    "peak_memory": round(report.peak_memory, 4),
                    "num_slots": engine.pool_size(),
                    "failure": report.failure,
                    "simulated": True,
                },
            )
        )

    summary = run_job(
        engine, controller, spec.num_steps, between_steps=between_steps, on_step=on_step
    )
    status = "cancelled" if summary.stopped else "succeeded"
    # What only a simulation can tell: why each transition was made, and whether the moves made
    # for their saving truly repaid (runtime/engine/hindsight.py).
    looked_back = hindsight.summary(hindsight.moves(controller.events, engine, controller.workload))
    sink.emit(
        RuntimeEvent(
            kind="job.finished",
            data={
                "status": status,
                "steps": summary.steps,
                "simulated_s": round(summary.seconds, 1),
                "transitions": summary.transitions,
                "restarts": summary.restarts,
                "hindsight": {**looked_back, "net_s": round(looked_back["net_s"], 1)},
                "simulated": True,
            },
        )
    )
    return JobOutcome(status=status, steps_done=summary.steps, final_loss=None)
