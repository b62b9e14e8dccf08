"""The primitives on real tensors across processes: eight CPU slots (Ray actors standing in for
GPUs, which this machine lacks) joined by gloo. After every primitive the logical state of every
unit equals the reference bit for bit."""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.emu import checkpoint, slot_ops
from runtime.emu.engine import IntegrityError, UnitEngine
from runtime.emu.layout import UnitLayout
from runtime.emu.primitives import Destroy, Extend, Merge, Split, TransitionError, Unit
from runtime.emu.slot_ops import reference_values
from runtime.engine.ray_cluster import ray_connection
from runtime.engine.slots import SlotPool
from runtime.planner.catalog import default_catalog

pytestmark = pytest.mark.ray

MODEL = default_catalog().model("tiny-llama")
NUM_SLOTS = 8
SEED = 11


@pytest.fixture(scope="module")
def engine():
    with ray_connection(None, num_cpus=NUM_SLOTS):
        pool = SlotPool.create(NUM_SLOTS, call_timeout_s=120)
        try:
            yield UnitEngine(pool)
        finally:
            pool.close()


@pytest.fixture
def fresh(engine):
    for unit in list(engine.units.values()):
        engine.destroy(Destroy(unit=unit))
    engine.empty_cache()
    return engine


def _reference(layout: UnitLayout) -> dict[str, torch.Tensor]:
    whole = UnitLayout(model=layout.model, tp=1, pp=1, training=layout.training)
    return {s.key: reference_values(s, SEED) for s in whole.shards(0)}


def _assert_bit_exact(engine: UnitEngine, unit: Unit) -> None:
    reference = _reference(unit.layout)
    held = engine.read(unit)
    assert set(held) == set(reference)
    for key, pieces in held.items():
        rebuilt = torch.empty_like(reference[key])
        covered = torch.zeros(reference[key].shape, dtype=torch.bool)
        for spec, data in pieces:
            region = tuple(slice(a, b) for a, b in spec.region())
            if spec.replica_id == 0:
                rebuilt[region] = data
                covered[region] = True
            else:  # a replicated copy must equal the canonical one too
                assert torch.equal(
                    data.view(torch.int16), reference[key][region].view(torch.int16)
                ) or (
                    data.dtype == torch.float32
                    and torch.equal(
                        data.view(torch.int32), reference[key][region].view(torch.int32)
                    )
                ), key
        assert bool(covered.all()), key
        bits = torch.int16 if rebuilt.element_size() == 2 else torch.int32
        assert torch.equal(rebuilt.view(bits), reference[key].view(bits)), key


def _new(engine, tp, pp, slots, uid, training=True):
    layout = UnitLayout(model=MODEL, tp=tp, pp=pp, training=training)
    return engine.create(
        Unit(unit_id=uid, model_stage="actor@training", layout=layout, slots=tuple(slots)),
        seed=SEED,
    )


def test_each_primitive_moves_what_it_must_and_keeps_state_bit_exact(fresh):
    engine = fresh
    unit = _new(engine, 2, 2, range(4), "a")
    state_bytes = sum(
        p[1].numel() * p[1].element_size() for ps in engine.read(unit).values() for p in ps
    )
    before = engine.checksum(unit)

    parts, report = engine.split(Split(unit=unit, axis="tp", k=2))
    assert (
        report.bytes_moved == state_bytes
    )  # each slot receives its peer's half: the whole state once
    assert report.groups_created == 2 and report.freed_bytes == state_bytes
    for part in parts:
        _assert_bit_exact(engine, part)
        assert engine.checksum(part) == before

    merged, report = engine.merge(Merge(units=tuple(parts), axis="tp", unit_id="m"))
    assert report.bytes_moved == 0 and merged.slots == (0, 1, 2, 3)
    _assert_bit_exact(engine, merged)

    copy, report = engine.extend(Extend(source=merged, slots=(4, 5, 6, 7), unit_id="e"))
    assert report.bytes_moved == state_bytes
    _assert_bit_exact(engine, copy)

    report = engine.destroy(Destroy(unit=copy))
    assert report.freed_bytes == state_bytes
    assert set(engine.units) == {"m"}


def test_extend_onto_slots_that_overlap_its_source(fresh):
    """A replica shifted along the pool (and one that keeps a position in place): slots that send
    one position and receive another must not deadlock, and the copy is bit-exact."""
    engine = fresh
    unit = _new(engine, 2, 2, range(4), "o")
    shifted, report = engine.extend(Extend(source=unit, slots=(2, 3, 4, 5), unit_id="sh"))
    _assert_bit_exact(engine, shifted)
    assert set(report.bytes_per_slot) == {2, 3, 4, 5}
    swapped, report = engine.extend(Extend(source=unit, slots=(1, 0, 2, 6), unit_id="sw"))
    _assert_bit_exact(engine, swapped)
    # position 2 stays on slot 2: a local copy, not counted as received
    assert set(report.bytes_per_slot) == {0, 1, 6}
    assert engine.checksum(swapped) == engine.checksum(unit)


