"""Validation of the cluster twin against real PPO jobs on this machine's CPU slots.

Measure (``--measure-only``): several real PPO job shapes run on the Ray engine (``RayEngine``
over a ``SlotPool`` of CPU slot actors, a pool of the shape's size, the plan the controller
picks, as ``benchmarks/ppo_adaptive.py`` runs them). Fixed shapes use admission ``never`` (the
plan stays the controller's first; two of them with the controller held to tensor- or
pipeline-parallel layouts, ``JobPolicy.fixed_layouts``); one shape uses ``payback``, with a
person's plan applied part-way (``Controller.override``: training state moves), then a slot
revoked that holds a training replica (the urgent path) and a slot given back, so transitions
are measured too. Each shape runs a short warm-up, then its measured steps.

Every step's record holds: the plan (``Plan.to_json()``), the workload (``PpoWorkload``'s
fields, models by name), each stage's seconds (``StepReport.stage_seconds``), the step's
seconds (``seconds``: the job's step, units' preparation included) and the loop's
(``loop_s``: since the last step ended, the controller's and the engine's work between steps
included), the model-stages' seconds the job measures (``actor@generation`` and each
``role@inference``), the response length of every sequence (``lengths``, EOS included) and the
prompts' (``prompt_lengths``, ``prompt_width`` after left padding), how the batch was cut
across the generation units, the micro-batches and stage modes, each weight sync (stage,
seconds, bytes), every remote call of the step (``calls``: stage, function, slots, round-trip
seconds, and the slowest and quickest slot's own seconds inside the call, through
``slot_work.timed``), and host-side phases (``host``: the units' preparation, the generate,
score and train calls with the driver's work around them, memory polling, checkpoints). Each
transition's record holds the ``TransitionDag`` (its JSON after the run, with each node's
measured seconds, and the DAG itself pickled as the controller compiled it, for the twin), its
measured seconds and the executor's events; each restart its seconds. Raw records go to
``benchmarks/results/twin_validation_raw.json`` (compact; each shape's distinct plans once, in
``plans``, a step naming its own by ``plan_id``: ``load_raw`` puts them back).

Predict (``--predict-only``): reads the raw records and the twin (``runtime.twin``, which reads
the profile ``runtime/twin/profiles/cpu-slot.json`` written by ``benchmarks/cpu_slot_profile.py``
and nothing of these records: it is not tuned on them), predicts every measured step
(``ClusterTwin.step``) and transition (``ClusterTwin.transition_seconds``), and prints per shape
and stage the measured mean and median, the twin's mean prediction and their ratio, then each
transition measured against predicted. Goal: each stage's mean within 15% of the measured mean.
Writes ``benchmarks/results/twin_validation.json``.

    python benchmarks/twin_validation.py [--measure-only | --predict-only] [--steps 10]
        [--shapes NAME,...] [--quick]
"""

from __future__ import annotations

import argparse
import base64
import copy
import dataclasses
import json
import os
import pickle
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import runtime.engine  # noqa: E402, F401 - keeps Ray on loopback (before anything imports ray)
from benchmarks import _report  # noqa: E402
from runtime.planner import default_catalog  # noqa: E402
from runtime.planner.plan import Plan  # noqa: E402
from runtime.planner.workload import PpoWorkload  # noqa: E402

STAGES = ("generation", "inference", "training")
RAW = _report.RESULTS / "twin_validation_raw.json"
PROFILE = ROOT / "runtime" / "twin" / "profiles" / "cpu-slot.json"
GOAL = 0.15
"""Each stage's mean predicted within this fraction of the measured mean."""


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    slots: int
    batch: int
    max_new_tokens: int
    epochs: int = 1
    minibatches: int = 2
    model: str = "tiny-sft"
    admission: str = "never"
    revoke_at: int = -1
    """The measured step before which a slot is revoked (-1: none)."""
    grant_at: int = -1
    """The measured step before which a slot is given (back) (-1: none)."""
    steps: int = 0
    """Measured steps; 0: ``--steps``."""
    override_at: int = -1
    """The measured step before which a person's plan (``Controller.override``) is applied."""
    override: tuple[tuple[str, tuple[int, int, int], tuple[tuple[int, ...], ...]], ...] = ()
    """That plan: the running one with these model-stages' (dp, tp, pp) and units changed."""
    fixed: tuple[tuple[str, tuple[int, int]], ...] = ()
    """Model-stages whose (tp, pp) the controller must keep (``JobPolicy.fixed_layouts``):
    the controller still picks the plan, among those layouts."""


