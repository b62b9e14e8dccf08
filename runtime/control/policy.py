"""A job's control policy: thresholds, the payback confidence, the approval gate. Validated whole
at submission, so a bad value is an error naming its field, never a failure mid-run."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

SIGNALS = ("gen_len", "step_time", "peak_memory", "efficiency", "calibration")
"""Drift signals: mean generated length, measured step seconds, the fullest slot's peak memory
fraction, achieved efficiency (predicted over measured step time), and calibration (how far the
calibrated efficiency of some operation class has moved since plans were last weighed: the
ranking of plans may have changed even where the running plan's prediction is right)."""
DEFAULT_THRESHOLD = 0.30
APPROVAL_MODES = ("auto", "manual", "manual_above")
ADMISSIONS = ("payback", "always_faster", "never", "restart")
RUNWAYS = ("shortest", "amortized", "longest")
"""``payback`` is Nereus's rule; ``always_faster`` admits whatever is predicted faster (DynaRL-style);
``never`` keeps the plan unless forced; ``restart`` admits by payback but moves by checkpoint/restart."""
MAX_APPROVAL_TIMEOUT_S = 30 * 24 * 3600
"""The longest a proposal may wait for a person: 30 days (a deadline far beyond it is no
deadline, and one past the calendar's end cannot be stored)."""


class PolicyError(ValueError):
    """A policy value out of range or unknown; the message names the field."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobPolicy:
    thresholds: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """Relative drift per signal that triggers a replan; unset signals use 30%."""
    gamma: float = 0.5
    """Admit when cost / saving <= gamma × H (the drift horizon in steps)."""
    approval: str = "auto"
    approval_above_s: float = 0.0
    """With ``manual_above``: transitions predicted to cost more than this wait for a person."""
    approval_timeout_s: float = 3600.0
    """A proposal nobody answers is dropped after this long (at most ``MAX_APPROVAL_TIMEOUT_S``);
    the job keeps its plan."""
    admission: str = "payback"
    lookahead_steps: int = 5
    """How far ahead a memory violation is predicted from the signals' trend."""
    memory_runway: str = "shortest"
    """How long a new plan must keep fitting in memory as the generated length grows (payback
    admission): ``shortest`` as far as the lookahead forecasts (the fastest steps, the most
    moves); ``longest`` until the length is next expected to drift or the pool to change (the
    fewest moves); ``amortized`` whichever of the plans for those and the lengths between has
    the least predicted step time plus its move's cost spread over the steps it lasts."""
    fixed_layouts: bool = False
    """Keep every model-stage's (tp, pp); replan only data parallelism."""
    fixed_micro_batches: bool = False
    """Keep every model-stage's micro-batch (generation: the sequences a unit decodes at once)
    at the first plan's, as a static framework keeps the ones it was launched with: never
    lowered to avoid a predicted memory problem or to run faster, but halved for the
    model-stage whose memory a step ran out of (generation: twice the waves), once that step
    has cost the job its restart from the last checkpoint. Independent of ``fixed_layouts``
    (the seed paper's DP-scaling baseline keeps both)."""
    min_saving: float = 0.01
    """Payback admission's dead band: a move predicted to save less than this fraction of a
    step is not made, however soon it would repay. Layouts whose predicted step times are this
    close are within the cost model's error in ranking them (exp3 of the simulated experiments
    measures that error), so such a move is as likely to be undone by the next replan as to
    pay; 0 turns the band off."""

    calibration_probes: bool = True
    """Time each communication class alone on the job's slots before plans are first weighed
    (and when the pool first spans more nodes), so that calibration knows the classes the
    running plan's steps do not exercise, or cannot tell apart (``runtime/planner/probes.py``)."""
    link_probe_every_s: float = 900.0
    """With ``calibration_probes``: how often (job seconds, between steps) each link type's
    gauge class is timed alone again, to follow the load other traffic puts on the links
    (``probes.LINK_GAUGES``): a few collectives on groups already made (0.5 s a round at 1,024
    simulated GPUs). 0 turns it off: calibration then learns the load from the steps, late,
    and blames it on whatever the window's plans ran most of."""

    def __post_init__(self) -> None:
        for name, value in self.thresholds.items():
            if name not in SIGNALS:
                raise PolicyError(
                    f"policy.thresholds.{name}: unknown signal; valid: {', '.join(SIGNALS)}"
                )
            if not _number(value) or not 0 < value <= 10:
                raise PolicyError(
                    f"policy.thresholds.{name}: must be a number in (0, 10], got {value!r}"
                )
        if not _number(self.gamma) or not 0 < self.gamma <= 100:
            raise PolicyError(f"policy.gamma: must be a number in (0, 100], got {self.gamma!r}")
        if self.approval not in APPROVAL_MODES:
            raise PolicyError(
                f"policy.approval: expected one of {', '.join(APPROVAL_MODES)}, "
                f"got {self.approval!r}"
            )
        for field in ("approval_above_s", "approval_timeout_s"):
            value = getattr(self, field)
            if not _number(value) or value < 0:
                raise PolicyError(f"policy.{field}: must be a number >= 0, got {value!r}")
        if self.approval_timeout_s > MAX_APPROVAL_TIMEOUT_S:
            raise PolicyError(
                f"policy.approval_timeout_s: must be at most {MAX_APPROVAL_TIMEOUT_S} "
                f"(30 days), got {self.approval_timeout_s!r}"
            )
        if not _number(self.link_probe_every_s) or not 0 <= self.link_probe_every_s <= 86_400:
            raise PolicyError(
                f"policy.link_probe_every_s: must be a number of seconds in [0, 86400], "
                f"got {self.link_probe_every_s!r}"
            )
        if not _number(self.min_saving) or not 0 <= self.min_saving < 1:
            raise PolicyError(
                f"policy.min_saving: must be a number in [0, 1), got {self.min_saving!r}"
            )
        if self.admission not in ADMISSIONS:
            raise PolicyError(
                f"policy.admission: expected one of {', '.join(ADMISSIONS)}, got {self.admission!r}"
            )
        if self.memory_runway not in RUNWAYS:
            raise PolicyError(
                f"policy.memory_runway: expected one of {', '.join(RUNWAYS)}, "
                f"got {self.memory_runway!r}"
            )
        for field in ("fixed_layouts", "fixed_micro_batches", "calibration_probes"):
            if not isinstance(getattr(self, field), bool):
                raise PolicyError(
                    f"policy.{field}: must be true or false, got {getattr(self, field)!r}"
                )
        if (
            isinstance(self.lookahead_steps, bool)
            or not isinstance(self.lookahead_steps, int)
            or not 0 <= self.lookahead_steps <= 10_000
        ):
            raise PolicyError(
                f"policy.lookahead_steps: must be an integer in [0, 10000], "
                f"got {self.lookahead_steps!r}"
            )

    def threshold(self, signal: str) -> float:
        return float(self.thresholds.get(signal, DEFAULT_THRESHOLD))

    @classmethod
    def from_json(cls, data: Any) -> JobPolicy:
        if not isinstance(data, Mapping):
            raise PolicyError("policy: must be an object")
        known = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                raise PolicyError(f"policy.{key}: unknown field; valid: {', '.join(sorted(known))}")
        thresholds = data.get("thresholds", {})
        if not isinstance(thresholds, Mapping):
            raise PolicyError("policy.thresholds: must be an object of signal: fraction")
        return cls(**{**data, "thresholds": dict(thresholds)})

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "thresholds": dict(self.thresholds)}


def _number(value: Any) -> bool:
    """A JSON number: any integer (math.isfinite overflows on one past a float's range) or a
    finite float; booleans are not numbers here."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
