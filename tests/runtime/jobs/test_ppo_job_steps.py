"""A PPO job's ``step.finished`` events and its scenario (``revoke_at_step``/``grant_at_step``)
count the job's own steps (``JobState.next_step``), not the loop's: a failed step makes no PPO
update and a resume from a checkpoint sends the job back, so the loop runs ahead of the job.

Only the step bookkeeping is exercised, so Ray is stood in for: the slot pool, the Ray engine,
the PPO runtime and the controller are stand-ins, and ``run_job`` is a loop that makes one PPO
update per loop step except where the scenario fails a step or resumes from a checkpoint (as the
controller's restart does, between ``between_steps`` and the step). ``run_ppo_job``'s closures
and ``run_ppo_steps`` are the real code."""

from __future__ import annotations

import contextlib
import types

import pytest

from runtime.control.controller import RunSummary
from runtime.events import ListSink
from runtime.jobs import ppo_job
from runtime.jobs.spec import PpoJobSpec


class _Job:
    def __init__(self):
        self.state = types.SimpleNamespace(next_step=0)
        self.stats = []

    def last_checkpoint(self):
        return None

    def workload(self):
        return None


class _Engine:
    def __init__(self, job: _Job):
        self.job = job
        self.events, self.on_event = [], None
        self.engine = types.SimpleNamespace(units={})
        self.moves: list[tuple[str, int]] = []
        self.started_from = 0

    def pool_size(self) -> int:
        return 4

    refuse: frozenset[str] = frozenset()
    """Moves an operator's resize left impossible (the pool at one slot, or at its max)."""

    def revoke(self) -> None:
        if "revoke" in self.refuse:
            raise ValueError("revoke: the job's last slot cannot be taken")
        self.moves.append(("revoke", self.job.state.next_step))

    def grant(self) -> None:
        if "grant" in self.refuse:
            raise ValueError("grant: all 5 slots are in use already")
        self.moves.append(("grant", self.job.state.next_step))

    def stop(self) -> None:
        pass


def _run(
    monkeypatch,
    spec: PpoJobSpec,
    *,
    fail: set[int],
    resume: dict[int, int],
    refuse: frozenset[str] = frozenset(),
):
    """Run ``spec``: loop steps in ``fail`` fail; before loop step k in ``resume`` the job goes
    back to step ``resume[k]``; the engine refuses the moves in ``refuse``. Returns the sink and
    the engine."""
    job = _Job()
    engine = _Engine(job)
    engine.refuse = refuse

    def run_job(engine_, controller, steps, *, between_steps, on_step):
        done = 0
        for loop_step in range(steps):
            if not between_steps(loop_step):
                break
            if loop_step in resume:  # the controller's restart, after between_steps
                job.state.next_step = resume[loop_step]
            ok = loop_step not in fail
            report = types.SimpleNamespace(
                step=loop_step,
                ok=ok,
                seconds=0.1,
                gen_len=10.0,
                stage_seconds={},
                peak_memory=0.1,
                failure="" if ok else "a slot failed",
                extra={"ppo_step": job.state.next_step} if ok else {},
            )
            if ok:
                job.state.next_step += 1
            on_step(report)
            done += 1
        return RunSummary(
            steps=done,
            seconds=1.0,
            step_seconds=1.0,
            transitions=0,
            transition_seconds=0.0,
            restarts=0,
            restart_seconds=0.0,
            failed_steps=len(fail),
            simulated=False,
        )

    @contextlib.contextmanager
    def connection(*args, **kwargs):
        yield types.SimpleNamespace(address="stand-in")

    pool = types.SimpleNamespace(
        num_slots=5,
        backend="gloo",
        setup_s=0.0,
        nodes=lambda: [{"node_id": "n"}],
        close=lambda: None,
    )
    monkeypatch.setattr(ppo_job, "ray_connection", connection)
    monkeypatch.setattr(ppo_job.SlotPool, "create", staticmethod(lambda *a, **k: pool))
    monkeypatch.setattr(ppo_job, "PpoRuntime", lambda *a, **k: job)
    monkeypatch.setattr(ppo_job, "RayEngine", lambda *a, **k: engine)
    monkeypatch.setattr(ppo_job, "Controller", lambda *a, **k: types.SimpleNamespace(last_step=0))
    monkeypatch.setattr(ppo_job, "run_job", run_job)
    monkeypatch.setattr(ppo_job, "_export", lambda *a, **k: None)
    sink = ListSink()
    outcome = ppo_job.run_ppo_job(spec, sink=sink, emit_control=lambda event: None)
    assert outcome.status == "succeeded" and outcome.steps_done == spec.num_steps
    return sink, engine


