"""Test-wide setup: loopback-only networking, an isolated var/ directory, and service URLs.

PostgreSQL and Redis are real: ``.ci/run`` points DATABASE_URL and REDIS_URL at this machine's
servers. Locally, without REDIS_URL, the Redis-backed tests skip; under CI they fail instead, so a
missing service can never hide behind a skip.
"""

import os

import pytest
from hypothesis import settings

import runtime.engine  # noqa: F401 - sets Ray's loopback environment before Ray loads
from tests.support.services import require

# Hypothesis's per-example deadline is a timing assertion: on a loaded 2-core machine a brute-force
# oracle can pass 200 ms and fail a correct example. Properties here are about results only.
settings.register_profile("nereus", deadline=None)
settings.load_profile("nereus")


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The real Redis the Redis-backed tests use (from REDIS_URL)."""
    url = os.environ.get("REDIS_URL", "")
    require(bool(url), "REDIS_URL is not set")
    return url
