"""Moving a training model-stage's state between layouts three ways, side by side in one run.

(a) checkpoint/restart: torch.distributed.checkpoint saves every shard, the slot actors and their
    groups are torn down, new ones start and load into the new layout (DCP reshards on load);
(b) shard-level: every tensor reassembled at a root and re-broadcast on its own, no unit boundary;
(c) the EMU primitives, twice: cold, the first time, when every buffer a primitive receives into or
    builds is fresh memory (each page faults in on first touch), and warm, run again on the same
    slots after the cold run's units were released, so its buffers come from the slots' arenas
    (what a job's later transitions see); warm is the median of ``--repeats`` runs.

Cases: scale 2→4 and 4→8 slots (Extend), TP 2→4 (Merge), PP 2→1 (Split), DP 2→1 (Destroy), on a
Llama-shaped model with about 300 MB of training state (bf16 weights, fp32 master weights and Adam
moments). Slots are CPU worker processes joined by gloo on loopback. Every method's result is
verified with the layout-independent checksum; the comparison is on the time to move the state
(groups, data, restart), with the verification reported beside it. Also measured here: gloo
broadcast and all-gather bandwidth, for the time the bytes that must move take at best, and each
primitive's raw communication pattern (same groups, same bytes, pre-faulted buffers).

    python benchmarks/transition_cost.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import runtime.engine  # noqa: F401 - keeps Ray on loopback
from benchmarks import _report
from runtime.emu import baselines, checkpoint, slot_ops
from runtime.emu.engine import UnitEngine
from runtime.emu.layout import UnitLayout
from runtime.emu.primitives import Destroy, Extend, Merge, Split, Unit
from runtime.engine.ray_cluster import ray_connection
from runtime.engine.slots import SlotPool
from runtime.planner.catalog import ModelConfig

MODEL = ModelConfig(
    name="bench-300mb",
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    num_layers=4,
    num_heads=8,
    num_kv_heads=8,
)
POOL = 8
MIB = 2**20


def _unit(uid: str, tp: int, pp: int, slots) -> Unit:
    return Unit(
        unit_id=uid,
        model_stage="actor@training",
        layout=UnitLayout(model=MODEL, tp=tp, pp=pp, training=True),
        slots=tuple(slots),
    )


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    sources: tuple[Unit, ...]
    targets: tuple[Unit, ...]
    emu: Callable[[UnitEngine], list]
    """Runs the primitives; returns their reports."""
    must_move: Callable[[int], int]
    """Bytes that must cross the network, given one unit's state bytes."""
    collective: str
    pattern: tuple[str, tuple[tuple[int, ...], ...], float] | None = None
    """The primitive's raw communication: (kind, groups, bytes per rank as a share of one unit)."""
    previous_pattern: str | None = None
    """The kind of pattern the primitive used before, timed on the same groups and bytes."""


def _cases() -> list[Case]:
    a2, a4 = _unit("a", 2, 1, (0, 1)), _unit("a", 4, 1, (0, 1, 2, 3))
    r0, r1 = _unit("r0", 2, 1, (0, 1)), _unit("r1", 2, 1, (2, 3))
    p2 = _unit("p", 1, 2, (0, 1))
    return [
        Case(
            "scale 2->4 slots",
            (a2,),
            (a2, dataclasses.replace(a2, unit_id="e", slots=(2, 3))),
            lambda eng: [eng.extend(Extend(source=a2, slots=(2, 3), unit_id="e"))[1]],
            lambda state: state,
            "broadcast",
            ("broadcast", ((0, 2), (1, 3)), 0.5),
        ),
        Case(
            "scale 4->8 slots",
            (a4,),
            (a4, dataclasses.replace(a4, unit_id="e", slots=(4, 5, 6, 7))),
            lambda eng: [eng.extend(Extend(source=a4, slots=(4, 5, 6, 7), unit_id="e"))[1]],
            lambda state: state,
            "broadcast",
            ("broadcast", ((0, 4), (1, 5), (2, 6), (3, 7)), 0.25),
        ),
        Case(
            "TP 2->4 (dp 2->1)",
            (r0, r1),
            (_unit("m", 4, 1, (0, 2, 1, 3)),),
            lambda eng: [eng.merge(Merge(units=(r0, r1), axis="tp", unit_id="m"))[1]],
            lambda state: 0,
            "none",
        ),
        Case(
            "PP 2->1 (dp 1->2)",
            (p2,),
            tuple(Split(unit=p2, axis="pp", k=2).targets()),
            lambda eng: [eng.split(Split(unit=p2, axis="pp", k=2))[1]],
            lambda state: state,
            "broadcast",
            ("p2p_exchange", ((0, 1),), 0.5),
            "exchange",
        ),
        Case(
            "DP 2->1",
            (r0, r1),
            (r0,),
            lambda eng: [eng.destroy(Destroy(unit=r1))],
            lambda state: 0,
            "none",
        ),
    ]