def test_groups_are_created_once_and_reused(fresh):
    engine = fresh
    engine.split(Split(unit=_new(engine, 2, 1, (0, 1), "x"), axis="tp", k=2))
    _, second = engine.split(Split(unit=_new(engine, 2, 1, (0, 1), "y"), axis="tp", k=2))
    # No group is missing, so no round trip to the slots is made at all (not merely a fast one).
    assert second.groups_created == 0 and second.group_setup_s == 0.0
    # Another engine on the same pool knows the groups exist without asking the slots.
    assert UnitEngine(engine.pool).prepare_groups([(0, 1)]) == {"created": 0, "seconds": 0.0}


def test_bad_requests_are_refused_before_anything_moves(fresh):
    engine = fresh
    unit = _new(engine, 2, 1, (0, 1), "z")
    before = engine.checksum(unit)
    ghost = Unit(unit_id="ghost", model_stage="actor@training", layout=unit.layout, slots=(2, 3))
    with pytest.raises(TransitionError, match="unit: ghost does not exist"):
        engine.split(Split(unit=ghost, axis="tp", k=2))
    with pytest.raises(TransitionError, match="far: slot 8 is not in the pool"):
        engine.extend(Extend(source=unit, slots=(8, 9), unit_id="far"))
    with pytest.raises(TransitionError, match="unit: z already exists"):
        engine.create(unit)
    with pytest.raises(TransitionError, match="cannot split into 4"):
        engine.split(Split(unit=unit, axis="tp", k=4))
    assert engine.checksum(unit) == before and set(engine.units) == {"z"}


@st.composite
def walks(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([p for p in (1, 2, 4, 8) if tp * p <= NUM_SLOTS]))
    return tp, pp, draw(st.lists(st.integers(0, 10_000), min_size=3, max_size=5))


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(walk=walks())
def test_random_walks_of_primitives_keep_every_unit_bit_exact(engine, walk, tmp_path_factory):
    """Random sequences of Split, Merge, Extend and Destroy over random layouts on up to 8 slots;
    every resulting unit equals, bit for bit, what DCP's resharded load gives for its layout."""
    for unit in list(engine.units.values()):
        engine.destroy(Destroy(unit=unit))
    tp, pp, choices = walk
    origin = _new(engine, tp, pp, range(tp * pp), "r")
    reference = engine.checksum(origin)
    saved = str(tmp_path_factory.mktemp("dcp"))
    engine.pool.run(checkpoint.ensure_unit_groups, units=[origin])
    engine.pool.run(checkpoint.save_unit, unit=origin, path=saved)
    for step, choice in enumerate(choices):
        moves = _applicable(engine, step)
        move = moves[choice % len(moves)]
        move()
        for unit in engine.units.values():
            assert engine.checksum(unit) == reference
        _assert_arenas_bounded(engine)
    for unit in list(engine.units.values()):
        _assert_bit_exact(engine, unit)
        shadow = dataclasses.replace(unit, unit_id=f"dcp-{unit.unit_id}")
        engine.pool.run(checkpoint.ensure_unit_groups, units=[shadow])
        engine.pool.run(checkpoint.load_unit, unit=shadow, path=saved)
        engine.units[shadow.unit_id] = shadow
        ours, theirs = engine.read(unit), engine.read(shadow)
        for key, pieces in ours.items():
            expected = {p[0]: p[1] for p in theirs[key]}
            for spec, data in pieces:
                assert torch.equal(data.view(torch.uint8), expected[spec].view(torch.uint8)), key
        engine.destroy(Destroy(unit=shadow))


def _applicable(engine: UnitEngine, step: int):
    units = list(engine.units.values())
    used = {s for u in units for s in u.slots}
    free = [s for s in range(NUM_SLOTS) if s not in used]
    moves = []
    for unit in units:
        for axis, degree in (("tp", unit.layout.tp), ("pp", unit.layout.pp)):
            for k in (2, 4):
                if degree % k == 0:
                    moves.append(
                        lambda u=unit, a=axis, k=k: engine.split(Split(unit=u, axis=a, k=k))
                    )
        if len(free) >= len(unit.slots):
            slots = tuple(free[: len(unit.slots)])
            moves.append(
                lambda u=unit, s=slots: engine.extend(Extend(source=u, slots=s, unit_id=f"e{step}"))
            )
        if len(units) > 1:
            moves.append(lambda u=unit: engine.destroy(Destroy(unit=u)))
    for a, b in (
        (a, b) for a in units for b in units if a.unit_id < b.unit_id and a.layout == b.layout
    ):
        for axis in ("tp", "pp"):
            try:
                Merge(units=(a, b), axis=axis, unit_id=f"m{step}").target()
            except TransitionError:
                continue
            moves.append(
                lambda a=a, b=b, axis=axis: engine.merge(
                    Merge(units=(a, b), axis=axis, unit_id=f"m{step}")
                )
            )
    return moves or [lambda: None]


