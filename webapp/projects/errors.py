"""Error texts about projects, members and tokens; tests import them rather than repeating them."""

NOT_FOUND = "not found"
ROLE_NEEDED = "this needs the {role} role in project {project}"
TOKEN_INVALID = "invalid or revoked token"
TOKEN_EXPIRED = "token expired: its project's admins issue a new one"


class NotFoundError(LookupError):
    """The thing does not exist, or the caller may not know that it does: both look the same."""

    def __init__(self, message: str = NOT_FOUND):
        super().__init__(message)


class RoleError(PermissionError):
    """The caller can see the project but their role there does not allow the request."""
