"""``nereus submit|status|watch|logs|cancel|approve|reject|download`` against a real web server (a
Daphne process on loopback with its own SQLite database), each command run as a subprocess with a
project token, checking what it prints and the exit code a pipeline branches on."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from nereus import client
from nereus.client_cli import EventPrinter, shown
from nereus.processes import free_port
from tests.support import live, plans

NEREUS = str(Path(sys.executable).with_name("nereus"))
PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY")

CREDENTIALS = """
import json
from django.contrib.auth import get_user_model
from webapp.projects import services
alice = get_user_model().objects.create_user(username="alice", password="pw-alice-1234")
project = services.project_create(user=alice, name="CI", slug="ci")
_, operator = services.token_create(user=alice, project=project, name="ci", role="operator")
_, viewer = services.token_create(user=alice, project=project, name="read", role="viewer")
old, revoked = services.token_create(user=alice, project=project, name="old")
services.token_revoke(user=alice, project=project, token_id=old.pk)
print(json.dumps({"operator": operator, "viewer": viewer, "revoked": revoked}))
"""


@dataclasses.dataclass(frozen=True)
class Service:
    url: str
    env: dict[str, str]
    tokens: dict[str, str]

    def cli_env(self, token: str | None = "operator", **overrides: str) -> dict[str, str]:
        env = {**self.env, "NEREUS_URL": self.url, **overrides}
        if token is None:
            env.pop("NEREUS_TOKEN", None)
        else:
            env["NEREUS_TOKEN"] = self.tokens[token]
        return env

    def cancel(self, job_id: int) -> dict:
        request = urllib.request.Request(
            f"{self.url}/api/v1/jobs/{job_id}/cancel/",
            method="POST",
            headers={"Authorization": f"Bearer {self.tokens['operator']}"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())


@contextlib.contextmanager
def _service(var_dir: Path) -> Iterator[Service]:
    """A migrated service with a project 'ci' and tokens, served by Daphne on loopback."""
    env = live.service_env(var_dir, **dict.fromkeys(PROXY_VARIABLES))
    env.pop("NEREUS_TOKEN", None)
    env.pop("NEREUS_URL", None)
    live.manage(env, "migrate", "--no-input")
    tokens = live.django_shell(env, CREDENTIALS)
    with live.web_server(env, var_dir / "logs") as url:
        yield Service(url=url, env=env, tokens=tokens)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """One service for the tests that need no worker: their jobs stay pending until cancelled."""
    with _service(tmp_path_factory.mktemp("client-service")) as running:
        yield running


@pytest.fixture
def spec_file(tmp_path) -> Path:
    path = tmp_path / "tiny-sft.json"
    path.write_text(json.dumps({"num_slots": 1, "num_steps": 3}))
    return path


def _run(args, env, timeout=60):
    return subprocess.run(
        [NEREUS, *args], env=env, cwd=live.REPO, capture_output=True, text=True, timeout=timeout
    )


def _popen(args, env):
    return subprocess.Popen(
        [NEREUS, *args],
        env=env,
        cwd=live.REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _read_until(proc, needle: str) -> list[str]:
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"exited ({proc.wait()}) before {needle!r}:\n{''.join(lines)}")


def _no_traceback(done) -> None:
    assert "Traceback" not in done.stderr, done.stderr


def test_submit_prints_the_id_and_a_resubmit_with_the_same_key_returns_it(service, spec_file):
    env = service.cli_env()
    args = ["submit", "--spec", str(spec_file), "--idempotency-key", "pipeline-41"]
    first = _run(args, env)
    assert first.returncode == 0, first.stderr
    job_id = int(first.stdout.strip())
    again = _run([*args, "--json"], env)
    assert again.returncode == 0, again.stderr
    job = json.loads(again.stdout)
    assert job["id"] == job_id and job["name"] == "tiny-sft" and job["project"] == "ci"
    assert "already made job" in again.stderr

    spec_file.write_text(json.dumps({"num_slots": 1, "num_steps": 4}))
    conflict = _run(args, env)
    assert conflict.returncode == client.EXIT_CONFLICT, conflict.stderr
    assert "HTTP 409" in conflict.stderr
    _no_traceback(conflict)


def test_download_fetches_the_trained_model_and_checks_every_file(service, spec_file, tmp_path):
    """The export a job's end writes (``runtime.ppo.export``, put in the job's directory here),
    fetched with a viewer's token into a new folder that transformers loads."""
    import torch
    import transformers

    from runtime.planner import default_catalog
    from runtime.ppo.export import write_hf_folder
    from runtime.ppo.model import build_model

    submitted = _run(["submit", "--spec", str(spec_file)], service.cli_env())
    job_id = int(submitted.stdout.strip())
    config = default_catalog().model("tiny-sft")
    model = build_model(config, scalar_head=False, seed=5)
    folder = write_hf_folder(
        Path(service.env["NEREUS_VAR_DIR"]) / "jobs" / str(job_id) / "export" / "actor",
        config,
        model.state_dict(),
        dtype="float32",
        source={"role": "actor", "step": 3},
    )
    env = service.cli_env("viewer")
    out = tmp_path / "model"
    done = _run(["download", str(job_id), "--out", str(out)], env)
    assert done.returncode == 0, done.stderr
    assert "weights after step 3" in done.stdout and done.stdout.count("sha256 ok") == 2
    for name in ("config.json", "model.safetensors"):
        assert (out / name).read_bytes() == (folder / name).read_bytes()
    tokens = torch.arange(4, 20).view(2, 8)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, model(tokens), rtol=1e-5, atol=1e-5)

    # A folder that holds something is never written into.
    again = _run(["download", str(job_id), "--out", str(out)], env)
    assert again.returncode == client.EXIT_USAGE and "--out:" in again.stderr
    # No such artifact: 4, naming it and what the job has.
    missing = _run(
        ["download", str(job_id), "--artifact", "critic", "--out", str(tmp_path / "c")], env
    )
    assert missing.returncode == client.EXIT_NOT_FOUND
    assert "artifact: job" in missing.stderr and "(it has: actor)" in missing.stderr
    # Bytes that are not the manifest's (same size, flipped on disk) are not kept.
    raw = bytearray((folder / "model.safetensors").read_bytes())
    raw[-1] ^= 0xFF
    (folder / "model.safetensors").write_bytes(bytes(raw))
    corrupt = _run(["download", str(job_id), "--out", str(tmp_path / "bad")], env)
    assert corrupt.returncode == client.EXIT_UNREACHABLE, corrupt.stderr
    assert "nothing was kept" in corrupt.stderr
    assert not (tmp_path / "bad").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    for done in (again, missing, corrupt):
        _no_traceback(done)


