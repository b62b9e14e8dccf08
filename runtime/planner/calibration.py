"""Online calibration: one efficiency per operation class (and link type), learned from the running
job's measured times.

A job measures what its slots can time: a whole model-stage (several operation classes run
together), a transition node, or one class alone. Each measurement is a ``Sample``: the ideal
seconds of each class in it (hardware peak, from the cost model; the pipeline's stretch
included) and the seconds it took. The efficiencies are those that best explain every sample in
the window at once, ``measured = sum(ideal_c / efficiency_c)``, in relative error: a class that runs
in several model-stages, or in one stage whose mix changes with the generated length or the
layout, is told apart from the classes it runs with. What the samples cannot tell apart (two
classes that only ever run together, in the same proportions) keeps the prior's ratio between
them: the solve moves the efficiencies as little as explaining the samples needs (a least-squares
fit that leaves the directions the samples do not determine where they were). Samples further
than 3 scaled median absolute deviations from the fit (in log space) are dropped and the fit made
again. A class the window no longer determines (the plan moved off what ran it) keeps what
was last learned of it with confidence: a job that left a slow link because it was slow must
not forget that it is, or the next replan takes it again. A class never learned borrows the
correction (learned / default) of learned classes of the same family (e.g.
``dp_allreduce:intra`` for ``dp_allreduce:inter``), else of the same link type, else keeps its
default. Calibrations are saved per job and per cluster kind, so a new job
on a known cluster starts from what the last one learned.

The load on the links moves over hours (other tenants' traffic), and every class that crosses a
link slows alike. A gauge class timed alone now and then (``probes.LINK_GAUGES``) measures each
link type's load against what it first measured (``observe_link``); a sample is recorded with
its linked classes' ideal seconds scaled by the load it ran under, so the fit learns each class
at the gauge's first load and samples from the hours of heavy and light traffic agree, and
``efficiency`` prices the links at their load now. Without it, a fit over a window of changing
load blames the load on whatever the window's plans happened to run most of (decode or the
tensor-parallel all-reduce, when generation's mix of the two cannot tell them apart).

Splitting a model-stage's time among its classes in proportion to their predicted time instead
gives every class of the stage the same correction: on a cluster whose links are slow and whose
decode is not, generation's decode is then learned as slow as its tensor-parallel all-reduce, and
the planner takes more tensor parallelism, the slow thing, to cut decode.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from runtime.planner import cost
from runtime.planner.catalog import Accelerator
from runtime.planner.cost import DEFAULT_EFFICIENCY, OPERATION_CLASSES
from runtime.planner.plan import Plan
from runtime.planner.shapes import LayoutShape
from runtime.planner.workload import PpoWorkload

LINKS = ("intra", "inter")
"""The link types a communication class crosses (the suffix of its name)."""
_MAD_SCALE = 1.4826  # MAD of a normal distribution -> its standard deviation
_OUTLIER_MADS = 3.0
SETTLED_CONFIDENCE = 0.5
"""The confidence at which a determined class is taken as learned (see ``settled``)."""
_RCOND = 0.01
"""Directions of the fit whose singular value is under this fraction of the largest are not
determined by the samples (noise would decide them): the fit leaves them where they were."""


@dataclasses.dataclass(frozen=True)
class Sample:
    """One measurement: the classes that ran in it, each with its ideal seconds (the pipeline's
    stretch included), and the seconds they took together."""

    source: str
    """What was timed (``actor@generation``, ``training``, a transition primitive, a class):
    the window keeps each source's last measurements."""
    terms: Mapping[str, float]
    measured_s: float


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
        self._rows: dict[str, collections.deque[tuple[dict[str, float], float]]] = {}
        self._fit: _Fit | None = None
        self._learned: dict[str, float] = {}
        """Each class's efficiency as last determined by the window (capped at 1), a linked
        class's at its link's reference load."""
        self._reference: dict[str, float] = {}
        """Each link type's gauge efficiency when first measured (``observe_link``)."""
        self._load: dict[str, float] = {}
        """Each link type's load now: how many times slower its gauge runs than at first."""
        self._gauge: dict[str, tuple[int, int] | None] = {}
        """The (ranks, bytes) of the gauge each reference was measured with."""

    def observe(self, op_class: str, *, ideal_s: float, measured_s: float) -> None:
        """Record one measurement of an operation class alone."""
        self.observe_sample(Sample(op_class, {op_class: ideal_s}, measured_s))

    def observe_sample(self, sample: Sample) -> None:
        """Record one measurement of classes that ran together."""
        terms = {}
        for op_class, ideal_s in sample.terms.items():
            _check_class(op_class)
            if not (isinstance(ideal_s, int | float) and math.isfinite(ideal_s) and ideal_s >= 0):
                raise ValueError(f"ideal_s: {op_class}: must be finite and not negative")
            if ideal_s > 0:  # at the reference load, this sample's classes took so long
                terms[op_class] = float(ideal_s) * self.link_load(_link(op_class))
        ideal, measured = sum(terms.values()), sample.measured_s
        if not (ideal > 0 and measured > 0 and math.isfinite(measured)):
            raise ValueError(
                f"measured_s: times must be positive and finite, got {ideal}, {measured}"
            )
        if abs(math.log(ideal) - math.log(measured)) > 50:
            # an efficiency of e**±50 is a broken measurement, not a slow cluster
            raise ValueError(f"measured_s: {measured} s against {ideal} s ideal is not plausible")
        rows = self._rows.setdefault(sample.source, collections.deque(maxlen=self.window))
        rows.append((terms, float(measured)))
        self._fit = None

    def measure(self, op_class: str, *, ideal_s: float, measured_s: Sequence[float]) -> float:
        """A class timed alone, outside the steps (a calibration probe, ``probes.py``): its
        efficiency, ideal seconds over the median measured run, is taken as learned of it. The
        fit starts there: a class the stage samples do not determine keeps what the probe
        measured (not a relative's correction); what they do determine they correct. Returns
        the efficiency."""
        _check_class(op_class)
        runs = [float(m) for m in measured_s]
        if not runs or not all(math.isfinite(m) and m > 0 for m in runs):
            raise ValueError(
                f"measured_s: {op_class}: runs must be positive and finite, got {runs}"
            )
        if not (math.isfinite(ideal_s) and ideal_s > 0):
            raise ValueError(f"ideal_s: {op_class}: must be positive and finite, got {ideal_s}")
        value = min(1.0, ideal_s / statistics.median(runs))
        if abs(math.log(value)) > 50:
            raise ValueError(f"measured_s: {op_class}: {runs} against {ideal_s} s is not plausible")
        self._learned[op_class] = min(1.0, value * self.link_load(_link(op_class)))
        self._fit = None
        return value

    def observe_link(
        self, link: str, efficiency: float, *, gauge: tuple[int, int] | None = None
    ) -> float:
        """A link type's gauge class (``probes.LINK_GAUGES``) timed alone now, at
        ``efficiency`` (ideal over measured seconds, not capped at 1: alone, a collective may
        run at the catalog's peak or past it): the first measurement of a link is its
        reference; each later one sets the link's load, the reference over it (2 = its classes
        take twice as long as when first measured). Samples recorded from now on ran under
        that load, and ``efficiency`` prices the link at it. ``gauge`` is the probe's (ranks,
        bytes): a collective's efficiency depends on them, so a gauge of another shape than the
        reference's (a node lost a slot, the pool spans more nodes, another job's model) is
        not compared with it: the reference is re-based on it at the load last known, and the
        load carries on. Returns the load."""
        if link not in LINKS:
            raise ValueError(f"link: unknown {link!r}; valid: {', '.join(LINKS)}")
        if not _plausible(efficiency):
            raise ValueError(f"efficiency: {link}: must be a positive number, got {efficiency!r}")
        shape = None if gauge is None else _gauge_shape(gauge)
        if gauge is not None and shape is None:
            raise ValueError(f"gauge: {link}: must be (ranks, bytes), got {gauge!r}")
        if link not in self._reference or self._gauge.get(link) != shape:
            self._reference[link] = float(efficiency) * self.link_load(link)
            self._gauge[link] = shape
        load = self._reference[link] / float(efficiency)
        if not _plausible(load):
            raise ValueError(
                f"efficiency: {link}: {efficiency} against {self._reference[link]} is not plausible"
            )
        self._load[link] = load
        return load

    def referenced(self) -> frozenset[str]:
        """The link types whose gauge has a reference (here or in the file loaded)."""
        return frozenset(self._reference)

    def link_load(self, link: str = "") -> float:
        """``link``'s load now (1 until its gauge was measured twice; 1 for no link)."""
        return self._load.get(link, 1.0)

    def learned(self) -> frozenset[str]:
        """The classes something has taught the calibration: settled by the stage samples, or
        measured by a probe (here or by an earlier job on this cluster, from its file)."""
        self._fitted()
        return frozenset(self._learned)

    def num_samples(self, op_class: str) -> int:
        """Samples in the window in which ``op_class`` ran."""
        return sum(op_class in terms for rows in self._rows.values() for terms, _ in rows)

    def _fitted(self) -> _Fit:
        """The fit of every sample in the window, made twice: a class that the samples do not
        determine (it never took a twentieth of a sample's time) starts the second from what
        its relatives learned in the first, and stays there."""
        if self._fit is None:
            rows = [row for source in self._rows.values() for row in source]
            first = _fit(rows, {**self.prior, **self._learned})
            self._fit = _fit(rows, self._borrowed(first))
            self._learned.update(
                {c: min(1.0, math.exp(self._fit.log_efficiency[c])) for c in self.settled()}
            )
        return self._fit

    def _borrowed(self, fit: _Fit) -> dict[str, float]:
        """Each class's efficiency where ``fit`` determined it, else as last learned, else its
        prior shifted by the mean correction (learned / prior) of the learned classes of its
        family and link (``dp_allreduce:intra`` for ``dp_allreduce:inter``), else of its link,
        else none."""
        known = {c: math.log(v) for c, v in self._learned.items()}
        known.update({c: fit.log_efficiency[c] for c in fit.determined})
        corrections = {c: v - math.log(self.prior[c]) for c, v in known.items()}
        out = {}
        for op_class in OPERATION_CLASSES:
            if op_class in known:
                out[op_class] = math.exp(known[op_class])
                continue
            family, _, link = op_class.partition(":")
            related = [v for c, v in corrections.items() if c.partition(":")[0] == family and link]
            if not related and link:
                related = [v for c, v in corrections.items() if c.partition(":")[2] == link]
            shift = statistics.fmean(related) if related else 0.0
            out[op_class] = min(1.0, self.prior[op_class] * math.exp(shift))
        return out

    def efficiency(self) -> dict[str, float]:
        """The calibrated efficiency of every operation class."""
        fit = self._fitted()
        out = self._borrowed(fit)
        out.update({c: math.exp(v) for c, v in fit.log_efficiency.items()})
        return {c: min(v / self.link_load(_link(c)), 1.0) for c, v in out.items()}

    def determined(self) -> frozenset[str]:
        """The classes the samples in the window determine (each took at least a twentieth of
        some sample's time); the others' efficiencies are borrowed from their relatives."""
        return self._fitted().determined

    def settled(self) -> frozenset[str]:
        """The classes the window determines with confidence (``SETTLED_CONFIDENCE``: several
        samples in which the class takes a real share, explained alike). One step's samples
        can pin a small class anywhere; what is remembered, and what moves the controller's
        ``calibration`` signal, is only what the samples agree on."""
        confidence = self.confidence()
        return frozenset(
            c for c in self._fitted().determined if confidence[c] >= SETTLED_CONFIDENCE
        )

    def confidence(self) -> dict[str, float]:
        """0 for a class never observed, towards 1 with many samples that the fit explains well
        and in which the class takes a real share of the time."""
        fit = self._fitted()
        out = {}
        for op_class in OPERATION_CLASSES:
            residuals = fit.residuals.get(op_class)
            if not residuals:
                out[op_class] = 0.0
                continue
            n = len(residuals)
            center = statistics.median(residuals)
            spread = _MAD_SCALE * statistics.median(abs(r - center) for r in residuals)
            out[op_class] = round(n / (n + 2) / (1.0 + 10.0 * spread), 4)
        return out

    # --- persistence ----------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {
            "prior": self.prior,
            "window": self.window,
            "learned": self._learned,
            "links": {
                "reference": self._reference,
                "load": self._load,
                "gauge": {k: list(v) for k, v in self._gauge.items() if v is not None},
            },
            "rows": {
                source: [[terms, measured] for terms, measured in rows]
                for source, rows in self._rows.items()
            },
        }

    @classmethod
    def from_json(cls, data: Mapping) -> Calibrator:
        try:
            calibrator = cls(prior=data["prior"], window=data["window"])
            learned = data.get("learned", {})
            if not isinstance(learned, dict):
                raise ValueError("learned: must be an object of operation class to efficiency")
            for op_class, value in learned.items():
                if op_class not in OPERATION_CLASSES:
                    raise ValueError(f"learned.{op_class}: unknown operation class")
                number = isinstance(value, int | float) and not isinstance(value, bool)
                if not (number and 0 < value <= 1):
                    raise ValueError(f"learned.{op_class}: must be a number in (0, 1]")
                calibrator._learned[op_class] = float(value)
            # The rows were recorded at the reference load: they are read before the load is.
            links = _links_from_json(data.get("links", {}))
            # Files written before samples of several classes: one log ratio per sample.
            for op_class, samples in data.get("samples", {}).items():
                if op_class not in OPERATION_CLASSES:
                    raise ValueError(f"samples.{op_class}: unknown operation class")
                values = [float(s) for s in samples]
                if not all(math.isfinite(v) and abs(v) <= 50 for v in values):
                    raise ValueError(f"samples.{op_class}: values must be finite")
                for ratio in values:
                    calibrator.observe(op_class, ideal_s=1.0, measured_s=math.exp(-ratio))
            for source, rows in data.get("rows", {}).items():
                for i, row in enumerate(rows):
                    if not (isinstance(row, list) and len(row) == 2 and isinstance(row[0], dict)):
                        raise ValueError(f"rows.{source}[{i}]: must be [terms, measured seconds]")
                    try:
                        calibrator.observe_sample(Sample(str(source), row[0], float(row[1])))
                    except ValueError as exc:
                        raise ValueError(f"rows.{source}[{i}]: {exc}") from None
            calibrator._reference, calibrator._load, calibrator._gauge = links
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


