"""Writes about jobs: submission, state moves, the event log, and running a job's driver."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, InterfaceError, OperationalError, connection, transaction
from django.db.models.functions import Coalesce
from django.utils import timezone

from webapp.jobs import errors, redact, selectors
from webapp.jobs.models import ALLOWED_MOVES, FailureReason, Job, JobEvent, JobState
from webapp.jobs.workdir import job_workdir_claim
from webapp.plans.models import Proposal, ProposalState
from webapp.projects import errors as project_errors
from webapp.projects.models import ApiToken, Project, Role
from webapp.projects.selectors import require_role
from webapp.projects.services import project_personal_for

logger = logging.getLogger(__name__)

T = TypeVar("T")

DATABASE_OUTAGE = (OperationalError, InterfaceError)
"""What the database raises when it is away (a restart, a failover, dropped connections): a
fault of the infrastructure, never of the job."""


def _database_outage(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an exception it was raised from, is the database being away."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, DATABASE_OUTAGE):
            return True
        seen.add(id(exc))
        exc = exc.__cause__
    return False


def _drop_connection() -> None:
    """Close this thread's database connection, so that its next query opens a new one (Django
    does not reconnect a dead connection by itself outside a request). Never inside a
    transaction, which must see its own end."""
    if connection.in_atomic_block:
        return
    try:
        connection.close()
    except Exception:  # closing a dead connection may complain; it is closed all the same
        logger.debug("closing a broken database connection failed", exc_info=True)


def _retrying_database(what: str, operation: Callable[[], T]) -> T:
    """Run ``operation`` (one transaction, or reads), and again on a new connection after a
    pause of each of ``NEREUS_DB_RETRY_S`` while the database is away; then it raises. Inside a
    caller's transaction it is not run again (that transaction is lost already)."""
    delays = tuple(settings.NEREUS_DB_RETRY_S)
    for attempt in range(len(delays) + 1):
        try:
            return operation()
        except DATABASE_OUTAGE as exc:
            if attempt == len(delays) or connection.in_atomic_block:
                raise
            logger.warning(
                "%s: the database is away (%s: %s); trying again in %s s",
                what,
                type(exc).__name__,
                exc,
                delays[attempt],
            )
            _drop_connection()
            time.sleep(delays[attempt])
    raise AssertionError("unreachable")


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


