"""A small client of the REST API (``/api/v1/``) for scripts and CI pipelines.

Standard library only (``urllib.request``): it authenticates with a project token
(``Authorization: Bearer …``) and turns every HTTP or connection problem into an ``ApiError``
carrying the exit code the ``nereus`` commands return, so a pipeline can branch on it:

====  ===========================================================================================
code  meaning
====  ===========================================================================================
0     success (``watch`` and ``submit --wait``: the job succeeded)
1     the job failed or was cancelled (``watch`` and ``submit --wait``)
2     bad input or usage: the API's 400 (with the field it names), a missing token, a bad file
3     authentication or authorisation: 401 (unknown or revoked token), 403 (role too low)
4     not found: 404 (no such job or proposal, or one of another project)
5     conflict: 409 (an idempotency key reused with another body, a state that forbids the call)
6     the service could not be reached (the URL is in the message), or answered 5xx
====  ===========================================================================================
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import http.client
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import nereus
from runtime.events import unique_keys

EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_USAGE = 2
EXIT_AUTH = 3
EXIT_NOT_FOUND = 4
EXIT_CONFLICT = 5
EXIT_UNREACHABLE = 6

CONFIG_HELP = (
    "Configuration: NEREUS_URL (default http://127.0.0.1:8000) and NEREUS_TOKEN (a project API "
    "token, required), or --url/--token."
)
EXIT_CODES_HELP = (
    "Exit codes: 0 success (watch, submit --wait: the job succeeded); 1 the job failed or was "
    "cancelled; 2 bad input or usage (the API's 400, with the field named; a missing token); "
    "3 authentication or authorisation (401/403); 4 not found (404); 5 conflict (409); "
    "6 the service could not be reached (or answered 5xx)."
)

URL_VARIABLE = "NEREUS_URL"
TOKEN_VARIABLE = "NEREUS_TOKEN"
DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 30.0
TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})
EVENTS_PAGE = 1000
IDEMPOTENCY_HEADER = "Idempotency-Key"


class ApiError(Exception):
    """A call that did not succeed: what to print, and the exit code that says why."""

    def __init__(
        self,
        message: str,
        *,
        exit_code: int,
        status: int | None = None,
        code: str = "",
        fields: Mapping[str, list[str]] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        self.status = status
        self.code = code
        self.fields = dict(fields or {})

    def lines(self) -> list[str]:
        """The message, then (for the API's answers) one line per field problem."""
        out = [self.message]
        if self.status is None:  # refused before sending: the message names the field already
            return out
        for field, problems in self.fields.items():
            out.extend(f"  {field}: {problem}" for problem in problems)
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "code": self.code,
            "message": self.message,
            "fields": self.fields,
            "exit_code": self.exit_code,
        }


def usage_error(field: str, message: str) -> ApiError:
    """Bad input caught before any request is sent."""
    return ApiError(
        f"{field}: {message}", exit_code=EXIT_USAGE, code="invalid", fields={field: [message]}
    )


def _exit_code_for(status: int) -> int:
    if status in (401, 403):
        return EXIT_AUTH
    if status == 404:
        return EXIT_NOT_FOUND
    if status == 409:
        return EXIT_CONFLICT
    if status >= 500:
        return EXIT_UNREACHABLE
    return EXIT_USAGE


def loads_strict(text: str) -> Any:
    """JSON as the service reads it: NaN and Infinity are not numbers there, a key given twice
    in one object is refused (``json`` would keep the last without a word), and nesting too
    deep for the decoder is malformed; each raises ValueError."""

    def refuse(constant: str):
        raise ValueError(f"{constant} is not a JSON number")

    try:
        return json.loads(text, parse_constant=refuse, object_pairs_hook=unique_keys)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _printable_ascii(value: str) -> bool:
    return value.isascii() and value.isprintable()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ClientConfig:
    """Where the service is and how to authenticate."""

    url: str
    """Base URL of the service, without a trailing slash."""
    token: str
    """A project API token (``nrs_…``); sent as ``Authorization: Bearer``."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Per-request timeout."""

    @classmethod
    def resolve(cls, *, url: str | None, token: str | None) -> ClientConfig:
        """From ``--url``/``--token`` when given, else ``NEREUS_URL``/``NEREUS_TOKEN``."""
        url = (url or os.environ.get(URL_VARIABLE) or DEFAULT_URL).strip().rstrip("/")
        try:
            parts = urllib.parse.urlsplit(url)
            parts.port  # noqa: B018 - parsed on access: a port out of range raises here
        except ValueError as exc:
            raise usage_error(f"{URL_VARIABLE} (or --url)", f"{exc}: {url!r}") from None
        host = parts.hostname or ""
        if (
            parts.scheme not in ("http", "https")
            or not host
            or any(c.isspace() or not c.isprintable() or c in '<>"{}|\\^`' for c in host)
        ):
            raise usage_error(
                f"{URL_VARIABLE} (or --url)", f"expected http(s)://host[:port], got {url!r}"
            )
        try:
            host.encode("idna")  # as the socket will: a..b, or a label over 63 characters, raise
        except UnicodeError:
            raise usage_error(
                f"{URL_VARIABLE} (or --url)",
                f"{host!r} is not a valid host name (a label between dots is empty or too long): "
                f"{url!r}",
            ) from None
        token = (token or os.environ.get(TOKEN_VARIABLE) or "").strip()
        if not token:
            raise usage_error(
                f"{TOKEN_VARIABLE} (or --token)",
                "required: set it to a project API token (POST /api/v1/projects/<slug>/tokens/)",
            )
        if not _printable_ascii(token):
            raise usage_error(f"{TOKEN_VARIABLE} (or --token)", "expected printable ASCII")
        return cls(url=url, token=token)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # the 3xx reaches the caller as an HTTPError


