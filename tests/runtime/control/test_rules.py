"""Triggers, drift horizons, admission branches and policy validation, with exact numbers."""

import math

import pytest

from runtime.control import DriftHorizon, JobPolicy, Monitor, PolicyError, Trigger, decide
from runtime.control.admission import Option, amortized_step_s, windowed_step_s


def test_the_drift_horizon_is_an_ema_of_steps_between_crossings():
    h = DriftHorizon()
    assert h.value == 1.0  # before any interval
    h.crossed(10)
    assert h.value == 1.0  # one crossing is not an interval yet
    h.crossed(20)
    assert h.value == 10.0  # the first interval is taken as it is
    h.crossed(40)
    assert h.value == 0.5 * 20 + 0.5 * 10  # then alpha = 0.5
    h.crossed(44)
    assert h.value == 0.5 * 4 + 0.5 * 15


def test_a_signal_triggers_past_its_threshold_and_its_reference_resets_on_replan():
    monitor = Monitor(JobPolicy(thresholds={"gen_len": 0.5}))
    assert monitor.observe(0, {"gen_len": 100.0, "step_time": 10.0}, pool=8) == []
    assert monitor.observe(1, {"gen_len": 150.0, "step_time": 12.9}, pool=8) == []  # 50%, 29%
    fired = monitor.observe(2, {"gen_len": 151.0, "step_time": 13.1}, pool=8)
    assert [(t.kind, t.signal) for t in fired] == [("drift", "gen_len"), ("drift", "step_time")]
    assert fired[0].reference == 100.0 and fired[0].value == 151.0 and not fired[0].urgent
    monitor.replanned()
    assert monitor.reference == {"gen_len": 151.0, "step_time": 13.1}
    assert monitor.observe(3, {"gen_len": 200.0}, pool=8) == []  # 32% of 151 < 50%
    fired = monitor.observe(4, {"gen_len": 230.0}, pool=8)  # steady growth keeps triggering
    assert [t.signal for t in fired] == ["gen_len"]
    assert monitor.horizon_of("gen_len") == 2.0  # crossings at steps 2 and 4
    assert monitor.effective_horizon("gen_len", 4) == 2.0
    assert monitor.effective_horizon("gen_len", 30) == 26.0  # calm for 26 steps since step 4


def test_pool_changes_trigger_and_only_a_shrink_is_urgent():
    monitor = Monitor(JobPolicy())
    monitor.observe(0, {}, pool=16)
    (grow,) = monitor.observe(1, {}, pool=24)
    assert (grow.kind, grow.value, grow.reference, grow.urgent) == ("pool", 24, 16, False)
    (shrink,) = monitor.observe(2, {}, pool=8)
    assert shrink.urgent
    assert Trigger(kind="failure").urgent and not Trigger(kind="memory").urgent


def test_the_trend_extrapolates_the_last_window_linearly():
    monitor = Monitor(JobPolicy())
    for step, value in enumerate([100, 110, 120, 130]):
        monitor.observe(step, {"gen_len": float(value)}, pool=8)
    assert monitor.trend("gen_len", 10) == 130 + 10 * 10
    assert Monitor(JobPolicy()).trend("gen_len", 5) is None
    # A swing between 100 and 200 forecasts about its level, below the peaks it has seen (the
    # line through the first and last points alone would say 200 + 100/7).
    swinging = Monitor(JobPolicy())
    for step in range(8):
        swinging.observe(step, {"gen_len": 100.0 if step % 2 == 0 else 200.0}, pool=8)
    assert swinging.trend("gen_len", 1, window=8) == pytest.approx(150 + 50 * 4.5 / 10.5)


ARGS = {"current_s": 10.0, "candidate_s": 8.0, "cost_s": 6.0, "gamma": 0.5, "urgent": False}