def _clear(pool: SlotPool) -> None:
    for held in pool.run(lambda ctx: list(ctx.state.get("units", {}))):
        if held:
            pool.run(slot_ops.release, unit_ids=held)


def _setup(pool: SlotPool, case: Case) -> UnitEngine:
    _clear(pool)
    engine = UnitEngine(pool)
    for unit in case.sources:
        engine.create(unit)
    return engine


def _state_bytes(engine: UnitEngine, unit: Unit) -> int:
    return sum(
        t.numel() * t.element_size() for pieces in engine.read(unit).values() for _, t in pieces
    )


def _time_emu(engine: UnitEngine, case: Case) -> dict:
    started = time.perf_counter()
    reports = case.emu(engine)
    total = time.perf_counter() - started
    verify = sum(r.verify_s for r in reports)
    return {
        "seconds": total - verify,
        "verify_s": verify,
        "total_s": total,
        "bytes": sum(r.bytes_moved for r in reports),
        "busiest_bytes": max([max(r.bytes_per_slot.values(), default=0) for r in reports]),
        "group_setup_s": sum(r.group_setup_s for r in reports),
        "reused_bytes": sum(r.reused_bytes for r in reports),
        "freed_bytes": sum(r.freed_bytes for r in reports),
        "cached_bytes": sum(r.cached_bytes for r in reports),
        "per_slot": _per_slot(case, reports),
    }


def _per_slot(case: Case, reports) -> dict[int, dict[str, int]]:
    """Per slot: bytes of the source and target shards it holds, bytes it received, and its peak
    (units and in-flight buffers, as the primitive measured it)."""
    from runtime.emu.slot_ops import _nbytes

    def held(units, slot):
        return sum(_nbytes(u.layout.shards(u.position_of(slot))) for u in units if slot in u.slots)

    moved = [u for u in case.targets if u not in case.sources]
    gone = [u for u in case.sources if u not in case.targets]
    out = {}
    for report in reports:
        for slot, peak in report.peak_bytes.items():
            out[slot] = {
                "old": held(gone, slot),
                "new": held(moved, slot),
                "received": report.bytes_per_slot.get(slot, 0),
                "peak": peak,
            }
    return out


