"""Settings parsing: every bad value gives an error that names its variable."""

import secrets
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from webapp import config
from webapp.config import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_sqlite_default_lives_under_var_dir(tmp_path):
    cfg = config.load({"NEREUS_VAR_DIR": str(tmp_path)})
    assert cfg.database["ENGINE"] == "django.db.backends.sqlite3"
    assert cfg.database["NAME"] == str(tmp_path / "nereus.sqlite3")
    assert "journal_mode=WAL" in cfg.database["OPTIONS"]["init_command"]
    assert cfg.embedded and cfg.redis_url is None and cfg.ray_address is None


def test_relative_sqlite_path_is_relative_to_the_checkout():
    parsed = config.parse_database_url("sqlite:///var/x.sqlite3")
    assert parsed["NAME"] == str(config.REPO_ROOT / "var" / "x.sqlite3")


def test_postgres_url_with_options():
    parsed = config.parse_database_url(
        "postgresql://bob:s%40cret@db.example:6543/nereus?sslmode=require"
    )
    assert parsed["ENGINE"] == "django.db.backends.postgresql"
    assert (parsed["USER"], parsed["PASSWORD"], parsed["HOST"], parsed["PORT"], parsed["NAME"]) == (
        "bob",
        "s@cret",
        "db.example",
        "6543",
        "nereus",
    )
    assert parsed["OPTIONS"]["sslmode"] == "require"


@given(
    user=st.text(
        st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), min_size=1, max_size=12
    ),
    password=st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), max_size=12),
    name=st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True),
    port=st.integers(1, 65535),
)
def test_postgres_url_components_round_trip(user, password, name, port):
    url = f"postgresql://{quote(user, safe='')}:{quote(password, safe='')}@127.0.0.1:{port}/{name}"
    parsed = config.parse_database_url(url)
    assert (parsed["USER"], parsed["PASSWORD"], parsed["PORT"], parsed["NAME"]) == (
        user,
        password,
        str(port),
        name,
    )


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("mysql://root@localhost/db", "unsupported scheme"),
        ("not a url", "not a URL"),
        ("postgresql://localhost:5432/", "needs a database name"),
        ("postgresql://localhost:abc/db", "port is not a number"),
        ("postgresql:///db", "needs a host"),
        ("sqlite://host/file.db", "has no host"),
        ("sqlite:///", "needs a file path"),
        ("postgresql://h/db?conn_max_age=soon", "conn_max_age"),
    ],
)
def test_bad_database_url_names_the_variable(value, words):
    with pytest.raises(ConfigError) as info:
        config.load({"DATABASE_URL": value})
    assert info.value.variable == "DATABASE_URL"
    assert str(info.value).startswith("DATABASE_URL: ")
    assert words in str(info.value)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("REDIS_URL", "http://127.0.0.1:6379"),
        ("REDIS_URL", "redis://"),
        ("REDIS_URL", "redis://127.0.0.1:port/0"),
        ("REDIS_URL", "redis://127.0.0.1:6379/zero"),
        ("REDIS_URL", "rediss://:pw@redis.example.internal:6380/0"),
        ("REDIS_URL", "rediss://:pw@redis.example.internal:6380/0?ssl_cert_reqs=maybe"),
        ("RAY_ADDRESS", "just-a-host"),
        ("RAY_ADDRESS", "127.0.0.1:99999"),
        ("RAY_ADDRESS", "ray://10.0.0.5:10001"),
        ("NEREUS_PRODUCTION", "maybe"),
        ("NEREUS_LOG_LEVEL", "LOUD"),
        ("NEREUS_CSRF_TRUSTED_ORIGINS", "nereus.example.com"),
    ],
)
def test_bad_values_name_their_variable(variable, value, tmp_path):
    with pytest.raises(ConfigError) as info:
        config.load({variable: value, "NEREUS_VAR_DIR": str(tmp_path)})
    assert info.value.variable == variable
    assert str(info.value).startswith(f"{variable}: ")