def test_status_prints_the_job_and_json_for_scripts(service, spec_file):
    env = service.cli_env()
    job_id = int(_run(["submit", "--spec", str(spec_file), "--name", "nightly"], env).stdout)
    done = _run(["status", str(job_id)], env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"job {job_id}  nightly\n")
    assert "  state     pending" in done.stdout and "  steps     3" in done.stdout
    job = json.loads(_run(["status", str(job_id), "--json"], env).stdout)
    assert job["id"] == job_id and job["spec"]["num_steps"] == 3 and job["owner"] == "alice"


def test_watch_follows_until_the_job_is_cancelled_and_exits_1(service, spec_file):
    env = service.cli_env()
    job_id = int(_run(["submit", "--spec", str(spec_file)], env).stdout)
    proc = _popen(["watch", str(job_id), "--interval", "0.2"], env)
    try:
        head = _read_until(proc, "job.submitted")
        assert head[0] == f"job {job_id} (ci): pending\n"
        service.cancel(job_id)
        rest, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == client.EXIT_JOB_FAILED, err
    lines = rest.splitlines()
    assert any("job.state" in line and line.endswith(" state=cancelled") for line in lines), rest
    assert lines[-1] == f"job {job_id} cancelled"


def test_cancel_prints_the_new_state_and_a_job_that_ended_is_a_conflict(service, spec_file):
    env = service.cli_env()
    job_id = int(_run(["submit", "--spec", str(spec_file)], env).stdout)
    # A viewer may read the job, not stop it.
    done = _run(["cancel", str(job_id)], service.cli_env("viewer"))
    assert done.returncode == client.EXIT_AUTH and "nereus cancel: HTTP 403" in done.stderr
    _no_traceback(done)
    done = _run(["cancel", str(job_id)], env)
    assert done.returncode == client.EXIT_OK, done.stderr
    assert done.stdout == f"job {job_id}: cancelled\n"
    assert json.loads(_run(["status", str(job_id), "--json"], env).stdout)["state"] == "cancelled"
    again = _run(["cancel", str(job_id), "--json"], env)
    assert again.returncode == client.EXIT_CONFLICT
    assert "nereus cancel: HTTP 409" in again.stderr and "cancelled" in again.stderr
    assert json.loads(again.stdout)["error"]["status"] == 409
    _no_traceback(again)
    pending = int(_run(["submit", "--spec", str(spec_file)], env).stdout)
    as_json = _run(["cancel", str(pending), "--json"], env)
    assert as_json.returncode == client.EXIT_OK, as_json.stderr
    assert json.loads(as_json.stdout)["id"] == pending
    assert json.loads(as_json.stdout)["state"] == "cancelled"