def run_emu(pool: SlotPool, case: Case, repeats: int) -> dict:
    """Cold (the first run, its buffers fresh memory), then warm: ``repeats`` runs on the same
    slots, each after the previous run's units were released into the arenas; the median."""
    engine = _setup(pool, case)
    engine.empty_cache()  # nothing cached from earlier cases: every buffer is fresh memory
    cold = _time_emu(engine, case)
    runs = []
    for _ in range(repeats):
        runs.append(_time_emu(_setup(pool, case), case))
    runs.sort(key=lambda r: r["seconds"])
    warm = runs[len(runs) // 2]
    _setup(pool, case).empty_cache()  # the baselines find the slots as they were before
    return {**cold, "warm": {**warm, "runs_s": [r["seconds"] for r in runs]}}


def run_shard_level(pool: SlotPool, case: Case) -> dict:
    engine = _setup(pool, case)
    source = case.sources[0]
    # No unit boundary: every target unit is rebuilt tensor by tensor, even one that a unit-aware
    # system would recognise as an intact replica.
    targets = [dataclasses.replace(t, unit_id=f"{t.unit_id}.x") for t in case.targets]
    started = time.perf_counter()
    moved = 0
    if targets:
        members = baselines.participants(source, targets)
        pool.run(slot_ops.ensure_groups, groups=[members])
        results = pool.run(baselines.reshard_per_tensor, source=source, targets=targets)
        moved = sum(r["bytes_received"] for r in results)
    pool.run(slot_ops.release, unit_ids=[s.unit_id for s in case.sources])
    seconds = time.perf_counter() - started
    expected = engine.verified[source.unit_id]
    for target in targets:
        engine.units[target.unit_id] = target
        assert engine.checksum(target) == expected, f"shard-level broke {target.unit_id}"
    return {"seconds": seconds, "bytes": moved}


def run_checkpoint_restart(pool: SlotPool, case: Case) -> tuple[SlotPool, dict]:
    engine = _setup(pool, case)
    directory = tempfile.mkdtemp(prefix="nereus-ckpt-")
    source = case.sources[0]  # replicas are identical; one copy is the checkpoint
    started = time.perf_counter()
    pool.run(checkpoint.ensure_unit_groups, units=[source])
    expected = engine.verified[source.unit_id]
    pool.run(checkpoint.save_unit, unit=source, path=directory)
    saved = time.perf_counter()
    pool.close()  # the restart: every worker and group goes away
    pool = SlotPool.create(POOL, call_timeout_s=600)
    restarted = time.perf_counter()
    pool.run(checkpoint.ensure_unit_groups, units=list(case.targets))
    engine = UnitEngine(pool)
    for target in case.targets:
        pool.run(checkpoint.load_unit, unit=target, path=directory)
        engine.units[target.unit_id] = target
    finished = time.perf_counter()
    for target in case.targets:
        assert engine.checksum(target) == expected, f"checkpoint/restart broke {target.unit_id}"
    size = sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())
    shutil.rmtree(directory, ignore_errors=True)
    return pool, {
        "seconds": finished - started,
        "save_s": saved - started,
        "restart_s": restarted - saved,
        "load_s": finished - restarted,
        "bytes": 2 * size,
    }


