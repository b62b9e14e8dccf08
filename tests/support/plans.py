"""Controller events for web tests, built with the real runtime: plans from the planner, DAGs from
the transition compiler, verdicts from admission, and a real controller on the simulated cluster."""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from runtime.control import Controller, JobPolicy
from runtime.control.admission import decide
from runtime.engine.sim import SimulatedEngine
from runtime.engine.traces import Trace
from runtime.planner import PpoWorkload, default_catalog, plan
from runtime.planner.plan import Layout, Plan
from runtime.transition import Cluster, diff
from runtime.twin import ClusterTwin, device

CATALOG = default_catalog()
CPU = CATALOG.accelerator("cpu-slot")
TINY = PpoWorkload.for_model(CATALOG.model("tiny-llama"))
H100 = CATALOG.accelerator("h100-sxm")
LLAMA_8B = PpoWorkload.for_model(CATALOG.model("llama-3.1-8b"), gen_len=1024)


def generation_over(num_slots: int, generation_tp: int) -> Plan:
    """An 8B PPO plan on ``num_slots`` H100s written by hand: every model-stage tensor-parallel
    over 8 slots across the pool, but generation over ``generation_tp``."""
    layouts = {}
    for ms in LLAMA_8B.model_stages():
        tp = generation_tp if ms.stage == "generation" else 8
        dp = num_slots // tp
        units = tuple(tuple(range(i * tp, (i + 1) * tp)) for i in range(dp))
        layouts[ms.name] = (Layout(dp=dp, tp=tp, pp=1), units)
    return Plan.of_units(accelerator=H100.name, num_slots=num_slots, layouts=layouts)


@functools.cache
def _plans(num_slots: int, pool: int):
    best = plan(TINY, CPU, num_slots, num_alternatives=0).best
    return dataclasses.replace(best, num_slots=pool)


def plan_json(num_slots: int = 4, *, pool: int = 8) -> dict[str, Any]:
    """The planner's best plan for the tiny model on ``num_slots`` of a pool of ``pool`` slots."""
    return copy.deepcopy(_plans(num_slots, pool).to_json())


@functools.cache
def _dag(source: int, target: int, pool: int):
    cluster = Cluster(accelerator=CPU, num_slots=pool, capacity_bytes=(1e15,) * pool)
    return diff(_plans(source, pool), _plans(target, pool), cluster, TINY)


def dag_json(source: int = 4, target: int = 8, *, pool: int = 8) -> dict[str, Any]:
    """The compiled transition DAG between the plans on ``source`` and ``target`` slots."""
    return copy.deepcopy(_dag(source, target, pool).to_json())


def verdict_json(source: int = 4, target: int = 8, **overrides) -> dict[str, Any]:
    """Admission's verdict on moving from ``source`` to ``target`` slots."""
    arguments = {
        "admission": "payback",
        "current_s": _plans(source, 8).predicted_step_s,
        "candidate_s": _plans(target, 8).predicted_step_s,
        "cost_s": _dag(source, target, 8).predicted_s,
        "horizon_steps": 10.0,
        "gamma": 0.5,
        "urgent": False,
        **overrides,
    }
    return decide(**arguments).to_json()


def initial_event(num_slots: int = 4) -> dict[str, Any]:
    return {"event": "control.plan", "plan": plan_json(num_slots), "reason": "initial"}


def decision_event(source: int = 4, target: int = 8, **verdict) -> dict[str, Any]:
    judged = verdict_json(source, target, **verdict)
    return {
        "event": "control.decision",
        "trigger": {"kind": "pool", "signal": "", "value": 8.0, "reference": 4.0, "step": 3},
        "candidate": plan_json(target),
        "current": plan_json(source),
        "verdict": judged,
        "admit": judged["admit"],
        "reason": judged["reason"],
        "horizon_steps": 10.0,
        "gamma": 0.5,
        "predicted_transition_s": _dag(source, target, 8).predicted_s,
    }


def proposal_event(proposal_id: int = 1, source: int = 4, target: int = 8) -> dict[str, Any]:
    return {
        "event": "control.proposal",
        "proposal": proposal_id,
        "plan": plan_json(target),
        "verdict": verdict_json(source, target),
    }


def transition_event(source: int = 4, target: int = 8, *, ok: bool = True) -> dict[str, Any]:
    dag = dag_json(source, target)
    return {
        "event": "control.transition",
        "ok": ok,
        "predicted_s": dag["predicted_s"],
        "actual_s": dag["predicted_s"] * 1.1,
        "nodes": len(dag["nodes"]),
        "failure": "" if ok else "slot 3 stopped answering",
        "simulated": True,
        "dag": dag,
    }


def simulated_controller(
    emit: Callable[[dict], None],
    *,
    serving_start_s: float | None = None,
    grow_at_s: float = 1.0,
    **policy,
) -> tuple[Controller, SimulatedEngine]:
    """A real controller for an 8B model on a simulated pool of 16 H100s that grows to 32 during
    step 0 (so it wants to move; ``grow_at_s``), emitting to ``emit``; its initial plan is already made. No
    calibration probe runs first (the pool would grow during them, before the first plan).
    ``serving_start_s``: the twin's generation units take this long to start; ``grow_at_s``:
    when the pool grows (simulated seconds)."""
    trace = Trace(
        name="grow",
        steps=20,
        accelerator=H100.name,
        gpus=16,
        gen_len=((0, 1024.0),),
        pool=((grow_at_s, 32),),
        len_sigma=0.0,  # every response the same length: the controller's choices repeat
    )
    gpu = device(H100.name)
    if serving_start_s is not None:  # generation units that take this long to start
        gpu = dataclasses.replace(gpu, serving_start_s=serving_start_s)
    engine = SimulatedEngine(trace, H100, twin=ClusterTwin.draw(gpu, 3, noise=0.0), seed=1)
    controller = Controller(
        LLAMA_8B,
        H100,
        JobPolicy(
            **{
                "admission": "always_faster",
                "calibration_probes": False,
                # the twin's first steps move calibration far; a replan it asked for would
                # replace the proposal these tests decide
                "thresholds": {"calibration": 10.0},
                **policy,
            }
        ),
        emit=emit,
    )
    controller.initial_plan(engine)
    return controller, engine


def run_steps(controller: Controller, engine: SimulatedEngine, steps: range) -> None:
    for step in steps:
        controller.before_step(engine, step)
        report = engine.step(controller.plan, LLAMA_8B, step)
        controller.after_step(report, engine)