def _enqueue_driver(job_id: int, *, epoch: int | None = None) -> None:
    from webapp.jobs.tasks import job_drive

    try:
        if epoch is None:
            job_drive.delay(job_id)
        else:
            job_drive.delay(job_id, epoch)
    except Exception as exc:  # kombu raises many types; the job must not wait forever for nothing
        logger.exception("could not enqueue the driver of job %s", job_id)
        if epoch is not None:
            return  # a redelivery (``jobs_reap_lost``): the next check tries again
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
    """Move a job along the state machine (caller holds the row lock); illegal moves raise.
    Stopping or stopped, its waiting proposals become stale in the same transaction."""
    if target not in ALLOWED_MOVES[job.state]:
        raise errors.JobError(errors.ILLEGAL_MOVE.format(current=job.state, target=target))
    job.state = target
    now = timezone.now()
    if target == JobState.RUNNING and job.started_at is None:
        job.started_at = now
    if target in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED):
        job.finished_at = now
    if reason:
        job.failure_reason, job.failure_detail = (
            reason,
            _for_viewers(detail, f"job {job.pk}")[:4000],
        )
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
    if target == JobState.CANCELLING:
        # No driver will act on a decision any more: the inbox must not keep asking for one.
        _stale_proposals(job, Proposal.objects.filter(job=job), why="the job is cancelling")
    elif target in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED):
        # Nor on an approval its driver did not take before it stopped: the record must not say
        # that a plan change was approved for a job that never made it.
        _stale_proposals(
            job, Proposal.objects.filter(job=job), why=f"the job {target}", untaken=True
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


RESIZE_NOTICE_MAX_S = 86400.0
"""The longest notice a pool change may give (a day): a shrink announced further ahead than a
job would plan for is better sent later."""


def job_resize_for(
    *, user, job_id: int, slots: Any, notice_s: Any = 0.0, token: ApiToken | None = None
) -> JobEvent:
    """Change a real PPO job's slot pool on behalf of a person: the job must be visible to them
    (else ``NotFoundError``) and they need the operator role in its project (else
    ``RoleError``). See ``job_resize``."""
    job = selectors.job_get_for(user, job_id=job_id, token=token)
    require_role(user, job.project, Role.OPERATOR, token=token)
    return job_resize(job_id=job.pk, slots=slots, notice_s=notice_s, by=user.get_username())


@transaction.atomic
def job_resize(*, job_id: int, slots: Any, notice_s: Any = 0.0, by: str = "") -> JobEvent:
    """Append a ``command.resize`` to the job's log: its driver makes the pool ``slots`` between
    steps (``RayEngine.resize``: a shrink with ``notice_s`` lets the job move off the slots to
    go while they hold their state), and a driver that takes the job over later starts on that
    pool (``job_pool_slots``). A pending job starts on it.

    Refuses: a job that is not a real PPO job, ``slots`` outside 1 to its ``max_slots`` or too few
    for its models in any layout (``PpoJobSpec.check_pool``), a ``notice_s`` that is not a number of
    seconds up to ``RESIZE_NOTICE_MAX_S`` (``ValidationError`` naming the field); a job that has
    finished or is being cancelled (``JobError``), whose driver will never read the command."""
    from runtime.jobs.spec import PpoJobSpec, PpoSimJobSpec, spec_from_json

    job = Job.objects.select_for_update().get(pk=job_id)
    try:
        spec = spec_from_json(job.spec)
    except ValueError as exc:  # stored before a check it now fails (an SFT spec over memory)
        raise ValidationError({"slots": [errors.RESIZE_STALE_SPEC.format(why=exc)]}) from None
    if isinstance(spec, PpoSimJobSpec):
        raise ValidationError({"slots": [errors.RESIZE_SIMULATED]})
    if not isinstance(spec, PpoJobSpec):
        raise ValidationError({"slots": [errors.RESIZE_FIXED.format(kind=spec.kind)]})
    try:
        spec.check_pool(slots)
    except ValueError as exc:
        raise ValidationError({"slots": [str(exc).partition(": ")[2]]}) from None
    if (
        isinstance(notice_s, bool)
        or not isinstance(notice_s, int | float)
        or not 0 <= notice_s <= RESIZE_NOTICE_MAX_S  # NaN fails both
    ):
        raise ValidationError(
            {"notice_s": [errors.NOTICE_RANGE.format(most=f"{RESIZE_NOTICE_MAX_S:g}")]}
        )
    if job.is_terminal:
        raise errors.JobError(errors.JOB_FINISHED.format(job_id=job.pk, state=job.state))
    if job.state == JobState.CANCELLING:
        raise errors.JobError(errors.JOB_STOPPING.format(job_id=job.pk, state=job.state))
    return job_event_append(
        job=job,
        epoch=job.epoch,
        kind="command.resize",
        data={"slots": slots, "notice_s": float(notice_s), "by": by},
    )


def job_pool_slots(job: Job) -> int | None:
    """The pool the job's last ``command.resize`` asked for, whichever driver it was given to;
    None if none was given."""
    last = (
        JobEvent.objects.filter(job=job, kind="command.resize")
        .order_by("-pk")
        .values_list("data", flat=True)
        .first()
    )
    return None if last is None else int(last["slots"])


def _for_viewers(value, what: str):
    """``value`` (a text or an event's data) as the job's viewers may read it: internal
    addresses replaced (``webapp.jobs.redact``); the original goes to the log."""
    shown = redact.redact_data(value)
    if shown != value:
        logger.info("%s: addresses redacted for viewers; the original: %r", what, value)
    return shown


class DatabaseEventSink:
    """Runtime events of one driver epoch into the job's event log."""

    def __init__(self, *, job_id: int, epoch: int):
        self.job_id, self.epoch = job_id, epoch
        self._furthest_before: int | None = None  # the furthest step of the earlier drivers

    def emit(self, event) -> None:
        """Write the event; while the database is away for a moment, wait and write it again
        (``NEREUS_DB_RETRY_S``) rather than lose the job's driver. A write whose commit went
        through but whose answer was lost with the connection is not written twice."""
        attempts = itertools.count()
        data = _for_viewers(dict(event.data), f"job {self.job_id} {event.kind}")
        event = dataclasses.replace(event, data=data)
        _retrying_database(
            f"job {self.job_id} event {event.kind}",
            lambda: self._emit(event, again=next(attempts) > 0),
        )

    @transaction.atomic
    def _emit(self, event, *, again: bool = False) -> None:
        job = Job.objects.select_for_update().get(pk=self.job_id)
        at = datetime.fromtimestamp(event.at, tz=UTC)
        if (
            again
            and JobEvent.objects.filter(job=job, epoch=self.epoch, kind=event.kind, at=at).exists()
        ):
            return  # the earlier try committed it (same kind, epoch and instant)
        job_event_append(job=job, epoch=self.epoch, kind=event.kind, data=dict(event.data), at=at)
        if event.kind == "command.applied" and event.data.get("command") == "override":
            _override_outcome(job, event.data.get("proposal"), str(event.data.get("outcome")))
        if event.kind == "step.finished" and job.driver_deliveries and self._progress(event.data):
            # This delivery moved the job on: it is not one that keeps killing its worker.
            job.driver_deliveries = 0
            job.save(update_fields=["driver_deliveries", "updated_at"])

    def _progress(self, data: dict) -> bool:
        """Whether a finished step takes the job further than any earlier driver of it went (a
        driver that resumes from a checkpoint, or starts over, runs some steps again)."""
        step = data.get("step")
        if data.get("ok") is False or not _is_int(step):
            return False
        if self._furthest_before is None:
            steps = (
                JobEvent.objects.filter(
                    job_id=self.job_id, kind="step.finished", epoch__lt=self.epoch
                )
                .values_list("data__step", flat=True)
                .iterator()
            )
            self._furthest_before = max((s for s in steps if _is_int(s)), default=-1)
        return step > self._furthest_before


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


OVERRIDE_TAKEN = ("applied", "rebatched", "unchanged")
"""What ``Controller.override`` answers when the job runs on the override's plan."""


def _override_outcome(job: Job, proposal_id: Any, outcome: str) -> None:
    """An approved override that the controller did not take (refused, ignored, or its
    transition failed) never applied: it is stale, as a proposal found stale on approval is."""
    if (
        outcome in OVERRIDE_TAKEN
        or isinstance(proposal_id, bool)
        or not isinstance(proposal_id, int)
    ):
        return
    Proposal.objects.filter(
        pk=proposal_id, job=job, proposed_by__isnull=False, state=ProposalState.APPROVED
    ).update(state=ProposalState.STALE)


def _claim_driver(
    job_id: int, *, epoch: int | None = None, unless_alive: bool = False
) -> tuple[Job, int] | None:
    """Take over a job for a new driver: count the delivery, bump the epoch, mark it starting.
    Proposals of older epochs that still wait (for a decision, or for their driver to take an
    approval) become stale: no driver will act on them (``_stale_older_proposals``).

    ``driver_deliveries`` counts the deliveries in a row that did not move the job on: the event
    sink resets it once a driver finishes a step further than any earlier driver did, so only a
    job that keeps killing its worker, not one that lost a few workers over a long life, ends
    ``too_many_deliveries``.

    ``epoch``: the delivery was made for that epoch (by ``jobs_reap_lost``); any other epoch means
    a newer delivery or driver exists, and this one is dropped. ``unless_alive``: drop the delivery
    when the job's current driver is alive (its heartbeat is fresh): the broker redelivered a task
    whose driver still runs, and a second copy must not start. Returns None when dropped."""
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job_id)
        if job.is_terminal:
            return None
        if epoch is not None and job.epoch != epoch:
            logger.info(
                "job %s: dropping a delivery for epoch %s (now %s)", job_id, epoch, job.epoch
            )
            return None
        if unless_alive and job.state != JobState.PENDING and _driver_alive(job):
            logger.info("job %s: its driver (epoch %s) is alive; dropping", job_id, job.epoch)
            return None
        job.driver_deliveries += 1
        job.epoch += 1
        job.heartbeat_at = timezone.now()
        job.save(update_fields=["driver_deliveries", "epoch", "heartbeat_at", "updated_at"])
        _stale_older_proposals(job, why=f"a new driver (epoch {job.epoch}) took the job over")
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