_MODEL_STAGES = tuple(
    (role, stage)
    for stage, roles in (
        ("generation", ("actor",)),
        ("inference", ("actor", "ref", "critic", "reward")),
        ("training", ("actor", "critic")),
    )
    for role in roles
)

SHAPES = (
    Shape("sft-s2-b8-t16-e1", slots=2, batch=8, max_new_tokens=16, epochs=1),
    Shape("sft-s3-b12-t24-e2", slots=3, batch=12, max_new_tokens=24, epochs=2),
    Shape("sft-s4-b16-t24-e2", slots=4, batch=16, max_new_tokens=24, epochs=2),
    Shape("sft-s4-b32-t12-e1", slots=4, batch=32, max_new_tokens=12, epochs=1, minibatches=4),
    Shape("sft-s2-b16-t48-e1", slots=2, batch=16, max_new_tokens=48, epochs=1),
    Shape("llama-s2-b8-t16-e1", slots=2, batch=8, max_new_tokens=16, epochs=1, model="tiny-llama"),
    Shape(
        "sft-s2-b8-t16-e1-tp2",
        slots=2,
        batch=8,
        max_new_tokens=16,
        epochs=1,
        fixed=tuple((f"{r}@{st}", (2, 1)) for r, st in _MODEL_STAGES),
    ),
    Shape(
        "llama-s4-b16-t16-e1-pp2",
        slots=4,
        batch=16,
        max_new_tokens=16,
        epochs=1,
        model="tiny-llama",
        fixed=tuple((f"{r}@{st}", (1, 2)) for r, st in _MODEL_STAGES if st != "generation"),
    ),
    Shape(
        "sft-s4-b16-t24-e2-revoke",
        slots=4,
        batch=16,
        max_new_tokens=24,
        epochs=2,
        admission="payback",
        # training moved by a person's plan (actor to two replicas, critic to slots 2 and 3:
        # state moves), then slot 3 revoked with a critic replica on it (the urgent path),
        # then a slot given back (payback may move onto it)
        override_at=2,
        override=(
            ("actor@training", (2, 1, 1), ((0,), (1,))),
            ("critic@training", (2, 1, 1), ((2,), (3,))),
        ),
        revoke_at=6,
        grant_at=10,
        steps=14,
    ),
)


# --- the real job, recorded -----------------------------------------------------------------------


def _fn_name(fn) -> str:
    return getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))


