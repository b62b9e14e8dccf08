"""The ``nereus`` command: version, doctor (each check a clear line, failures with a hint and exit
code 1), and the demo supervisor (serves, and leaves no process behind on Ctrl-C)."""

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import nereus
from nereus import processes
from nereus.processes import free_port
from tests.support import live

NEREUS = str(Path(sys.executable).with_name("nereus"))


def _run(args, env, timeout=180):
    return subprocess.run(
        [NEREUS, *args], env=env, cwd=live.REPO, capture_output=True, text=True, timeout=timeout
    )


def test_version(tmp_path):
    done = _run(["version"], live.service_env(tmp_path))
    assert done.returncode == 0 and done.stdout.strip() == f"nereus {nereus.__version__}"


def test_doctor_on_a_healthy_embedded_install(tmp_path):
    env = live.service_env(tmp_path)
    live.manage(env, "migrate", "--no-input")
    done = _run(["doctor"], env)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = {line.split()[1]: line for line in done.stdout.splitlines() if line[:1] in "✓!✗"}
    assert set(lines) == {
        "python",
        "pytorch",
        "ray",
        "database",
        "redis",
        "workers",
        "kernels",
        "gpus",
    }
    # No worker runs here: said, as a warning with what to start.
    assert lines["workers"].startswith("!") and "no Celery worker answered" in lines["workers"]
    assert lines["database"].startswith("✓") and "migrations applied" in lines["database"]
    assert lines["redis"].startswith("✓") and "embedded" in lines["redis"]
    assert "CPU build" in lines["pytorch"]


def test_doctor_reports_pending_migrations_as_a_warning(tmp_path):
    done = _run(["doctor", "--json"], live.service_env(tmp_path))
    assert done.returncode == 0
    findings = {f["name"]: f for f in json.loads(done.stdout)}
    assert findings["database"]["status"] == "warn"
    assert findings["database"]["hint"] == "python manage.py migrate"


def test_doctor_fails_with_a_hint_when_redis_is_down(tmp_path):
    env = live.service_env(tmp_path, REDIS_URL=f"redis://127.0.0.1:{free_port()}/0")
    done = _run(["doctor"], env)
    assert done.returncode == 1
    redis_line = next(line for line in done.stdout.splitlines() if " redis " in line)
    assert redis_line.startswith("✗")
    assert "hint: check REDIS_URL" in done.stdout
    workers = next(line for line in done.stdout.splitlines() if " workers " in line)
    assert "not asked: the broker is unreachable" in workers  # and no wait for them


def test_doctor_fails_when_the_ray_cluster_is_unreachable(tmp_path):
    env = live.service_env(tmp_path, RAY_ADDRESS=f"127.0.0.1:{free_port()}")
    done = _run(["doctor", "--json"], env)
    assert done.returncode == 1
    ray_finding = next(f for f in json.loads(done.stdout) if f["name"] == "ray")
    assert ray_finding["status"] == "fail" and "ray start --head" in ray_finding["hint"]


