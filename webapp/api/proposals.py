"""``/api/v1/proposals/``: the approvals inbox, one proposal, and approving or rejecting it; and
``/api/v1/jobs/<id>/override/``: a person proposing a plan of their own for a job.

Anyone who can see the job reads its proposals; approving or rejecting needs the approver role in
its project and a comment; proposing an override, the operator role and a reason. The rules live
in ``webapp.plans.services`` (``proposal_decide``, ``proposal_override``).
"""

from __future__ import annotations

from django.urls import reverse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from webapp.api.authentication import request_token
from webapp.api.inputs import StrictInput, Text
from webapp.api.jobs import _job_or_404, _project_or_field_error
from webapp.api.pagination import IdCursorPagination
from webapp.api.parsers import JSONParser
from webapp.plans import selectors, services
from webapp.plans.models import Proposal, ProposalState


class ProposalOutput(serializers.ModelSerializer):
    project = serializers.SlugRelatedField(source="job.project", slug_field="slug", read_only=True)
    plan = serializers.JSONField(help_text="The proposed plan, as the runtime's Plan.to_json().")
    verdict = serializers.JSONField(
        allow_null=True, help_text="The controller's admission verdict; null for an override."
    )
    proposed_by = serializers.CharField(
        source="proposed_by.get_username",
        allow_null=True,
        default=None,
        help_text="Null when the controller proposed it.",
    )
    decided_by = serializers.CharField(
        source="decided_by.get_username", allow_null=True, default=None
    )

    class Meta:
        model = Proposal
        fields = [
            "id",
            "job",
            "project",
            "epoch",
            "controller_id",
            "plan",
            "verdict",
            "reason",
            "route",
            "proposed_by",
            "state",
            "decided_by",
            "decided_at",
            "comment",
            "created_at",
            "expires_at",
        ]
        read_only_fields = fields


class ProposalListApi(APIView):
    """Proposals of the jobs you can see, newest first: ``?state=waiting`` is the inbox."""

    class ListFilter(serializers.Serializer):
        state = serializers.ChoiceField(choices=ProposalState.choices, required=False)
        project = serializers.SlugField(required=False)
        job = serializers.IntegerField(min_value=1, max_value=2**63 - 1, required=False)

    @extend_schema(
        operation_id="proposals_list",
        parameters=[
            ListFilter,
            OpenApiParameter("cursor", OpenApiTypes.STR, description="From the previous page."),
            OpenApiParameter("limit", OpenApiTypes.INT, description="Page size, at most 200."),
        ],
        responses={200: ProposalOutput(many=True)},
    )
    def get(self, request):
        filters = self.ListFilter(data=request.query_params)
        filters.is_valid(raise_exception=True)
        token = request_token(request)
        proposals = selectors.proposal_list_for(
            request.user,
            token=token,
            state=filters.validated_data.get("state"),
            project=_project_or_field_error(request, filters.validated_data.get("project")),
            job_id=filters.validated_data.get("job"),
        )
        paginator = IdCursorPagination()
        page = paginator.paginate_queryset(proposals, request, view=self)
        return paginator.get_paginated_response(ProposalOutput(page, many=True).data)


class ProposalDetailApi(APIView):
    """One proposal."""

    @extend_schema(operation_id="proposals_retrieve", responses={200: ProposalOutput})
    def get(self, request, proposal_id: int):
        proposal = selectors.proposal_get_for(
            request.user, proposal_id=proposal_id, token=request_token(request)
        )
        return Response(ProposalOutput(proposal).data)


class DecisionInput(StrictInput):
    comment = Text(
        max_length=services.COMMENT_MAX_CHARS, multiline=True, help_text="Why; required, not blank."
    )


class _DecisionApi(APIView):
    decision = ""
    parser_classes = [JSONParser]

    def post(self, request, proposal_id: int):
        token = request_token(request)
        proposal = selectors.proposal_get_for(request.user, proposal_id=proposal_id, token=token)
        data = DecisionInput(data=request.data)
        data.is_valid(raise_exception=True)
        decided = services.proposal_decide(
            user=request.user,
            proposal=proposal,
            decision=self.decision,
            comment=data.validated_data["comment"],
            token=token,
        )
        return Response(
            ProposalOutput(
                selectors.proposal_get_for(request.user, proposal_id=decided.pk, token=token)
            ).data
        )


class ProposalApproveApi(_DecisionApi):
    """Approve a waiting proposal (approvers and admins of its project), with a comment. A proposal
    that is not waiting answers 409; approving your own override, 409 ``self_approval``."""

    decision = "approve"

    @extend_schema(
        operation_id="proposals_approve", request=DecisionInput, responses={200: ProposalOutput}
    )
    def post(self, request, proposal_id: int):
        return super().post(request, proposal_id)


class ProposalRejectApi(_DecisionApi):
    """Reject a waiting proposal (approvers and admins of its project), with a comment; the job
    keeps its plan. A proposal that is not waiting answers 409."""

    decision = "reject"

    @extend_schema(
        operation_id="proposals_reject", request=DecisionInput, responses={200: ProposalOutput}
    )
    def post(self, request, proposal_id: int):
        return super().post(request, proposal_id)


class OverrideInput(StrictInput):
    plan = serializers.JSONField(
        help_text="The plan to move the job to, as the runtime's Plan.to_json() (a plan of "
        "GET /api/v1/jobs/<id>/plans/, changed)."
    )
    reason = Text(max_length=4000, multiline=True, help_text="Why; required, not blank.")


class JobOverrideApi(APIView):
    """Propose a plan of your own for a job (operator role or above), with a reason: a waiting
    proposal that another approver approves or rejects like the controller's. Approved, the
    job's driver moves to it between steps, or refuses it saying why (``control.override_refused``
    in the job's events: it does not fit, uses more slots than are alive, has other
    model-stages). A job that has finished or is being cancelled answers 409."""

    parser_classes = [JSONParser]

    @extend_schema(
        operation_id="jobs_override", request=OverrideInput, responses={201: ProposalOutput}
    )
    def post(self, request, job_id: int):
        token = request_token(request)
        job = _job_or_404(request, job_id)
        data = OverrideInput(data=request.data)
        data.is_valid(raise_exception=True)
        proposal = services.proposal_override(
            user=request.user,
            job=job,
            plan=data.validated_data["plan"],
            reason=data.validated_data["reason"],
            token=token,
        )
        response = Response(
            ProposalOutput(
                selectors.proposal_get_for(request.user, proposal_id=proposal.pk, token=token)
            ).data,
            status=status.HTTP_201_CREATED,
        )
        response["Location"] = reverse("api:proposal-detail", kwargs={"proposal_id": proposal.pk})
        return response
