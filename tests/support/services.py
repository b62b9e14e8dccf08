"""A service a test needs: where it is missing, the test skips locally and fails under CI
(``.ci/run`` sets ``CI`` and provides every service), so a missing one never hides behind a skip."""

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def require(available: bool, missing: str) -> None:
    """Skip (locally) or fail (under CI) unless ``available``; ``missing`` says what is not."""
    if available:
        return
    if in_ci():
        pytest.fail(f"{missing} in CI: the test must run")
    pytest.skip(f"{missing} (CI provides it)")
