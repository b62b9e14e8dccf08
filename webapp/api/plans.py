"""``/api/v1/jobs/<id>/plans/``, ``/api/v1/jobs/<id>/transitions/`` and
``/api/v1/transitions/<id>/``: what the controller ran a job on and how it moved between plans.

Lists are newest first and cursor-paginated like the jobs list; a transition's DAG is in its detail
only (it can be large). Another project's job or transition is not found.
"""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from webapp.api.authentication import request_token
from webapp.api.pagination import IdCursorPagination
from webapp.jobs.selectors import job_get_for
from webapp.plans import selectors
from webapp.plans.models import Plan, Transition

PAGE_PARAMETERS = [
    OpenApiParameter("cursor", OpenApiTypes.STR, description="From the previous page."),
    OpenApiParameter("limit", OpenApiTypes.INT, description="Page size, at most 200."),
]


class PlanOutput(serializers.ModelSerializer):
    plan = serializers.JSONField(help_text="The runtime's Plan.to_json().")

    class Meta:
        model = Plan
        fields = [
            "id",
            "job",
            "epoch",
            "plan",
            "predicted_step_s",
            "current",
            "reason",
            "created_at",
        ]
        read_only_fields = fields


class TransitionOutput(serializers.ModelSerializer):
    class Meta:
        model = Transition
        fields = [
            "id",
            "job",
            "epoch",
            "from_plan",
            "to_plan",
            "state",
            "predicted_s",
            "actual_s",
            "num_nodes",
            "failure",
            "simulated",
            "created_at",
        ]
        read_only_fields = fields


class TransitionDetailOutput(TransitionOutput):
    dag = serializers.JSONField(help_text="The runtime's TransitionDag.to_json().")

    class Meta(TransitionOutput.Meta):
        fields = [*TransitionOutput.Meta.fields, "dag"]
        read_only_fields = fields


def _page(request, view, rows, output):
    paginator = IdCursorPagination()
    page = paginator.paginate_queryset(rows, request, view=view)
    return paginator.get_paginated_response(output(page, many=True).data)


class JobPlansApi(APIView):
    """A job's plans, newest first; ``current`` marks the one it runs on."""

    @extend_schema(
        operation_id="jobs_plans",
        parameters=PAGE_PARAMETERS,
        responses={200: PlanOutput(many=True)},
    )
    def get(self, request, job_id: int):
        job = job_get_for(request.user, job_id=job_id, token=request_token(request))
        return _page(request, self, selectors.plans_of(job), PlanOutput)


class JobTransitionsApi(APIView):
    """A job's transitions, newest first, without their DAGs."""

    @extend_schema(
        operation_id="jobs_transitions",
        parameters=PAGE_PARAMETERS,
        responses={200: TransitionOutput(many=True)},
    )
    def get(self, request, job_id: int):
        job = job_get_for(request.user, job_id=job_id, token=request_token(request))
        return _page(request, self, selectors.transitions_of(job), TransitionOutput)


class TransitionDetailApi(APIView):
    """One transition with its DAG."""

    @extend_schema(operation_id="transitions_retrieve", responses={200: TransitionDetailOutput})
    def get(self, request, transition_id: int):
        transition = selectors.transition_get_for(
            request.user, transition_id=transition_id, token=request_token(request)
        )
        return Response(TransitionDetailOutput(transition).data)