def measure_bandwidth(pool: SlotPool, nbytes: int) -> dict:
    pair = (0, 1)
    pool.run(slot_ops.ensure_groups, groups=[pair])
    out = {}
    for kind in ("broadcast", "all_gather"):
        seconds = max(pool.run(baselines.measure_collective, ranks=pair, nbytes=nbytes, kind=kind))
        out[kind] = nbytes / seconds
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeats", type=int, default=3, help="warm EMU runs per case (the median is reported)"
    )
    args = parser.parse_args()
    rows, records = [], []
    with ray_connection(None, num_cpus=POOL):
        pool = SlotPool.create(POOL, call_timeout_s=600)
        bandwidth = measure_bandwidth(pool, 64 * MIB)
        state = None
        for case in _cases():
            if state is None:
                engine = _setup(pool, case)
                state = _state_bytes(engine, case.sources[0])
            emu = run_emu(pool, case, max(1, args.repeats))
            shard = run_shard_level(pool, case)
            pool, ckpt = run_checkpoint_restart(pool, case)
            must = case.must_move(state)
            # The bytes that must move, at the bandwidth one pair of slots gets from the same gloo
            # collective here: with two cores, concurrent pairs share it rather than add up.
            ideal = must / bandwidth[case.collective] if case.collective in bandwidth else 0.0
            raw = previous = None
            if case.pattern is not None:
                kind, groups, share = case.pattern
                pool.run(slot_ops.ensure_groups, groups=list(groups))
                for name in [kind] + ([case.previous_pattern] if case.previous_pattern else []):
                    seconds = max(
                        pool.run(
                            baselines.measure_pattern,
                            groups=list(groups),
                            nbytes=int(share * state),
                            kind=name,
                        )
                    )
                    raw, previous = (seconds, previous) if name == kind else (raw, seconds)
            warm = emu["warm"]
            data_s = emu["seconds"] - emu["group_setup_s"]
            record = {
                "case": case.name,
                "state_bytes": state,
                "must_move_bytes": must,
                "ideal_s": ideal,
                "emu": emu,
                "shard_level": shard,
                "checkpoint_restart": ckpt,
                "checkpoint_over_emu": ckpt["seconds"] / emu["seconds"],
                "shard_over_emu": shard["seconds"] / emu["seconds"],
                "emu_over_ideal": emu["seconds"] / ideal if ideal else None,
                "emu_data_over_ideal": data_s / ideal if ideal else None,
                "raw_pattern_s": raw,
                "emu_over_raw_pattern": emu["seconds"] / raw if raw else None,
                "raw_previous_pattern_s": previous,
                "previous_pattern": case.previous_pattern,
                "checkpoint_over_warm": ckpt["seconds"] / warm["seconds"],
                "shard_over_warm": shard["seconds"] / warm["seconds"],
                "warm_over_ideal": warm["seconds"] / ideal if ideal else None,
                "warm_over_raw_pattern": warm["seconds"] / raw if raw else None,
            }
            records.append(record)
            rows.append(
                [
                    case.name,
                    f"{emu['seconds']:.3f}",
                    f"{shard['seconds']:.3f}",
                    f"{ckpt['seconds']:.2f}",
                    f"{record['checkpoint_over_emu']:.0f}x",
                    f"{record['shard_over_emu']:.1f}x",
                    f"{emu['bytes'] / MIB:.0f}/{must / MIB:.0f}",
                    f"{shard['bytes'] / MIB:.0f}",
                    f"{ideal:.3f}" if ideal else "-",
                    f"{record['emu_over_ideal']:.2f}x" if ideal else "-",
                    f"{record['emu_data_over_ideal']:.2f}x" if ideal else "-",
                    f"{raw:.3f}" if raw else "-",
                    f"{emu['seconds'] / raw:.2f}x" if raw else "-",
                    f"{warm['seconds']:.3f}",
                    f"{record['shard_over_warm']:.1f}x",
                    f"{record['warm_over_ideal']:.2f}x" if ideal else "-",
                    f"{record['warm_over_raw_pattern']:.2f}x" if raw else "-",
                    f"{emu['group_setup_s']:.3f}",
                    f"{emu['verify_s']:.2f}",
                ]
            )
        pool.close()
    print(
        f"state per unit: {state / MIB:.0f} MiB; gloo on loopback, 64 MiB: broadcast "
        f"{bandwidth['broadcast'] / 1e9:.2f} GB/s, all-gather {bandwidth['all_gather'] / 1e9:.2f} GB/s"
    )
    _report.print_table(
        [
            "case",
            "EMU s",
            "shard s",
            "ckpt s",
            "ckpt/EMU",
            "shard/EMU",
            "EMU MiB moved/min",
            "shard MiB",
            "ideal s",
            "EMU/ideal",
            "data/ideal",
            "raw s",
            "EMU/raw",
            "warm s",
            "shard/warm",
            "warm/ideal",
            "warm/raw",
            "groups s",
            "verify s",
        ],
        rows,
    )
    path = _report.write(
        "transition_cost",
        {
            "model": dataclasses.asdict(MODEL),
            "slots": POOL,
            "repeats": args.repeats,
            "bandwidth_bytes_per_s": bandwidth,
            "results": records,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
