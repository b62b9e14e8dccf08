"""``/api/v1/projects/``: the projects you belong to, and their API tokens.

Tokens are managed from a signed-in session only: a token cannot mint or revoke tokens, so a leaked
one cannot make itself permanent.
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.exceptions import PermissionDenied
from rest_framework.response import Response
from rest_framework.views import APIView

from webapp.api.authentication import request_token
from webapp.api.inputs import StrictInput, Text, WholeNumber
from webapp.api.parsers import JSONParser
from webapp.projects import selectors, services
from webapp.projects.models import ApiToken, Role

SESSION_ONLY = "API tokens are managed from a signed-in session, not with a token"


class ProjectOutput(serializers.Serializer):
    slug = serializers.SlugField()
    name = serializers.CharField()
    role = serializers.ChoiceField(choices=Role.choices)


class TokenOutput(serializers.ModelSerializer):
    user = serializers.CharField(source="user.get_username", read_only=True)

    class Meta:
        model = ApiToken
        fields = [
            "id",
            "name",
            "role",
            "prefix",
            "user",
            "created_at",
            "last_used_at",
            "revoked_at",
            "expires_at",
        ]
        read_only_fields = fields


class TokenCreatedOutput(TokenOutput):
    secret = serializers.CharField(help_text="Shown this once; only a hash is kept.")

    class Meta(TokenOutput.Meta):
        fields = [*TokenOutput.Meta.fields, "secret"]
        read_only_fields = fields


def _session_only(request) -> None:
    if request_token(request) is not None:
        raise PermissionDenied(SESSION_ONLY)


class ProjectListApi(APIView):
    """The projects you can see, with your role in each."""

    @extend_schema(operation_id="projects_list", responses={200: ProjectOutput(many=True)})
    def get(self, request):
        token = request_token(request)
        projects = selectors.projects_visible_to(request.user, token=token)
        rows = [
            {
                "slug": p.slug,
                "name": p.name,
                "role": selectors.role_of(request.user, p, token=token),
            }
            for p in projects
        ]
        return Response(ProjectOutput(rows, many=True).data)


class TokenListCreateApi(APIView):
    """A project's tokens (admins), or a new one: its secret is in this response only."""

    parser_classes = [JSONParser]

    class CreateInput(StrictInput):
        name = Text(max_length=200)
        role = serializers.ChoiceField(choices=Role.choices, default=Role.OPERATOR)
        expires_in_days = WholeNumber(
            min_value=1,
            max_value=services.MAX_TOKEN_DAYS,
            required=False,
            allow_null=True,
            help_text="Days until the token stops working; absent or null: until revoked.",
        )

    @extend_schema(operation_id="tokens_list", responses={200: TokenOutput(many=True)})
    def get(self, request, slug: str):
        _session_only(request)
        project = selectors.project_get_for(request.user, slug=slug)
        selectors.require_role(request.user, project, Role.ADMIN)
        return Response(TokenOutput(selectors.tokens_of(project), many=True).data)

    @extend_schema(
        operation_id="tokens_create", request=CreateInput, responses={201: TokenCreatedOutput}
    )
    def post(self, request, slug: str):
        _session_only(request)
        project = selectors.project_get_for(request.user, slug=slug)
        data = self.CreateInput(data=request.data)
        data.is_valid(raise_exception=True)
        token, secret = services.token_create(
            user=request.user, project=project, **data.validated_data
        )
        token.secret = secret
        # The one answer that carries the secret: no cache (a browser's, or the browsable
        # API's page) may keep it.
        return Response(
            TokenCreatedOutput(token).data,
            status=status.HTTP_201_CREATED,
            headers={"Cache-Control": "no-store"},
        )


class TokenRevokeApi(APIView):
    """Revoke a token (project admins, or its creator). Revoking twice is harmless."""

    @extend_schema(operation_id="tokens_revoke", request=None, responses={200: TokenOutput})
    def post(self, request, slug: str, token_id: int):
        _session_only(request)
        project = selectors.project_get_for(request.user, slug=slug)
        token = services.token_revoke(user=request.user, project=project, token_id=token_id)
        return Response(TokenOutput(token).data)
