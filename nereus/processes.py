"""Starting and stopping the service's processes: a Ray head, Celery workers, the ASGI server.

Each child runs in its own session (process group) so that stopping it reaches everything it
spawned (Ray's raylet and workers, Celery's pool children). ``ProcessGroup.stop`` sends SIGTERM to
each child (which shuts its own descendants down in order), waits, then SIGKILLs whatever is left in
its group, and reports any process that survived. Children also get SIGTERM from the kernel if the
supervisor dies without stopping them (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from runtime.engine.ray_cluster import loopback_environment
from webapp import queues


@dataclasses.dataclass
class Child:
    name: str
    popen: subprocess.Popen
    log_path: Path
    stop_signal: int = signal.SIGTERM


class ProcessGroup:
    """Children started together and stopped together."""

    def __init__(self, *, log_dir: Path):
        self.log_dir = log_dir
        self.children: list[Child] = []
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stop_signal: int = signal.SIGTERM,
    ) -> Child:
        """Start a child with exactly ``env`` as its environment (this process's when None);
        ``stop_signal`` is what ``stop`` sends it first."""
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("ab") as log:
            popen = subprocess.Popen(
                list(argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(os.environ if env is None else env),
                start_new_session=True,
                preexec_fn=functools.partial(_die_with_parent, stop_signal, os.getpid()),
            )
        child = Child(name=name, popen=popen, log_path=log_path, stop_signal=stop_signal)
        self.children.append(child)
        return child

    def check_alive(self) -> None:
        """Raise naming the first child that exited, with the tail of its log."""
        for child in self.children:
            code = child.popen.poll()
            if code is not None:
                tail = child.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{child.name} exited with code {code}; its log ends:\n{tail}")

    def stop(self, *, grace_s: float = 10.0) -> list[int]:
        """Stop every child and its descendants; returns pids still alive afterwards (none)."""
        for child in reversed(self.children):
            with contextlib.suppress(ProcessLookupError):
                child.popen.send_signal(child.stop_signal)
        deadline = time.monotonic() + grace_s
        pgids = [c.popen.pid for c in self.children]
        while time.monotonic() < deadline and any(_group_members(p) for p in pgids):
            for child in self.children:
                child.popen.poll()
            time.sleep(0.2)
        for pgid in pgids:
            _signal_group(pgid, signal.SIGKILL)
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(timeout=5)
        time.sleep(0.2)
        return [pid for pgid in pgids for pid in _group_members(pgid)]


def _die_with_parent(stop_signal: int, parent: int) -> None:
    """In the child before exec: ask the kernel for the child's stop signal when the supervisor
    dies, and stop at once if it already has (it may have died between fork and here)."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, int(stop_signal))
    if os.getppid() != parent:
        os._exit(1)


_PR_SET_PDEATHSIG = 1
# Loaded in the parent: dlopen after fork in a threaded parent can deadlock the child.
_LIBC = ctypes.CDLL(None, use_errno=True)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group or session is ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        state, group, session = fields[0], int(fields[2]), int(fields[3])
        if state != "Z" and pgid in (group, session):
            members.append(int(entry.name))
    return members


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something answers on ``host``:``port`` (an IPv4 or IPv6 address or a name; an
    unknown name raises ``socket.gaierror``)."""
    for family, kind, proto, _, address in socket.getaddrinfo(
        host.strip("[]"), port, type=socket.SOCK_STREAM
    ):
        with socket.socket(family, kind, proto) as sock:
            if sock.connect_ex(address) == 0:
                return True
    return False


def wait_until(
    predicate: Callable[[], bool],
    *,
    timeout_s: float,
    what: str,
    group: ProcessGroup | None = None,
    interval_s: float = 0.2,
) -> float:
    """Poll until ``predicate`` holds; returns the seconds it took. Fails fast if a child died."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if predicate():
            return time.monotonic() - started
        if group is not None:
            group.check_alive()
        time.sleep(interval_s)
    raise TimeoutError(f"{what} not ready after {timeout_s:.0f} s")


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status < 500
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def ray_head_argv(port: int, *, num_cpus: int) -> list[str]:
    """``ray start`` for a single-machine head on loopback, kept in the foreground (``--block``)."""
    ray_bin = Path(sys.executable).with_name("ray")
    return [
        str(ray_bin),
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        f"--num-cpus={num_cpus}",
        "--include-dashboard=false",
        "--disable-usage-stats",
    ]


def ray_head_env(var_dir: Path) -> dict[str, str]:
    """Environment for the head and for every process that joins it: loopback, token auth on
    (Ray's default for clusters; drivers must ask for it too) with the token of
    ``ray_auth_token_env``, no usage reporting."""
    return {
        **loopback_environment(None),
        "RAY_AUTH_MODE": "token",
        **ray_auth_token_env(var_dir),
        "RAY_USAGE_STATS_ENABLED": "0",
        # One machine: nothing to drain to, so stop at once instead of waiting 30 s.
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    }


RAY_AUTH_TOKEN_FILE = "ray-auth-token"


def ray_auth_token_env(var_dir: Path) -> dict[str, str]:
    """Where the processes of a head this machine starts find its token: the one the
    environment names (``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH``), else a file of the
    service's own under ``var_dir``, made once (readable by its owner only). Ray's own default,
    ``~/.ray/auth_token``, exists only where something made it, and ``ray start`` with token
    authentication refuses to start without one."""
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return {}
    path = Path(var_dir) / RAY_AUTH_TOKEN_FILE
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32))
        try:  # whole or not at all, and the first one made stays (another demo may use it)
            os.link(partial, path)
        except FileExistsError:
            pass
        finally:
            partial.unlink()
    return {"RAY_AUTH_TOKEN_PATH": str(path)}


