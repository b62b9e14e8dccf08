"""The pages: job list (state filter, bulk cancel), submit form and its preview, the PPO job's
page (simulated and real), the approvals inbox; and who may do what through them."""

from __future__ import annotations

import json
import re

import pytest

from runtime.jobs.sim_job import run_sim_ppo_job
from runtime.jobs.spec import PpoJobSpec, PpoSimJobSpec, spec_from_json
from tests.support.jobs import make_job
from tests.support.plans import initial_event, plan_json, proposal_event
from webapp.jobs.models import Job, JobEvent, JobState
from webapp.plans import errors as plan_errors
from webapp.plans import services as plan_services
from webapp.plans.models import Proposal, ProposalState
from webapp.projects.models import Role
from webapp.projects.services import project_personal_for

pytestmark = pytest.mark.django_db

SIM_FORM = {
    "name": "sim",
    "kind": "ppo-sim",
    "num_steps": 50,
    "seed": 0,
    "model": "llama-3.1-8b",
    "gpu": "h100-sxm",
    "gpus": 16,
    "trace": "growth",
    "pace_s": 0.1,
    "approval": "manual",
}
SIM_SPEC = PpoSimJobSpec(num_steps=10, policy={"approval": "manual"}).to_json()
PPO_FORM = {
    "name": "ppo",
    "kind": "ppo",
    "num_steps": 20,
    "seed": 0,
    "ppo_model": "tiny-sft",
    "tasks": "copy,reverse",
    "reward": "length",
    "num_slots": 3,
    "max_slots": 4,
    "batch_size": 16,
    "max_new_tokens": 16,
    "warmup_steps": 10,
    "checkpoint_every": 4,
    "revoke_at_step": 5,
    "grant_at_step": "",
    "pace_s": 0.5,
    "approval": "manual_above",
    "approval_above_s": 2.5,
}
PPO_SPEC = PpoJobSpec(num_steps=10, revoke_at_step=3, policy={"approval": "manual"}).to_json()


@pytest.fixture
def operator(project, member):
    return member(project, Role.OPERATOR, "olga")


@pytest.fixture
def approver(project, member):
    return member(project, Role.APPROVER, "anna")


@pytest.fixture
def viewer(project, member):
    return member(project, Role.VIEWER, "vic")


@pytest.fixture
def outsider(other_project, member):
    return member(other_project, Role.ADMIN, "otto")


@pytest.fixture
def sim_job(project, operator):
    return make_job(owner=operator, project=project, name="simjob", spec=SIM_SPEC)


@pytest.fixture
def waiting(sim_job):
    """A controller proposal of ``sim_job``, waiting."""
    plan_services.record_controller_event(job=sim_job, event=initial_event())
    plan_services.record_controller_event(job=sim_job, event=proposal_event(1))
    return Proposal.objects.get(job=sim_job)


# --- job list --------------------------------------------------------------------------------


def test_the_list_filters_by_state_and_refuses_an_unknown_state(client, project, operator):
    make_job(owner=operator, project=project, name="runner", state=JobState.RUNNING)
    make_job(owner=operator, project=project, name="done", state=JobState.SUCCEEDED)
    client.force_login(operator)
    page = client.get("/jobs/?state=running").content.decode()
    assert "<td>runner</td>" in page and "<td>done</td>" not in page
    response = client.get("/jobs/?state=sleeping")
    assert response.status_code == 400 and "state: expected one of" in response.content.decode()


def test_the_list_names_each_job_s_kind(client, project, operator):
    """Found by review: every job that was not a simulated one was listed as SFT."""
    kinds = {"ppo": "PPO", "ppo-sim": 'PPO <span class="sim">simulated</span>', "sft": "SFT"}
    for kind in kinds:
        make_job(owner=operator, project=project, name=kind, spec={"kind": kind, "num_slots": 1})
    client.force_login(operator)
    page = client.get("/jobs/").content.decode()
    for kind, shown in kinds.items():
        assert f"<td>{kind}</td>\n        <td>{shown}</td>" in page, kind


