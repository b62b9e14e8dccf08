"""Writes about jobs: submission, state moves, the event log, and running a job's driver."""

from __future__ import annotations

import hashlib
import json
import logging
from datetime import UTC, datetime
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from webapp.jobs import errors, selectors
from webapp.jobs.models import ALLOWED_MOVES, FailureReason, Job, JobEvent, JobState
from webapp.projects import errors as project_errors
from webapp.projects.models import ApiToken, Project, Role
from webapp.projects.selectors import require_role
from webapp.projects.services import project_personal_for

logger = logging.getLogger(__name__)


@transaction.atomic
def job_submit(
    *,
    user,
    name: str,
    spec: dict[str, Any],
    project: Project | None = None,
    token: ApiToken | None = None,
    idempotency_key: str = "",
    request_hash: str = "",
) -> Job:
    """Validate the spec, store the job and enqueue its driver once the row is committed.

    Needs the operator role in ``project``; without one, the job goes to the token's project, or
    to the user's personal project.
    """
    from runtime.jobs.spec import spec_from_json

    if project is None:
        project = token.project if token is not None else project_personal_for(user)
    require_role(user, project, Role.OPERATOR, token=token)
    try:
        validated = spec_from_json(spec)
    except ValueError as exc:
        field = str(exc).split(":", 1)[0]
        raise ValidationError({field: str(exc)}) from exc
    job = Job.objects.create(
        name=name,
        owner=user,
        project=project,
        spec=validated.to_json(),
        idempotency_key=idempotency_key,
        request_hash=request_hash,
    )
    job_event_append(
        job=job, epoch=job.epoch, kind="job.submitted", data={"by": user.get_username()}
    )
    transaction.on_commit(lambda: _enqueue_driver(job.pk))
    return job


def request_fingerprint(body: Any) -> str:
    """SHA-256 of a JSON request body in canonical form (sorted keys, no spaces)."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def job_submit_idempotent(
    *,
    user,
    name: str,
    spec: dict[str, Any],
    project: Project | None,
    idempotency_key: str,
    body: Any,
    token: ApiToken | None = None,
) -> tuple[Job, bool]:
    """Submit once per (user, key): returns ``(job, replayed)``. The same key with the same body
    returns the job it made; with a different body, ``IdempotencyError``."""
    fingerprint = request_fingerprint(body)
    existing = Job.objects.filter(owner=user, idempotency_key=idempotency_key).first()
    if existing is not None:
        return _replay(existing, user=user, token=token, fingerprint=fingerprint), True
    try:
        with transaction.atomic():
            job = job_submit(
                user=user,
                name=name,
                spec=spec,
                project=project,
                token=token,
                idempotency_key=idempotency_key,
                request_hash=fingerprint,
            )
    except IntegrityError:
        # A concurrent request with the same key committed first; PostgreSQL made this insert wait
        # for it, so its job is visible now.
        existing = Job.objects.filter(owner=user, idempotency_key=idempotency_key).first()
        if existing is None:
            raise
        return _replay(existing, user=user, token=token, fingerprint=fingerprint), True
    return job, False


def _replay(job: Job, *, user, token: ApiToken | None, fingerprint: str) -> Job:
    mismatch = errors.IdempotencyError(errors.IDEMPOTENCY_MISMATCH.format(key=job.idempotency_key))
    if job.request_hash != fingerprint:
        raise mismatch
    try:  # a token of another project must not learn of the job through its key
        return selectors.job_get_for(user, job_id=job.pk, token=token)
    except project_errors.NotFoundError:
        raise mismatch from None


def _enqueue_driver(job_id: int) -> None:
    from webapp.jobs.tasks import job_drive

    try:
        job_drive.delay(job_id)
    except Exception as exc:  # kombu raises many types; the job must not wait forever for nothing
        logger.exception("could not enqueue the driver of job %s", job_id)
        with transaction.atomic():
            job = Job.objects.select_for_update().get(pk=job_id)
            if job.state == JobState.PENDING:
                job_move(
                    job=job,
                    target=JobState.FAILED,
                    reason=FailureReason.QUEUE_UNAVAILABLE,
                    detail=f"{type(exc).__name__}: {exc}",
                )


def job_move(*, job: Job, target: str, reason: str = "", detail: str = "") -> Job:
    """Move a job along the state machine (caller holds the row lock); illegal moves raise."""
    if target not in ALLOWED_MOVES[job.state]:
        raise errors.JobError(errors.ILLEGAL_MOVE.format(current=job.state, target=target))
    job.state = target
    now = timezone.now()
    if target == JobState.RUNNING and job.started_at is None:
        job.started_at = now
    if target in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED):
        job.finished_at = now
    if reason:
        job.failure_reason, job.failure_detail = reason, detail[:4000]
    job.save(
        update_fields=[
            "state",
            "started_at",
            "finished_at",
            "failure_reason",
            "failure_detail",
            "updated_at",
        ]
    )
    job_event_append(
        job=job, epoch=job.epoch, kind="job.state", data={"state": target, "reason": reason}
    )
    return job


def job_event_append(
    *, job: Job, epoch: int, kind: str, data: dict[str, Any], at: datetime | None = None
) -> JobEvent:
    """Append to the job's event log and publish it live after commit; stale epochs are refused."""
    if epoch < job.epoch:
        raise errors.StaleEpochError(errors.STALE_EPOCH.format(epoch=epoch, current=job.epoch))
    event = JobEvent.objects.create(
        job=job, epoch=epoch, kind=kind, data=data, at=at or timezone.now()
    )
    message = {"type": "job.event", "event": event.as_message()}
    group = job.group_name
    transaction.on_commit(lambda: _publish(group, message))
    return event


