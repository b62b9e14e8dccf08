"""``JobPolicy`` bounds that a job's run depends on (the rest: ``test_rules.py``)."""

from __future__ import annotations

import pytest

from runtime.control.policy import JobPolicy, PolicyError


@pytest.mark.parametrize("seconds", [2_592_001, 3e11, 1e300, 10**30])
def test_an_approval_timeout_beyond_30_days_is_refused_naming_the_field(seconds):
    """Accepted, it failed the job at its first proposal: the web service's deadline (now plus
    the timeout) overflowed the calendar (found by review)."""
    with pytest.raises(PolicyError, match=r"^policy\.approval_timeout_s: must be at most 2592000"):
        JobPolicy.from_json({"approval": "manual", "approval_timeout_s": seconds})


@pytest.mark.parametrize("seconds", [0, 30, 3600.0, 2_592_000])
def test_an_approval_timeout_up_to_30_days_is_kept(seconds):
    assert JobPolicy.from_json({"approval_timeout_s": seconds}).approval_timeout_s == seconds
