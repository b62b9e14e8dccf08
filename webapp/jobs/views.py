"""Pages: the job list with its submit form, and a job's live page."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import Http404
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from webapp.jobs import errors, selectors, services
from webapp.jobs.forms import JobSubmitForm
from webapp.projects import errors as project_errors
from webapp.projects.models import Role
from webapp.projects.selectors import role_of


@login_required
@require_http_methods(["GET", "POST"])
def job_list(request):
    form = JobSubmitForm(request.POST or None, user=request.user)
    if request.method == "POST" and form.is_valid():
        try:
            job = services.job_submit(
                user=request.user,
                name=form.cleaned_data["name"],
                spec=form.spec(),
                project=form.cleaned_data["project"],
            )
        except ValidationError as exc:
            for field, problems in exc.message_dict.items():
                form.add_error(field if field in form.fields else None, problems)
        except (project_errors.NotFoundError, project_errors.RoleError) as exc:
            form.add_error("project", str(exc))
        else:
            return redirect("jobs:detail", job_id=job.pk)
    jobs = selectors.job_list_for(request.user)[:100]
    return render(request, "jobs/list.html", {"jobs": jobs, "form": form})


@login_required
def job_detail(request, job_id: int):
    try:
        job = selectors.job_get_for(request.user, job_id=job_id)
    except project_errors.NotFoundError:
        raise Http404("no such job") from None
    role = role_of(request.user, job.project)
    can_cancel = role is not None and role.allows(Role.OPERATOR)
    return render(request, "jobs/detail.html", {"job": job, "can_cancel": can_cancel})


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