def _publish(group: str, message: dict) -> None:
    # The event is already durable; live delivery failing must not fail the writer.
    try:
        async_to_sync(get_channel_layer().group_send)(group, message)
    except Exception:
        logger.exception("live delivery of %s to %s failed", message["event"]["id"], group)


@transaction.atomic
def job_cancel(*, job_id: int) -> Job:
    """Ask a job to stop: pending jobs end at once, running ones at their next step boundary."""
    job = Job.objects.select_for_update().get(pk=job_id)
    if job.is_terminal:
        raise errors.JobError(errors.JOB_FINISHED.format(job_id=job.pk, state=job.state))
    if job.state == JobState.CANCELLING:
        return job
    target = JobState.CANCELLED if job.state == JobState.PENDING else JobState.CANCELLING
    return job_move(job=job, target=target)


def job_cancel_for(*, user, job_id: int, token: ApiToken | None = None) -> Job:
    """Cancel on behalf of a person: the job must be visible to them (else ``NotFoundError``) and
    they need the operator role in its project (else ``RoleError``)."""
    job = selectors.job_get_for(user, job_id=job_id, token=token)
    require_role(user, job.project, Role.OPERATOR, token=token)
    return job_cancel(job_id=job.pk)


class DatabaseEventSink:
    """Runtime events of one driver epoch into the job's event log."""

    def __init__(self, *, job_id: int, epoch: int):
        self.job_id, self.epoch = job_id, epoch

    @transaction.atomic
    def emit(self, event) -> None:
        job = Job.objects.select_for_update().get(pk=self.job_id)
        job_event_append(
            job=job,
            epoch=self.epoch,
            kind=event.kind,
            data=dict(event.data),
            at=datetime.fromtimestamp(event.at, tz=UTC),
        )


