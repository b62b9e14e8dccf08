"""What the controller did to a job: the plans it ran on, the transitions between them, and the
plan changes it proposed for a person to approve or reject.

Rows are written from the controller's events (``services.record_controller_event``); the events
themselves stay in the job's append-only log, so these tables are an index over it, never the only
record.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models


class Plan(models.Model):
    """A plan a job ran on, or was moved towards; ``current`` marks the one it runs on now."""

    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="plans")
    epoch = models.PositiveIntegerField(help_text="The driver epoch that reported it.")
    plan = models.JSONField(help_text="The runtime's Plan.to_json().")
    predicted_step_s = models.FloatField(help_text="The planner's predicted seconds per step.")
    current = models.BooleanField(default=False)
    reason = models.CharField(max_length=500, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["job", "id"])]
        constraints = [
            models.UniqueConstraint(
                fields=["job"], condition=models.Q(current=True), name="plans_one_current_per_job"
            )
        ]

    def __str__(self) -> str:
        return f"plan {self.pk} of job {self.job_id}{' (current)' if self.current else ''}"


class TransitionState(models.TextChoices):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class Transition(models.Model):
    """One move of a running job from a plan to another, with its DAG as the runtime compiled it."""

    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="transitions")
    epoch = models.PositiveIntegerField(help_text="The driver epoch that ran it.")
    from_plan = models.ForeignKey(
        Plan, null=True, blank=True, on_delete=models.SET_NULL, related_name="transitions_out"
    )
    to_plan = models.ForeignKey(
        Plan, null=True, blank=True, on_delete=models.SET_NULL, related_name="transitions_in"
    )
    dag = models.JSONField(help_text="The runtime's TransitionDag.to_json().")
    num_nodes = models.PositiveIntegerField(default=0)
    predicted_s = models.FloatField()
    actual_s = models.FloatField(null=True, blank=True)
    state = models.CharField(
        max_length=16, choices=TransitionState.choices, default=TransitionState.PENDING
    )
    failure = models.TextField(blank=True)
    simulated = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["job", "id"])]

    def __str__(self) -> str:
        return f"transition {self.pk} of job {self.job_id} ({self.state})"


class ProposalState(models.TextChoices):
    WAITING = "waiting"
    APPROVED = "approved"
    REJECTED = "rejected"
    EXPIRED = "expired"
    """Nobody answered in time: the job keeps its current plan."""
    STALE = "stale"
    """The job moved on (new units, a new driver, a newer proposal): the plan no longer applies."""


class ProposalRoute(models.TextChoices):
    LIVE = "live"
    """A transition DAG moves the running job's state."""
    RESTART = "restart"
    """Approving saves the state and restarts the job onto the plan (no live transition reaches
    it, or the job's policy adapts by restarting)."""


class Proposal(models.Model):
    """A plan change waiting for a person: from the controller (``proposed_by`` empty) or a
    person's override. Tied to the job, the driver epoch and the exact plan proposed."""

    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="proposals")
    epoch = models.PositiveIntegerField(help_text="The driver epoch the proposal belongs to.")
    controller_id = models.PositiveIntegerField(
        null=True, blank=True, help_text="The controller's own proposal id (within its epoch)."
    )
    plan = models.JSONField(help_text="The proposed plan, as Plan.to_json().")
    verdict = models.JSONField(null=True, blank=True, help_text="The admission verdict, if any.")
    reason = models.TextField(blank=True)
    route = models.CharField(
        max_length=16,
        choices=ProposalRoute.choices,
        default=ProposalRoute.LIVE,
        help_text="How approving moves the job: a live transition, or a checkpoint/restart.",
    )
    proposed_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="proposals_made",
        help_text="Empty when the controller proposed it.",
    )
    state = models.CharField(
        max_length=16, choices=ProposalState.choices, default=ProposalState.WAITING
    )
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="proposals_decided",
    )
    decided_at = models.DateTimeField(null=True, blank=True)
    comment = models.TextField(blank=True, help_text="Why it was approved or rejected.")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()

    class Meta:
        ordering = ["-id"]
        indexes = [
            models.Index(fields=["state", "id"]),
            models.Index(fields=["job", "id"]),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["job", "epoch", "controller_id"],
                condition=models.Q(controller_id__isnull=False),
                name="plans_one_proposal_per_controller_id",
            )
        ]

    def __str__(self) -> str:
        return f"proposal {self.pk} of job {self.job_id} ({self.state})"