def _stale_older_proposals(job: Job, *, why: str) -> list[int]:
    """The job has a new epoch: what older drivers' controllers proposed (waiting for a
    decision, or approved and never taken) will never happen, as a controller's proposal ids are
    its own and commands are for the epoch they were given in. Marks them stale
    (``_stale_proposals``); returns their ids. A person's overrides are for the job, not for a
    driver: they go on to the new one (``_carry_overrides``)."""
    older = Proposal.objects.filter(job=job, epoch__lt=job.epoch)
    carried = _carry_overrides(job, older.filter(proposed_by__isnull=False))
    return _stale_proposals(job, older.exclude(pk__in=carried), why=why, untaken=True)


def _carry_overrides(job: Job, overrides) -> list[int]:
    """Give the job's new epoch the overrides given before it that no driver took: one waiting
    for its approval is decided for the new driver, and an approved one is given to it again
    (its ``command.approve`` at the new epoch). An override approved while the job waited in the
    queue, or between a lost driver and its successor, was otherwise lost without a word.
    Returns their ids; the caller holds the job's row lock."""
    carried = []
    for row in overrides.filter(state__in=(ProposalState.WAITING, ProposalState.APPROVED)).order_by(
        "pk"
    ):
        if row.state == ProposalState.APPROVED and _proposal_taken(job, row):
            continue
        row.epoch = job.epoch
        row.save(update_fields=["epoch"])
        if row.state == ProposalState.APPROVED:
            job_event_append(
                job=job,
                epoch=job.epoch,
                kind="command.approve",
                data={
                    "proposal": None,
                    "proposal_row": row.pk,
                    "plan": row.plan,
                    "by": row.decided_by.get_username() if row.decided_by else "",
                    "comment": row.comment,
                    "carried": True,
                },
            )
        carried.append(row.pk)
    return carried


