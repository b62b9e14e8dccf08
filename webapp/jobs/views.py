"""Pages: the job list (state filter, bulk cancel), the submit form with its preview, and a job's
live page (with its cancel and, for a real PPO job, its slot-pool form)."""

from __future__ import annotations

import uuid

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import Http404, JsonResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_http_methods, require_POST

from runtime.control.policy import DEFAULT_THRESHOLD
from runtime.planner.memory import HEADROOM
from webapp.jobs import errors, selectors, services
from webapp.jobs.forms import JobSubmitForm, PoolForm
from webapp.jobs.models import JobState
from webapp.jobs.preview import job_preview
from webapp.projects import errors as project_errors
from webapp.projects.models import Role
from webapp.projects.selectors import require_role, role_of

LIST_LIMIT = 200
BULK_CANCEL_MAX = 200


@login_required
@require_http_methods(["GET", "POST"])
def job_list(request):
    if request.method == "POST":  # the submit form posts here too
        return job_new(request)
    state = request.GET.get("state") or None
    state_error = ""
    if state is not None and state not in JobState.values:
        state_error = f"state: expected one of {', '.join(JobState.values)}, got {state!r}"
        state = None
    jobs = list(selectors.job_list_for(request.user, state=state)[:LIST_LIMIT])
    cancellable = _projects_where(request.user, jobs, Role.OPERATOR)
    rows = [
        {"job": job, "can_cancel": job.project_id in cancellable and not job.is_terminal}
        for job in jobs
    ]
    return render(
        request,
        "jobs/list.html",
        {
            "rows": rows,
            "jobs": jobs,
            "states": JobState.values,
            "state": state or "",
            "state_error": state_error,
            "any_cancellable": any(row["can_cancel"] for row in rows),
        },
        status=400 if state_error else 200,
    )


def _projects_where(user, jobs, role: str) -> set[int]:
    allowed = set()
    for project in {job.project for job in jobs}:
        have = role_of(user, project)
        if have is not None and have.allows(role):
            allowed.add(project.pk)
    return allowed


FORM_SENT_BEFORE = (
    "this page was submitted before with other values (its job is in the list); "
    "submit again to make another job"
)


def _with_new_key(data):
    data = data.copy()
    data["submit_key"] = uuid.uuid4().hex
    return data


@login_required
@require_http_methods(["GET", "POST"])
def job_new(request):
    form = JobSubmitForm(request.POST or None, user=request.user)
    if request.method == "POST" and form.is_valid():
        data, spec = form.cleaned_data, form.spec()
        try:
            if data["submit_key"]:  # the page's own: a second submit of it makes no second job
                job, _ = services.job_submit_idempotent(
                    user=request.user,
                    name=data["name"],
                    spec=spec,
                    project=data["project"],
                    idempotency_key=f"form-{data['submit_key']}",
                    body={
                        "name": data["name"],
                        "spec": spec,
                        "project": data["project"] and data["project"].pk,
                    },
                )
            else:
                job = services.job_submit(
                    user=request.user, name=data["name"], spec=spec, project=data["project"]
                )
        except errors.IdempotencyError:
            # The page was submitted before with other values (back, edit, submit): say so,
            # and give the form shown again a key of its own, so that submitting it goes on.
            form = JobSubmitForm(_with_new_key(request.POST), user=request.user)
            form.is_valid()
            form.add_error(None, FORM_SENT_BEFORE)
        except ValidationError as exc:
            for problems in exc.message_dict.values():
                for problem in problems:
                    form.add_error(form.field_of(problem), problem)
        except (project_errors.NotFoundError, project_errors.RoleError) as exc:
            form.add_error("project", str(exc))
        else:
            return redirect("jobs:detail", job_id=job.pk)
    return render(request, "jobs/new.html", {"form": form})


@login_required
@require_POST
def job_preview_view(request):
    """JSON: the submit form's field errors, or the layout the job would start on."""
    form = JobSubmitForm(request.POST, user=request.user)
    if not form.is_valid():
        return JsonResponse({"ok": False, "errors": form.errors.get_json_data()}, status=400)
    try:
        preview = job_preview(form.spec())
    except ValueError as exc:
        field = form.field_of(str(exc)) or "__all__"
        return JsonResponse(
            {"ok": False, "errors": {field: [{"message": str(exc), "code": "invalid"}]}},
            status=400,
        )
    return JsonResponse({"ok": True, "preview": preview})


