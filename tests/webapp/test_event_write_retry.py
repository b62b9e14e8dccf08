"""An event write whose commit went through, but whose answer was lost with the connection (the
database restarted just then), is tried again by the driver: it must not be written twice.
The lost answer is stood in for by raising ``OperationalError`` after the write committed."""

from __future__ import annotations

import pytest
from django.db import OperationalError
from django.test import override_settings

from runtime.events import RuntimeEvent
from tests.support import plans as events
from webapp.jobs import services
from webapp.jobs.models import JobEvent
from webapp.projects.models import Role

# Retries run outside a transaction only (inside one, the transaction is lost already).
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def job(project, member, no_live_delivery, monkeypatch):
    monkeypatch.setattr(services, "_enqueue_driver", lambda job_id, epoch=None: None)
    owner = member(project, Role.OPERATOR, "owner")
    return services.job_submit(
        user=owner, project=project, name="j", spec={"num_slots": 1, "num_steps": 3}
    )


@pytest.fixture
def answer_lost_once(monkeypatch):
    """Each database write's first try commits, then raises as a dropped connection does;
    returns the tries made."""
    real, tries = services._retrying_database, []

    def lossy(what, operation):
        def once():
            result = operation()
            tries.append(what)
            if len(tries) == 1:
                raise OperationalError("server closed the connection unexpectedly")
            return result

        return real(what, once)

    monkeypatch.setattr(services, "_retrying_database", lossy)
    return tries


@override_settings(NEREUS_DB_RETRY_S=(0.0,))
def test_a_runtime_event_committed_before_the_connection_dropped_is_written_once(
    job, answer_lost_once
):
    sink = services.DatabaseEventSink(job_id=job.pk, epoch=job.epoch)
    sink.emit(RuntimeEvent(kind="step.finished", data={"step": 1}))
    assert len(answer_lost_once) == 2  # it was tried again
    assert JobEvent.objects.filter(job=job, kind="step.finished").count() == 1
    # Another event of the same kind at another instant is written as usual.
    sink.emit(RuntimeEvent(kind="step.finished", data={"step": 2}))
    assert JobEvent.objects.filter(job=job, kind="step.finished").count() == 2


@override_settings(NEREUS_DB_RETRY_S=(0.0,))
def test_a_controller_event_committed_before_the_connection_dropped_is_recorded_once(
    job, answer_lost_once
):
    link = services._ControlLink(job_id=job.pk, epoch=job.epoch)
    link.emit_control({"event": "control.plan", "plan": events.plan_json(8), "reason": "initial"})
    assert len(answer_lost_once) == 2
    assert JobEvent.objects.filter(job=job, kind="control.plan").count() == 1
    assert job.plans.count() == 1