def test_bulk_cancel_cancels_what_one_may_and_reports_the_rest(
    client, project, other_project, operator, viewer, outsider
):
    mine = make_job(owner=operator, project=project, name="a")
    running = make_job(owner=operator, project=project, name="b", state=JobState.RUNNING)
    finished = make_job(owner=operator, project=project, name="c", state=JobState.SUCCEEDED)
    foreign = make_job(owner=outsider, project=other_project, name="x")
    client.force_login(viewer)  # a viewer sees the jobs but cancels none, and gets no checkboxes
    page = client.get("/jobs/").content.decode()
    assert f'value="{mine.pk}"' not in page and "Cancel selected" not in page
    response = client.post("/jobs/cancel/", {"job": [mine.pk]}, follow=True)
    assert "needs the operator role" in response.content.decode()
    mine.refresh_from_db()
    assert mine.state == JobState.PENDING

    client.force_login(operator)
    assert f'value="{mine.pk}"' in client.get("/jobs/").content.decode()
    ids = [mine.pk, running.pk, finished.pk, foreign.pk]
    response = client.post("/jobs/cancel/", {"job": ids}, follow=True)
    text = response.content.decode()
    assert f"job {foreign.pk}: not found" in text and f"job {finished.pk}:" in text
    states = {j.pk: j.state for j in Job.objects.all()}
    assert states[mine.pk] == JobState.CANCELLED and states[running.pk] == JobState.CANCELLING
    assert states[finished.pk] == JobState.SUCCEEDED and states[foreign.pk] == JobState.PENDING


@pytest.mark.parametrize("ids", [[], ["abc"], ["-1"], ["9" * 40]])
def test_bulk_cancel_answers_bad_ids_with_a_message(client, operator, ids):
    client.force_login(operator)
    response = client.post("/jobs/cancel/", {"job": ids}, follow=True)
    assert response.status_code == 200 and "job: " in response.content.decode()


# --- submit form and preview -----------------------------------------------------------------


def test_the_submit_page_submits_a_simulated_job_with_its_policy(client, operator):
    client.force_login(operator)
    page = client.get("/jobs/new/").content.decode()
    assert 'name="gpus"' in page and 'name="num_slots"' in page and "simulated" in page
    assert 'name="memory_runway"' in page
    response = client.post(
        "/jobs/new/",
        {
            **SIM_FORM,
            "gamma": 0.25,
            "threshold": 0.5,
            "memory_runway": "amortized",
            "min_saving": 0.02,
            "calibration_probes": "off",
            "link_probe_every_s": 600,
        },
    )
    job = Job.objects.get(name="sim")
    assert response.status_code == 302 and response["Location"] == f"/jobs/{job.pk}/"
    assert job.spec["kind"] == "ppo-sim" and job.spec["gpus"] == 16
    assert job.spec["policy"]["approval"] == "manual" and job.spec["policy"]["gamma"] == 0.25
    assert job.spec["policy"]["thresholds"]["gen_len"] == 0.5
    assert job.spec["policy"]["memory_runway"] == "amortized"
    assert job.spec["policy"]["min_saving"] == 0.02
    assert job.spec["policy"]["calibration_probes"] is False
    assert job.spec["policy"]["link_probe_every_s"] == 600


def _submit_key(page: str) -> str:
    return re.search(r'name="submit_key" value="([0-9a-f]{32})"', page).group(1)


def test_a_page_of_the_submit_form_sent_twice_makes_one_job(client, operator):
    client.force_login(operator)
    key = _submit_key(client.get("/jobs/new/").content.decode())
    assert key != _submit_key(client.get("/jobs/new/").content.decode())  # one per page
    first = client.post("/jobs/new/", {**SIM_FORM, "submit_key": key})
    again = client.post("/jobs/new/", {**SIM_FORM, "submit_key": key})  # a double click
    job = Job.objects.get()
    assert first["Location"] == again["Location"] == f"/jobs/{job.pk}/"
    # The same page sent back with other values: said so, and the page shown again submits.
    changed = client.post("/jobs/new/", {**SIM_FORM, "name": "other", "submit_key": key})
    page = changed.content.decode()
    assert changed.status_code == 200 and "submitted before with other values" in page
    assert Job.objects.count() == 1 and _submit_key(page) != key
    made = client.post("/jobs/new/", {**SIM_FORM, "name": "other", "submit_key": _submit_key(page)})
    assert made.status_code == 302 and Job.objects.filter(name="other").count() == 1
    bad = client.post("/jobs/new/", {**SIM_FORM, "submit_key": "x"})
    assert bad.status_code == 200 and "32 hex digits" in bad.content.decode()