def test_logs_prints_the_events_once_and_pages_with_since_and_limit(service, spec_file):
    env = service.cli_env()
    job_id = int(_run(["submit", "--spec", str(spec_file)], env).stdout)
    service.cancel(job_id)
    done = _run(["logs", str(job_id)], env, timeout=30)  # prints and exits: the job's log so far
    assert done.returncode == client.EXIT_OK and done.stderr == "", done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) >= 2 and "job.submitted" in lines[0]
    assert "job.state" in lines[-1] and lines[-1].endswith(" state=cancelled")
    ids = [int(line.split()[0]) for line in lines]
    assert ids == sorted(ids)

    first = _run(["logs", str(job_id), "--limit", "1"], env)
    assert first.returncode == client.EXIT_OK and first.stdout.splitlines() == lines[:1]
    assert f"more follow (--since {ids[0]} for the next ones)" in first.stderr
    rest = _run(["logs", str(job_id), "--since", str(ids[0])], env)
    assert rest.returncode == client.EXIT_OK and rest.stdout.splitlines() == lines[1:]
    everything = _run(["logs", str(job_id), "--limit", str(len(lines))], env)
    assert everything.stdout.splitlines() == lines and everything.stderr == ""
    none = _run(["logs", str(job_id), "--since", str(ids[-1])], env)
    assert none.returncode == client.EXIT_OK and none.stdout == "" and none.stderr == ""

    records = [
        json.loads(r) for r in _run(["logs", str(job_id), "--json"], env).stdout.splitlines()
    ]
    assert [r["event"]["id"] for r in records] == ids
    assert records[-1]["event"]["data"]["state"] == "cancelled"
    # An id past the largest there can be is refused by the command, naming its flag (found by
    # audit: it named the API's field, "after").
    bad = _run(["logs", str(job_id), "--since", str(2**63)], env)
    assert bad.returncode == client.EXIT_USAGE and "--since" in bad.stderr, bad.stderr
    _no_traceback(bad)


def test_submit_wait_json_streams_events_and_ends_with_the_final_job(service, spec_file):
    env = service.cli_env()
    proc = _popen(
        ["submit", "--spec", str(spec_file), "--wait", "--json", "--interval", "0.2"], env
    )
    try:
        first = json.loads(proc.stdout.readline())
        job_id = first["job"]["id"]
        _read_until(proc, "job.submitted")
        service.cancel(job_id)
        rest, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == client.EXIT_JOB_FAILED, err
    records = [json.loads(line) for line in rest.splitlines()]
    assert records[-1]["job"]["state"] == "cancelled"
    kinds = [r["event"]["kind"] for r in records[:-1]]
    assert kinds and set(kinds) <= {"job.state"} and kinds[-1] == "job.state"