class Client:
    """Calls of ``/api/v1/``; every failure raises ``ApiError``."""

    def __init__(self, config: ClientConfig):
        self.config = config
        # The environment's proxies are honoured (a CI runner may need them), as urllib does;
        # redirects are not followed, since urllib would carry the token to wherever they lead.
        self._opener = urllib.request.build_opener(_NoRedirect())

    # --- jobs ------------------------------------------------------------------------------

    def job_submit(
        self,
        *,
        name: str,
        spec: Mapping[str, Any],
        project: str | None = None,
        idempotency_key: str | None = None,
    ) -> tuple[dict[str, Any], bool]:
        """Submit a job; returns ``(job, replayed)`` (replayed: the key had made it before)."""
        body: dict[str, Any] = {"name": name, "spec": dict(spec)}
        if project is not None:
            body["project"] = project
        headers = {}
        if idempotency_key is not None:
            if not (0 < len(idempotency_key) <= 255 and _printable_ascii(idempotency_key)):
                raise usage_error(
                    "--idempotency-key", "expected 1 to 255 printable ASCII characters"
                )
            headers[IDEMPOTENCY_HEADER] = idempotency_key
        status, job = self._call("POST", "/api/v1/jobs/", body=body, headers=headers)
        return job, status == 200

    def job_get(self, job_id: int) -> dict[str, Any]:
        """One job."""
        return self._call("GET", f"/api/v1/jobs/{int(job_id)}/")[1]

    def job_cancel(self, job_id: int) -> dict[str, Any]:
        """Ask a job to stop."""
        return self._call("POST", f"/api/v1/jobs/{int(job_id)}/cancel/")[1]

    def job_pool(self, job_id: int, *, slots: int, notice_s: float = 0.0) -> dict[str, Any]:
        """Change a running PPO job's slot pool (the driver makes the change between steps)."""
        return self._call(
            "POST",
            f"/api/v1/jobs/{int(job_id)}/pool/",
            body={"slots": slots, "notice_s": notice_s},
        )[1]

    def job_events(self, job_id: int, *, after: int = 0) -> Iterator[dict[str, Any]]:
        """The job's events with ids above ``after``, oldest first, every page of them."""
        while True:
            query = urllib.parse.urlencode({"after": after, "limit": EVENTS_PAGE})
            page = self._call("GET", f"/api/v1/jobs/{int(job_id)}/events/?{query}")[1]
            results = page.get("results") or []
            yield from results
            # ``next`` is an absolute URL built by the server from its own idea of its host; the
            # last id says the same thing without trusting it.
            if not page.get("next") or not results:
                return
            after = int(results[-1]["id"])

    def job_artifacts(self, job_id: int) -> list[dict[str, Any]]:
        """The job's trained models, each with its files (name, bytes, sha256)."""
        return list(self._call("GET", f"/api/v1/jobs/{int(job_id)}/artifacts/")[1]["results"])

    def artifact_download(
        self, job_id: int, artifact: str, file: Mapping[str, Any], dest: Path
    ) -> None:
        """One file of an artifact into ``dest``, written aside and renamed into place only once
        its size and SHA-256 are the manifest's (``file``); else ``ApiError``, nothing left."""
        # The path is built here, not taken from the listing's absolute URL: that names the host
        # as the server sees itself, and the token must only go to the configured service.
        path = "/api/v1/jobs/{}/artifacts/{}/{}".format(
            int(job_id),
            urllib.parse.quote(artifact, safe=""),
            urllib.parse.quote(file["name"], safe=""),
        )
        url = self.config.url + path
        partial = dest.with_name(f".{dest.name}.partial")
        digest, size = hashlib.sha256(), 0
        try:
            with (
                self._open("GET", url, accept="application/octet-stream") as response,
                partial.open("wb") as out,
            ):
                while True:
                    try:
                        block = response.read(1 << 20)
                    except (OSError, http.client.HTTPException) as exc:
                        raise self._unreachable("GET", url, exc) from None
                    if not block:
                        break
                    out.write(block)
                    digest.update(block)
                    size += len(block)
            if size != file["bytes"] or digest.hexdigest() != file["sha256"]:
                raise ApiError(
                    f"GET {url}: {size} bytes with SHA-256 {digest.hexdigest()[:16]}…, the "
                    f"manifest says {file['bytes']} bytes and {str(file['sha256'])[:16]}…; "
                    "nothing was kept",
                    exit_code=EXIT_UNREACHABLE,
                    code="corrupt_download",
                )
            partial.replace(dest)
        finally:
            partial.unlink(missing_ok=True)

    # --- proposals -------------------------------------------------------------------------

    def proposal_decide(self, proposal_id: int, *, decision: str, comment: str) -> dict[str, Any]:
        """Approve or reject a plan-change proposal, with a comment."""
        if decision not in ("approve", "reject"):
            raise ValueError(f"decision: expected 'approve' or 'reject', got {decision!r}")
        if not comment.strip():
            raise usage_error("comment", "required: say why (--comment TEXT)")
        path = f"/api/v1/proposals/{int(proposal_id)}/{decision}/"
        return self._call("POST", path, body={"comment": comment})[1]

    def job_override(self, job_id: int, *, plan: dict[str, Any], reason: str) -> dict[str, Any]:
        """Propose a plan of one's own for a job; another approver approves it."""
        return self._call(
            "POST", f"/api/v1/jobs/{int(job_id)}/override/", body={"plan": plan, "reason": reason}
        )[1]

    # --- transport -------------------------------------------------------------------------

    def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        url = self.config.url + path
        with self._open(method, url, body=body, headers=headers) as response:
            try:
                raw = response.read()
            except (OSError, http.client.HTTPException) as exc:
                raise self._unreachable(method, url, exc) from None
            return response.status, _decode(raw, url=url, method=method)

    @contextlib.contextmanager
    def _open(
        self,
        method: str,
        url: str,
        *,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
        accept: str = "application/json",
    ) -> Iterator[http.client.HTTPResponse]:
        """The open response to a request; every failure as ``ApiError``."""
        request = urllib.request.Request(url, method=method)
        request.add_header("Authorization", f"Bearer {self.config.token}")
        request.add_header("Accept", accept)
        request.add_header("User-Agent", f"nereus-cli/{nereus.__version__}")
        for key, value in (headers or {}).items():
            request.add_header(key, value)
        if body is not None:
            request.data = json.dumps(body).encode("utf-8")
            request.add_header("Content-Type", "application/json")
        try:
            response = self._opener.open(request, timeout=self.config.timeout_s)
        except urllib.error.HTTPError as exc:
            with exc:
                raise _http_error(exc, method=method, url=url) from None
        except (OSError, http.client.HTTPException) as exc:
            raise self._unreachable(method, url, exc) from None
        except UnicodeError as exc:
            # What urllib cannot encode of the URL (the host for a socket, the path for the
            # request line): ``ClientConfig.resolve`` refuses such hosts; this keeps any other
            # out of a traceback and exit 1, which means "the job failed".
            raise usage_error(
                f"{URL_VARIABLE} (or --url)", f"cannot send a request to {url!r}: {exc}"
            ) from None
        with response:
            yield response

    def _unreachable(self, method: str, url: str, exc: Exception) -> ApiError:
        # URLError (refused, unknown host), timeouts, resets, and a peer that does not speak
        # HTTP all mean the same to a pipeline: no answer from the service.
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        return ApiError(
            f"cannot reach the service at {self.config.url} ({method} {url}): {reason}; "
            f"check {URL_VARIABLE} or --url",
            exit_code=EXIT_UNREACHABLE,
            code="unreachable",
        )