def test_the_submit_form_lists_the_personal_project_once_as_its_empty_choice(
    client, project, operator
):
    client.force_login(operator)
    personal = project_personal_for(operator)
    page = client.get("/jobs/new/").content.decode()
    options = page[page.index('name="project"') :]
    options = options[: options.index("</select>")]
    assert options.count(f"({personal.slug})") == 1  # the empty choice names it
    assert '<option value="" selected>' in options and f'value="{personal.pk}"' not in options
    assert f'value="{project.pk}"' in options
    client.post("/jobs/new/", {**SIM_FORM, "project": ""})
    assert Job.objects.get(name="sim").project == personal


@pytest.mark.parametrize(
    "change, field",
    [
        ({"gpus": 0}, "gpus"),
        ({"gpus": ""}, "gpus"),
        ({"model": "gpt-9"}, "model"),
        ({"trace": "zigzag"}, "trace"),
        ({"gamma": 500}, "gamma"),
        ({"threshold": -1}, "threshold"),
        ({"pace_s": 99}, "pace_s"),
        ({"approval": "sometimes"}, "approval"),
        ({"memory_runway": "forever"}, "memory_runway"),
        ({"min_saving": 1.5}, "min_saving"),
        ({"calibration_probes": "maybe"}, "calibration_probes"),
        ({"link_probe_every_s": -5}, "link_probe_every_s"),
        ({"link_probe_every_s": "often"}, "link_probe_every_s"),
        ({"kind": "quantum"}, "kind"),
    ],
)
def test_the_submit_form_names_the_bad_field(client, operator, change, field):
    client.force_login(operator)
    response = client.post("/jobs/new/", {**SIM_FORM, **change})
    assert response.status_code == 200 and field in response.context["form"].errors
    assert not Job.objects.exists()


def test_the_preview_is_the_plan_the_job_starts_on(client, operator):
    client.force_login(operator)
    response = client.post("/jobs/new/preview/", SIM_FORM)
    assert response.status_code == 200
    body = response.json()
    preview = body["preview"]
    assert body["ok"] and preview["simulated"] and preview["predicted_step_s"] > 0
    assert not Job.objects.exists()  # a preview submits nothing
    # The same spec, run: its first control.plan is the previewed plan.
    first = []
    spec = spec_from_json(
        {
            **{k: SIM_FORM[k] for k in ("model", "gpu", "gpus", "trace", "num_steps", "seed")},
            "kind": "ppo-sim",
            "pace_s": 0.0,
            "policy": {"approval": "manual"},
        }
    )
    run_sim_ppo_job(
        spec,
        sink=_Discard(),
        emit_control=lambda e: first.append(e) if e["event"] == "control.plan" else None,
        should_stop=lambda: bool(first),
    )
    assert json.loads(json.dumps(first[0]["plan"])) == preview["plan"]
    for ms in preview["plan"]["model_stages"]:
        layout = ms["layout"]
        assert len(ms["units"]) == layout["dp"]
        assert all(len(unit) == layout["tp"] * layout["pp"] for unit in ms["units"])


class _Discard:
    def emit(self, event) -> None:
        pass


def test_the_preview_of_an_sft_job_is_data_parallel_without_a_prediction(client, operator):
    client.force_login(operator)
    response = client.post(
        "/jobs/new/preview/", {"name": "s", "num_slots": 3, "num_steps": 5, "seed": 0}
    )
    preview = response.json()["preview"]
    assert preview["predicted_step_s"] is None and not preview["simulated"]
    assert preview["plan"]["model_stages"][0]["units"] == [[0], [1], [2]]


@pytest.mark.parametrize(
    "change, field",
    [({"gpus": "lots"}, "gpus"), ({"model": "llama-3.1-70b", "gpus": 1}, "gpus")],
)
def test_the_preview_answers_bad_input_with_field_errors(client, operator, change, field):
    client.force_login(operator)
    response = client.post("/jobs/new/preview/", {**SIM_FORM, **change})
    assert response.status_code == 400
    body = response.json()
    assert not body["ok"] and field in body["errors"]


def test_the_preview_needs_a_login(client):
    response = client.post("/jobs/new/preview/", SIM_FORM)
    assert response.status_code == 302 and response["Location"].startswith("/login/")


