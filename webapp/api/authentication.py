"""``Authorization: Bearer <token>``: project-scoped API tokens (see ``webapp.projects``)."""

from __future__ import annotations

from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed

from webapp.projects import errors as project_errors
from webapp.projects import services as project_services
from webapp.projects.models import ApiToken

MALFORMED_HEADER = "Authorization: expected 'Bearer <token>'"


class BearerTokenAuthentication(BaseAuthentication):
    """Authenticates as the token's creator; ``request.auth`` is the token, which narrows what
    the request may see and do to the token's project and role. A revoked or unknown token is
    refused with 401; no header at all lets the next class (the session) try."""

    keyword = b"bearer"

    def authenticate(self, request):
        parts = get_authorization_header(request).split()
        if not parts or parts[0].lower() != self.keyword:
            return None
        if len(parts) != 2:
            raise AuthenticationFailed(MALFORMED_HEADER)
        try:
            secret = parts[1].decode("ascii")
        except UnicodeDecodeError:
            raise AuthenticationFailed(MALFORMED_HEADER) from None
        try:
            token = project_services.token_authenticate(secret)
        except project_errors.NotFoundError as exc:
            raise AuthenticationFailed(str(exc)) from None
        return token.user, token

    def authenticate_header(self, request) -> str:
        return 'Bearer realm="nereus"'


def request_token(request) -> ApiToken | None:
    """The token a request authenticated with, or None for a signed-in session."""
    return request.auth if isinstance(request.auth, ApiToken) else None