def recording_classes():
    """A ``PpoRuntime`` and a ``RayEngine`` that record what each step and transition did
    (imported here: Ray's import must follow ``runtime.engine``'s, and ``--predict-only`` needs
    neither)."""
    from runtime.engine.ray_engine import RayEngine
    from runtime.ppo import slot_work
    from runtime.ppo.job import PpoRuntime, _split

    class RecordingRuntime(PpoRuntime):
        """Records per step: lengths, model-stage seconds, remote calls, host-side phases."""

        def begin(self) -> None:
            self.rec: dict = {"calls": [], "host": {}, "syncs": []}
            self._phase = "prepare"

        def _timed(self, key: str, fn, *args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - started
                self.rec["host"][key] = self.rec["host"].get(key, 0.0) + took

        def _prepare(self, engine, units, workload):
            self._phase = "prepare"
            return self._timed("prepare_s", super()._prepare, engine, units, workload)

        def _sync(self, engine, *pairs):
            # the first sync of a step is generation's, the second inference's
            self._phase = "generation" if not self.rec["syncs"] else "inference"
            started = time.perf_counter()
            nbytes = super()._sync(engine, *pairs)
            self.rec["syncs"].append(
                {
                    "stage": self._phase,
                    "seconds": time.perf_counter() - started,
                    "bytes": nbytes,
                    "pairs": [
                        {
                            "sources": [list(u.slots) for u in sources],
                            "targets": [list(u.slots) for u in targets],
                        }
                        for sources, targets in pairs
                    ],
                }
            )
            return nbytes

        def _generate(self, engine, units, prompts, params, micro_batch):
            self._phase = "generation"
            rollout = self._timed(
                "generate_s", super()._generate, engine, units, prompts, params, micro_batch
            )
            self.rec["lengths"] = [int(n) for n in rollout["response_mask"].sum(dim=1)]
            self.rec["prompt_lengths"] = [len(p.tokens) for p in prompts]
            self.rec["prompt_width"] = int(rollout["prompt_length"])
            self.rec["generation_units"] = [
                {"unit": u.unit_id, "slots": list(u.slots), "rows": [r.start, r.stop]}
                for u, r in zip(units, _split(len(prompts), len(units)), strict=True)
            ]
            self.rec["generation_micro_batch"] = micro_batch
            return rollout

        def _infer(self, engine, units, rollout, *, modes, micro_batches):
            self._phase = "inference"
            self.rec["micro_batches"] = dict(micro_batches)
            self.rec["modes"] = dict(modes)
            return self._timed(
                "score_s",
                super()._infer,
                engine,
                units,
                rollout,
                modes=modes,
                micro_batches=micro_batches,
            )

        def _train(self, engine, units, micro_batches, **batch):
            self._phase = "training"
            return self._timed("train_s", super()._train, engine, units, micro_batches, **batch)

        def _memory(self, engine):
            self._phase = "after"
            return self._timed("memory_s", super()._memory, engine)

        def save_checkpoint(self, engine):
            self._phase = "checkpoint"
            return self._timed("checkpoint_s", super().save_checkpoint, engine)

        def step(self, engine, plan, workload, step):
            self.begin()
            report = super().step(engine, plan, workload, step)
            self.rec["model_stage_seconds"] = dict(getattr(self, "_measured", {}))
            self._phase = "between"
            return report

    class RecordingEngine(RayEngine):
        """Records each step's plan and workload, each transition's DAG, each restart."""

        def __init__(self, pool, **kwargs):
            super().__init__(pool, **kwargs)
            self.transitions: list[dict] = []
            self.restarts: list[dict] = []
            self.steps_seen: list[tuple[Plan, PpoWorkload]] = []
            self._trace(pool)

        def _trace(self, pool) -> None:
            """Every ``SlotPool.run``/``start`` the job makes, with its stage and seconds."""
            lock = threading.Lock()
            run, start = pool.run, pool.start
            job = self.job

            def note(kind, fn, on, seconds, in_slot=None):
                rec = getattr(job, "rec", None)
                if rec is None:
                    return
                call = {
                    "stage": getattr(job, "_phase", "?"),
                    "fn": _fn_name(fn),
                    "kind": kind,
                    "slots": len(on) if on is not None else pool.num_slots,
                    "seconds": seconds,
                }
                if in_slot:
                    call["in_slot_max_s"] = max(in_slot)
                    call["in_slot_min_s"] = min(in_slot)
                with lock:
                    rec["calls"].append(call)

            inside = threading.local()  # ``run`` is ``start`` then ``wait``: counted once

            def traced_run(fn, per_rank_kwargs=None, *, on=None, **common):
                # Through ``slot_work.timed``: each slot also says how long the function ran
                # there, so the round trip splits into the slots' work and the rest (Ray,
                # pickling, the driver waiting).
                slots = list(range(pool.num_slots)) if on is None else list(on)
                per_rank = per_rank_kwargs or [{} for _ in slots]
                wrapped = [{"fn": fn, "kwargs": {**common, **kw}} for kw in per_rank]
                started = time.perf_counter()
                inside.run = True
                try:
                    results = run(slot_work.timed, wrapped, on=on)
                finally:
                    inside.run = False
                took = time.perf_counter() - started
                note("run", fn, on, took, [seconds for _, seconds in results])
                return [result for result, _ in results]

            def traced_start(fn, per_rank_kwargs=None, *, on=None, **common):
                if getattr(inside, "run", False):
                    return start(fn, per_rank_kwargs, on=on, **common)
                started = time.perf_counter()
                try:
                    return start(fn, per_rank_kwargs, on=on, **common)
                finally:  # the call only started: its wait is counted where it is waited for
                    note("start", fn, on, time.perf_counter() - started)

            pool.run, pool.start = traced_run, traced_start
            self._untrace = lambda: (
                pool.__dict__.pop("run", None),
                pool.__dict__.pop("start", None),
            )

        def step(self, plan, workload, step):
            self.steps_seen.append((plan, workload))
            return super().step(plan, workload, step)

        def transition(self, dag):
            before = pickle.dumps(copy.deepcopy(dag))  # as the controller compiled it
            mark = len(self.events)
            outcome = super().transition(dag)
            self.transitions.append(
                {
                    "ok": outcome.ok,
                    "seconds": outcome.seconds,
                    "failure": outcome.failure,
                    "predicted_s": dag.predicted_s,
                    "dag": dag.to_json(),
                    "dag_pickle": base64.b64encode(before).decode(),
                    "events": self.events[mark:],
                }
            )
            return outcome

        def restart(self, plan, workload):
            seconds = super().restart(plan, workload)
            self.restarts.append({"seconds": seconds, "plan": plan.to_json()})
            return seconds

    return RecordingRuntime, RecordingEngine


def workload_json(workload: PpoWorkload) -> dict:
    out = {
        f.name: getattr(workload, f.name)
        for f in dataclasses.fields(workload)
        if f.name != "models"
    }
    out["models"] = {role: model.name for role, model in workload.models.items()}
    return out


def workload_from_json(data: dict) -> PpoWorkload:
    catalog = default_catalog()
    fields = {k: v for k, v in data.items() if k != "models"}
    models = {role: catalog.model(name) for role, name in data["models"].items()}
    return PpoWorkload(models=models, **fields)


def run_shape(shape: Shape, pool, args) -> dict:
    from runtime.control import Controller, JobPolicy, run_job
    from runtime.ppo.algorithm import PPOConfig
    from runtime.ppo.job import PpoJobConfig

    runtime_cls, engine_cls = recording_classes()
    measured = shape.steps or args.steps
    warmup = args.warmup
    transition_shape = shape.revoke_at >= 0 or shape.grant_at >= 0
    config = PpoJobConfig(
        model=shape.model,
        batch_size=shape.batch,
        max_new_tokens=shape.max_new_tokens,
        warmup_steps=20,
        # a checkpoint only where a revoked slot may take a model-stage's every unit
        checkpoint_every=5 if transition_shape else 0,
        seed=args.seed,
        ppo=PPOConfig(
            kl_coef=0.01, epochs=shape.epochs, minibatch_size=shape.batch // shape.minibatches
        ),
    )
    job = runtime_cls(config, workdir=tempfile.mkdtemp(prefix=f"nereus-twin-{shape.name}-"))
    job.initial_weights()  # the driver's supervised warm-up: not part of any step
    engine = engine_cls(pool, job=job, pool_size=shape.slots)
    events: list[dict] = []
    controller = Controller(
        job.workload(),
        default_catalog().accelerator("cpu-slot"),
        JobPolicy(admission=shape.admission, fixed_layouts=bool(shape.fixed)),
        emit=events.append,
        fixed={name: tuple(layout) for name, layout in shape.fixed} or None,
    )
    steps: list[dict] = []
    seen: dict = {"transitions": 0, "restarts": 0}

    def between_steps(step: int) -> bool:
        at = step - warmup
        what = []
        if at == shape.override_at >= 0:
            wanted = controller.plan.to_json()
            changes = {name: (layout, units) for name, layout, units in shape.override}
            for ms in wanted["model_stages"]:
                if ms["name"] in changes:
                    (dp, tp, pp), units = changes[ms["name"]]
                    ms["layout"] = {"dp": dp, "tp": tp, "pp": pp}
                    ms["units"] = [list(u) for u in units]
            what.append({"override": controller.override(wanted, engine)})
        if at == shape.revoke_at >= 0:
            what.append({"revoked": engine.revoke()})
        if at == shape.grant_at >= 0:
            what.append({"granted": engine.grant()})
        seen["pool"] = what
        return True

    def on_step(report) -> None:
        now = time.perf_counter()
        loop_s, seen["last"] = now - seen.get("last", started), now
        plan, workload = engine.steps_seen[-1]
        rec = getattr(job, "rec", {})
        after_move = (
            len(engine.transitions) != seen["transitions"]
            or len(engine.restarts) != seen["restarts"]
        )
        seen["transitions"], seen["restarts"] = len(engine.transitions), len(engine.restarts)
        steps.append(
            {
                "shape": shape.name,
                "step": report.step,
                "warmup": report.step < warmup,
                "after_move": after_move,
                "pool_change": seen.pop("pool", []),
                "ok": report.ok,
                "failure": report.failure,
                "seconds": report.seconds,
                "loop_s": loop_s,
                "stage_seconds": dict(report.stage_seconds),
                "model_stage_seconds": rec.get("model_stage_seconds", {}),
                "rebuild_seconds": dict(report.rebuild_seconds),
                "gen_len": report.gen_len,
                "lengths": rec.get("lengths"),
                "prompt_lengths": rec.get("prompt_lengths"),
                "prompt_width": rec.get("prompt_width"),
                "generation_units": rec.get("generation_units"),
                "generation_micro_batch": rec.get("generation_micro_batch"),
                "micro_batches": rec.get("micro_batches"),
                "modes": rec.get("modes"),
                "host": rec.get("host", {}),
                "syncs": list(rec.get("syncs", [])),
                "calls": list(rec.get("calls", [])),
                "plan": plan.to_json(),
                "workload": workload_json(workload),
                "sync_bytes": report.extra.get("sync_bytes"),
                "generated_on": report.extra.get("generated_on"),
                "stats": report.extra.get("stats", {}),
            }
        )
        controller.emit_step(report)

    load = os.getloadavg()
    started = time.perf_counter()  # read by on_step: a step's loop time is since the last
    summary = run_job(
        engine, controller, warmup + measured, between_steps=between_steps, on_step=on_step
    )
    wall = time.perf_counter() - started
    engine.stop()
    engine._untrace()
    decisions = [
        {
            "step": e.get("step"),
            "trigger": e.get("trigger", {}).get("kind"),
            "reason": e.get("reason", ""),
        }
        for e in events
        if e["event"] == "control.decision"
    ]
    transition_steps = [e.get("step") for e in events if e["event"] == "control.transition"]
    for t, step in zip(engine.transitions, transition_steps, strict=False):
        t["after_step"] = step
    return {
        "shape": dataclasses.asdict(shape),
        "config": {
            "model": config.model,
            "batch_size": config.batch_size,
            "max_new_tokens": config.max_new_tokens,
            "ppo_epochs": config.ppo.epochs,
            "minibatch_size": config.ppo.minibatch_size,
            "temperature": config.temperature,
            "reward": config.reward,
            "generation_backend": config.generation_backend,
            "checkpoint_every": config.checkpoint_every,
        },
        "warmup_steps": warmup,
        "measured_steps": measured,
        "wall_s": wall,
        "loadavg_start": list(load),
        "loadavg_end": list(os.getloadavg()),
        "summary": {
            "steps": summary.steps,
            "failed_steps": summary.failed_steps,
            "transitions": summary.transitions,
            "transition_seconds": summary.transition_seconds,
            "restarts": summary.restarts,
            "restart_seconds": summary.restart_seconds,
            "probe_seconds": summary.probe_seconds,
        },
        "decisions": decisions,
        "steps": steps,
        "transitions": engine.transitions,
        "restarts": engine.restarts,
    }


def measure(args) -> dict:
    import torch

    from runtime.engine.ray_cluster import ray_connection
    from runtime.engine.slots import SlotPool

    chosen = [s for s in SHAPES if not args.shapes or s.name in args.shapes]
    pool_size = max(s.slots + (s.grant_at >= 0) for s in chosen)
    started = time.perf_counter()
    load = os.getloadavg()
    out: dict = {"shapes": []}
    with ray_connection(None, num_cpus=pool_size):
        for shape in chosen:
            # A pool of the shape's own size (one more slot where one is given during the run):
            # every slot of a pool takes part in the per-step calls over the pool (the units'
            # preparation, the liveness probe, memory polling), as in a job on that many GPUs.
            t0 = time.perf_counter()
            pool = SlotPool.create(shape.slots + (shape.grant_at >= 0), call_timeout_s=300)
            try:
                result = run_shape(shape, pool, args)
            finally:
                pool.close()
            result["pool_setup_s"] = pool.setup_s
            out["shapes"].append(result)
            means = {
                stage: statistics.fmean(
                    s["stage_seconds"].get(stage, 0.0)
                    for s in result["steps"]
                    if s["ok"] and not s["warmup"]
                )
                for stage in STAGES
            }
            print(
                f"{shape.name}: {time.perf_counter() - t0:.1f} s wall, "
                + ", ".join(f"{k} {v:.3f} s" for k, v in means.items())
                + f", transitions {result['summary']['transitions']}, "
                f"restarts {result['summary']['restarts']}, load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    import ray

    out["measured_on"] = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "nproc": os.cpu_count(),
        "cores": len(os.sched_getaffinity(0)),
        "pool_slots": pool_size,
        "loadavg_start": list(load),
        "loadavg_end": list(os.getloadavg()),
        "wall_s": time.perf_counter() - started,
        "args": {k: (list(v) if isinstance(v, set | tuple) else v) for k, v in vars(args).items()},
    }
    return out


def save_raw(raw: dict, path: Path) -> None:
    """The raw records, each shape's plans written once (``plans``; a step names its own by
    ``plan_id``): ``load_raw`` gives every step its ``plan`` back."""
    out = copy.deepcopy(raw)
    for shape in out["shapes"]:
        plans: list[dict] = []
        for step in shape["steps"]:
            plan = step.pop("plan")
            if plan not in plans:
                plans.append(plan)
            step["plan_id"] = plans.index(plan)
        shape["plans"] = plans
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, separators=(",", ":"), default=str) + "\n")


