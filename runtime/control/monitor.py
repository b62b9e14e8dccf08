"""The monitor: per-step signals, their references, drift horizons and the triggers they fire.

A signal drifts when it moves more than its relative threshold from its *reference* (its value at
the last replan). Each crossing is recorded; the drift horizon ``H`` of a signal is the exponential
moving average of the steps between its crossings (1 before any interval has been seen), and
estimates how long a new plan will stay right. The clock of each horizon starts when the signal is
first observed (the job's start is where its first reference was set), so the first crossing
already closes an interval: a signal that held still for 200 steps before it first moved has
H = 200, not 1. The slot pool is a signal too (``pool``): every change of the pool is a crossing,
so a job on a pool that changes once an hour is not told that the next change comes in one step.
References reset after every replan, so that steady growth keeps triggering.
"""

from __future__ import annotations

import dataclasses

from runtime.control.policy import SIGNALS, JobPolicy

POOL = "pool"
"""The horizon of the slot pool: its crossings are the pool's changes."""
HORIZON_ALPHA = 0.5
"""Weight of the newest interval in the drift horizon's moving average."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Trigger:
    kind: str
    """``pool`` (the slots changed), ``failure`` (slots lost or a step failed), ``memory``
    (a violation is predicted within the lookahead), or ``drift``."""
    signal: str = ""
    value: float = 0.0
    reference: float = 0.0
    step: int = 0
    detail: str = ""
    spared: bool = False
    """A pool that shrank without taking a slot the running plan uses (an idle slot lost):
    the plan runs on, so the replan is not urgent."""

    @property
    def urgent(self) -> bool:
        """Urgent triggers waive profitability (feasibility only) and take the urgent path: a
        failure or slots taken away. More slots are not urgent; nor is a predicted memory
        violation, which is a forecast and may be a false alarm: admission decides how far to
        trust it (a move away from a plan forecast to outgrow memory is admitted on feasibility
        when it is live, or when the plan would outgrow the devices themselves)."""
        if self.kind == "pool":
            return self.value < self.reference and not self.spared
        return self.kind in ("failure",)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class DriftHorizon:
    """EMA of the steps between a signal's threshold crossings."""

    def __init__(self, alpha: float = HORIZON_ALPHA):
        self.alpha = alpha
        self.value = 1.0
        self.last_crossing: int | None = None
        self.intervals = 0

    def start(self, step: int) -> None:
        """Start the clock: the first crossing after ``step`` closes an interval from it."""
        if self.last_crossing is None:
            self.last_crossing = step

    def crossed(self, step: int) -> None:
        if self.last_crossing is not None:
            interval = step - self.last_crossing
            self.value = (
                float(interval)
                if self.intervals == 0
                else self.alpha * interval + (1 - self.alpha) * self.value
            )
            self.intervals += 1
        self.last_crossing = step


PLAN_SIGNALS = ("step_time", "peak_memory")
"""Signals whose level is the running plan's: a new plan starts them afresh."""
RELATIVE_SIGNALS = ("calibration",)
"""Signals measured from the last replan already (1 there): their reference is always 1."""


class Monitor:
    """Feed it one step's signals at a time; it answers with the triggers they fire."""

    def __init__(self, policy: JobPolicy):
        self.policy = policy
        self.reference: dict[str, float] = {}
        self.horizon = {s: DriftHorizon() for s in (*SIGNALS, POOL)}
        self.history: dict[str, list[tuple[int, float]]] = {s: [] for s in SIGNALS}
        self.pool: int | None = None

    def observe(self, step: int, signals: dict[str, float], *, pool: int) -> list[Trigger]:
        triggers = []
        self.horizon[POOL].start(step)
        if self.pool is not None and pool != self.pool:
            self.horizon[POOL].crossed(step)
            triggers.append(
                Trigger(
                    kind="pool",
                    signal=POOL,
                    value=pool,
                    reference=self.pool,
                    step=step,
                    detail=f"slots {self.pool} -> {pool}",
                )
            )
        self.pool = pool
        for name, value in signals.items():
            if name not in SIGNALS:
                raise ValueError(f"signals.{name}: unknown signal")
            self.history[name].append((step, value))
            self.horizon[name].start(step)
            reference = 1.0 if name in RELATIVE_SIGNALS else self.reference.setdefault(name, value)
            if reference and abs(value - reference) / abs(reference) > self.policy.threshold(name):
                self.horizon[name].crossed(step)
                triggers.append(
                    Trigger(
                        kind="drift",
                        signal=name,
                        value=value,
                        reference=reference,
                        step=step,
                        detail=f"{name} {reference:.4g} -> {value:.4g}",
                    )
                )
        return triggers

    def plan_changed(self) -> None:
        """Another plan runs from the next step: the signals that measure the plan rather than
        the world (its step time, its peak memory) take their next value as reference, so that
        a move to a faster or leaner plan is not read as drift. Efficiency, measured against
        the running plan's own prediction, keeps its reference: a plan slower than predicted
        is drift the calibration must see."""
        for name in PLAN_SIGNALS:
            self.reference.pop(name, None)

    def replanned(self) -> None:
        """A new plan is in place: every signal's reference becomes its latest value."""
        for name, history in self.history.items():
            if history:
                self.reference[name] = history[-1][1]

    def trend(self, signal: str, ahead: int, window: int = 8) -> float | None:
        """The signal ``ahead`` steps on: the least-squares line through the last ``window``
        steps, extended. A line through all of them, not through the first and last only, so
        that a swinging signal forecasts its level rather than its latest swing."""
        points = self.history[signal][-window:]
        if len(points) < 2:
            return points[-1][1] if points else None
        n = len(points)
        mean_s = sum(s for s, _ in points) / n
        mean_v = sum(v for _, v in points) / n
        spread = sum((s - mean_s) ** 2 for s, _ in points)
        slope = sum((s - mean_s) * (v - mean_v) for s, v in points) / spread if spread > 0 else 0.0
        return mean_v + slope * (points[-1][0] + ahead - mean_s)

    def horizon_of(self, signal: str) -> float:
        """H: the EMA of steps between the signal's crossings (1 before any interval)."""
        return self.horizon[signal].value if signal else 1.0

    def effective_horizon(self, signal: str, step: int) -> float:
        """What admission uses: H, or the steps the signal has stayed quiet since its last
        crossing if that is longer. A signal that has held still for k steps is likely to hold a
        while more, so a move deferred as too slow to repay is admitted once the calm lasts."""
        if not signal:
            return 1.0
        last = self.horizon[signal].last_crossing
        quiet = step - last if last is not None else 0
        return max(self.horizon[signal].value, float(quiet))
