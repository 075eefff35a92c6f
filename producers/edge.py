"""The HTTP edge the bridge and the proxy share: optional bearer-token auth (RFC 6750
``Authorization: Bearer``) and error details that are safe to send back.

When a token is configured (``SPANRL_AUTH_TOKEN`` / ``SPANRL_AUTH_TOKEN_FILE``, see
infra/settings.py) every request but ``GET /health`` must carry
``Authorization: Bearer <token>``; otherwise the service answers 401 with a JSON reason
(``missing_token`` or ``invalid_token``) and ``WWW-Authenticate: Bearer``. The token is
compared in constant time and never logged or echoed.
"""
from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Callable

from pydantic import SecretStr

if TYPE_CHECKING:  # the agent side (instrument, runner) uses the token helpers without FastAPI
    from fastapi.exceptions import RequestValidationError
    from starlette.responses import Response
    from starlette.types import ASGIApp, Receive, Scope, Send

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


class BearerAuth:
    """ASGI middleware: 401 unless the request carries the bearer token (see module doc).

    ``reject(reason, detail)`` builds the 401 body in the service's own error shape (and
    counts it); this class adds ``WWW-Authenticate``. Lifespan and open routes pass.
    """

    def __init__(self, app: ASGIApp, token: SecretStr | str, reject: Callable[[str, str], Response]):
        value = token_value(token)
        if value is None:
            raise ValueError("BearerAuth needs a non-empty token")
        self.app = app
        self._token = value.encode()
        self.reject = reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) in OPEN_ROUTES:
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        reason = check_bearer(header, self._token)
        if reason is None:
            await self.app(scope, receive, send)
            return
        detail = ("this service needs 'Authorization: Bearer <token>' (SPANRL_AUTH_TOKEN)"
                  if reason == MISSING_TOKEN else "the bearer token is not the one this service expects")
        response = self.reject(reason, detail)
        response.headers["WWW-Authenticate"] = (
            'Bearer realm="spanrl"' if reason == MISSING_TOKEN else 'Bearer realm="spanrl", error="invalid_token"')
        await response(scope, receive, send)


def install_auth(app, token: SecretStr | str | None, reject: Callable[[str, str], Response]) -> None:
    """Add :class:`BearerAuth` to a FastAPI ``app`` when ``token`` is set (no-op otherwise)."""
    if token_value(token) is not None:
        app.add_middleware(BearerAuth, token=token, reject=reject)


def validation_summary(exc: RequestValidationError) -> str:
    """A 422's detail without the offending input: ``body.value: Input should be ...; ...``."""
    return "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg', '')}" for e in exc.errors())


#: reason codes of the errors FastAPI/Starlette raise themselves (400: a body that is not JSON)
HTTP_REASONS = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed", 422: "invalid_request"}


def install_error_handlers(app, error: Callable[..., Response]) -> None:
    """Answer FastAPI's own 4xx through the service's ``error(status, reason, detail, headers)``,
    so they are counted in /metrics and keep the service's error shape. FastAPI's default
    422 echoes the input, which fails on a lone surrogate in it; ours does not echo."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError) -> Response:
        return error(422, HTTP_REASONS[422], validation_summary(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException) -> Response:
        return error(exc.status_code, HTTP_REASONS.get(exc.status_code, "http_error"), str(exc.detail), exc.headers)


def safe_detail(detail: str) -> str:
    """``detail`` encodable as UTF-8 JSON: bad input may hold lone surrogates (JSON ``"\\ud800"``)."""
    return detail.encode("utf-8", "backslashreplace").decode()
