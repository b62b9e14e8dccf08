"""Test-wide setup: loopback-only networking, an isolated var/ directory, and service URLs.

PostgreSQL and Redis are real: ``.ci/run`` points DATABASE_URL and REDIS_URL at this machine's
servers. Locally, without REDIS_URL, the Redis-backed tests skip; under CI they fail instead, so a
missing service can never hide behind a skip.
"""

import os

import pytest
from hypothesis import settings

import runtime.engine  # noqa: F401 - sets Ray's loopback environment before Ray loads

# Hypothesis's per-example deadline is a timing assertion: on a loaded 2-core machine a brute-force
# oracle can pass 200 ms and fail a correct example. Properties here are about results only.
settings.register_profile("nereus", deadline=None)
settings.load_profile("nereus")


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The real Redis the Redis-backed tests use (from REDIS_URL)."""
    url = os.environ.get("REDIS_URL")
    if not url:
        if _in_ci():
            pytest.fail("REDIS_URL is not set in CI: the Redis-backed tests must run")
        pytest.skip("REDIS_URL is not set (CI sets it; .ci/run starts Redis)")
    return url
