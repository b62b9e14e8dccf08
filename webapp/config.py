"""Service configuration read from environment variables.

Pure functions over a mapping, so they are tested without Django. Every error names the variable
that caused it; ``webapp.settings`` turns a ``ConfigError`` into a refusal to start.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import parse_qs, parse_qsl, unquote, urlsplit

REPO_ROOT = Path(__file__).resolve().parent.parent

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_POSTGRES_SCHEMES = {"postgres", "postgresql", "pgsql", "postgresql+psycopg"}
CONN_MAX_AGE_DIGITS = 9
"""The most digits DATABASE_URL's ``conn_max_age`` may have (about 31 years: for ever). ``int``
refuses over 4,300, and Django adds it to a float clock, which overflows past about 308."""


class ConfigError(ValueError):
    """A configuration variable has a value the service cannot use."""

    def __init__(self, variable: str, problem: str):
        self.variable = variable
        super().__init__(f"{variable}: {problem}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ServiceConfig:
    """The service's settings, parsed and validated."""

    production: bool
    """NEREUS_PRODUCTION: deployment settings (HTTPS, secure cookies, a required secret key)."""
    secret_key: str
    var_dir: Path
    """NEREUS_VAR_DIR: where the embedded defaults keep their files (git-ignored ``var/``)."""
    database: dict
    """DATABASES['default'] for Django, from DATABASE_URL."""
    redis_url: str | None
    """REDIS_URL: when set, Celery broker and result store and the channel layer use Redis."""
    ray_address: str | None
    """RAY_ADDRESS: a Ray cluster to join; unset means a local Ray instance."""
    allowed_hosts: tuple[str, ...]
    csrf_trusted_origins: tuple[str, ...]
    log_level: str
    jobs_dir: Path | None = None
    """NEREUS_JOBS_DIR: each job's working directory (checkpoints) is ``<jobs_dir>/<job id>/``;
    on a Ray cluster, a path every node mounts. Default: ``<var_dir>/jobs``."""
    driver_lost_s: float = 60.0
    """NEREUS_DRIVER_LOST_S: a job driver silent this long is taken as lost and its job resumed."""

    @property
    def embedded(self) -> bool:
        """True when no Redis is configured and the in-project defaults carry events and tasks."""
        return self.redis_url is None


_USER_INFO = re.compile(r"//[^/?#]*@")


