"""Writes about plans, transitions and proposals.

``record_controller_event`` turns the runtime controller's events into rows and appends each to
the job's event log. ``proposal_decide`` records a person's answer to a proposal and appends a
``command.approve`` / ``command.reject`` event; the job's driver (``webapp.jobs.services``, for the
"ppo" and "ppo-sim" kinds) reads those commands between steps and passes them to
``Controller.command``, which answers with ``control.approved`` / ``control.rejected`` /
``control.stale``. An approved override (``proposal_override``: a person's plan) goes to
``Controller.override``, which moves the job to it (a ``control.decision`` with trigger
``override``, then its transition) or refuses it (``control.override_refused``). A newer
proposal for a job, the controller's or a person's, makes the older ones still waiting stale
(``_supersede``): only a job's newest proposal can be approved.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from runtime.control.policy import MAX_APPROVAL_TIMEOUT_S, JobPolicy, PolicyError
from runtime.events import finite
from runtime.planner.plan import Plan as RuntimePlan
from webapp.jobs import errors as job_errors
from webapp.jobs.models import Job, JobEvent, JobState
from webapp.jobs.services import job_event_append, proposals_ended
from webapp.plans import errors
from webapp.plans.models import (
    Plan,
    Proposal,
    ProposalRoute,
    ProposalState,
    Transition,
    TransitionState,
)
from webapp.projects.models import ApiToken, Role
from webapp.projects.selectors import require_role
from webapp.validators import control_character

DECISIONS = ("approve", "reject")
# What the controller reports about a proposal, as the state it leaves the proposal in.
OUTCOMES = {
    "control.approved": ProposalState.APPROVED,
    "control.rejected": ProposalState.REJECTED,
    "control.expired": ProposalState.EXPIRED,
    "control.stale": ProposalState.STALE,
}

COMMENT_MAX_CHARS = 4000
"""The longest comment on a decision (the API's, the page's and the command line's)."""


# --- the controller's events -----------------------------------------------------------------


@transaction.atomic
def record_controller_event(
    *,
    job: Job,
    event: Mapping[str, Any],
    event_id: str = "",
    epoch: int | None = None,
    at: datetime | None = None,
) -> JobEvent:
    """Record one controller event (``{"event": "control.…", …}``) as rows and as an entry of the
    job's log, which is returned. With an ``event_id``, recording the same event again returns
    the first entry and changes nothing. ``epoch`` defaults to the job's current one; an older
    epoch raises ``StaleEpochError``; a malformed event raises ``ValueError`` naming the field."""
    job = Job.objects.select_for_update().get(pk=job.pk)
    epoch = job.epoch if epoch is None else epoch
    if epoch < job.epoch:
        raise job_errors.StaleEpochError(
            job_errors.STALE_EPOCH.format(epoch=epoch, current=job.epoch)
        )
    if not isinstance(event, Mapping):
        raise ValueError(errors.BAD_EVENT.format(field="", problem="expected an object"))
    kind = event.get("event")
    if not isinstance(kind, str) or not kind:
        raise ValueError(errors.BAD_EVENT.format(field="event", problem="expected a kind"))
    if event_id:
        existing = job.events.filter(kind=kind, data__event_id=event_id).first()
        if existing is not None:
            return existing
    data = finite({key: value for key, value in event.items() if key != "event"})
    if event_id:
        data["event_id"] = event_id
    recorder = _RECORDERS.get(kind)
    if recorder is not None:
        data["record"] = recorder(job, epoch, data)
    elif kind in OUTCOMES:
        data["record"] = _record_outcome(job, epoch, data, OUTCOMES[kind])
    return job_event_append(job=job, epoch=epoch, kind=kind, data=data, at=at)


def _record_plan(job: Job, epoch: int, data: dict) -> dict:
    row = _make_current(job, epoch, _plan_field(data, "plan"), reason=str(data.get("reason", "")))
    return {"plan": row.pk}


def _record_transition(job: Job, epoch: int, data: dict) -> dict:
    dag = data.get("dag")
    if not isinstance(dag, dict) or not isinstance(dag.get("nodes"), list):
        raise ValueError(errors.BAD_EVENT.format(field="dag", problem="expected a DAG object"))
    ok = data.get("ok")
    if not isinstance(ok, bool):
        raise ValueError(errors.BAD_EVENT.format(field="ok", problem="expected true or false"))
    predicted_s = _number(data, "predicted_s")
    actual_s = _number(data, "actual_s", required=False)
    source = Plan.objects.filter(job=job, current=True).first()
    target = _target(job, epoch, data)
    destination = None
    if target is not None:
        if ok:
            destination = _make_current(job, epoch, target, reason="transition")
        else:
            destination = _make_plan(job, epoch, target, reason="transition failed")
    row = Transition.objects.create(
        job=job,
        epoch=epoch,
        from_plan=source,
        to_plan=destination,
        dag=dag,
        num_nodes=int(data.get("nodes") or len(dag["nodes"])),
        predicted_s=predicted_s if predicted_s is not None else 0.0,
        actual_s=actual_s,
        state=TransitionState.DONE if ok else TransitionState.FAILED,
        failure=str(data.get("failure") or ""),
        simulated=bool(data.get("simulated", False)),
    )
    return {"transition": row.pk, "plan": destination.pk if destination else None}


def _record_restart(job: Job, epoch: int, data: dict) -> dict:
    target = _target(job, epoch, data)
    if target is None:
        return {"plan": None}
    row = _make_current(job, epoch, target, reason=f"restart: {data.get('reason', '')}")
    return {"plan": row.pk}


def _record_proposal(job: Job, epoch: int, data: dict) -> dict:
    controller_id = data.get("proposal")
    if isinstance(controller_id, bool) or not isinstance(controller_id, int) or controller_id < 1:
        raise ValueError(errors.BAD_EVENT.format(field="proposal", problem="expected an id"))
    plan = _plan_field(data, "plan")
    verdict = data.get("verdict")
    if verdict is not None and not isinstance(verdict, dict):
        raise ValueError(errors.BAD_EVENT.format(field="verdict", problem="expected an object"))
    route = data.get("route", ProposalRoute.LIVE)
    if route not in ProposalRoute.values:
        raise ValueError(
            errors.BAD_EVENT.format(
                field="route", problem=f"expected one of {ProposalRoute.values}"
            )
        )
    row, created = Proposal.objects.get_or_create(
        job=job,
        epoch=epoch,
        controller_id=controller_id,
        defaults={
            "plan": plan,
            "verdict": verdict,
            "reason": str((verdict or {}).get("reason", "")),
            "route": route,
            "expires_at": timezone.now() + approval_timeout(job),
        },
    )
    if created:
        _supersede(job, row)
    return {"proposal": row.pk}


def _supersede(job: Job, newer: Proposal) -> list[int]:
    """A newer proposal for a job makes every older one still waiting stale, the controller's
    and people's overrides alike: only the newest can be approved, so that two approvals never
    both reach the job (an older one approved before the newer was made is not waiting, and
    stays approved). Returns their ids; the caller holds the job's row lock.

    The pages are told (``proposals.stale``) of those the controller has not announced itself:
    a controller's new proposal replaces its own older one with a ``control.stale`` of its own.
    A person's override superseding the controller's proposal also tells the controller, which
    holds it as its pending proposal (``command.stale``, passed on between steps like a
    decision): it lets it go and the job stops awaiting an approval nobody can give."""
    older = list(
        Proposal.objects.select_for_update()
        .filter(job=job, state=ProposalState.WAITING, pk__lt=newer.pk)
        .order_by("pk")
    )
    if not older:
        return []
    ids = [row.pk for row in older]
    Proposal.objects.filter(pk__in=ids).update(state=ProposalState.STALE)
    why = f"superseded by proposal {newer.pk}, made after it for the same job"
    by_person = newer.proposed_by_id is not None
    announce = [row.pk for row in older if by_person or row.proposed_by_id is not None]
    if announce:
        proposals_ended(job, announce, ProposalState.STALE, why)
    for row in older:
        if by_person and row.proposed_by_id is None and row.controller_id is not None:
            job_event_append(
                job=job,
                epoch=row.epoch,
                kind="command.stale",
                data={"proposal": row.controller_id, "proposal_row": row.pk, "reason": why},
            )
    return ids


def _record_outcome(job: Job, epoch: int, data: dict, state: str) -> dict:
    controller_id = data.get("proposal")
    row = (
        Proposal.objects.select_for_update()
        .filter(job=job, epoch=epoch, controller_id=controller_id)
        .first()
        if isinstance(controller_id, int) and not isinstance(controller_id, bool)
        else None
    )
    if row is None:
        return {"proposal": None}  # its proposal was not recorded; the log entry still is
    # Approved or rejected confirm a waiting proposal; expired or stale mean the plan was not
    # applied, whatever a person decided, so they always win.
    confirms = state in (ProposalState.APPROVED, ProposalState.REJECTED)
    if row.state == ProposalState.WAITING or not confirms:
        row.state = state
        row.save(update_fields=["state"])
    return {"proposal": row.pk}


_RECORDERS: dict[str, Callable[[Job, int, dict], dict]] = {
    "control.plan": _record_plan,
    "control.transition": _record_transition,
    "control.restart": _record_restart,
    "control.proposal": _record_proposal,
}


def _make_plan(job: Job, epoch: int, plan: dict, *, reason: str, current: bool = False) -> Plan:
    return Plan.objects.create(
        job=job,
        epoch=epoch,
        plan=plan,
        predicted_step_s=float(plan.get("predicted_step_s") or 0.0),
        current=current,
        reason=reason[:500],
    )


def _make_current(job: Job, epoch: int, plan: dict, *, reason: str) -> Plan:
    Plan.objects.filter(job=job, current=True).update(current=False)
    return _make_plan(job, epoch, plan, reason=reason, current=True)


def _target(job: Job, epoch: int, data: dict) -> dict | None:
    """The plan a transition or restart moved the job to: the event names it (``target``);
    an event from before it did is read as ``_last_target`` reads the log."""
    if "target" in data:
        return _plan_field(data, "target")
    return _last_target(job, epoch)


def _last_target(job: Job, epoch: int) -> dict | None:
    """The plan the controller is moving to, for events that do not name it: the last
    decision's candidate, or the plan of the proposal it last approved (a transition or restart
    follows one of the two, unless something the controller had in hand came between)."""
    last = (
        job.events.filter(epoch=epoch, kind__in=["control.decision", "control.approved"])
        .order_by("-id")
        .first()
    )
    if last is None:
        return None
    if last.kind == "control.approved":
        proposal = Proposal.objects.filter(
            job=job, epoch=epoch, controller_id=last.data.get("proposal")
        ).first()
        return proposal.plan if proposal is not None else None
    candidate = last.data.get("candidate")
    return candidate if isinstance(candidate, dict) else None


def _plan_field(data: dict, field: str) -> dict:
    value = data.get(field)
    if not isinstance(value, dict):
        raise ValueError(errors.BAD_EVENT.format(field=field, problem="expected a plan object"))
    try:
        RuntimePlan.from_json(value)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            errors.BAD_EVENT.format(field=field, problem=f"not a plan: {exc}")
        ) from None
    return value