def load_raw(path: Path) -> dict:
    raw = json.loads(path.read_text())
    for shape in raw["shapes"]:
        for step in shape["steps"]:
            if "plan" not in step:
                step["plan"] = shape["plans"][step["plan_id"]]
    return raw


# --- the twin's prediction --------------------------------------------------------------------


class TwinUnavailableError(RuntimeError):
    """The twin (``runtime.twin``) or its CPU-slot profile cannot be loaded."""


def load_twin():
    """``ClusterTwin(device("cpu-slot"), seed=0, noise=0.0, interference=0.0)``."""
    try:
        from runtime.twin import ClusterTwin, device
    except ImportError as exc:
        raise TwinUnavailableError(
            f"the cluster twin cannot be imported ({exc}): runtime/twin/ must provide "
            "ClusterTwin and device (see this script's docstring); the raw records stay in "
            f"{RAW.relative_to(ROOT)} for --predict-only once it exists"
        ) from exc
    if not PROFILE.is_file():
        raise TwinUnavailableError(
            f"{PROFILE.relative_to(ROOT)} is missing: run benchmarks/cpu_slot_profile.py first"
        )
    return ClusterTwin(device("cpu-slot"), seed=0, noise=0.0, interference=0.0)


def predict(record: dict, twin=None) -> dict:
    """The twin's seconds for one measured step record: ``stage_seconds`` and
    ``model_stage_seconds``."""
    twin = twin or load_twin()
    plan = Plan.from_json(record["plan"])
    workload = workload_from_json(record["workload"])
    lengths = record.get("lengths") or [max(1, round(record["gen_len"]))] * workload.global_batch
    step = twin.step(plan, workload, lengths=list(lengths), at_s=0.0, backend="torch")
    return {
        "stage_seconds": dict(step.stage_seconds),
        "model_stage_seconds": dict(getattr(step, "model_stage_seconds", {}) or {}),
    }