def test_the_submit_page_submits_a_real_ppo_job(client, operator):
    client.force_login(operator)
    page = client.get("/jobs/new/").content.decode()
    assert 'value="ppo"' in page and 'name="ppo_model"' in page and 'name="revoke_at_step"' in page
    response = client.post("/jobs/new/", PPO_FORM)
    assert response.status_code == 302, response.context["form"].errors
    job = Job.objects.get(name="ppo")
    spec = job.spec
    assert (spec["kind"], spec["model"], spec["tasks"], spec["reward"]) == (
        "ppo",
        "tiny-sft",
        "copy,reverse",
        "length",
    )
    assert (spec["num_slots"], spec["max_slots"], spec["batch_size"]) == (3, 4, 16)
    assert (spec["revoke_at_step"], spec["grant_at_step"], spec["pace_s"]) == (5, -1, 0.5)
    assert spec["policy"] == {"approval": "manual_above", "approval_above_s": 2.5}


@pytest.mark.parametrize(("batch_size", "minibatch_size"), [(4, 4), (1, 1), (8, 8), (16, 8)])
def test_the_ppo_submit_form_takes_a_batch_smaller_than_the_default_minibatch(
    client, operator, batch_size, minibatch_size
):
    """The form has no minibatch field, and the spec's default of 8 refused any batch below 8
    (found by review): the minibatch is the default cut to the batch."""
    client.force_login(operator)
    response = client.post("/jobs/new/", {**PPO_FORM, "batch_size": batch_size})
    assert response.status_code == 302, response.context["form"].errors
    spec = Job.objects.get(name="ppo").spec
    assert (spec["batch_size"], spec["minibatch_size"]) == (batch_size, minibatch_size)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"ppo_model": "gpt-9"}, "ppo_model"),
        ({"ppo_model": ""}, "ppo_model"),
        ({"ppo_model": "llama-3.1-8b"}, "ppo_model"),  # in the catalog, but not on 3 CPU slots
        ({"tasks": "zigzag"}, "tasks"),
        ({"tasks": ""}, "tasks"),
        ({"reward": "vibes"}, "reward"),
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": "lots"}, "batch_size"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_slots": 2}, "max_slots"),
        ({"num_slots": 0}, "num_slots"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"checkpoint_every": ""}, "checkpoint_every"),
        ({"revoke_at_step": 20}, "revoke_at_step"),
        ({"grant_at_step": -5}, "grant_at_step"),
        ({"pace_s": 61}, "pace_s"),
        ({"approval_above_s": -1}, "approval_above_s"),
        ({"threshold": 0}, "threshold"),
    ],
)
def test_the_ppo_submit_form_names_the_bad_field(client, operator, change, field):
    client.force_login(operator)
    response = client.post("/jobs/new/", {**PPO_FORM, **change})
    assert response.status_code == 200 and field in response.context["form"].errors, (
        response.context["form"].errors
    )
    assert not Job.objects.exists()


def test_the_preview_of_a_ppo_job_is_the_controllers_first_plan_on_its_slots(client, operator):
    client.force_login(operator)
    response = client.post("/jobs/new/preview/", PPO_FORM)
    assert response.status_code == 200, response.content
    preview = response.json()["preview"]
    assert preview["kind"] == "ppo" and not preview["simulated"]
    assert preview["predicted_step_s"] > 0 and preview["plan"]["num_slots"] == 3
    assert preview["plan"]["accelerator"] == "cpu-slot"
    names = {ms["name"] for ms in preview["plan"]["model_stages"]}
    assert {"actor@generation", "actor@training", "critic@training"} <= names
    for ms in preview["plan"]["model_stages"]:
        assert all(slot < 3 for unit in ms["units"] for slot in unit)
    assert not Job.objects.exists()


