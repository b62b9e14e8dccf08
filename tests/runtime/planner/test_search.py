"""The global search: exact against exhaustive enumeration, deterministic, valid placements,
alternatives, rejections with reasons, and infeasibility that says what binds."""

import dataclasses
import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.bytesize import byte_size, byte_sizes
from runtime.planner import (
    PlanningError,
    PpoWorkload,
    cost,
    default_catalog,
    min_max_allocation,
    plan,
)
from runtime.planner.catalog import Accelerator, ModelConfig
from runtime.planner.memory import memory_breakdown, memory_budget, total_bytes
from runtime.planner.plan import Layout, Plan, PlanError
from runtime.planner.search import fitting, price_plan, rebatched
from runtime.planner.shapes import (
    ADAM_BYTES_PER_PARAM,
    LayoutShape,
    batchings,
    training_state,
)
from runtime.planner.space import only_layouts, valid_layouts
from tests.runtime.planner.oracle import exhaustive_step_seconds
from tests.support.hashing import outputs_under_hash_seeds

CATALOG = default_catalog()


@given(
    tables=st.lists(
        st.lists(st.one_of(st.floats(0.1, 100.0), st.just(math.inf)), min_size=9, max_size=9),
        min_size=1,
        max_size=4,
    ),
    budget=st.integers(0, 8),
)
def test_min_max_allocation_matches_brute_force(tables, budget):
    times = [np.minimum.accumulate(np.array([math.inf, *t[1:]])) for t in tables]
    value, allocation = min_max_allocation(times, budget)
    brute = min(
        (
            max(t[g] for t, g in zip(times, split, strict=True))
            for split in np.ndindex(*([budget + 1] * len(times)))
            if sum(split) <= budget
        ),
        default=math.inf,
    )
    assert value == brute
    assert sum(allocation) <= budget
    assert max(t[g] for t, g in zip(times, allocation, strict=True)) == value


@st.composite
def small_instances(draw):
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    model = ModelConfig(
        name="rand",
        vocab_size=draw(st.integers(16, 2000)),
        hidden_size=heads * draw(st.sampled_from([8, 16, 32])),
        intermediate_size=draw(st.integers(16, 512)),
        num_layers=draw(st.integers(1, 8)),
        num_heads=heads,
        num_kv_heads=draw(st.sampled_from([h for h in (1, 2, 4, 8) if heads % h == 0])),
    )
    workload = PpoWorkload.for_model(
        model,
        global_batch=draw(st.integers(1, 64)),
        prompt_len=draw(st.integers(1, 256)),
        gen_len=draw(st.integers(1, 256)),
        micro_batch=draw(st.integers(1, 8)),
        gen_micro_batch=draw(st.integers(1, 16)),
        ppo_epochs=draw(st.integers(1, 2)),
    )
    weights = model.num_params() * 2
    acc = Accelerator(
        name="rand-gpu",
        peak_flops=draw(st.floats(1e9, 1e15)),
        # from far too small to ample, so that memory binds in some instances and not others
        memory_bytes=weights * draw(st.floats(2.0, 200.0)),
        memory_bandwidth=draw(st.floats(1e9, 5e12)),
        intra_node_bandwidth=draw(st.floats(1e9, 1e12)),
        intra_node_latency=draw(st.floats(0, 1e-4)),
        inter_node_bandwidth=draw(st.floats(1e8, 1e11)),
        inter_node_latency=draw(st.floats(0, 1e-3)),
        gpus_per_node=draw(st.sampled_from([1, 2, 4, 8])),
    )
    return workload, acc, draw(st.integers(1, 16))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_instances())