def _plausible(value) -> bool:
    """A positive number within e**±50 of 1 (further is a broken measurement, not a link)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and 0 < value < math.inf and abs(math.log(value)) <= 50


def _gauge_shape(value) -> tuple[int, int] | None:
    """``value`` as a gauge's (ranks, bytes), two positive integers; None if it is not one."""
    whole = isinstance(value, tuple | list) and len(value) == 2
    if not (whole and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in value)):
        return None
    return value[0], value[1]


def _links_from_json(links) -> tuple[dict, dict, dict]:
    """A calibration file's ``links`` (each link type's gauge reference, the (ranks, bytes) it
    was measured with, and its load), checked: each named by its field when malformed."""
    if not isinstance(links, dict):
        raise ValueError("links: must be an object with reference, load and gauge")
    parts = {}
    for part in ("reference", "load", "gauge"):
        values = links.get(part, {})
        if not isinstance(values, dict):
            raise ValueError(f"links.{part}: must be an object keyed by link type")
        for link, value in values.items():
            if link not in LINKS:
                raise ValueError(
                    f"links.{part}.{link}: unknown link type; valid: {', '.join(LINKS)}"
                )
            if part == "gauge":
                if _gauge_shape(value) is None:
                    raise ValueError(f"links.gauge.{link}: must be [ranks, bytes], got {value!r}")
            elif not _plausible(value):
                raise ValueError(f"links.{part}.{link}: must be a positive number, got {value!r}")
            if part != "reference" and link not in links.get("reference", {}):
                raise ValueError(f"links.{part}.{link}: the link has no reference")
        parts[part] = dict(values)
    gauge = {link: _gauge_shape(parts["gauge"].get(link)) for link in parts["reference"]}
    reference = {k: float(v) for k, v in parts["reference"].items()}
    return reference, {k: float(v) for k, v in parts["load"].items()}, gauge