def test_payback_admits_exactly_when_cost_over_saving_is_within_gamma_h():
    # saving 2 s/step, cost 6 s: pays back in 3 steps; gamma 0.5
    at = decide(admission="payback", horizon_steps=6.0, **ARGS)  # 3 <= 0.5 × 6
    assert at.admit and at.payback_steps == 3.0 and at.saving_s == 2.0
    # Both sides as priced for the decision (the page shows them, not the plans' own older
    # predictions), in the verdict's JSON too.
    assert (at.current_s, at.candidate_s) == (ARGS["current_s"], ARGS["candidate_s"])
    assert at.to_json()["current_s"] - at.to_json()["candidate_s"] == at.saving_s
    assert at.reason == "pays back in 3.00 steps <= gamma 0.5 × H 6.00"
    under = decide(admission="payback", horizon_steps=5.99, **ARGS)
    assert not under.admit and "> gamma 0.5 × H 5.99" in under.reason


def test_a_move_that_repays_only_after_the_run_ends_is_refused():
    # pays back in 3 steps, within gamma × H = 5; with 3 steps left it repays exactly in time
    on_time = decide(admission="payback", horizon_steps=10.0, steps_left=3, **ARGS)
    assert on_time.admit and on_time.reason.startswith("pays back in 3.00 steps")
    late = decide(admission="payback", horizon_steps=10.0, steps_left=2, **ARGS)
    assert not late.admit
    assert late.reason == "the run ends first: pays back in 3.00 steps, 2 left"
    # Beyond gamma × H as well: still the end, which no later step can change, is the reason.
    neither = decide(admission="payback", horizon_steps=1.0, steps_left=2, **ARGS)
    assert neither.reason == "the run ends first: pays back in 3.00 steps, 2 left"
    # Feasibility-only moves and the DynaRL-style policy do not weigh the end.
    assert decide(admission="always_faster", horizon_steps=1.0, steps_left=0, **ARGS).admit
    urgent = decide(
        admission="payback", horizon_steps=1.0, steps_left=0, **{**ARGS, "urgent": True}
    )
    assert urgent.admit


def test_every_other_admission_branch():
    dynarl = decide(admission="always_faster", horizon_steps=1.0, **ARGS)
    assert dynarl.admit and dynarl.reason == "faster by 2.000 s/step"
    slower = decide(admission="always_faster", horizon_steps=1.0, **{**ARGS, "candidate_s": 10.5})
    assert not slower.admit and slower.reason.startswith("not faster: saves -0.500")
    assert math.isinf(slower.payback_steps) and slower.to_json()["payback_steps"] is None
    never = decide(admission="never", horizon_steps=100.0, **ARGS)
    assert not never.admit and never.reason == "the policy never adapts"
    urgent = decide(admission="payback", horizon_steps=1.0, **{**ARGS, "urgent": True})
    assert urgent.admit and urgent.reason == "urgent: feasibility only"
    infeasible = decide(
        admission="payback", horizon_steps=100.0, infeasible="slot 3 is full", **ARGS
    )
    assert not infeasible.admit and infeasible.reason == "infeasible: slot 3 is full"
    urgent_but_infeasible = decide(
        admission="payback", horizon_steps=1.0, infeasible="x", **{**ARGS, "urgent": True}
    )
    assert not urgent_but_infeasible.admit


def test_a_saving_inside_the_dead_band_is_not_worth_a_move():
    """Saving 2 s of a 10 s step (20%) repays in 3 steps; with a dead band of 25% it is not
    made however soon it repays, and the reason names the band. At 20% exactly it is."""
    band = decide(admission="payback", horizon_steps=100.0, min_saving=0.25, **ARGS)
    assert not band.admit
    assert band.reason == "saves 2.000 s/step (20.00%), under the policy's min_saving of 25.00%"
    assert decide(admission="payback", horizon_steps=100.0, min_saving=0.20, **ARGS).admit
    # The DynaRL-style policy admits whatever is faster; urgent and overflowing moves are
    # made on feasibility alone: the band is payback admission's.
    assert decide(admission="always_faster", horizon_steps=1.0, min_saving=0.25, **ARGS).admit
    for urgent, overflows in ((True, ""), (False, "actor needs 90 GiB")):
        args = {**ARGS, "urgent": urgent}
        forced = decide(
            admission="payback", horizon_steps=1.0, min_saving=0.25, overflows=overflows, **args
        )
        assert forced.admit


