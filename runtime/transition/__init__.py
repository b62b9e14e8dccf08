"""Transitions between plans: the global DAG of primitives that takes every model-stage from its
current units to its target units, its memory-safety check, and the executor that runs it.

``diff`` compiles (pure Python, no Ray); ``Executor`` runs a compiled DAG on a ``UnitEngine``;
``simulate`` runs one against the memory model with predicted durations (benchmarks, properties).
"""

from runtime.transition.compiler import Cluster, TransitionRefusedError, diff
from runtime.transition.dag import MemoryUnsafeError, Node, TransitionDag
from runtime.transition.executor import ExecutionResult, Executor
from runtime.transition.simulate import SimulationResult, simulate
from runtime.transition.units import Units, units_of

__all__ = [
    "Cluster",
    "ExecutionResult",
    "Executor",
    "MemoryUnsafeError",
    "Node",
    "SimulationResult",
    "TransitionDag",
    "TransitionRefusedError",
    "Units",
    "diff",
    "simulate",
    "units_of",
]
