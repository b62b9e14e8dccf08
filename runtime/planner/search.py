"""The global plan search: the lowest predicted step latency whose every slot's memory holds.

A PPO step runs its three stages one after another on the same pool, so the step latency is the sum
of the stage latencies and each stage is planned on the whole pool. Inside a stage the model-stages
either share it *disjointly* (concurrently, on separate slots: the stage takes as long as its
slowest model-stage) or *colocated* (one after another, each on as many slots as it likes). The
disjoint case is a min-max allocation of slots to model-stages, solved exactly by dynamic
programming over model-stages and slot budgets (``min_max_allocation``).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from runtime.bytesize import byte_size, byte_sizes
from runtime.planner import cost, memory
from runtime.planner.catalog import Accelerator
from runtime.planner.plan import Layout, ModelStagePlan, Plan, StagePlan
from runtime.planner.shapes import LayoutShape, batchings, training_state
from runtime.planner.space import Rejection, valid_layouts
from runtime.planner.workload import STAGES, ModelStage, PpoWorkload


class PlanningError(ValueError):
    """No feasible plan: says which constraint binds, for which model-stage, and by how much."""

    def __init__(self, message: str, *, constraint: str, model_stage: str, shortfall: float):
        super().__init__(message)
        self.constraint = constraint
        self.model_stage = model_stage
        self.shortfall = shortfall


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlanResult:
    """The best plan, the next alternatives (each differing in some model-stage's layout), and
    every candidate layout the planner did not take with its binding reason."""

    best: Plan
    alternatives: tuple[Plan, ...]
    rejected: tuple[Rejection, ...]
    elapsed_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class _Column:
    """One model-stage's best option for every slot budget 0..N ("at most g slots")."""

    model_stage: ModelStage
    gpus_per_node: int
    time: np.ndarray  # time[g]: best predicted seconds with at most g slots; inf if none fits
    choice: np.ndarray  # choice[g] = (tp, pp, dp, micro-batch) index into options, -1 if none
    options: list[tuple[int, int, int, int]]


def min_max_allocation(times: Sequence[np.ndarray], budget: int) -> tuple[float, list[int]]:
    """Split at most ``budget`` slots among model-stages so the slowest is as fast as possible.

    ``times[k][g]`` is model-stage k's best time with at most g slots (non-increasing in g, inf
    where nothing fits). The table is ``best[k][b]``: the lowest achievable max over model-stages
    0..k of their times when together they use at most b slots, with ``give[k][b]`` the slots that
    model-stage k gets in that optimum. ``best[k][b] = min_g max(times[k][g], best[k-1][b-g])``; the
    first argument falls and the second rises with g, so the minimum sits where they cross, which a
    bisection finds for all b at once. Returns the optimum and each model-stage's slot count.
    """
    budgets = np.arange(budget + 1)
    best = times[0][: budget + 1].copy()
    gives = [budgets.copy()]
    for k in range(1, len(times)):
        own, prev = times[k][: budget + 1], best
        lo, hi = np.zeros(budget + 1, dtype=np.int64), budgets.copy()
        while np.any(lo < hi):  # smallest g with own[g] <= prev[b - g]
            active = lo < hi
            mid = (lo + hi) // 2
            ok = own[mid] <= prev[budgets - mid]
            hi = np.where(active & ok, mid, hi)
            lo = np.where(active & ~ok, mid + 1, lo)
        at = np.maximum(own[lo], prev[budgets - lo])
        before = np.maximum(own[np.maximum(lo - 1, 0)], prev[np.minimum(budgets - lo + 1, budget)])
        take_before = (lo > 0) & (before < at)
        gives.append(np.where(take_before, lo - 1, lo))
        best = np.where(take_before, before, at)
    allocation, remaining = [], budget
    for k in range(len(times) - 1, -1, -1):
        g = int(gives[k][remaining]) if k else remaining
        allocation.append(g)
        remaining -= g
    allocation.reverse()
    return float(best[budget]), allocation


@dataclasses.dataclass(frozen=True, slots=True)
class _Priced:
    """One (tp, pp) of one model-stage at every dp: what ``fitting`` says of each."""

    dp: np.ndarray
    seconds: np.ndarray
    fits: np.ndarray
    micro: np.ndarray
    need: np.ndarray


class _Prices:
    """Every layout of every model-stage, priced once per search: the best plan, each
    alternative (a re-solve with one layout excluded) and the rejections read the same rows.

    ``resident`` ((training role, bytes per slot)) is the training state every model-stage's
    memory is checked beside, and a training layout keeping more is not taken (so a plan found
    holds what it was checked with); None: each at its least. Other allowances are priced from
    the same tables (``at``): the state only adds a constant to a layout's need."""

    def __init__(self, workload, acc, num_slots: int, efficiency, fits_at, resident=None) -> None:
        self.workload, self.acc, self.num_slots = workload, acc, num_slots
        self.efficiency, self.fits_at = efficiency, fits_at
        self.resident = resident
        self._tables: dict[tuple[str, int, int], tuple[np.ndarray, list]] = {}
        self._rows: dict[tuple[str, int, int], _Priced] = {}

    def at(self, resident) -> _Prices:
        """The same tables beside another allowance of training state."""
        other = _Prices(
            self.workload, self.acc, self.num_slots, self.efficiency, self.fits_at, resident
        )
        other._tables = self._tables
        return other

    def too_heavy(self, ms: ModelStage, tp: int, pp: int) -> float | None:
        """The bytes per slot a training layout keeps when that is more than planned for."""
        if self.resident is None or ms.stage != "training":
            return None
        keeps = _kept_per_slot(ms, self.workload, tp, pp)
        return keeps if keeps > dict(self.resident)[ms.role] * (1 + 1e-9) else None

    def layout(self, ms: ModelStage, tp: int, pp: int) -> _Priced:
        key = (ms.name, tp, pp)
        if key not in self._rows:
            if key not in self._tables:
                max_dp = min(self.num_slots // (tp * pp), self.workload.global_batch)
                dp = np.arange(1, max_dp + 1, dtype=float)
                shape = LayoutShape(
                    ms=ms,
                    workload=self.workload,
                    accelerator=self.acc,
                    tp=tp,
                    pp=pp,
                    dp=dp,
                    resident=_none_kept(self.workload),
                )
                self._tables[key] = (
                    dp,
                    _batching_table(shape, self.num_slots, self.efficiency, self.fits_at),
                )
            dp, table = self._tables[key]
            # The tables hold no training state beside the layout; the allowance adds its own.
            offset = memory.training_state_beside(
                LayoutShape(
                    ms=ms,
                    workload=self.workload,
                    accelerator=self.acc,
                    tp=tp,
                    pp=pp,
                    dp=dp[:1],
                    resident=self.resident,
                ),
                self.num_slots,
            )
            budget = memory.memory_budget(self.acc.memory_bytes)
            self._rows[key] = _Priced(dp, *_select(table, budget, offset))
        return self._rows[key]


def _none_kept(workload: PpoWorkload) -> tuple[tuple[str, float], ...]:
    return tuple((ms.role, 0.0) for ms in workload.model_stages("training"))


def _column(ms: ModelStage, prices: _Prices, excluded: frozenset[tuple[str, int, int]]) -> _Column:
    num_slots = prices.num_slots
    exact = np.full(num_slots + 1, np.inf)
    exact_choice = np.full(num_slots + 1, -1, dtype=np.int64)
    options: list[tuple[int, int, int, int]] = []
    allowed, _ = valid_layouts(ms.model, prices.acc, num_slots, lm_head=not ms.scalar_head)
    for tp, pp in allowed:
        if (ms.name, tp, pp) in excluded or prices.too_heavy(ms, tp, pp) is not None:
            continue
        row = prices.layout(ms, tp, pp)
        dp, total = row.dp, row.seconds
        slots = (dp * tp * pp).astype(np.int64)  # distinct within one layout
        better = np.nonzero(row.fits & (total < exact[slots]))[0]
        exact[slots[better]] = total[better]
        exact_choice[slots[better]] = len(options) + np.arange(len(better))
        options += [(tp, pp, int(dp[i]), int(row.micro[i])) for i in better]
    # "at most g slots": a running minimum over g, choosing where it was last reached
    time_at_most = np.minimum.accumulate(exact)
    reached = np.where(exact <= time_at_most, np.arange(num_slots + 1), 0)
    choice = exact_choice[np.maximum.accumulate(reached)]
    return _Column(
        model_stage=ms,
        gpus_per_node=prices.acc.gpus_per_node,
        time=time_at_most,
        choice=choice,
        options=options,
    )


MAX_SLOTS = 65_536
"""The largest pool ``plan`` takes: its tables are one column per slot count, so a mistyped
count of 10^20 would exhaust memory before saying anything."""


def fitting(
    shape: LayoutShape,
    num_slots: int,
    efficiency: Mapping[str, float],
    fits_at: PpoWorkload | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For every dp of ``shape``: predicted seconds, whether it fits the memory budget (at
    ``fits_at`` when given), its micro-batch and the bytes per slot it needs. The micro-batch is
    the fastest of the model-stage's ``batchings`` that fits (the largest among equals: a
    pipeline drains its bubble faster in smaller ones; each tensor-parallel all-reduce pays its
    latency once per micro-batch; generation decodes in more waves only to fit), else the
    smallest, which needs the least."""
    table = _batching_table(shape, num_slots, efficiency, fits_at)
    return _select(table, memory.memory_budget(shape.accelerator.memory_bytes), 0.0)


def _batching_table(shape, num_slots, efficiency, fits_at) -> list:
    """(micro-batch, seconds, bytes per slot) of every batching of ``shape``, most memory first."""
    table = []
    for size in batchings(shape):
        at = dataclasses.replace(shape, micro_batch=size)
        seconds, _ = cost.predict(at, num_slots=num_slots, efficiency=efficiency)
        held = at if fits_at is None else dataclasses.replace(at, workload=fits_at)
        table.append(
            (size, seconds, memory.total_bytes(memory.memory_breakdown(held, num_slots=num_slots)))
        )
    return table


def _select(table, budget: float, offset: float):
    """``fitting``'s choice from a batching table whose needs grow by ``offset`` bytes."""
    total = fits = micro = need = None
    for size, seconds, bytes_ in table:
        bytes_ = bytes_ + offset
        ok = bytes_ <= budget
        if total is None:
            total, fits, need, micro = seconds, ok, bytes_, np.full_like(seconds, size)
            continue
        # Smaller and fitting where faster or where nothing fitted yet; the smallest where
        # nothing fits at all.
        take = (ok & (~fits | (seconds < total))) | (~fits & ~ok)
        total = np.where(take, seconds, total)
        micro = np.where(take, size, micro)
        need = np.where(take, bytes_, need)
        fits = fits | ok
    return total, fits, micro, need


def _infeasible(
    column: _Column,
    workload: PpoWorkload,
    acc: Accelerator,
    num_slots: int,
    excluded: frozenset[tuple[str, int, int]] = frozenset(),
    resident=None,
) -> PlanningError:
    """Explain why a model-stage fits nowhere: too little memory and by how much, or exclusions
    (beside ``resident`` training state, as ``_Prices``)."""
    ms = column.model_stage
    allowed, _ = valid_layouts(
        ms.model, acc, num_slots, lm_head=not ms.scalar_head
    )  # never empty: (1, 1) always fits
    budget = memory.memory_budget(acc.memory_bytes)
    least, where = np.inf, None
    for tp, pp in allowed:
        dp = np.arange(
            1, max(1, min(num_slots // (tp * pp), workload.global_batch)) + 1, dtype=float
        )
        shape = LayoutShape(
            ms=ms, workload=workload, accelerator=acc, tp=tp, pp=pp, dp=dp, resident=resident
        )
        shape = dataclasses.replace(shape, micro_batch=batchings(shape)[-1])
        need = memory.total_bytes(memory.memory_breakdown(shape, num_slots=num_slots))
        i = int(np.argmin(need))
        if need[i] < least:
            least, where = float(need[i]), (int(dp[i]), tp, pp)
    over = least - budget
    if over <= 0:  # memory is not what binds: the caller excluded every layout that fits
        banned = sorted((tp, pp) for name, tp, pp in excluded if name == ms.name)
        return PlanningError(
            f"excluded: every layout of {ms.name} that fits is excluded (tp, pp) in {banned}",
            constraint="excluded",
            model_stage=ms.name,
            shortfall=0.0,
        )
    beside = ""
    if resident is not None:
        others = [(r, v) for r, v in resident if not (ms.stage == "training" and r == ms.role)]
        if others:
            each = byte_sizes(*(v for _, v in others))  # each model's own, told apart
            named = ", ".join(
                f"{role} {size}" for (role, _), size in zip(others, each, strict=True)
            )
            total = byte_size(sum(v for _, v in others))
            beside = f", beside {total} of training state kept per slot ({named})"
    need, budget_text = byte_sizes(least, budget)
    return PlanningError(
        f"memory: {ms.name} needs at least {need} per slot (dp,tp,pp)="
        f"({where[0]},{where[1]},{where[2]}){beside}, {byte_size(over)} over the "
        f"{budget_text} budget of {acc.name} ({byte_size(acc.memory_bytes)} less "
        f"{memory.HEADROOM:.0%} headroom)",
        constraint="memory",
        model_stage=ms.name,
        shortfall=over,
    )


def _model_stage_plan(
    column: _Column,
    option: int,
    first_slot: int,
    workload: PpoWorkload,
    acc: Accelerator,
    num_slots: int,
    efficiency: Mapping[str, float],
    resident,
) -> ModelStagePlan:
    tp, pp, dp, micro_batch = column.options[option]
    layout = Layout(dp=dp, tp=tp, pp=pp)
    size = tp * pp
    return ModelStagePlan(
        name=column.model_stage.name,
        layout=layout,
        units=tuple(
            tuple(range(first_slot + u * size, first_slot + (u + 1) * size)) for u in range(dp)
        ),
        micro_batch=micro_batch,
        **_described(
            column.model_stage, workload, acc, layout, micro_batch, num_slots, efficiency, resident
        ),
    )


def _described(ms, workload, acc, layout, micro_batch, num_slots, efficiency, resident) -> dict:
    """A model-stage plan's predicted seconds, their breakdown and its memory per slot."""
    shape = LayoutShape.of_layout(ms, workload, acc, layout, micro_batch, resident)
    total, breakdown = cost.predict(shape, num_slots=num_slots, efficiency=efficiency)
    mem = memory.memory_breakdown(shape, num_slots=num_slots)
    return {
        "predicted_s": float(total[0]),
        "breakdown": tuple((k, float(v[0])) for k, v in breakdown.items() if float(v[0]) > 0),
        "memory_per_slot": tuple((k, float(v[0])) for k, v in mem.items() if float(v[0]) > 0),
    }


def rebatched(
    plan_: Plan,
    workload: PpoWorkload,
    accelerator: Accelerator,
    *,
    efficiency: Mapping[str, float] | None = None,
    fits_at: PpoWorkload | None = None,
) -> Plan | None:
    """``plan_``'s layouts on its slots, each model-stage in the micro-batch the search would
    give that layout now (the fastest that fits, at ``fits_at`` too; for generation, the fewest
    waves); None when some layout fits in none. Moving to it moves no state."""
    eff = _efficiencies(efficiency)
    resident = training_state(plan_, workload)
    chosen: dict[str, ModelStagePlan] = {}
    for ms in workload.model_stages():
        running = plan_.model_stage(ms.name)
        shape = LayoutShape.of_layout(ms, workload, accelerator, running.layout, 0, resident)
        _, fits, micro, _ = fitting(shape, plan_.num_slots, eff, fits_at)
        if not fits[0]:
            return None
        size = int(micro[0])
        described = _described(
            ms, workload, accelerator, running.layout, size, plan_.num_slots, eff, resident
        )
        chosen[ms.name] = dataclasses.replace(running, micro_batch=size, **described)
    stages = []
    for stage in plan_.stages:
        times = [chosen[ms.name].predicted_s for ms in workload.model_stages(stage.stage)]
        stages.append(dataclasses.replace(stage, predicted_s=stage_time(stage.mode, times)))
    return dataclasses.replace(
        plan_,
        model_stages=tuple(chosen[ms.name] for ms in plan_.model_stages),
        stages=tuple(stages),
        predicted_step_s=sum(s.predicted_s for s in stages),
    )


def _alignment(tp: int, pp: int, dp: int, gpus_per_node: int) -> int:
    """The slot multiple a model-stage's block must start on for the links its cost assumed:
    the whole block if it is priced inside a node, else each unit if that is, else each TP group."""

    def inside(n: int) -> bool:
        return n <= gpus_per_node and n & (n - 1) == 0

    if inside(tp * pp * dp):
        return tp * pp * dp
    if inside(tp * pp):
        return tp * pp
    return tp


def _plan_stage(columns: list[_Column], num_slots: int):
    """Best mode and slot split for one stage: (seconds, mode, [(column, option, first_slot)])."""
    if len(columns) == 1:
        column = columns[0]
        return (
            float(column.time[num_slots]),
            "disjoint",
            [(column, int(column.choice[num_slots]), 0)],
        )
    disjoint_s, allocation = min_max_allocation([c.time for c in columns], num_slots)
    colocated_s = float(sum(c.time[num_slots] for c in columns))
    if colocated_s < disjoint_s:
        return colocated_s, "colocated", [(c, int(c.choice[num_slots]), 0) for c in columns]
    # Buddy placement: blocks in decreasing order of the alignment they need. Every block's size is
    # a multiple of its alignment, and every alignment is a power of two dividing the ones before,
    # so each block starts on a multiple of its own alignment with no gap.
    picks = [(c, int(c.choice[g])) for c, g in zip(columns, allocation, strict=True)]
    picks.sort(key=lambda pick: -_alignment(*pick[0].options[pick[1]][:3], pick[0].gpus_per_node))
    placed, first = [], 0
    for column, option in picks:
        placed.append((column, option, first))
        tp, pp, dp, _ = column.options[option]
        first += tp * pp * dp
    return disjoint_s, "disjoint", placed


def plan(
    workload: PpoWorkload,
    accelerator: Accelerator,
    num_slots: int,
    *,
    efficiency: Mapping[str, float] | None = None,
    num_alternatives: int = 3,
    excluded: frozenset[tuple[str, int, int]] = frozenset(),
    fits_at: PpoWorkload | None = None,
) -> PlanResult:
    """Plan every model-stage of a PPO step on ``num_slots`` slots; deterministic for its inputs.

    Speed is priced at ``workload``; memory is checked at ``fits_at`` when given (the same job
    at a longer generated length that the plan must also fit: the controller plans for the
    length a plan must last to, but picks the fastest at the length it runs now)."""
    if fits_at is not None and fits_at.gen_len < workload.gen_len:
        raise ValueError(
            f"fits_at.gen_len: must be at least the workload's {workload.gen_len}, "
            f"got {fits_at.gen_len}"
        )
    if isinstance(num_slots, np.integer):
        num_slots = int(num_slots)
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"gpus: must be a positive whole number of slots, got {num_slots!r}")
    if num_slots > MAX_SLOTS:
        raise ValueError(f"gpus: at most {MAX_SLOTS} slots are planned for, got {num_slots}")
    started = time.perf_counter()
    eff = _efficiencies(efficiency)
    best, prices, columns = _search(workload, accelerator, num_slots, eff, excluded, fits_at)
    alternatives = _alternatives(best, prices, excluded, num_alternatives)
    rejected = _rejections(best, columns, prices, excluded)
    return PlanResult(
        best=best,
        alternatives=alternatives,
        rejected=rejected,
        elapsed_s=time.perf_counter() - started,
    )


def _search(workload, accelerator, num_slots, eff, excluded, fits_at):
    """The best plan whose memory counts the training state it lays out itself.

    The training units keep their state on their slots through the whole step, so every
    model-stage's memory depends on the training layouts the search picks. The search is solved
    beside each allowance of training state per slot that some training layout keeps, taking no
    training layout that keeps more (so a plan found holds what it was checked with), and the
    fastest plan of all is the answer: more room for that state allows faster training layouts
    and leaves less for the rest. The allowances share one table of prices."""
    base = _Prices(workload, accelerator, num_slots, eff, fits_at)
    # Only the bytes a training layout that fits keeps (beside the other training model kept
    # at the same) can be what the best plan keeps; nearly equal ones (the critic's head is
    # smaller than the actor's) are one allowance.
    kept = sorted(
        (
            (_kept_per_slot(ms, workload, tp, pp), ms, tp, pp)
            for ms in workload.model_stages("training")
            for tp, pp in valid_layouts(
                ms.model, accelerator, num_slots, lm_head=not ms.scalar_head
            )[0]
        ),
        key=lambda entry: entry[0],  # equal bytes happen (tied embeddings): never compare the rest
    )
    clusters: list[list] = []
    for entry in kept:
        if clusters and entry[0] <= clusters[-1][0][0] * 1.005:
            clusters[-1].append(entry)
        else:
            clusters.append([entry])
    levels: list[float] = []
    for cluster in clusters:
        level = cluster[-1][0]
        at = base.at(_allow(level, workload))
        if any(at.layout(ms, tp, pp).fits.any() for _, ms, tp, pp in cluster):
            levels.append(level)
    allowances = [_allow(level, workload) for level in levels]
    if not levels:  # no training layout fits beside anything: say why, beside the least each
        # training model keeps and beside its unsharded state (every training layout
        # allowed), each model's its own (the actor's vocabulary head keeps more than the
        # critic's scalar one); the refusal below names the smaller shortfall (the unsharded
        # state alone overstated the state beside the other model-stages thirtyfold where
        # sharding was what came closest)
        training = workload.model_stages("training")
        least = tuple(
            (ms.role, min((k for k, other, _, _ in kept if other.name == ms.name), default=0.0))
            for ms in training
        )
        unsharded = tuple((ms.role, _kept_per_slot(ms, workload, 1, 1)) for ms in training)
        allowances = [least] if least == unsharded else [least, unsharded]
    found, errors = [], []
    for allowance in allowances:
        try:
            found.append(_solve(base.at(allowance), excluded))
        except PlanningError as exc:
            errors.append(exc)
    if not found or not levels:  # each training model beside the other's own allowance
        found += _own_allowances(base, kept, workload, excluded)
    if not found:
        # Say what binds where the plan comes closest to fitting: the smallest shortfall.
        memory_errors = [e for e in errors if e.constraint == "memory"]
        raise min(memory_errors, key=lambda e: e.shortfall) if memory_errors else errors[-1]
    return min(found, key=lambda r: r[0].predicted_step_s)


def _allow(level: float, workload: PpoWorkload) -> tuple[tuple[str, float], ...]:
    return tuple((ms.role, level) for ms in workload.model_stages("training"))


def _own_allowances(base: _Prices, kept, workload: PpoWorkload, excluded) -> list:
    """Plans beside an allowance of training state per slot for each training model on its own,
    where no one allowance for both fits: the actor's vocabulary head makes its layouts keep more
    than the critic's same layouts (tp=4: 2 GiB more of an 8B model), and on a small pool the
    actor may fit beside the critic's state only where the critic keeps its own, smaller, state.
    Tried only then: each pair of allowances is one more search."""
    levels: dict[str, list[float]] = {}
    for nbytes, ms, _, _ in kept:  # each role's distinct allowances, nearly equal ones as one
        own = levels.setdefault(ms.role, [])
        if own and nbytes <= own[-1] * 1.005:
            own[-1] = nbytes
        else:
            own.append(nbytes)
    roles = [ms.role for ms in workload.model_stages("training")]
    found = []
    for allowance in itertools.product(*(levels.get(role, [0.0]) for role in roles)):
        if len(set(allowance)) < 2:
            continue  # one allowance for both: searched already
        prices = base.at(tuple(zip(roles, allowance, strict=True)))
        if not all(
            any(
                prices.too_heavy(ms, tp, pp) is None and prices.layout(ms, tp, pp).fits.any()
                for _, other, tp, pp in kept
                if other.name == ms.name
            )
            for ms in workload.model_stages("training")
        ):
            continue  # some training model fits nowhere beside the other's allowance
        try:
            found.append(_solve(prices, excluded))
        except PlanningError:
            continue
    return found


def _solve(prices: _Prices, excluded):
    """The best plan at ``prices``' allowance of training state: it, the prices and the
    columns it was read from; raises PlanningError when some model-stage fits nowhere."""
    workload, accelerator, num_slots = prices.workload, prices.acc, prices.num_slots
    columns = {ms.name: _column(ms, prices, excluded) for ms in workload.model_stages()}
    for column in columns.values():
        if not np.isfinite(column.time[num_slots]):
            raise _infeasible(
                column,
                prices.fits_at or workload,
                accelerator,
                num_slots,
                excluded,
                prices.resident,
            )
    best = _assemble(columns, workload, accelerator, num_slots, prices.efficiency, prices.resident)
    return best, prices, columns


def _kept_per_slot(ms: ModelStage, workload: PpoWorkload, tp: int, pp: int) -> float:
    """Bytes of state a training layout keeps on the fullest slot of its units (at dp 1: with a
    distributed optimizer more replicas keep less)."""
    return float(
        LayoutShape.of_layout(ms, workload, None, Layout(dp=1, tp=tp, pp=pp)).kept_per_slot[0]
    )


def _assemble(columns, workload, accelerator, num_slots, eff, resident) -> Plan:
    stage_plans, ms_plans = [], []
    for stage in STAGES:
        stage_columns = [columns[ms.name] for ms in workload.model_stages(stage)]
        seconds, mode, placed = _plan_stage(stage_columns, num_slots)
        stage_plans.append(StagePlan(stage=stage, mode=mode, predicted_s=seconds))
        built = {
            column.model_stage.name: _model_stage_plan(
                column, option, first, workload, accelerator, num_slots, eff, resident
            )
            for column, option, first in placed
        }
        ms_plans += [built[c.model_stage.name] for c in stage_columns]
    return Plan(
        accelerator=accelerator.name,
        num_slots=num_slots,
        model_stages=tuple(ms_plans),
        stages=tuple(stage_plans),
        predicted_step_s=sum(s.predicted_s for s in stage_plans),
        models=tuple(sorted((role, model.name) for role, model in workload.models.items())),
        training_state=tuple(resident or ()),
    )


def _alternatives(best, prices: _Prices, excluded, count) -> tuple[Plan, ...]:
    """The best plans that change one model-stage's (tp, pp): re-solve with that layout excluded."""
    if count <= 0:
        return ()
    workload, num_slots = prices.workload, prices.num_slots
    found: dict[tuple, Plan] = {}
    for ms in best.model_stages:
        ban = excluded | {(ms.name, ms.layout.tp, ms.layout.pp)}
        columns = {m.name: _column(m, prices, ban) for m in workload.model_stages()}
        if any(not np.isfinite(c.time[num_slots]) for c in columns.values()):
            continue
        candidate = _assemble(
            columns, workload, prices.acc, num_slots, prices.efficiency, prices.resident
        )
        key = tuple(sorted((n, str(lay)) for n, lay in candidate.layouts().items()))
        if candidate.layouts() != best.layouts():
            found.setdefault(key, candidate)
    ranked = sorted(
        found.values(), key=lambda p: (p.predicted_step_s, str(sorted(p.layouts().items())))
    )
    return tuple(ranked[:count])


def _rejections(best, columns, prices: _Prices, excluded) -> tuple[Rejection, ...]:
    """Every (tp, pp) of every model-stage's grid that the best plan does not use, with its reason."""
    workload, accelerator, num_slots = prices.workload, prices.acc, prices.num_slots
    out: list[Rejection] = []
    budget = memory.memory_budget(accelerator.memory_bytes)
    modes = {s.stage: s.mode for s in best.stages}
    for ms_plan in best.model_stages:
        column = columns[ms_plan.name]
        ms = column.model_stage
        shared = modes[ms.stage] == "disjoint" and len(workload.model_stages(ms.stage)) > 1
        # Under a disjoint split a model-stage competes with the others for slots: compare layouts
        # on the slots it was given; otherwise on the whole pool.
        limit = ms_plan.layout.num_slots if shared else num_slots
        allowed, refused = valid_layouts(
            ms.model, accelerator, num_slots, lm_head=not ms.scalar_head
        )
        out += [Rejection(model_stage=ms.name, tp=tp, pp=pp, reason=r) for tp, pp, r in refused]
        chosen = (ms_plan.layout.tp, ms_plan.layout.pp)
        for tp, pp in allowed:
            if (tp, pp) == chosen:
                continue
            if (ms.name, tp, pp) in excluded:
                out.append(
                    Rejection(model_stage=ms.name, tp=tp, pp=pp, reason="excluded by the caller")
                )
                continue
            keeps = prices.too_heavy(ms, tp, pp)
            if keeps is not None:
                keeps_text, room = byte_sizes(keeps, dict(prices.resident)[ms.role])
                reason = (
                    f"memory: keeps {keeps_text} of training state per slot through the "
                    f"step, more than the {room} the other model-stages were planned beside"
                )
                out.append(Rejection(model_stage=ms.name, tp=tp, pp=pp, reason=reason))
                continue
            row = prices.layout(ms, tp, pp)
            dp, total, need = row.dp, row.seconds, row.need
            within = dp * tp * pp <= limit
            if not np.any(need <= budget):
                at_best, budget_text = byte_sizes(float(need.min()), budget)
                reason = (
                    f"memory: needs {at_best} per slot at best "
                    f"(dp={int(dp[np.argmin(need)])}), budget {budget_text}"
                )
            elif not np.any((need <= budget) & within):
                fewest = int(dp[np.argmax(need <= budget)]) * tp * pp
                reason = (
                    f"slots: its smallest configuration that fits in memory takes {fewest} "
                    f"slots; {ms_plan.name} has {limit} in this plan"
                )
            else:
                total = np.where((need <= budget) & within, total, np.inf)
                i = int(np.argmin(total))
                reason = (
                    f"slower: {total[i]:.3f} s at dp={int(dp[i])} on at most {limit} slots, "
                    f"against {ms_plan.predicted_s:.3f} s for the chosen {ms_plan.layout}"
                )
            out.append(Rejection(model_stage=ms.name, tp=tp, pp=pp, reason=reason))
    return tuple(out)


def _efficiencies(efficiency: Mapping[str, float] | None) -> dict[str, float]:
    """Defaults overridden by ``efficiency``; every value must be a known class in (0, 1]."""
    for op_class, value in (efficiency or {}).items():
        if op_class not in cost.DEFAULT_EFFICIENCY:
            raise ValueError(
                f"efficiency.{op_class}: unknown operation class; valid: "
                f"{', '.join(cost.OPERATION_CLASSES)}"
            )
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
            raise ValueError(f"efficiency.{op_class}: must be a number in (0, 1], got {value!r}")
    return {**cost.DEFAULT_EFFICIENCY, **(efficiency or {})}


def stage_time(mode: str, seconds: Sequence[float]) -> float:
    """A stage's time from its model-stages': one after another when colocated, else the
    slowest of them running side by side."""
    return sum(seconds) if mode == "colocated" else max(seconds)


def stage_prices(
    plan_: Plan,
    workload: PpoWorkload,
    accelerator: Accelerator,
    *,
    efficiency: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Predicted seconds of each stage of an existing plan's layouts under a workload and
    efficiencies."""
    eff = _efficiencies(efficiency)
    modes = {s.stage: s.mode for s in plan_.stages}
    seconds = {stage: [] for stage in STAGES}
    for ms in workload.model_stages():
        shape = LayoutShape.of_plan(ms, workload, accelerator, plan_)
        total, _ = cost.predict(shape, num_slots=plan_.num_slots, efficiency=eff)
        seconds[ms.stage].append(float(total[0]))
    return {stage: stage_time(modes[stage], ts) for stage, ts in seconds.items()}


def price_plan(
    plan_: Plan,
    workload: PpoWorkload,
    accelerator: Accelerator,
    *,
    efficiency: Mapping[str, float] | None = None,
) -> float:
    """Predicted step seconds of an existing plan's layouts under a workload and efficiencies
    (for comparing the running plan with a candidate under the same calibrated model)."""
    return sum(stage_prices(plan_, workload, accelerator, efficiency=efficiency).values())


def on_ready(
    plan_: Plan,
    workload: PpoWorkload,
    accelerator: Accelerator,
    building: Collection[tuple[str, tuple[int, ...]]],
    *,
    efficiency: Mapping[str, float] | None = None,
) -> Plan | None:
    """``plan_`` as it runs while its units ``building`` ((model-stage, slots)) are still being
    built: each generation model-stage among them on its other units only, which share its
    sequences between them (the other stages wait for their units). Each decodes as many at
    once as the search would give it: the fastest that fits ``accelerator``'s memory (pass the
    memory the devices really give), else as many as a unit of the whole plan does. Generation
    units are independent engines, so a generation stage can run on any of its units. None
    when some generation model-stage has no unit built yet."""
    eff = _efficiencies(efficiency)
    changed = {}
    for ms in workload.model_stages():
        running = plan_.model_stage(ms.name)
        if ms.stage != "generation" or not any((ms.name, u) in building for u in running.units):
            continue
        units = tuple(u for u in running.units if (ms.name, u) not in building)
        if not units:
            return None
        layout = dataclasses.replace(running.layout, dp=len(units))
        whole = LayoutShape.of_plan(ms, workload, accelerator, plan_)
        shape = LayoutShape.of_layout(ms, workload, accelerator, layout, 0, whole.resident)
        _, fits, micro, _ = fitting(shape, plan_.num_slots, eff)
        size = int(micro[0]) if fits[0] else int(whole.concurrent[0])
        changed[ms.name] = dataclasses.replace(
            running, layout=layout, units=units, micro_batch=size
        )
    return dataclasses.replace(
        plan_, model_stages=tuple(changed.get(ms.name, ms) for ms in plan_.model_stages)
    )