def test_a_saving_a_recent_calibration_denies_is_not_worth_a_move():
    """A move that repays within the horizon, but is not faster as calibration priced it a few
    steps before, is not made by payback admission, and the reason says under which step's
    calibration; the DynaRL-style policy, urgent moves and overflowing plans do not ask."""
    contested = "as calibrated after step 43, saves -1.000 s/step"
    refused = decide(admission="payback", horizon_steps=100.0, contested=contested, **ARGS)
    assert not refused.admit
    assert refused.reason == f"faster only as calibrated now: {contested}"
    assert refused.saving_s == 2.0  # the saving as calibrated now is still what it reports
    assert decide(admission="payback", horizon_steps=100.0, contested="", **ARGS).admit
    assert decide(admission="always_faster", horizon_steps=1.0, contested=contested, **ARGS).admit
    for urgent, overflows in ((True, ""), (False, "actor needs 90 GiB")):
        args = {**ARGS, "urgent": urgent}
        assert decide(
            admission="payback", horizon_steps=1.0, contested=contested, overflows=overflows, **args
        ).admit


def test_a_plan_predicted_not_to_fit_is_left_on_feasibility_alone():
    """Staying on a plan that will not fit costs an out-of-memory step and the state since the
    last checkpoint: a slower candidate, or one that repays late, is admitted all the same."""
    slower = {**ARGS, "candidate_s": 10.5}
    left = decide(admission="payback", horizon_steps=1.0, overflows="actor needs 90 GiB", **slower)
    assert left.admit
    assert left.reason == "the running plan will not fit (actor needs 90 GiB): feasibility only"
    assert decide(admission="always_faster", horizon_steps=1.0, overflows="x", **slower).admit
    # A policy that never adapts waits for the failure; an infeasible move is still refused.
    assert not decide(admission="never", horizon_steps=1.0, overflows="x", **slower).admit
    assert not decide(
        admission="payback", horizon_steps=1.0, overflows="x", infeasible="y", **slower
    ).admit


def test_a_move_s_cost_is_spread_over_the_steps_its_plan_lasts():
    # 10 s to move to a 50 s/step plan that lasts 5 steps: 52 s a step; 12 s to move to a
    # 51 s/step plan that lasts 100: 51.12; the latter is cheaper, unless its steps are 53 s.
    assert amortized_step_s(50.0, 10.0, 5) == 52.0
    assert amortized_step_s(51.0, 12.0, 100) == pytest.approx(51.12)
    assert amortized_step_s(53.0, 12.0, 100) > amortized_step_s(50.0, 10.0, 5)
    # A plan that must move again at once carries its whole move; staying put costs nothing.
    assert amortized_step_s(50.0, 10.0, 0) == 60.0
    assert amortized_step_s(50.0, 0.0, 3) == 50.0


