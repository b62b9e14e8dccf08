"""``/api/v1/jobs/``: submit, list, retrieve, cancel, resize a job's slot pool, read a job's events,
fetch its trained models.

One thin class per operation: validate the input, call a service or selector, render the output.
Visibility and roles are decided by the services and selectors; their errors become responses in
``webapp.api.exceptions``.
"""

from __future__ import annotations

import base64

from asgiref.sync import sync_to_async
from django.http import FileResponse
from django.urls import reverse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.response import Response
from rest_framework.views import APIView

from runtime.jobs.spec import spec_from_json
from webapp.api.authentication import request_token
from webapp.api.inputs import Number, StrictInput, Text, WholeNumber
from webapp.api.pagination import MAX_ID, IdCursorPagination
from webapp.api.parsers import JSONParser
from webapp.jobs import selectors, services
from webapp.jobs.models import Job, JobState
from webapp.projects import errors as project_errors
from webapp.projects.selectors import project_get_for

IDEMPOTENCY_HEADER = "Idempotency-Key"
BAD_IDEMPOTENCY_KEY = "expected 1 to 255 printable ASCII characters"
NO_SUCH_PROJECT = "no such project"
SPEC_NOT_OBJECT = "expected a JSON object"
EVENTS_PAGE = 100
EVENTS_PAGE_MAX = 1000


class JobOutput(serializers.ModelSerializer):
    project = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    owner = serializers.CharField(source="owner.get_username", read_only=True)

    class Meta:
        model = Job
        fields = [
            "id",
            "name",
            "project",
            "owner",
            "state",
            "failure_reason",
            "failure_detail",
            "spec",
            "epoch",
            "created_at",
            "updated_at",
            "started_at",
            "finished_at",
        ]
        read_only_fields = fields


class EventOutput(serializers.Serializer):
    id = serializers.IntegerField()
    job = serializers.IntegerField()
    epoch = serializers.IntegerField()
    kind = serializers.CharField()
    data = serializers.DictField()
    at = serializers.DateTimeField()


def _project_or_field_error(request, slug: str | None):
    if slug is None:
        return None
    try:
        return project_get_for(request.user, slug=slug, token=request_token(request))
    except project_errors.NotFoundError:
        # The same answer whether it does not exist or is someone else's.
        raise serializers.ValidationError({"project": [NO_SUCH_PROJECT]}) from None


def _job_or_404(request, job_id: int) -> Job:
    return selectors.job_get_for(request.user, job_id=job_id, token=request_token(request))


class JobListCreateApi(APIView):
    """List the jobs you can see, or submit one."""

    parser_classes = [JSONParser]

    class SubmitInput(StrictInput):
        project = serializers.SlugField(
            required=False,
            help_text="Project slug; default: the token's project, or your personal project.",
        )
        name = Text(max_length=200)
        spec = serializers.JSONField(
            help_text="The job spec (see runtime/jobs/spec.py); missing fields take defaults. "
            "A PPO job's (kind ppo) generation_backend: torch (the default) or vllm, which needs "
            "GPU slots (a GPU kind in gpu) and is refused on CPU slots with a 400 naming "
            "spec.generation_backend."
        )

        def validate_spec(self, value):
            if not isinstance(value, dict):
                raise serializers.ValidationError(SPEC_NOT_OBJECT)
            try:
                spec_from_json(value)
            except ValueError as exc:
                field, _, message = str(exc).partition(": ")
                raise serializers.ValidationError({field: [message or str(exc)]}) from None
            return value

    class ListFilter(serializers.Serializer):
        state = serializers.ChoiceField(choices=JobState.choices, required=False)
        project = serializers.SlugField(required=False)

    @extend_schema(
        operation_id="jobs_list",
        parameters=[
            ListFilter,
            OpenApiParameter("cursor", OpenApiTypes.STR, description="From the previous page."),
            OpenApiParameter("limit", OpenApiTypes.INT, description="Page size, at most 200."),
        ],
        responses={200: JobOutput(many=True)},
    )
    def get(self, request):
        filters = self.ListFilter(data=request.query_params)
        filters.is_valid(raise_exception=True)
        project = _project_or_field_error(request, filters.validated_data.get("project"))
        jobs = selectors.job_list_for(
            request.user,
            token=request_token(request),
            state=filters.validated_data.get("state"),
            project=project,
        )
        paginator = IdCursorPagination()
        page = paginator.paginate_queryset(jobs, request, view=self)
        return paginator.get_paginated_response(JobOutput(page, many=True).data)

    @extend_schema(
        operation_id="jobs_submit",
        request=SubmitInput,
        parameters=[
            OpenApiParameter(
                IDEMPOTENCY_HEADER,
                OpenApiTypes.STR,
                OpenApiParameter.HEADER,
                description="Retry-safe submission: the same key and body return the same job "
                "(200); the same key with another body is a 409.",
            )
        ],
        responses={201: JobOutput, 200: JobOutput},
    )
    def post(self, request):
        key = request.headers.get(IDEMPOTENCY_HEADER)
        if key is not None and not (0 < len(key) <= 255 and key.isascii() and key.isprintable()):
            raise serializers.ValidationError({IDEMPOTENCY_HEADER: [BAD_IDEMPOTENCY_KEY]})
        data = self.SubmitInput(data=request.data)
        data.is_valid(raise_exception=True)
        fields = data.validated_data
        submit = {
            "user": request.user,
            "token": request_token(request),
            "name": fields["name"],
            "spec": fields["spec"],
            "project": _project_or_field_error(request, fields.get("project")),
        }
        if key is None:
            job, replayed = services.job_submit(**submit), False
        else:
            job, replayed = services.job_submit_idempotent(
                **submit, idempotency_key=key, body=request.data
            )
        response = Response(
            JobOutput(job).data, status=status.HTTP_200_OK if replayed else status.HTTP_201_CREATED
        )
        response["Location"] = reverse("api:job-detail", kwargs={"job_id": job.pk})
        if replayed:
            response["Idempotent-Replayed"] = "true"
        return response


