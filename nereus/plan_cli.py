"""``nereus plan``: the planner on the command line."""

from __future__ import annotations

import json

import typer

from runtime.planner import PlanningError, PpoWorkload, default_catalog, plan
from runtime.planner.catalog import GIB, CatalogError
from runtime.planner.plan import Plan


def run_plan(
    *,
    model: str,
    gpus: int,
    gpu: str,
    gen_len: int,
    prompt_len: int,
    global_batch: int,
    micro_batch: int,
    pin_micro_batch: bool,
    ppo_epochs: int,
    recompute: bool,
    catalog_file: str | None,
    alternatives: int,
    as_json: bool,
    show_rejected: bool,
) -> int:
    try:
        catalog = default_catalog()
        if catalog_file is not None:
            if not catalog_file.strip():
                raise CatalogError("--catalog: empty; give a file name")
            catalog = catalog.extended(catalog_file)
        accelerator = catalog.accelerator(gpu)
        workload = PpoWorkload.for_model(
            catalog.model(model),
            gen_len=gen_len,
            prompt_len=prompt_len,
            global_batch=global_batch,
            micro_batch=micro_batch,
            adaptive_micro_batch=not pin_micro_batch,
            ppo_epochs=ppo_epochs,
            recompute=recompute,
        )
        result = plan(workload, accelerator, gpus, num_alternatives=alternatives)
    except (CatalogError, PlanningError, ValueError) as exc:
        typer.echo(f"nereus plan: {exc}", err=True)
        return 2
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "plan": result.best.to_json(),
                    "alternatives": [p.to_json() for p in result.alternatives],
                    "rejected": [
                        {"model_stage": r.model_stage, "tp": r.tp, "pp": r.pp, "reason": r.reason}
                        for r in result.rejected
                    ],
                    "elapsed_s": result.elapsed_s,
                },
                indent=2,
            )
        )
        return 0
    _print_plan(
        result.best, title=f"{model} on {gpus} × {accelerator.name}, generation length {gen_len}"
    )
    for i, alternative in enumerate(result.alternatives, 1):
        changed = {
            n: str(lay)
            for n, lay in alternative.layouts().items()
            if lay != result.best.layouts()[n]
        }
        slower = alternative.predicted_step_s / result.best.predicted_step_s - 1
        typer.echo(
            f"alternative {i}: {alternative.predicted_step_s:.3f} s/step (+{slower:.1%}), "
            f"changes {changed}"
        )
    if show_rejected:
        typer.echo("\nrejected candidates:")
        for rejection in result.rejected:
            typer.echo(f"  {rejection}")
    typer.echo(f"\nplanned in {result.elapsed_s * 1000:.0f} ms")
    return 0


def _print_plan(best: Plan, *, title: str) -> None:
    typer.echo(
        f"{title}\npredicted step: {best.predicted_step_s:.3f} s "
        f"({', '.join(f'{s.stage} {s.predicted_s:.3f} s {s.mode}' for s in best.stages)})\n"
    )
    typer.echo(
        f"{'model-stage':<20} {'(dp,tp,pp)':<11} {'slots':>6} {'mb':>4} {'seconds':>9} "
        f"{'GiB/slot':>9}  largest costs"
    )
    for ms in best.model_stages:
        top = sorted(ms.breakdown, key=lambda kv: -kv[1])[:3]
        costs = ", ".join(f"{k} {v:.3f}" for k, v in top)
        typer.echo(
            f"{ms.name:<20} {ms.layout!s:<11} {ms.layout.num_slots:>6} "
            f"{ms.micro_batch or '':>4} "
            f"{ms.predicted_s:>9.3f} {ms.memory_bytes / GIB:>9.1f}  {costs}"
        )
    typer.echo(
        "mb: sequences per micro-batch; for generation, the sequences a unit decodes at once, "
        "the rest in later waves (blank: all of them)\n"
    )