def test_a_plan_that_must_move_sooner_pays_for_that_move_too():
    # Staying (20 s/step, free) lasts 10 steps; a 19.5 s/step plan costs 15 s to move to and
    # lasts 10 as well; an 18 s/step plan costs 30 s and lasts 40. Each move spread over its
    # own plan's life alone would rate staying at 20 s/step whatever it must do at step 10.
    stay, soon, long = Option(20.0, 0.0, 10), Option(19.5, 15.0, 10), Option(18.0, 30.0, 40)
    rates = windowed_step_s([stay, soon, long])
    # A 40-step window: stay 10 steps then move to the long plan (0 + 200 + 30 + 540) / 40;
    # move to the 19.5 plan, then to the long one (15 + 195 + 30 + 540) / 40; the long plan
    # alone (30 + 720) / 40.
    assert rates == pytest.approx([19.25, 19.5, 18.75])
    # Where every option lasts the window, it is each move spread over that window.
    same = [Option(20.0, 0.0, 40), Option(19.0, 30.0, 40)]
    assert windowed_step_s(same) == [amortized_step_s(o.step_s, o.move_s, 40) for o in same]
    # The order stays what matters: with only two short-lived options, staying wins by what
    # the move costs, whatever comes after both (the same forced move).
    assert windowed_step_s([stay, soon])[0] < windowed_step_s([stay, soon])[1]
    assert windowed_step_s([]) == []


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"thresholds": {"tokens": 0.3}}, r"policy.thresholds.tokens: unknown signal"),
        ({"thresholds": {"gen_len": 0}}, r"policy.thresholds.gen_len: must be a number in"),
        ({"thresholds": {"gen_len": True}}, r"policy.thresholds.gen_len"),
        ({"thresholds": [0.3]}, r"policy.thresholds: must be an object"),
        ({"gamma": -1}, r"policy.gamma: must be a number in \(0, 100\]"),
        ({"gamma": float("nan")}, r"policy.gamma"),
        ({"approval": "sometimes"}, r"policy.approval: expected one of auto, manual"),
        ({"approval_timeout_s": -5}, r"policy.approval_timeout_s: must be a number >= 0"),
        ({"admission": "greedy"}, r"policy.admission: expected one of payback"),
        ({"lookahead_steps": 2.5}, r"policy.lookahead_steps"),
        ({"min_saving": 1.0}, r"policy.min_saving: must be a number in \[0, 1\)"),
        ({"min_saving": -0.01}, r"policy.min_saving"),
        ({"min_saving": "1%"}, r"policy.min_saving"),
        (
            {"memory_runway": "forever"},
            r"policy.memory_runway: expected one of shortest, amortized",
        ),
        ({"colour": "red"}, r"policy.colour: unknown field"),
        ([], r"policy: must be an object"),
    ],
)
def test_bad_policies_are_refused_naming_the_field(data, message):
    with pytest.raises(PolicyError, match=message):
        JobPolicy.from_json(data)


def test_a_policy_round_trips_and_defaults_to_thirty_percent():
    policy = JobPolicy.from_json({"thresholds": {"gen_len": 0.2}, "gamma": 0.25})
    assert policy.threshold("gen_len") == 0.2 and policy.threshold("step_time") == 0.30
    assert JobPolicy.from_json(policy.to_json()) == policy


def test_a_horizon_clock_starts_at_the_first_observation():
    h = DriftHorizon()
    h.start(5)
    assert h.value == 1.0 and h.last_crossing == 5  # no interval yet: H is still 1
    h.start(9)  # only the first start counts
    h.crossed(25)
    assert h.value == 20.0  # the first crossing closes the interval from the start
    monitor = Monitor(JobPolicy(thresholds={"gen_len": 0.5}))
    monitor.observe(3, {"gen_len": 100.0}, pool=8)
    (fired,) = monitor.observe(40, {"gen_len": 151.0}, pool=8)
    assert fired.signal == "gen_len" and monitor.horizon_of("gen_len") == 37.0


def test_pool_changes_are_crossings_of_the_pool_horizon():
    monitor = Monitor(JobPolicy())
    monitor.observe(0, {}, pool=16)
    assert monitor.observe(99, {}, pool=16) == []
    (grow,) = monitor.observe(100, {}, pool=24)
    assert (grow.kind, grow.signal) == ("pool", "pool")
    assert monitor.horizon_of("pool") == 100.0  # not 1: the pool held for 100 steps
    monitor.observe(140, {}, pool=8)
    assert monitor.horizon_of("pool") == 0.5 * 40 + 0.5 * 100
    assert monitor.effective_horizon("pool", 140) == 70.0
    assert monitor.effective_horizon("pool", 300) == 160.0  # calm since step 140
