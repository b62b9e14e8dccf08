"""The deployment files, checked by tools that run offline: kustomize renders the Kubernetes
manifests, and the compose files are validated against a JSON schema of the Compose subset they
use, plus the checks a schema cannot express (references resolve, no literal secrets)."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from django.conf import settings

from webapp import queues

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
SCHEMA = json.loads((Path(__file__).with_name("compose.schema.json")).read_text())
COMPOSE = DOCKER / "compose.yaml"
COMPOSE_FILES = [COMPOSE, DOCKER / "compose.gpu.yaml"]
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|_KEY$", re.IGNORECASE)
INTERPOLATION = re.compile(r"\$\{[A-Z0-9_]+(:?[-?][^}]*)?\}")
URL_PASSWORD = re.compile(r"://[^:/@\s]*:([^@\s]+)@")


# --- Kubernetes ------------------------------------------------------------------------------


def render(path: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render the manifests (make test installs the rest)"
    done = subprocess.run(
        [kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    kinds: dict[str, list[dict]] = {}
    for doc in docs:
        kinds.setdefault(doc["kind"], []).append(doc)
    return kinds


def pod_specs(doc: dict) -> list[dict]:
    if doc["kind"] in {"Deployment", "Job"}:
        return [doc["spec"]["template"]["spec"]]
    if doc["kind"] == "RayCluster":
        groups = [doc["spec"]["headGroupSpec"], *doc["spec"]["workerGroupSpecs"]]
        return [g["template"]["spec"] for g in groups]
    return []


@pytest.fixture(scope="module")
def gpu_docs() -> list[dict]:
    return render(DOCKER / "k8s")


def test_the_manifests_render_with_every_part_of_the_deployment(gpu_docs):
    kinds = by_kind(gpu_docs)
    names = {(d["kind"], d["metadata"]["name"]) for d in gpu_docs}
    assert {
        ("Deployment", "nereus-web"),
        ("Deployment", "nereus-worker"),
        ("Deployment", "nereus-beat"),
        ("Service", "nereus-web"),
        ("Job", "nereus-migrate"),
        ("RayCluster", "nereus-ray"),
        ("PersistentVolumeClaim", "nereus-checkpoints"),
    } <= names
    assert len(kinds["ConfigMap"]) == 1
    assert all(d["metadata"]["namespace"] == "nereus" for d in gpu_docs)
    (job,) = kinds["Job"]
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][-2:] == [
        "migrate",
        "--noinput",
    ]


def _queues(command: list[str]) -> set[str]:
    (option,) = [c for c in command if c.startswith("--queues=")]
    return set(option.removeprefix("--queues=").split(","))


def test_the_periodic_checks_have_a_worker_that_drives_no_job(gpu_docs):
    """The drivers hold their worker's processes for hours: the check for lost drivers must not
    wait behind them (webapp/queues.py). Compose and Kubernetes each run one worker on the
    maintenance queue, with the beat, and the job workers consume the drivers' queue only."""
    deployments = {d["metadata"]["name"]: d for d in by_kind(gpu_docs)["Deployment"]}
    k8s = {
        name: pod_specs(deployments[name])[0]["containers"][0]["command"]
        for name in ("nereus-worker", "nereus-beat")
    }
    services = load(COMPOSE)["services"]
    compose = {name: services[name]["command"] for name in ("worker", "maintenance")}
    for drivers, maintenance in (k8s.values(), compose.values()):
        assert _queues(drivers) == {queues.DRIVERS} and "--beat" not in drivers
        assert _queues(maintenance) == {queues.MAINTENANCE} and "--beat" in maintenance
        assert "--pool=solo" in maintenance
        # Drivers run on a Ray node of their own machine (nereus.ray_node joins one first);
        # the maintenance worker needs none.
        assert drivers[:5] == ["python", "-m", "nereus.ray_node", "celery", "-A"], drivers
        assert maintenance[0] == "celery"
    routes = settings.CELERY_TASK_ROUTES
    assert {routes[t]["queue"] for t in ("jobs.reap", "plans.expire")} == {queues.MAINTENANCE}
    assert {e["task"] for e in settings.CELERY_BEAT_SCHEDULE.values()} <= set(routes)


