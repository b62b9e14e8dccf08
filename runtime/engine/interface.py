"""The engine interface: what the controller and the job loop need from where units live.

Two engines honour it: the simulated cluster (``runtime/engine/sim.py``) and the Ray engine
(``runtime/engine/ray_engine.py``, real units on slot actors). Nothing above this interface knows
which one runs, except that every report of the simulated one says ``simulated=True``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from runtime.planner.calibration import Sample
from runtime.planner.plan import Plan
from runtime.planner.probes import Probe
from runtime.planner.workload import PpoWorkload
from runtime.transition.dag import TransitionDag
from runtime.transition.units import Units


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepReport:
    """One PPO step as measured by the engine."""

    step: int
    ok: bool
    seconds: float
    """Seconds the step took (simulated seconds on the simulated engine)."""
    gen_len: float
    """Mean generated tokens per response this step."""
    stage_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    samples: tuple[Sample, ...] = ()
    """What calibration learns from: each model-stage's measured seconds beside its classes'
    ideal seconds (``calibration.samples_from_stages``)."""
    peak_memory: float = 0.0
    """The fullest slot's peak as a fraction of its capacity."""
    failure: str = ""
    simulated: bool = False
    rebuild_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    """Per stage, the longest one new derived unit took to build this step (none: empty)."""
    extra: dict = dataclasses.field(default_factory=dict)
    """What the job itself reports (PPO's statistics); the controller does not read it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransitionOutcome:
    ok: bool
    seconds: float
    units: dict
    """Each persistent model-stage's intact units afterwards."""
    lost_slots: tuple[int, ...] = ()
    failure: str = ""
    simulated: bool = False
    rebuild_s: float = 0.0
    """Of ``seconds``, the part spent rebuilding derived model-stages (an engine that rebuilds
    them at the next step instead reports 0 here and the time in that step)."""
    samples: tuple[Sample, ...] = ()
    """What calibration learns from: each primitive that ran, its classes' ideal seconds beside
    its measured time (``Node.sample``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProbeReport:
    """Calibration probes as the engine ran them (``runtime/planner/probes.py``)."""

    measured_s: tuple[tuple[float, ...], ...]
    """Of each probe that ran, in the order asked, the seconds of each timed run (the slowest
    rank's). Fewer than asked when a slot failed part-way (``failure``)."""
    seconds: float
    """What probing took in all, group set-up and warm-up included (simulated seconds on the
    simulated engine): time the job spent not stepping."""
    simulated: bool = False
    failure: str = ""
    """Why the probes stopped early (a slot failed): the job goes on without the rest."""


class Engine(Protocol):
    """Where a job's units live and its steps run."""

    kind: str
    simulated: bool

    def now(self) -> float:
        """Seconds since the job started (simulated on the simulated engine)."""

    def pool_size(self) -> int:
        """Slots the job may use now."""

    def lost_slots(self) -> frozenset[int]:
        """Slots whose state is gone (revoked or failed) since the last placement."""

    def start(self, plan: Plan, workload: PpoWorkload) -> None:
        """Place the plan's units (fresh state, or the job's checkpoint)."""

    def units(self) -> Units:
        """The persistent units that exist now."""

    def step(self, plan: Plan, workload: PpoWorkload, step: int) -> StepReport: ...

    def transition(self, dag: TransitionDag) -> TransitionOutcome:
        """Run ``dag``; its ``built_ahead`` units were started by ``build_ahead``, and the
        transition waits only for whatever of them is still building. Its ``joining`` units
        it does not wait for: the next step generates on the generation units that are built
        while they build (new generation units join once built; the inference stage waits for
        whatever still builds on its slots)."""

    def build_ahead(
        self, plan: Plan, workload: PpoWorkload, units: dict[str, tuple[tuple[int, ...], ...]]
    ) -> None:
        """Start building, without waiting, ``plan``'s derived units ``units`` (model-stage →
        each unit's slots), all on slots the running plan does not use: the job's next step
        runs on the others meanwhile."""

    def drop_ahead(self) -> None:
        """The units building ahead will not be used (their proposal was rejected or expired,
        their staged move dropped): free them once built, without waiting for the builds."""

    def restart(self, plan: Plan, workload: PpoWorkload) -> float:
        """Checkpoint/restart onto ``plan``; returns its seconds."""

    def run_probes(self, probes: Sequence[Probe]) -> ProbeReport:
        """Time each probe's collective alone on its slots, one probe after another, on slots
        no step or build is using (before the job's first step, or between steps). A probe
        naming a slot that is not a live slot of the pool is refused, before anything runs,
        with a ``ValueError`` naming it (``probes[i].slots``)."""
