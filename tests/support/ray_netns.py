"""A Ray cluster of several nodes on one machine, each node in a network namespace of its own.

Ray on one address cannot hold several nodes, and nothing may use the machine's interface
address, so each node gets a namespace with one veth end (named ``eth0`` in every namespace, so
``GLOO_SOCKET_IFNAME=eth0`` holds everywhere) on a bridge that lives in a namespace of its own:
10.77.<net>.1 is the head, .2, .3, ... the workers. Nodes are started with ``ray start``, as on a
real cluster; a driver runs inside the head's namespace (``run_in_head``). Needs root and
iproute2; everything is torn down on exit, namespaces included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))
PORT = 6390


@dataclasses.dataclass(frozen=True)
class NetnsCluster:
    prefix: str
    net: int
    nodes: int
    spare: int = 0
    """Namespaces after the nodes', on the same bridge, where no Ray node is started."""

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


def _teardown(cluster: NetnsCluster) -> None:
    for node in range(cluster.nodes):  # ``ray stop`` reaches the spare namespaces' nodes too
        with contextlib.suppress(Exception):
            cluster.exec(node, [RAY, "stop", "--force"], capture_output=True, timeout=60)
    every = range(cluster.nodes + cluster.spare)
    for name in [cluster.namespace(n) for n in every] + [f"{cluster.prefix}br"]:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


@contextlib.contextmanager
def netns_ray_cluster(
    nodes: int = 3, *, cpus_per_node: int = 2, spare: int = 0
) -> Iterator[NetnsCluster]:
    """A head and ``nodes - 1`` workers, started with ``ray start``, each in its namespace, and
    ``spare`` namespaces without a node (``cluster.namespace(nodes)`` on)."""
    pid = os.getpid()
    cluster = NetnsCluster(
        prefix=f"nrs{pid % 100000}", net=pid % 200 + 20, nodes=nodes, spare=spare
    )
    bridge = f"{cluster.prefix}br"
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
        cluster.exec(
            0,
            [
                RAY,
                "start",
                "--head",
                f"--node-ip-address={cluster.address(0)}",
                f"--port={PORT}",
                "--include-dashboard=false",
                *common,
            ],
            capture_output=True,
            timeout=180,
        )
        for node in range(1, nodes):
            cluster.exec(
                node,
                [
                    RAY,
                    "start",
                    f"--address={cluster.ray_address}",
                    f"--node-ip-address={cluster.address(node)}",
                    *common,
                ],
                capture_output=True,
                timeout=180,
            )
        yield cluster
    finally:
        _teardown(cluster)
