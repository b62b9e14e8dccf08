"""The ``nereus`` command line."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Annotated

import typer

import nereus
from nereus import client as client_help

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
    steps: Annotated[
        int, typer.Option(min=1, max=1_000_000, help="Steps of the demo PPO job.")
    ] = 150,
    slots: Annotated[
        int, typer.Option(min=1, max=8, help="CPU slots the demo PPO job starts with.")
    ] = 4,
) -> None:
    """Run the service on this machine (Ray head, Celery worker, web server) with a real PPO job
    on CPU slots whose response length grows, which loses a slot and gets one back."""
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
    micro_batch: Annotated[
        int, typer.Option(help="Sequences per training and inference micro-batch, at most.")
    ] = 4,
    pin_micro_batch: Annotated[
        bool,
        typer.Option(
            help="Always --micro-batch sequences, never fewer to fit or for speed; generation "
            "decodes all of a unit's sequences at once, never in waves."
        ),
    ] = False,
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
            pin_micro_batch=pin_micro_batch,
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
        str, typer.Option(help="nereus, dynarl, never, restart, dp-only or relaxed-dp.")
    ] = "nereus",
    gpus: Annotated[
        int | None, typer.Option(help="Slots at the start (default: the trace's).")
    ] = None,
    model: Annotated[str, typer.Option(help="Model of all four roles.")] = "llama-3.1-8b",
    gpu: Annotated[str, typer.Option(help="Accelerator kind.")] = "h100-sxm",
    steps: Annotated[int | None, typer.Option(min=1, help="Steps (default: the trace's).")] = None,
    seed: Annotated[
        int, typer.Option(help="Seed of the generated trace and the cluster twin.")
    ] = 0,
    policy_file: Annotated[
        str | None, typer.Option(help="JSON file of policy settings (thresholds, gamma, ...).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    events: Annotated[str | None, typer.Option(help="Write every event to this file.")] = None,
    counterfactual: Annotated[
        bool,
        typer.Option(
            help="Run it again without the moves made for their saving, all and each alone, "
            "to say what they bought (one more run, and one replay per move)."
        ),
    ] = False,
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
            counterfactual=counterfactual,
        )
    )


# --- the REST API from a CI pipeline (nereus.client_cli) -------------------------------------

_API_EPILOG = client_help.CONFIG_HELP + "\n\n" + client_help.EXIT_CODES_HELP
_Url = Annotated[
    str | None,
    typer.Option(help="Service URL (default: $NEREUS_URL, else http://127.0.0.1:8000)."),
]
_Token = Annotated[
    str | None,
    typer.Option(help="API token (default: $NEREUS_TOKEN; prefer the variable in CI)."),
]
_Json = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
_Interval = Annotated[
    float, typer.Option("--interval", min=0.05, max=3600, help="Seconds between polls.")
]


@app.command("submit", epilog=_API_EPILOG)
def submit_command(
    spec: Annotated[str, typer.Option(help="JSON file of the job spec ('-': standard input).")],
    generation_backend: Annotated[
        str | None,
        typer.Option(
            help="A PPO job's generation backend, set in the spec over the file's: torch (the "
            "default) or vllm (GPU slots only; refused on CPU slots, exit code 2)."
        ),
    ] = None,
    project: Annotated[
        str | None, typer.Option(help="Project slug (default: the token's project).")
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="Job name (default: the spec file's name).")
    ] = None,
    idempotency_key: Annotated[
        str | None,
        typer.Option(help="Retry-safe: the same key and body return the same job."),
    ] = None,
    wait: Annotated[bool, typer.Option(help="Follow the job to its end, like watch.")] = False,
    interval: _Interval = 1.0,
    as_json: _Json = False,
    url: _Url = None,
    token: _Token = None,
) -> None:
    """Submit a job (POST /api/v1/jobs/) and print its id."""
    from nereus.client_cli import submit

    raise typer.Exit(
        code=submit(
            spec_file=spec,
            generation_backend=generation_backend,
            project=project,
            name=name,
            idempotency_key=idempotency_key,
            wait=wait,
            interval_s=interval,
            as_json=as_json,
            url=url,
            token=token,
        )
    )


@app.command("status", epilog=_API_EPILOG)
def status_command(
    job_id: Annotated[int, typer.Argument(min=1)],
    as_json: _Json = False,
    url: _Url = None,
    token: _Token = None,
) -> None:
    """Print a job (GET /api/v1/jobs/<id>/)."""
    from nereus.client_cli import status

    raise typer.Exit(code=status(job_id=job_id, as_json=as_json, url=url, token=token))


@app.command("watch", epilog=_API_EPILOG)
def watch_command(
    job_id: Annotated[int, typer.Argument(min=1)],
    interval: _Interval = 1.0,
    as_json: _Json = False,
    url: _Url = None,
    token: _Token = None,
) -> None:
    """Print a job's events until it ends (a progress bar for steps on a terminal)."""
    from nereus.client_cli import watch

    raise typer.Exit(
        code=watch(job_id=job_id, interval_s=interval, as_json=as_json, url=url, token=token)
    )


