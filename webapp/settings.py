"""Django settings for Nereus: one module, driven by environment variables (see webapp/config.py).

Embedded default (no REDIS_URL): SQLite under var/, Celery over the filesystem transport under
var/celery/, and the database-backed channel layer, so that a Celery worker in its own process can
deliver events to websocket clients of the web process. With REDIS_URL: Redis for all three roles.
"""

from __future__ import annotations

import sys
from pathlib import Path

import plotly

from webapp import config as _config
from webapp import queues

try:
    CONFIG = _config.load()
except _config.ConfigError as _exc:
    # A bad variable stops the process with a line naming it, not a traceback deep in Django
    # (manage.py, Daphne and Celery alike exit with status 2, as webapp/startup.py's checks do).
    sys.stderr.write(f"nereus: configuration error: {_exc}\n")
    sys.stderr.flush()
    raise SystemExit(2) from None

BASE_DIR = _config.REPO_ROOT
VAR_DIR: Path = CONFIG.var_dir
VAR_DIR.mkdir(parents=True, exist_ok=True)

SECRET_KEY = CONFIG.secret_key
DEBUG = not CONFIG.production
ALLOWED_HOSTS = list(CONFIG.allowed_hosts)
CSRF_TRUSTED_ORIGINS = list(CONFIG.csrf_trusted_origins)

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI and ReDoc served from here, never from a CDN
    "webapp.realtime",
    "webapp.projects",
    "webapp.jobs",
    "webapp.plans",
    "webapp.api",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "webapp.urls"
ASGI_APPLICATION = "webapp.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "webapp" / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {"default": CONFIG.database}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# Migrations live in the top-level migrations/ package, one sub-package per app.
MIGRATION_MODULES = {
    "realtime": "migrations.realtime",
    "projects": "migrations.projects",
    "jobs": "migrations.jobs",
    "plans": "migrations.plans",
}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "jobs:list"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "staticfiles"
STATIC_ROOT.mkdir(exist_ok=True)
# plotly.js comes from the plotly package's own copy, never from a CDN.
STATICFILES_DIRS = [
    BASE_DIR / "static",
    ("vendor/plotly", Path(plotly.__file__).parent / "package_data"),
]
WHITENOISE_USE_FINDERS = not CONFIG.production
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": (
            "whitenoise.storage.CompressedManifestStaticFilesStorage"
            if CONFIG.production
            else "django.contrib.staticfiles.storage.StaticFilesStorage"
        )
    },
}

# --- Channels -------------------------------------------------------------------------------
if CONFIG.redis_url:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [CONFIG.redis_url], "prefix": "nereus"},
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "webapp.realtime.layers.DatabaseChannelLayer"}}

# --- Celery ---------------------------------------------------------------------------------
CELERY_BROKER_DIR = VAR_DIR / "celery"
if CONFIG.redis_url:
    CELERY_BROKER_URL = CONFIG.redis_url
    CELERY_RESULT_BACKEND = CONFIG.redis_url
    CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 6 * 3600}
else:
    for _sub in ("queue", "processed", "results", "control"):
        (CELERY_BROKER_DIR / _sub).mkdir(parents=True, exist_ok=True)
    # kombu's filesystem transport, with messages written whole (webapp/broker.py).
    from webapp import broker as _broker

    CELERY_BROKER_URL = f"{_broker.ALIAS}://"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(CELERY_BROKER_DIR / "queue"),
        "data_folder_out": str(CELERY_BROKER_DIR / "queue"),
        "processed_folder": str(CELERY_BROKER_DIR / "processed"),
        "store_processed": False,
        # Broadcast (pidbox) exchanges; kombu's default is ./control, relative to the cwd.
        "control_folder": str(CELERY_BROKER_DIR / "control"),
        "polling_interval": 0.2,
    }
    CELERY_RESULT_BACKEND = f"file://{CELERY_BROKER_DIR / 'results'}"
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# Ray needs real file descriptors for stdout/stderr; Celery would replace them with a proxy.
CELERY_WORKER_REDIRECT_STDOUTS = False
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_RESULT_EXPIRES = 24 * 3600
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# The periodic tasks have a queue of their own, away from the job drivers (see webapp/queues.py).
CELERY_TASK_DEFAULT_QUEUE = queues.DRIVERS
CELERY_TASK_ROUTES = {
    "jobs.reap": {"queue": queues.MAINTENANCE},
    "plans.expire": {"queue": queues.MAINTENANCE},
}
# The periodic schedule (the maintenance worker runs it with --beat; one per deployment is
# enough, more are harmless: a job is taken over under its row lock).
CELERY_BEAT_SCHEDULE = {
    "jobs-reap-lost-drivers": {
        "task": "jobs.reap",
        "schedule": max(1.0, CONFIG.driver_lost_s / 3),
        "options": {"expires": max(1.0, CONFIG.driver_lost_s / 3)},
    },
    # Waiting proposals past their deadline, marked expired even when no driver is left to.
    "plans-expire-overdue-proposals": {
        "task": "plans.expire",
        "schedule": 60.0,
        "options": {"expires": 60.0},
    },
}
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celery-beat-schedule")