def test_a_ppo_job_on_gpus_is_previewed_and_submitted_for_them(client, operator):
    """The form's Slots choice: a model too big for CPU slots is planned for, and submitted on,
    the GPUs named; an unknown accelerator is named as the form's field."""
    client.force_login(operator)
    form = {**PPO_FORM, "ppo_model": "llama-3.1-8b", "ppo_gpu": "h100-sxm", "num_slots": 8}
    form.update(max_slots=8, revoke_at_step=-1)
    preview = client.post("/jobs/new/preview/", form).json()["preview"]
    assert preview["plan"]["accelerator"] == "h100-sxm" and "h100-sxm GPUs" in preview["note"]
    response = client.post("/jobs/new/", form)
    assert response.status_code == 302, response.context["form"].errors
    job = Job.objects.get(name="ppo")
    assert job.spec["gpu"] == "h100-sxm" and job.spec["model"] == "llama-3.1-8b"
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert "engine: <strong>Ray, h100-sxm GPUs</strong>" in page
    response = client.post("/jobs/new/", {**form, "name": "bad", "ppo_gpu": "tpu-v9"})
    assert response.status_code == 200 and "ppo_gpu" in response.context["form"].errors


@pytest.mark.parametrize(
    "change, field",
    [({"ppo_model": "llama-3.1-70b"}, "ppo_model"), ({"tasks": "zigzag"}, "tasks")],
)
def test_the_ppo_preview_answers_bad_input_with_field_errors(client, operator, change, field):
    client.force_login(operator)
    response = client.post("/jobs/new/preview/", {**PPO_FORM, **change})
    assert response.status_code == 400
    body = response.json()
    assert not body["ok"] and field in body["errors"], body


def test_the_real_ppo_job_page_has_the_controller_and_ppo_panels_without_simulated_labels(
    client, project, operator, approver
):
    job = make_job(owner=operator, project=project, name="ppojob", spec=PPO_SPEC)
    client.force_login(approver)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert "engine: <strong>Ray, CPU slots</strong>" in page
    assert 'class="sim"' not in page and "simulated cluster" not in page
    assert 'id="twin-scope"' not in page
    for panel in (
        "chart-genlen",
        "chart-memory",
        "chart-pool",
        "chart-latency",
        "map-current",
        "chart-reward",
        "chart-kl",
        "chart-length",
        "chart-clip",
    ):
        assert f'id="{panel}"' in page
    assert 'id="dag"' in page and 'id="decisions"' in page and 'id="calibration-ops"' in page
    assert 'id="decide-form"' in page and "js/job_ppo.js" in page
    assert "takes a slot away before" in page


# --- the simulated job's page ----------------------------------------------------------------


def test_the_simulated_job_page_labels_the_engine_and_offers_approval_to_approvers(
    client, sim_job, approver, viewer
):
    client.force_login(approver)
    page = client.get(f"/jobs/{sim_job.pk}/").content.decode()
    assert "engine: <strong>simulated cluster</strong>" in page
    for panel in ("chart-genlen", "chart-memory", "chart-pool", "chart-latency", "map-current"):
        assert f'id="{panel}"' in page
    assert 'id="dag"' in page and 'id="decisions"' in page and 'id="calibration-ops"' in page
    assert 'id="decide-form"' in page and 'id="job-config"' in page
    assert 'id="chart-reward"' not in page  # PPO's own statistics are the real job's
    # what the cluster twin models and what it leaves out, said where its figures are shown
    assert 'id="twin-scope"' in page and "It leaves out:" in page
    client.force_login(viewer)
    page = client.get(f"/jobs/{sim_job.pk}/").content.decode()
    assert 'id="decide-form"' not in page and f"/jobs/{sim_job.pk}/cancel/" not in page


def test_pages_of_another_projects_job_are_not_found(client, sim_job, waiting, outsider):
    client.force_login(outsider)
    assert client.get(f"/jobs/{sim_job.pk}/").status_code == 404
    assert client.post(f"/jobs/{sim_job.pk}/cancel/").status_code == 404
    response = client.post(
        f"/approvals/{waiting.pk}/decide/", {"decision": "approve", "comment": "mine now"}
    )
    assert response.status_code == 404
    assert f"proposal-{waiting.pk}" not in client.get("/approvals/").content.decode()
    waiting.refresh_from_db()
    assert waiting.state == ProposalState.WAITING


# --- approvals inbox -------------------------------------------------------------------------


def test_the_inbox_lists_waiting_proposals_to_approvers_only(client, waiting, approver, viewer):
    client.force_login(approver)
    page = client.get("/approvals/").content.decode()
    assert f'id="proposal-{waiting.pk}"' in page and f"/approvals/{waiting.pk}/decide/" in page
    client.force_login(viewer)
    page = client.get("/approvals/").content.decode()
    assert f'id="proposal-{waiting.pk}"' not in page and "Nothing waits" in page