def _steps(sink) -> list[tuple[int, bool, int | None]]:
    return [
        (e.data["step"], e.data["ok"], e.data["ppo_step"]) for e in sink.of_kind("step.finished")
    ]


def test_a_failed_step_is_labelled_with_the_step_it_tried_and_the_scenario_waits_for_it(
    monkeypatch,
):
    spec = PpoJobSpec(num_steps=5, revoke_at_step=3, grant_at_step=4)
    sink, engine = _run(monkeypatch, spec, fail={2}, resume={})
    assert _steps(sink) == [
        (0, True, 0),
        (1, True, 1),
        (2, False, None),  # the job's step 2 failed: no update ...
        (2, True, 2),  # ... and ran again
        (3, True, 3),
        (4, True, 4),
    ]
    # Was: labels 0..5 (the last one ppo_step 4), and the revoke at the job's step 2.
    assert engine.moves == [("revoke", 3), ("grant", 4)]


@pytest.mark.parametrize("failed_too", [False, True])
def test_after_a_resume_the_labels_go_back_with_the_job_and_each_move_is_made_once(
    monkeypatch, failed_too
):
    """Before loop step 4 the job resumes from its checkpoint at step 2, after passing step 3:
    steps 2 and 3 run again, and the revoke at step 3 is not made a second time."""
    spec = PpoJobSpec(num_steps=5, revoke_at_step=3, grant_at_step=2)
    sink, engine = _run(monkeypatch, spec, fail={5} if failed_too else set(), resume={4: 2})
    again = [(3, False, None), (3, True, 3)] if failed_too else [(3, True, 3)]
    assert _steps(sink) == [
        (0, True, 0),
        (1, True, 1),
        (2, True, 2),
        (3, True, 3),
        (2, True, 2),
        *again,
        (4, True, 4),
    ]
    assert all(step == ppo_step for step, ok, ppo_step in _steps(sink) if ok)
    assert engine.moves == [("grant", 2), ("revoke", 3)]


def test_a_scripted_move_an_operator_s_resize_left_impossible_is_skipped_not_fatal(monkeypatch):
    """An operator shrank the pool to one slot (or grew it to its max) before the spec's
    revoke (grant): the move is skipped, saying why, and the job runs on."""
    spec = PpoJobSpec(num_steps=4, revoke_at_step=1, grant_at_step=2)
    sink, engine = _run(monkeypatch, spec, fail=set(), resume={}, refuse=frozenset({"revoke"}))
    assert [(s, ok) for s, ok, _ in _steps(sink)] == [(0, True), (1, True), (2, True), (3, True)]
    assert engine.moves == [("grant", 2)]
    (skipped,) = sink.of_kind("scenario.skipped")
    assert skipped.data == {
        "move": "revoke",
        "reason": "revoke: the job's last slot cannot be taken",
    }


def test_a_job_folder_it_cannot_use_fails_the_job_naming_it_before_any_slot_is_taken(
    tmp_path, monkeypatch
):
    taken = []
    monkeypatch.setattr(ppo_job, "ray_connection", lambda *a, **k: taken.append(a))
    (tmp_path / "file").write_text("in the way")
    workdir = tmp_path / "file" / "job"
    with pytest.raises(OSError, match="workdir: Not a directory") as raised:
        ppo_job.run_ppo_job(
            PpoJobSpec(), sink=ListSink(), emit_control=lambda e: None, workdir=workdir
        )
    assert raised.value.filename == str(workdir) and taken == []