def test_a_bad_spec_field_is_named_and_exits_2(service, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"num_slots": 0}))
    done = _run(["submit", "--spec", str(bad)], service.cli_env())
    assert done.returncode == client.EXIT_USAGE
    assert "HTTP 400" in done.stderr and "spec.num_slots: expected 1 <= num_slots <= 64" in (
        done.stderr
    )
    _no_traceback(done)
    as_json = _run(["submit", "--spec", str(bad), "--json"], service.cli_env())
    assert "spec.num_slots" in json.loads(as_json.stdout)["error"]["fields"]

    for text, message in (
        ("{not json", "not valid JSON"),
        ('{"lr": NaN}', "NaN is not a JSON number"),  # the service would refuse it unnamed
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),  # was a RecursionError traceback
    ):
        bad.write_text(text)
        done = _run(["submit", "--spec", str(bad)], service.cli_env())
        assert done.returncode == client.EXIT_USAGE and "--spec: " in done.stderr, done.stderr
        assert message in done.stderr
        _no_traceback(done)


@pytest.mark.parametrize(
    "url",
    [
        "http://[::1",
        "http://127.0.0.1:99999",
        "ftp://example.org",
        "http://",
        "http://exa mple.com",
        "http://a..b",  # the IDNA codec refuses an empty label and one over 63 characters
        "http://" + "a" * 64 + ".example",
    ],
)
def test_a_malformed_service_url_names_the_variable(url):
    with pytest.raises(client.ApiError) as info:
        client.ClientConfig.resolve(url=url, token="nrs_x")
    assert info.value.exit_code == client.EXIT_USAGE
    assert "NEREUS_URL (or --url)" in str(info.value)


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("http://a..b", "'a..b' is not a valid host name"),
        ("http://" + "a" * 64 + ".example", "is not a valid host name"),
        ("http://127.0.0.1:9/\u00fc", "cannot send a request to"),  # a path urllib cannot send
    ],
)
def test_a_url_urllib_cannot_encode_exits_2_naming_the_variable(url, said):
    """Found by review: UnicodeError (the IDNA codec's, or ASCII's for the request line) escaped
    as a traceback with exit 1, which says the job failed."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("NEREUS_") and k not in PROXY_VARIABLES
    }
    done = _run(["status", "1"], {**env, "NEREUS_URL": url, "NEREUS_TOKEN": "nrs_x"})
    assert done.returncode == client.EXIT_USAGE, done.stderr
    assert done.stderr.startswith("nereus status: NEREUS_URL (or --url): ") and said in done.stderr
    _no_traceback(done)


def test_a_revoked_token_exits_3_and_so_does_a_role_too_low(service, spec_file):
    done = _run(["status", "1"], service.cli_env(token="revoked"))
    assert done.returncode == client.EXIT_AUTH and "HTTP 401" in done.stderr
    _no_traceback(done)
    done = _run(["submit", "--spec", str(spec_file)], service.cli_env(token="viewer"))
    assert done.returncode == client.EXIT_AUTH and "HTTP 403" in done.stderr
    _no_traceback(done)


def test_an_unknown_job_or_proposal_exits_4(service):
    for args in (
        ["status", "987654"],
        ["watch", "987654"],
        ["logs", "987654"],
        ["cancel", "987654"],
        ["approve", "987654", "--comment", "fine"],  # 404 with or without the endpoint
    ):
        done = _run(args, service.cli_env())
        assert done.returncode == client.EXIT_NOT_FOUND, done.stderr
        assert "HTTP 404" in done.stderr
        _no_traceback(done)


def test_a_missing_token_names_the_variable_and_exits_2(service, spec_file):
    for args in (
        ["status", "1"],
        ["submit", "--spec", str(spec_file)],
        ["watch", "1"],
        ["logs", "1"],
        ["cancel", "1"],
    ):
        done = _run(args, service.cli_env(token=None))
        assert done.returncode == client.EXIT_USAGE
        assert "NEREUS_TOKEN" in done.stderr
        _no_traceback(done)


def test_an_unreachable_service_exits_6_with_the_url(service, spec_file):
    url = f"http://127.0.0.1:{free_port()}"
    env = service.cli_env(NEREUS_URL=url)
    for args in (
        ["status", "1"],
        ["watch", "1"],
        ["logs", "1"],
        ["cancel", "1"],
        ["submit", "--spec", str(spec_file)],
        ["approve", "1", "--comment", "looks right"],
        ["reject", "1", "--comment", "too risky"],
        ["override", "1", "--plan", str(spec_file), "--reason", "more slots"],
    ):
        done = _run(args, env)
        assert done.returncode == client.EXIT_UNREACHABLE, (args, done.stderr)
        assert url in done.stderr
        _no_traceback(done)


def test_approve_and_reject_refuse_a_missing_comment_before_any_request(service, spec_file):
    # An unreachable URL: the refusal must come from the client, not the server.
    env = service.cli_env(NEREUS_URL=f"http://127.0.0.1:{free_port()}")
    for args, field in (
        (["approve", "7"], "comment"),
        (["reject", "7", "--comment", "  "], "comment"),
        (["override", "7", "--plan", str(spec_file)], "reason"),
    ):
        done = _run(args, env)
        assert done.returncode == client.EXIT_USAGE
        assert f"nereus {args[0]}: {field}: required" in done.stderr
        _no_traceback(done)


def test_on_a_terminal_steps_draw_a_progress_bar_and_otherwise_plain_lines():
    events = [
        {"id": 1, "kind": "job.state", "at": "2026-01-01T10:00:00+00:00", "data": {}},
        {"id": 2, "kind": "step.finished", "at": "2026-01-01T10:00:01+00:00", "data": {"step": 0}},
        {"id": 3, "kind": "step.finished", "at": "2026-01-01T10:00:02+00:00", "data": {"step": 1}},
    ]
    tty, plain = io.StringIO(), io.StringIO()
    for out, is_tty in ((tty, True), (plain, False)):
        printer = EventPrinter(total_steps=4, as_json=False, tty=is_tty, out=out)
        for event in events:
            printer.event(event)
        printer.close()
    assert "\r" in tty.getvalue() and tty.getvalue().endswith("step 2/4\n")
    printer = EventPrinter(total_steps=2, as_json=False, tty=True, out=(done := io.StringIO()))
    for event in events:
        printer.event(event)
    printer.event({**events[0], "id": 4})
    assert done.getvalue().endswith("step 2/2\n     4 10:00:00 job.state\n")
    assert "[" + "#" * 15 + "." * 15 + "]" in tty.getvalue()
    assert "\r" not in plain.getvalue() and "\x1b" not in plain.getvalue()
    assert [line.split()[2] for line in plain.getvalue().splitlines()] == [
        "job.state",
        "step.finished",
        "step.finished",
    ]
    assert "[2/4] step=1" in plain.getvalue()


@pytest.mark.ray
def test_submit_wait_follows_a_real_job_to_success_and_exits_0(tmp_path, spec_file):
    """A Celery worker runs the job on a local Ray instance; the client prints every step."""
    with _service(tmp_path / "var") as running, live.celery_worker(running.env, tmp_path / "w"):
        env = running.cli_env()
        args = ["submit", "--spec", str(spec_file), "--wait", "--interval", "0.2"]
        done = _run(args, env, timeout=240)
        assert done.returncode == client.EXIT_OK, done.stdout + done.stderr
        lines = done.stdout.splitlines()
        job_id = int(lines[0])
        assert [line.split()[3] for line in lines if "step.finished" in line] == [
            "[1/3]",
            "[2/3]",
            "[3/3]",
        ]
        assert lines[-1] == f"job {job_id} succeeded"
        # Watching a finished job replays its log and exits at once.
        again = _run(["watch", str(job_id), "--json"], env)
    assert again.returncode == client.EXIT_OK, again.stderr
    records = [json.loads(line) for line in again.stdout.splitlines()]
    assert records[-1]["job"]["state"] == "succeeded"
    assert [r["event"]["kind"] for r in records[:-1]].count("step.finished") == 3


def test_download_writes_nothing_for_file_names_that_are_paths(tmp_path, monkeypatch, capsys):
    """A service (broken, or an impostor on plain http) listing '/tmp/x' or '../x' as a file of
    an artifact must not make the client write there."""
    import http.server
    import threading

    from nereus.client_cli import download

    victim = tmp_path / "victim.txt"
    body = json.dumps(
        {
            "results": [
                {
                    "name": "actor",
                    "files": [
                        {"name": str(victim), "bytes": 1, "sha256": "0" * 64},
                        {"name": "../escape", "bytes": 1, "sha256": "0" * 64},
                    ],
                }
            ]
        }
    ).encode()

    class Impostor(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Impostor)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    for variable in PROXY_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    try:
        monkeypatch.chdir(tmp_path)
        code = download(
            job_id=1,
            artifact="actor",
            out=None,
            as_json=False,
            url=f"http://127.0.0.1:{server.server_address[1]}",
            token="t",
        )
    finally:
        server.shutdown()
    assert code == client.EXIT_UNREACHABLE
    assert "not plain names" in capsys.readouterr().err
    assert not victim.exists() and not (tmp_path / "job-1-actor").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_event_line_shows_a_plan_by_its_size_and_cuts_long_values():
    """Found by review: a decision's two plans made one line of some 10 kB in a CI log."""
    plan = plans.plan_json(8)
    event = {
        "id": 7,
        "kind": "control.decision",
        "at": "2026-01-01T10:00:00+00:00",
        "data": {"candidate": plan, "reason": "r" * 500, "admit": True},
    }
    printer = EventPrinter(total_steps=None, as_json=False, tty=False, out=(out := io.StringIO()))
    printer.event(event)
    line = out.getvalue()
    assert line.count("\n") == 1 and len(line) < 400, line
    assert f"candidate=<plan: 8 slots, {len(plan['model_stages'])} model-stages, predicted" in line
    assert "(500 chars; --json for all)" in line and "admit=True" in line
    printer = EventPrinter(total_steps=None, as_json=True, tty=False, out=(whole := io.StringIO()))
    printer.event(event)
    assert json.loads(whole.getvalue())["event"]["data"]["candidate"] == plan


