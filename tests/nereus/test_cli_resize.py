"""``nereus resize JOB_ID --slots N [--notice S] [--json]`` against a real web server (the Daphne
service of ``test_client``, with its project 'ci' and tokens), run as a subprocess: what it
prints, the command it records in the job's log, and the exit code a pipeline branches on. No
worker runs: the jobs stay pending (a pending real PPO job takes a resize) until cancelled."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from nereus import client
from nereus.processes import free_port
from tests.nereus.test_client import PROXY_VARIABLES, _no_traceback, _run, _service
from webapp.jobs import errors

PPO_SPEC = {"kind": "ppo", "num_slots": 2, "max_slots": 4, "num_steps": 5}
SFT_SPEC = {"num_slots": 1, "num_steps": 3}
ASKED = re.compile(
    r"job (\d+): pool of (\d+) slots asked(, with \S+ s notice)? "
    r"\(command (\d+); the driver makes it between steps\)\n"
)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with _service(tmp_path_factory.mktemp("resize-service")) as running:
        yield running


def _submit(service, tmp_path: Path, spec: dict, name: str) -> int:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(spec))
    done = _run(["submit", "--spec", str(path), "--name", name], service.cli_env())
    assert done.returncode == client.EXIT_OK, done.stderr
    return int(done.stdout.strip())


@pytest.fixture
def ppo_job(service, tmp_path) -> int:
    return _submit(service, tmp_path, PPO_SPEC, "ppo")


def _resizes(service, job_id: int) -> list[dict]:
    done = _run(["logs", str(job_id), "--json"], service.cli_env("viewer"))
    assert done.returncode == client.EXIT_OK, done.stderr
    events = [json.loads(line)["event"] for line in done.stdout.splitlines()]
    return [e for e in events if e["kind"] == "command.resize"]


def test_resize_prints_what_was_asked_and_records_the_command(service, ppo_job):
    done = _run(["resize", str(ppo_job), "--slots", "3"], service.cli_env())
    assert done.returncode == client.EXIT_OK, done.stderr
    match = ASKED.fullmatch(done.stdout)
    assert match, done.stdout
    assert (int(match[1]), int(match[2]), match[3]) == (ppo_job, 3, None)
    (event,) = _resizes(service, ppo_job)
    assert event["id"] == int(match[4])
    assert event["data"] == {"slots": 3, "notice_s": 0.0, "by": "alice"}

    done = _run(["resize", str(ppo_job), "--slots", "1", "--notice", "90"], service.cli_env())
    assert done.returncode == client.EXIT_OK, done.stderr
    match = ASKED.fullmatch(done.stdout)
    assert match and match[2] == "1" and match[3] == ", with 90 s notice", done.stdout
    events = _resizes(service, ppo_job)
    assert [e["data"]["slots"] for e in events] == [3, 1]
    assert events[-1]["id"] == int(match[4]) and events[-1]["data"]["notice_s"] == 90.0


def test_resize_json_prints_the_services_answer(service, ppo_job):
    done = _run(
        ["resize", str(ppo_job), "--slots", "4", "--notice", "12.5", "--json"], service.cli_env()
    )
    assert done.returncode == client.EXIT_OK, done.stderr
    answer = json.loads(done.stdout)
    (event,) = _resizes(service, ppo_job)
    assert answer == {"job": ppo_job, "slots": 4, "notice_s": 12.5, "event": event["id"]}
    assert event["data"] == {"slots": 4, "notice_s": 12.5, "by": "alice"}


def test_a_pool_past_max_slots_is_a_400_naming_slots_and_exits_2(service, ppo_job):
    done = _run(["resize", str(ppo_job), "--slots", "5"], service.cli_env())
    assert done.returncode == client.EXIT_USAGE, done.stderr
    assert "nereus resize: HTTP 400" in done.stderr
    assert "  slots: " in done.stderr and "max_slots (4)" in done.stderr, done.stderr
    assert done.stdout == ""
    _no_traceback(done)
    as_json = _run(["resize", str(ppo_job), "--slots", "5", "--json"], service.cli_env())
    assert as_json.returncode == client.EXIT_USAGE
    error = json.loads(as_json.stdout)["error"]
    assert (error["status"], error["exit_code"], list(error["fields"])) == (400, 2, ["slots"])
    assert _resizes(service, ppo_job) == []


def test_a_supervised_job_is_a_400_and_exits_2(service, tmp_path):
    job_id = _submit(service, tmp_path, SFT_SPEC, "sft")
    done = _run(["resize", str(job_id), "--slots", "1", "--json"], service.cli_env())
    assert done.returncode == client.EXIT_USAGE, done.stderr
    assert "HTTP 400" in done.stderr
    assert json.loads(done.stdout)["error"]["fields"] == {
        "slots": [errors.RESIZE_FIXED.format(kind="sft")]
    }
    _no_traceback(done)
    assert _resizes(service, job_id) == []


def test_a_job_that_ended_is_a_409_and_exits_5(service, ppo_job):
    assert service.cancel(ppo_job)["state"] == "cancelled"  # pending: cancelled at once
    done = _run(["resize", str(ppo_job), "--slots", "3"], service.cli_env())
    assert done.returncode == client.EXIT_CONFLICT, done.stderr
    assert "nereus resize: HTTP 409" in done.stderr
    assert errors.JOB_FINISHED.format(job_id=ppo_job, state="cancelled") in done.stderr
    assert done.stdout == ""
    _no_traceback(done)
    as_json = _run(["resize", str(ppo_job), "--slots", "3", "--json"], service.cli_env())
    assert as_json.returncode == client.EXIT_CONFLICT
    error = json.loads(as_json.stdout)["error"]
    assert (error["status"], error["exit_code"], error["fields"]) == (409, 5, {})
    assert _resizes(service, ppo_job) == []


def test_a_viewer_exits_3_and_an_unknown_job_4(service, ppo_job):
    done = _run(["resize", str(ppo_job), "--slots", "3"], service.cli_env("viewer"))
    assert done.returncode == client.EXIT_AUTH and "nereus resize: HTTP 403" in done.stderr
    _no_traceback(done)
    done = _run(["resize", "987654", "--slots", "3"], service.cli_env())
    assert done.returncode == client.EXIT_NOT_FOUND and "HTTP 404" in done.stderr
    _no_traceback(done)
    done = _run(["resize", str(ppo_job), "--slots", "3"], service.cli_env("revoked"))
    assert done.returncode == client.EXIT_AUTH and "HTTP 401" in done.stderr
    assert _resizes(service, ppo_job) == []


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--slots", "0"], "--slots"),
        (["--slots", "two"], "--slots"),
        (["--slots", "2.5"], "--slots"),
        (["--slots", "2", "--notice", "-1"], "--notice"),
        (["--slots", "2", "--notice", "86401"], "--notice"),
        (["--slots", "2", "--notice", "soon"], "--notice"),
        ([], "--slots"),
    ],
)
def test_bad_options_are_refused_before_any_request(service, args, named):
    """An unreachable URL: the refusal must come from the command line, not the server."""
    env = service.cli_env(NEREUS_URL=f"http://127.0.0.1:{free_port()}")
    done = _run(["resize", "7", *args], env)
    assert done.returncode == client.EXIT_USAGE, done.stderr
    assert named in done.stderr, done.stderr
    assert "cannot reach" not in done.stderr
    _no_traceback(done)


def test_an_unreachable_service_exits_6_with_the_url(service):
    url = f"http://127.0.0.1:{free_port()}"
    done = _run(["resize", "7", "--slots", "2"], service.cli_env(NEREUS_URL=url))
    assert done.returncode == client.EXIT_UNREACHABLE, done.stderr
    assert url in done.stderr
    _no_traceback(done)


def test_a_missing_token_names_the_variable_and_exits_2(service):
    done = _run(["resize", "7", "--slots", "2"], service.cli_env(token=None))
    assert done.returncode == client.EXIT_USAGE and "NEREUS_TOKEN" in done.stderr
    _no_traceback(done)


def test_the_client_posts_the_pool_and_returns_the_answer(service, ppo_job, monkeypatch):
    """``Client.job_pool``, the library call under the command."""
    for variable in PROXY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    api = client.Client(
        client.ClientConfig.resolve(url=service.url, token=service.tokens["operator"])
    )
    answer = api.job_pool(ppo_job, slots=2, notice_s=7.5)
    assert (answer["job"], answer["slots"], answer["notice_s"]) == (ppo_job, 2, 7.5)
    with pytest.raises(client.ApiError) as info:
        api.job_pool(ppo_job, slots=9)
    assert info.value.status == 400 and list(info.value.fields) == ["slots"]
    assert info.value.exit_code == client.EXIT_USAGE
    assert [e["id"] for e in _resizes(service, ppo_job)] == [answer["event"]]
