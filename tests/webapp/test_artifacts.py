"""A job's trained models through the REST API and its page: listed from the manifests in the
job's directory, each file served as its manifest lists it (hash in ETag and Repr-Digest), to
the job's project only; anything else is a 404 that names the artifact or the file.

The export folder here is written by ``runtime.ppo.export`` as a job's end writes it; a real job
writes it in tests/webapp/test_ppo_job.py."""

from __future__ import annotations

import base64
import hashlib

import pytest
from django.test import override_settings

from runtime.planner import default_catalog
from runtime.ppo.export import write_hf_folder
from runtime.ppo.model import build_model
from webapp.jobs import services as job_services
from webapp.jobs.workdir import job_workdir
from webapp.projects.models import Role

TINY = default_catalog().model("tiny-sft")


@pytest.fixture
def jobs_dir(tmp_path):
    with override_settings(NEREUS_JOBS_DIR=tmp_path / "jobs"):
        yield tmp_path / "jobs"


@pytest.fixture
def job(project, member, monkeypatch, jobs_dir):
    monkeypatch.setattr(job_services, "_enqueue_driver", lambda job_id: None)
    owner = member(project, Role.OPERATOR, "owner")
    spec = {"kind": "ppo", "num_slots": 1, "max_slots": 1, "num_steps": 2}
    return job_services.job_submit(user=owner, project=project, name="ppo", spec=spec)


@pytest.fixture
def exported(job, jobs_dir):
    model = build_model(TINY, scalar_head=False, seed=1)
    return write_hf_folder(
        job_workdir(job.pk) / "export" / "actor",
        TINY,
        model.state_dict(),
        source={"role": "actor", "step": 2},
    )


def _artifacts(client, job_id):
    return client.get(f"/api/v1/jobs/{job_id}/artifacts/")


@pytest.mark.django_db
def test_a_job_without_an_export_lists_none(api, project, member, job):
    response = _artifacts(api(user=member(project, Role.VIEWER, "v")), job.pk)
    assert response.status_code == 200 and response.json() == {"results": []}


@pytest.mark.django_db
def test_the_export_is_listed_and_each_file_downloads_with_its_hash(
    api, project, member, token_for, job, exported
):
    for client in (
        api(user=member(project, Role.VIEWER, "v")),
        api(secret=token_for(project, Role.VIEWER)),
    ):
        response = _artifacts(client, job.pk)
        assert response.status_code == 200, response.content
        (artifact,) = response.json()["results"]
        assert artifact["name"] == "actor" and artifact["architecture"] == "LlamaForCausalLM"
        assert artifact["source"] == {"role": "actor", "step": 2}
        names = {f["name"] for f in artifact["files"]}
        assert names == {"config.json", "model.safetensors"}
        for entry in artifact["files"]:
            assert entry["url"].endswith(f"/api/v1/jobs/{job.pk}/artifacts/actor/{entry['name']}")
            got = client.get(entry["url"])
            assert got.status_code == 200
            body = b"".join(got.streaming_content)
            assert body == (exported / entry["name"]).read_bytes()
            assert len(body) == entry["bytes"]
            assert hashlib.sha256(body).hexdigest() == entry["sha256"]
            assert got["ETag"] == f'"{entry["sha256"]}"'
            assert got["Repr-Digest"] == (
                "sha-256=:" + base64.b64encode(hashlib.sha256(body).digest()).decode() + ":"
            )
            assert got["Content-Disposition"].startswith("attachment")


@pytest.mark.django_db
def test_other_projects_and_strangers_find_nothing(
    api, project, other_project, member, token_for, job, exported
):
    outsider = api(user=member(other_project, Role.ADMIN, "outsider"))
    other_token = api(secret=token_for(other_project, Role.ADMIN))
    anonymous = api()
    url = f"/api/v1/jobs/{job.pk}/artifacts/actor/model.safetensors"
    for client in (outsider, other_token):
        assert _artifacts(client, job.pk).status_code == 404
        assert client.get(url).status_code == 404
    assert anonymous.get(url).status_code in (401, 403)


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("critic/config.json", "artifact: this job has no artifact 'critic'"),
        ("actor/tokenizer.json", "file: artifact 'actor' has no file 'tokenizer.json'"),
        ("actor/manifest.json", "file: artifact 'actor' has no file 'manifest.json'"),
        ("../x", "artifact: this job has no artifact '..'"),
        ("actor/..", "file: artifact 'actor' has no file '..'"),
    ],
)
def test_only_files_the_manifest_lists_are_served(
    api, project, member, job, exported, path, message
):
    response = api(user=member(project, Role.VIEWER, "v")).get(
        f"/api/v1/jobs/{job.pk}/artifacts/{path}"
    )
    assert response.status_code == 404
    assert message in response.json()["message"]