def test_dp_equals_exhaustive_optimum(instance):
    """The search is exact beside the training state it plans room for, and that room holds
    what its training layouts keep; where it finds nothing, nothing fits beside any room a
    training layout could need."""
    workload, acc, num_slots = instance
    try:
        result = plan(workload, acc, num_slots)
    except PlanningError:
        for ms in workload.model_stages("training"):
            for tp, pp in valid_layouts(ms.model, acc, num_slots)[0]:
                one = LayoutShape(
                    ms=ms, workload=workload, accelerator=acc, tp=tp, pp=pp, dp=np.array([1.0])
                )
                level = float(one.params_per_slot * one.training_bytes_per_param[0])
                room = tuple((t.role, level) for t in workload.model_stages("training"))
                assert not math.isfinite(exhaustive_step_seconds(workload, acc, num_slots, room))
        return
    room = result.best.training_state
    optimum = exhaustive_step_seconds(workload, acc, num_slots, room)
    assert result.best.predicted_step_s == pytest.approx(optimum, rel=1e-9)
    assert price_plan(result.best, workload, acc) == pytest.approx(optimum, rel=1e-9)
    kept = dict(training_state(dataclasses.replace(result.best, training_state=()), workload))
    assert all(kept[role] <= nbytes * (1 + 1e-9) for role, nbytes in room)
    _assert_valid_placement(result.best, acc)


