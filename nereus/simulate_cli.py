"""``nereus simulate``: the controller, planner and transitions on the simulated cluster.

Everything it prints is simulated: step times, transitions and restarts come from the simulated
cluster twin's physics (runtime/twin), never from hardware.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import typer

from nereus.client import loads_strict
from runtime.control import Controller, JobPolicy, PolicyError, run_job
from runtime.engine import hindsight
from runtime.engine.sim import SimulatedEngine
from runtime.engine.traces import (
    MAX_GPUS,
    MAX_STEPS,
    SHAPES,
    TraceError,
    generate,
    load,
    min_steps,
)
from runtime.planner import PlanningError, PpoWorkload, default_catalog
from runtime.planner.catalog import CatalogError

POLICIES = {
    "nereus": {"admission": "payback"},
    "dynarl": {"admission": "always_faster"},
    "never": {"admission": "never"},
    "restart": {"admission": "restart"},
    # the seed paper's baseline: the launch layouts and micro-batches kept, DP following the pool
    # (a micro-batch halves only after a step ran out of memory and cost the job a restart)
    "dp-only": {"admission": "payback", "fixed_layouts": True, "fixed_micro_batches": True},
    "relaxed-dp": {"admission": "payback", "fixed_layouts": True},  # micro-batches free
}


MAX_SEED = 2**31 - 1
"""The largest seed, as a simulated job's spec takes."""


class SimulateError(ValueError):
    """Bad input to ``nereus simulate``; the message names the option."""


def load_trace(spec: str, *, steps: int | None, gpus: int | None, seed: int, accelerator: str):
    """A trace file, or ``gen:<shape>`` for a generated one (with a spot-like pool)."""
    if spec.startswith("gen:"):
        shape = spec[4:]
        if shape not in SHAPES:
            raise SimulateError(
                f"--trace: unknown shape {shape!r}; choose one of {', '.join(SHAPES)}"
            )
        if steps is not None and steps < min_steps(shape):
            raise SimulateError(
                f"--steps: a {shape} trace needs at least {min_steps(shape)} steps, got {steps}"
            )
        return generate(
            shape,
            seed=seed,
            steps=steps or 1000,
            gpus=gpus or 16,
            accelerator=accelerator,
            spot=True,
        )
    if not Path(spec).exists():
        raise SimulateError(f"--trace: no such file {spec!r} (or use gen:<shape>)")
    if not Path(spec).is_file():
        raise SimulateError(f"--trace: {spec!r} is not a file")
    trace = load(spec)  # the file as written: its errors name its lines
    if gpus:
        try:  # its failures must still leave a slot on the smaller pool
            trace = load(spec, gpus=gpus)
        except TraceError as exc:
            raise SimulateError(f"--gpus {gpus}: {exc}") from None
    return dataclasses.replace(trace, steps=steps) if steps else trace


def _check_writable(option: str, path: Path) -> None:
    """Before the run, not after it: a file ``option`` can write, so that a long simulation's
    output is not lost at its end. Nothing is created or opened here: opening a named pipe, say,
    would end its reader's input before the run wrote anything."""
    if path.is_dir():
        raise SimulateError(f"{option}: {str(path)!r} is a folder; give a file name")
    folder = path.resolve().parent
    if not folder.is_dir():
        raise SimulateError(f"{option}: no folder to write {str(path)!r} in")
    # A file not there yet (a dangling link's target too) is made at the end of the run.
    if not (os.access(path, os.W_OK) if path.exists() else os.access(folder, os.W_OK | os.X_OK)):
        raise SimulateError(f"{option}: cannot write {str(path)!r}: permission denied")