def _number(data: dict, field: str, *, required: bool = True) -> float | None:
    value = data.get(field)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(errors.BAD_EVENT.format(field=field, problem="expected a number"))
    return float(value)


def approval_timeout(job: Job) -> timedelta:
    """How long a proposal of this job waits: its spec's ``policy.approval_timeout_s``, or the
    runtime's default; never more than ``MAX_APPROVAL_TIMEOUT_S`` (a spec stored before that
    bound must not make the deadline overflow the calendar and fail the job)."""
    policy = job.spec.get("policy") if isinstance(job.spec, dict) else None
    try:
        seconds = JobPolicy.from_json(policy).approval_timeout_s if policy else None
    except (PolicyError, TypeError):
        raw = policy.get("approval_timeout_s") if isinstance(policy, Mapping) else None
        valid = isinstance(raw, int | float) and not isinstance(raw, bool) and raw >= 0  # no NaN
        seconds = raw if valid else None
    if seconds is None:
        seconds = JobPolicy().approval_timeout_s
    return timedelta(seconds=min(seconds, MAX_APPROVAL_TIMEOUT_S))


# --- people's proposals and decisions ----------------------------------------------------------


PLANNED_KINDS = ("ppo", "ppo-sim")
"""The job kinds a controller drives, which take a person's plan."""


