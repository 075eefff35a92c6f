"""The FastAPI side of the HTTP edge the bridge and the proxy share: the bearer-token
middleware (:class:`BearerAuth`) and error answers that are safe to send back.

The rule itself (which routes are open, how a token is compared, :class:`BadRequest`) is on
the floor, spanrl/core/edge.py, shared with the reloader, the evaluator and the dashboard:
when a token is configured every request but ``GET /health`` must carry
``Authorization: Bearer <token>``, else 401 with ``missing_token`` or ``invalid_token`` and
``WWW-Authenticate: Bearer``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from pydantic import SecretStr

from spanrl.core.edge import MISSING_TOKEN, OPEN_ROUTES, check_bearer, token_value

if TYPE_CHECKING:  # imported by the bridge and the proxy only; FastAPI is loaded when used
    from fastapi.exceptions import RequestValidationError
    from starlette.responses import Response
    from starlette.types import ASGIApp, Receive, Scope, Send


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
