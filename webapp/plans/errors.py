"""Error texts about plans and proposals; tests import them rather than repeating the words."""

NOT_WAITING = "proposal {proposal_id} is {state}, not waiting"
EXPIRED = "proposal {proposal_id} expired at {expires_at}; the job kept its plan"
SUPERSEDED_EPOCH = (
    "proposal {proposal_id} belongs to driver epoch {epoch}; the job is at epoch {current}"
)
SUPERSEDED = (
    "proposal {proposal_id} is stale: proposal {newer} for the same job was made after it, and "
    "only a job's newest proposal can be approved or rejected"
)
JOB_FINISHED = "proposal {proposal_id}: its job has finished or is stopping ({state})"
OVERRIDE_JOB_STOPPED = "job {job_id} is {state}: there is no running plan to override"
OVERRIDE_FIXED = (
    "a job of kind {kind} runs the layout it started with; it takes no plan (only PPO jobs do)"
)
SELF_APPROVAL = "you proposed this change; another approver must approve it"
COMMENT_REQUIRED = "a comment is required: say why"
COMMENT_NUL = "must not contain NUL characters"
COMMENT_CONTROL = "must not hold control characters (found {char})"  # as the API says
COMMENT_TOO_LONG = "at most {most} characters, got {got}"
PLAN_UNKNOWN_FIELD = "{path}: unknown field"
PLAN_NUL = "{path}: must not contain NUL characters"
PLAN_NUL_KEY = "{path}: a key must not contain NUL characters"
BAD_DECISION = "expected 'approve' or 'reject', got {decision!r}"
BAD_EVENT = "event.{field}: {problem}"


class ProposalError(ValueError):
    """A decision that the proposal's current state does not allow."""


class SelfApprovalError(ProposalError):
    """The person who proposed a change tried to approve it themselves."""