@transaction.atomic
def proposal_override(
    *, user, job: Job, plan: dict[str, Any], reason: str, token: ApiToken | None = None
) -> Proposal:
    """A person proposes a plan for a job (operator role or above); another person approves it,
    and the job's driver moves to it (``Controller.override``), or refuses it saying why.

    Refuses: a caller below operator (``RoleError``); a plan that is not one, or a job no
    controller drives (SFT) (``ValidationError`` on ``plan``); a job that has finished or is
    being cancelled (``JobError``), whose driver will never read the approval."""
    require_role(user, job.project, Role.OPERATOR, token=token)
    kind = job.spec.get("kind", "sft") if isinstance(job.spec, dict) else "sft"
    if kind not in PLANNED_KINDS:  # no controller reads its commands
        raise ValidationError({"plan": [errors.OVERRIDE_FIXED.format(kind=kind)]})
    plan = _plan_sent(plan)
    job = Job.objects.select_for_update().get(pk=job.pk)
    if job.is_terminal or job.state == JobState.CANCELLING:
        raise job_errors.JobError(
            errors.OVERRIDE_JOB_STOPPED.format(job_id=job.pk, state=job.state)
        )
    proposal = Proposal.objects.create(
        job=job,
        epoch=job.epoch,
        plan=plan,
        reason=reason,
        proposed_by=user,
        expires_at=timezone.now() + approval_timeout(job),
    )
    job_event_append(
        job=job,
        epoch=job.epoch,
        kind="proposal.override",
        data={"proposal_row": proposal.pk, "by": user.get_username(), "reason": reason},
    )
    _supersede(job, proposal)  # what waited before it is stale: only the newest is decided
    return proposal