class JobDetailApi(APIView):
    """One job."""

    @extend_schema(operation_id="jobs_retrieve", responses={200: JobOutput})
    def get(self, request, job_id: int):
        return Response(JobOutput(_job_or_404(request, job_id)).data)


class JobCancelApi(APIView):
    """Ask a job to stop (operator role or above): pending jobs end at once, running ones at their
    next step boundary. A finished job answers 409."""

    @extend_schema(operation_id="jobs_cancel", request=None, responses={200: JobOutput})
    def post(self, request, job_id: int):
        job = services.job_cancel_for(
            user=request.user, job_id=job_id, token=request_token(request)
        )
        return Response(JobOutput(job).data)


class PoolInput(StrictInput):
    """A job's slot pool from now on, and the notice for the slots to go."""

    slots = WholeNumber(
        min_value=1,
        help_text="The job's pool from now on: 1 to its spec's max_slots, and enough for its "
        "models in some layout.",
    )
    notice_s = Number(
        required=False,
        default=0.0,
        min_value=0.0,
        max_value=services.RESIZE_NOTICE_MAX_S,
        help_text="For a shrink: seconds the slots to go stay the job's while it moves off them "
        "(0: taken at once, with what they hold). At most a day.",
    )


class PoolOutput(serializers.Serializer):
    job = serializers.IntegerField()
    slots = serializers.IntegerField()
    notice_s = serializers.FloatField()
    event = serializers.IntegerField(help_text="The command's id in the job's events.")


class JobPoolApi(APIView):
    """Change a running (or pending) real PPO job's slot pool (operator role or above). Its
    driver makes the change between steps: more slots are the controller's to use when a move
    pays; fewer are taken at once, or, with ``notice_s``, released once the job has moved off
    them while they still hold their state (taken whatever at the deadline). The outcome is a
    ``command.applied`` event; a driver that takes the job over later starts on the new pool.
    A simulated job (its pool follows its trace) or a supervised one answers 400 on ``slots``;
    a job that has finished or is being cancelled, 409."""

    parser_classes = [JSONParser]

    @extend_schema(operation_id="jobs_pool", request=PoolInput, responses={202: PoolOutput})
    def post(self, request, job_id: int):
        data = PoolInput(data=request.data)
        data.is_valid(raise_exception=True)
        event = services.job_resize_for(
            user=request.user,
            job_id=job_id,
            slots=data.validated_data["slots"],
            notice_s=data.validated_data["notice_s"],
            token=request_token(request),
        )
        body = {"job": job_id, **{k: event.data[k] for k in ("slots", "notice_s")}}
        return Response(PoolOutput({**body, "event": event.pk}).data, status.HTTP_202_ACCEPTED)


