"""The planner: catalogs, the PPO workload, cost and memory models, calibration and the global
search. Pure Python and NumPy over frozen dataclasses; imports neither Ray nor torch.distributed."""

from runtime.planner.catalog import Accelerator, Catalog, CatalogError, ModelConfig, default_catalog
from runtime.planner.plan import Layout, ModelStagePlan, Plan, StagePlan
from runtime.planner.search import PlanningError, PlanResult, min_max_allocation, plan
from runtime.planner.workload import PpoWorkload

__all__ = [
    "Accelerator",
    "Catalog",
    "CatalogError",
    "Layout",
    "ModelConfig",
    "ModelStagePlan",
    "Plan",
    "PlanResult",
    "PlanningError",
    "PpoWorkload",
    "StagePlan",
    "default_catalog",
    "min_max_allocation",
    "plan",
]