def _plan_sent(plan: Any) -> dict[str, Any]:
    """A plan a person sent, as the runtime reads it (``Plan.to_json`` of what it parsed), or
    ``ValidationError`` on ``plan``: not a plan, or with a field the runtime does not read (a
    misspelt one would otherwise be dropped without a word; what is kept is what the driver
    will run)."""
    if not isinstance(plan, dict):
        raise ValidationError({"plan": ["expected a plan object"]})
    try:
        parsed = RuntimePlan.from_json(plan)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValidationError({"plan": [f"not a plan: {exc}"]}) from None
    read = parsed.to_json()
    unknown = _unknown_fields(plan, read, "plan")
    if unknown:
        raise ValidationError({"plan": [errors.PLAN_UNKNOWN_FIELD.format(path=unknown)]})
    nul = _nul_at(read, "plan")
    if nul:
        raise ValidationError({"plan": [nul]})
    return finite(read)


def _nul_at(value: Any, path: str) -> str:
    """Where a string or a key of ``value`` (a parsed plan's JSON: what is stored) holds a NUL
    character, said as the refusal, or ``""``. PostgreSQL's jsonb cannot store one (SQLite
    would), so it is refused here, as ``proposal_decide`` refuses it in a comment, rather than
    a 500 from the database. Here, not in the runtime's ``Plan``: only the service's storage
    minds it, and a person's plan reaches storage only through this function."""
    if isinstance(value, str):
        return errors.PLAN_NUL.format(path=path) if "\x00" in value else ""
    if isinstance(value, dict):
        for key, item in value.items():
            if "\x00" in key:
                return errors.PLAN_NUL_KEY.format(path=path)
            found = _nul_at(item, f"{path}.{key}")
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _nul_at(item, f"{path}[{i}]")
            if found:
                return found
    return ""