def _decode(raw: bytes, *, url: str, method: str) -> dict[str, Any]:
    try:
        body = json.loads(raw) if raw else {}
    except ValueError:
        body = None
    if not isinstance(body, dict):  # every answer of /api/v1/ this client calls is an object
        raise ApiError(
            f"{method} {url}: the answer is not a JSON object; is this a Nereus service?",
            exit_code=EXIT_UNREACHABLE,
            code="bad_response",
        )
    return body


def _http_error(exc: urllib.error.HTTPError, *, method: str, url: str) -> ApiError:
    try:
        raw = exc.read()
    except OSError:
        raw = b""
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    code, message, fields = "", exc.reason or "", {}
    if isinstance(body, dict):
        code = str(body.get("code") or "")
        message = str(body.get("message") or body.get("detail") or message)
        raw_fields = body.get("fields")
        if isinstance(raw_fields, dict):
            fields = {
                str(key): [str(v) for v in value] if isinstance(value, list) else [str(value)]
                for key, value in raw_fields.items()
            }
    if exc.code == 404 and not code:
        message = f"not found ({method} {url})"
    elif 300 <= exc.code < 400:
        location = exc.headers.get("Location", "?") if exc.headers else "?"
        message = f"{method} {url} redirects to {location}; set {URL_VARIABLE} or --url to it"
    return ApiError(
        f"HTTP {exc.code}: {message}",
        exit_code=_exit_code_for(exc.code),
        status=exc.code,
        code=code,
        fields=fields,
    )
