"""``/metrics`` after a job ran: the job's figures, read from the database at scrape time (so a
web process reports what a Celery worker recorded), plus the API latency of this process."""

from __future__ import annotations

from datetime import timedelta

import pytest
from prometheus_client.parser import text_string_to_metric_families

from webapp.jobs import services as job_services
from webapp.jobs.models import JobEvent, JobState
from webapp.plans.models import Proposal, ProposalState, Transition
from webapp.projects.models import Role

pytestmark = pytest.mark.django_db(transaction=True)

SPEC = {"kind": "ppo-sim", "gpus": 16, "num_steps": 40, "trace": "growth", "pace_s": 0.0}


def scrape(client) -> dict[tuple[str, tuple], float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.content.decode())
        for s in family.samples
    }


def total(samples, name: str, **labels) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(
        value
        for (sample, pairs), value in samples.items()
        if sample == name and set(labels.items()) <= set(pairs)
    )


def test_metrics_show_the_figures_of_a_job_that_ran(project, member, api, monkeypatch, client):
    before = scrape(client)
    assert total(before, "nereus_steps_total") == 0
    assert total(before, "nereus_jobs") == 0

    monkeypatch.setattr(job_services, "_enqueue_driver", lambda job_id: None)
    owner = member(project, Role.OPERATOR, "owner")
    job = job_services.job_submit(user=owner, project=project, name="sim", spec=SPEC)
    assert job_services.job_drive(job_id=job.pk) == JobState.SUCCEEDED

    # A person's decision on a proposal, 90 s after it was made.
    proposal = Proposal.objects.create(
        job=job,
        epoch=job.epoch,
        plan={},
        expires_at=job.created_at + timedelta(hours=1),
    )
    Proposal.objects.filter(pk=proposal.pk).update(
        state=ProposalState.APPROVED, decided_at=proposal.created_at + timedelta(seconds=90)
    )
    listed = api(user=owner).get("/api/v1/jobs/")
    assert listed.status_code == 200

    after = scrape(client)
    events = JobEvent.objects.filter(job=job)
    steps = [e.data for e in events.filter(kind="step.finished")]
    assert len(steps) == 40
    assert after[("nereus_jobs", (("state", "succeeded"),))] == 1
    assert total(after, "nereus_jobs") == 1
    ok = sum(1 for s in steps if s["ok"])
    assert after[("nereus_steps_total", (("mode", "simulated"), ("ok", "true")))] == ok
    assert total(after, "nereus_steps_total", mode="simulated") == 40

    stages = {stage for s in steps for stage in s["stage_s"]}
    assert stages
    for stage in stages:
        labels = (("mode", "simulated"), ("stage", stage))
        count = after[("nereus_step_stage_duration_seconds_count", labels)]
        assert count == sum(stage in s["stage_s"] for s in steps)
        assert after[("nereus_step_stage_duration_seconds_sum", labels)] == pytest.approx(
            sum(s["stage_s"].get(stage, 0.0) for s in steps), rel=1e-9
        )
    assert after[("nereus_step_duration_seconds_count", (("mode", "simulated"),))] == len(steps)

    triggers = [e.data["kind"] for e in events.filter(kind="control.trigger")]
    assert triggers, "the growth trace fires triggers"
    for kind in set(triggers):
        assert after[("nereus_triggers_total", (("kind", kind),))] == triggers.count(kind)

    transitions = list(Transition.objects.filter(job=job))
    assert total(after, "nereus_transitions_total") == len(transitions)
    if transitions:
        assert total(after, "nereus_transition_predicted_seconds_sum") == pytest.approx(
            sum(t.predicted_s for t in transitions), rel=1e-6
        )
        measured = [t.actual_s for t in transitions if t.actual_s is not None]
        assert total(after, "nereus_transition_actual_seconds_count") == len(measured)

    wait = (("decision", "approved"),)
    assert after[("nereus_approval_wait_seconds_count", wait)] == 1
    assert after[("nereus_approval_wait_seconds_sum", wait)] == pytest.approx(90)
    assert after[("nereus_approval_wait_seconds_bucket", (*wait, ("le", "60.0")))] == 0
    assert after[("nereus_approval_wait_seconds_bucket", (*wait, ("le", "120.0")))] == 1

    api_get = (("method", "GET"), ("route", "api/v1/jobs/"))
    assert (
        after[("nereus_http_request_duration_seconds_count", api_get)]
        == before.get(("nereus_http_request_duration_seconds_count", api_get), 0) + 1
    )

    # Counted once: a second scrape reads no event twice.
    again = scrape(client)
    assert total(again, "nereus_steps_total") == 40
    assert total(again, "nereus_triggers_total") == len(triggers)


def test_an_event_committed_after_a_later_one_is_still_counted(project, member):
    """Events can commit out of id order (concurrent transactions): an id missing at one scrape
    is counted when it appears, and nothing is counted twice."""
    from django.utils import timezone

    from tests.support.jobs import make_job
    from webapp.observability.metrics import DatabaseCollector

    collector = DatabaseCollector()
    job = make_job(owner=member(project, Role.OPERATOR, "o"))

    def steps() -> float:
        families = {f.name: f for f in collector.collect()}
        return sum(s.value for s in families["nereus_steps"].samples if s.name.endswith("_total"))

    def step(pk=None):
        fields = {"pk": pk} if pk else {}
        return JobEvent.objects.create(
            job=job,
            epoch=0,
            kind="step.finished",
            data={"ok": True, "step_s": 0.1},
            at=timezone.now(),
            **fields,
        )

    first = step()
    assert steps() == 1
    late = first.pk + 1
    step(pk=first.pk + 2)  # committed while the transaction holding first.pk + 1 is still open
    assert steps() == 2
    step(pk=late)
    assert steps() == 3
    assert steps() == 3


def test_metrics_can_require_a_bearer_token(client, monkeypatch):
    monkeypatch.setenv("NEREUS_METRICS_TOKEN", "s3cret-token")
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret-token").status_code == 200
