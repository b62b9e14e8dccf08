"""Plans as values: for every model-stage its layout, its units and their slots.

A plan is frozen, hashable and round-trips through JSON; the planner produces plans and the
transition compiler diffs them. A unit's slots are listed pipeline-stage-major: slots
``[p * tp, (p + 1) * tp)`` of the tuple form pipeline stage ``p``'s tensor-parallel group.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


class PlanError(ValueError):
    """A plan value is malformed."""


MAX_SLOTS = 1 << 20
"""The most slots a pool may have: far beyond any cluster, small enough for every count that
follows from it (bytes, seconds) to stay a finite float."""
MAX_MICRO_BATCH = 1 << 31


def shown(value: Any) -> str:
    """``value`` as an error message shows it: a huge integer by its size, not its digits."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _whole(value: Any, field: str, *, least: int, most: int) -> None:
    """Refuse ``value`` unless it is an int (not a bool) in ``[least, most]``."""
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise PlanError(
            f"{field}: must be a whole number from {least} to {most}, got {shown(value)}"
        )


def _number(value: Any, field: str) -> None:
    """Refuse ``value`` unless it is an int or float (not a bool, not NaN) that fits a float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PlanError(f"{field}: must be a number, got {shown(value)}")
    try:
        if math.isnan(float(value)):
            raise PlanError(f"{field}: must be a number, got NaN")
    except OverflowError:
        raise PlanError(f"{field}: too large for a number ({shown(value)})") from None


def _as_float(value: Any, field: str) -> float:
    """``value`` as a float, refused (naming ``field``) unless it is a number a float holds."""
    _number(value, field)
    return float(value)


def _named_numbers(pairs: Any, field: str) -> None:
    """Refuse ``pairs`` unless they are (name, number) pairs."""
    for name, value in pairs:
        if not isinstance(name, str):
            raise PlanError(f"{field}: expected names, got {shown(name)}")
        _number(value, f"{field}.{name}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """(dp, tp, pp): data-parallel units, each a tp × pp grid of slots."""

    dp: int
    tp: int
    pp: int

    def __post_init__(self) -> None:
        for field in ("dp", "tp", "pp"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{field}: must be a positive integer, got {shown(value)}")
            if value > MAX_SLOTS:
                raise PlanError(f"{field}: at most {MAX_SLOTS}, got {value}")

    @property
    def num_slots(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        return f"({self.dp},{self.tp},{self.pp})"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelStagePlan:
    """One model-stage's part of a plan, with what the planner predicted for it."""

    name: str
    layout: Layout
    units: tuple[tuple[int, ...], ...]
    predicted_s: float
    breakdown: tuple[tuple[str, float], ...]
    """Seconds per step by operation class, calibrated."""
    memory_per_slot: tuple[tuple[str, float], ...]
    """Bytes per slot by component on the most loaded slot."""
    micro_batch: int = 0
    """Sequences per micro-batch in training and inference (0: the workload's); in generation,
    the most sequences a unit decodes at once (vLLM's ``max_num_seqs``; 0: all of its share of
    the batch), the rest in later waves. Changing it moves no state (the planner lowers it
    before it changes a layout that memory outgrows)."""

    def __post_init__(self) -> None:
        role, at, stage = self.name.partition("@") if isinstance(self.name, str) else ("", "", "")
        if not (role and at and stage):
            raise PlanError(f"name: expected 'role@stage', got {shown(self.name)}")
        _whole(self.micro_batch, f"{self.name}.micro_batch", least=0, most=MAX_MICRO_BATCH)
        _number(self.predicted_s, f"{self.name}.predicted_s")
        _named_numbers(self.breakdown, f"{self.name}.breakdown")
        _named_numbers(self.memory_per_slot, f"{self.name}.memory_per_slot")
        every = [s for unit in self.units for s in unit]
        for slot in every:  # exactly int: not a bool, not a float such as 8.0
            if type(slot) is not int or not 0 <= slot < MAX_SLOTS:
                _whole(slot, f"{self.name}.units", least=0, most=MAX_SLOTS - 1)  # raises
        if len(self.units) != self.layout.dp:
            raise PlanError(f"{self.name}.units: {len(self.units)} units for dp={self.layout.dp}")
        for unit in self.units:
            if len(unit) != self.layout.tp * self.layout.pp or len(set(unit)) != len(unit):
                raise PlanError(
                    f"{self.name}.units: unit {unit} is not {self.layout.tp}×{self.layout.pp} slots"
                )
        if len(set(every)) != len(every):
            raise PlanError(f"{self.name}.units: a slot is used by two units")

    @property
    def slots(self) -> frozenset[int]:
        return frozenset(s for unit in self.units for s in unit)

    @property
    def memory_bytes(self) -> float:
        return sum(v for _, v in self.memory_per_slot)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    """How a stage's model-stages share the slots: ``disjoint`` (concurrently, each on its own
    slots) or ``colocated`` (one after another, each on as many slots as it likes)."""

    stage: str
    mode: str
    predicted_s: float

    def __post_init__(self) -> None:
        if not isinstance(self.stage, str) or not self.stage:
            raise PlanError(f"stages: expected a stage name, got {shown(self.stage)}")
        _number(self.predicted_s, f"{self.stage}.predicted_s")
        if self.mode not in ("disjoint", "colocated"):
            raise PlanError(
                f"{self.stage}.mode: expected 'disjoint' or 'colocated', got {shown(self.mode)}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A whole job's plan on a pool of ``num_slots`` slots of one accelerator."""

    accelerator: str
    num_slots: int
    model_stages: tuple[ModelStagePlan, ...]
    stages: tuple[StagePlan, ...]
    predicted_step_s: float
    models: tuple[tuple[str, str], ...] = ()
    """(role, model name) of the workload the plan was made for; empty when not recorded."""
    job: str = ""
    """The job the plan belongs to; empty when not recorded."""
    training_state: tuple[tuple[str, float], ...] = ()
    """(training role, bytes per slot): the state of the training units (weights, gradients,
    Adam), which stay on their slots through the whole step, that every model-stage's memory
    was checked beside (at least what the plan's training layouts keep); empty: exactly what
    they keep."""

    def __post_init__(self) -> None:
        if not isinstance(self.accelerator, str) or not self.accelerator:
            raise PlanError(f"accelerator: expected a name, got {shown(self.accelerator)}")
        _whole(self.num_slots, "num_slots", least=1, most=MAX_SLOTS)
        _number(self.predicted_step_s, "predicted_step_s")
        for role, model in self.models:
            if not isinstance(role, str) or not isinstance(model, str):
                raise PlanError(
                    f"models: expected role: model name, got {shown(role)}: {shown(model)}"
                )
        names = [ms.name for ms in self.model_stages]
        if len(set(names)) != len(names):
            raise PlanError("model_stages: a model-stage is listed twice")
        for role, nbytes in self.training_state:
            if not isinstance(role, str) or not role:
                raise PlanError(f"training_state: expected role names, got {shown(role)}")
            if (
                isinstance(nbytes, bool)
                or not isinstance(nbytes, int | float)
                or not math.isfinite(nbytes)
                or nbytes < 0
            ):
                raise PlanError(
                    f"training_state.{role}: must be a number of bytes >= 0, got {shown(nbytes)}"
                )
        for ms in self.model_stages:
            outside = [s for s in ms.slots if not 0 <= s < self.num_slots]
            if outside:
                raise PlanError(
                    f"{ms.name}.units: slot {outside[0]} outside the pool of {self.num_slots}"
                )
        for stage in self.stages:
            if stage.mode != "disjoint":
                continue
            seen: dict[int, str] = {}
            for ms in self.model_stages:
                if ms.name.endswith(f"@{stage.stage}"):
                    for slot in ms.slots:
                        if slot in seen:
                            raise PlanError(
                                f"{ms.name}.units: slot {slot} is also used by {seen[slot]} "
                                f"in the disjoint {stage.stage} stage"
                            )
                        seen[slot] = ms.name

    @classmethod
    def of_units(
        cls,
        *,
        accelerator: str,
        num_slots: int,
        layouts: dict[str, tuple[Layout, tuple[tuple[int, ...], ...]]],
        mode: str = "colocated",
    ) -> Plan:
        """A plan written by hand (a person's override, a test, a trace): each model-stage's
        layout and units, every stage in ``mode``, nothing predicted yet."""
        stages = {name.partition("@")[2] for name in layouts}
        return cls(
            accelerator=accelerator,
            num_slots=num_slots,
            model_stages=tuple(
                ModelStagePlan(
                    name=name,
                    layout=layout,
                    units=tuple(tuple(u) for u in units),
                    predicted_s=0.0,
                    breakdown=(),
                    memory_per_slot=(),
                )
                for name, (layout, units) in layouts.items()
            ),
            stages=tuple(
                StagePlan(stage=s, mode=mode, predicted_s=0.0)
                for s in ("generation", "inference", "training")
                if s in stages
            ),
            predicted_step_s=0.0,
        )

    def model_stage(self, name: str) -> ModelStagePlan:
        for ms in self.model_stages:
            if ms.name == name:
                return ms
        raise KeyError(name)

    def layouts(self) -> dict[str, Layout]:
        return {ms.name: ms.layout for ms in self.model_stages}

    def micro_batches(self, default: int = 0) -> dict[str, int]:
        """Each model-stage's micro-batch; ``default`` (the workload's) where a training or
        inference model-stage has none (generation's 0 is all of a unit's sequences at once)."""
        return {
            ms.name: ms.micro_batch or (0 if ms.name.endswith("@generation") else default)
            for ms in self.model_stages
        }

    def places_like(self, other: Plan) -> bool:
        """Whether every model-stage has the same layout on the same slots in both plans (going
        from one to the other moves no state; micro-batches may differ)."""
        return self.layouts() == other.layouts() and all(
            ms.units == other.model_stage(ms.name).units for ms in self.model_stages
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "accelerator": self.accelerator,
            "num_slots": self.num_slots,
            "predicted_step_s": self.predicted_step_s,
            "models": dict(self.models),
            "job": self.job,
            "training_state": dict(self.training_state),
            "stages": [dataclasses.asdict(s) for s in self.stages],
            "model_stages": [
                {
                    "name": ms.name,
                    "layout": dataclasses.asdict(ms.layout),
                    "units": [list(u) for u in ms.units],
                    "predicted_s": ms.predicted_s,
                    "breakdown": dict(ms.breakdown),
                    "memory_per_slot": dict(ms.memory_per_slot),
                    "micro_batch": ms.micro_batch,
                }
                for ms in self.model_stages
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        """The plan ``to_json`` wrote; a malformed part is refused naming where it is
        (``model_stages[2].layout.tp: ...``). Fields a model-stage entry or the plan has beside
        those it reads are ignored (the service refuses them in a plan a person sends)."""
        top = _object(data, "plan")
        try:
            return cls(
                accelerator=_key(top, "accelerator", ""),
                num_slots=_key(top, "num_slots", ""),
                predicted_step_s=_as_float(_key(top, "predicted_step_s", ""), "predicted_step_s"),
                models=tuple(sorted(_object(top.get("models", {}), "models").items())),
                job=_text(top.get("job", ""), "job"),
                training_state=tuple(
                    sorted(_object(top.get("training_state", {}), "training_state").items())
                ),
                stages=tuple(
                    _build(StagePlan, s, f"stages[{i}]")
                    for i, s in enumerate(_array(_key(top, "stages", ""), "stages"))
                ),
                model_stages=tuple(
                    _model_stage_from_json(ms, f"model_stages[{i}]")
                    for i, ms in enumerate(_array(_key(top, "model_stages", ""), "model_stages"))
                ),
            )
        except PlanError:
            raise
        except (TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise PlanError(f"plan: malformed JSON ({exc})") from None


def _object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise PlanError(f"{where}: expected an object, got {shown(value)}")
    return value


def _array(value: Any, where: str) -> list:
    if not isinstance(value, list | tuple):
        raise PlanError(f"{where}: expected a list, got {shown(value)}")
    return list(value)


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise PlanError(f"{where}: expected text, got {shown(value)}")
    return value


def _key(obj: dict, key: str, where: str) -> Any:
    try:
        return obj[key]
    except KeyError:
        raise PlanError(f"{where}{'.' if where else ''}{key}: missing from the plan JSON") from None


def _build(kind: type, fields: Any, where: str) -> Any:
    """``kind(**fields)`` for a dataclass of this module, naming a field it has not."""
    fields = _object(fields, where)
    known = {f.name for f in dataclasses.fields(kind)}
    for name in fields:
        if name not in known:
            raise PlanError(f"{where}.{name}: unknown field")
    for f in dataclasses.fields(kind):
        if f.name not in fields and f.default is dataclasses.MISSING:
            raise PlanError(f"{where}.{f.name}: missing from the plan JSON")
    return kind(**fields)


def _model_stage_from_json(data: Any, where: str) -> ModelStagePlan:
    ms = _object(data, where)
    name = _key(ms, "name", where)
    return ModelStagePlan(
        name=name,
        layout=_build(Layout, _key(ms, "layout", where), f"{where}.layout"),
        units=tuple(
            tuple(_array(u, f"{where}.units[{i}]"))
            for i, u in enumerate(_array(_key(ms, "units", where), f"{where}.units"))
        ),
        predicted_s=_as_float(_key(ms, "predicted_s", where), f"{name}.predicted_s"),
        breakdown=tuple(_object(_key(ms, "breakdown", where), f"{where}.breakdown").items()),
        memory_per_slot=tuple(
            _object(_key(ms, "memory_per_slot", where), f"{where}.memory_per_slot").items()
        ),
        micro_batch=ms.get("micro_batch", 0),
    )
