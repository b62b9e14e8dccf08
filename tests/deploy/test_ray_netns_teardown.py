"""The namespaced Ray cluster's teardown (``tests/support/ray_netns.py``) stops the processes it
started and nothing else. It ran ``ray stop --force`` in each node's namespace, which finds Ray's
processes by name on the whole machine, network namespace or not, and took down an unrelated Ray
cluster on the same machine (found by review).

Here processes named as Ray's are (a ``raylet``, a ``default_worker.py``, both names ``ray stop``
looks for) run beside the cluster, in the machine's namespaces and in a node's own network
namespace; they outlive the teardown, and nothing the teardown was given is left: no process of
a node's PID namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support import ray_netns
from tests.support.services import require


@pytest.fixture
def netns_capable() -> None:
    require(
        os.geteuid() == 0 and bool(shutil.which("ip")) and bool(shutil.which("unshare")),
        "network namespaces need root, iproute2 and unshare",
    )


def _bystanders(tmp_path: Path, namespace: str | None = None) -> list[subprocess.Popen]:
    """Processes ``ray stop`` takes for Ray's: one whose name is ``raylet`` (it matches the
    process name), one with ``default_worker.py`` in its command line; in ``namespace``'s
    network namespace when given. Each in a session of its own, as an unrelated cluster's."""
    raylet = tmp_path / "raylet"
    if not raylet.exists():
        shutil.copy(shutil.which("sleep"), raylet)
        (tmp_path / "default_worker.py").write_text("import time\ntime.sleep(600)\n")
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    return [
        subprocess.Popen([*prefix, str(raylet), "600"], start_new_session=True),
        subprocess.Popen(
            [*prefix, sys.executable, str(tmp_path / "default_worker.py")], start_new_session=True
        ),
    ]


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def _pid_namespace(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/pid")


def _in_pid_namespace(namespace: str) -> list[int]:
    """Processes of the machine in that PID namespace."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if _pid_namespace(int(entry)) == namespace:
                    found.append(int(entry))
            except OSError:
                continue  # gone meanwhile
    return found


FAKE_RAY = textwrap.dedent(
    """\
    #!/bin/sh
    # Stands in for ``ray start --block``: a process that leaves the process group, one that
    # stays in it, and (with an argument) SIGTERM ignored, as the first process of a PID
    # namespace without a handler ignores it.
    setsid sleep 600 &
    sleep 600 &
    case "$*" in *obeys*) trap 'exit 0' TERM ;; esac
    echo "Ray runtime started."
    while :; do sleep 1; done
    """
)


@pytest.mark.parametrize("fake", ["obeys", "ignores"])
def test_a_node_is_stopped_with_everything_it_started_and_nothing_else(
    netns_capable, tmp_path, monkeypatch, fake
):
    """A node's own processes go, the one that left its process group too (its PID namespace
    holds it), whether or not it obeys SIGTERM; the Ray-named processes beside it stay."""
    script = tmp_path / "ray"
    script.write_text(FAKE_RAY)
    script.chmod(0o755)
    monkeypatch.setattr(ray_netns, "RAY", str(script))
    pid = os.getpid()
    cluster = ray_netns.NetnsCluster(prefix=f"nrt{pid % 100000}", net=pid % 200 + 20, nodes=1)
    subprocess.run(["ip", "netns", "add", cluster.namespace(0)], check=True)
    bystanders: list[subprocess.Popen] = []
    try:
        bystanders = _bystanders(tmp_path) + _bystanders(tmp_path, cluster.namespace(0))
        node = ray_netns.start_node(cluster, 0, [fake], tmp_path / "node.log", timeout=30)
        assert node.init is not None
        namespace = _pid_namespace(node.init)
        assert namespace != _pid_namespace(os.getpid())
        deadline = time.monotonic() + 10
        while len(_in_pid_namespace(namespace)) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)  # the script, its two sleeps, the loop's
        assert len(_in_pid_namespace(namespace)) >= 3

        started = time.monotonic()
        ray_netns.stop_node(node, grace_s=2)
        took = time.monotonic() - started
        # SIGTERM ends one that obeys it; one that does not is killed after the grace.
        assert took < 2 if fake == "obeys" else 2 <= took < 30
        assert node.process.poll() is not None
        assert _in_pid_namespace(namespace) == []
        assert [p.poll() for p in bystanders] == [None] * len(bystanders)
    finally:
        _stop(bystanders)
        subprocess.run(["ip", "netns", "delete", cluster.namespace(0)], capture_output=True)


@pytest.mark.ray
def test_the_cluster_s_teardown_leaves_an_unrelated_ray_running(netns_capable, tmp_path):
    """A real two-node cluster, up and used, then torn down: the Ray-named processes started
    beside it (in the machine's namespaces and in the head's network namespace) are alive, and
    no process of its nodes' PID namespaces is left."""
    bystanders: list[subprocess.Popen] = []
    try:
        with ray_netns.netns_ray_cluster(2) as cluster:
            bystanders = _bystanders(tmp_path) + _bystanders(tmp_path, cluster.namespace(0))
            nodes = cluster.run_in_head(
                [
                    sys.executable,
                    "-c",
                    "import json, ray; ray.init(); "
                    "print(json.dumps(sum(n['Alive'] for n in ray.nodes())))",
                ],
                timeout=120,
            )
            assert nodes.returncode == 0, nodes.stderr[-3000:]
            assert json.loads(nodes.stdout.strip().splitlines()[-1]) == 2
            namespaces = [_pid_namespace(node.init) for node in cluster.started]
            assert len(set(namespaces)) == 2
            assert all(_in_pid_namespace(n) for n in namespaces)
        assert [_in_pid_namespace(n) for n in namespaces] == [[], []]
        assert all(node.process.poll() is not None for node in cluster.started)
        assert [p.poll() for p in bystanders] == [None] * len(bystanders)
    finally:
        _stop(bystanders)