def test_the_inbox_warns_that_approving_a_restart_proposal_restarts_the_job(
    client, sim_job, approver
):
    plan_services.record_controller_event(job=sim_job, event=initial_event())
    plan_services.record_controller_event(
        job=sim_job, event={**proposal_event(1), "route": "restart"}
    )
    client.force_login(approver)
    page = client.get("/approvals/").content.decode()
    assert "Approving restarts the job" in page
    plan_services.record_controller_event(job=sim_job, event=proposal_event(2))  # a live one
    page = client.get("/approvals/").content.decode()
    assert "proposal-" in page and "Approving restarts the job" not in page


def test_a_viewer_or_operator_cannot_approve_through_the_page(client, waiting, viewer, operator):
    for user in (viewer, operator):
        client.force_login(user)
        response = client.post(
            f"/approvals/{waiting.pk}/decide/", {"decision": "approve", "comment": "ok"}
        )
        assert response.status_code == 403
    waiting.refresh_from_db()
    assert waiting.state == ProposalState.WAITING
    assert not JobEvent.objects.filter(kind="command.approve").exists()


@pytest.mark.parametrize(
    "data, field",
    [
        ({"decision": "approve", "comment": "   "}, "comment"),
        ({"decision": "maybe", "comment": "hmm"}, "decision"),
        ({"decision": "reject", "comment": "a\x00b"}, "comment"),  # PostgreSQL's text refuses NUL
        ({"decision": "reject", "comment": "ok\x1b]0;pwned\x07"}, "comment"),  # a terminal's
        ({"decision": "approve", "comment": "x" * 4001}, "comment"),  # the API's limit too
    ],
)
def test_deciding_without_a_comment_or_decision_is_a_field_error(
    client, waiting, approver, data, field
):
    client.force_login(approver)
    response = client.post(f"/approvals/{waiting.pk}/decide/", data)
    assert response.status_code == 400
    assert f'data-field="{field}"' in response.content.decode()
    waiting.refresh_from_db()
    assert waiting.state == ProposalState.WAITING


def test_an_approver_approves_with_a_comment_and_the_job_gets_the_command(
    client, sim_job, waiting, approver
):
    client.force_login(approver)
    response = client.post(
        f"/approvals/{waiting.pk}/decide/",
        {"decision": "approve", "comment": "the DAG is short", "next": f"/jobs/{sim_job.pk}/"},
    )
    assert response.status_code == 302 and response["Location"] == f"/jobs/{sim_job.pk}/"
    waiting.refresh_from_db()
    assert waiting.state == ProposalState.APPROVED and waiting.decided_by == approver
    command = JobEvent.objects.get(job=sim_job, kind="command.approve")
    assert command.data["comment"] == "the DAG is short" and command.data["proposal"] == 1
    # Deciding twice is refused with a message, not an error page.
    again = client.post(
        f"/approvals/{waiting.pk}/decide/", {"decision": "reject", "comment": "no"}, follow=True
    )
    assert again.status_code == 200 and "not waiting" in again.content.decode()


def test_a_redirect_elsewhere_is_not_followed(client, waiting, approver):
    client.force_login(approver)
    response = client.post(
        f"/approvals/{waiting.pk}/decide/",
        {"decision": "reject", "comment": "no", "next": "https://evil.example/"},
    )
    assert response.status_code == 302 and response["Location"] == "/approvals/"


def test_self_approval_is_refused_by_default(client, sim_job, project, member):
    proposer = member(project, Role.APPROVER, "pat")
    override = plan_services.proposal_override(
        user=proposer, job=sim_job, plan=plan_json(8), reason="more slots"
    )
    client.force_login(proposer)
    response = client.post(
        f"/approvals/{override.pk}/decide/",
        {"decision": "approve", "comment": "looks good to me"},
        follow=True,
    )
    assert plan_errors.SELF_APPROVAL in response.content.decode()
    override.refresh_from_db()
    assert override.state == ProposalState.WAITING


def test_dark_mode_follows_the_system_setting(client):
    css = b"".join(client.get("/static/css/nereus.css").streaming_content).decode()
    assert "@media (prefers-color-scheme: dark)" in css