def predict_transition(record: dict, twin=None) -> float | None:
    """The twin's seconds for one measured transition: the DAG as the controller compiled it,
    played in the executor's order (``runtime.transition.simulate``) with the twin's time for
    each primitive, as the simulated engine plays it."""
    from runtime.transition.simulate import simulate
    from runtime.twin import primitive_seconds

    twin = twin or load_twin()
    dag = pickle.loads(base64.b64decode(record["dag_pickle"]))
    if hasattr(twin, "transition_seconds"):  # a stand-in of the tests
        return float(twin.transition_seconds(dag))
    result = simulate(dag, durations=lambda node: primitive_seconds(twin, node.primitive))
    return float(result.makespan_s)


def _segments(steps: list[dict]) -> list[list[dict]]:
    """The measured steps cut where the plan changed: each run of steps on one plan, the step
    right after a move (its builds, its joining units) left out."""
    out: list[list[dict]] = []
    last = None
    for s in steps:
        if s["warmup"] or not s["ok"]:
            continue
        key = json.dumps(
            [(ms["name"], ms["units"], ms["micro_batch"]) for ms in s["plan"]["model_stages"]]
        )
        if key != last:
            out.append([])
            last = key
        if not s["after_move"]:
            out[-1].append(s)
    return [seg for seg in out if seg]