def _stale_proposals(job: Job, proposals, *, why: str, untaken: bool = False) -> list[int]:
    """Marks stale those of ``proposals`` that wait for a decision and, with ``untaken``, those
    approved that their driver did not take, with a ``proposals.stale`` event saying why;
    returns their ids. The caller holds the job's row lock."""
    stale = list(proposals.filter(state=ProposalState.WAITING).values_list("pk", flat=True))
    if untaken:
        stale += [
            p.pk
            for p in proposals.filter(state=ProposalState.APPROVED).order_by("pk")
            if not _proposal_taken(job, p)
        ]
    if not stale:
        return []
    stale.sort()
    Proposal.objects.filter(pk__in=stale).update(state=ProposalState.STALE)
    proposals_ended(job, stale, ProposalState.STALE, why)
    return stale


def proposals_ended(job: Job, ids: list[int], state: str, why: str) -> None:
    """The ``proposals.<state>`` event (stale, expired) of proposals the service ended, so that
    every page showing them stops offering them. The caller holds the job's row lock."""
    job_event_append(
        job=job,
        epoch=job.epoch,
        kind=f"proposals.{state}",
        data={"proposals": ids, "epoch": job.epoch, "reason": why},
    )


def _proposal_taken(job: Job, proposal: Proposal) -> bool:
    """Whether its driver's controller took an approved proposal: the controller confirms its own
    with ``control.approved``; a person's override taken is a ``command.applied`` so saying."""
    events = JobEvent.objects.filter(job=job, epoch=proposal.epoch)
    if proposal.proposed_by_id is None:
        return events.filter(
            kind="control.approved", data__proposal=proposal.controller_id
        ).exists()
    return events.filter(
        kind="command.applied",
        data__command="override",
        data__proposal=proposal.pk,
        data__outcome__in=OVERRIDE_TAKEN,
    ).exists()


def _driver_alive(job: Job, now: datetime | None = None) -> bool:
    if job.heartbeat_at is None:
        return False
    age = ((now or timezone.now()) - job.heartbeat_at).total_seconds()
    return age < settings.NEREUS_DRIVER_LOST_S


def _should_stop(job_id: int, epoch: int) -> bool:
    """Between steps: stop when cancelled or superseded; otherwise this is a heartbeat too."""
    return _retrying_database(
        f"job {job_id} between steps", lambda: _should_stop_once(job_id, epoch)
    )


def _should_stop_once(job_id: int, epoch: int) -> bool:
    beat = Job.objects.filter(pk=job_id, epoch=epoch).update(heartbeat_at=timezone.now())
    if not beat:
        return True
    job = Job.objects.only("state", "epoch").get(pk=job_id)
    return job.state == JobState.CANCELLING or job.epoch != epoch