def _link(op_class: str) -> str:
    """The link type an operation class crosses (``""`` for one that stays on a device)."""
    return op_class.partition(":")[2]


def _check_class(op_class: str) -> None:
    if op_class not in OPERATION_CLASSES:
        raise ValueError(f"op_class: unknown {op_class!r}; valid: {', '.join(OPERATION_CLASSES)}")


@dataclasses.dataclass(frozen=True)
class _Fit:
    log_efficiency: dict[str, float]
    """Of each class some kept sample ran."""
    determined: frozenset[str]
    """The classes that took a twentieth or more of some kept sample's time."""
    residuals: dict[str, list[float]]
    """Of each class, the fit's log residual in each kept sample where it took a tenth of the
    time or more."""


def _fit(rows: list[tuple[dict[str, float], float]], start: Mapping[str, float]) -> _Fit:
    """The efficiencies that best explain ``rows`` (least squares of the log of predicted over
    measured seconds, from ``start``, leaving the directions the rows do not determine there),
    the outliers of a first fit dropped."""
    if not rows:
        return _Fit({}, frozenset(), {})
    classes = sorted({c for terms, _ in rows for c in terms})
    column = {c: i for i, c in enumerate(classes)}
    ideal = np.zeros((len(rows), len(classes)))
    for j, (terms, _) in enumerate(rows):
        for op_class, seconds in terms.items():
            ideal[j, column[op_class]] = seconds
    measured = np.log([m for _, m in rows])
    begin = np.array([-math.log(start[c]) for c in classes])  # log(1 / efficiency)
    slowness = _solve(ideal, measured, begin)
    residual = np.log(ideal @ np.exp(slowness)) - measured
    center = float(np.median(residual))
    spread = _MAD_SCALE * float(np.median(np.abs(residual - center)))
    kept = np.abs(residual - center) <= _OUTLIER_MADS * max(spread, 0.01)
    if not kept.all():
        ideal, measured = ideal[kept], measured[kept]
        seen = ideal.any(axis=0)  # a class only the outliers ran is not learned
        ideal, begin = ideal[:, seen], begin[seen]
        classes = [c for c, s in zip(classes, seen, strict=True) if s]
        slowness = _solve(ideal, measured, begin)
        residual = np.log(ideal @ np.exp(slowness)) - measured
    time = ideal * np.exp(slowness)
    shares = time / time.sum(axis=1, keepdims=True)
    return _Fit(
        log_efficiency={c: -float(v) for c, v in zip(classes, slowness, strict=True)},
        determined=frozenset(c for i, c in enumerate(classes) if shares[:, i].max() >= 0.05),
        residuals={
            c: [float(r) for r in residual[shares[:, i] >= 0.1]] for i, c in enumerate(classes)
        },
    )


