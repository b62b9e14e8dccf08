"""One error shape for the whole API: ``{"code", "message", "fields"}``.

``fields`` maps a field's dotted path (``spec.num_slots``, ``after``, ``Idempotency-Key``) to its
problems; it is empty for errors that are not about one field. Domain errors of the services map to
statuses here, so views never translate them one by one.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import Http404, JsonResponse
from django.views import defaults
from rest_framework import exceptions, status
from rest_framework.views import exception_handler as drf_exception_handler

from webapp.jobs import errors as job_errors
from webapp.plans import errors as plan_errors
from webapp.projects import errors as project_errors

INVALID_INPUT = "invalid input; see fields"


class Conflict(exceptions.APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "the request conflicts with the current state"
    default_code = "conflict"


def _translate(exc: Exception) -> Exception:
    # DRF's handler converts these two itself, but only for its response: the exception stays
    # Django's, with no ``detail`` for the body below (DRF's content negotiation raises Http404).
    if isinstance(exc, Http404):
        return exceptions.NotFound(*exc.args)
    if isinstance(exc, DjangoPermissionDenied):
        return exceptions.PermissionDenied(*exc.args)
    if isinstance(exc, DjangoValidationError):
        detail = (
            exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
        )
        return exceptions.ValidationError(detail)
    if isinstance(exc, project_errors.NotFoundError):
        return exceptions.NotFound(str(exc))
    if isinstance(exc, project_errors.RoleError):
        return exceptions.PermissionDenied(str(exc))
    if isinstance(exc, project_errors.TokenNameTakenError):
        conflict = Conflict(str(exc), code="name_taken")
        conflict.field = "name"
        return conflict
    if isinstance(exc, plan_errors.SelfApprovalError):
        return Conflict(str(exc), code="self_approval")
    if isinstance(exc, plan_errors.ProposalError):
        return Conflict(str(exc), code="not_waiting")
    if isinstance(exc, job_errors.IdempotencyError):
        return Conflict(str(exc), code="idempotency_key_reused")
    if isinstance(exc, job_errors.JobError):
        return Conflict(str(exc))
    return exc


def flatten(detail: Any, prefix: str = "") -> dict[str, list[str]]:
    """DRF's nested error detail as ``{"a.b": [messages]}``."""
    if isinstance(detail, dict):
        flat: dict[str, list[str]] = {}
        for key, value in detail.items():
            flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    if isinstance(detail, list) and any(isinstance(item, dict | list) for item in detail):
        flat = {}
        for index, item in enumerate(detail):
            flat.update(flatten(item, f"{prefix}.{index}" if prefix else str(index)))
        return flat
    items = detail if isinstance(detail, list) else [detail]
    return {prefix or "non_field_errors": [str(item) for item in items]}


def exception_handler(exc: Exception, context: dict):
    """DRF's handler, then the response body rewritten to the one shape."""
    exc = _translate(exc)
    response = drf_exception_handler(exc, context)
    if response is None:
        return None  # not an API error: a real bug, left to surface as a 500
    if isinstance(exc, exceptions.ValidationError):
        body = {"code": "invalid", "message": INVALID_INPUT, "fields": flatten(exc.detail)}
    else:
        detail = exc.detail if isinstance(exc, exceptions.APIException) else response.data
        if isinstance(detail, dict) and "detail" in detail:  # DRF's own body: {"detail": ...}
            detail = detail["detail"]
        if isinstance(detail, dict | list):  # not a validation's, but read the same way
            fields = flatten(detail)
            messages = [
                m if k == "non_field_errors" else f"{k}: {m}"
                for k, ms in fields.items()
                for m in ms
            ]
            code = getattr(exc, "default_code", "error")
            response.data = {"code": str(code), "message": "; ".join(messages), "fields": fields}
            return response
        code = getattr(detail, "code", None) or getattr(exc, "default_code", "error")
        field = getattr(exc, "field", None)  # an error about one field that is not a validation's
        fields = {field: [str(detail).removeprefix(f"{field}: ")]} if field else {}
        body = {"code": str(code), "message": str(detail), "fields": fields}
    response.data = body
    return response


def not_found(request, exception=None):
    """Django's 404 for a path no route matches: the API's one error shape under ``/api/``, the
    usual page elsewhere."""
    if request.path.startswith("/api/"):
        return JsonResponse(
            {
                "code": "not_found",
                "message": f"no such resource: {request.method} {request.path}",
                "fields": {},
            },
            status=status.HTTP_404_NOT_FOUND,
        )
    return defaults.page_not_found(request, exception)


def server_error(request):
    """Django's 500 (a bug): the API's error shape under ``/api/``, the usual page elsewhere."""
    if request.path.startswith("/api/"):
        return JsonResponse(
            {"code": "server_error", "message": "internal error; it is logged", "fields": {}},
            status=status.HTTP_500_INTERNAL_SERVER_ERROR,
        )
    return defaults.server_error(request)