# Celery's SIGTERM is a warm shutdown that waits for running tasks, which for a job driver can be
# hours; SIGQUIT is its cold shutdown. The job's driver stops writing its heartbeat, and the
# periodic check (``jobs.reap``, on the maintenance worker) hands the job to a new driver
# with a new epoch, which resumes from the job's last checkpoint.
CELERY_STOP_SIGNAL = signal.SIGQUIT


def celery_worker_argv(*, concurrency: int = 1, hostname: str = "worker@%h") -> list[str]:
    """A Celery worker that drives jobs: one job per pool process, ``concurrency`` at once."""
    return _celery_worker(
        "--pool=prefork",
        f"--concurrency={concurrency}",
        f"--hostname={hostname}",
        f"--queues={queues.DRIVERS}",
    )


def celery_maintenance_argv(*, hostname: str = "maintenance@%h", beat: bool = True) -> list[str]:
    """The maintenance worker: it runs the periodic tasks that rescue jobs (a lost driver's
    takeover, a lost task sent again, overdue proposals) and never a job's driver, so that busy
    drivers cannot hold them up; with ``beat``, it also sends the schedule (one per deployment
    is enough). The tasks are short database work: the solo pool runs them in its one process."""
    return _celery_worker(
        "--pool=solo",
        f"--hostname={hostname}",
        f"--queues={queues.MAINTENANCE}",
        *(["--beat"] if beat else []),
    )


def start_celery_workers(
    group: ProcessGroup,
    env: Mapping[str, str],
    *,
    concurrency: int = 1,
    maintenance: bool = True,
) -> tuple[Child, Child | None]:
    """Start the job worker (``concurrency`` drivers) in ``group`` and, with ``maintenance``,
    the maintenance worker beside it, as a deployment runs them; returns both (None for the
    maintenance worker not started)."""
    worker = group.start(
        "celery",
        celery_worker_argv(concurrency=concurrency),
        env=env,
        stop_signal=CELERY_STOP_SIGNAL,
    )
    if not maintenance:
        return worker, None
    return worker, group.start(
        "celery-maintenance", celery_maintenance_argv(), env=env, stop_signal=CELERY_STOP_SIGNAL
    )


def _celery_worker(*options: str) -> list[str]:
    celery_bin = Path(sys.executable).with_name("celery")
    return [
        str(celery_bin),
        "-A",
        "webapp.celery",
        "worker",
        "--loglevel=INFO",
        "--without-gossip",
        "--without-mingle",
        *options,
    ]


def asgi_server_argv(*, host: str, port: int) -> list[str]:
    """The web server: Daphne with request bodies capped as they are read (nereus/asgi_server.py),
    serving the ASGI application (HTTP and websockets) on ``host``:``port``."""
    return [
        sys.executable,
        "-m",
        "nereus.asgi_server",
        "-b",
        host,
        "-p",
        str(port),
        "webapp.asgi:application",
    ]