def _unknown_fields(sent: Any, read: Any, path: str) -> str:
    """The first field of ``sent`` that ``read`` (what was parsed from it) does not have, as a
    dotted path, or ``""``. Walks no deeper than ``read`` goes, so however deep ``sent`` is
    nested this is bounded by the plan's own shape."""
    if isinstance(sent, dict) and isinstance(read, dict):
        for key in sent:
            if key not in read:
                return f"{path}.{key}"
            found = _unknown_fields(sent[key], read[key], f"{path}.{key}")
            if found:
                return found
    elif isinstance(sent, list) and isinstance(read, list) and len(sent) == len(read):
        for i, (one, other) in enumerate(zip(sent, read, strict=True)):
            found = _unknown_fields(one, other, f"{path}[{i}]")
            if found:
                return found
    return ""


def proposal_decide(
    *,
    user,
    proposal: Proposal,
    decision: str,
    comment: str,
    token: ApiToken | None = None,
) -> Proposal:
    """Approve or reject a waiting proposal (approver role or above), with a required comment.

    Refuses: a caller who cannot see the job (``NotFoundError``) or is below approver
    (``RoleError``); a bad decision or blank comment (``ValidationError`` naming the field); a
    proposal that is not waiting, expired, from an older driver epoch, older than another
    proposal for the same job (only the newest is decided: ``errors.SUPERSEDED``) or of a job
    that has finished or is being cancelled (``ProposalError``; the last four are marked
    expired or stale as they are found); the proposer approving their own override
    (``SelfApprovalError``, unless ``NEREUS_ALLOW_SELF_APPROVAL``). On success, appends
    ``command.<decision>`` to the job's log for its driver to pass to the controller between
    steps (an approved override: ``Controller.override``; a rejected one asks nothing of it).
    """
    require_role(user, proposal.job.project, Role.APPROVER, token=token)
    if decision not in DECISIONS:
        raise ValidationError({"decision": [errors.BAD_DECISION.format(decision=decision)]})
    comment = comment.strip() if isinstance(comment, str) else ""
    if not comment:
        raise ValidationError({"comment": [errors.COMMENT_REQUIRED]})
    if "\x00" in comment:  # PostgreSQL's text cannot hold it (SQLite would store it)
        raise ValidationError({"comment": [errors.COMMENT_NUL]})
    if char := control_character(comment, multiline=True):  # the page's form, as the API's
        raise ValidationError({"comment": [errors.COMMENT_CONTROL.format(char=char)]})
    if len(comment) > COMMENT_MAX_CHARS:  # the API's limit, for the page's form too
        raise ValidationError(
            {"comment": [errors.COMMENT_TOO_LONG.format(most=COMMENT_MAX_CHARS, got=len(comment))]}
        )
    decided, refusal = _decide(
        user=user,
        job_id=proposal.job_id,
        proposal_id=proposal.pk,
        decision=decision,
        comment=comment,
    )
    if refusal is not None:
        raise refusal  # after the commit, so that an expired or stale mark is kept
    return decided


