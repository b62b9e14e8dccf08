"""A PPO job's ``generation_backend`` through the web service: the API's spec and the submit form
take ``torch`` (the default, recorded on the job) and ``vllm`` on GPU slots; ``vllm`` on CPU
slots and unknown values are refused naming the field (the API's 400 on
``spec.generation_backend``, the form's error on its Generation field)."""

from __future__ import annotations

import pytest

from runtime.jobs.spec import VLLM_NEEDS_GPUS
from webapp.jobs.models import Job
from webapp.projects.models import Role

pytestmark = pytest.mark.django_db

JOBS = "/api/v1/jobs/"
VLLM_ON_CPU = VLLM_NEEDS_GPUS.removeprefix("generation_backend: ")
SPEC = {"kind": "ppo", "model": "tiny-sft", "num_slots": 2, "max_slots": 2, "num_steps": 4}
FORM = {
    "name": "ppo",
    "kind": "ppo",
    "num_steps": 20,
    "seed": 0,
    "ppo_model": "tiny-sft",
    "tasks": "copy",
    "reward": "length",
    "num_slots": 2,
    "max_slots": 2,
    "batch_size": 16,
    "max_new_tokens": 16,
    "warmup_steps": 10,
    "checkpoint_every": 4,
    "revoke_at_step": -1,
    "grant_at_step": -1,
    "approval": "auto",
}


@pytest.fixture
def operator(project, member):
    return member(project, Role.OPERATOR, "olga")


def _submit(api, operator, spec):
    return api(user=operator).post(
        JOBS, {"project": "ml", "name": "ppo", "spec": spec}, format="json"
    )


# --- the API ----------------------------------------------------------------------------------


def test_the_api_records_torch_for_a_job_that_names_no_backend(api, operator, enqueued):
    response = _submit(api, operator, SPEC)
    assert response.status_code == 201, response.content
    assert response.json()["spec"]["generation_backend"] == "torch"
    assert Job.objects.get().spec["generation_backend"] == "torch"


def test_the_api_takes_vllm_on_gpu_slots(api, operator, enqueued):
    response = _submit(api, operator, {**SPEC, "gpu": "h100-sxm", "generation_backend": "vllm"})
    assert response.status_code == 201, response.content
    job = Job.objects.get()
    assert (job.spec["gpu"], job.spec["generation_backend"]) == ("h100-sxm", "vllm")


def test_the_api_refuses_vllm_on_cpu_slots_with_a_400_naming_the_field(api, operator, enqueued):
    response = _submit(api, operator, {**SPEC, "generation_backend": "vllm"})
    assert response.status_code == 400, response.content
    body = response.json()
    assert body["code"] == "invalid"
    assert body["fields"] == {"spec.generation_backend": [VLLM_ON_CPU]}
    assert VLLM_ON_CPU == (
        "vllm needs GPU slots; this job runs on CPU slots (gpu=cpu-slot): name a GPU kind in gpu, "
        "or use torch"
    )
    assert not Job.objects.exists() and not enqueued


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("tensorrt", "expected one of torch, vllm, got 'tensorrt'"),
        (3, "expected str, got 3"),
        (None, "expected str, got None"),
    ],
)
def test_the_api_refuses_an_unknown_backend_naming_the_field(api, operator, value, message):
    for gpu in ("cpu-slot", "h100-sxm"):
        response = _submit(api, operator, {**SPEC, "gpu": gpu, "generation_backend": value})
        assert response.status_code == 400, response.content
        assert response.json()["fields"] == {"spec.generation_backend": [message]}
    assert not Job.objects.exists()


def test_the_openapi_schema_documents_the_field(client):
    schema = client.get("/api/schema/", {"format": "json"}).json()
    body = schema["paths"]["/api/v1/jobs/"]["post"]["requestBody"]["content"]["application/json"]
    ref = body["schema"]["$ref"].rsplit("/", 1)[1]
    described = schema["components"]["schemas"][ref]["properties"]["spec"]["description"]
    assert "generation_backend" in described and "torch" in described and "vllm" in described
    assert "refused on CPU slots" in described


# --- the submit form --------------------------------------------------------------------------


def test_the_form_offers_the_backends_and_submits_torch_by_default(client, operator):
    client.force_login(operator)
    page = client.get("/jobs/new/").content.decode()
    assert 'name="generation_backend"' in page
    assert '<option value="torch" selected>torch</option>' in page
    assert '<option value="vllm">vllm</option>' in page
    response = client.post("/jobs/new/", FORM)  # a form without the field: torch
    assert response.status_code == 302, response.context["form"].errors
    assert Job.objects.get().spec["generation_backend"] == "torch"


def test_the_form_submits_vllm_on_gpu_slots(client, operator):
    client.force_login(operator)
    form = {**FORM, "ppo_gpu": "h100-sxm", "generation_backend": "vllm"}
    response = client.post("/jobs/new/", form)
    assert response.status_code == 302, response.context["form"].errors
    job = Job.objects.get()
    assert (job.spec["gpu"], job.spec["generation_backend"]) == ("h100-sxm", "vllm")


def test_the_form_puts_vllm_on_cpu_slots_on_the_field(client, operator):
    client.force_login(operator)
    response = client.post("/jobs/new/", {**FORM, "generation_backend": "vllm"})
    assert response.status_code == 200
    errors = response.context["form"].errors
    assert errors == {"generation_backend": [VLLM_NEEDS_GPUS]}, errors
    assert VLLM_NEEDS_GPUS in response.content.decode()
    assert not Job.objects.exists()


def test_the_form_refuses_an_unknown_backend_on_the_field(client, operator):
    client.force_login(operator)
    response = client.post("/jobs/new/", {**FORM, "generation_backend": "tensorrt"})
    assert response.status_code == 200
    assert list(response.context["form"].errors) == ["generation_backend"]
    assert not Job.objects.exists()


def test_the_preview_names_the_field_for_vllm_on_cpu_slots(client, operator):
    client.force_login(operator)
    response = client.post("/jobs/new/preview/", {**FORM, "generation_backend": "vllm"})
    assert response.status_code == 400
    body = response.json()
    assert not body["ok"]
    assert [e["message"] for e in body["errors"]["generation_backend"]] == [VLLM_NEEDS_GPUS]
