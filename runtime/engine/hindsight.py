"""Hindsight on a simulated run: why each transition was made, and what each move made for its
saving truly saved. Every figure here is simulated.

Only the simulated engine can say the second: it knows the true model that the planner learns
from measurements, and it keeps the plan and clock of every step it ran
(``SimulatedEngine.history``). A move admitted because it repays itself was priced on what the
controller had learned, at the length, load and pool of that moment; the world then moves on.
Hindsight replays the steps that followed and ran to their end: at each, the true seconds
(noise aside) of the plan that step ran, against the same plan with the model-stages the move
changed back as they were (those the run has not changed again since; a later change of one is
the later move's), at the length the step ran at and the link load of its time. The move's life
ends where that comparison stops meaning anything: the pool changes (the old plan would have
been replanned too), a model-stage whose TP or PP the move changed moves again, a stage's mode
changes, another model-stage takes the old slots, or the old layouts would no longer have fitted
in memory. A failed transition is not replayed, nor one followed by another change before the
next step (which plan is whose would be a guess). A slot that fails without the pool changing
does not end a life. A move that repays within its horizon can lose after it, and one that seems to lose over
the next stretch can win over its life.

What a move bought beyond its life takes the run again: ``replayed`` makes it from its seeds
without the moves made for their saving (all of them, and each alone from a copy taken before
its decision), with the controller's ``veto`` refusing them, and compares the two runs' clocks.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
from collections.abc import Callable, Sequence

from runtime.control.admission import MOVE_REASONS, why_moved
from runtime.control.controller import Controller, run_job
from runtime.engine.sim import SimulatedEngine
from runtime.planner.plan import ModelStagePlan, Plan, PlanError
from runtime.planner.workload import PpoWorkload

REASONS = MOVE_REASONS


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoveHindsight:
    """One transition of a run; the fields after ``cost_s`` only for a move made for its
    saving."""

    step: int
    """The last step run before the transition (-1: none)."""
    decided: int | None = None
    """The step of the decision it carried out (``step`` or earlier: a move whose new units
    were built during one more step runs a step after it was admitted); None if unknown."""
    why: str
    cost_s: float
    """The transition's seconds, and what admission charged its first step for the new units
    that joined during it (``joining_s``)."""
    moved: tuple[tuple[str, tuple[int, int], tuple[int, int]], ...] = ()
    """(model-stage, (tp, pp) before, (tp, pp) after) of those whose layout changed (or, if
    none did, of those whose units or micro-batches did)."""
    predicted_saving_s: float | None = None
    """Seconds per step admission priced the move to save."""
    true_saving_s: float | None = None
    """Seconds the move truly saved over its life, in all; None where it was not replayed
    (not made for a saving, failed, or no step ran after it)."""
    steps: int = 0
    """The steps of its life."""
    until: str = ""
    """What ended its life (or why it was not replayed)."""

    @property
    def net_s(self) -> float | None:
        """What the move truly saved less what it cost."""
        return None if self.true_saving_s is None else self.true_saving_s - self.cost_s

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["moved"] = [
            {"model_stage": n, "before": list(a), "after": list(b)} for n, a, b in self.moved
        ]
        out["net_s"] = self.net_s
        return out


def reason(because: dict | None) -> str:
    """``REASONS``' name for what made a transition, from what it says of the decision it
    carried out (``because``: its trigger's kind, its reason)."""
    if because is None:
        return "other"
    # The controller's own word where the decision carries it (a move off a plan that could no
    # longer run is urgent whatever its trigger); else from its trigger and reason.
    return because.get("why") or why_moved(because["trigger"], str(because.get("reason") or ""))


def _entry(ms: ModelStagePlan) -> tuple:
    """What a move changes about a model-stage: its layout, its units' slots, its
    micro-batch."""
    return (ms.layout, ms.units, ms.micro_batch)


def _tp_pp(ms: ModelStagePlan) -> tuple[int, int]:
    return (ms.layout.tp, ms.layout.pp)


def moves(
    events: Sequence[dict], engine: SimulatedEngine, workload: PpoWorkload
) -> list[MoveHindsight]:
    """Every transition in ``events`` (a controller's, run on ``engine``), with why it was
    made and, for a move made for its saving that succeeded, what it truly saved over its life
    (the module's docstring). Each transition names the last step run before it and the
    decision it carried out (``step``, ``because``). ``workload``: the job's."""
    out = []
    steps = sorted(engine.history)
    moved_at: dict[int, dict] = {}  # step: the target of the last transition after it
    for event in events:
        if event["event"] != "control.transition":
            continue
        because, step = event["because"], event["step"]
        why = reason(because)
        joining_s = float((event.get("dag") or {}).get("joining_s") or 0.0)
        move = MoveHindsight(
            step=step,
            decided=(because or {}).get("step"),
            why=why,
            cost_s=event["actual_s"] + joining_s,
        )
        if why == "saving" and event.get("ok", True) and step in engine.history:
            before = moved_at.get(step)  # another transition at the same boundary first
            old = Plan.from_json(before) if before else engine.history[step].plan
            move = _life(
                engine, workload, steps, move, old, event.get("target"), because["saving_s"]
            )
        if event.get("ok", True) and event.get("target"):
            moved_at[step] = event["target"]
        out.append(move)
    return out


def _life(
    engine: SimulatedEngine,
    workload: PpoWorkload,
    steps: list[int],
    move: MoveHindsight,
    old: Plan,
    target: dict | None,
    predicted_saving_s: float | None,
) -> MoveHindsight:
    after = steps[bisect.bisect_right(steps, move.step) :]
    if not after:
        return move
    new = engine.history[after[0]].plan
    if target is not None and Plan.from_json(target).model_stages != new.model_stages:
        return dataclasses.replace(move, until="another change came before the next step")
    changed = {
        ms.name: ms for ms in old.model_stages if _entry(ms) != _entry(new.model_stage(ms.name))
    }
    relaid = [n for n, ms in changed.items() if _tp_pp(ms) != _tp_pp(new.model_stage(n))]
    moved = relaid or list(changed)
    saved, lived, until = 0.0, 0, "the run ended"
    for later in after:
        ran = engine.history[later]
        if ran.plan.num_slots != new.num_slots:
            until = f"the pool changed at step {later}"
            break
        if any(_tp_pp(ran.plan.model_stage(n)) != _tp_pp(new.model_stage(n)) for n in moved):
            until = f"step {later} moved them again"
            break
        if [s.mode for s in ran.plan.stages] != [s.mode for s in new.stages]:
            until = f"step {later} changed how a stage shares its slots"
            break
        back = _back(ran.plan, new, old, changed)
        if back is None:
            until = f"step {later} gave their old slots to others"
            break
        seconds, _ = engine.replay(ran.plan, workload, ran)
        old_s, failure = engine.replay(back, workload, ran)
        if failure:
            until = f"their old layouts would not have fitted at step {later}"
            break
        saved += old_s - seconds
        lived += 1
    return dataclasses.replace(
        move,
        moved=tuple((n, _tp_pp(old.model_stage(n)), _tp_pp(new.model_stage(n))) for n in moved),
        predicted_saving_s=predicted_saving_s,
        true_saving_s=saved,
        steps=lived,
        until=until,
    )


def _back(ran: Plan, new: Plan, old: Plan, changed: dict[str, ModelStagePlan]) -> Plan | None:
    """``ran`` with the model-stages the move changed, where the run has not changed them
    again, as they were before it (with the stages' modes then); None where that plan is not
    one (another model-stage holds their old slots)."""
    try:
        return dataclasses.replace(
            ran,
            stages=old.stages,
            model_stages=tuple(
                changed[ms.name]
                if ms.name in changed and _entry(ms) == _entry(new.model_stage(ms.name))
                else ms
                for ms in ran.model_stages
            ),
        )
    except PlanError:
        return None


def summary(hindsight: Sequence[MoveHindsight]) -> dict:
    """A run's transitions by reason, and its moves made for their saving: how many, how many
    truly repaid their own seconds over their life, and what they saved less what they cost,
    in all (simulated)."""
    made = [m for m in hindsight if m.true_saving_s is not None]
    return {
        "simulated": True,
        "transitions": {why: sum(m.why == why for m in hindsight) for why in REASONS},
        "moves_for_saving": len(made),
        "repaid": sum(m.net_s > 0 for m in made),
        "net_s": sum(m.net_s for m in made),
    }


# --- counterfactual replays -------------------------------------------------------------------

VETO_ALL = "hindsight: the same run without moves made for their saving"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Counterfactual:
    """The run as it ran against the same run, from the same seeds, with moves made for their
    saving refused (``veto``): the seconds the run took each way. Every figure is simulated."""

    step: int
    """The move's step (``MoveHindsight.step``); -1 for the whole run's saving moves."""
    moved: tuple[tuple[str, tuple[int, int], tuple[int, int]], ...] = ()
    run_s: float
    """The run's seconds, all steps, as it ran."""
    without_s: float
    """The same run's seconds with the veto."""
    refused: int
    """Admissions the veto refused in the replay (0: the replay never met the move)."""
    refused_at: int | None = None
    """The step of the first decision the veto refused (the move's own, ``decided``)."""
    decided: int | None = None
    """The step of the decision the move carried out (``MoveHindsight.decided``)."""

    @property
    def met(self) -> bool:
        """The replay refused the move itself, at its decision: else its figure is not the
        move's (the run again, or a later move's), and is not counted."""
        return self.refused_at is not None and self.decided in (None, self.refused_at)

    @property
    def net_s(self) -> float:
        """What the moves bought, their own cost and everything that followed from them
        included: positive when the run was faster for them."""
        return self.without_s - self.run_s

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["moved"] = [
            {"model_stage": n, "before": list(a), "after": list(b)} for n, a, b in self.moved
        ]
        out["net_s"] = self.net_s
        out["met"] = self.met
        out["simulated"] = True
        return out


Start = Callable[[], tuple[SimulatedEngine, Controller]]
"""Makes a simulated job afresh: its engine and controller, from the same seeds each time."""


def without_saving_moves(start: Start, steps: int, run_s: float) -> Counterfactual:
    """The run again with every move made for its saving refused (moves for slots, memory,
    failures and overrides are made as before): what the policy's moves for a saving bought,
    taken together. ``run_s``: the seconds of the run as it ran (``start``'s, all ``steps``)."""
    engine, controller = start()
    controller.veto = lambda running, candidate, step: VETO_ALL
    run_job(engine, controller, steps)
    return Counterfactual(
        step=-1, run_s=run_s, without_s=engine.now(), refused=_refusals(controller)
    )


def counterfactuals(
    start: Start, steps: int, seen: Sequence[MoveHindsight]
) -> list[Counterfactual]:
    """For each move of ``seen`` made for its saving that in-run hindsight replayed (``moves``
    of the run ``start`` makes: its next step ran what it made), the same run with that move
    refused (``_veto_of``: and any other move for a saving into what it made of its
    model-stages, for as long as the run as it ran kept them so). The run is made again and
    copied (``copy.deepcopy``) before the step of the decision each such move carried out;
    each copy goes on with the veto to the run's end. The replays share the steps' noise (the
    engine draws it per step), so what differs is what the move did. One replay of the run's
    remainder per move, after one run to take the copies."""
    wanted = [m for m in seen if m.why == "saving" and m.moved]
    if not wanted:
        return []
    at = {id(m): max(0, m.step if m.decided is None else min(m.decided, m.step)) for m in wanted}
    snapshots: dict[int, tuple[SimulatedEngine, Controller]] = {}
    engine, controller = start()

    def snapshot(step: int) -> bool:
        if step in at.values():
            snapshots[step] = _copy(engine, controller)
        return True

    run_job(engine, controller, steps, between_steps=snapshot)
    out = []
    for move in wanted:
        copied_engine, copied = _copy(*snapshots[at[id(move)]])
        targets = _targets(move, engine)
        copied.veto = _veto_of(
            move, targets, copied_engine, _kept_until(move, targets, engine, steps)
        )
        run_job(copied_engine, copied, steps, resume_at=at[id(move)])
        out.append(
            Counterfactual(
                step=move.step,
                moved=move.moved,
                run_s=engine.now(),
                without_s=copied_engine.now(),
                refused=_refusals(copied),
                refused_at=next(iter(_refused_steps(copied)), None),
                decided=move.decided,
            )
        )
    return out


def replayed(start: Start, steps: int, seen: Sequence[MoveHindsight], run_s: float) -> dict:
    """What the run's moves made for their saving bought, by replaying it without them: all of
    them (``without_saving_moves``) and each alone (``counterfactuals``), as JSON. ``run_s``:
    the seconds of the run ``start`` makes, as it ran; a replay that does not reproduce them is
    an error (something in the run was not drawn from its seeds)."""
    alone = counterfactuals(start, steps, seen)
    if any(c.run_s != run_s for c in alone):
        raise RuntimeError(
            f"the replay took {alone[0].run_s} s where the run took {run_s} s: "
            "the simulated run is not reproducible from its seeds"
        )
    whole = without_saving_moves(start, steps, run_s)
    if whole.refused == 0 and whole.without_s != run_s:
        raise RuntimeError(
            f"the replay refused nothing and took {whole.without_s} s where the run took "
            f"{run_s} s: the simulated run is not reproducible from its seeds"
        )
    return {
        "simulated": True,
        "without_saving_moves": whole.to_json(),
        "moves": [c.to_json() for c in alone],
        "paid": sum(c.met and c.net_s > 0 for c in alone),
        "unmet": sum(not c.met for c in alone),
    }


def _relaid(move: MoveHindsight) -> bool:
    return any(before != after for _, before, after in move.moved)


def _key(move: MoveHindsight) -> Callable[[ModelStagePlan], tuple]:
    """What a move changed about its model-stages, as a veto compares it: their TP/PP where it
    relaid them, else their layout, slots and micro-batch (a move onto other slots or
    batches)."""
    return _tp_pp if _relaid(move) else _entry


def _targets(move: MoveHindsight, engine: SimulatedEngine) -> dict[str, tuple]:
    """What ``move`` made of the model-stages it moved (``_key``), as the first step after it
    ran them (``engine.history`` of the run as it ran; ``moves`` replays only moves whose next
    step ran their target)."""
    after = min(s for s in engine.history if s > move.step)
    plan, key = engine.history[after].plan, _key(move)
    changed = [name for name, before, new in move.moved if before != new] or [
        name for name, _, _ in move.moved
    ]
    return {name: key(plan.model_stage(name)) for name in changed}


def _kept_until(
    move: MoveHindsight, targets: dict[str, tuple], engine: SimulatedEngine, steps: int
) -> int:
    """The first step after ``move`` that the run as it ran (``engine.history``) took with one
    of its model-stages other than it made them (``targets``), or on another pool (``steps``:
    none did)."""
    ran = sorted(s for s in engine.history if s > move.step)
    key = _key(move)
    pool = engine.history[ran[0]].plan.num_slots
    for step in ran:
        plan = engine.history[step].plan
        if plan.num_slots != pool or any(
            key(plan.model_stage(name)) != target for name, target in targets.items()
        ):
            return step
    return steps


def _veto_of(
    move: MoveHindsight, targets: dict[str, tuple], engine: SimulatedEngine, until_step: int
) -> Callable[[Plan, Plan, int], str]:
    """Refuses a move for a saving that makes a model-stage ``move`` moved what the move made
    of it (``targets``): decided before ``until_step`` (the run as it ran kept them so until
    then), and while the pool has not changed since the veto first refused (the move itself:
    after a change the two runs replan on the new pool freely; what the move left behind still
    counts). A slot that fails does not end it, as it does not end a move's life."""
    key = _key(move)
    first_s: float | None = None

    def veto(running: Plan, candidate: Plan, step: int) -> str:
        nonlocal first_s
        if step + 1 >= until_step:  # a move decided then would run when the run had left
            return ""
        if first_s is not None and any(first_s < at <= engine.now() for at, _ in engine.trace.pool):
            return ""
        for name, target in targets.items():
            if key(candidate.model_stage(name)) == target != key(running.model_stage(name)):
                first_s = engine.now() if first_s is None else first_s
                return f"hindsight: the run without the move of step {move.step} ({name})"
        return ""

    return veto


def _copy(engine: SimulatedEngine, controller: Controller) -> tuple[SimulatedEngine, Controller]:
    """A copy of a running simulated job that reports nowhere: its events and step history
    start empty (they only grow, and what the copy does next is all a replay reads), and it
    has no sink to emit to."""
    memo = {id(controller.events): [], id(engine.history): {}, id(controller._emit_to): None}
    return copy.deepcopy((engine, controller), memo)


def _refused_steps(controller: Controller) -> list[int]:
    """The steps of the decisions ``controller``'s veto refused, in order."""
    return [
        e["step"]
        for e in controller.events
        if e["event"] == "control.decision" and str(e["reason"]).startswith("vetoed:")
    ]


def _refusals(controller: Controller) -> int:
    return len(_refused_steps(controller))