@app.command("cancel", epilog=_API_EPILOG)
def cancel_command(
    job_id: Annotated[int, typer.Argument(min=1)],
    as_json: _Json = False,
    url: _Url = None,
    token: _Token = None,
) -> None:
    """Ask a job to stop (POST /api/v1/jobs/<id>/cancel/) and print its state: a pending job is
    cancelled at once, a running one is cancelling until its next step boundary. A job that has
    ended already is a conflict (exit code 5)."""
    from nereus.client import ApiError, Client, ClientConfig
    from nereus.client_cli import _fail

    try:
        job = Client(ClientConfig.resolve(url=url, token=token)).job_cancel(job_id)
    except ApiError as exc:
        raise typer.Exit(code=_fail("cancel", exc, as_json=as_json)) from None
    if as_json:
        typer.echo(json.dumps(job))
    elif job.get("state") == "cancelling":
        typer.echo(f"job {job['id']}: cancelling (it stops at its next step boundary)")
    else:
        typer.echo(f"job {job['id']}: {job.get('state')}")


@app.command("resize", epilog=_API_EPILOG)
def resize_command(
    job_id: Annotated[int, typer.Argument(min=1)],
    slots: Annotated[
        int, typer.Option(min=1, help="The job's pool from now on (1 to its max_slots).")
    ],
    notice: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=86400.0,
            help="For a shrink: seconds the slots to go stay the job's while it moves off "
            "them, with their state (0: taken at once).",
        ),
    ] = 0.0,
    as_json: _Json = False,
    url: _Url = None,
    token: _Token = None,
) -> None:
    """Change a running PPO job's slot pool (POST /api/v1/jobs/<id>/pool/). Its driver makes the
    change between steps; the outcome is a command.applied event (``nereus logs``). A simulated
    or supervised job is bad input (exit code 2); a job that has ended, a conflict (5)."""
    from nereus.client import ApiError, Client, ClientConfig
    from nereus.client_cli import _fail

    try:
        client = Client(ClientConfig.resolve(url=url, token=token))
        answer = client.job_pool(job_id, slots=slots, notice_s=notice)
    except ApiError as exc:
        raise typer.Exit(code=_fail("resize", exc, as_json=as_json)) from None
    if as_json:
        typer.echo(json.dumps(answer))
    else:
        how = f", with {answer['notice_s']:g} s notice" if answer.get("notice_s") else ""
        typer.echo(
            f"job {answer['job']}: pool of {answer['slots']} slots asked{how} "
            f"(command {answer['event']}; the driver makes it between steps)"
        )


@app.command("logs", epilog=_API_EPILOG)
def logs_command(
    job_id: Annotated[int, typer.Argument(min=1)],
    since: Annotated[
        int,
        typer.Option(
            min=0,
            max=2**63 - 1,  # an event id; past it, the API's own field name came back
            help="Only events with ids above N (each line's first column: the last one "
            "shown goes on from there).",
        ),
    ] = 0,
    limit: Annotated[
        int | None, typer.Option(min=1, help="At most this many events (default: all).")
    ] = None,
    as_json: _Json = False,
    url: _Url = None,
    token: _Token = None,
) -> None:
    """Print a job's events once, oldest first (GET /api/v1/jobs/<id>/events/), and exit; watch
    follows a job instead. With --limit, a line on stderr says where the next ones start."""
    import itertools

    from nereus.client import ApiError, Client, ClientConfig
    from nereus.client_cli import EventPrinter, _fail

    try:
        client = Client(ClientConfig.resolve(url=url, token=token))
        job = client.job_get(job_id)
        events = client.job_events(job_id, after=since)
        printer = EventPrinter(
            total_steps=(job.get("spec") or {}).get("num_steps"), as_json=as_json, tty=False
        )
        shown, last = 0, since
        for event in itertools.islice(events, limit):
            printer.event(event)
            shown, last = shown + 1, int(event["id"])
        more = limit is not None and shown == limit and next(events, None) is not None
    except ApiError as exc:
        raise typer.Exit(code=_fail("logs", exc, as_json=as_json)) from None
    if more:
        typer.echo(
            f"nereus logs: {shown} events shown; more follow (--since {last} for the next ones)",
            err=True,
        )


