"""The four primitives as values: what each does to units and slots, validated before anything moves.

- ``Split``: one unit of a ``tp × pp`` grid becomes ``k`` units of ``tp/k × pp`` (axis ``tp``) or
  ``tp × pp/k`` (axis ``pp``) on the same slots. New unit ``j`` takes the old positions whose index
  along the axis is ``≡ j (mod k)``, so the ``k`` slots that will hold the same new position are the
  ones that together hold its data: they AllGather among themselves.
- ``Merge``: ``k`` replicas (same layout, disjoint slots) become one unit ``k`` times wider along the
  axis; the inverse assignment of Split, so every slot already holds the slice its new position owns
  and only slices locally.
- ``Extend``: a new replica on other slots (they may overlap the source's), filled by a
  rank-aligned Broadcast from a live replica.
- ``Destroy``: release a unit and its slots.
"""

from __future__ import annotations

import dataclasses
import itertools

from runtime.emu.layout import ShardError, UnitLayout

BUCKET_BYTES = 32 * 2**20
"""Bytes per broadcast when received shards are cut up into new ones (a TP Split over gloo): the
receive buffer is one bucket (or one shard, if a shard is larger), not the peer's whole set."""


class TransitionError(ValueError):
    """A primitive the units and slots cannot make; raised before anything moves."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Unit:
    """One replica of a model-stage: a layout and its slots (``slots[p * tp + t]``)."""

    unit_id: str
    model_stage: str
    layout: UnitLayout
    slots: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.slots) != self.layout.num_positions:
            raise TransitionError(
                f"{self.unit_id}: {len(self.slots)} slots for a {self.layout.tp}x{self.layout.pp} unit"
            )
        if len(set(self.slots)) != len(self.slots):
            raise TransitionError(f"{self.unit_id}: a slot appears twice in {self.slots}")

    def position_of(self, slot: int) -> int:
        return self.slots.index(slot)


def _with(layout: UnitLayout, **changes) -> UnitLayout:
    try:
        return dataclasses.replace(layout, **changes)
    except ShardError as exc:
        raise TransitionError(str(exc)) from None


def _positions(tp: int, pp: int):
    return [(p, t) for p in range(pp) for t in range(tp)]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Split:
    unit: Unit
    axis: str
    k: int

    def targets(self) -> list[Unit]:
        """The k new units, named ``<unit>.s<j>``."""
        layout, k = self.unit.layout, self.k
        if self.axis not in ("tp", "pp"):
            raise TransitionError(f"axis: expected 'tp' or 'pp', got {self.axis!r}")
        degree = layout.tp if self.axis == "tp" else layout.pp
        if k < 2 or degree % k:
            raise TransitionError(
                f"k: {self.axis}={degree} of {self.unit.unit_id} cannot split into {k}"
            )
        new = _with(layout, **{self.axis: degree // k})
        units = []
        for j in range(k):
            slots = []
            for p, t in _positions(new.tp, new.pp):
                old_p, old_t = (p, t * k + j) if self.axis == "tp" else (p * k + j, t)
                slots.append(self.unit.slots[old_p * layout.tp + old_t])
            units.append(
                Unit(
                    unit_id=f"{self.unit.unit_id}.s{j}",
                    model_stage=self.unit.model_stage,
                    layout=new,
                    slots=tuple(slots),
                )
            )
        return units

    def peer_groups(self) -> list[tuple[int, ...]]:
        """The slots that AllGather together: one group per new position, k slots each."""
        targets = self.targets()
        return [tuple(u.slots[i] for u in targets) for i in range(targets[0].layout.num_positions)]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Merge:
    units: tuple[Unit, ...]
    axis: str
    unit_id: str

    def target(self) -> Unit:
        units, k = self.units, len(self.units)
        if k < 2:
            raise TransitionError("units: Merge needs at least two replicas")
        if self.axis not in ("tp", "pp"):
            raise TransitionError(f"axis: expected 'tp' or 'pp', got {self.axis!r}")
        first = units[0]
        for other in units[1:]:
            if other.layout != first.layout or other.model_stage != first.model_stage:
                raise TransitionError(f"units: {other.unit_id} is not a replica of {first.unit_id}")
        every = [s for u in units for s in u.slots]
        if len(set(every)) != len(every):
            raise TransitionError("units: replicas to merge share a slot")
        layout = first.layout
        new = _with(layout, **{self.axis: (layout.tp if self.axis == "tp" else layout.pp) * k})
        slots = []
        for p, t in _positions(new.tp, new.pp):
            j, old_p, old_t = (t % k, p, t // k) if self.axis == "tp" else (p % k, p // k, t)
            slots.append(units[j].slots[old_p * layout.tp + old_t])
        return Unit(
            unit_id=self.unit_id, model_stage=first.model_stage, layout=new, slots=tuple(slots)
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Extend:
    source: Unit
    slots: tuple[int, ...]
    unit_id: str

    def target(self) -> Unit:
        if tuple(self.slots) == self.source.slots:
            raise TransitionError(
                f"slots: {list(self.slots)} already hold {self.source.unit_id} in that order"
            )
        return Unit(
            unit_id=self.unit_id,
            model_stage=self.source.model_stage,
            layout=self.source.layout,
            slots=self.slots,
        )

    def broadcast_groups(self) -> list[tuple[int, ...]]:
        """(source slot, new slot) for every position, in position order: the rank-aligned
        broadcasts. The new slots may overlap the source's (a replica shifted along the pool): a
        slot may then send one position and receive another, and a slot that keeps its position
        copies locally (a pair ``(s, s)``)."""
        target = self.target()
        return [(s, d) for s, d in zip(self.source.slots, target.slots, strict=True)]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Destroy:
    unit: Unit


Primitive = Split | Merge | Extend | Destroy


def check_slots(units: list[Unit], pool: range | set[int]) -> None:
    """Every slot of every unit must be in the pool."""
    for unit, slot in itertools.chain.from_iterable(((u, s) for s in u.slots) for u in units):
        if slot not in pool:
            raise TransitionError(f"{unit.unit_id}: slot {slot} is not in the pool")