def compare(raw: dict, twin) -> dict:
    rows: list[dict] = []
    transitions: list[dict] = []
    for shape in raw["shapes"]:
        for index, seg in enumerate(_segments(shape["steps"])):
            predictions = [predict(s, twin) for s in seg]
            name = shape["shape"]["name"] + (f"#{index}" if index else "")
            slots = sorted({u for ms in seg[0]["plan"]["model_stages"] for u in _flat(ms)})
            keys = [(stage, "stage_seconds") for stage in STAGES]
            names = sorted({k for s in seg for k in s["model_stage_seconds"]})
            keys += [(k, "model_stage_seconds") for k in names]
            for key, field in keys:
                measured = [s[field].get(key) for s in seg]
                predicted = [p[field].get(key) for p in predictions]
                if any(v is None for v in measured):
                    continue
                mean = statistics.fmean(measured)
                pred = (
                    statistics.fmean(predicted) if all(v is not None for v in predicted) else None
                )
                ratio = pred / mean if pred is not None and mean > 0 else None
                rows.append(
                    {
                        "shape": name,
                        "slots": len(slots),
                        "key": key,
                        "kind": "stage" if field == "stage_seconds" else "model-stage",
                        "steps": len(seg),
                        "measured_mean_s": mean,
                        "measured_median_s": statistics.median(measured),
                        "measured_stdev_s": statistics.stdev(measured) if len(measured) > 1 else 0,
                        "predicted_s": pred,
                        "ratio": ratio,
                        "within_goal": ratio is not None and abs(ratio - 1) <= GOAL,
                    }
                )
        for t in shape["transitions"]:
            predicted = predict_transition(t, twin)
            nodes = [
                {
                    "id": n["id"],
                    "kind": n["kind"],
                    "model_stage": n["model_stage"],
                    "actual_s": n["actual_s"],
                }
                for n in t["dag"]["nodes"]
            ]
            transitions.append(
                {
                    "shape": shape["shape"]["name"],
                    "after_step": t.get("after_step"),
                    "nodes": nodes,
                    "measured_s": t["seconds"],
                    "planner_predicted_s": t["predicted_s"],
                    "twin_predicted_s": predicted,
                    "ratio": (
                        predicted / t["seconds"]
                        if predicted is not None and t["seconds"] > 0
                        else None
                    ),
                }
            )
    stage_rows = [r for r in rows if r["kind"] == "stage"]
    return {
        "goal": f"each stage's mean predicted within {GOAL:.0%} of the measured mean",
        "met": all(r["within_goal"] for r in stage_rows),
        "stages_within_goal": sum(r["within_goal"] for r in stage_rows),
        "stages": len(stage_rows),
        "rows": rows,
        "transitions": transitions,
    }


