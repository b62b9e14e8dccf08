"""Pages: the job list with its submit form, and a job's live page."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import Http404
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from webapp.jobs import errors, selectors, services
from webapp.jobs.forms import JobSubmitForm


@login_required
@require_http_methods(["GET", "POST"])
def job_list(request):
    form = JobSubmitForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            job = services.job_submit(
                user=request.user, name=form.cleaned_data["name"], spec=form.spec()
            )
        except ValidationError as exc:
            for field, problems in exc.message_dict.items():
                form.add_error(field if field in form.fields else None, problems)
        else:
            return redirect("jobs:detail", job_id=job.pk)
    jobs = selectors.jobs_visible_to(request.user)[:100]
    return render(request, "jobs/list.html", {"jobs": jobs, "form": form})


@login_required
def job_detail(request, job_id: int):
    job = selectors.jobs_visible_to(request.user).filter(pk=job_id).first()
    if job is None:
        raise Http404("no such job")
    return render(request, "jobs/detail.html", {"job": job})


@login_required
@require_POST
def job_cancel(request, job_id: int):
    if not selectors.jobs_visible_to(request.user).filter(pk=job_id).exists():
        raise Http404("no such job")
    try:
        services.job_cancel(job_id=job_id)
    except errors.JobError as exc:
        messages.error(request, str(exc))
    return redirect("jobs:detail", job_id=job_id)