def test_dcp_load_follows_tensor_rank_order_not_slot_order(fresh, tmp_path):
    """A merged unit's slots are not in ascending order; its DTensor mesh must follow its positions."""
    engine = fresh
    r0, r1 = _new(engine, 2, 1, (0, 1), "r0"), _new(engine, 2, 1, (2, 3), "r1")
    merged, _ = engine.merge(Merge(units=(r0, r1), axis="tp", unit_id="m"))
    assert merged.slots == (0, 2, 1, 3)
    engine.pool.run(checkpoint.ensure_unit_groups, units=[merged])
    engine.pool.run(checkpoint.save_unit, unit=merged, path=str(tmp_path))
    shadow = dataclasses.replace(merged, unit_id="dcp-m")
    engine.pool.run(checkpoint.load_unit, unit=shadow, path=str(tmp_path))
    engine.units["dcp-m"] = shadow
    assert engine.checksum(shadow) == engine.checksum(merged)
    _assert_bit_exact(engine, shadow)


def _assert_arenas_bounded(engine: UnitEngine) -> None:
    """No slot holds more, units and arena together, than its units and buffers in flight ever
    held at once."""
    for stats in engine.pool.run(slot_ops.memory_stats):
        assert stats["state_bytes"] + stats["arena_bytes"] <= stats["high_water"], stats
        assert stats["arena_buffers"] <= slot_ops.ARENA_MAX_BUFFERS


def _slot_bytes(unit: Unit, slot: int) -> int:
    return slot_ops._nbytes(unit.layout.shards(unit.position_of(slot)))


def test_released_buffers_are_cached_reused_and_given_back(fresh):
    engine = fresh
    unit = _new(engine, 2, 1, (0, 1), "a")
    copy, report = engine.extend(Extend(source=unit, slots=(2, 3), unit_id="e"))
    assert report.reused_bytes == 0  # the arenas were empty: fresh memory
    received = report.bytes_per_slot
    assert received == {2: _slot_bytes(copy, 2), 3: _slot_bytes(copy, 3)}
    assert report.peak_bytes[2] == received[2]  # the receive buffer is the new unit's storage

    report = engine.destroy(Destroy(unit=copy))
    assert report.freed_bytes == sum(received.values()) == report.cached_bytes
    stats = engine.pool.run(slot_ops.memory_stats, on=[2, 3])
    assert [s["arena_bytes"] for s in stats] == [received[2], received[3]]
    assert all(s["state_bytes"] == 0 for s in stats)
    _assert_arenas_bounded(engine)

    again, report = engine.extend(Extend(source=unit, slots=(2, 3), unit_id="e2"))
    assert report.reused_bytes == report.bytes_moved == sum(received.values())
    _assert_bit_exact(engine, again)
    assert [s["arena_bytes"] for s in engine.pool.run(slot_ops.memory_stats, on=[2, 3])] == [0, 0]

    report = engine.destroy(Destroy(unit=again))
    assert engine.empty_cache() == report.cached_bytes == report.freed_bytes
    assert all(s["arena_bytes"] == 0 for s in engine.pool.run(slot_ops.memory_stats))


def test_the_arena_gives_way_when_fresh_memory_is_needed(fresh):
    """A request the arena cannot serve frees cached buffers first: the slot never holds more
    than it held before."""
    engine = fresh
    big = _new(engine, 1, 1, (4,), "big")
    engine.destroy(Destroy(unit=big))
    (before,) = engine.pool.run(slot_ops.memory_stats, on=[4])
    assert before["arena_bytes"] == _slot_bytes(big, 4) == before["high_water"]
    small = _new(engine, 2, 1, (4, 5), "small", training=False)  # no cached buffer fits
    (after,) = engine.pool.run(slot_ops.memory_stats, on=[4])
    assert after["state_bytes"] == _slot_bytes(small, 4)
    assert after["arena_bytes"] == 0 and after["high_water"] == before["high_water"]


def test_release_never_caches_storage_something_else_still_holds(fresh):
    engine = fresh
    unit = _new(engine, 2, 1, (0, 1), "p")

    def pin(ctx):  # a view of slot 0's shard buffer that outlives the unit
        state = ctx.state["units"]["p"]
        ctx.state["pinned"] = next(iter(state.values()))[:1]
        return True

    def unpin(ctx):
        return ctx.state.pop("pinned", None) is not None

    engine.pool.run(pin, on=[0])
    try:
        report = engine.destroy(Destroy(unit=unit))
        stats = engine.pool.run(slot_ops.memory_stats, on=[0, 1])
        assert report.freed_bytes == _slot_bytes(unit, 0) + _slot_bytes(unit, 1)
        assert report.cached_bytes == _slot_bytes(unit, 1)
        assert [s["arena_bytes"] for s in stats] == [0, _slot_bytes(unit, 1)]
    finally:
        assert engine.pool.run(unpin, on=[0]) == [True]