def _flat(ms: dict) -> list[int]:
    return [s for unit in ms["units"] for s in unit]


def print_measured(raw: dict) -> None:
    """The real per-stage seconds, without the twin (what ``--measure-only`` shows)."""
    headers = ["shape", "plan", "steps", "gen s", "inf s", "train s", "step s", "gen_len"]
    rows = []
    for shape in raw["shapes"]:
        for index, seg in enumerate(_segments(shape["steps"])):
            layouts = " ".join(
                f"{ms['name'].partition('@')[2][:3]}"
                f"({ms['layout']['dp']},{ms['layout']['tp']},{ms['layout']['pp']})"
                for ms in seg[0]["plan"]["model_stages"]
                if ms["name"].startswith("actor")
            )
            rows.append(
                [
                    shape["shape"]["name"] + (f"#{index}" if index else ""),
                    layouts,
                    len(seg),
                    *(
                        f"{statistics.fmean(s['stage_seconds'][k] for s in seg):.3f}"
                        for k in STAGES
                    ),
                    f"{statistics.fmean(s['seconds'] for s in seg):.3f}",
                    f"{statistics.fmean(s['gen_len'] for s in seg):.1f}",
                ]
            )
    _report.print_table(headers, rows)
    for shape in raw["shapes"]:
        for t in shape["transitions"]:
            kinds = {}
            for n in t["dag"]["nodes"]:
                kinds[n["kind"]] = kinds.get(n["kind"], 0) + 1
            print(
                f"{shape['shape']['name']}: transition after step {t.get('after_step')}: "
                f"{t['seconds']:.3f} s, nodes {kinds}, planner predicted {t['predicted_s']:.3f} s"
            )
        for r in shape["restarts"]:
            print(f"{shape['shape']['name']}: restart {r['seconds']:.3f} s")