def _assert_valid_placement(best: Plan, acc: Accelerator) -> None:
    """TP groups inside a node; links priced as intra-node really are; disjoint means disjoint."""

    def nodes(slots) -> set[int]:
        return {s // acc.gpus_per_node for s in slots}

    by_stage: dict[str, list] = {}
    for ms in best.model_stages:
        by_stage.setdefault(ms.name.split("@")[1], []).append(ms)
        priced = dict(ms.breakdown)
        for unit in ms.units:
            for p in range(ms.layout.pp):
                group = unit[p * ms.layout.tp : (p + 1) * ms.layout.tp]
                assert len(nodes(group)) == 1, f"{ms.name}: TP group {group} straddles nodes"
            if "pp_p2p:intra" in priced:
                assert len(nodes(unit)) == 1, (
                    f"{ms.name}: unit {unit} priced intra-node spans nodes"
                )
        if "dp_allreduce:intra" in priced:
            assert len(nodes(ms.slots)) == 1, f"{ms.name}: DP group priced intra-node spans nodes"
    for stage in best.stages:
        if stage.mode == "disjoint":
            used = [s for ms in by_stage[stage.stage] for s in ms.slots]
            assert len(used) == len(set(used)), f"{stage.stage}: model-stages share a slot"


def test_search_is_deterministic_and_round_trips_json():
    workload = PpoWorkload.for_model(CATALOG.model("llama-3.1-8b"))
    acc = CATALOG.accelerator("h100-sxm")
    first, second = plan(workload, acc, 64), plan(workload, acc, 64)
    assert first.best == second.best and first.alternatives == second.alternatives
    assert Plan.from_json(first.best.to_json()) == first.best
    _assert_valid_placement(first.best, acc)


def test_alternatives_change_a_layout_and_are_not_better():
    workload = PpoWorkload.for_model(CATALOG.model("qwen2.5-7b"), gen_len=1024)
    result = plan(workload, CATALOG.accelerator("h200"), 32, num_alternatives=3)
    assert 1 <= len(result.alternatives) <= 3
    times = [a.predicted_step_s for a in result.alternatives]
    assert times == sorted(times) and times[0] >= result.best.predicted_step_s
    assert all(a.layouts() != result.best.layouts() for a in result.alternatives)


def test_every_unused_candidate_has_a_reason():
    workload = PpoWorkload.for_model(CATALOG.model("qwen2.5-7b"))
    result = plan(workload, CATALOG.accelerator("h100-sxm"), 16)
    reasons = {(r.model_stage, r.tp, r.pp): r.reason for r in result.rejected}
    assert "28 attention heads are not divisible by tp=8" in reasons[("actor@training", 8, 1)]
    assert reasons[("actor@training", 16, 1)].startswith("tp=16 exceeds the 8 GPUs of a node")
    # Training layouts keeping more state per slot than the plan made room for are not taken.
    assert any(r.startswith("memory: keeps") for r in reasons.values())
    chosen = result.best.model_stage("actor@training").layout
    assert ("actor@training", chosen.tp, chosen.pp) not in reasons


def test_no_feasible_plan_says_what_binds_and_by_how_much():
    workload = PpoWorkload.for_model(CATALOG.model("llama-3.1-70b"))
    with pytest.raises(PlanningError) as info:
        plan(workload, CATALOG.accelerator("h100-sxm"), 8)
    error = info.value
    assert error.constraint == "memory" and error.shortfall > 0
    assert str(error).startswith(f"memory: {error.model_stage} needs at least")
    assert "GiB over the 72.0 GiB budget" in str(error)
    tiny = PpoWorkload.for_model(CATALOG.model("tiny-llama"))
    with pytest.raises(ValueError, match="gpus: must be a positive whole number of slots, got 0"):
        plan(tiny, CATALOG.accelerator("cpu-slot"), 0)


def test_no_feasible_plan_prices_each_training_models_state_at_its_own():
    """Llama-3.1-70B on one H100: no training layout fits, and the refusal priced the state
    the other model-stages sit beside at the critic's figure for the actor too (the actor's
    vocabulary head keeps more than the critic's scalar one; found by review). Each is priced
    from its own parameters, and the need named is generation's beside both."""
    model = CATALOG.model("llama-3.1-70b")
    workload = PpoWorkload.for_model(model)
    acc = CATALOG.accelerator("h100-sxm")
    with pytest.raises(PlanningError) as refused:
        plan(workload, acc, 1)
    per_param = 2 * workload.bytes_per_value + ADAM_BYTES_PER_PARAM  # unsharded, one replica
    actor = model.num_params(scalar_head=False) * per_param
    critic = model.num_params(scalar_head=True) * per_param
    assert actor > critic * 1.005
    message = str(refused.value)
    shown_actor, shown_critic = byte_sizes(actor, critic)
    assert f"beside {byte_size(actor + critic)} of training state kept per slot" in message
    assert f"(actor {shown_actor}, critic {shown_critic})" in message, message
    assert refused.value.model_stage == "actor@generation"
    (generation,) = workload.model_stages("generation")
    shape = LayoutShape(
        ms=generation,
        workload=workload,
        accelerator=acc,
        tp=1,
        pp=1,
        dp=np.array([1.0]),
        resident=(("actor", actor), ("critic", critic)),
    )
    shape = dataclasses.replace(shape, micro_batch=batchings(shape)[-1])
    need = float(total_bytes(memory_breakdown(shape, num_slots=1))[0])
    assert refused.value.shortfall == pytest.approx(need - memory_budget(acc.memory_bytes))
    assert f"needs at least {byte_sizes(need, memory_budget(acc.memory_bytes))[0]}" in message


def test_a_refusal_by_a_hair_prints_the_need_and_the_budget_apart():
    """The largest slot on which a tiny model fits in no layout: its need passes the budget by
    under a byte, and the refusal printed both as "0.2 GiB" and the shortfall as "0.0 GiB".
    The two figures read differently, and the shortfall is not a bare zero."""
    workload = PpoWorkload.for_model(CATALOG.model("tiny-llama"))
    acc = CATALOG.accelerator("cpu-slot")
    low, high = 2**20, 2**30  # bytes of a slot: none fits at the first, one does at the second
    refusal = None
    while high - low > 1:
        middle = (low + high) // 2
        try:
            plan(workload, dataclasses.replace(acc, memory_bytes=middle), 1, num_alternatives=0)
            high = middle
        except PlanningError as exc:
            low, refusal = middle, exc
    assert refusal is not None and refusal.constraint == "memory"
    assert 0 < refusal.shortfall < 1
    found = re.search(
        r"needs at least (\S+ \S+) per slot .*, (\S+ \S+) over the (\S+ \S+) budget",
        str(refusal),
    )
    assert found is not None, str(refusal)
    need, over, budget = found.groups()
    assert need != budget and need.endswith(" MiB") and budget.endswith(" MiB"), str(refusal)
    assert float(need.split()[0]) > float(budget.split()[0])
    assert over.endswith(" bytes") and float(over.split()[0]) > 0, str(refusal)


def test_a_plan_is_fastest_at_one_length_and_fits_another():
    """``fits_at``: memory is checked at the longer length, speed priced at the running one
    (one sequence per micro-batch, so that no smaller micro-batch can make a plan fit)."""
    acc = CATALOG.accelerator("h100-sxm")
    now = PpoWorkload.for_model(CATALOG.model("llama-3.1-8b"), gen_len=1000, micro_batch=1)
    later = now.with_gen_len(32000)
    short = plan(now, acc, 32, num_alternatives=0).best
    lasting = plan(now, acc, 32, num_alternatives=0, fits_at=later).best
    for_later = plan(later, acc, 32, num_alternatives=0).best

    def fits(p, workload) -> bool:
        return all(
            total_bytes(memory_breakdown(shape, num_slots=32))[0] <= memory_budget(acc.memory_bytes)
            for shape in (
                LayoutShape.of_plan(ms, workload, acc, p) for ms in workload.model_stages()
            )
        )

    assert not fits(short, later) and fits(lasting, later) and fits(lasting, now)
    # Fastest now among the plans that fit later: no slower now than the plan made for later,
    # no faster than the plan made for now alone.
    at_now = [price_plan(p, now, acc) for p in (short, lasting, for_later)]
    assert at_now[0] < at_now[1] <= at_now[2]
    assert lasting.predicted_step_s == pytest.approx(at_now[1])
    with pytest.raises(ValueError, match=r"fits_at\.gen_len: must be at least the workload's 1000"):
        plan(now, acc, 32, fits_at=now.with_gen_len(500))


def test_more_slots_never_predict_a_slower_step():
    workload = PpoWorkload.for_model(CATALOG.model("llama-3.1-8b"))
    acc = CATALOG.accelerator("h100-sxm")
    times = [
        plan(workload, acc, n, num_alternatives=0).best.predicted_step_s for n in (16, 32, 64, 128)
    ]
    assert times == sorted(times, reverse=True)


def test_links_priced_inside_a_node_are_placed_inside_one():
    """A disjoint stage with units whose sizes are not powers of two (found by review: a (3,1,2)
    critic once landed across two nodes while priced as intra-node)."""
    workload = PpoWorkload.for_model(CATALOG.model("qwen2.5-7b"), gen_len=256)
    acc = CATALOG.accelerator("h100-sxm")
    for n in (6, 12, 14, 24, 40):
        _assert_valid_placement(plan(workload, acc, n, num_alternatives=0).best, acc)


def test_efficiencies_are_validated():
    workload = PpoWorkload.for_model(CATALOG.model("tiny-llama"))
    acc = CATALOG.accelerator("cpu-slot")
    for bad, message in [
        ({"gemm": 0}, "efficiency.gemm: must be a number in (0, 1]"),
        ({"gemm": -0.5}, "efficiency.gemm: must be"),
        ({"gemm": "0.5"}, "efficiency.gemm: must be"),
        ({"gem": 0.5}, "efficiency.gem: unknown operation class"),
    ]:
        with pytest.raises(ValueError) as info:
            plan(workload, acc, 4, efficiency=bad)
        assert str(info.value).startswith(message)


def test_excluding_every_fitting_layout_says_so():
    workload = PpoWorkload.for_model(CATALOG.model("tiny-llama"))
    acc = CATALOG.accelerator("cpu-slot")
    banned = frozenset(("actor@generation", tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8))
    with pytest.raises(PlanningError) as info:
        plan(workload, acc, 8, excluded=banned)
    assert info.value.constraint == "excluded" and info.value.model_stage == "actor@generation"
    one = frozenset({("actor@training", 1, 1)})
    result = plan(workload, acc, 8, excluded=one)
    reasons = {(r.model_stage, r.tp, r.pp): r.reason for r in result.rejected}
    assert reasons.get(("actor@training", 1, 1)) == "excluded by the caller"


@pytest.mark.parametrize(
    ("model", "num_slots", "keep"),
    [("qwen2.5-7b", 28, (4, 1)), ("llama-3.1-70b", 80, (4, 20)), ("llama-3.1-8b", 16, (2, 2))],
)
def test_keeping_layouts_leaves_only_those_layouts(model, num_slots, keep):
    """``only_layouts`` excludes the whole grid the planner searches: pp of every divisor of the
    layer count, not only powers of two (found by review: keeping (4, 1) for a 28-layer model
    gave every model-stage but generation (1, 7))."""
    workload = PpoWorkload.for_model(CATALOG.model(model))
    acc = CATALOG.accelerator("h100-sxm")
    kept = {ms.name: keep for ms in workload.model_stages()}
    best = plan(
        workload,
        acc,
        num_slots,
        num_alternatives=0,
        excluded=only_layouts(kept, workload, acc, num_slots),
    ).best
    assert {ms.name: (ms.layout.tp, ms.layout.pp) for ms in best.model_stages} == kept


@pytest.mark.parametrize("stage", ["training", "inference"])
def test_a_micro_batch_is_never_charged_more_sequences_than_its_unit_has(stage):
    """A pinned micro-batch of 8 on a unit holding one sequence runs micro-batches of one: memory
    and time are those of micro-batch 1 (found by review: such a unit was charged the
    activations of 8 sequences, and a layout that fits was refused)."""
    from runtime.planner.plan import Layout

    workload = PpoWorkload.for_model(
        CATALOG.model("llama-3.1-8b"),
        global_batch=8,
        micro_batch=8,
        adaptive_micro_batch=False,
        gen_len=2048,
    )
    acc = CATALOG.accelerator("h100-sxm")
    ms = next(m for m in workload.model_stages(stage) if m.role == "actor")

    def priced(dp, micro_batch):
        shape = LayoutShape.of_layout(ms, workload, acc, Layout(dp=dp, tp=2, pp=2), micro_batch)
        need = float(total_bytes(memory_breakdown(shape, num_slots=32))[0])
        seconds = float(cost.predict(shape, num_slots=32, efficiency=cost.DEFAULT_EFFICIENCY)[0][0])
        return need, seconds

    assert priced(8, 8) == pytest.approx(priced(8, 1))  # one sequence per unit
    assert priced(4, 8) == pytest.approx(priced(4, 2))  # two
    assert priced(1, 8)[0] > priced(1, 4)[0]  # eight: the size is the plan's


def test_a_layout_memory_outgrows_runs_in_smaller_micro_batches_before_it_is_dropped():
    """Training and inference at 8,000 generated tokens in micro-batches of 8 sequences: each
    model-stage runs in the fastest of 8, 4, 2 and 1 that fits its layout, and some fit only in
    smaller ones; pinned to 8, no plan fits: the actor's training in micro-batches of 8 does not
    fit a device in the layouts that keep least, and those that keep more leave its generation
    no room; the refusal names whichever comes closer."""
    acc = CATALOG.accelerator("h100-sxm")
    adaptive = PpoWorkload.for_model(CATALOG.model("llama-3.1-8b"), gen_len=8000, micro_batch=8)
    pinned = dataclasses.replace(adaptive, adaptive_micro_batch=False)
    free = plan(adaptive, acc, 32, num_alternatives=0).best
    with pytest.raises(
        PlanningError,
        match=r"memory: actor@(generation|training) needs .* beside \d+\.\d+ GiB of training state",
    ) as refused:
        plan(pinned, acc, 32, num_alternatives=0)
    assert refused.value.constraint == "memory"
    budget = memory_budget(acc.memory_bytes)
    outgrown = []
    for ms in adaptive.model_stages():
        chosen = LayoutShape.of_plan(ms, adaptive, acc, free)
        predicted, fits, micro, _ = fitting(chosen, 32, cost.DEFAULT_EFFICIENCY)
        assert fits[0] and micro[0] == chosen.micro_batch
        assert predicted[0] == pytest.approx(price(chosen))
        assert total_bytes(memory_breakdown(chosen, num_slots=32))[0] <= budget
        for size in batchings(chosen):  # none that fits is faster
            other = dataclasses.replace(chosen, micro_batch=size)
            need = total_bytes(memory_breakdown(other, num_slots=32))[0]
            if need <= budget:
                assert price(other) >= price(chosen)
            elif size == 8:
                outgrown.append(ms.name)
    assert outgrown and all(n.endswith(("@training", "@inference")) for n in outgrown)
    assert Plan.from_json(free.to_json()) == free


def test_generation_whose_kv_cache_cannot_hold_every_sequence_decodes_in_waves():
    """At 16,000 generated tokens on 8 A100s no generation layout holds the KV cache of all of
    a unit's sequences: decoding them all at once (pinned) fits nowhere. Planned, a unit
    decodes as many as its cache holds and the rest in later waves (vLLM's max_num_seqs), and
    no option with fewer waves fits; each wave reads the weights again, so it costs more than
    the same layout would all at once."""
    acc = CATALOG.accelerator("a100-80gb")
    adaptive = PpoWorkload.for_model(CATALOG.model("llama-3.1-8b"), gen_len=16000)
    pinned = dataclasses.replace(adaptive, adaptive_micro_batch=False)
    with pytest.raises(PlanningError, match=r"memory: actor@generation needs") as refused:
        plan(pinned, acc, 8, num_alternatives=0)
    assert refused.value.constraint == "memory"
    best = plan(adaptive, acc, 8, num_alternatives=0).best
    ms = next(m for m in adaptive.model_stages() if m.stage == "generation")
    chosen = LayoutShape.of_plan(ms, adaptive, acc, best)
    share = float(chosen.batch_per_unit[0])
    assert 0 < best.model_stage(ms.name).micro_batch < share
    assert float(chosen.waves[0]) >= 2 and float(chosen.concurrent[0]) * chosen.waves[0] >= share
    budget = memory_budget(acc.memory_bytes)
    assert total_bytes(memory_breakdown(chosen, num_slots=8))[0] <= budget
    at_once = dataclasses.replace(chosen, micro_batch=0)
    assert total_bytes(memory_breakdown(at_once, num_slots=8))[0] > budget
    assert price(at_once, 8) < price(chosen, 8)
    for option in batchings(chosen):  # fewer waves than chosen: too big
        other = dataclasses.replace(chosen, micro_batch=option)
        if float(other.waves[0]) < float(chosen.waves[0]):
            assert total_bytes(memory_breakdown(other, num_slots=8))[0] > budget
    assert Plan.from_json(best.to_json()) == best


def test_a_plan_rebatched_for_a_longer_length_keeps_its_layouts_and_slots():
    """A plan made at 2,000 tokens, re-batched for 5,000: every model-stage keeps its layout
    and slots, micro-batches only shrink (generation decodes in waves, so ``micro_batch`` goes
    from all at once to some), the plan's predictions are its own at the new length, and it
    fits there; at a length no micro-batch of some layout fits, there is none."""
    acc = CATALOG.accelerator("h100-sxm")
    short = PpoWorkload.for_model(CATALOG.model("llama-3.1-8b"), gen_len=2000, global_batch=2048)
    running = plan(short, acc, 16, num_alternatives=0).best
    longer = short.with_gen_len(5000)
    again = rebatched(running, longer, acc)
    assert again is not None and again.places_like(running)
    assert again.predicted_step_s == pytest.approx(price_plan(again, longer, acc))
    before, after = running.micro_batches(short.micro_batch), again.micro_batches(4)
    assert before != after
    for name, size in after.items():
        if name.endswith("@generation"):
            assert before[name] == 0 or 0 < size <= before[name]
        else:
            assert size <= before[name]
    budget = memory_budget(acc.memory_bytes)
    for ms in longer.model_stages():
        shape = LayoutShape.of_plan(ms, longer, acc, again)
        assert total_bytes(memory_breakdown(shape, num_slots=16))[0] <= budget
    assert rebatched(running, short, acc) == dataclasses.replace(running)  # nothing to change
    assert rebatched(running, short.with_gen_len(64000), acc) is None


def price(shape: LayoutShape, num_slots: int = 32) -> float:
    return float(cost.predict(shape, num_slots=num_slots, efficiency=cost.DEFAULT_EFFICIENCY)[0][0])


def test_a_plan_s_micro_batch_is_checked_and_defaults_to_the_workload_s():
    workload = PpoWorkload.for_model(CATALOG.model("llama-3.1-8b"))
    best = plan(workload, CATALOG.accelerator("h100-sxm"), 16, num_alternatives=0).best
    data = best.to_json()
    data["model_stages"][0]["micro_batch"] = -1
    with pytest.raises(PlanError, match=r"actor@generation\.micro_batch: must be a whole number"):
        Plan.from_json(data)
    for ms in data["model_stages"]:  # a plan written before micro-batches were planned
        del ms["micro_batch"]
    older = Plan.from_json(data)
    assert set(older.micro_batches().values()) == {0}
    # training and inference take the workload's; generation decodes all at once
    assert older.micro_batches(default=4) == {
        ms.name: 0 if ms.name.endswith("@generation") else 4 for ms in older.model_stages
    }
    assert price_plan(older, workload, CATALOG.accelerator("h100-sxm")) > 0


def test_plan_json_with_overlapping_disjoint_model_stages_is_refused():
    workload = PpoWorkload.for_model(CATALOG.model("llama-3.1-8b"))
    best = plan(workload, CATALOG.accelerator("h100-sxm"), 64, num_alternatives=0).best
    data = best.to_json()
    disjoint = next(s["stage"] for s in data["stages"] if s["mode"] == "disjoint")
    members = [ms for ms in data["model_stages"] if ms["name"].endswith("@" + disjoint)]
    if len(members) > 1:
        members[1]["units"][0][0] = members[0]["units"][0][0]
        with pytest.raises(PlanError, match="is also used by"):
            Plan.from_json(data)
    data = best.to_json()
    data["model_stages"][0]["breakdown"] = []
    with pytest.raises(PlanError, match=r"model_stages\[0\]\.breakdown: expected an object"):
        Plan.from_json(data)


def test_same_plan_under_another_hash_seed():
    code = (
        "from runtime.planner import *; c = default_catalog(); "
        "w = PpoWorkload.for_model(c.model('qwen2.5-7b')); "
        "import json; best = plan(w, c.accelerator('h100-sxm'), 48).best; "
        "print(json.dumps(best.to_json(), sort_keys=True))"
    )
    assert len(outputs_under_hash_seeds(code)) == 1


def test_a_layout_the_model_cannot_take_is_refused_with_the_field():
    from runtime.planner.space import check_layout, valid_layouts

    model, acc = (
        CATALOG.model("qwen2.5-7b"),
        CATALOG.accelerator("h100-sxm"),
    )  # 28 heads, 4 KV, 28 layers
    cases = [
        ({"dp": 1, "tp": 8, "pp": 1}, "tp: 28 attention heads are not divisible by tp=8"),
        ({"dp": 1, "tp": 3, "pp": 1}, "tp: must be a power of two, got 3"),
        ({"dp": 1, "tp": 16, "pp": 1}, "tp: tp=16 exceeds the 8 GPUs of a node"),
        ({"dp": 1, "tp": 1, "pp": 3}, "pp: 28 layers are not divisible by pp=3"),
        ({"dp": 9, "tp": 2, "pp": 1}, "dp: (dp,tp,pp)=(9,2,1) needs 18 slots, the pool has 16"),
        ({"dp": 0, "tp": 1, "pp": 1}, "dp: must be a positive integer, got 0"),
    ]
    for layout, message in cases:
        with pytest.raises(ValueError) as info:
            check_layout(model, acc, num_slots=16, **layout)
        assert str(info.value).startswith(message), str(info.value)
    check_layout(model, acc, num_slots=16, dp=2, tp=4, pp=2)
    # Uneven MLP or vocabulary splits cannot run under DTensor: never proposed, refused if asked.
    odd = dataclasses.replace(CATALOG.model("tiny-llama"), name="odd", vocab_size=510)
    with pytest.raises(ValueError, match=r"tp: vocab_size=510 is not divisible by tp=4"):
        check_layout(odd, acc, num_slots=16, dp=1, tp=4, pp=1)
    narrow = dataclasses.replace(CATALOG.model("tiny-llama"), name="narrow", intermediate_size=350)
    with pytest.raises(ValueError, match=r"tp: intermediate_size=350 is not divisible by tp=4"):
        check_layout(narrow, acc, num_slots=16, dp=1, tp=4, pp=1)
    assert all(tp in (1, 2) for tp, _ in valid_layouts(odd, acc, 16)[0])


def test_a_model_with_tied_embeddings_is_planned():
    """With tied embeddings the actor and the critic keep the same bytes per slot at some
    layouts; the search's allowances were sorted with the model-stages as tie-breakers, which
    cannot be ordered (a TypeError for any such model)."""
    model = dataclasses.replace(CATALOG.model("tiny-llama"), tie_embeddings=True)
    workload = PpoWorkload.for_model(model)
    best = plan(workload, CATALOG.accelerator("cpu-slot"), 8, num_alternatives=0).best
    assert best.training_state and all(nbytes > 0 for _, nbytes in best.training_state)


def test_a_tied_lm_head_is_planned_only_at_tp_1_and_pp_1_while_scalar_heads_are_free():
    """A tied head is the embedding table: with pp > 1 the last stage would use an embedding
    it never receives (the first stage holds it), and under TP the model layer refuses it. The
    planner keeps the actor's and reference's model-stages whole; the critic's and reward's
    scalar heads take any layout."""
    model = dataclasses.replace(CATALOG.model("tiny-llama"), tie_embeddings=True)
    workload = PpoWorkload.for_model(model, gen_len=1024)
    acc = CATALOG.accelerator("cpu-slot")
    result = plan(workload, acc, 16, num_alternatives=3)
    for found in (result.best, *result.alternatives):
        for ms in workload.model_stages():
            layout = found.model_stage(ms.name).layout
            if not ms.scalar_head:
                assert (layout.tp, layout.pp) == (1, 1), ms.name
    assert any(
        (found.model_stage(ms.name).layout.tp, found.model_stage(ms.name).layout.pp) != (1, 1)
        for found in (result.best, *result.alternatives)
        for ms in workload.model_stages()
        if ms.scalar_head
    )
    _, refused = valid_layouts(model, acc, 64)
    assert any("tie_embeddings" in reason for *_, reason in refused)
    assert not any(
        "tie_embeddings" in r for *_, r in valid_layouts(model, acc, 64, lm_head=False)[1]
    )


def test_when_no_training_layout_fits_the_refusal_counts_the_least_training_state():
    """With no training layout fitting beside anything, the refusal priced the others beside
    the unsharded training state (953 GiB a slot for a 32B actor and critic, found by review),
    not beside the least that some layout keeps."""
    import re

    acc = CATALOG.accelerator("a100-80gb")
    workload = PpoWorkload.for_model(CATALOG.model("qwen2.5-32b"), gen_len=500)
    with pytest.raises(PlanningError) as refused:
        plan(workload, acc, 16, num_alternatives=0)
    beside = re.search(r"beside (\d+\.\d+) GiB of training state", str(refused.value))
    assert beside is not None, str(refused.value)
    least = sum(
        min(
            float(
                LayoutShape.of_layout(ms, workload, None, Layout(dp=1, tp=tp, pp=pp)).kept_per_slot[
                    0
                ]
            )
            for tp, pp in ((8, 2), (4, 4), (2, 8), (1, 16))  # the most sharded on 16 slots
        )
        for ms in workload.model_stages("training")
    )
    assert float(beside.group(1)) * 2**30 <= least * 1.01


def test_where_no_one_allowance_fits_both_training_models_each_gets_its_own():
    """Llama-3.1-8B on 7 H100s: the actor's tp=4 layouts keep 2 GiB a slot more than the
    critic's (its vocabulary head), and the actor fits only beside the critic's smaller state.
    One allowance for both (the actor's) leaves the actor no room; each its own finds the plan,
    the exhaustive optimum beside those allowances."""
    workload = PpoWorkload.for_model(CATALOG.model("llama-3.1-8b"), gen_len=1024)
    acc = CATALOG.accelerator("h100-sxm")
    best = plan(workload, acc, 7, num_alternatives=0).best
    room = dict(best.training_state)
    assert room["actor"] > room["critic"] * 1.05
    assert best.predicted_step_s == pytest.approx(
        exhaustive_step_seconds(workload, acc, 7, best.training_state), rel=1e-9
    )
    one = tuple((role, room["actor"]) for role in room)
    assert not math.isfinite(exhaustive_step_seconds(workload, acc, 7, one))
