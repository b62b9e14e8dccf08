"""Jobs and their event logs."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class JobState(models.TextChoices):
    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    TRANSITIONING = "transitioning"
    AWAITING_APPROVAL = "awaiting_approval"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
ACTIVE_STATES = frozenset(JobState) - TERMINAL_STATES

# The published state machine: every move a job may make. Anything else is refused.
ALLOWED_MOVES: dict[str, frozenset[str]] = {
    JobState.PENDING: frozenset({JobState.STARTING, JobState.CANCELLED, JobState.FAILED}),
    JobState.STARTING: frozenset({JobState.RUNNING, JobState.CANCELLING, JobState.FAILED}),
    JobState.RUNNING: frozenset(
        {
            JobState.TRANSITIONING,
            JobState.AWAITING_APPROVAL,
            JobState.CANCELLING,
            JobState.SUCCEEDED,
            JobState.FAILED,
            JobState.STARTING,  # a new driver (higher epoch) takes over after a lost worker
        }
    ),
    # STARTING from a running-like state: a new driver (higher epoch) takes over after a lost worker
    JobState.TRANSITIONING: frozenset(
        {JobState.RUNNING, JobState.CANCELLING, JobState.FAILED, JobState.STARTING}
    ),
    JobState.AWAITING_APPROVAL: frozenset(
        {
            JobState.TRANSITIONING,
            JobState.RUNNING,
            JobState.CANCELLING,
            JobState.FAILED,
            JobState.STARTING,
        }
    ),
    JobState.CANCELLING: frozenset({JobState.CANCELLED, JobState.FAILED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


class FailureReason(models.TextChoices):
    NONE = "", "none"
    INVALID_SPEC = "invalid_spec"
    RUNTIME_ERROR = "runtime_error"
    SLOT_LOST = "slot_lost"
    DRIVER_LOST = "driver_lost"
    TOO_MANY_DELIVERIES = "too_many_deliveries"
    QUEUE_UNAVAILABLE = "queue_unavailable"


class Job(models.Model):
    """One submitted job. The database is the source of truth for its state and epoch."""

    name = models.CharField(max_length=200)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="jobs"
    )
    project = models.ForeignKey("projects.Project", on_delete=models.PROTECT, related_name="jobs")
    state = models.CharField(max_length=32, choices=JobState.choices, default=JobState.PENDING)
    failure_reason = models.CharField(
        max_length=32, choices=FailureReason.choices, default=FailureReason.NONE, blank=True
    )
    failure_detail = models.TextField(blank=True)
    spec = models.JSONField(help_text="The validated runtime job spec.")
    epoch = models.PositiveIntegerField(
        default=0, help_text="Increases each time a driver (re)starts; older epochs are refused."
    )
    driver_deliveries = models.PositiveIntegerField(default=0)
    heartbeat_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="The current epoch's driver was last alive then; stale means lost.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    idempotency_key = models.CharField(
        max_length=255, blank=True, default="", help_text="The submitter's Idempotency-Key."
    )
    request_hash = models.CharField(
        max_length=64, blank=True, default="", help_text="SHA-256 of the submitted request body."
    )

    class Meta:
        ordering = ["-id"]
        indexes = [
            models.Index(fields=["owner", "state"]),
            models.Index(fields=["project", "state"]),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["owner", "idempotency_key"],
                condition=~models.Q(idempotency_key=""),
                name="jobs_idempotency_key_per_owner",
            )
        ]

    def __str__(self) -> str:
        return f"job {self.pk} ({self.state})"

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def group_name(self) -> str:
        """Channel-layer group that carries this job's live events."""
        return f"job-{self.pk}"


class JobEvent(models.Model):
    """One entry of a job's append-only event log; ids increase, so clients resume from one."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events")
    epoch = models.PositiveIntegerField()
    kind = models.CharField(max_length=64)
    data = models.JSONField(default=dict)
    at = models.DateTimeField(help_text="When it happened (the runtime's clock).")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["job", "id"])]

    def __str__(self) -> str:
        return f"{self.job_id}#{self.pk} {self.kind}"

    def as_message(self) -> dict:
        """The JSON shape sent to websocket and REST clients."""
        return {
            "id": self.pk,
            "job": self.job_id,
            "epoch": self.epoch,
            "kind": self.kind,
            "data": self.data,
            "at": self.at.isoformat(),
        }