def test_the_ray_cluster_has_a_head_and_a_gpu_worker_group(gpu_docs):
    (cluster,) = by_kind(gpu_docs)["RayCluster"]
    assert cluster["apiVersion"] == "ray.io/v1"
    head = cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # the head hosts no slots
    (group,) = cluster["spec"]["workerGroupSpecs"]
    container = group["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["image"].endswith("/nereus-ray:cuda")
    # Token authentication on every node, from the Secret.
    for spec in pod_specs(cluster):
        env = {e["name"]: e for e in spec["containers"][0]["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "nereus-secrets"


def test_the_cpu_overlay_drops_the_gpus():
    (cluster,) = by_kind(render(DOCKER / "k8s" / "overlays" / "cpu"))["RayCluster"]
    (group,) = cluster["spec"]["workerGroupSpecs"]
    text = json.dumps(group)
    assert "nvidia.com/gpu" not in text
    assert group["template"]["spec"]["containers"][0]["image"].endswith("/nereus-ray:cpu")


def test_the_manifests_hold_no_secret_and_every_pod_runs_as_non_root(gpu_docs):
    kinds = by_kind(gpu_docs)
    assert "Secret" not in kinds  # created outside the repository (secrets.env.example)
    config = kinds["ConfigMap"][0]["data"]
    assert not [k for k in config if SECRET_NAME.search(k) or k in {"DATABASE_URL", "REDIS_URL"}]
    for doc in gpu_docs:
        for spec in pod_specs(doc):
            assert spec["securityContext"]["runAsUser"] != 0, doc["metadata"]["name"]
            for container in spec["containers"]:
                for env in container.get("env", []):
                    if SECRET_NAME.search(env["name"]):
                        assert "value" not in env, (doc["metadata"]["name"], env["name"])
                refs = [e.get("secretRef", {}).get("name") for e in container.get("envFrom", [])]
                if doc["kind"] != "RayCluster":
                    assert "nereus-secrets" in refs, doc["metadata"]["name"]


# --- Compose ---------------------------------------------------------------------------------


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def semantic_problems(compose: dict) -> list[str]:
    """What the schema cannot check: references resolve, secrets are never literal."""
    problems = []
    services = compose.get("services", {})
    declared = set(compose.get("volumes") or {})
    for name, service in services.items():
        depends = service.get("depends_on") or {}
        for other in depends if isinstance(depends, list) else depends.keys():
            if other not in services:
                problems.append(f"{name}: depends_on names no service {other!r}")
            elif other == name:
                problems.append(f"{name}: depends on itself")
            elif (
                not isinstance(depends, list)
                and depends[other]["condition"] == "service_healthy"
                and "healthcheck" not in services[other]
            ):
                problems.append(f"{name}: waits for {other} to be healthy, which has no check")
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0] if isinstance(volume, str) else volume.get("source")
            kind = "bind" if source and source.startswith((".", "/", "~")) else "volume"
            if isinstance(volume, dict):
                kind = volume["type"]
            if kind == "volume" and source not in declared:
                problems.append(f"{name}: volume {source!r} is not declared")
        for key, value in environment(service).items():
            literal = INTERPOLATION.sub("", value)
            if SECRET_NAME.search(key) and literal.strip():
                problems.append(f"{name}: {key} holds a literal secret")
            for password in URL_PASSWORD.findall(value):
                if not INTERPOLATION.fullmatch(password):
                    problems.append(f"{name}: {key} has a literal password in its URL")
    return problems


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_the_compose_files_follow_the_schema(path):
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    jsonschema.Draft202012Validator(SCHEMA).validate(load(path))


def test_the_compose_file_has_every_service_of_one_host_and_no_literal_secret():
    compose = load(COMPOSE)
    services = compose["services"]
    assert {"postgres", "redis", "migrate", "web", "worker", "ray-head", "ray-worker"} <= set(
        services
    )
    assert semantic_problems(compose) == []
    assert {"pgdata", "checkpoints"} <= set(compose["volumes"])
    # The settings the web app reads, on every process of it.
    for name in ("migrate", "web", "worker"):
        env = environment(services[name])
        assert {"DATABASE_URL", "REDIS_URL", "NEREUS_SECRET_KEY", "NEREUS_PRODUCTION"} <= set(env)
        assert env["DATABASE_URL"].startswith("postgresql://")
    assert services["web"]["depends_on"]["migrate"]["condition"] == (
        "service_completed_successfully"
    )
    assert services["ray-worker"]["deploy"]["replicas"] == "${RAY_WORKERS:-2}"
    for name in ("worker", "ray-head", "ray-worker"):  # drivers and slots share the job dirs
        assert "checkpoints:/var/lib/nereus/jobs" in services[name]["volumes"]
    # The web port is published on the host's loopback only.
    assert all(p.startswith("127.0.0.1:") for p in services["web"]["ports"])


def test_the_checks_catch_what_they_are_for():
    """The schema and the semantic checks fail on the mistakes they exist for."""
    compose = load(COMPOSE)
    validator = jsonschema.Draft202012Validator(SCHEMA)
    for mutate, where in [
        (lambda c: c["services"]["web"].update(helthcheck={}), "helthcheck"),
        (lambda c: c["services"]["web"]["depends_on"]["migrate"].update(condition="done"), "done"),
        (lambda c: c["services"]["web"].pop("image"), "image"),
        (lambda c: c["services"]["web"]["healthcheck"].update(interval="15"), "15"),
    ]:
        broken = copy.deepcopy(compose)
        mutate(broken)
        errors = list(validator.iter_errors(broken))
        assert errors, where

    for mutate, expected in [
        (
            lambda c: c["services"]["web"]["depends_on"].update(
                cache={"condition": "service_started"}
            ),
            "names no service 'cache'",
        ),
        (
            lambda c: c["services"]["worker"]["volumes"].append("models:/models"),
            "volume 'models' is not declared",
        ),
        (
            lambda c: c["services"]["web"]["environment"].update(NEREUS_SECRET_KEY="hunter2" * 8),
            "NEREUS_SECRET_KEY holds a literal secret",
        ),
        (
            lambda c: c["services"]["web"]["environment"].update(
                DATABASE_URL="postgresql://u:pw@db/x"
            ),
            "literal password",
        ),
    ]:
        broken = copy.deepcopy(compose)
        mutate(broken)
        assert any(expected in p for p in semantic_problems(broken)), expected


def test_the_grafana_dashboard_queries_the_metrics_the_service_exports():
    dashboard = json.loads((DOCKER / "grafana" / "nereus.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for metric in (
        "nereus_jobs",
        "nereus_steps_total",
        "nereus_step_stage_duration_seconds_bucket",
        "nereus_transitions_total",
        "nereus_transition_predicted_seconds",
        "nereus_transition_actual_seconds",
        "nereus_triggers_total",
        "nereus_approval_wait_seconds_bucket",
        "nereus_http_request_duration_seconds_bucket",
    ):
        assert metric in exprs, metric
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_the_images_run_as_non_root_with_a_health_check_and_no_secret():
    for name in ("Dockerfile.web", "Dockerfile.ray"):
        text = (DOCKER / name).read_text()
        stages = re.findall(r"^FROM\s+(\S+)", text, re.MULTILINE)
        assert len(stages) >= 2, f"{name}: multi-stage"
        assert re.search(r"^ARG PYTHON_IMAGE=python:\d+\.\d+\.\d+-slim-\w+$", text, re.M), name
        assert re.search(r"^USER (?!root)\w+", text, re.MULTILINE), name
        assert "HEALTHCHECK" in text, name
        assert "VARIANT" in text and "'.[gpu]'" in text, (
            f"{name}: a CUDA variant with the gpu extra"
        )
        assert not re.search(r"^(ENV|ARG)\s+\S*(SECRET|PASSWORD|TOKEN)\S*=", text, re.M), name
    assert "/healthz" in (DOCKER / "Dockerfile.web").read_text()