@login_required
def job_detail(request, job_id: int):
    try:
        job = selectors.job_get_for(request.user, job_id=job_id)
    except project_errors.NotFoundError:
        raise Http404("no such job") from None
    role = role_of(request.user, job.project)
    kind = job.spec.get("kind", "sft") if isinstance(job.spec, dict) else "sft"
    simulated = kind == "ppo-sim"
    context = {
        "job": job,
        "role": role,
        "can_cancel": role is not None and role.allows(Role.OPERATOR),
        "can_approve": role is not None and role.allows(Role.APPROVER),
        "simulated": simulated,
    }
    if kind in ("ppo", "ppo-sim"):  # the controller's panels; labelled by the events' flag too
        policy = job.spec.get("policy") or {}
        thresholds = policy.get("thresholds") or {}
        context["config"] = {
            "job": job.pk,
            "thresholds": {
                signal: thresholds.get(signal, DEFAULT_THRESHOLD)
                for signal in ("gen_len", "step_time", "peak_memory")
            },
            "memory_budget": 1.0 - HEADROOM,
            "decide_url": reverse("plans:decide", args=[0]).replace("/0/", "/{id}/"),
            "can_approve": context["can_approve"],
            "simulated": simulated,
        }
        context["artifacts"] = {} if simulated else selectors.job_artifacts(job=job)
        stopping = job.is_terminal or job.state == JobState.CANCELLING
        if not simulated and context["can_cancel"] and not stopping:
            slots = services.job_pool_slots(job) or job.spec.get("num_slots")
            context["pool_form"] = PoolForm(
                initial={"slots": slots, "notice_s": 0}, max_slots=job.spec.get("max_slots")
            )
        return render(request, "jobs/detail_ppo.html", context)
    return render(request, "jobs/detail.html", context)


@login_required
@require_POST
def job_cancel(request, job_id: int):
    try:
        services.job_cancel_for(user=request.user, job_id=job_id)
    except project_errors.NotFoundError:
        raise Http404("no such job") from None
    except project_errors.RoleError as exc:
        raise PermissionDenied(str(exc)) from exc
    except errors.JobError as exc:
        messages.error(request, str(exc))
    return redirect("jobs:detail", job_id=job_id)


@login_required
@require_POST
def job_pool(request, job_id: int):
    """An operator changes a running PPO job's slot pool; the driver makes it between steps."""
    try:
        job = selectors.job_get_for(request.user, job_id=job_id)
        require_role(request.user, job.project, Role.OPERATOR)
    except project_errors.NotFoundError:
        raise Http404("no such job") from None
    except project_errors.RoleError as exc:
        raise PermissionDenied(str(exc)) from exc
    form = PoolForm(request.POST)
    if not form.is_valid():
        for field, problems in form.errors.items():
            for problem in problems:
                messages.error(request, f"{field}: {problem}")
        return redirect("jobs:detail", job_id=job_id)
    notice_s = form.cleaned_data["notice_s"] or 0.0
    try:
        services.job_resize_for(
            user=request.user,
            job_id=job_id,
            slots=form.cleaned_data["slots"],
            notice_s=notice_s,
        )
    except project_errors.NotFoundError:
        raise Http404("no such job") from None
    except project_errors.RoleError as exc:
        raise PermissionDenied(str(exc)) from exc
    except ValidationError as exc:
        for field, problems in exc.message_dict.items():
            for problem in problems:
                messages.error(request, f"{field}: {problem}")
    except errors.JobError as exc:
        messages.error(request, str(exc))
    else:
        how = f" with {notice_s:g} s notice" if notice_s else ""
        messages.success(
            request,
            f"pool of {form.cleaned_data['slots']} slots asked{how}; the job makes the change "
            "between steps",
        )
    return redirect("jobs:detail", job_id=job_id)


@login_required
@require_POST
def job_bulk_cancel(request):
    """Cancel the ticked jobs: each one the caller may cancel is cancelled, each other one is
    reported; a job the caller cannot see is reported as not found."""
    raw = request.POST.getlist("job")
    ids = []
    for value in raw:
        if not (value.isascii() and value.isdigit()) or len(value) > 18:
            messages.error(request, f"job: expected job ids, got {value!r}")
            return redirect("jobs:list")
        ids.append(int(value))
    if not ids:
        messages.error(request, "job: tick at least one job to cancel")
        return redirect("jobs:list")
    if len(ids) > BULK_CANCEL_MAX:
        messages.error(request, f"job: at most {BULK_CANCEL_MAX} jobs at a time")
        return redirect("jobs:list")
    done, refused = [], []
    for job_id in dict.fromkeys(ids):
        try:
            services.job_cancel_for(user=request.user, job_id=job_id)
        except project_errors.NotFoundError:
            refused.append(f"job {job_id}: not found")
        except project_errors.RoleError as exc:
            refused.append(f"job {job_id}: {exc}")
        except errors.JobError as exc:
            refused.append(f"job {job_id}: {exc}")
        else:
            done.append(job_id)
    if done:
        messages.success(request, f"cancelling {len(done)} job(s): {', '.join(map(str, done))}")
    for problem in refused:
        messages.error(request, problem)
    return redirect("jobs:list")
