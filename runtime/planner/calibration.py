"""Online calibration: one efficiency per operation class (and link type), learned from the running
job's measured times.

Each observation is an operation class's ideal seconds (hardware peak, from the cost model) beside
the seconds the job measured for it; ``ideal / measured`` is a sample of that class's efficiency.
The estimate is robust to outliers: samples further than 3 scaled median absolute deviations from
the median (in log space) are dropped and the rest averaged. A class never observed borrows the
correction (learned / default) of observed classes of the same family (e.g. ``dp_allreduce:intra``
for ``dp_allreduce:inter``), else of the same link type, else keeps its default. Calibrations are
saved per job and per cluster kind, so a new job on a known cluster starts from what the last one
learned.
"""

from __future__ import annotations

import collections
import json
import math
import os
import statistics
from collections.abc import Mapping
from pathlib import Path

from runtime.planner import cost
from runtime.planner.catalog import Accelerator
from runtime.planner.cost import DEFAULT_EFFICIENCY, OPERATION_CLASSES
from runtime.planner.plan import Plan
from runtime.planner.shapes import LayoutShape
from runtime.planner.workload import PpoWorkload

_MAD_SCALE = 1.4826  # MAD of a normal distribution -> its standard deviation
_OUTLIER_MADS = 3.0


class Calibrator:
    """Efficiency per operation class, from a sliding window of measurements."""

    def __init__(self, *, prior: Mapping[str, float] | None = None, window: int = 64):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window: must be a positive integer, got {window!r}")
        for op_class, value in (prior or {}).items():
            if op_class not in OPERATION_CLASSES:
                raise ValueError(f"prior.{op_class}: unknown operation class")
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
                raise ValueError(f"prior.{op_class}: must be a number in (0, 1], got {value!r}")
        self.prior = {**DEFAULT_EFFICIENCY, **(prior or {})}
        self.window = window
        self._samples: dict[str, collections.deque[float]] = {}

    def observe(self, op_class: str, *, ideal_s: float, measured_s: float) -> None:
        """Record one measurement of an operation class."""
        if op_class not in OPERATION_CLASSES:
            raise ValueError(
                f"op_class: unknown {op_class!r}; valid: {', '.join(OPERATION_CLASSES)}"
            )
        if not (
            ideal_s > 0 and measured_s > 0 and math.isfinite(ideal_s) and math.isfinite(measured_s)
        ):
            raise ValueError(
                f"measured_s: times must be positive and finite, got {ideal_s}, {measured_s}"
            )
        ratio = math.log(ideal_s) - math.log(measured_s)
        if abs(ratio) > 50:  # an efficiency of e**±50 is a broken measurement, not a slow cluster
            raise ValueError(
                f"measured_s: {measured_s} s against {ideal_s} s ideal is not plausible"
            )
        samples = self._samples.setdefault(op_class, collections.deque(maxlen=self.window))
        samples.append(ratio)

    def num_samples(self, op_class: str) -> int:
        return len(self._samples.get(op_class, ()))

    def _estimate(self, op_class: str) -> tuple[float, float] | None:
        """(log efficiency, robust spread) of an observed class, None if unobserved."""
        samples = list(self._samples.get(op_class, ()))
        if not samples:
            return None
        center = statistics.median(samples)
        spread = _MAD_SCALE * statistics.median(abs(s - center) for s in samples)
        # A floor on the spread (1% in log space) so that identical samples still reject outliers.
        limit = _OUTLIER_MADS * max(spread, 0.01)
        kept = [s for s in samples if abs(s - center) <= limit]
        return statistics.fmean(kept), spread

    def efficiency(self) -> dict[str, float]:
        """The calibrated efficiency of every operation class."""
        learned = {c: e[0] for c in OPERATION_CLASSES if (e := self._estimate(c)) is not None}
        corrections = {c: v - math.log(self.prior[c]) for c, v in learned.items()}
        out = {}
        for op_class in OPERATION_CLASSES:
            if op_class in learned:
                out[op_class] = math.exp(learned[op_class])
                continue
            family, _, link = op_class.partition(":")
            related = [v for c, v in corrections.items() if c.partition(":")[0] == family and link]
            if not related and link:
                related = [v for c, v in corrections.items() if c.partition(":")[2] == link]
            shift = statistics.fmean(related) if related else 0.0
            out[op_class] = self.prior[op_class] * math.exp(shift)
        return {c: min(v, 1.0) for c, v in out.items()}

    def confidence(self) -> dict[str, float]:
        """0 for a class never observed, towards 1 with many consistent observations."""
        out = {}
        for op_class in OPERATION_CLASSES:
            estimate = self._estimate(op_class)
            if estimate is None:
                out[op_class] = 0.0
                continue
            n = self.num_samples(op_class)
            out[op_class] = round(n / (n + 2) / (1.0 + 10.0 * estimate[1]), 4)
        return out

    # --- persistence ----------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "prior": self.prior,
            "window": self.window,
            "samples": {c: list(s) for c, s in self._samples.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping) -> Calibrator:
        try:
            calibrator = cls(prior=data["prior"], window=data["window"])
            for op_class, samples in data["samples"].items():
                if op_class not in OPERATION_CLASSES:
                    raise ValueError(f"samples.{op_class}: unknown operation class")
                values = [float(s) for s in samples]
                if not all(math.isfinite(v) for v in values):
                    raise ValueError(f"samples.{op_class}: values must be finite")
                calibrator._samples[op_class] = collections.deque(values, maxlen=calibrator.window)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"calibration: malformed file ({exc})") from None
        return calibrator

    def save(self, path: str | Path) -> None:
        """Write atomically: aside, synced, renamed."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        with tmp.open("w") as f:
            json.dump(self.to_json(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> Calibrator:
        return cls.from_json(json.loads(Path(path).read_text()))


TRAINING = ("actor@training", "critic@training")


def samples_from_stages(
    plan: Plan,
    workload: PpoWorkload,
    accelerator: Accelerator,
    *,
    measured: Mapping[str, float],
    training_s: float,
) -> tuple[tuple[str, float, float], ...]:
    """(operation class, ideal seconds, measured seconds) samples from a step's measured seconds
    per model-stage (``measured``; the two training models, which update in the same calls, are
    timed together as ``training_s``), at ``workload`` (the step's own generated length).

    Slots time model-stages, not operations: a model-stage's measured time is shared among its
    classes in proportion to the time the cost model gives them at one efficiency, the 1F1B
    bubble included (it stretches the classes inside the pipeline); each class's sample is its
    share net of the bubble, which ``cost.predict`` adds back. A job that runs exactly as the
    cost model says at one efficiency is learned exactly, at any pipeline degree."""
    ideal: dict[str, dict[str, float]] = {}
    stretched: dict[str, float] = {}  # the model-stage's ideal seconds, bubble included
    for ms in workload.model_stages():
        shape = LayoutShape.of_plan(ms, workload, accelerator, plan)
        seconds, stretches = cost.ideal_breakdown(shape, num_slots=plan.num_slots)
        stretch = float(stretches[0])
        ideal[ms.name] = {op: float(v[0]) for op, v in seconds.items() if float(v[0]) > 0}
        stretched[ms.name] = sum(
            s * (stretch if cost.in_pipeline(op) else 1.0) for op, s in ideal[ms.name].items()
        )
    measured = {k: v for k, v in measured.items() if k not in TRAINING}
    training = sum(stretched[name] for name in TRAINING)
    for name in TRAINING:
        share = stretched[name] / training if training > 0 else 0.5
        measured[name] = training_s * share
    out = []
    for name, ops in ideal.items():
        if stretched[name] <= 0 or name not in measured:
            continue
        out += [(op, s, measured[name] * s / stretched[name]) for op, s in ops.items()]
    return tuple(out)


def calibration_path(root: str | Path, *, cluster_kind: str, job_id: str | None = None) -> Path:
    """Where a calibration lives: per cluster kind, and per job inside it."""
    for name, value in (("cluster_kind", cluster_kind), ("job_id", job_id)):
        if value is not None and (not value or "/" in value or value.startswith(".")):
            raise ValueError(f"{name}: must be a plain name, got {value!r}")
    base = Path(root) / cluster_kind
    return base / (f"job-{job_id}.json" if job_id is not None else "cluster.json")
