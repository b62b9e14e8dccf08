"""``nereus doctor``: what this installation has, each with a clear line and a hint."""

from __future__ import annotations

import dataclasses
import os
import platform
import sys

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Finding:
    name: str
    status: str
    detail: str
    hint: str = ""


def check_python() -> Finding:
    version = platform.python_version()
    if sys.version_info < (3, 11):  # noqa: UP036 - reports an unsupported interpreter
        return Finding(
            name="python", status=FAIL, detail=version, hint="Nereus needs Python 3.11 or newer"
        )
    return Finding(name="python", status=OK, detail=f"{version} ({sys.executable})")


def check_torch() -> Finding:
    try:
        import torch
    except ImportError as exc:
        return Finding(
            name="pytorch", status=FAIL, detail=str(exc), hint="pip install -e . (make install)"
        )
    if torch.version.hip:
        build = f"ROCm {torch.version.hip}"
    elif torch.version.cuda:
        build = f"CUDA {torch.version.cuda}"
    else:
        build = "CPU"
    detail = f"{torch.__version__}, {build} build, {torch.get_num_threads()} threads"
    if build != "CPU" and not torch.cuda.is_available():
        return Finding(
            name="pytorch",
            status=WARN,
            detail=detail + ", no device visible",
            hint="a GPU build without a visible GPU: check the driver and CUDA_VISIBLE_DEVICES",
        )
    return Finding(name="pytorch", status=OK, detail=detail)


def check_ray() -> Finding:
    try:
        import ray

        import runtime.engine  # noqa: F401 - keeps a local Ray on loopback
    except ImportError as exc:
        return Finding(
            name="ray", status=FAIL, detail=str(exc), hint="pip install -e . (make install)"
        )
    from webapp.health import check_ray as probe

    found = probe()
    if not found.ok:
        return Finding(
            name="ray",
            status=FAIL,
            detail=f"{ray.__version__}; {found.detail}",
            hint="start the cluster (ray start --head) or unset RAY_ADDRESS for a local instance",
        )
    return Finding(name="ray", status=OK, detail=f"{ray.__version__}; {found.detail}")


def check_database() -> Finding:
    from django.conf import settings
    from django.db import connections
    from django.db.migrations.executor import MigrationExecutor

    from webapp.health import check_database as probe

    found = probe()
    if not found.ok:
        return Finding(
            name="database",
            status=FAIL,
            detail=found.detail,
            hint="check DATABASE_URL and that the server is running",
        )
    pending = MigrationExecutor(connections["default"]).migration_plan(
        MigrationExecutor(connections["default"]).loader.graph.leaf_nodes()
    )
    name = settings.DATABASES["default"]["NAME"]
    if pending:
        return Finding(
            name="database",
            status=WARN,
            detail=f"{found.detail} {name}: {len(pending)} migrations not applied",
            hint="python manage.py migrate",
        )
    return Finding(name="database", status=OK, detail=f"{found.detail} {name}, migrations applied")


def check_redis() -> Finding:
    from django.conf import settings

    from webapp.health import check_broker

    if not settings.CONFIG.redis_url:
        return Finding(
            name="redis",
            status=OK,
            detail="REDIS_URL unset: embedded broker (filesystem) and channel layer (database)",
        )
    found = check_broker()
    if not found.ok:
        return Finding(
            name="redis",
            status=FAIL,
            detail=found.detail,
            hint="check REDIS_URL and that redis-server is running, or unset it",
        )
    from webapp.config import redact

    return Finding(
        name="redis", status=OK, detail=f"reachable at {redact(settings.CONFIG.redis_url)}"
    )


