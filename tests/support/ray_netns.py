"""A Ray cluster of several nodes on one machine, each node in a network namespace of its own.

Ray on one address cannot hold several nodes, and nothing may use the machine's interface
address, so each node gets a namespace with one veth end (named ``eth0`` in every namespace, so
``GLOO_SOCKET_IFNAME=eth0`` holds everywhere) on a bridge that lives in a namespace of its own:
10.77.<net>.1 is the head, .2, .3, ... the workers. Nodes are started with ``ray start``, as on a
real cluster; a driver runs inside the head's namespace (``run_in_head``). Needs root and
iproute2; everything is torn down on exit, namespaces included.

Each node is ``ray start --block`` as the first process of a PID namespace of its own
(``unshare --pid --fork --kill-child``), started in a session of its own, and the teardown stops
exactly those: it signals the node's process group and the namespace's first process, and a PID
namespace whose first process ends takes every process in it along. ``ray stop`` is never run:
it finds Ray's processes by name on the whole machine, whatever their network namespace, and
took down an unrelated Ray cluster on the same machine (found by review).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))
PORT = 6390
STARTED = "Ray runtime started"
"""What ``ray start`` prints once its node is up (``--block`` then waits until signalled)."""


@dataclasses.dataclass(frozen=True)
class NetnsCluster:
    prefix: str
    net: int
    nodes: int
    spare: int = 0
    """Namespaces after the nodes', on the same bridge, where no Ray node is started."""
    started: list[RayNode] = dataclasses.field(default_factory=list, compare=False, repr=False)
    """The nodes started in it (``start_node``), the head first: what its teardown stops."""

    def namespace(self, node: int) -> str:
        return f"{self.prefix}n{node}"

    def address(self, node: int) -> str:
        return f"10.77.{self.net}.{node + 1}"

    @property
    def ray_address(self) -> str:
        return f"{self.address(0)}:{PORT}"

    def env(self, **extra: str) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
        }
        return {
            **env,
            "RAY_AUTH_MODE": "token",
            "GLOO_SOCKET_IFNAME": "eth0",
            "RAY_USAGE_STATS_ENABLED": "0",
            **extra,
        }

    def exec(self, node: int, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ip", "netns", "exec", self.namespace(node), *argv],
            check=kwargs.pop("check", True),
            env=kwargs.pop("env", self.env()),
            **kwargs,
        )

    def run_in_head(self, argv: Sequence[str], *, timeout: float, env: dict | None = None):
        """Run a driver inside the head's namespace with ``RAY_ADDRESS`` set."""
        return self.exec(
            0,
            argv,
            env=self.env(RAY_ADDRESS=self.ray_address, **(env or {})),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@dataclasses.dataclass
class RayNode:
    """One ``ray start --block`` this module started: ``process`` is ``ip netns exec … unshare``
    (the leader of a session and process group of its own), ``init`` the host's id of the
    first process of its PID namespace (``ray start`` itself), once known."""

    process: subprocess.Popen
    log: Path
    init: int | None = None

    def output(self, tail: int | None = 4000) -> str:
        """What it printed (its last ``tail`` characters; None: all)."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return text if tail is None else text[-tail:]


def start_node(
    cluster: NetnsCluster, node: int, argv: Sequence[str], log: Path, *, timeout: float = 180
) -> RayNode:
    """``ray start --block`` with ``argv`` in ``node``'s namespace, as the first process of a
    PID namespace of its own; returns once it says its node is up (or raises, the node
    stopped)."""
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [
                *("ip", "netns", "exec", cluster.namespace(node)),
                *("unshare", "--pid", "--fork", "--kill-child", "--mount-proc"),
                *(RAY, "start", "--block", *argv),
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=cluster.env(PYTHONUNBUFFERED="1"),
            start_new_session=True,  # its own process group: the teardown signals that alone
        )
    started = RayNode(process=process, log=log)
    deadline = time.monotonic() + timeout
    try:
        while STARTED not in started.output(tail=None):
            if process.poll() is not None:
                raise RuntimeError(
                    f"ray start in {cluster.namespace(node)} exited {process.returncode}:\n"
                    f"{started.output()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"ray start in {cluster.namespace(node)} not up in {timeout:.0f} s:\n"
                    f"{started.output()}"
                )
            time.sleep(0.2)
        started.init = _only_child(process.pid)
    except BaseException:
        stop_node(started)
        raise
    return started


def _only_child(pid: int) -> int | None:
    """The one child of ``pid`` (``unshare --fork``'s: the PID namespace's first process)."""
    children: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(c) for c in f.read().split()]
    return children[0] if len(children) == 1 else None


def stop_node(node: RayNode, *, grace_s: float = 20.0) -> None:
    """Stop the processes ``start_node`` started, and only those, and wait until they are gone.

    SIGTERM to its process group: ``ray start --block`` stops its node's processes and exits
    (``unshare`` blocks SIGTERM and waits for it). Past ``grace_s``, SIGKILL to the namespace's
    first process, which takes every process of its PID namespace along: the kernel ends them
    all before that first process's own end is reported, so ``unshare`` exiting (it reaps its
    child, then exits; the wait here reaps it) means the namespace is empty. Only when that
    first process is unknown, or ``unshare`` still does not exit, SIGKILL to the group
    (``--kill-child`` then kills the first process)."""
    process = node.process
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            init = node.init if node.init == _only_child(process.pid) else None
            if init is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(init, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=60)
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=60)


def _teardown(cluster: NetnsCluster, nodes: Sequence[RayNode]) -> None:
    for node in reversed(nodes):  # the workers, then the head
        with contextlib.suppress(Exception):
            stop_node(node)
    every = range(cluster.nodes + cluster.spare)
    for name in [cluster.namespace(n) for n in every] + [f"{cluster.prefix}br"]:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


@contextlib.contextmanager
def netns_ray_cluster(
    nodes: int = 3, *, cpus_per_node: int = 2, spare: int = 0
) -> Iterator[NetnsCluster]:
    """A head and ``nodes - 1`` workers, started with ``ray start``, each in its namespace, and
    ``spare`` namespaces without a node (``cluster.namespace(nodes)`` on). On exit it stops the
    nodes it started (``stop_node``) and nothing else: a process started in a spare namespace
    is its starter's to stop."""
    pid = os.getpid()
    cluster = NetnsCluster(
        prefix=f"nrs{pid % 100000}", net=pid % 200 + 20, nodes=nodes, spare=spare
    )
    bridge = f"{cluster.prefix}br"
    started = cluster.started
    logs = Path(tempfile.mkdtemp(prefix=f"{cluster.prefix}-ray-"))
    try:
        _ip("netns", "add", bridge)
        _ip("netns", "exec", bridge, "ip", "link", "add", "br0", "type", "bridge")
        _ip("netns", "exec", bridge, "ip", "link", "set", "br0", "up")
        for node in range(nodes + spare):
            ns, outer = cluster.namespace(node), f"{cluster.prefix}v{node}"
            _ip("netns", "add", ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", f"{outer}p")
            _ip("link", "set", f"{outer}p", "netns", ns)
            _ip("link", "set", outer, "netns", bridge)
            _ip("netns", "exec", ns, "ip", "link", "set", f"{outer}p", "name", "eth0")
            _ip(
                "netns",
                "exec",
                ns,
                "ip",
                "addr",
                "add",
                f"{cluster.address(node)}/24",
                "dev",
                "eth0",
            )
            _ip("netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _ip("netns", "exec", bridge, "ip", "link", "set", outer, "master", "br0")
            _ip("netns", "exec", bridge, "ip", "link", "set", outer, "up")
        common = [f"--num-cpus={cpus_per_node}", "--disable-usage-stats"]
        started.append(
            start_node(
                cluster,
                0,
                [
                    "--head",
                    f"--node-ip-address={cluster.address(0)}",
                    f"--port={PORT}",
                    "--include-dashboard=false",
                    *common,
                ],
                logs / "node0.log",
            )
        )
        for node in range(1, nodes):
            started.append(
                start_node(
                    cluster,
                    node,
                    [
                        f"--address={cluster.ray_address}",
                        f"--node-ip-address={cluster.address(node)}",
                        *common,
                    ],
                    logs / f"node{node}.log",
                )
            )
        yield cluster
    finally:
        _teardown(cluster, started)
        with contextlib.suppress(OSError):
            for log in logs.iterdir():
                log.unlink()
            logs.rmdir()
