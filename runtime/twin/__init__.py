"""The cluster twin: a simulated GPU cluster running a PPO job, with physics of its own.

It prices a step from the shapes of its work and the hardware's published rates
(``hardware``, ``kernels``, ``layers``), plays pipelines micro-batch by micro-batch
(``pipeline``) and generation as a serving engine batches it (``serving``), and fails what does
not fit in memory (``twin``). It imports nothing from the planner's cost or memory models: the
planner must learn it online, and may be wrong about it. ``runtime/engine/sim.py`` is the engine
interface over it.
"""

from runtime.twin.hardware import CPU_SLOT, DEVICES, Device, Link, device
from runtime.twin.twin import (
    ClusterTwin,
    TwinStep,
    build_seconds,
    primitive_seconds,
    probe_seconds,
    restart_seconds,
)

__all__ = [
    "CPU_SLOT",
    "DEVICES",
    "ClusterTwin",
    "Device",
    "Link",
    "TwinStep",
    "build_seconds",
    "device",
    "primitive_seconds",
    "probe_seconds",
    "restart_seconds",
]
