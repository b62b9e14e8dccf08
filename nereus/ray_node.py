"""Run a command, a Celery worker that drives jobs, on a Ray node of the cluster at ``RAY_ADDRESS``.

Ray attaches a driver to a node on the driver's own machine (``ray.init`` looks for one among the
machine's processes), so a container that is not a Ray node cannot drive a job on a cluster, and a
job's driver moves its units' state through its node's object store. Before replacing itself with
the command, this joins the cluster with a node that offers it no CPU and no GPU (no slot is ever
placed there), unless one of that cluster already runs on this machine (a worker on a Ray node, or
``make demo``'s single machine). Without ``RAY_ADDRESS`` (each driver starts a local Ray), or with
``auto``, it only runs the command. ``NEREUS_NODE_IP``: the address the cluster reaches this
machine at (Kubernetes: the pod's IP), where Ray's own choice would be wrong.

    python -m nereus.ray_node celery -A webapp.celery worker --queues=celery ...

The node lives as long as the machine (container or pod) does: when the command ends, the
container ends and the node with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def join_argv(address: str, *, node_ip: str | None = None) -> list[str]:
    """``ray start`` for a node of the cluster at ``address`` that offers it no resources;
    ``node_ip``: the address the cluster reaches it at (default: Ray's choice, the interface
    of the route to the outside)."""
    return [
        str(Path(sys.executable).with_name("ray")),
        "start",
        f"--address={address}",
        *([f"--node-ip-address={node_ip}"] if node_ip else []),
        "--num-cpus=0",
        "--num-gpus=0",
        "--disable-usage-stats",
    ]


def ensure_node(address: str | None, *, node_ip: str | None = None) -> bool:
    """Join the cluster at ``address`` from this machine unless a node of it runs here already;
    returns whether a node was started."""
    from webapp.startup import local_ray_node, names_a_cluster

    if not names_a_cluster(address) or local_ray_node(address):
        return False
    done = subprocess.run(
        join_argv(address, node_ip=node_ip), capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        sys.stderr.write(f"nereus: could not join the Ray cluster at {address}:\n{done.stderr}\n")
        raise SystemExit(2)
    return True


def main(argv: Sequence[str] | None = None) -> None:
    command = list(sys.argv[1:] if argv is None else argv)
    if not command:
        sys.stderr.write("usage: python -m nereus.ray_node COMMAND [ARG ...]\n")
        raise SystemExit(2)
    ensure_node(
        (os.environ.get("RAY_ADDRESS") or "").strip() or None,
        node_ip=(os.environ.get("NEREUS_NODE_IP") or "").strip() or None,
    )
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
