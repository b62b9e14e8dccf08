"""What a job would start on, before it is submitted: its first plan and predicted step time.

For a PPO job on CPU slots it is the controller's first plan for the job's workload on its slots
(nothing is started). For a simulated PPO job this is the controller's own first plan
(``Controller.initial_plan`` on the same trace and simulated cluster the job will start with), so
the preview is what the job's first ``control.plan`` event will say. An SFT job has no cost
model: its layout is data-parallel over its slots and no step time is predicted.
"""

from __future__ import annotations

from typing import Any

from runtime.jobs.spec import PpoJobSpec, PpoSimJobSpec, SftJobSpec, spec_from_json


def job_preview(spec: dict[str, Any]) -> dict[str, Any]:
    """The planned layout of a valid spec; ``ValueError`` naming the field otherwise."""
    validated = spec_from_json(spec)
    if isinstance(validated, PpoSimJobSpec):
        return _ppo_sim_preview(validated)
    if isinstance(validated, PpoJobSpec):
        return _ppo_preview(validated)
    return _sft_preview(validated)


class _PlannedSlots:
    """What the controller asks of an engine to plan a job's start: its slots, none lost yet.
    Nothing is started (no Ray for a preview)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots

    def pool_size(self) -> int:
        return self.num_slots

    def lost_slots(self) -> frozenset[int]:
        return frozenset()

    def start(self, plan, workload) -> None:
        pass


def _ppo_preview(spec: PpoJobSpec) -> dict[str, Any]:
    """The controller's first plan for the job's workload (``PpoRuntime.workload``) on its slots
    (CPU processes or GPUs, ``spec.gpu``): what the job's first ``control.plan`` event would say
    before its probes time the links (``Controller._run_probes``) and calibration learns."""
    import tempfile

    from runtime.control import Controller, JobPolicy
    from runtime.planner import PlanningError, default_catalog
    from runtime.ppo.job import PpoRuntime

    accelerator = default_catalog().accelerator(spec.gpu)
    with tempfile.TemporaryDirectory(prefix="nereus-preview-") as workdir:
        workload = PpoRuntime(spec.job_config(), workdir=workdir).workload()
    # A preview starts nothing, so it times no link: the plan the catalog's figures give.
    policy = JobPolicy.from_json({**spec.policy, "calibration_probes": False})
    controller = Controller(workload, accelerator, policy)
    try:
        plan = controller.initial_plan(_PlannedSlots(spec.num_slots))
    except PlanningError as exc:
        raise ValueError(
            f"model: no feasible plan for {spec.model} on {spec.num_slots} {spec.gpu} slot(s): {exc}"
        ) from None
    return {
        "kind": "ppo",
        "simulated": False,
        "predicted_step_s": plan.predicted_step_s,
        "gen_len": controller.workload.gen_len,
        "note": (
            "the controller's first plan on the job's "
            + ("CPU slots" if not spec.uses_gpus else f"{spec.gpu} GPUs")
            + " (before its probes and calibration)"
        ),
        "plan": plan.to_json(),
    }


def _sft_preview(spec: SftJobSpec) -> dict[str, Any]:
    units = [[slot] for slot in range(spec.num_slots)]
    return {
        "kind": "sft",
        "simulated": False,
        "predicted_step_s": None,
        "note": "data-parallel over the CPU slots; the SFT job has no cost model",
        "plan": {
            "num_slots": spec.num_slots,
            "predicted_step_s": None,
            "stages": [{"stage": "training", "mode": "colocated", "predicted_s": None}],
            "model_stages": [
                {
                    "name": "model@training",
                    "layout": {"dp": spec.num_slots, "tp": 1, "pp": 1},
                    "units": units,
                    "predicted_s": None,
                }
            ],
        },
    }


def _ppo_sim_preview(spec: PpoSimJobSpec) -> dict[str, Any]:
    from runtime.jobs.sim_job import sim_job_parts

    # The spec's own validation made this plan already, refusing a job that fits nowhere.
    engine, controller = sim_job_parts(spec)
    plan = controller.initial_plan(engine)
    return {
        "kind": "ppo-sim",
        "simulated": True,
        "predicted_step_s": plan.predicted_step_s,
        "gen_len": controller.workload.gen_len,
        "note": "the controller's first plan on the simulated cluster",
        "plan": plan.to_json(),
    }