def test_tensor_split_cuts_peers_shards_bucket_by_bucket(fresh, monkeypatch):
    """With small buckets a TP Split never holds a peer's whole shard set: per slot the peak is the
    old shards, the new ones and one bucket."""
    engine = fresh
    unit = _new(engine, 2, 2, range(4), "t")

    def set_bucket(ctx, *, size):
        previous, slot_ops.BUCKET_BYTES = slot_ops.BUCKET_BYTES, size
        return previous

    bucket = 256 * 1024
    monkeypatch.setattr(slot_ops, "BUCKET_BYTES", bucket)
    previous = engine.pool.run(set_bucket, size=bucket)
    try:
        spec = Split(unit=unit, axis="tp", k=2)
        parts, report = engine.split(spec)
    finally:
        engine.pool.run(set_bucket, size=previous[0])
    for part in parts:
        _assert_bit_exact(engine, part)
    groups = {s: g for g in spec.peer_groups() for s in g}
    for slot in range(4):
        (peer,) = (m for m in groups[slot] if m != slot)
        shards = unit.layout.shards(unit.position_of(peer))
        largest = max(slot_ops._nbytes(b) for b in slot_ops._buckets(shards))
        new = next(_slot_bytes(p, slot) for p in parts if slot in p.slots)
        old, received = _slot_bytes(unit, slot), report.bytes_per_slot[slot]
        assert received == slot_ops._nbytes(shards) > largest
        assert report.peak_bytes[slot] <= old + new + largest < old + new + received


def test_pipeline_split_keeps_the_received_buffers_as_they_are(fresh, monkeypatch):
    """A PP Split copies nothing: each slot keeps its old buffer and the one it received as the new
    unit's storage. Units that live in several buffers then move as several runs, or packed when
    there are too many."""
    engine = fresh
    unit = _new(engine, 1, 4, range(4), "pp")
    parts, report = engine.split(Split(unit=unit, axis="pp", k=2))
    assert report.freed_bytes == 0  # the old buffers live on in the new units
    for slot in range(4):
        old, received = _slot_bytes(unit, slot), report.bytes_per_slot[slot]
        new = next(_slot_bytes(p, slot) for p in parts if slot in p.slots)
        assert report.peak_bytes[slot] == old + received == new

    def buffers_of(ctx, *, unit_id):
        return len({t.untyped_storage().data_ptr() for t in ctx.state["units"][unit_id].values()})

    first = parts[0]
    assert engine.pool.run(buffers_of, on=first.slots, unit_id=first.unit_id) == [2, 2]
    for part in parts:
        _assert_bit_exact(engine, part)

    # Several runs per position: an Extend and a second Split send them without packing ...
    copy, _ = engine.extend(Extend(source=first, slots=(4, 5), unit_id="c"))
    _assert_bit_exact(engine, copy)
    halves, _ = engine.split(Split(unit=copy, axis="pp", k=2))
    for half in halves:
        _assert_bit_exact(engine, half)

    # ... and with more runs than a header describes, the sender packs them first.
    def set_runs(ctx, *, runs):
        previous, slot_ops.MAX_RUNS = slot_ops.MAX_RUNS, runs
        return previous

    previous = engine.pool.run(set_runs, runs=1)
    try:
        packed, _ = engine.extend(Extend(source=parts[1], slots=(6, 7), unit_id="k"))
    finally:
        engine.pool.run(set_runs, runs=previous[0])
    _assert_bit_exact(engine, packed)
    _assert_arenas_bounded(engine)


def test_a_destination_that_does_not_match_its_source_is_dropped(fresh):
    """The checksums come back with the move; a mismatch releases the destination and leaves the
    source registered."""
    engine = fresh
    unit = _new(engine, 2, 1, (0, 1), "c")

    def flip(ctx):
        first = next(iter(ctx.state["units"]["c"].values()))
        first.view(-1).view(torch.uint8)[0] ^= 1
        return True

    engine.pool.run(flip, on=[1])  # after the source's checksum was verified
    with pytest.raises(IntegrityError, match="extend: bad checksum"):
        engine.extend(Extend(source=unit, slots=(2, 3), unit_id="bad"))
    assert set(engine.units) == {"c"}
    assert [s["state_bytes"] for s in engine.pool.run(slot_ops.memory_stats, on=[2, 3])] == [0, 0]
    engine.pool.run(flip, on=[1])
    assert engine.checksum(unit) == engine.verified["c"]