@pytest.mark.parametrize(
    ("variable", "value", "words"),
    [
        ("DATABASE_URL", "postgresql://[::1/db", "malformed URL"),
        ("DATABASE_URL", "postgresql://h/db?conn_max_age=\u00b2", "conn_max_age"),
        ("DATABASE_URL", "postgresql://h/db?conn_max_age=" + "9" * 5000, "conn_max_age"),
        ("REDIS_URL", "redis://[::1:6379/0", "malformed URL"),
        ("REDIS_URL", "redis://127.0.0.1:6379/\u00b2", "database index"),
        ("REDIS_URL", "redis://a..b:6379/0", "'a..b' is not a valid host name"),
        ("RAY_ADDRESS", "[::1:6379", "'[::1' is not an IPv6 address in brackets"),
        ("RAY_ADDRESS", "a..b:6379", "'a..b' is not a valid host name"),
        ("RAY_ADDRESS", "a" * 64 + ".example:6379", "is not a valid host name"),
        ("RAY_ADDRESS", "10.0.0.5:\u00b2", "expected HOST:PORT"),
        ("NEREUS_PRODUCTION", "//[x", "expected one of"),
    ],
)
def test_a_value_the_parsers_raise_on_is_refused_naming_its_variable(
    variable, value, words, tmp_path
):
    """Found by review: ``urlsplit`` (an unclosed ``[``, also inside ``redact`` while the message
    about a bad NEREUS_PRODUCTION was built), ``int("²")`` (``isdigit`` takes "²") and the IDNA
    codec (an empty or over-long host label, when a worker or the start-up check connects)
    raised ValueError or UnicodeError: a traceback and exit 1 instead of a line and exit 2."""
    with pytest.raises(ConfigError) as info:
        config.load({variable: value, "NEREUS_VAR_DIR": str(tmp_path)})
    assert info.value.variable == variable
    assert str(info.value).startswith(f"{variable}: ") and words in str(info.value)
    assert len(str(info.value)) < 300


def test_a_malformed_url_is_redacted_without_raising():
    assert config.redact("postgresql://bob:hunter2@[::1/db") == "postgresql://***@[::1/db"
    assert config.redact("//[x") == "//[x"


def test_a_tls_redis_url_is_kept_only_where_celery_can_use_it(tmp_path):
    """Celery's Redis result backend refuses a rediss:// URL without ``ssl_cert_reqs`` (at the
    first task, stopping the worker); the template's URL, which has it, is one Celery takes."""
    from celery import Celery

    template = (REPO / "docker/k8s/secrets.env.example").read_text()
    url = next(
        line.split("=", 1)[1] for line in template.splitlines() if line.startswith("REDIS_URL=")
    )
    url = url.replace("CHANGE-ME", "pw")
    cfg = config.load({"REDIS_URL": url, "NEREUS_VAR_DIR": str(tmp_path)})
    assert cfg.redis_url == url
    app = Celery("check", broker=url, backend=url)
    assert app.backend.connparams["ssl_cert_reqs"].name == "CERT_REQUIRED"  # taken, not refused
    with pytest.raises(ValueError, match="ssl_cert_reqs"):
        Celery("check", broker=url, backend=url.split("?")[0]).backend  # noqa: B018


def test_unset_or_empty_redis_and_ray_mean_embedded_and_local(tmp_path):
    cfg = config.load({"REDIS_URL": "", "RAY_ADDRESS": " ", "NEREUS_VAR_DIR": str(tmp_path)})
    assert cfg.redis_url is None and cfg.ray_address is None


def test_valid_redis_and_ray_values_are_kept(tmp_path):
    cfg = config.load(
        {
            "REDIS_URL": "redis://127.0.0.1:6379/2",
            "RAY_ADDRESS": "10.0.0.5:6379",
            "NEREUS_VAR_DIR": str(tmp_path),
        }
    )
    assert cfg.redis_url == "redis://127.0.0.1:6379/2" and not cfg.embedded
    assert cfg.ray_address == "10.0.0.5:6379"


def test_production_requires_a_secret_key_and_hosts(tmp_path):
    with pytest.raises(ConfigError) as info:
        config.load({"NEREUS_PRODUCTION": "1", "NEREUS_VAR_DIR": str(tmp_path)})
    assert info.value.variable == "NEREUS_SECRET_KEY"
    with pytest.raises(ConfigError) as info:
        config.load({"NEREUS_PRODUCTION": "true", "NEREUS_SECRET_KEY": secrets.token_urlsafe(60)})
    assert info.value.variable == "NEREUS_ALLOWED_HOSTS"
    cfg = config.load(
        {
            "NEREUS_PRODUCTION": "yes",
            "NEREUS_SECRET_KEY": secrets.token_urlsafe(60),
            "NEREUS_ALLOWED_HOSTS": "a.example",
        }
    )
    assert cfg.production and cfg.allowed_hosts == ("a.example",)
    with pytest.raises(ConfigError, match=r"NEREUS_SECRET_KEY: .*random"):
        config.load(
            {"NEREUS_PRODUCTION": "1", "NEREUS_SECRET_KEY": "ab" * 40, "NEREUS_ALLOWED_HOSTS": "x"}
        )


