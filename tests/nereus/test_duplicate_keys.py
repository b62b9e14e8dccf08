"""Found by audit: the CLI's JSON inputs read a key given twice "last one wins": a
``--policy-file`` of ``{"gamma": 1, "gamma": 2}`` ran with gamma 2, a trace line giving
``gen_len`` twice ran with the second. Each is refused, exit 2, naming the key (and the line)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nereus import client
from nereus.client import loads_strict
from tests.support import live

NEREUS = str(Path(sys.executable).with_name("nereus"))
HEADER = '{"trace": "t", "version": 1, "steps": 3, "accelerator": "h100-sxm", "gpus": 8}'


def _run(args, env, timeout=180):
    return subprocess.run(
        [NEREUS, *args], env=env, cwd=live.REPO, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('{"gamma": 1, "gamma": 2}', "gamma"),
        ('{"gamma": 1, "gamma": 1}', "gamma"),  # the same value twice is still a repeat
        ('{"spec": {"policy": {"lr": 1, "lr": 2}}}', "lr"),
        ('[{"a": 1}, {"b": 1, "b": 2}]', "b"),
    ],
)
def test_loads_strict_refuses_a_key_given_twice_naming_it(text, key):
    with pytest.raises(ValueError, match=f"^{key!r} is given twice in one object$"):
        loads_strict(text)


def test_simulate_refuses_a_policy_file_giving_a_key_twice(tmp_path):
    policy = tmp_path / "policy.json"
    policy.write_text('{"gamma": 1, "gamma": 2}')
    done = _run(
        ["simulate", "--trace", "gen:growth", "--steps", "2", "--policy-file", str(policy)],
        live.service_env(tmp_path),
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""  # nothing was simulated
    assert (
        "--policy-file: cannot read a JSON policy ('gamma' is given twice in one object)"
        in done.stderr
    )
    assert "Traceback" not in done.stderr


def test_simulate_refuses_a_trace_line_giving_a_key_twice_naming_the_line(tmp_path):
    trace = tmp_path / "dup.jsonl"
    trace.write_text(f'{HEADER}\n{{"at_step": 0, "gen_len": 500, "gen_len": 600}}\n')
    done = _run(["simulate", "--trace", str(trace)], live.service_env(tmp_path))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    assert f"{trace}:2: field 'gen_len': given twice in one object" in done.stderr
    assert "Traceback" not in done.stderr


def test_submit_refuses_a_spec_giving_a_key_twice_before_any_request(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text('{"num_slots": 1, "num_slots": 64}')
    env = live.service_env(tmp_path, NEREUS_URL="http://127.0.0.1:9", NEREUS_TOKEN="nrs_x")
    done = _run(["submit", "--spec", str(spec)], env)
    # Exit 6 (unreachable) would mean the body was sent: the service reads no further.
    assert done.returncode == client.EXIT_USAGE, done.stdout + done.stderr
    assert "--spec: " in done.stderr
    assert "'num_slots' is given twice in one object" in done.stderr
    assert "Traceback" not in done.stderr