def print_comparison(result: dict) -> None:
    headers = ["shape", "stage", "steps", "mean s", "median s", "twin s", "twin/real", "ok"]
    rows = [
        [
            r["shape"],
            r["key"],
            r["steps"],
            f"{r['measured_mean_s']:.4f}",
            f"{r['measured_median_s']:.4f}",
            "-" if r["predicted_s"] is None else f"{r['predicted_s']:.4f}",
            "-" if r["ratio"] is None else f"{r['ratio']:.2f}",
            "yes" if r["within_goal"] else "no",
        ]
        for r in result["rows"]
    ]
    _report.print_table(headers, rows)
    if result["transitions"]:
        _report.print_table(
            ["shape", "after step", "nodes", "measured s", "planner s", "twin s", "twin/real"],
            [
                [
                    t["shape"],
                    t["after_step"],
                    len(t["nodes"]),
                    f"{t['measured_s']:.4f}",
                    f"{t['planner_predicted_s']:.4f}",
                    "-" if t["twin_predicted_s"] is None else f"{t['twin_predicted_s']:.4f}",
                    "-" if t["ratio"] is None else f"{t['ratio']:.2f}",
                ]
                for t in result["transitions"]
            ],
        )
    print(
        f"goal ({result['goal']}): {result['stages_within_goal']}/{result['stages']} stages; "
        f"{'met' if result['met'] else 'not met'}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--measure-only", action="store_true", help="run the real jobs, save raw")
    mode.add_argument("--predict-only", action="store_true", help="predict from the raw file")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per shape")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per shape")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--shapes",
        type=lambda s: set(s.split(",")),
        default=None,
        help="comma-separated shape names (default: all): " + ", ".join(s.name for s in SHAPES),
    )
    parser.add_argument("--raw", type=Path, default=RAW, help="the raw records' file")
    args = parser.parse_args()
    if not args.predict_only:
        raw = measure(args)
        save_raw(raw, args.raw)
        print_measured(raw)
        print(f"wrote {args.raw} ({raw['measured_on']['wall_s']:.0f} s wall)")
        if args.measure_only:
            return 0
    raw = load_raw(args.raw)
    try:
        twin = load_twin()
    except TwinUnavailableError as exc:
        print(f"no prediction: {exc}", file=sys.stderr)
        return 2
    result = compare(raw, twin)
    print_comparison(result)
    path = _report.write(
        "twin_validation",
        {"raw": str(args.raw.relative_to(ROOT)), "measured_on": raw["measured_on"], **result},
    )
    print(f"wrote {path}")
    return 0 if result["met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
