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
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

from runtime.engine.sim import SimulatedEngine
from runtime.planner.plan import ModelStagePlan, Plan, PlanError
from runtime.planner.workload import PpoWorkload

REASONS = ("slots", "memory", "urgent", "override", "saving", "other")
"""Why a transition was made: the slots changed; the running plan would not fit the length
the trend reaches; a failure forced it; a person chose the plan; admission found that it saves
enough to repay itself (payback) or that it is faster (DynaRL-style ``always_faster``); or no
decision it carried out (``other``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoveHindsight:
    """One transition of a run; the fields after ``cost_s`` only for a move made for its
    saving."""

    step: int
    """The last step run before the transition (-1: none)."""
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
    said = str(because.get("reason") or "")
    if because["trigger"] in ("pool", "override"):
        return "slots" if because["trigger"] == "pool" else "override"
    if said.startswith("the running plan will not fit"):
        return "memory"
    if said.startswith(("urgent", "salvage")):
        return "urgent"
    return "saving"


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
        move = MoveHindsight(step=step, why=why, cost_s=event["actual_s"] + joining_s)
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
        at = workload.with_gen_len(max(1, round(ran.gen_len)))
        seconds, _ = engine.truth.step_seconds(ran.plan, at, engine.acc, at_s=ran.at_s)
        old_s, peak = engine.truth.step_seconds(back, at, engine.acc, at_s=ran.at_s)
        if peak > 1.0:
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