def _solve(ideal: np.ndarray, measured: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Gauss-Newton on ``log(ideal @ exp(y)) = measured`` from ``start``, with ``y >= 0`` (no
    efficiency above 1): each step is the least-squares step of least length, cut where it
    would not lower the error."""
    y = start.copy()

    def error(at):
        return float(np.sum((np.log(ideal @ np.exp(at)) - measured) ** 2))

    current = error(y)
    for _ in range(50):
        time = ideal * np.exp(y)
        predicted = time.sum(axis=1)
        jacobian = time / predicted[:, None]  # each class's share of its sample's time
        step = np.linalg.lstsq(jacobian, measured - np.log(predicted), rcond=_RCOND)[0]
        scale = 1.0
        while scale > 1e-4:
            trial = np.maximum(y + scale * step, 0.0)
            if (value := error(trial)) < current:
                break
            scale /= 2
        else:
            break
        moved = float(np.max(np.abs(trial - y)))
        y, current = trial, value
        if moved < 1e-9:
            break
    return y


TRAINING = ("actor@training", "critic@training")


def samples_from_stages(
    plan: Plan,
    workload: PpoWorkload,
    accelerator: Accelerator,
    *,
    measured: Mapping[str, float],
    training_s: float,
) -> tuple[Sample, ...]:
    """Calibration samples from a step's measured seconds per model-stage (``measured``; the two
    training models, which update in the same calls, are timed together as ``training_s``), at
    ``workload`` (the step's own generated length): one per model-stage timed, its classes'
    ideal seconds with the 1F1B bubble's stretch on those inside the pipeline, as
    ``cost.predict`` adds it. A job that runs exactly as the cost model says is learned exactly,
    at any pipeline degree."""
    terms: dict[str, dict[str, float]] = {}
    for ms in workload.model_stages():
        shape = LayoutShape.of_plan(ms, workload, accelerator, plan)
        seconds, stretches = cost.ideal_breakdown(shape, num_slots=plan.num_slots)
        stretch = float(stretches[0])
        terms[ms.name] = {
            op: float(v[0]) * (stretch if cost.in_pipeline(op) else 1.0)
            for op, v in seconds.items()
            if float(v[0]) > 0
        }
    training: dict[str, float] = {}
    for name in TRAINING:
        for op, s in terms.pop(name, {}).items():
            training[op] = training.get(op, 0.0) + s
    out = [
        Sample(name, ops, measured[name]) for name, ops in terms.items() if ops and name in measured
    ]
    if training and training_s > 0:
        out.append(Sample("training", training, training_s))
    return tuple(out)


def calibration_path(root: str | Path, *, cluster_kind: str, job_id: str | None = None) -> Path:
    """Where a calibration lives: per cluster kind, and per job inside it."""
    for name, value in (("cluster_kind", cluster_kind), ("job_id", job_id)):
        if value is not None and (not value or "/" in value or value.startswith(".")):
            raise ValueError(f"{name}: must be a plain name, got {value!r}")
    base = Path(root) / cluster_kind
    return base / (f"job-{job_id}.json" if job_id is not None else "cluster.json")