def simulate(
    *,
    trace_spec: str,
    policy: str,
    gpus: int | None,
    model: str,
    gpu: str,
    steps: int | None,
    seed: int,
    policy_file: str | None,
    as_json: bool,
    events_file: str | None,
    counterfactual: bool = False,
) -> int:
    try:
        if policy not in POLICIES:
            raise SimulateError(
                f"--policy: unknown {policy!r}; choose one of {', '.join(POLICIES)}"
            )
        if gpus is not None and not 1 <= gpus <= MAX_GPUS:
            raise SimulateError(
                f"--gpus: must be from 1 to {MAX_GPUS} (the simulated cluster's most), got {gpus}"
            )
        if not 0 <= seed <= MAX_SEED:
            raise SimulateError(f"--seed: must be from 0 to {MAX_SEED}, got {seed}")
        for option, value in (
            ("--trace", trace_spec),
            ("--events", events_file),
            ("--policy-file", policy_file),
        ):
            if value is not None and not value.strip():
                raise SimulateError(f"{option}: empty; give a file name")
        if steps is not None and not 1 <= steps <= MAX_STEPS:
            raise SimulateError(f"--steps: must be from 1 to {MAX_STEPS}, got {steps}")
        if events_file:
            _check_writable("--events", Path(events_file))
        settings = dict(POLICIES[policy])
        if policy_file:
            try:
                extra = loads_strict(Path(policy_file).read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:  # ValueError: not JSON, or not UTF-8
                raise SimulateError(f"--policy-file: cannot read a JSON policy ({exc})") from None
            if not isinstance(extra, dict):
                raise SimulateError(
                    f"--policy-file: expected a JSON object of policy fields, got "
                    f"{type(extra).__name__}"
                )
            clashing = sorted(k for k in extra if k in settings and extra[k] != settings[k])
            if clashing:
                raise SimulateError(
                    f"--policy-file: {clashing[0]} is {settings[clashing[0]]!r} under --policy "
                    f"{policy}; leave it out of the file or choose another --policy"
                )
            settings = {**extra, **settings}
        job_policy = JobPolicy.from_json(settings)
        catalog = default_catalog()
        accelerator = catalog.accelerator(gpu)
        trace = load_trace(
            trace_spec, steps=steps, gpus=gpus, seed=seed, accelerator=accelerator.name
        )
        if trace.accelerator != accelerator.name:
            raise SimulateError(
                f"--gpu: the trace is for {trace.accelerator}, not {accelerator.name}"
            )
        workload = PpoWorkload.for_model(catalog.model(model), gen_len=trace.gen_len_at(0))

        def start() -> tuple[SimulatedEngine, Controller]:
            return (
                SimulatedEngine(trace, accelerator, seed=seed),
                Controller(workload, accelerator, job_policy),
            )

        engine, controller = start()
        summary = run_job(engine, controller, trace.steps)
    except (SimulateError, TraceError, PolicyError, CatalogError, PlanningError) as exc:
        typer.echo(f"nereus simulate: {exc}", err=True)
        return 2
    if events_file:
        try:
            # Every line says it is simulated, the plans and decisions too, not only the steps
            # and transitions that the engine labels: a line read alone must not pass for a
            # real job's.
            lines = (json.dumps({**e, "simulated": True}) for e in controller.events)
            Path(events_file).write_text("\n".join(lines) + "\n")
        except OSError as exc:
            typer.echo(f"nereus simulate: --events: cannot write {events_file}: {exc}", err=True)
            return 2
    transitions = [e for e in controller.events if e["event"] == "control.transition"]
    built_ahead = sum(e["dag"]["built_ahead"] > 0 for e in transitions)
    joined = sum(bool(e["dag"]["joining"]) for e in transitions)
    seen = hindsight.moves(controller.events, engine, workload)
    looked_back = hindsight.summary(seen)
    replayed = None
    if counterfactual:
        try:
            replayed = hindsight.replayed(start, trace.steps, seen, engine.now())
        except (RuntimeError, PlanningError) as exc:  # a replay that could not be made
            typer.echo(f"nereus simulate: --counterfactual: {exc}", err=True)
            return 1
    result = {
        "simulated": True,
        "trace": trace.name,
        "policy": policy,
        **summary.to_json(),
        "built_ahead": built_ahead,
        "joined": joined,
        "hindsight": {**looked_back, "moves": [m.to_json() for m in seen]},
        **({"counterfactual": replayed} if replayed is not None else {}),
    }
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return 0
    typer.echo(
        f"SIMULATED: {model} on {trace.gpus} × {accelerator.name}, trace {trace.name}, "
        f"policy {policy}"
    )
    typer.echo(f"  steps              {summary.steps} ({summary.failed_steps} failed)")
    typer.echo(f"  mean s/step        {summary.mean_step_s:.2f}")
    typer.echo(f"  run time           {summary.seconds / 3600:.2f} h")
    typer.echo(
        f"  transitions        {summary.transitions}, {summary.transition_seconds:.1f} s "
        f"({summary.transition_seconds / summary.seconds:.3%} of the run; "
        f"{built_ahead} with new units built ahead on idle slots, {joined} with new units "
        "built while the next step generated on the built ones)"
    )
    why = ", ".join(f"{n} {why}" for why, n in looked_back["transitions"].items() if n)
    typer.echo(f"  made for           {why or 'no transition'}")
    if looked_back["moves_for_saving"]:
        typer.echo(
            f"  in hindsight       {looked_back['repaid']} of {looked_back['moves_for_saving']} "
            f"moves made for their saving truly repaid their cost; their true saving less "
            f"their cost, in all: {looked_back['net_s']:+.1f} s (the twin replayed, over each "
            "move's life)"
        )
    if replayed is not None:
        whole, alone = replayed["without_saving_moves"], replayed["moves"]
        typer.echo(
            f"  counterfactual     without its moves made for their saving the run takes "
            f"{whole['without_s'] / 3600:.2f} h: they bought {whole['net_s']:+.1f} s, their "
            "cost and all that followed from them included"
        )
        met = [m for m in alone if m["met"]]
        if met:
            typer.echo(
                f"                     each refused alone: {replayed['paid']} of "
                f"{len(met)} paid: "
                + ", ".join(f"step {m['step']} {m['net_s']:+.1f} s" for m in met)
            )
        if replayed["unmet"]:
            typer.echo(
                f"                     {replayed['unmet']} could not be refused alone (the "
                "replay did not meet them at their decision)"
            )
    typer.echo(f"  restarts           {summary.restarts}, {summary.restart_seconds:.1f} s")
    return 0
