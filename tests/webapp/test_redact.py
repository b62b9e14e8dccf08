"""Internal addresses in errors are not shown to a job's viewers (``webapp.jobs.redact``)."""

import pytest
from django.contrib.auth import get_user_model
from django.test import override_settings

from runtime.events import RuntimeEvent
from tests.support.jobs import make_job
from webapp.jobs import redact, services
from webapp.jobs.models import FailureReason, JobEvent, JobState

RAY_DEATH = (
    "SlotError: slot 3 died: The actor died unexpectedly before finishing this task. "
    "class_name: SlotWorker actor_id: 9f1c2e pid: 4242 name: slot-3 ip: 10.0.3.17; "
    "the node fe80::1ff:fe23:4567:890a was removed"
)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (
            RAY_DEATH,
            RAY_DEATH.replace("10.0.3.17", "<address>").replace(
                "fe80::1ff:fe23:4567:890a", "<address>"
            ),
        ),
        ("Error 111 connecting to 192.168.1.20:6379.", "Error 111 connecting to <address>:6379."),
        ("redis://:s3cret@cache:6379/0 refused", "redis://<credentials>@cache:6379/0 refused"),
        ("postgresql://nereus:pw@db/nereus", "postgresql://<credentials>@db/nereus"),
        ("bound to [::1]:8000", "bound to [<address>]:8000"),
        # Not addresses: C++ names, clock times, versions, plans, byte counts, MAC-like ids.
        ("c10::Error in at::Tensor::copy_", "c10::Error in at::Tensor::copy_"),
        ("at 12:30:05 step 4", "at 12:30:05 step 4"),
        ("torch 2.5.1 dp4tp2pp1 with 1.5e9 bytes", "torch 2.5.1 dp4tp2pp1 with 1.5e9 bytes"),
        ("version 1.2.3.4.5 of x", "version 1.2.3.4.5 of x"),
        ("id aa:bb:cc:dd:ee:ff", "id aa:bb:cc:dd:ee:ff"),
    ],
)
def test_redact_replaces_addresses_and_credentials_only(text, shown):
    assert redact.redact(text) == shown


def test_configured_dotted_host_names_are_redacted_one_word_service_names_are_not():
    redact._configured_hosts.cache_clear()
    try:
        with override_settings(
            CELERY_BROKER_URL="redis://cache-7.prod.example.net:6379/0",
            NEREUS_RAY_ADDRESS="ray-head.prod.example.net:6379",
            CHANNEL_LAYERS={"default": {"CONFIG": {"hosts": ["redis://redis:6379/1"]}}},
        ):
            shown = redact.redact(
                "could not reach cache-7.prod.example.net nor ray-head.prod.example.net:6379; "
                "redis said no"
            )
    finally:
        redact._configured_hosts.cache_clear()
    assert shown == "could not reach <address> nor <address>:6379; redis said no"


@pytest.mark.django_db
def test_a_failed_jobs_detail_and_its_events_carry_no_internal_address(monkeypatch, caplog):
    from runtime.jobs import driver

    owner = get_user_model().objects.create_user(username="ada", password="pw-ada-12345")
    job = make_job(owner=owner, spec={"num_slots": 2, "num_steps": 5})

    def fail(spec, *, sink, **kwargs):
        sink.emit(RuntimeEvent(kind="engine.step_failed", data={"step": 0, "error": RAY_DEATH}))
        raise RuntimeError(RAY_DEATH)

    monkeypatch.setattr(driver, "run_sft_job", fail)
    caplog.set_level("INFO", logger="webapp.jobs.services")
    assert services.job_drive(job_id=job.pk) == JobState.FAILED
    job.refresh_from_db()
    assert job.failure_reason == FailureReason.RUNTIME_ERROR
    assert "slot 3 died" in job.failure_detail and "pid: 4242" in job.failure_detail
    assert "10.0.3.17" not in job.failure_detail and "fe80::" not in job.failure_detail
    event = JobEvent.objects.get(job=job, kind="engine.step_failed")
    assert event.data["step"] == 0
    assert "<address>" in event.data["error"] and "10.0.3.17" not in event.data["error"]
    # The operators keep the original in the service's log.
    assert "10.0.3.17" in caplog.text