@transaction.atomic
def _decide(
    *, user, job_id: int, proposal_id: int, decision: str, comment: str
) -> tuple[Proposal, errors.ProposalError | None]:
    job = Job.objects.select_for_update().get(pk=job_id)  # the job first, as every writer does
    row = Proposal.objects.select_for_update().get(pk=proposal_id)
    newer = (
        Proposal.objects.filter(job=job, pk__gt=row.pk).order_by("-pk").values_list("pk", flat=True)
    ).first()
    if row.state != ProposalState.WAITING:
        if row.state == ProposalState.STALE and newer is not None:
            return row, errors.ProposalError(
                errors.SUPERSEDED.format(proposal_id=row.pk, newer=newer)
            )
        return row, errors.ProposalError(
            errors.NOT_WAITING.format(proposal_id=row.pk, state=row.state)
        )
    if job.is_terminal or job.state == JobState.CANCELLING:
        # A cancelling job's driver stops at its next step boundary, before it reads commands:
        # an approval now would be recorded and never applied.
        return _mark(job, row, ProposalState.STALE), errors.ProposalError(
            errors.JOB_FINISHED.format(proposal_id=row.pk, state=job.state)
        )
    if row.epoch < job.epoch:
        return _mark(job, row, ProposalState.STALE), errors.ProposalError(
            errors.SUPERSEDED_EPOCH.format(proposal_id=row.pk, epoch=row.epoch, current=job.epoch)
        )
    if newer is not None:  # one that waited from before newer proposals went stale with them
        return _mark(job, row, ProposalState.STALE, f"superseded by proposal {newer}"), (
            errors.ProposalError(errors.SUPERSEDED.format(proposal_id=row.pk, newer=newer))
        )
    if timezone.now() >= row.expires_at:
        return _mark(job, row, ProposalState.EXPIRED), errors.ProposalError(
            errors.EXPIRED.format(proposal_id=row.pk, expires_at=row.expires_at.isoformat())
        )
    self_approval = row.proposed_by_id is not None and row.proposed_by_id == user.pk
    if decision == "approve" and self_approval and not settings.NEREUS_ALLOW_SELF_APPROVAL:
        return row, errors.SelfApprovalError(errors.SELF_APPROVAL)
    row.state = ProposalState.APPROVED if decision == "approve" else ProposalState.REJECTED
    row.decided_by, row.decided_at, row.comment = user, timezone.now(), comment
    row.save(update_fields=["state", "decided_by", "decided_at", "comment"])
    job_event_append(
        job=job,
        epoch=row.epoch,
        kind=f"command.{decision}",
        data={
            "proposal": row.controller_id,
            "proposal_row": row.pk,
            "plan": row.plan,
            "by": user.get_username(),
            "comment": comment,
        },
    )
    return row, None


def _mark(job: Job, row: Proposal, state: str, why: str = "") -> Proposal:
    """Mark a waiting proposal stale or expired as a decision finds it, with the job's event
    that says so to every page showing it (the caller holds the job's row lock)."""
    row.state = state
    row.save(update_fields=["state"])
    if not why:
        why = "past its deadline" if state == ProposalState.EXPIRED else "found stale when decided"
    proposals_ended(job, [row.pk], state, why)
    return row


def proposals_expire_overdue(*, now: datetime | None = None) -> int:
    """Mark waiting proposals past their deadline expired (the job keeps its plan), each job's
    with a ``proposals.expired`` event, so that the pages showing them stop offering them;
    returns how many. Run by the periodic ``plans.expire`` task (``CELERY_BEAT_SCHEDULE``)."""
    now = now or timezone.now()
    overdue = Proposal.objects.filter(state=ProposalState.WAITING, expires_at__lte=now)
    expired = 0
    for job_id in sorted(set(overdue.values_list("job_id", flat=True))):
        with transaction.atomic():
            job = Job.objects.select_for_update().get(pk=job_id)  # the job first, as ever
            ids = sorted(overdue.filter(job=job).select_for_update().values_list("pk", flat=True))
            if not ids:
                continue
            Proposal.objects.filter(pk__in=ids).update(state=ProposalState.EXPIRED)
            proposals_ended(job, ids, ProposalState.EXPIRED, "past its deadline")
            expired += len(ids)
    return expired
