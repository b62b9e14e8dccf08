"""Error texts about projects, members and tokens; tests import them rather than repeating them."""

NOT_FOUND = "not found"
ROLE_NEEDED = "this needs the {role} role in project {project}"
TOKEN_INVALID = "invalid or revoked token"
TOKEN_EXPIRED = "token expired: its project's admins issue a new one"
TOKEN_NAME_TAKEN = "a token named {name!r} is active already: revoke it or choose another name"


class NotFoundError(LookupError):
    """The thing does not exist, or the caller may not know that it does: both look the same."""

    def __init__(self, message: str = NOT_FOUND):
        super().__init__(message)


class RoleError(PermissionError):
    """The caller can see the project but their role there does not allow the request."""


class TokenNameTakenError(ValueError):
    """A project has an active token of that name already (one per name: the page that shows a
    new secret answers its POST, so a reload would otherwise make a second token)."""

    def __init__(self, name: str):
        super().__init__(TOKEN_NAME_TAKEN.format(name=name))