class _Heartbeat:
    """A driver's sign of life between its steps too (a step, or starting Ray, may be long):
    writes ``Job.heartbeat_at`` every ``interval_s`` while the driver's epoch is current."""

    def __init__(self, job_id: int, epoch: int, interval_s: float):
        self.job_id, self.epoch, self.interval_s = job_id, epoch, interval_s
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"heartbeat-job-{job_id}", daemon=True
        )

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            while not self._done.wait(self.interval_s):
                try:
                    beat = Job.objects.filter(pk=self.job_id, epoch=self.epoch).update(
                        heartbeat_at=timezone.now()
                    )
                except Exception:  # the database may be away for a moment; try again later
                    logger.exception("heartbeat of job %s failed", self.job_id)
                    # A dropped connection stays dead in this thread: the next beat opens anew.
                    _drop_connection()
                    continue
                if not beat:
                    return  # superseded: the driver sees it at its next step and stops
        finally:
            connection.close()


def jobs_reap_lost(*, now: datetime | None = None) -> list[int]:
    """Find jobs whose driver went silent (a worker killed, a machine lost) and hand each to a new
    driver. The epoch is bumped here, under the row lock, so an old driver that was only slow
    stops at its next step and writes nothing more (exactly one copy runs); the new driver
    resumes from the job's last checkpoint.

    A job still pending after ``NEREUS_PENDING_REDELIVER_S`` (its driver task lost before any
    driver claimed it) is delivered again, with a new epoch: whichever of its deliveries comes
    first runs it, and every other one is dropped (``_claim_driver``), so a job that only waits
    in the queue behind others still runs once. The wait doubles with each redelivery (up to 8
    times). Returns the ids of the jobs taken over or delivered again."""
    now = now or timezone.now()
    lost_before = now - timedelta(seconds=settings.NEREUS_DRIVER_LOST_S)
    running = (JobState.STARTING, JobState.RUNNING, JobState.TRANSITIONING)
    candidates = Job.objects.filter(
        state__in=(*running, JobState.AWAITING_APPROVAL, JobState.CANCELLING),
        heartbeat_at__lt=lost_before,
    ).values_list("pk", flat=True)
    taken = []
    for job_id in list(candidates):
        with transaction.atomic():
            job = Job.objects.select_for_update().filter(pk=job_id).first()
            if job is None or job.is_terminal or _driver_alive(job, now):
                continue
            silent_s = round((now - job.heartbeat_at).total_seconds(), 1)
            job_event_append(
                job=job,
                epoch=job.epoch,
                kind="job.driver_lost",
                data={"epoch": job.epoch, "silent_s": silent_s},
            )
            job.epoch += 1
            job.heartbeat_at = now  # the new delivery's grace period before it is lost in turn
            job.save(update_fields=["epoch", "heartbeat_at", "updated_at"])
            _stale_older_proposals(
                job, why=f"the driver of epoch {job.epoch - 1} was lost (silent {silent_s} s)"
            )
            if job.state == JobState.CANCELLING:
                job_move(job=job, target=JobState.CANCELLED)
                continue
            new_epoch = job.epoch
            transaction.on_commit(
                lambda job_id=job_id, new_epoch=new_epoch: _enqueue_driver(job_id, epoch=new_epoch)
            )
            logger.warning(
                "job %s: driver silent for %s s; a new driver takes over", job_id, silent_s
            )
            taken.append(job_id)
    return taken + _redeliver_pending(now)


def _redeliver_pending(now: datetime) -> list[int]:
    """Deliver again the driver task of jobs pending too long (see ``jobs_reap_lost``)."""
    base_s = settings.NEREUS_PENDING_REDELIVER_S
    candidates = (
        Job.objects.filter(state=JobState.PENDING)
        .alias(waiting_since=Coalesce("heartbeat_at", "created_at"))
        .filter(waiting_since__lt=now - timedelta(seconds=base_s))
        .values_list("pk", flat=True)
    )
    delivered = []
    for job_id in list(candidates):
        with transaction.atomic():
            job = Job.objects.select_for_update().filter(pk=job_id).first()
            if job is None or job.state != JobState.PENDING:
                continue
            # The heartbeat of a pending job: when its driver task was last sent.
            waited_s = (now - (job.heartbeat_at or job.created_at)).total_seconds()
            if waited_s < base_s * min(2**job.epoch, 8):
                continue
            job_event_append(
                job=job,
                epoch=job.epoch,
                kind="job.redelivered",
                data={"epoch": job.epoch, "pending_s": round(waited_s, 1)},
            )
            job.epoch += 1
            job.heartbeat_at = now
            job.save(update_fields=["epoch", "heartbeat_at", "updated_at"])
            new_epoch = job.epoch
            transaction.on_commit(
                lambda job_id=job_id, new_epoch=new_epoch: _enqueue_driver(job_id, epoch=new_epoch)
            )
            logger.warning(
                "job %s: pending for %s s; its driver task is sent again", job_id, round(waited_s)
            )
            delivered.append(job_id)
    return delivered