def redact(url: str) -> str:
    """A URL with its password replaced, for messages and logs. Never raises: it builds the
    messages that say a value is malformed, so a URL ``urlsplit`` refuses (an unclosed ``[``)
    has its whole user info (``//USER:PASS@``) replaced instead."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return _USER_INFO.sub("//***@", url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


def parse_bool(variable: str, value: str | None, *, default: bool) -> bool:
    """Read an on/off variable; anything but the usual spellings is an error."""
    if value is None:
        return default
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(
        variable, f"expected one of 1/0, true/false, yes/no, on/off; got {redact(value)!r}"
    )


def _split_url(variable: str, value: str):
    """``urlsplit(value)``, or ``ConfigError`` naming ``variable`` where it refuses the URL (a
    bracketed IPv6 host that is unclosed or not an address)."""
    try:
        return urlsplit(value)
    except ValueError as exc:
        raise ConfigError(variable, f"malformed URL ({exc}): {redact(value)!r}") from None


def _whole_number(text: str) -> bool:
    """Whether ``text`` is ASCII digits: ``str.isdigit`` alone takes ``"²"``, which ``int``
    refuses."""
    return text.isascii() and text.isdigit()


def _host_problem(host: str) -> str | None:
    """Why Python's sockets cannot connect to ``host`` (a name or an IP address, an IPv6 one in
    brackets), or None. They encode a name with the IDNA codec, which refuses an empty label
    (``a..b``) or one over 63 characters with ``UnicodeError``; an address is refused here
    rather than when a worker first connects."""
    if host.startswith("[") or host.endswith("]"):
        inner = host[1:-1] if host.startswith("[") and host.endswith("]") else ""
        try:
            ipaddress.IPv6Address(inner)
        except ValueError:
            return f"{host!r} is not an IPv6 address in brackets"
        return None
    try:
        host.encode("idna")
    except UnicodeError:
        return f"{host!r} is not a valid host name (a label between dots is empty or too long)"
    return None


def parse_database_url(value: str, *, variable: str = "DATABASE_URL") -> dict:
    """Turn ``sqlite:///PATH`` or ``postgresql://USER:PASS@HOST:PORT/NAME?k=v`` into a Django dict.

    SQLite runs in WAL mode with immediate transactions so that the web process, Celery workers and
    the channel layer can write to one file at the same time.
    """
    parts = _split_url(variable, value.strip())
    scheme = parts.scheme.lower()
    if not scheme:
        raise ConfigError(
            variable, f"not a URL (expected sqlite:///PATH or postgresql://...): {redact(value)!r}"
        )
    options = dict(parse_qsl(parts.query, keep_blank_values=True))
    if scheme == "sqlite":
        if parts.netloc:
            raise ConfigError(
                variable,
                "an SQLite URL has no host: use sqlite:///relative/path or sqlite:////abs/path",
            )
        path = unquote(parts.path[1:]) if parts.path.startswith("/") else unquote(parts.path)
        if not path:
            raise ConfigError(
                variable, "an SQLite URL needs a file path, e.g. sqlite:///var/nereus.sqlite3"
            )
        file = Path(path)
        if path != ":memory:" and not file.is_absolute():
            file = REPO_ROOT / file
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(file) if path != ":memory:" else ":memory:",
            "OPTIONS": {
                "timeout": 30,
                "transaction_mode": "IMMEDIATE",
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
        }
    if scheme in _POSTGRES_SCHEMES:
        name = unquote(parts.path.lstrip("/"))
        if not name:
            raise ConfigError(
                variable, "a PostgreSQL URL needs a database name: postgresql://HOST:PORT/NAME"
            )
        try:
            port = parts.port
        except ValueError as exc:
            raise ConfigError(variable, f"the port is not a number in {redact(value)!r}") from exc
        if not parts.hostname:
            raise ConfigError(
                variable, "a PostgreSQL URL needs a host: postgresql://HOST:PORT/NAME"
            )
        conn_max_age = options.pop("conn_max_age", "60")
        if not _whole_number(conn_max_age) or len(conn_max_age) > CONN_MAX_AGE_DIGITS:
            raise ConfigError(
                variable,
                "conn_max_age must be a whole number of seconds "
                f"(at most {CONN_MAX_AGE_DIGITS} digits), got {conn_max_age[:20]!r}",
            )
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": name,
            "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname,
            "PORT": str(port or 5432),
            "CONN_MAX_AGE": int(conn_max_age),
            "CONN_HEALTH_CHECKS": True,
            "OPTIONS": {"connect_timeout": 5, **options},
        }
    raise ConfigError(variable, f"unsupported scheme {scheme!r}; use sqlite or postgresql")


def parse_redis_url(value: str | None, *, variable: str = "REDIS_URL") -> str | None:
    """Check a ``redis://`` / ``rediss://`` / ``unix://`` URL; empty or unset means no Redis."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    parts = _split_url(variable, text)
    if parts.scheme not in {"redis", "rediss", "unix"}:
        raise ConfigError(
            variable,
            f"expected redis://HOST:PORT/DB (or rediss://, unix://), got {redact(value)!r}",
        )
    if parts.scheme != "unix" and not parts.hostname:
        raise ConfigError(variable, f"no host in {redact(value)!r}")
    if parts.scheme != "unix" and (problem := _host_problem(parts.hostname)):
        raise ConfigError(variable, f"{problem} in {redact(value)!r}")
    try:
        parts.port  # noqa: B018 - evaluating it validates the port
    except ValueError as exc:
        raise ConfigError(variable, f"the port is not a number in {redact(value)!r}") from exc
    db = parts.path.lstrip("/")
    if db and (not _whole_number(db) or len(db) > 9):  # redis-py's int() takes 4,300 digits
        raise ConfigError(variable, f"the database index must be a number, got {db!r}")
    if parts.scheme == "rediss":
        # Celery's result backend refuses a TLS URL that does not say how to check the server's
        # certificate, and would stop every worker at its first task: say so at start-up.
        given = parse_qs(parts.query).get("ssl_cert_reqs", [""])[-1]
        if given not in SSL_CERT_REQS:
            raise ConfigError(
                variable,
                "a rediss:// URL needs ssl_cert_reqs=required (or optional, none) in its query, "
                f"got {given!r} in {redact(value)!r}",
            )
    return text


