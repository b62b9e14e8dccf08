"""``nereus submit`` and a PPO job's ``generation_backend``, against a real web server (the Daphne
service of ``test_client``), run as a subprocess: the spec file's field or ``--generation-backend``
(which sets it over the file's); ``vllm`` on CPU slots and unknown values exit 2 with the
service's message naming ``spec.generation_backend``. No worker runs: jobs stay pending."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nereus import client
from runtime.jobs.spec import VLLM_NEEDS_GPUS
from tests.nereus.test_client import _no_traceback, _run, _service

PPO_SPEC = {"kind": "ppo", "num_slots": 2, "max_slots": 2, "num_steps": 4}
VLLM_ON_CPU = VLLM_NEEDS_GPUS.removeprefix("generation_backend: ")


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with _service(tmp_path_factory.mktemp("backend-service")) as running:
        yield running


def _spec_file(tmp_path: Path, spec: dict) -> str:
    path = tmp_path / "ppo.json"
    path.write_text(json.dumps(spec))
    return str(path)


def _submitted(service, args: list[str]) -> dict:
    done = _run(["submit", *args, "--json"], service.cli_env())
    assert done.returncode == client.EXIT_OK, done.stderr
    job = json.loads(done.stdout)
    service.cancel(job["id"])
    return job


def test_a_job_that_names_no_backend_records_torch(service, tmp_path):
    job = _submitted(service, ["--spec", _spec_file(tmp_path, PPO_SPEC)])
    assert job["spec"]["generation_backend"] == "torch"


def test_the_flag_sets_the_field_over_the_file_s(service, tmp_path):
    on_gpus = {**PPO_SPEC, "gpu": "h100-sxm", "generation_backend": "torch"}
    job = _submitted(
        service, ["--spec", _spec_file(tmp_path, on_gpus), "--generation-backend", "vllm"]
    )
    assert (job["spec"]["gpu"], job["spec"]["generation_backend"]) == ("h100-sxm", "vllm")
    job = _submitted(
        service, ["--spec", _spec_file(tmp_path, {**on_gpus, "generation_backend": "vllm"})]
    )
    assert job["spec"]["generation_backend"] == "vllm"


def test_vllm_on_cpu_slots_exits_2_naming_the_field(service, tmp_path):
    by_flag = ["--spec", _spec_file(tmp_path, PPO_SPEC), "--generation-backend", "vllm"]
    done = _run(["submit", *by_flag], service.cli_env())
    assert done.returncode == client.EXIT_USAGE, done.stderr
    assert "HTTP 400" in done.stderr
    assert f"spec.generation_backend: {VLLM_ON_CPU}" in done.stderr, done.stderr
    assert done.stdout == ""
    _no_traceback(done)

    in_file = ["--spec", _spec_file(tmp_path, {**PPO_SPEC, "generation_backend": "vllm"})]
    as_json = _run(["submit", *in_file, "--json"], service.cli_env())
    assert as_json.returncode == client.EXIT_USAGE
    fields = json.loads(as_json.stdout)["error"]["fields"]
    assert fields == {"spec.generation_backend": [VLLM_ON_CPU]}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("tensorrt", "expected one of torch, vllm, got 'tensorrt'"),
        (3, "expected str, got 3"),
        (None, "expected str, got None"),
    ],
)
def test_an_unknown_backend_exits_2_naming_the_field(service, tmp_path, value, message):
    spec = _spec_file(tmp_path, {**PPO_SPEC, "generation_backend": value})
    done = _run(["submit", "--spec", spec], service.cli_env())
    assert done.returncode == client.EXIT_USAGE, done.stderr
    assert f"spec.generation_backend: {message}" in done.stderr, done.stderr
    _no_traceback(done)
    if isinstance(value, str):
        flag = ["--spec", _spec_file(tmp_path, PPO_SPEC), "--generation-backend", value]
        done = _run(["submit", *flag], service.cli_env())
        assert done.returncode == client.EXIT_USAGE, done.stderr
        assert f"spec.generation_backend: {message}" in done.stderr, done.stderr


def test_the_help_names_the_flag(service):
    done = _run(["submit", "--help"], service.cli_env(COLUMNS="200"))
    assert done.returncode == 0 and "--generation-backend" in done.stdout, done.stdout
