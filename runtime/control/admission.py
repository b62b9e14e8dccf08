"""Admission: is a candidate plan feasible, and does the move pay for itself?

Feasibility: the planner only proposes plans whose every slot fits (retained state, workspaces,
co-resident state and collective buffers, 10% headroom), and the transition compiler only compiles
a DAG whose intermediate units fit in every order it admits. Profitability (the seed's Eq. 2):
with ``saving`` the predicted seconds per step the candidate saves and ``cost`` the predicted
seconds of the transition, admit when ``cost / saving <= gamma × H``, ``H`` being the triggering
signal's drift horizon in steps: the move must repay itself well before the world drifts again.
It must also repay before the run ends: a move that needs more steps than are left only costs,
and save at least ``min_saving`` of the running plan's step (a dead band: smaller savings are
within the cost model's error in ranking layouts, and a move on one is as likely to be undone).
A move that is faster only as calibration stands now, and not under what it learned a few steps
before (``contested``: interference that comes and goes swings the links' learned efficiencies
back and forth), is not made either: its saving goes when they swing back, and the move with it.
Urgent triggers (slots revoked or lost, a failed step) check feasibility only; so does a move away
from a plan that is predicted not to fit within the lookahead (``overflows``): staying would cost
an out-of-memory step, which loses the job's state back to its last checkpoint.
"""

from __future__ import annotations

import dataclasses
import math

CONTESTED = "faster only as calibrated now"
"""How a refusal under ``decide``'s ``contested`` begins."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Verdict:
    admit: bool
    reason: str
    saving_s: float
    cost_s: float
    payback_steps: float
    horizon_steps: float
    gamma: float
    current_s: float
    """The running plan's step as priced for this decision (with what the job has measured,
    at the length and pool decided for): ``saving_s`` is ``current_s - candidate_s``."""
    candidate_s: float
    """The candidate's step, priced the same way."""

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        if math.isinf(self.payback_steps):
            out["payback_steps"] = None
        return out


def decide(
    *,
    admission: str,
    current_s: float,
    candidate_s: float,
    cost_s: float,
    horizon_steps: float,
    gamma: float,
    urgent: bool,
    infeasible: str = "",
    steps_left: float = math.inf,
    overflows: str = "",
    min_saving: float = 0.0,
    contested: str = "",
) -> Verdict:
    """One admission decision with its reason; exact arithmetic, no side effects.
    ``steps_left``: steps the run has after this one (unknown: no end). ``overflows``: why the
    running plan is predicted not to fit (empty: it fits). ``min_saving``: the least fraction
    of ``current_s`` a payback move must save. ``contested``: how a recent calibration prices
    the candidate not faster (empty: every one prices it faster)."""
    saving = current_s - candidate_s
    payback = cost_s / saving if saving > 0 else math.inf

    def verdict(admit: bool, reason: str) -> Verdict:
        return Verdict(
            admit=admit,
            reason=reason,
            saving_s=saving,
            cost_s=cost_s,
            payback_steps=payback,
            horizon_steps=horizon_steps,
            gamma=gamma,
            current_s=current_s,
            candidate_s=candidate_s,
        )

    if infeasible:
        return verdict(False, f"infeasible: {infeasible}")
    if urgent:
        return verdict(True, "urgent: feasibility only")
    if admission == "never":
        return verdict(False, "the policy never adapts")
    if overflows:
        return verdict(True, f"the running plan will not fit ({overflows}): feasibility only")
    if saving <= 0:
        return verdict(False, f"not faster: saves {saving:.3f} s/step")
    if admission == "always_faster":
        return verdict(True, f"faster by {saving:.3f} s/step")
    if contested:
        return verdict(False, f"{CONTESTED}: {contested}")
    if saving < min_saving * current_s:
        return verdict(
            False,
            f"saves {saving:.3f} s/step ({saving / current_s:.2%}), under the policy's "
            f"min_saving of {min_saving:.2%}",
        )
    if payback > steps_left:
        return verdict(
            False,
            f"the run ends first: pays back in {payback:.2f} steps, {steps_left:.0f} left",
        )
    limit = gamma * horizon_steps
    if payback <= limit:
        return verdict(
            True, f"pays back in {payback:.2f} steps <= gamma {gamma} × H {horizon_steps:.2f}"
        )
    return verdict(
        False, f"pays back in {payback:.2f} steps > gamma {gamma} × H {horizon_steps:.2f}"
    )


MOVE_REASONS = ("slots", "memory", "urgent", "override", "saving", "other")
"""Why a plan change was made: the slots changed; the running plan would not fit the length
the trend reaches; a failure forced it; a person chose the plan; admission found that it saves
enough to repay itself (payback) or that it is faster (DynaRL-style ``always_faster``); or no
decision it carried out (``other``)."""


def why_moved(trigger: str, reason: str, *, forced: bool = False) -> str:
    """``MOVE_REASONS``' name for a move admitted on a trigger of kind ``trigger`` with the
    verdict's (or the decision's) ``reason``: the one rule the controller's veto and hindsight
    share. ``forced``: a move off a plan that can no longer run (urgent, unless the slots
    changed or a person chose it)."""
    if trigger in ("pool", "override"):
        return "slots" if trigger == "pool" else "override"
    if forced:
        return "urgent"
    if reason.startswith("the running plan will not fit"):
        return "memory"
    if reason.startswith(("urgent", "salvage")):
        return "urgent"
    return "saving"


def amortized_step_s(step_s: float, move_s: float, lasts_steps: float) -> float:
    """Seconds per step of moving to a plan that runs a step in ``step_s``, costs ``move_s`` to
    move to and lasts ``lasts_steps`` steps before memory forces the next move: its step time
    plus its move's cost spread over those steps (at least one)."""
    return step_s + move_s / max(1.0, lasts_steps)


@dataclasses.dataclass(frozen=True)
class Option:
    """A plan a move could go to, as ``windowed_step_s`` weighs it."""

    step_s: float
    move_s: float
    """Seconds of the move to it (0: the running plan, or its layouts in other micro-batches)."""
    lasts_steps: float
    """Steps before memory forces the next move (the window's end at most)."""


def windowed_step_s(options: list[Option]) -> list[float]:
    """Each option's seconds per step over one window shared by all of them: the longest any
    option lasts. An option that ends sooner is followed by a forced move to the option that
    lasts longest (the cheapest per step of those, if several), priced at that option's move
    and steps. Comparing each option's move spread over its own life alone (``amortized_step_s``)
    lets the running plan, which costs nothing to keep, win whenever a faster plan would have to
    move again soon, even when the running plan must move sooner still: both moves happen, only
    in another order. With every option lasting the window, this is ``amortized_step_s``."""
    if not options:
        return []
    window = max(1.0, max(o.lasts_steps for o in options))
    longest = [o for o in options if max(1.0, o.lasts_steps) >= window]
    after = min(longest, key=lambda o: amortized_step_s(o.step_s, o.move_s, window))
    rates = []
    for o in options:
        lasts = min(window, max(1.0, o.lasts_steps))
        total = o.move_s + o.step_s * lasts
        if lasts < window:
            total += after.move_s + after.step_s * (window - lasts)
        rates.append(total / window)
    return rates