def check_kernels() -> Finding:
    import torch

    from runtime import kernels
    from runtime.kernels.paths import library_path

    status = kernels.library_status()
    fallback = "pack/unpack and checksums use the pure-PyTorch implementation"
    if status.state == "compiled":
        if torch.cuda.is_available() and not kernels.has_kernels_for("cuda"):
            return Finding(
                name="kernels",
                status=WARN,
                detail=f"compiled (csrc/) from {library_path()} without CUDA kernels: on the "
                "GPU, " + fallback,
                hint="rebuild where PyTorch is a CUDA build and nvcc is found (CUDA_HOME): "
                "make kernels",
            )
        devices = "CPU and CUDA" if kernels.has_kernels_for("cuda") else "CPU"
        return Finding(
            name="kernels", status=OK, detail=f"compiled (csrc/, {devices}) from {library_path()}"
        )
    if status.state == "stale":
        return Finding(
            name="kernels",
            status=WARN,
            detail=f"stale ({status.detail}): {library_path()} is not used; {fallback}",
            hint="make kernels (python -m runtime.kernels.build)",
        )
    if status.state == "failed":
        return Finding(
            name="kernels",
            status=WARN,
            detail=f"failed to load: {status.detail}; {fallback}",
            hint="rebuild with this PyTorch: make kernels (python -m runtime.kernels.build)",
        )
    return Finding(
        name="kernels",
        status=WARN,
        detail=f"not built: {fallback}",
        hint="python -m runtime.kernels.build (make install runs it)",
    )


def check_gpus() -> Finding:
    try:
        import pynvml
    except ImportError:
        return Finding(
            name="gpus",
            status=WARN,
            detail="nvidia-ml-py is not installed",
            hint="pip install nvidia-ml-py",
        )
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return Finding(
            name="gpus",
            status=WARN,
            detail=f"NVML unavailable ({exc}); CPU slots stand in for GPUs",
            hint="on a GPU machine, install the NVIDIA driver",
        )
    try:
        count = pynvml.nvmlDeviceGetCount()
        names = []
        for index in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            label = name if isinstance(name, str) else name.decode()
            names.append(f"{label} ({memory.total / 2**30:.0f} GiB)")
    finally:
        pynvml.nvmlShutdown()
    if not count:
        return Finding(name="gpus", status=WARN, detail="NVML reports no GPU; CPU slots stand in")
    return Finding(name="gpus", status=OK, detail=f"{count}: " + ", ".join(names))


WORKERS_TIMEOUT_S = 2.0


def check_workers() -> Finding:
    """Which Celery workers answer, and whether the two queues each have one: the job drivers'
    and the maintenance worker's (without it no lost driver is replaced)."""
    from webapp import queues
    from webapp.celery import app

    try:
        answered = app.control.inspect(timeout=WORKERS_TIMEOUT_S).active_queues() or {}
    except Exception as exc:  # the broker is unreachable: its own check says why
        return Finding(name="workers", status=WARN, detail=f"could not ask the workers: {exc}")
    consumers: dict[str, list[str]] = {}
    for worker, consumed in sorted(answered.items()):
        for queue in consumed or []:
            consumers.setdefault(queue.get("name", ""), []).append(worker)
    missing = [q for q in (queues.DRIVERS, queues.MAINTENANCE) if q not in consumers]
    detail = "; ".join(f"{q}: {', '.join(w)}" for q, w in sorted(consumers.items()))
    if not answered:
        return Finding(
            name="workers",
            status=WARN,
            detail=f"no Celery worker answered within {WORKERS_TIMEOUT_S:g} s: jobs wait queued",
            hint="start the job workers and the maintenance worker (make demo does; see "
            "docs/deployment.md)",
        )
    if missing:
        return Finding(
            name="workers",
            status=WARN,
            detail=f"no worker consumes {', '.join(missing)} ({detail})",
            hint=(
                "start the maintenance worker (celery -A webapp.celery worker --pool=solo "
                f"--queues={queues.MAINTENANCE} --beat): without it no lost driver is replaced"
                if queues.MAINTENANCE in missing
                else f"start a job worker (celery -A webapp.celery worker --queues={queues.DRIVERS})"
            ),
        )
    return Finding(name="workers", status=OK, detail=detail)


def run_all() -> list[Finding]:
    """Every check, in order; the Django-dependent ones after Django is set up."""
    findings = [check_python(), check_torch()]
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    try:
        from webapp import config

        config.load()  # first: the settings would stop the process on a bad variable
        import django

        django.setup()
    except Exception as exc:  # a configuration error: report it as the finding it is
        findings.append(
            Finding(
                name="configuration",
                status=FAIL,
                detail=str(exc),
                hint="fix the variable named above (see the README's configuration table)",
            )
        )
        return [*findings, check_kernels(), check_gpus()]
    broker = check_redis()
    workers = (
        check_workers()
        if broker.status != FAIL
        else Finding(name="workers", status=WARN, detail="not asked: the broker is unreachable")
    )
    findings += [check_ray(), check_database(), broker, workers, check_kernels(), check_gpus()]
    return findings
