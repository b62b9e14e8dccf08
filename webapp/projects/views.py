"""Pages: the projects one belongs to, and one project's members and API tokens.

Tokens are what CI pipelines use (``nereus submit`` with ``NEREUS_TOKEN``); a project's admins
issue them here and anyone revokes their own. A new token's secret is shown in the answer to the
form that made it, once: it is never stored (only its hash), nor put in a message that the
session would keep.
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from webapp.projects import errors, selectors, services
from webapp.projects.forms import TokenForm
from webapp.projects.models import Membership, Role


@login_required
def project_list(request):
    memberships = (
        Membership.objects.filter(user=request.user).select_related("project").order_by("project")
    )
    return render(request, "projects/list.html", {"memberships": list(memberships)})


def _project_or_404(user, slug: str):
    try:
        return selectors.project_get_for(user, slug=slug)
    except errors.NotFoundError:
        raise Http404("no such project") from None


def _page(request, project, *, form=None, created=None, status=200):
    role = selectors.role_of(request.user, project)
    is_admin = role is not None and role.allows(Role.ADMIN)
    tokens = selectors.tokens_of(project).order_by("-created_at")
    if not is_admin:  # a member sees the tokens they made; admins see every one
        tokens = tokens.filter(user=request.user)
    context = {
        "project": project,
        "role": role,
        "is_admin": is_admin,
        "members": project.memberships.select_related("user").order_by("user__username"),
        "tokens": list(tokens),
        "form": form if form is not None else (TokenForm() if is_admin else None),
        "created": created,
    }
    response = render(request, "projects/detail.html", context, status=status)
    if created is not None:
        response["Cache-Control"] = "no-store"  # the secret is in this page only
    return response


@login_required
def project_detail(request, slug: str):
    return _page(request, _project_or_404(request.user, slug))


@login_required
@require_POST
def token_create_view(request, slug: str):
    project = _project_or_404(request.user, slug)
    # The role first: what the form says next (a name in use) must not tell a member who may not
    # see the project's tokens which names its admins gave theirs.
    try:
        selectors.require_role(request.user, project, Role.ADMIN)
    except errors.RoleError as exc:
        raise PermissionDenied(str(exc)) from exc
    form = TokenForm(request.POST)
    if not form.is_valid():
        return _page(request, project, form=form, status=400)
    name = form.cleaned_data["name"]
    # The page that shows a new secret answers this POST (the secret is kept nowhere for a
    # redirect to show), so a reload sends the form again: the service's one active token per
    # name keeps that from making a second token.
    try:
        token, secret = services.token_create(
            user=request.user,
            project=project,
            name=name,
            role=form.cleaned_data["role"],
            expires_in_days=form.cleaned_data["expires_in_days"],
        )
    except errors.TokenNameTakenError as exc:
        form.add_error("name", str(exc))
        return _page(request, project, form=form, status=409)
    except errors.RoleError as exc:
        raise PermissionDenied(str(exc)) from exc
    return _page(request, project, created={"token": token, "secret": secret})


@login_required
@require_POST
def token_revoke_view(request, slug: str, token_id: int):
    project = _project_or_404(request.user, slug)
    try:
        token = services.token_revoke(user=request.user, project=project, token_id=token_id)
    except errors.NotFoundError:
        raise Http404("no such token") from None
    except errors.RoleError as exc:
        raise PermissionDenied(str(exc)) from exc
    messages.success(request, f"Token {token.name} ({token.prefix}…) revoked.")
    return redirect("projects:detail", slug=project.slug)
