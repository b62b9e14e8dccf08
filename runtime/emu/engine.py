"""The driver's side of the primitives: validate, run on the slots, verify, then release.

Every primitive is two-phase: the destination units are built while the source is intact, their
logical checksums are compared with the source's, and only then is the source released (so a
failure part-way leaves a usable unit behind). Each returns a ``PrimitiveReport``.

A primitive costs the driver two round trips to its slots: one that moves the state and returns
each slot's contribution to the new units' checksums with the result, and, once the driver has
compared them with the source's, one that releases the source. Released buffers stay in the slots'
arenas for the next primitive to reuse (reported as ``cached_bytes``) until ``empty_cache``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import weakref

from runtime.emu import slot_ops
from runtime.emu.integrity import combine
from runtime.emu.primitives import Destroy, Extend, Merge, Split, TransitionError, Unit, check_slots
from runtime.engine.slots import SlotError, SlotPool


class IntegrityError(RuntimeError):
    """A destination unit's logical state differs from its source's."""


class SourceReleaseError(SlotError):
    """A primitive's units were dropped from the engine but releasing them failed on a slot (one
    that died, say): the destinations are verified and registered, the released units are not
    units any more, and what the failed slot held is for the caller to find out (``lost_slots``)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PrimitiveReport:
    kind: str
    source: tuple[str, ...]
    target: tuple[str, ...]
    bytes_moved: int
    """Bytes received over the network by all slots together."""
    bytes_per_slot: dict[int, int]
    duration_s: float
    """All of it: groups, movement, verification and release."""
    group_setup_s: float
    groups_created: int
    peak_bytes: dict[int, int]
    """Per slot: the most bytes its units and in-flight buffers held at once during the primitive
    (each storage once; buffers cached in the slot's arena are not counted: the arena only ever
    holds what the slot held before, see ``slot_ops._Arena``)."""
    freed_bytes: int = 0
    move_s: float = 0.0
    """Group setup and data movement, before verification."""
    verify_s: float = 0.0
    """Computing (on the slots, the slowest slot's time) and comparing the destinations' logical
    checksums."""
    cached_bytes: int = 0
    """Of ``freed_bytes``, what the slots keep in their arenas to reuse (``UnitEngine.empty_cache``
    gives it back)."""
    reused_bytes: int = 0
    """Buffers the slots took from their arenas instead of fresh memory, all slots together."""


_POOL_GROUPS: weakref.WeakKeyDictionary[SlotPool, set[tuple[int, ...]]] = (
    weakref.WeakKeyDictionary()
)
"""Groups known to exist on each pool's slots, whichever engine made them."""
_POOL_GROUPS_LOCK = threading.Lock()


