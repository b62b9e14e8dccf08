"""``nereus submit|status|watch|approve|reject|override|download``: the REST API from a CI pipeline.

Each function returns the command's exit code (see ``nereus.client`` for the table). Errors go to
stderr as ``nereus <command>: …`` with one line per field the API named; with ``--json`` they are
also written to stdout as ``{"error": {...}}`` so a script can read the same fields.

``watch`` polls ``/api/v1/jobs/<id>/events/?after=<last id>``: the websocket at ``/ws/jobs/<id>/``
authenticates browser sessions only, not API tokens, so a token-holding client cannot use it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

import typer

from nereus.client import (
    EXIT_JOB_FAILED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_UNREACHABLE,
    TERMINAL_STATES,
    ApiError,
    Client,
    ClientConfig,
    loads_strict,
    usage_error,
)

# How long ``watch`` keeps polling through an unreachable or failing (5xx) service before it gives
# up with exit code 6: long enough for a web process to restart, short enough for a CI step.
RETRY_FOR_S = 60.0
EXIT_INTERRUPTED = 130
BAR_WIDTH = 30


# Control characters, tab aside (C0, DEL and C1), and what makes a terminal show text in another
# order or on another line: bidirectional overrides and isolates, line and paragraph separators.
_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def shown(value: Any) -> Any:
    """What the service sent, safe to print as lines: every control character in its strings
    (keys too), which could move the cursor, retitle a terminal or start a fake line in a CI
    log, is printed as a ``\\xNN`` escape. Job names, reasons, comments and events' data are
    anyone's words; ``--json`` output escapes them itself."""
    if isinstance(value, str):
        return _CONTROL.sub(_escape, value)
    if isinstance(value, Mapping):
        return {shown(k): shown(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [shown(v) for v in value]
    return value


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def _fail(command: str, exc: ApiError, *, as_json: bool) -> int:
    for line in map(shown, exc.lines()):
        typer.echo(f"nereus {command}: {line}" if not line.startswith("  ") else line, err=True)
    if as_json:
        typer.echo(json.dumps({"error": exc.to_json()}))
    return exc.exit_code


def _client(url: str | None, token: str | None) -> Client:
    return Client(ClientConfig.resolve(url=url, token=token))


def _read_spec(path: str, option: str = "--spec") -> dict[str, Any]:
    """The JSON object in file ``path`` ('-': standard input); errors name ``option``."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise usage_error(option, f"cannot read {path}: {exc}") from None
    try:
        spec = loads_strict(text)
    except ValueError as exc:
        raise usage_error(option, f"{path}: not valid JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise usage_error(option, f"{path}: expected a JSON object, got {type(spec).__name__}")
    return spec


# --- commands ------------------------------------------------------------------------------


def submit(
    *,
    spec_file: str,
    project: str | None,
    name: str | None,
    idempotency_key: str | None,
    wait: bool,
    interval_s: float,
    as_json: bool,
    url: str | None,
    token: str | None,
    generation_backend: str | None = None,
) -> int:
    """Submit a job; print its id (or its JSON); with ``wait``, follow it to the end.
    ``generation_backend``: the spec's field of that name, over the file's; the service
    validates it as any spec field (a 400 naming ``spec.generation_backend``: exit code 2)."""
    try:
        spec = _read_spec(spec_file)
        if generation_backend is not None:
            spec["generation_backend"] = generation_backend
        if name is None:
            name = "job" if spec_file == "-" else Path(spec_file).stem
        client = _client(url, token)
        job, replayed = client.job_submit(
            name=name, spec=spec, project=project, idempotency_key=idempotency_key
        )
    except ApiError as exc:
        return _fail("submit", exc, as_json=as_json)
    if replayed:
        typer.echo(
            f"nereus submit: key {idempotency_key!r} already made job {job['id']}; "
            "not submitted again",
            err=True,
        )
    if as_json:
        typer.echo(json.dumps({"job": job}) if wait else json.dumps(job))
    else:
        typer.echo(str(job["id"]))
    if not wait:
        return EXIT_OK
    return _follow("submit", client, job, interval_s=interval_s, as_json=as_json)


def status(*, job_id: int, as_json: bool, url: str | None, token: str | None) -> int:
    """Print one job."""
    try:
        job = _client(url, token).job_get(job_id)
    except ApiError as exc:
        return _fail("status", exc, as_json=as_json)
    if as_json:
        typer.echo(json.dumps(job))
        return EXIT_OK
    job = shown(job)
    typer.echo(f"job {job['id']}  {job.get('name', '')}")
    for label, key in (
        ("project", "project"),
        ("owner", "owner"),
        ("state", "state"),
        ("epoch", "epoch"),
        ("created", "created_at"),
        ("started", "started_at"),
        ("finished", "finished_at"),
    ):
        if job.get(key) is not None:
            typer.echo(f"  {label:<9} {job[key]}")
    if job.get("failure_reason"):
        typer.echo(f"  {'failure':<9} {job['failure_reason']}: {job.get('failure_detail', '')}")
    steps = (job.get("spec") or {}).get("num_steps")
    if steps is not None:
        typer.echo(f"  {'steps':<9} {steps}")
    return EXIT_OK


def watch(
    *, job_id: int, interval_s: float, as_json: bool, url: str | None, token: str | None
) -> int:
    """Follow a job's events until it reaches a final state."""
    try:
        client = _client(url, token)
        job = client.job_get(job_id)
    except ApiError as exc:
        return _fail("watch", exc, as_json=as_json)
    return _follow("watch", client, job, interval_s=interval_s, as_json=as_json)


def decide(
    *,
    decision: str,
    proposal_id: int,
    comment: str | None,
    as_json: bool,
    url: str | None,
    token: str | None,
) -> int:
    """Approve or reject a plan-change proposal."""
    try:
        if comment is None or not comment.strip():
            raise usage_error("comment", "required: say why with --comment TEXT")
        proposal = _client(url, token).proposal_decide(
            proposal_id, decision=decision, comment=comment
        )
    except ApiError as exc:
        return _fail(decision, exc, as_json=as_json)
    if as_json:
        typer.echo(json.dumps(proposal))
    else:
        proposal = shown(proposal)
        state = proposal.get("state") or ("approved" if decision == "approve" else "rejected")
        job = f" (job {proposal['job']})" if proposal.get("job") is not None else ""
        typer.echo(f"proposal {proposal_id}: {state}{job}")
    return EXIT_OK


def override(
    *,
    job_id: int,
    plan_file: str,
    reason: str | None,
    as_json: bool,
    url: str | None,
    token: str | None,
) -> int:
    """Propose a plan of your own for a job (POST /api/v1/jobs/<id>/override/): a proposal that
    another approver approves (``nereus approve``) before the job moves to it."""
    try:
        if reason is None or not reason.strip():
            raise usage_error("reason", "required: say why with --reason TEXT")
        plan = _read_spec(plan_file, "--plan")
        proposal = _client(url, token).job_override(job_id, plan=plan, reason=reason)
    except ApiError as exc:
        return _fail("override", exc, as_json=as_json)
    if as_json:
        typer.echo(json.dumps(proposal))
    else:
        proposal = shown(proposal)
        typer.echo(
            f"proposal {proposal.get('id')}: {proposal.get('state', 'waiting')} (job {job_id}); "
            "another approver approves it with nereus approve"
        )
    return EXIT_OK


def download(
    *,
    job_id: int,
    artifact: str,
    out: str | None,
    as_json: bool,
    url: str | None,
    token: str | None,
) -> int:
    """Fetch a job's trained model (an artifact: a Hugging Face folder) into a new folder,
    every file checked against the manifest's size and SHA-256."""
    try:
        client = _client(url, token)
        found = {a["name"]: a for a in client.job_artifacts(job_id)}
        if artifact not in found:
            have = ", ".join(sorted(found)) or "none yet: one is written when the job ends"
            raise ApiError(
                f"artifact: job {job_id} has no artifact {artifact!r} (it has: {have})",
                exit_code=EXIT_NOT_FOUND,
                code="not_found",
                fields={"artifact": [f"no artifact {artifact!r}"]},
            )
        chosen = found[artifact]
        bad = [f.get("name") for f in chosen["files"] if not _plain_name(f.get("name"))]
        if bad:  # a name is a path only a broken or hostile service would send
            raise ApiError(
                f"the service lists file names that are not plain names: {bad!r}; nothing was written",
                exit_code=EXIT_UNREACHABLE,
                code="bad_response",
            )
        folder = (Path(out) if out else Path(f"job-{job_id}-{artifact}")).resolve()
        if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
            raise usage_error("--out", f"{folder} exists and is not an empty folder")
        # Into a folder beside it, renamed into place when every file is checked: an
        # interrupted or corrupt download leaves nothing that looks like a model.
        staging = folder.with_name(f".{folder.name}.partial-{os.getpid()}")
        try:
            staging.mkdir(parents=True)
            for file in chosen["files"]:
                client.artifact_download(job_id, artifact, file, staging / file["name"])
            if folder.exists():
                folder.rmdir()
            staging.rename(folder)
        except OSError as exc:
            raise usage_error("--out", f"cannot write {folder}: {exc}") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except ApiError as exc:
        return _fail("download", exc, as_json=as_json)
    if as_json:
        typer.echo(json.dumps({"folder": str(folder), **chosen}))
    else:
        chosen = shown(chosen)
        source = chosen.get("source") or {}
        typer.echo(
            f"{artifact} of job {job_id} ({chosen.get('architecture', '')}, "
            f"{chosen.get('dtype', '')}, weights after step {source.get('step', '?')}) in {folder}"
        )
        for file in chosen["files"]:
            typer.echo(f"  {file['name']:<24} {file['bytes']:>12,} bytes  sha256 ok")
    return EXIT_OK


def _plain_name(name: Any) -> bool:
    """A file name of a manifest: letters, digits, '.', '_' and '-', not a path, not '..' (the
    rule ``runtime.ppo.export.plain_name`` applies when a manifest is read; not imported from
    there, since this client needs no torch)."""
    return (
        isinstance(name, str)
        and re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}", name) is not None
        and ".." not in name
    )


# --- following a job -----------------------------------------------------------------------


def _follow(
    command: str, client: Client, job: dict[str, Any], *, interval_s: float, as_json: bool
) -> int:
    job_id = int(job["id"])
    printer = EventPrinter(
        total_steps=(job.get("spec") or {}).get("num_steps"),
        as_json=as_json,
        tty=not as_json and sys.stdout.isatty(),
    )
    if not as_json:
        typer.echo(f"job {job_id} ({shown(job.get('project'))}): {shown(job.get('state'))}")
    last_id, failing_since = 0, None
    try:
        while True:
            try:
                # The state first, then the events: the move to a final state is written with its
                # own event, so once the state read is final every event up to it is readable.
                job = client.job_get(job_id)
                for event in client.job_events(job_id, after=last_id):
                    printer.event(event)
                    last_id = max(last_id, int(event["id"]))
                failing_since = None
            except ApiError as exc:
                if exc.exit_code != EXIT_UNREACHABLE:
                    raise
                now = time.monotonic()
                failing_since = failing_since if failing_since is not None else now
                if now - failing_since >= RETRY_FOR_S:
                    raise
                printer.note(f"nereus {command}: {shown(exc.message)}; retrying")
            else:
                if job.get("state") in TERMINAL_STATES:
                    break
            time.sleep(interval_s)
    except ApiError as exc:
        printer.close()
        return _fail(command, exc, as_json=as_json)
    except KeyboardInterrupt:
        printer.close()
        typer.echo(f"nereus {command}: stopped watching; job {job_id} goes on", err=True)
        return EXIT_INTERRUPTED
    printer.close()
    printer.final(job)
    return EXIT_OK if job.get("state") == "succeeded" else EXIT_JOB_FAILED


class EventPrinter:
    """Event lines on stdout; on a terminal, steps drive a progress bar instead of lines."""

    def __init__(
        self,
        *,
        total_steps: int | None,
        as_json: bool,
        tty: bool,
        out: TextIO | None = None,
    ):
        self.total_steps = total_steps if isinstance(total_steps, int) else None
        self.as_json = as_json
        self.tty = tty
        self._out = out
        self._bar = ""

    def _write(self, text: str) -> None:
        typer.echo(text, nl=False, file=self._out)

    def event(self, event: Mapping[str, Any]) -> None:
        if self.as_json:
            self._write(json.dumps({"event": event}) + "\n")
            return
        data = event.get("data") or {}
        if event.get("kind") == "step.finished" and isinstance(data.get("step"), int):
            done = data["step"] + 1
            if self.tty and self.total_steps:
                self._draw_bar(done, data)
                return
            self._line(event, prefix=f"[{done}/{self.total_steps or '?'}] ")
            return
        self._line(event)

    def note(self, text: str) -> None:
        """A line on stderr (not part of the event stream)."""
        self._clear_bar()
        typer.echo(text, err=True)
        self._redraw_bar()

    def final(self, job: Mapping[str, Any]) -> None:
        if self.as_json:
            self._write(json.dumps({"job": job}) + "\n")
            return
        job = shown(job)
        line = f"job {job.get('id')} {job.get('state')}"
        if job.get("failure_reason"):
            line += f": {job['failure_reason']}"
            if job.get("failure_detail"):
                line += f": {job['failure_detail']}"
        self._write(line + "\n")

    def close(self) -> None:
        if self._bar:
            self._write("\n")
            self._bar = ""

    def _line(self, event: Mapping[str, Any], prefix: str = "") -> None:
        self._clear_bar()
        line = (
            f"{event.get('id', ''):>6} {_clock(event.get('at'))} {event.get('kind', ''):<18} "
            f"{prefix}{_summary(event.get('data') or {})}"
        )
        self._write(shown(line.rstrip()) + "\n")
        self._redraw_bar()

    def _draw_bar(self, done: int, data: Mapping[str, Any]) -> None:
        total = self.total_steps or done
        filled = min(BAR_WIDTH, BAR_WIDTH * done // max(total, 1))
        loss = f" loss {shown(str(data['loss']))}" if "loss" in data else ""
        self._clear_bar()
        self._bar = f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] step {done}/{total}{loss}"
        self._write(self._bar)
        if done >= total:  # complete: leave it as a line of its own, not redrawn under later ones
            self.close()

    def _clear_bar(self) -> None:
        if self._bar:
            self._write("\r\x1b[K")

    def _redraw_bar(self) -> None:
        if self._bar:
            self._write(self._bar)


def _clock(at: Any) -> str:
    try:
        return datetime.fromisoformat(str(at)).strftime("%H:%M:%S")
    except ValueError:
        return str(at or "")


SHOWN_CHARS = 120
"""The most of one value an event line shows (``--json`` gives everything)."""


def _summary(data: Mapping[str, Any]) -> str:
    parts = []
    for key in sorted(data):
        value = data[key]
        if value == "":
            continue
        parts.append(f"{key}={_shown(value)}")
    return " ".join(parts)


def _shown(value: Any) -> str:
    """A value as one event line shows it: a plan by its size and prediction, anything long cut
    (a decision's two plans were 10 kB of JSON on one line of a CI log)."""
    if isinstance(value, str | int | float):
        text = str(value)
    elif isinstance(value, Mapping) and "model_stages" in value and "num_slots" in value:
        stages = value.get("model_stages")
        count = len(stages) if isinstance(stages, list) else "?"
        text = (
            f"<plan: {value.get('num_slots')} slots, {count} model-stages, predicted "
            f"{value.get('predicted_step_s')} s/step>"
        )
    else:
        text = json.dumps(value)
    if len(text) > SHOWN_CHARS:
        text = f"{text[: SHOWN_CHARS - 1]}… ({len(text)} chars; --json for all)"
    return text