def test_doctor_names_a_bad_variable(tmp_path):
    done = _run(["doctor"], live.service_env(tmp_path, DATABASE_URL="mongodb://x/y"))
    assert done.returncode == 1
    assert (
        "✗ configuration" in done.stdout
        and "DATABASE_URL: unsupported scheme 'mongodb'" in done.stdout
    )


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, stack = set(), [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add(child)
            stack.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_demo_names_a_host_it_cannot_serve_on(tmp_path):
    """Found by audit: a host that does not resolve was a socket.gaierror traceback. ("a..b" is
    refused by the name's encoding, before any lookup leaves the machine.)"""
    done = _run(["demo", "--host", "a..b", "--port", "45999"], live.service_env(tmp_path))
    assert done.returncode == 2, done.stderr
    assert "--host: cannot serve on 'a..b'" in done.stderr and "Traceback" not in done.stderr


def test_something_listening_on_ipv6_loopback_is_seen():
    """Found by audit: the check for a taken port spoke IPv4 only, and `--host ::1` failed."""
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as listener:
        try:
            listener.bind(("::1", 0))
        except OSError:  # a host without IPv6 loopback: nothing to check there
            pytest.skip("this host has no IPv6 loopback")
        listener.listen()
        port = listener.getsockname()[1]
        assert processes.port_in_use(port, "::1") and processes.port_in_use(port, "[::1]")
    assert not processes.port_in_use(port, "::1")


@pytest.mark.ray
def test_demo_serves_and_ctrl_c_leaves_no_process_behind(tmp_path):
    port = free_port()
    # A fresh machine's: no ~/.ray/auth_token, which Ray makes only when something asks it to
    # (the demo's token-authenticated head then refused to start).
    env = live.service_env(
        tmp_path, HOME=str(tmp_path / "home"), RAY_AUTH_TOKEN=None, RAY_AUTH_TOKEN_PATH=None
    )
    proc = subprocess.Popen(
        [NEREUS, "demo", "--port", str(port), "--steps", "5", "--slots", "1"],
        env=env,
        cwd=live.REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline, output = time.monotonic() + 240, []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "demo exited early:\n" + "".join(output)
            output.append(line)
            if "Ctrl-C stops everything" in line:
                break
        text = "".join(output)
        assert f"Nereus is running at http://127.0.0.1:{port}/" in text
        assert "sign in as 'demo' with password" in text
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/login/", timeout=30) as page:
            assert page.status == 200 and b"Sign in" in page.read()
        spawned = _descendants(proc.pid)
        assert len(spawned) >= 3  # Ray head (and its daemons), Celery worker, web server
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, rest
    assert re.search(r"stopped in [0-9.]+ s: no process left behind", rest)
    assert [pid for pid in spawned if _alive(pid)] == []


def test_plan_prints_a_plan_and_json_for_scripts(tmp_path):
    env = live.service_env(tmp_path)
    args = ["plan", "--model", "llama-3.1-8b", "--gpus", "64", "--gpu", "h100", "--gen-len", "4096"]
    done = _run(args, env)
    assert done.returncode == 2 and "gpu: unknown accelerator 'h100'; choose one of" in done.stderr
    args[args.index("h100")] = "h100-sxm"
    done = _run(args, env)
    assert done.returncode == 0, done.stderr
    assert "actor@training" in done.stdout and "predicted step:" in done.stdout
    data = json.loads(_run([*args, "--json"], env).stdout)
    stages = {ms["name"] for ms in data["plan"]["model_stages"]}
    assert stages == {
        "actor@generation",
        "actor@inference",
        "ref@inference",
        "critic@inference",
        "reward@inference",
        "actor@training",
        "critic@training",
    }
    assert data["plan"]["num_slots"] == 64 and data["rejected"]


def test_plan_without_a_feasible_layout_names_the_constraint(tmp_path):
    done = _run(["plan", "--model", "llama-3.1-70b", "--gpus", "8"], live.service_env(tmp_path))
    assert done.returncode == 2
    assert "nereus plan: memory: " in done.stderr and "GiB over the" in done.stderr
    done = _run(["plan", "--gpus", str(10**20)], live.service_env(tmp_path))
    assert done.returncode == 2 and "gpus: at most 65536 slots" in done.stderr, done.stderr


def test_plan_names_a_catalog_number_no_float_holds(tmp_path):
    """Found by review: a RoPE scaling factor of 401 digits raised OverflowError, a traceback
    with exit 1."""
    scaling = {
        "rope_type": "llama3",
        "factor": 10**400,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    model = {
        "vocab_size": 64,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 4,
        "rope_scaling": scaling,
    }
    catalog = tmp_path / "catalog.json"
    catalog.write_text(json.dumps({"models": {"m": model}}))
    done = _run(
        ["plan", "--catalog", str(catalog), "--model", "m", "--gpus", "2"],
        live.service_env(tmp_path),
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("nereus plan: models.m.rope_scaling.factor: too large for a")
    assert "Traceback" not in done.stderr


def test_simulate_prints_simulated_figures_and_names_bad_input(tmp_path):
    env = live.service_env(tmp_path)
    done = _run(
        ["simulate", "--trace", "gen:growth", "--gpus", "16", "--steps", "20", "--json"], env
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["simulated"] is True and data["steps"] == 20 and data["mean_step_s"] > 0
    assert 0 <= data["built_ahead"] <= data["transitions"]
    assert 0 <= data["joined"] <= data["transitions"]
    looked_back = data["hindsight"]  # every transition has its reason, labelled simulated
    assert looked_back["simulated"] is True
    assert sum(looked_back["transitions"].values()) == data["transitions"]
    assert len(looked_back["moves"]) == data["transitions"]
    events = tmp_path / "events.jsonl"
    short = ["simulate", "--trace", "gen:growth", "--gpus", "16", "--steps", "5"]
    text = _run([*short, "--events", str(events)], env)
    assert text.stdout.startswith("SIMULATED:")
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    assert {e["event"] for e in lines} >= {"control.plan", "step"}
    assert all(e["simulated"] is True for e in lines)  # the plans and decisions too
    trace = tmp_path / "bad.jsonl"
    trace.write_text(
        '{"trace": "t", "version": 1, "steps": 5, "accelerator": "h100-sxm", "gpus": 8}\n'
        '{"at_step": 0, "gen_len": "long"}\n'
    )
    done = _run(["simulate", "--trace", str(trace)], env)
    assert done.returncode == 2 and f"{trace}:2: field 'gen_len'" in done.stderr
    trace.write_bytes(b'{"trace": "caf\xe9"}\n')
    done = _run(["simulate", "--trace", str(trace)], env)
    assert done.returncode == 2 and f"{trace}:1: not UTF-8 text" in done.stderr
    done = _run(["simulate", "--trace", "gen:step", "--steps", "3", "--gpu", "H100-SXM"], env)
    assert done.returncode == 2 and "--steps: a step trace needs at least 4 steps" in done.stderr
    done = _run(["simulate", "--trace", "gen:growth", "--policy", "greedy"], env)
    assert done.returncode == 2 and "--policy: unknown 'greedy'" in done.stderr
    policy = tmp_path / "policy.json"
    policy.write_text('{"gamma": 7000}')
    done = _run(["simulate", "--trace", "gen:growth", "--policy-file", str(policy)], env)
    assert done.returncode == 2 and "policy.gamma: must be a number in (0, 100]" in done.stderr
    policy.write_text("[1, 2]")
    done = _run(["simulate", "--trace", "gen:growth", "--policy-file", str(policy)], env)
    assert done.returncode == 2 and "--policy-file: expected a JSON object" in done.stderr
    # Refused before simulating: the events file had nowhere to go only after the whole run.
    events = tmp_path / "missing" / "events.jsonl"
    done = _run(["simulate", "--trace", "gen:growth", "--events", str(events)], env)
    assert done.returncode == 2 and "--events: no folder to write" in done.stderr
    # Found by audit: a folder given as the events file was found out only after the run.
    done = _run(["simulate", "--trace", "gen:growth", "--events", str(tmp_path)], env)
    assert done.returncode == 2 and "--events: " in done.stderr and "is a folder" in done.stderr
    assert done.stdout == ""  # nothing was simulated
    policy.write_bytes(b'{"gamma": "\xff"}')
    done = _run(["simulate", "--trace", "gen:growth", "--policy-file", str(policy)], env)
    assert done.returncode == 2 and "--policy-file: cannot read a JSON policy" in done.stderr
    # An accelerator is named in any case, for a generated trace as for the catalog.
    done = _run(
        ["simulate", "--trace", "gen:step", "--steps", "6", "--gpu", "H100-SXM", "--json"], env
    )
    assert done.returncode == 0, done.stderr


_TRACE_HEADER = '{"trace": "t", "version": 1, "steps": 5, "accelerator": "h100-sxm", "gpus": %d}'
_POINT = '{"at_step": 0, "gen_len": 500}'


def test_simulate_counterfactual_replays_the_run_without_its_moves_for_a_saving(tmp_path):
    env = live.service_env(tmp_path)
    args = ["simulate", "--trace", "gen:oscillate", "--gpus", "16", "--steps", "12"]
    args += ["--seed", "9", "--policy", "dynarl", "--counterfactual"]
    done = _run([*args, "--json"], env, timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    replayed = data["counterfactual"]
    assert replayed["simulated"] is True
    whole = replayed["without_saving_moves"]
    assert whole["run_s"] == data["seconds"] and whole["refused"] >= 1
    assert whole["without_s"] != whole["run_s"]  # refusing moves changed the run
    relaid = [m for m in data["hindsight"]["moves"] if m["why"] == "saving" and m["moved"]]
    assert len(relaid) >= 1  # the replays below are of real moves
    assert [m["step"] for m in replayed["moves"]] == [m["step"] for m in relaid]
    assert replayed["paid"] == sum(m["net_s"] > 0 for m in replayed["moves"])
    text = _run(args, env, timeout=300)
    assert text.returncode == 0, text.stderr
    assert "counterfactual     without its moves made for their saving" in text.stdout
    assert f"each refused alone: {replayed['paid']} of {len(relaid)} paid" in text.stdout


@pytest.mark.parametrize(
    ("lines", "args", "message"),
    [
        # Each once ended in a traceback and exit code 1.
        (
            [_TRACE_HEADER % 16, _POINT, "[" * 200_000],
            [],
            "{trace}:3: not JSON (nested too deeply)",
        ),
        (
            [_TRACE_HEADER % 16, '{"at_step": 1' + "0" * 5000 + ', "gen_len": 500}'],
            [],
            "{trace}:2: field 'at_step': must be an integer from 0 to 1,000,000, got an integer "
            "of 5001 digits",
        ),
        (
            [_TRACE_HEADER % 16, '{"at_step": 0, "gen_len": 1e300}'],
            [],
            "{trace}:2: field 'gen_len': must be a finite number from 1 to 10,000,000",
        ),
        (
            [_TRACE_HEADER % 16, _POINT, '{"at_s": 1, "gpus": 100000000}'],
            [],
            "{trace}:3: field 'gpus': must be an integer from 1 to 4,096, got 100000000",
        ),
        (
            [_TRACE_HEADER % 1, _POINT, '{"at_s": 1, "fail_slot": 0}'],
            ["--model", "tiny-llama"],
            "{trace}:3: field 'fail_slot': slot 0 failing at 1 s leaves no slot to run on",
        ),
        (  # the file leaves a slot; --gpus 1 in place of its 16 would not
            [_TRACE_HEADER % 16, _POINT, '{"at_s": 1, "fail_slot": 0}'],
            ["--model", "tiny-llama", "--gpus", "1"],
            "--gpus 1: {trace}:3: field 'fail_slot': slot 0 failing at 1 s leaves no slot",
        ),
        (None, ["--steps", "5", "--gpus", "4097"], "--gpus: must be from 1 to 4096"),
        (None, ["--steps", "5", "--seed", "-1"], "--seed: must be from 0 to 2147483647, got -1"),
        (None, ["--steps", "5", "--events", ""], "--events: empty; give a file name"),
        (
            None,
            ["--steps", "5", "--policy", "dynarl", "--policy-file", "{policy}"],
            "--policy-file: admission is 'always_faster' under --policy dynarl",
        ),
        (None, ["--steps", "2000000"], "--steps: must be from 1 to 1000000, got 2000000"),
    ],
)
def test_simulate_refuses_what_crashed_it_in_one_line_with_exit_code_2(
    tmp_path, lines, args, message
):
    trace = tmp_path / "trace.jsonl"
    if lines is not None:
        trace.write_text("\n".join(lines) + "\n")
    spec = str(trace) if lines is not None else "gen:growth"
    policy = tmp_path / "policy.json"
    policy.write_text('{"admission": "payback"}')  # a file that --policy dynarl contradicts
    args = [arg.format(policy=policy) for arg in args]
    done = _run(["simulate", "--trace", spec, *args], live.service_env(tmp_path), timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and done.stdout == ""
    assert done.stderr.startswith("nereus simulate: " + message.format(trace=trace)), done.stderr


def test_the_events_check_opens_nothing(tmp_path):
    """Found by review: the up-front check of --events opened the file and closed it again,
    which for a named pipe ended its reader's input before the run wrote anything (the run then
    waited for a reader forever)."""
    import os
    import threading

    from nereus.simulate_cli import SimulateError, _check_writable

    fifo = tmp_path / "events.fifo"
    os.mkfifo(fifo)
    checked = threading.Thread(target=_check_writable, args=("--events", fifo), daemon=True)
    checked.start()
    checked.join(10)  # opening a pipe with no reader for writing would block here
    assert not checked.is_alive()
    dangling = tmp_path / "link.jsonl"
    dangling.symlink_to(tmp_path / "missing-target.jsonl")
    _check_writable("--events", dangling)  # fine: written at the end, through the link
    assert dangling.is_symlink() and not (tmp_path / "missing-target.jsonl").exists()
    with pytest.raises(SimulateError, match="is a folder"):
        _check_writable("--events", tmp_path)
