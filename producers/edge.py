"""The FastAPI side of the HTTP edge the bridge and the proxy share: the bearer-token
middleware (:class:`BearerAuth`) and error answers that are safe to send back.

The rule itself (roles, which routes are open, how a token is compared, :class:`BadRequest`)
is on the floor, spanrl/core/edge.py, shared with the trainer, the reloader and the
dashboard: with auth on every request but ``GET /health`` must carry the agent or the
administrator token (401 ``missing_token`` / ``invalid_token`` otherwise), and ``/admin/*``
the administrator's (403 ``admin_only``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from pydantic import SecretStr

from spanrl.core.edge import Credentials, as_credentials, authorize, www_authenticate

if TYPE_CHECKING:  # imported by the bridge and the proxy only; FastAPI is loaded when used
    from fastapi.exceptions import RequestValidationError
    from starlette.responses import Response
    from starlette.types import ASGIApp, Receive, Scope, Send


class BearerAuth:
    """ASGI middleware: :func:`spanrl.core.edge.authorize` before the app sees the request
    (its body unread, so a refusal writes nothing). ``reject(status, reason, detail)`` builds
    the 401/403 body in the service's own error shape (and counts it); this class adds
    ``WWW-Authenticate`` to a 401. Lifespan and open routes pass."""

    def __init__(self, app: ASGIApp, credentials: Credentials, reject: Callable[[int, str, str], Response]):
        if credentials is None:
            raise ValueError("BearerAuth needs credentials")
        self.app, self.credentials, self.reject = app, credentials, reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = authorize(self.credentials, scope["method"], scope["path"], presented(scope["headers"]))
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, reason, detail = refusal
        response = self.reject(status, reason, detail)
        if status == 401:
            response.headers["WWW-Authenticate"] = www_authenticate(reason)
        await response(scope, receive, send)


def presented(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The credential a request presents, as an ``Authorization`` value: that header, else
    ``x-api-key`` (how the Anthropic SDK sends its ``api_key``) as a bearer token."""
    header = next((v for k, v in headers if k == b"authorization"), None)
    if header is None:
        key = next((v for k, v in headers if k == b"x-api-key"), None)
        header = b"Bearer " + key if key else None
    return header


def install_auth(app, credentials: Credentials | SecretStr | str | None,
                 reject: Callable[[int, str, str], Response]) -> None:
    """Add :class:`BearerAuth` to a FastAPI ``app`` (no-op when ``credentials`` is None: open;
    one plain token: that token for both roles, ``spanrl.core.edge.as_credentials``)."""
    creds = as_credentials(credentials)
    if creds is not None:
        app.add_middleware(BearerAuth, credentials=creds, reject=reject)


async def read_body(request, max_bytes: int) -> bytes:
    """The body of a Starlette ``request``, at most ``max_bytes``: a larger ``Content-Length``
    or a chunked body that grows past it raises :class:`BadRequest` 413 ``body_too_large``
    before more is read."""
    from spanrl.core.edge import BadRequest

    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > max_bytes:
        raise BadRequest(413, "body_too_large", f"body of {length} bytes over {max_bytes} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BadRequest(413, "body_too_large", f"body over {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


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