def _claim_driver(job_id: int) -> tuple[Job, int] | None:
    """Take over a job for a new driver: count the delivery, bump the epoch, mark it starting."""
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job_id)
        if job.is_terminal:
            return None
        job.driver_deliveries += 1
        job.epoch += 1
        job.save(update_fields=["driver_deliveries", "epoch", "updated_at"])
        if job.state == JobState.CANCELLING:
            job_move(job=job, target=JobState.CANCELLED)
            return None
        if job.driver_deliveries > settings.NEREUS_MAX_DRIVER_DELIVERIES:
            detail = errors.TOO_MANY_DELIVERIES.format(count=job.driver_deliveries)
            job_move(
                job=job,
                target=JobState.FAILED,
                reason=FailureReason.TOO_MANY_DELIVERIES,
                detail=detail,
            )
            return None
        if job.state != JobState.STARTING:
            job_move(job=job, target=JobState.STARTING)
        job_move(job=job, target=JobState.RUNNING)
        return job, job.epoch


def _should_stop(job_id: int, epoch: int) -> bool:
    job = Job.objects.only("state", "epoch").get(pk=job_id)
    return job.state == JobState.CANCELLING or job.epoch != epoch


def job_drive(*, job_id: int) -> str:
    """Run a job's driver to the end (the body of the Celery task). Returns the final state."""
    from runtime.jobs.driver import run_sft_job
    from runtime.jobs.spec import PpoSimJobSpec, spec_from_json

    claimed = _claim_driver(job_id)
    if claimed is None:
        return Job.objects.get(pk=job_id).state
    job, epoch = claimed
    sink = DatabaseEventSink(job_id=job_id, epoch=epoch)
    try:
        spec = spec_from_json(job.spec)
        if isinstance(spec, PpoSimJobSpec):
            outcome = _drive_simulated(job_id, epoch, spec, sink)
        else:
            outcome = run_sft_job(
                spec,
                sink=sink,
                ray_address=settings.NEREUS_RAY_ADDRESS,
                should_stop=lambda: _should_stop(job_id, epoch),
            )
    except errors.StaleEpochError:
        logger.warning("driver of job %s epoch %s was superseded; stopping", job_id, epoch)
        return Job.objects.get(pk=job_id).state
    except Exception as exc:
        logger.exception("job %s failed", job_id)
        return _finish(
            job_id,
            epoch,
            JobState.FAILED,
            FailureReason.RUNTIME_ERROR,
            f"{type(exc).__name__}: {exc}",
        )
    target = JobState.SUCCEEDED if outcome.status == "succeeded" else JobState.CANCELLED
    return _finish(job_id, epoch, target)


def _drive_simulated(job_id: int, epoch: int, spec, sink: DatabaseEventSink):
    """A simulated PPO job: the controller's events become plans, proposals and transitions
    (``webapp.plans``), and the approvals people give reach the controller between steps."""
    from runtime.jobs.sim_job import run_sim_ppo_job
    from webapp.plans.services import record_controller_event

    seen = {"after": 0}

    def emit_control(event: dict) -> None:
        record_controller_event(job=Job(pk=job_id), event=event, epoch=epoch)

    def commands() -> list[tuple[str, int]]:
        new = list(
            JobEvent.objects.filter(
                job_id=job_id,
                pk__gt=seen["after"],
                kind__in=("command.approve", "command.reject"),
            ).order_by("pk")
        )
        if new:
            seen["after"] = new[-1].pk
        return [(e.kind.partition(".")[2], int(e.data["proposal"])) for e in new]

    return run_sim_ppo_job(
        spec,
        sink=sink,
        emit_control=emit_control,
        commands=commands,
        should_stop=lambda: _should_stop(job_id, epoch),
    )


@transaction.atomic
def _finish(job_id: int, epoch: int, target: str, reason: str = "", detail: str = "") -> str:
    job = Job.objects.select_for_update().get(pk=job_id)
    if job.epoch != epoch or job.is_terminal:
        return job.state
    if job.state == JobState.CANCELLING and target == JobState.SUCCEEDED:
        target = JobState.CANCELLED  # cancelled during its last step: the user asked it to stop
    if target == JobState.CANCELLED and job.state != JobState.CANCELLING:
        job_move(job=job, target=JobState.CANCELLING)
    job_move(job=job, target=target, reason=reason, detail=detail)
    return job.state