def _decide(
    decision: str,
    proposal_id: int,
    comment: str | None,
    as_json: bool,
    url: str | None,
    token: str | None,
) -> None:
    from nereus.client_cli import decide

    raise typer.Exit(
        code=decide(
            decision=decision,
            proposal_id=proposal_id,
            comment=comment,
            as_json=as_json,
            url=url,
            token=token,
        )
    )


_Comment = Annotated[str | None, typer.Option(help="Why (required).")]


@app.command("approve", epilog=_API_EPILOG)
def approve_command(
    proposal_id: Annotated[int, typer.Argument(min=1)],
    comment: _Comment = None,
    as_json: _Json = False,
    url: _Url = None,
    token: _Token = None,
) -> None:
    """Approve a plan-change proposal (POST /api/v1/proposals/<id>/approve/)."""
    _decide("approve", proposal_id, comment, as_json, url, token)


@app.command("reject", epilog=_API_EPILOG)
def reject_command(
    proposal_id: Annotated[int, typer.Argument(min=1)],
    comment: _Comment = None,
    as_json: _Json = False,
    url: _Url = None,
    token: _Token = None,
) -> None:
    """Reject a plan-change proposal (POST /api/v1/proposals/<id>/reject/)."""
    _decide("reject", proposal_id, comment, as_json, url, token)


@app.command("override", epilog=_API_EPILOG)
def override_command(
    job_id: Annotated[int, typer.Argument(min=1)],
    plan: Annotated[str, typer.Option(help="A plan's JSON file ('-': standard input).")],
    reason: Annotated[str | None, typer.Option(help="Why (required).")] = None,
    as_json: _Json = False,
    url: _Url = None,
    token: _Token = None,
) -> None:
    """Propose a plan of your own for a job (POST /api/v1/jobs/<id>/override/); another approver
    approves it with nereus approve before the job moves to it."""
    from nereus.client_cli import override

    raise typer.Exit(
        code=override(
            job_id=job_id, plan_file=plan, reason=reason, as_json=as_json, url=url, token=token
        )
    )


@app.command("download", epilog=_API_EPILOG)
def download_command(
    job_id: Annotated[int, typer.Argument(min=1)],
    artifact: Annotated[str, typer.Option(help="Which trained model (actor).")] = "actor",
    out: Annotated[
        str | None,
        typer.Option(help="A new (or empty) folder (default: ./job-<id>-<artifact>)."),
    ] = None,
    as_json: _Json = False,
    url: _Url = None,
    token: _Token = None,
) -> None:
    """Download a job's trained model, a Hugging Face folder (GET /api/v1/jobs/<id>/artifacts/),
    checking every file's SHA-256."""
    from nereus.client_cli import download

    raise typer.Exit(
        code=download(
            job_id=job_id, artifact=artifact, out=out, as_json=as_json, url=url, token=token
        )
    )


@app.command("export")
def export_command(
    job_dir: Annotated[
        str, typer.Argument(help="The job's working directory ($NEREUS_JOBS_DIR/<id>).")
    ],
    out: Annotated[
        str,
        typer.Option(
            help="The folder to write: a new or empty one, or an earlier export (replaced)."
        ),
    ],
    role: Annotated[str, typer.Option(help="actor or critic.")] = "actor",
    step: Annotated[
        int | None,
        typer.Option(min=0, help="The checkpoint that resumes at this step (default: newest)."),
    ] = None,
    dtype: Annotated[str, typer.Option(help="bfloat16 or float32.")] = "bfloat16",
) -> None:
    """Export a trained model from a job's committed checkpoint as a Hugging Face folder (on
    this machine, no service needed): for a job that stopped before its end."""
    from runtime.ppo.export import DTYPES, ROLES, ExportError, export_job_checkpoint

    try:
        # Before any checkpoint is looked for (found by audit: --dtype zzz was named only after).
        if role not in ROLES:
            raise ExportError(f"--role: expected one of {', '.join(ROLES)}, got {role!r}")
        if dtype not in DTYPES:
            raise ExportError(f"--dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
        folder = export_job_checkpoint(job_dir, out, role=role, step=step, dtype=dtype)
    except ExportError as exc:
        typer.echo(f"nereus export: {exc}", err=True)
        raise typer.Exit(code=2) from None
    typer.echo(f"{role} exported to {folder}")


def main() -> None:
    app()