class JobEventsApi(APIView):
    """A job's events with ids above ``after``, oldest first; ``next`` reads the following page."""

    class Query(serializers.Serializer):
        after = serializers.IntegerField(min_value=0, max_value=MAX_ID, default=0)
        limit = serializers.IntegerField(
            min_value=1, max_value=EVENTS_PAGE_MAX, default=EVENTS_PAGE
        )

    @extend_schema(
        operation_id="jobs_events",
        parameters=[Query],
        responses={
            200: inline_serializer(
                "JobEventPage",
                {
                    "next": serializers.CharField(allow_null=True),
                    "results": EventOutput(many=True),
                },
            )
        },
    )
    def get(self, request, job_id: int):
        query = self.Query(data=request.query_params)
        query.is_valid(raise_exception=True)
        job = _job_or_404(request, job_id)
        after, limit = query.validated_data["after"], query.validated_data["limit"]
        events = selectors.job_events_since(job=job, after_id=after, limit=limit + 1)
        more = len(events) > limit
        events = events[:limit]
        next_url = None
        if more:
            params = request.query_params.copy()
            params["after"] = str(events[-1].pk)
            params["limit"] = str(limit)
            next_url = request.build_absolute_uri(f"{request.path}?{params.urlencode()}")
        return Response({"next": next_url, "results": [e.as_message() for e in events]})


class ArtifactFileOutput(serializers.Serializer):
    name = serializers.CharField()
    bytes = serializers.IntegerField()
    sha256 = serializers.CharField()
    url = serializers.URLField()


class ArtifactOutput(serializers.Serializer):
    name = serializers.CharField(help_text="``actor``: the trained policy.")
    format = serializers.CharField(help_text="``huggingface``: transformers and vLLM load it.")
    architecture = serializers.CharField()
    dtype = serializers.CharField()
    source = serializers.DictField(help_text="Where the weights came from: role, step.")
    files = ArtifactFileOutput(many=True)


class JobArtifactsApi(APIView):
    """The job's trained models: each a Hugging Face folder written when the job ended (or
    exported from a checkpoint), with every file's size and SHA-256 and the URL to fetch it."""

    @extend_schema(
        operation_id="jobs_artifacts",
        responses={200: inline_serializer("JobArtifacts", {"results": ArtifactOutput(many=True)})},
    )
    def get(self, request, job_id: int):
        job = _job_or_404(request, job_id)
        results = []
        for name, manifest in selectors.job_artifacts(job=job).items():
            files = [
                {
                    **{k: f[k] for k in ("name", "bytes", "sha256")},
                    "url": request.build_absolute_uri(
                        reverse(
                            "api:job-artifact-file",
                            kwargs={"job_id": job.pk, "artifact": name, "name": f["name"]},
                        )
                    ),
                }
                for f in manifest["files"]
            ]
            results.append(
                {
                    "name": name,
                    "format": manifest.get("format", ""),
                    "architecture": manifest.get("architecture", ""),
                    "dtype": manifest.get("dtype", ""),
                    "source": manifest.get("source", {}),
                    "files": files,
                }
            )
        return Response({"results": results})


class ChunkedFileResponse(FileResponse):
    """A file sent a block at a time under ASGI too: Django's ``FileResponse`` there reads a
    synchronous file whole before its first byte (a model of gigabytes, in the web process)."""

    block_size = 1 << 20

    async def __aiter__(self):
        read = sync_to_async(self.file_to_stream.read, thread_sensitive=False)
        while block := await read(self.block_size):
            yield block


class _AnyAccept(BaseContentNegotiation):
    """The file goes out as bytes whatever the client accepts; an error, as JSON."""

    def select_parser(self, request, parsers):
        return parsers[0] if parsers else None

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


class JobArtifactFileApi(APIView):
    """One file of an artifact, as its manifest lists it (its SHA-256 in ``ETag`` and
    ``Repr-Digest``); any other name is not found."""

    content_negotiation_class = _AnyAccept

    @extend_schema(
        operation_id="jobs_artifact_file",
        responses={(200, "application/octet-stream"): OpenApiTypes.BINARY},
    )
    def get(self, request, job_id: int, artifact: str, name: str):
        job = _job_or_404(request, job_id)
        try:
            handle, entry = selectors.job_artifact_file(job=job, artifact=artifact, name=name)
        except selectors.ArtifactError as exc:
            raise NotFound(str(exc)) from None
        response = ChunkedFileResponse(
            handle,
            as_attachment=True,
            filename=entry["name"],
            content_type="application/octet-stream",
        )
        response["ETag"] = f'"{entry["sha256"]}"'
        digest = base64.b64encode(bytes.fromhex(entry["sha256"])).decode()
        response["Repr-Digest"] = f"sha-256=:{digest}:"
        return response
