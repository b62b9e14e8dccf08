"""Joining (or starting) the Ray instance that hosts a job's slots.

By default Ray binds to the machine's interface address and maps 127.0.0.1 back to it. A single
machine must keep everything on loopback, so for a local instance (RAY_ADDRESS unset, or pointing
at a loopback address) we set ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` before Ray is imported, which
makes Ray use 127.0.0.1. A real cluster address leaves Ray's own choice alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
from collections.abc import Iterator

_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def is_loopback_address(address: str | None) -> bool:
    """True for no address (a local instance) or an address whose host is a loopback address."""
    if address in (None, "", "local"):
        return True
    host = address.removeprefix("ray://").rpartition(":")[0] or address
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def loopback_environment(address: str | None) -> dict[str, str]:
    """Environment variables that keep Ray on loopback for this address (empty for a cluster)."""
    return dict(_LOOPBACK_ENV) if is_loopback_address(address) else {}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RayConnection:
    """A connected Ray driver: where it is attached and whether it started the instance itself."""

    address: str
    started_locally: bool
    num_cpus: float


@contextlib.contextmanager
def ray_connection(address: str | None, *, num_cpus: int | None = None) -> Iterator[RayConnection]:
    """Attach this process to Ray for the duration of the block.

    ``address`` None starts a private local instance (shut down on exit); otherwise the driver joins
    the given cluster and only disconnects on exit.
    """
    import ray

    if is_loopback_address(address) and ray._private.ray_constants.ENABLE_RAY_CLUSTER:
        # Ray read its environment when first imported, before runtime.engine could set it.
        raise RuntimeError(
            "Ray was imported before runtime.engine; a local instance would bind to the machine's "
            "interface address. Import runtime.engine first or set "
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0."
        )

    if ray.is_initialized():
        # Joined by an outer block in this process; leave the connection to its owner.
        yield RayConnection(
            address=ray.get_runtime_context().gcs_address,
            started_locally=False,
            num_cpus=ray.cluster_resources().get("CPU", 0.0),
        )
        return
    kwargs: dict = {"include_dashboard": False, "log_to_driver": False, "logging_level": "WARNING"}
    if address is None:
        # "local": always a private instance, never a cluster that happens to run on this machine.
        kwargs["address"] = "local"
        kwargs["num_cpus"] = num_cpus or max(2, os.cpu_count() or 2)
    else:
        kwargs["address"] = address
    context = ray.init(**kwargs)
    try:
        yield RayConnection(
            address=context.address_info.get("gcs_address", address or "local"),
            started_locally=address is None,
            num_cpus=ray.cluster_resources().get("CPU", 0.0),
        )
    finally:
        ray.shutdown()