SSL_CERT_REQS = frozenset(
    {"required", "optional", "none", "CERT_REQUIRED", "CERT_OPTIONAL", "CERT_NONE"}
)


def parse_ray_address(value: str | None, *, variable: str = "RAY_ADDRESS") -> str | None:
    """``HOST:PORT`` of a Ray cluster's GCS, ``auto`` (the cluster of this machine's Ray node), or
    unset: a local instance per driver. Ray Client (``ray://``) is refused: a job's driver moves
    its units' state through its own node's object store and forms groups with its slots, which
    Ray Client's proxied connection does not give; a driver runs on a Ray node instead
    (``nereus.ray_node``)."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    if text in {"auto", "local"}:
        return text
    if text.startswith("ray://"):
        raise ConfigError(
            variable,
            f"Ray Client addresses ({redact(value)!r}) are not supported: give the cluster's GCS "
            "address HOST:PORT (port 6379 by default) and run the Celery worker on a Ray node "
            "(python -m nereus.ray_node celery ..., docs/deployment.md)",
        )
    host, sep, port = text.rpartition(":")
    port_ok = _whole_number(port) and len(port) <= 5 and 0 < int(port) < 65536
    if not sep or not host or not port_ok:
        raise ConfigError(variable, f"expected HOST:PORT, 'auto' or unset; got {redact(value)!r}")
    problem = _host_problem(host)
    if problem:
        raise ConfigError(variable, f"{problem} in {redact(value)!r}")
    return text


def _split_list(value: str | None) -> tuple[str, ...]:
    return tuple(item.strip() for item in (value or "").split(",") if item.strip())


def load(environ: Mapping[str, str] | None = None) -> ServiceConfig:
    """Read every variable the service understands and validate it."""
    env = os.environ if environ is None else environ
    production = parse_bool("NEREUS_PRODUCTION", env.get("NEREUS_PRODUCTION"), default=False)

    var_dir = Path(env.get("NEREUS_VAR_DIR") or REPO_ROOT / "var")
    if not var_dir.is_absolute():
        var_dir = REPO_ROOT / var_dir
    try:
        var_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            "NEREUS_VAR_DIR", f"cannot use {str(var_dir)!r}: {exc.strerror}"
        ) from None

    database_url = env.get("DATABASE_URL")
    if database_url is None or not database_url.strip():
        database = parse_database_url(f"sqlite:///{var_dir / 'nereus.sqlite3'}")
    else:
        database = parse_database_url(database_url)

    secret_key = env.get("NEREUS_SECRET_KEY", "")
    if production:
        if len(secret_key) < 50 or len(set(secret_key)) < 5:
            raise ConfigError(
                "NEREUS_SECRET_KEY", "required in production: at least 50 random characters"
            )
    elif not secret_key:
        secret_key = _local_secret_key(var_dir)

    allowed_hosts = _split_list(env.get("NEREUS_ALLOWED_HOSTS"))
    if production and not allowed_hosts:
        raise ConfigError("NEREUS_ALLOWED_HOSTS", "required in production, e.g. nereus.example.com")
    if not allowed_hosts:
        allowed_hosts = ("127.0.0.1", "localhost", "[::1]", "testserver")

    origins = _split_list(env.get("NEREUS_CSRF_TRUSTED_ORIGINS"))
    # In production the site is served over HTTPS only: a plain http:// origin there would let a
    # page on the network path (not TLS-protected) pass the CSRF origin check.
    schemes = ("https://",) if production else ("http://", "https://")
    for origin in origins:
        if not origin.startswith(schemes):
            raise ConfigError(
                "NEREUS_CSRF_TRUSTED_ORIGINS",
                f"{origin!r} must start with https://"
                + ("" if production else " (or http:// outside production)"),
            )

    log_level = (env.get("NEREUS_LOG_LEVEL") or "INFO").upper()
    if log_level not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
        raise ConfigError(
            "NEREUS_LOG_LEVEL",
            f"expected DEBUG, INFO, WARNING, ERROR or CRITICAL, got {log_level!r}",
        )

    jobs_dir = Path(env.get("NEREUS_JOBS_DIR") or var_dir / "jobs")
    if not jobs_dir.is_absolute():
        jobs_dir = REPO_ROOT / jobs_dir
    _check_directory("NEREUS_JOBS_DIR", jobs_dir)

    raw_lost = env.get("NEREUS_DRIVER_LOST_S") or "60"
    try:
        driver_lost_s = float(raw_lost)
    except ValueError:
        driver_lost_s = float("nan")
    if not 2 <= driver_lost_s <= 86400:
        raise ConfigError(
            "NEREUS_DRIVER_LOST_S", f"expected seconds in [2, 86400], got {raw_lost!r}"
        )

    return ServiceConfig(
        production=production,
        secret_key=secret_key,
        var_dir=var_dir,
        database=database,
        redis_url=parse_redis_url(env.get("REDIS_URL")),
        ray_address=parse_ray_address(env.get("RAY_ADDRESS")),
        allowed_hosts=allowed_hosts,
        csrf_trusted_origins=origins,
        log_level=log_level,
        jobs_dir=jobs_dir,
        driver_lost_s=driver_lost_s,
    )


def _local_secret_key(var_dir: Path) -> str:
    """A per-checkout key kept under var/, so sessions survive restarts of the local service. A
    key file that cannot be read, or is empty (truncated on a full disk, say), is refused here:
    the service would otherwise start and then fail every request."""
    path = var_dir / "secret_key"
    try:
        key = path.read_text().strip()
    except FileNotFoundError:
        key = None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            "NEREUS_VAR_DIR", f"cannot read {str(path)!r}: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    if key is None:
        try:
            key = _create_secret_key(path)
        except OSError as exc:
            raise ConfigError(
                "NEREUS_VAR_DIR", f"cannot write {str(path)!r}: {exc.strerror}"
            ) from None
    if not key:
        raise ConfigError(
            "NEREUS_VAR_DIR",
            f"{str(path)!r} is empty: delete it to make a new key (signed-in sessions end) "
            "or set NEREUS_SECRET_KEY",
        )
    return key


def _create_secret_key(path: Path) -> str:
    key = secrets.token_urlsafe(50)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(key)
    try:
        os.link(tmp, path)  # atomic create-if-absent: concurrent first starts agree on one key
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_text().strip()


def _check_directory(name: str, path: Path) -> None:
    """``path`` is a directory, or can become one: its nearest existing ancestor is a directory
    (it is made when first needed, where it is needed)."""
    existing = path
    try:
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        is_dir = existing.is_dir()
    except OSError as exc:  # a folder on the way this process may not enter
        raise ConfigError(name, f"cannot use {str(path)!r}: {exc.strerror}") from None
    if not is_dir:
        where = "is" if existing == path else f"lies under {str(existing)!r}, which is"
        raise ConfigError(name, f"{str(path)!r} {where} not a directory")