@pytest.mark.django_db
@pytest.mark.parametrize(
    "path", ["..%2F..%2F..%2Fsecret_key", "actor/..%2F..%2F..%2Fsecret_key", "actor/x/y"]
)
def test_a_path_that_leaves_the_export_matches_no_route(api, project, member, job, exported, path):
    """The server decodes %2F before routing: such a path has more segments than the route
    allows, so nothing under the job's directory (or beyond it) is reached."""
    (job_workdir(job.pk) / "secret_key").write_text("s3cret")
    response = api(user=member(project, Role.VIEWER, "v")).get(
        f"/api/v1/jobs/{job.pk}/artifacts/{path}"
    )
    assert response.status_code == 404 and b"s3cret" not in response.content


@pytest.mark.django_db
def test_a_file_changed_on_disk_is_not_served(api, project, member, job, exported):
    client = api(user=member(project, Role.VIEWER, "v"))
    with (exported / "model.safetensors").open("ab") as handle:
        handle.write(b"\0")
    response = client.get(f"/api/v1/jobs/{job.pk}/artifacts/actor/model.safetensors")
    assert response.status_code == 404
    assert (
        "'model.safetensors' of artifact 'actor' is missing or changed"
        in response.json()["message"]
    )


@pytest.mark.django_db
def test_the_job_page_links_each_file_of_the_trained_model(client, project, member, job, exported):
    client.force_login(member(project, Role.VIEWER, "v"))
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="artifacts"' in page and 'id="artifacts" hidden' not in page
    for name in ("config.json", "model.safetensors"):
        assert f'href="/api/v1/jobs/{job.pk}/artifacts/actor/{name}"' in page


@pytest.mark.django_db
def test_the_job_page_hides_the_card_until_there_is_a_model(client, project, member, job):
    client.force_login(member(project, Role.VIEWER, "v"))
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="artifacts" hidden' in page


@pytest.mark.django_db
def test_a_link_in_the_export_is_not_followed(api, project, member, job, exported, tmp_path):
    """Defence in depth: whoever can write into a job's folder cannot make the web server read
    elsewhere by a link, even one whose size matches the manifest."""
    secret = tmp_path / "environ"
    secret.write_bytes((exported / "config.json").read_bytes()[::-1])  # the same size
    (exported / "config.json").unlink()
    (exported / "config.json").symlink_to(secret)
    client = api(user=member(project, Role.VIEWER, "v"))
    response = client.get(f"/api/v1/jobs/{job.pk}/artifacts/actor/config.json")
    assert response.status_code == 404 and "missing or changed" in response.json()["message"]
    linked = exported.parent / "linked"
    linked.symlink_to(exported)
    names = [a["name"] for a in _artifacts(client, job.pk).json()["results"]]
    assert names == ["actor"]


@pytest.mark.django_db  # closing a response sends request_finished, which touches connections
def test_a_model_file_streams_a_block_at_a_time_under_asgi(tmp_path):
    """Django's own FileResponse reads a synchronous file whole under ASGI before sending."""
    import asyncio
    import warnings

    from webapp.api.jobs import ChunkedFileResponse

    path = tmp_path / "model.safetensors"
    path.write_bytes(bytes(range(256)) * (3 * 4096 + 1))  # just over 3 MiB
    handle = path.open("rb")
    response = ChunkedFileResponse(handle, as_attachment=True, filename=path.name)

    async def first_two():
        blocks = []
        async for block in response:
            blocks.append((len(block), handle.tell()))
            if len(blocks) == 2:
                break
        return blocks

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "must consume synchronous iterators" would be one
        blocks = asyncio.run(first_two())
    assert blocks == [(2**20, 2**20), (2**20, 2**21)]
    response.close()
    assert handle.closed