def test_what_anyone_typed_is_printed_without_its_control_characters():
    """Found by audit: a job named "ok\x1b]0;pwned\x07\r\nfake line" retitled the terminal of
    whoever ran `nereus status` or `logs` on it, and put a fake line in a CI log."""
    hostile = "ok\x1b]0;pwned\x07\r\nfake line\x9b2J"
    event = {
        "id": 9,
        "kind": "job.override",
        "at": "2026-01-01T10:00:00+00:00",
        "data": {"reason": hostile, hostile: 1},
    }
    printer = EventPrinter(total_steps=None, as_json=False, tty=False, out=(out := io.StringIO()))
    printer.event(event)
    printer.final({"id": 9, "state": "failed", "failure_reason": "x", "failure_detail": hostile})
    text = out.getvalue()
    assert text.count("\n") == 2  # two lines: the event, the job
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", text)
    assert r"ok\x1b]0;pwned\x07\x0d\x0afake line\x9b2J" in text  # what was sent, readable
    assert shown({"a\nb": ["\t", 3]}) == {r"a\x0ab": ["\t", 3]}  # tabs kept, numbers untouched
    assert shown("abc\u202edef\u2028") == r"abc\u202edef\u2028"  # reordering, line breaking
    printer = EventPrinter(total_steps=None, as_json=False, tty=False, out=(out := io.StringIO()))
    printer.event({**event, "data": {"nested": {"k": "\x1b"}}})  # JSON escapes it, once
    assert r'nested={"k": "\u001b"}' in out.getvalue()
    printer = EventPrinter(total_steps=None, as_json=True, tty=False, out=(whole := io.StringIO()))
    printer.event(event)  # --json: the words as they were, escaped by JSON
    assert json.loads(whole.getvalue())["event"]["data"]["reason"] == hostile