def job_drive(*, job_id: int, epoch: int | None = None) -> str:
    """Run a job's driver to the end (the body of the Celery task). Returns the final state.

    ``epoch``: see ``_claim_driver``. Without one (the submit's delivery, or the broker's
    redelivery of it), the job is taken over only when no driver of it is alive."""
    from runtime.jobs.driver import run_sft_job
    from runtime.jobs.spec import PpoJobSpec, PpoSimJobSpec, spec_from_json

    claimed = _claim_driver(job_id, epoch=epoch, unless_alive=epoch is None)
    if claimed is None:
        return Job.objects.get(pk=job_id).state
    job, epoch = claimed
    sink = DatabaseEventSink(job_id=job_id, epoch=epoch)
    try:
        with _Heartbeat(job_id, epoch, settings.NEREUS_DRIVER_HEARTBEAT_S):
            spec = spec_from_json(job.spec)
            if isinstance(spec, PpoSimJobSpec):
                outcome = _drive_simulated(job_id, epoch, spec, sink)
            elif isinstance(spec, PpoJobSpec):
                outcome = _drive_ppo(job_id, epoch, spec, sink)
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
        if _database_outage(exc):
            return _leave_to_reaper(job_id, epoch, exc, last_state=job.state)
        if Job.objects.filter(pk=job_id).values_list("epoch", flat=True).first() != epoch:
            logger.warning("driver of job %s epoch %s was superseded (%s)", job_id, epoch, exc)
            return Job.objects.get(pk=job_id).state
        logger.exception("job %s failed", job_id)
        return _finish(
            job_id,
            epoch,
            JobState.FAILED,
            FailureReason.RUNTIME_ERROR,
            f"{type(exc).__name__}: {exc}",
        )
    target = JobState.SUCCEEDED if outcome.status == "succeeded" else JobState.CANCELLED
    return _retrying_database(f"job {job_id} end", lambda: _finish(job_id, epoch, target))


def _leave_to_reaper(job_id: int, epoch: int, exc: BaseException, *, last_state: str) -> str:
    """The database stayed away while the driver ran: that is no fault of the job, which must
    not fail for it. The driver stops, its heartbeat with it, and ``jobs_reap_lost`` hands the
    job to a new driver (a new epoch) that resumes from its last checkpoint."""
    logger.warning(
        "job %s epoch %s: the database is away (%s: %s); the driver stops and a new one will "
        "take the job over",
        job_id,
        epoch,
        type(exc).__name__,
        exc,
    )
    _drop_connection()
    try:
        return Job.objects.only("state").get(pk=job_id).state
    except DATABASE_OUTAGE:
        _drop_connection()
        return last_state