class UnitEngine:
    """Units of model-stages on a pool of slots, and the four primitives over them."""

    def __init__(self, pool: SlotPool):
        self.pool = pool
        self.units: dict[str, Unit] = {}
        self.verified: dict[str, int] = {}
        """Each unit's logical checksum as last verified: a source is not re-hashed."""
        self.lost_slots: set[int] = set()
        """Slots whose state is gone (a revoked device): releases skip them."""
        self._groups: set[tuple[int, ...]] = set()
        self._lock = threading.Lock()  # primitives on disjoint slots may run from several threads

    def prepare_groups(self, groups) -> dict:
        """Create the process groups not made yet. Collective over the whole pool (creating a
        torch.distributed group is), so a transition makes all of its groups before it starts
        primitives concurrently; returns ``{"created", "seconds"}``."""
        with _POOL_GROUPS_LOCK:
            self._groups |= _POOL_GROUPS.get(self.pool, set())
        needed = sorted({tuple(sorted(set(g))) for g in groups if len(set(g)) > 1} - self._groups)
        if not needed:
            return {"created": 0, "seconds": 0.0}
        setup = self.pool.run(slot_ops.ensure_groups, groups=needed)
        self._groups.update(needed)
        with _POOL_GROUPS_LOCK:
            _POOL_GROUPS.setdefault(self.pool, set()).update(needed)
        return {
            "created": max(s["created"] for s in setup),
            "seconds": max(s["seconds"] for s in setup),
        }

    # --- units ------------------------------------------------------------------------------------

    def create(self, unit: Unit, *, seed: int = 0) -> Unit:
        """Materialise a unit with deterministic state (a stand-in for loading a checkpoint)."""
        self._check_new([unit])
        self.pool.run(slot_ops.fill_unit, on=unit.slots, unit=unit, seed=seed)
        with self._lock:
            self.units[unit.unit_id] = unit
        self.verified[unit.unit_id] = self.checksum(unit)
        return unit

    def checksum(self, unit: Unit) -> int:
        """The unit's logical checksum, computed now on its slots."""
        return self._checksums([self._known(unit)])[0]

    def _checksums(self, units: list[Unit]) -> list[int]:
        slots = sorted({s for u in units for s in u.slots})
        per_slot = self.pool.run(slot_ops.units_checksums, on=slots, units=units)
        return [combine(*(slot[i] for slot in per_slot)) for i in range(len(units))]

    def _verified_checksum(self, unit: Unit) -> int:
        if unit.unit_id not in self.verified:
            self.verified[unit.unit_id] = self.checksum(unit)
        return self.verified[unit.unit_id]

    def empty_cache(self, slots=None) -> int:
        """Free the buffers the slots' arenas keep (all slots, or ``slots``); returns the bytes.
        Call it before handing slots to work that allocates outside the units. Like any call on
        a slot it waits for the primitive running there, if any."""
        on = sorted(set(range(self.pool.num_slots) if slots is None else slots) - self.lost_slots)
        return sum(r["freed_bytes"] for r in self.pool.run(slot_ops.empty_cache, on=on))

    def read(self, unit: Unit) -> dict:
        """The unit's shards gathered to the driver: {key: [(ShardSpec, tensor), ...]}."""
        out: dict = {}
        for held in self.pool.run(slot_ops.read_unit, on=unit.slots, unit=self._known(unit)):
            for key, pair in held.items():
                out.setdefault(key, []).append(pair)
        return out

    # --- primitives -------------------------------------------------------------------------------

    def split(self, spec: Split) -> tuple[list[Unit], PrimitiveReport]:
        self._known(spec.unit)
        targets = spec.targets()
        self._check_new(targets)
        self._check_split_covers(spec, targets)
        report = self._run(
            "split",
            [spec.unit],
            targets,
            spec.peer_groups(),
            slot_ops.split,
            spec=spec,
            on=spec.unit.slots,
        )
        return targets, report

    def merge(self, spec: Merge) -> tuple[Unit, PrimitiveReport]:
        for unit in spec.units:
            self._known(unit)
        target = spec.target()
        self._check_new([target])
        self._check_local_merge(spec, target)
        report = self._run(
            "merge", list(spec.units), [target], [], slot_ops.merge, spec=spec, on=target.slots
        )
        return target, report

    def extend(self, spec: Extend) -> tuple[Unit, PrimitiveReport]:
        self._known(spec.source)
        target = spec.target()
        self._check_new([target])
        report = self._run(
            "extend",
            [spec.source],
            [target],
            spec.broadcast_groups(),
            slot_ops.extend,
            spec=spec,
            on=sorted(set(spec.source.slots) | set(target.slots)),
            release_source=False,
        )
        return target, report

    def destroy(self, spec: Destroy) -> PrimitiveReport:
        unit = self._known(spec.unit)
        started = time.perf_counter()
        with self._lock:  # gone from the engine's view first, even if its release fails
            del self.units[unit.unit_id]
            self.verified.pop(unit.unit_id, None)
        results = self._release([unit], kind="destroy")
        leaked = sum(r["still_referenced"] for r in results)
        if leaked:
            raise RuntimeError(f"{unit.unit_id}: {leaked} tensors outlived their release")
        return PrimitiveReport(
            kind="destroy",
            source=(unit.unit_id,),
            target=(),
            bytes_moved=0,
            bytes_per_slot={},
            duration_s=time.perf_counter() - started,
            group_setup_s=0.0,
            groups_created=0,
            peak_bytes={},
            freed_bytes=sum(r["freed_bytes"] for r in results),
            cached_bytes=sum(r.get("cached_bytes", 0) for r in results),
        )

    # --- helpers ----------------------------------------------------------------------------------

    def _run(
        self, kind, sources, targets, groups, fn, *, spec, on, release_source=True
    ) -> PrimitiveReport:
        started = time.perf_counter()
        setup = self.prepare_groups(groups)
        on = list(on)
        try:
            # One round trip moves the state and brings back each slot's checksum contributions.
            results = self.pool.run(fn, on=on, spec=spec, verify=True)
        except BaseException:
            # Part-way failure: drop whatever destination state was built; the source is intact.
            self._release_quietly(targets)
            raise
        returned = time.perf_counter()
        checksum_s = max(r.get("checksum_s", 0.0) for r in results)
        expected = self._verified_checksum(sources[0])
        contributions = [r.get("checksums") or [0] * len(targets) for r in results]
        got = [combine(*(c[i] for c in contributions)) for i in range(len(targets))]
        for target, value in zip(targets, got, strict=True):
            if value != expected:
                self._release_quietly(targets)
                raise IntegrityError(
                    f"{kind}: {target.unit_id} checksum {value:#x} != source {expected:#x}"
                )
        with self._lock:
            for target in targets:
                self.units[target.unit_id] = target
                self.verified[target.unit_id] = expected
            if release_source:
                # The targets are verified: the sources stop being units before their release
                # starts, so a release that fails part-way (some slots freed them, one died)
                # never leaves a partly released source listed as intact.
                for unit in sources:
                    self.units.pop(unit.unit_id, None)
                    self.verified.pop(unit.unit_id, None)
        verified = time.perf_counter()
        freed = cached = 0
        if release_source:
            released = self._release(sources, kind=kind)
            freed = sum(r["freed_bytes"] for r in released)
            cached = sum(r.get("cached_bytes", 0) for r in released)
        return PrimitiveReport(
            kind=kind,
            source=tuple(u.unit_id for u in sources),
            target=tuple(t.unit_id for t in targets),
            bytes_moved=sum(r["bytes_received"] for r in results),
            bytes_per_slot={
                slot: r["bytes_received"]
                for slot, r in zip(on, results, strict=True)
                if r["bytes_received"]
            },
            duration_s=time.perf_counter() - started,
            move_s=returned - started - checksum_s,
            verify_s=checksum_s + verified - returned,
            group_setup_s=setup["seconds"],
            groups_created=setup["created"],
            peak_bytes={
                slot: r["peak_bytes"]
                for slot, r in zip(on, results, strict=True)
                if r.get("peak_bytes")
            },
            freed_bytes=freed,
            cached_bytes=cached,
            reused_bytes=sum(r.get("reused_bytes", 0) for r in results),
        )

    def _release(self, units: list[Unit], *, kind: str) -> list[dict]:
        """Release units already unregistered on their slots that still hold state; a slot that
        fails meanwhile is reported (``SourceReleaseError``) with the engine's view already right:
        the units are gone, whatever the slots that answered freed."""
        slots = sorted({s for u in units for s in u.slots} - self.lost_slots)
        try:
            return self.pool.run(slot_ops.release, on=slots, unit_ids=[u.unit_id for u in units])
        except SlotError as exc:
            ids = ", ".join(u.unit_id for u in units)
            raise SourceReleaseError(
                f"{kind}: releasing {ids} failed on a slot (no longer units of this engine): {exc}"
            ) from exc

    def _release_quietly(self, units: list[Unit]) -> None:
        """Drop half-built destination state on the slots that still answer."""
        slots = sorted({s for u in units for s in u.slots} - self.lost_slots)
        # A dead slot's state went with it; the original error is the one to report.
        with contextlib.suppress(SlotError):
            self.pool.run(slot_ops.release, on=slots, unit_ids=[u.unit_id for u in units])

    def _known(self, unit: Unit) -> Unit:
        if self.units.get(unit.unit_id) != unit:
            raise TransitionError(f"unit: {unit.unit_id} does not exist on this engine")
        return unit

    def _check_new(self, units: list[Unit]) -> None:
        check_slots(units, range(self.pool.num_slots))
        for unit in units:
            if unit.unit_id in self.units:
                raise TransitionError(f"unit: {unit.unit_id} already exists")

    @staticmethod
    def _check_split_covers(spec: Split, targets: list[Unit]) -> None:
        """Every slot's peers must hold all it will need (uneven splits may not): check first."""
        from runtime.emu.layout import ShardError
        from runtime.emu.reshard import plan_copies

        source = spec.unit
        groups = {slot: group for group in spec.peer_groups() for slot in group}
        for target in targets:
            for slot in target.slots:
                held = {m: source.layout.shards(source.position_of(m)) for m in groups[slot]}
                try:
                    plan_copies(held, {slot: target.layout.shards(target.position_of(slot))})
                except ShardError as exc:
                    raise TransitionError(f"split: {exc}; the sizes do not split evenly") from None

    @staticmethod
    def _check_local_merge(spec: Merge, target: Unit) -> None:
        """Merge moves nothing: every slot must already hold what its new position owns."""
        from runtime.emu.reshard import plan_copies

        for slot in target.slots:
            source = next(u for u in spec.units if slot in u.slots)
            try:
                copies = plan_copies(
                    {slot: source.layout.shards(source.position_of(slot))},
                    {slot: target.layout.shards(target.position_of(slot))},
                )
            except ValueError as exc:
                raise TransitionError(f"merge: {exc}") from None
            if any(not c.local for c in copies):
                raise TransitionError(f"merge: slot {slot} would need data from another slot")