def test_local_secret_key_is_stable_across_loads(tmp_path):
    first = config.load({"NEREUS_VAR_DIR": str(tmp_path)}).secret_key
    second = config.load({"NEREUS_VAR_DIR": str(tmp_path)}).secret_key
    assert first == second and len(first) >= 50


@pytest.mark.parametrize("broken", ["empty", "a directory", "unreadable bytes"])
def test_a_local_secret_key_that_cannot_be_used_is_refused(tmp_path, broken):
    """Found by audit: an empty key file (truncated on a full disk) let the service start and then
    fail every request; a directory there was a traceback."""
    path = tmp_path / "secret_key"
    if broken == "empty":
        path.write_text("  \n")
    elif broken == "a directory":
        path.mkdir()
    else:
        path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match=r"^NEREUS_VAR_DIR: .*secret_key"):
        config.load({"NEREUS_VAR_DIR": str(tmp_path)})
    if broken == "empty":  # nothing was overwritten: the operator decides
        assert path.read_text() == "  \n"


def test_the_jobs_directory_must_be_one(tmp_path):
    """Found by audit: NEREUS_JOBS_DIR=/etc/passwd passed the checks and every job's driver then
    failed with NotADirectoryError."""
    a_file = tmp_path / "file"
    a_file.write_text("x")
    env = {"NEREUS_VAR_DIR": str(tmp_path / "var")}
    with pytest.raises(ConfigError, match=r"^NEREUS_JOBS_DIR: .*is not a directory"):
        config.load({**env, "NEREUS_JOBS_DIR": str(a_file)})
    with pytest.raises(ConfigError, match=r"^NEREUS_JOBS_DIR: .*lies under .*file.*not a dir"):
        config.load({**env, "NEREUS_JOBS_DIR": str(a_file / "jobs")})
    later = tmp_path / "not" / "yet"  # made when a job first needs it
    assert config.load({**env, "NEREUS_JOBS_DIR": str(later)}).jobs_dir == later
    assert not later.exists()


@pytest.mark.parametrize(
    ("database_url", "said"),
    [
        ("oracle://x/y", "DATABASE_URL: unsupported scheme"),
        # Found by review: a ValueError traceback from urlsplit, exit 1, no variable named.
        ("postgresql://bob:hunter2@[::1/db", "DATABASE_URL: malformed URL"),
    ],
)
def test_a_process_with_a_bad_variable_refuses_to_start(tmp_path, database_url, said):
    env = {"PATH": "/usr/bin:/bin", "NEREUS_VAR_DIR": str(tmp_path), "DATABASE_URL": database_url}
    done = subprocess.run(
        [sys.executable, str(REPO / "manage.py"), "check"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.startswith(f"nereus: configuration error: {said}")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr  # one line
    assert "hunter2" not in done.stderr


def test_production_settings_pass_the_deploy_check(tmp_path):
    env = {
        "PATH": "/usr/bin:/bin",
        "NEREUS_VAR_DIR": str(tmp_path),
        "NEREUS_PRODUCTION": "1",
        "NEREUS_SECRET_KEY": secrets.token_urlsafe(60),
        "NEREUS_ALLOWED_HOSTS": "nereus.example.com",
    }
    done = subprocess.run(
        [sys.executable, str(REPO / "manage.py"), "check", "--deploy", "--fail-level", "WARNING"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_errors_never_echo_a_password(tmp_path):
    with pytest.raises(ConfigError) as info:
        config.load(
            {"DATABASE_URL": "postgresql://bob:hunter2@db:port/x", "NEREUS_VAR_DIR": str(tmp_path)}
        )
    assert "hunter2" not in str(info.value) and "bob:***@db" in str(info.value)


def test_var_dir_that_cannot_be_a_directory_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError) as info:
        config.load({"NEREUS_VAR_DIR": str(blocker / "var")})
    assert info.value.variable == "NEREUS_VAR_DIR"