class _ControlLink:
    """The web side of a controller: its events become plans, proposals and transitions
    (``webapp.plans``), and the approvals people give (``command.*`` entries of the job's log)
    reach it between steps."""

    def __init__(self, job_id: int, epoch: int):
        self.job_id, self.epoch = job_id, epoch
        # Commands given to an older driver were for its proposals; this one starts after them
        # (not after its own: one given since it claimed the job is for it).
        last = (
            JobEvent.objects.filter(job_id=job_id, kind__in=COMMAND_KINDS, epoch__lt=epoch)
            .order_by("-pk")
            .values_list("pk", flat=True)
            .first()
        )
        self.after = last or 0

    def emit_control(self, event: dict) -> None:
        from webapp.plans.services import record_controller_event

        # One id for every try: a retry after a commit whose answer was lost records nothing.
        event_id = uuid.uuid4().hex
        event = _for_viewers(event, f"job {self.job_id} {event.get('event')}")

        def record() -> None:
            with transaction.atomic():
                record_controller_event(
                    job=Job(pk=self.job_id), event=event, epoch=self.epoch, event_id=event_id
                )
                self._follow(event.get("event"))

        _retrying_database(f"job {self.job_id} {event.get('event')}", record)

    def _follow(self, kind: str | None) -> None:
        """The job's state follows its controller: awaiting approval while a proposal waits."""
        if kind == "control.proposal":
            source, target = JobState.RUNNING, JobState.AWAITING_APPROVAL
        elif kind in _PROPOSAL_ENDS:
            source, target = JobState.AWAITING_APPROVAL, JobState.RUNNING
        else:
            return
        job = Job.objects.select_for_update().get(pk=self.job_id)
        if job.epoch == self.epoch and job.state == source:
            job_move(job=job, target=target)

    def commands(self) -> list[tuple[str, Any]]:
        """The commands people gave since the last call (``runtime.jobs.driver.Command``): an
        approval or rejection of a controller's proposal, by its controller id; a controller's
        proposal a person's newer override made stale (``stale``), by its controller id; an
        approved override (a person's proposal: no controller id), with its plan; a pool
        change. A rejected override asks nothing of the driver."""
        new = _retrying_database(
            f"job {self.job_id} commands",
            lambda: list(
                JobEvent.objects.filter(
                    job_id=self.job_id, pk__gt=self.after, kind__in=COMMAND_KINDS
                ).order_by("pk")
            ),
        )
        if new:
            self.after = new[-1].pk
        commands: list[tuple[str, Any]] = []
        for e in new:
            if e.epoch != self.epoch:
                continue  # a resize given to an older driver: this one started on its pool
            if e.kind == "command.resize":
                commands.append(
                    ("resize", {"slots": e.data["slots"], "notice_s": e.data["notice_s"]})
                )
                continue
            decision, proposal = e.kind.partition(".")[2], e.data.get("proposal")
            if proposal is not None:
                commands.append((decision, int(proposal)))
            elif decision == "approve":
                override = {"plan": e.data.get("plan"), "proposal": e.data.get("proposal_row")}
                commands.append(("override", override))
        return commands


COMMAND_KINDS = ("command.approve", "command.reject", "command.stale", "command.resize")
_PROPOSAL_ENDS = ("control.approved", "control.rejected", "control.expired", "control.stale")


def _drive_simulated(job_id: int, epoch: int, spec, sink: DatabaseEventSink):
    """A simulated PPO job: the real controller against the simulated cluster."""
    from runtime.jobs.sim_job import run_sim_ppo_job

    link = _ControlLink(job_id, epoch)
    return run_sim_ppo_job(
        spec,
        sink=sink,
        emit_control=link.emit_control,
        commands=link.commands,
        should_stop=lambda: _should_stop(job_id, epoch),
    )


def _drive_ppo(job_id: int, epoch: int, spec, sink: DatabaseEventSink):
    """A real PPO job on slots through the Ray engine (``RAY_ADDRESS``, or a local Ray). Its
    working directory is the job's own, so a driver that takes over after a lost worker resumes
    from the last committed checkpoint there."""
    from runtime.events import RuntimeEvent
    from runtime.jobs.ppo_job import run_ppo_job

    workdir, set_aside = job_workdir_claim(Job.objects.get(pk=job_id))
    if set_aside is not None:
        logger.warning(
            "job %s: %s held another job's files; moved to %s", job_id, workdir, set_aside
        )
        sink.emit(
            RuntimeEvent(
                kind="job.workdir_set_aside",
                data={"workdir": str(workdir), "moved_to": str(set_aside)},
            )
        )
    link = _ControlLink(job_id, epoch)
    num_slots = _retrying_database(
        f"job {job_id} pool", lambda: job_pool_slots(Job.objects.get(pk=job_id))
    )
    return run_ppo_job(
        spec,
        num_slots=num_slots,
        sink=sink,
        emit_control=link.emit_control,
        commands=link.commands,
        should_stop=lambda: _should_stop(job_id, epoch),
        ray_address=settings.NEREUS_RAY_ADDRESS,
        workdir=workdir,
        still_current=lambda: _still_current(job_id, epoch),
    )


def _still_current(job_id: int, epoch: int) -> bool:
    """Whether the driver of ``epoch`` still owns the job (asked before it writes the job's
    files: a driver taken over in the middle of a step writes no checkpoint after that)."""
    return _retrying_database(
        f"job {job_id} before writing its files",
        lambda: Job.objects.filter(pk=job_id, epoch=epoch).exists(),
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
    if target == JobState.SUCCEEDED and job.state != JobState.RUNNING:
        job_move(job=job, target=JobState.RUNNING)  # ended with a proposal still waiting
    job_move(job=job, target=target, reason=reason, detail=detail)
    return job.state
