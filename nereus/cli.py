"""The ``nereus`` command line."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Annotated

import typer

import nereus

app = typer.Typer(
    help="Nereus: adaptive parallelism for LLM post-training.",
    no_args_is_help=True,
    add_completion=False,
)

_MARKS = {"ok": "✓", "warn": "!", "fail": "✗"}


@app.command()
def version() -> None:
    """Print the Nereus version."""
    typer.echo(f"nereus {nereus.__version__}")


@app.command()
def doctor(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Check this installation: Python, PyTorch, Ray, the database, Redis, kernels and GPUs."""
    from nereus.doctor import run_all

    findings = run_all()
    if as_json:
        typer.echo(json.dumps([dataclasses.asdict(f) for f in findings], indent=2))
    else:
        for f in findings:
            typer.echo(f"{_MARKS[f.status]} {f.name:<14} {f.detail}")
            if f.hint and f.status != "ok":
                typer.echo(f"  {'':<14} hint: {f.hint}")
    raise typer.Exit(code=1 if any(f.status == "fail" for f in findings) else 0)


@app.command()
def demo(
    host: Annotated[
        str, typer.Option(help="Address to serve on (loopback by default).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="NEREUS_DEMO_PORT", min=1, max=65535)] = 8000,
    steps: Annotated[int, typer.Option(min=1, max=1_000_000, help="Steps of the demo job.")] = 2000,
    slots: Annotated[int, typer.Option(min=1, max=8, help="CPU slots of the demo job.")] = 2,
) -> None:
    """Run the service on this machine (Ray head, Celery worker, web server) with a demo job."""
    from nereus.demo import run_demo

    raise typer.Exit(code=run_demo(host=host, port=port, num_steps=steps, num_slots=slots))


@app.command("run-sft")
def run_sft(
    slots: Annotated[int, typer.Option(min=1, max=64)] = 2,
    steps: Annotated[int, typer.Option(min=1)] = 20,
    seed: Annotated[int, typer.Option(min=0)] = 0,
) -> None:
    """Run an SFT job directly on Ray (no web service), printing its events."""
    import runtime.engine  # noqa: F401 - before Ray: keeps a local instance on loopback
    from runtime.jobs.driver import run_sft_job
    from runtime.jobs.spec import SftJobSpec

    class _PrintSink:
        def emit(self, event) -> None:
            typer.echo(f"{event.kind:<18} {json.dumps(dict(event.data), sort_keys=True)}")

    try:
        spec = SftJobSpec(num_slots=slots, num_steps=steps, seed=seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    outcome = run_sft_job(
        spec, sink=_PrintSink(), ray_address=os.environ.get("RAY_ADDRESS") or None
    )
    raise typer.Exit(code=0 if outcome.status == "succeeded" else 1)


@app.command("plan")
def plan_command(
    gpus: Annotated[int, typer.Option(help="Slots in the pool.")],
    model: Annotated[str, typer.Option(help="Model of all four roles.")] = "llama-3.1-8b",
    gpu: Annotated[str, typer.Option(help="Accelerator kind.")] = "h100-sxm",
    gen_len: Annotated[int, typer.Option(help="Generated tokens per response.")] = 2048,
    prompt_len: Annotated[int, typer.Option()] = 512,
    global_batch: Annotated[int, typer.Option(help="Sequences per PPO step.")] = 256,
    micro_batch: Annotated[int, typer.Option()] = 4,
    ppo_epochs: Annotated[int, typer.Option()] = 1,
    recompute: Annotated[bool, typer.Option(help="Full activation recomputation.")] = False,
    catalog: Annotated[
        str | None, typer.Option(help="YAML/JSON file of extra models/GPUs.")
    ] = None,
    alternatives: Annotated[int, typer.Option(min=0, max=20)] = 3,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    show_rejected: Annotated[bool, typer.Option(help="List every rejected candidate.")] = False,
) -> None:
    """Plan every model-stage of a PPO job: layout, predicted time, memory, alternatives."""
    from nereus.plan_cli import run_plan

    raise typer.Exit(
        code=run_plan(
            model=model,
            gpus=gpus,
            gpu=gpu,
            gen_len=gen_len,
            prompt_len=prompt_len,
            global_batch=global_batch,
            micro_batch=micro_batch,
            ppo_epochs=ppo_epochs,
            recompute=recompute,
            catalog_file=catalog,
            alternatives=alternatives,
            as_json=as_json,
            show_rejected=show_rejected,
        )
    )


@app.command("simulate")
def simulate_command(
    trace: Annotated[
        str, typer.Option(help="A trace file (JSON Lines), or gen:<shape> to generate one.")
    ],
    policy: Annotated[
        str, typer.Option(help="nereus, dynarl, never, restart or dp-only.")
    ] = "nereus",
    gpus: Annotated[
        int | None, typer.Option(help="Slots at the start (default: the trace's).")
    ] = None,
    model: Annotated[str, typer.Option(help="Model of all four roles.")] = "llama-3.1-8b",
    gpu: Annotated[str, typer.Option(help="Accelerator kind.")] = "h100-sxm",
    steps: Annotated[int | None, typer.Option(min=1, help="Steps (default: the trace's).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the generated trace and true model.")] = 0,
    policy_file: Annotated[
        str | None, typer.Option(help="JSON file of policy settings (thresholds, gamma, ...).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    events: Annotated[str | None, typer.Option(help="Write every event to this file.")] = None,
) -> None:
    """Run the controller on the simulated cluster (every figure it prints is simulated)."""
    from nereus.simulate_cli import simulate

    raise typer.Exit(
        code=simulate(
            trace_spec=trace,
            policy=policy,
            gpus=gpus,
            model=model,
            gpu=gpu,
            steps=steps,
            seed=seed,
            policy_file=policy_file,
            as_json=as_json,
            events_file=events,
        )
    )


def main() -> None:
    app()
