"""Waiting in tests for something another thread or process does: a bound on the wait, never a
claim about speed (a test that waits too long fails saying what never happened)."""

import time


def wait_until(predicate, what: str, *, timeout_s: float, interval_s: float = 0.02):
    """``predicate()``'s first truthy value, polled every ``interval_s``; fails with ``what`` if
    none comes within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} (waited {timeout_s:.0f} s)")
        time.sleep(interval_s)
    return value
