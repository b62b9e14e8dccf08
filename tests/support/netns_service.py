"""The service's own processes next to a namespaced Ray cluster (``tests/support/ray_netns.py``).

PostgreSQL and Redis listen on 127.0.0.1 of the root namespace, which the namespaces cannot
reach. ``root_gateway`` gives the root namespace a veth into the cluster's bridge with the
address 10.77.<net>.254 (a test-created address, never the machine's interface), and
``tcp_forwarders`` relays connections made to that address on to 127.0.0.1, so that a Celery
worker running inside the head's namespace reaches the database and the broker while the Ray
nodes reach it back (it is the job's driver).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import threading
from collections.abc import Iterator, Mapping

from tests.support.ray_netns import NetnsCluster

GATEWAY_HOST = 254


def gateway_address(cluster: NetnsCluster) -> str:
    return f"10.77.{cluster.net}.{GATEWAY_HOST}"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def root_gateway(cluster: NetnsCluster) -> Iterator[str]:
    """A veth from the root namespace into the cluster's bridge; yields the root end's address."""
    outer, inner = f"{cluster.prefix}gw", f"{cluster.prefix}gwp"
    bridge = f"{cluster.prefix}br"
    address = gateway_address(cluster)
    try:
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", bridge)
        _ip("netns", "exec", bridge, "ip", "link", "set", inner, "master", "br0")
        _ip("netns", "exec", bridge, "ip", "link", "set", inner, "up")
        _ip("addr", "add", f"{address}/24", "dev", outer)
        _ip("link", "set", outer, "up")
        yield address
    finally:
        # Deleting one end removes the pair (the peer goes with the bridge namespace otherwise).
        subprocess.run(["ip", "link", "delete", outer], capture_output=True)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


class _Forwarders:
    """asyncio TCP relays in a thread of their own: ``listen_host:port`` -> ``127.0.0.1:port``."""

    def __init__(self, listen_host: str, targets: Mapping[int, int]):
        self.listen_host, self.targets = listen_host, dict(targets)
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="tcp-forwarders", daemon=True)
        self._stop: asyncio.Event | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported to the thread that waits for readiness
            self.error = exc
            self.ready.set()
        finally:
            self.loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        servers, connections = [], set()
        for listen_port, target_port in self.targets.items():

            async def handle(reader, writer, target_port=target_port):
                connections.add(asyncio.current_task())
                try:
                    up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)
                except OSError:
                    writer.close()
                    return
                try:
                    await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
                finally:
                    connections.discard(asyncio.current_task())

            servers.append(await asyncio.start_server(handle, self.listen_host, listen_port))
        self.ready.set()
        try:
            await self._stop.wait()
        finally:
            for server in servers:
                server.close()
            for task in list(connections):
                task.cancel()
            await asyncio.gather(*connections, return_exceptions=True)

    def start(self) -> None:
        self.thread.start()
        if not self.ready.wait(timeout=10) or self.error is not None:
            raise RuntimeError(f"forwarders did not start: {self.error!r}")

    def stop(self) -> None:
        if self._stop is not None and self.loop.is_running():
            self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(timeout=10)


@contextlib.contextmanager
def tcp_forwarders(listen_host: str, targets: Mapping[int, int]) -> Iterator[None]:
    """Relay ``listen_host:<port>`` to ``127.0.0.1:<target port>`` for each pair of ``targets``."""
    forwarders = _Forwarders(listen_host, targets)
    forwarders.start()
    try:
        yield
    finally:
        forwarders.stop()
