"""What every service's HTTP edge shares, without a web framework: optional bearer-token
auth (RFC 6750 ``Authorization: Bearer``) and :class:`BadRequest`, the refusal of a client
request.

When a token is configured (``SPANRL_AUTH_TOKEN`` / ``SPANRL_AUTH_TOKEN_FILE``, see
spanrl/core/settings.py) every request but ``GET /health`` must carry
``Authorization: Bearer <token>``; otherwise the service answers 401 with a JSON reason
(``missing_token`` or ``invalid_token``) and ``WWW-Authenticate: Bearer``. The token is
compared in constant time and never logged or echoed. Clients (the reloader, the
evaluator, the dashboard) send it with :func:`bearer_headers`; the servers check it with
:func:`check_bearer` (the bridge and the proxy through producers/edge.py's ASGI middleware,
the dashboard through its own).
"""
from __future__ import annotations

import hmac

from pydantic import SecretStr

MISSING_TOKEN = "missing_token"
INVALID_TOKEN = "invalid_token"
#: (method, path) answered without a token: liveness probes carry no secret
OPEN_ROUTES = frozenset({("GET", "/health")})


class BadRequest(ValueError):
    """A client request a service refuses: HTTP ``status``, an OpenAI error ``reason`` (its
    ``type``) and, when one request field is to blame, that field as ``param``; ``headers``
    of the answer (``Retry-After`` of a 503: the refusal is the service's state, not the
    request's, and a retry may pass)."""

    def __init__(self, status: int, reason: str, detail: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(detail)
        self.status, self.reason, self.detail, self.param = status, reason, detail, param
        self.headers = headers


def token_value(token: SecretStr | str | None) -> str | None:
    """The token as plain text (None or empty: auth off)."""
    value = token.get_secret_value() if isinstance(token, SecretStr) else token
    return value or None


def bearer_headers(token: SecretStr | str | None) -> dict[str, str]:
    """``{"Authorization": "Bearer <token>"}`` for a client, ``{}`` when there is no token."""
    value = token_value(token)
    return {"Authorization": f"Bearer {value}"} if value else {}


def check_bearer(authorization: bytes | None, token: bytes) -> str | None:
    """None when the ``Authorization`` header value carries ``token``, else the 401 reason.

    The scheme is case-insensitive (RFC 7235 s2.1); the credentials are compared with
    :func:`hmac.compare_digest` so the time taken does not depend on where they differ.
    """
    if not authorization:
        return MISSING_TOKEN
    scheme, _, credentials = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return MISSING_TOKEN
    return None if hmac.compare_digest(credentials.strip(), token) else INVALID_TOKEN
