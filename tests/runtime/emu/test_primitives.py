"""Primitive specs, reshard planning and the logical checksum: pure, no processes."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from runtime.emu.integrity import combine, shard_checksum
from runtime.emu.layout import ShardError, ShardSpec, UnitLayout
from runtime.emu.primitives import Extend, Merge, Split, TransitionError, Unit, check_slots
from runtime.emu.reshard import plan_copies
from runtime.emu.slot_ops import reference_values
from runtime.planner.catalog import default_catalog

MODEL = default_catalog().model("tiny-llama")  # 8 heads, 4 KV heads, 8 layers


def _unit(tp, pp, slots, uid="u", training=False):
    return Unit(
        unit_id=uid,
        model_stage="actor@training",
        layout=UnitLayout(model=MODEL, tp=tp, pp=pp, training=training),
        slots=tuple(slots),
    )


def _full_state(layout, seed=0):
    whole = UnitLayout(
        model=layout.model,
        tp=1,
        pp=1,
        training=layout.training,
        scalar_head=layout.scalar_head,
        dtype=layout.dtype,
    )
    return {s.key: reference_values(s, seed) for s in whole.shards(0)}


def _checksum(layout, full):
    total = 0
    for _, shard in layout.all_shards():
        region = tuple(slice(a, b) for a, b in shard.region())
        total = combine(total, shard_checksum(shard, full[shard.key][region]))
    return total


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (4, 2), (2, 4), (1, 8)])
def test_logical_checksum_is_layout_independent_and_sees_one_bit(tp, pp):
    full = _full_state(UnitLayout(model=MODEL, tp=1, pp=1, training=True))
    base = _checksum(UnitLayout(model=MODEL, tp=1, pp=1, training=True), full)
    assert _checksum(UnitLayout(model=MODEL, tp=tp, pp=pp, training=True), full) == base
    key = "model.layers.5.mlp.up_proj.weight::exp_avg"
    full[key].view(-1).view(torch.int32)[17] ^= 1  # one bit of one fp32 moment
    assert _checksum(UnitLayout(model=MODEL, tp=tp, pp=pp, training=True), full) != base


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (4, 2)])
def test_the_checksum_sees_tensors_trade_contents_and_every_copy_of_a_replicated_one(tp, pp):
    """Found by review: the sum once depended only on each element's index and bits, so two
    tensors of one shape could trade contents (Adam's two moments, one layer's weights for the
    next one's) unseen, and copies of a replicated tensor past the first were not summed at all."""
    layout = UnitLayout(model=MODEL, tp=tp, pp=pp, training=True)
    full = _full_state(UnitLayout(model=MODEL, tp=1, pp=1, training=True))
    base = _checksum(layout, full)
    for a, b in [
        (
            "model.layers.0.mlp.up_proj.weight::exp_avg",
            "model.layers.0.mlp.up_proj.weight::exp_avg_sq",
        ),
        ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"),
    ]:
        traded = dict(full, **{a: full[b], b: full[a]})
        assert _checksum(layout, traded) != base, (a, b)
    if tp > 1:  # one copy of the final norm, on tensor rank 1, loses one bit
        total = 0
        for _, shard in layout.all_shards():
            data = full[shard.key][tuple(slice(x, y) for x, y in shard.region())].clone()
            if shard.key == "model.norm.weight" and shard.replica_id == 1:
                data.view(-1).view(torch.int32)[0] ^= 1 << 30
            total = combine(total, shard_checksum(shard, data))
        assert total != base


def test_split_assigns_position_wise_peers_and_merge_inverts_it():
    unit = _unit(4, 2, range(8))
    parts = Split(unit=unit, axis="tp", k=2).targets()
    assert [p.slots for p in parts] == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert Split(unit=unit, axis="tp", k=2).peer_groups() == [(0, 1), (2, 3), (4, 5), (6, 7)]
    merged = Merge(units=tuple(parts), axis="tp", unit_id="m").target()
    assert merged.slots == unit.slots and merged.layout == unit.layout
    stages = Split(unit=unit, axis="pp", k=2).targets()
    assert [p.slots for p in stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert Merge(units=tuple(stages), axis="pp", unit_id="m").target().slots == unit.slots


@given(
    tp=st.sampled_from([1, 2, 4]),
    pp=st.sampled_from([1, 2, 4, 8]),
    axis=st.sampled_from(["tp", "pp"]),
    k=st.sampled_from([2, 4]),
)
def test_every_split_plan_covers_its_targets_from_its_peers(tp, pp, axis, k):
    unit = _unit(tp, pp, range(tp * pp))
    degree = tp if axis == "tp" else pp
    if degree % k:
        with pytest.raises(TransitionError):
            Split(unit=unit, axis=axis, k=k).targets()
        return
    spec = Split(unit=unit, axis=axis, k=k)
    groups = {s: g for g in spec.peer_groups() for s in g}
    for target in spec.targets():
        for slot in target.slots:
            sources = {m: unit.layout.shards(unit.position_of(m)) for m in groups[slot]}
            copies = plan_copies(sources, {slot: target.layout.shards(target.position_of(slot))})
            assert {c.src_slot for c in copies} <= set(groups[slot])


def test_merge_needs_no_communication():
    parts = Split(unit=_unit(4, 1, range(4)), axis="tp", k=4).targets()
    merged = Merge(units=tuple(parts), axis="tp", unit_id="m").target()
    for slot in merged.slots:
        src = next(u for u in parts if slot in u.slots)
        copies = plan_copies(
            {slot: src.layout.shards(0)}, {slot: merged.layout.shards(merged.position_of(slot))}
        )
        assert all(c.local for c in copies)


def test_impossible_transitions_are_refused_before_anything_moves():
    unit = _unit(2, 2, range(4))
    with pytest.raises(TransitionError, match="tp=2 of u cannot split into 4"):
        Split(unit=unit, axis="tp", k=4).targets()
    with pytest.raises(TransitionError, match="axis: expected 'tp' or 'pp'"):
        Split(unit=unit, axis="dp", k=2).targets()
    with pytest.raises(TransitionError, match=r"slots: \[0, 1, 2, 3\] already hold u in that"):
        Extend(source=unit, slots=(0, 1, 2, 3), unit_id="e").target()
    shifted = Extend(source=unit, slots=(2, 3, 4, 5), unit_id="e")
    assert shifted.broadcast_groups() == [(0, 2), (1, 3), (2, 4), (3, 5)]
    other = _unit(1, 2, (4, 5), uid="v")
    with pytest.raises(TransitionError, match="is not a replica of"):
        Merge(units=(unit, other), axis="tp", unit_id="m").target()
    with pytest.raises(TransitionError, match="slot 9 is not in the pool"):
        check_slots([_unit(1, 1, (9,))], range(8))
    with pytest.raises(TransitionError, match="4 slots for a 2x1 unit"):
        _unit(2, 1, range(4))
    wide = (_unit(4, 1, range(4)), _unit(4, 1, range(4, 8), uid="w"))
    with pytest.raises(
        TransitionError, match="tp: 8 heads and 4 KV heads must both be divisible by tp=8"
    ):
        Merge(units=wide, axis="tp", unit_id="m").target()


def test_missing_source_state_is_named():
    shard = ShardSpec(
        key="w",
        global_shape=(8, 2),
        global_offset=(0, 0),
        local_shape=(8, 2),
        replica_id=0,
        dtype="bf16",
    )
    half = ShardSpec(
        key="w",
        global_shape=(8, 2),
        global_offset=(0, 0),
        local_shape=(4, 2),
        replica_id=0,
        dtype="bf16",
    )
    with pytest.raises(ShardError, match=r"w: \[4, 8\) along dim 0 is held by no live shard"):
        plan_copies({0: [half]}, {1: [shard]})


def test_an_uneven_split_is_refused_before_anything_moves():
    """Found by review: with a vocabulary that does not split evenly, a slot's peers may not hold
    all its new shard needs; the engine must say so before any slot moves a byte."""
    from runtime.emu.engine import UnitEngine
    from runtime.planner.catalog import ModelConfig

    odd = ModelConfig(
        name="odd",
        vocab_size=10,
        hidden_size=32,
        intermediate_size=16,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
    )
    unit = Unit(
        unit_id="u",
        model_stage="x",
        layout=UnitLayout(model=odd, tp=4, pp=1, training=False),
        slots=(0, 1, 2, 3),
    )
    spec = Split(unit=unit, axis="tp", k=2)
    with pytest.raises(
        TransitionError,
        match=r"split: model\.embed_tokens\.weight: \[\d+, \d+\) along dim 0 is held by no live shard",
    ):
        UnitEngine._check_split_covers(spec, spec.targets())
    even = Unit(
        unit_id="v",
        model_stage="x",
        layout=UnitLayout(model=MODEL, tp=4, pp=1, training=False),
        slots=(0, 1, 2, 3),
    )
    good = Split(unit=even, axis="tp", k=2)
    UnitEngine._check_split_covers(good, good.targets())


def test_the_arena_hands_out_the_best_fit_and_stays_bounded():
    from runtime.emu import slot_ops

    arena = slot_ops._Arena(enabled=True)
    for n in (100, 1000, 1200, 4000):
        arena.put(torch.empty(n, dtype=torch.uint8))
    # The smallest that fits; unit storage at most 1/SLACK larger than asked for (1000 + 125).
    assert arena.take(900, pinned=True).numel() == 1000
    assert arena.take(1100, pinned=True).numel() == 1200
    assert arena.take(1000, pinned=True) is None
    assert arena.take(1000, pinned=False).numel() == 4000  # a transient buffer: any larger one
    assert [b.numel() for b in arena.buffers] == [100]
    # Never more than ARENA_MAX_BUFFERS kept (the oldest go), and trimmed oldest first.
    for n in range(1, slot_ops.ARENA_MAX_BUFFERS + 1):
        arena.put(torch.empty(n, dtype=torch.uint8))
    assert [b.numel() for b in arena.buffers] == list(range(1, slot_ops.ARENA_MAX_BUFFERS + 1))
    freed = arena.trim(slot_ops.ARENA_MAX_BUFFERS)
    assert arena.nbytes <= slot_ops.ARENA_MAX_BUFFERS
    assert [b.numel() for b in arena.buffers] == [slot_ops.ARENA_MAX_BUFFERS]
    assert freed == sum(range(1, slot_ops.ARENA_MAX_BUFFERS))
    assert arena.trim(0) == slot_ops.ARENA_MAX_BUFFERS and not arena.buffers
    # CUDA slots leave caching to PyTorch's allocator.
    assert slot_ops._Arena(enabled=False).put(torch.empty(1, dtype=torch.uint8)) is False