# --- Runtime ---------------------------------------------------------------------------------
NEREUS_RAY_ADDRESS = CONFIG.ray_address
# A job whose driver task was delivered this many times in a row without the job making progress
# (a step further than any earlier driver of it went) is failed, not retried.
NEREUS_MAX_DRIVER_DELIVERIES = 3
# A job still pending this long (its driver task lost before a worker claimed it) is delivered
# again by the check for lost drivers; the wait doubles with each redelivery, up to 8 times.
NEREUS_PENDING_REDELIVER_S = 300.0
# A driver whose database goes away writes again after these pauses; after the last, it stops
# and the job is taken over by a new driver once its heartbeat is older than NEREUS_DRIVER_LOST_S.
NEREUS_DB_RETRY_S = (0.5, 1.0, 2.0, 4.0)
# A driver writes a heartbeat (Job.heartbeat_at) every NEREUS_DRIVER_HEARTBEAT_S; a job whose
# heartbeat is older than NEREUS_DRIVER_LOST_S is taken over by a new driver (a new epoch, which
# stops the old one at its next step if it is only slow) that resumes from the job's checkpoint.
NEREUS_DRIVER_LOST_S = CONFIG.driver_lost_s
NEREUS_DRIVER_HEARTBEAT_S = max(0.5, NEREUS_DRIVER_LOST_S / 4)
# Each job's working directory (checkpoints): stable, so that a new driver finds them.
NEREUS_JOBS_DIR = CONFIG.jobs_dir or VAR_DIR / "jobs"
# Whether the person who proposed a plan override may approve it too (two people by default).
NEREUS_ALLOW_SELF_APPROVAL = False

# --- What a client may send (webapp/limits.py) ---------------------------------------------
# An HTTP request body over this many bytes is refused with 413, whatever parses it: Django's
# default (2.5 MB), stated here because webapp/limits.py and the API's JSON parser apply it to
# every body, not only to forms as Django does. The largest legitimate one, a plan override for
# 1,024 GPUs, is 20-300 KB (see webapp/limits.py).
DATA_UPLOAD_MAX_MEMORY_SIZE = 2_621_440
# A websocket message from a client over this many bytes closes the socket (4413). The job
# websocket only expects {"type": "resume", "after": N}; Daphne's own cap is 1 MiB.
NEREUS_WS_MAX_MESSAGE_BYTES = 64 * 1024

# --- REST framework -------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    # The bearer class comes first so that a request without credentials gets a 401 naming the
    # scheme (DRF asks the first class for WWW-Authenticate), not a 403.
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "webapp.api.authentication.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PARSER_CLASSES": ["webapp.api.parsers.JSONParser"],
    # An unknown ?format= is a 400 naming "format" (DRF's own raises a bare Http404).
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "webapp.api.parsers.ContentNegotiation",
    "EXCEPTION_HANDLER": "webapp.api.exceptions.exception_handler",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Nereus API",
    "DESCRIPTION": "Submit, watch and steer adaptive PPO post-training jobs.",
    "VERSION": "v1",
    "SERVE_INCLUDE_SCHEMA": False,
    # The schema UI's scripts come from the drf-spectacular-sidecar package's static files, like
    # plotly.js: a CDN would run third-party code on this origin, next to the session.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # Several models have a "state"; name each choice set after its model.
    "ENUM_NAME_OVERRIDES": {
        "StateEnum": "webapp.jobs.models.JobState",  # the jobs' name, kept as it was published
        "TransitionStateEnum": "webapp.plans.models.TransitionState",
        "ProposalStateEnum": "webapp.plans.models.ProposalState",
    },
}

# --- Production switch ----------------------------------------------------------------------
if CONFIG.production:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = True
    # Probes and scrapes reach the pods over plain HTTP inside the cluster.
    SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^metrics$"]
    SECURE_HSTS_SECONDS = 31536000
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    SECURE_CONTENT_TYPE_NOSNIFF = True
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_REFERRER_POLICY = "same-origin"
    X_FRAME_OPTIONS = "DENY"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": CONFIG.log_level},
    "loggers": {"django.db.backends": {"level": "INFO"}},
}

# --- Observability (webapp/observability): Prometheus metrics at /metrics, API latency ---------
INSTALLED_APPS.append("webapp.observability")
MIDDLEWARE.insert(0, "webapp.observability.middleware.ProbeMiddleware")
MIDDLEWARE.insert(0, "webapp.observability.middleware.RequestLatencyMiddleware")
