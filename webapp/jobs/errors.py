"""Error texts that users see; tests import them rather than repeating the words."""

ILLEGAL_MOVE = "a job in state {current} cannot move to {target}"
STALE_EPOCH = "epoch {epoch} is older than the job's current epoch {current}; the write is refused"
JOB_FINISHED = "job {job_id} has already finished ({state})"
JOB_STOPPING = "job {job_id} is {state}; its driver takes no more commands"
RESIZE_SIMULATED = "a simulated job's pool follows its trace; it cannot be resized"
RESIZE_FIXED = "a job of kind {kind} runs on the slots it started with; it cannot be resized"
RESIZE_STALE_SPEC = (
    "this job's stored spec no longer passes the checks ({why}); it cannot be resized"
)
NOTICE_RANGE = "expected a number of seconds from 0 to {most}"
TOO_MANY_DELIVERIES = (
    "the driver task was delivered {count} times in a row without the job making progress"
)
IDEMPOTENCY_MISMATCH = (
    "Idempotency-Key {key!r} was used for a different request; use a new key for a new job"
)


class JobError(ValueError):
    """A request about a job that its current state does not allow."""


class StaleEpochError(JobError):
    """A write from a driver that has been superseded."""


class IdempotencyError(JobError):
    """An Idempotency-Key reused with a different request body."""
