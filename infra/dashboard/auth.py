"""The dashboard's way in when the stack has a bearer token (``SPANRL_AUTH_TOKEN``).

A program sends ``Authorization: Bearer <token>`` as to the bridge and the proxy
(producers/edge.py). A browser cannot, so it opens any page once with ``?token=<token>``:
the dashboard answers 303 to the same URL without the token and sets the cookie
``spanrl_dashboard`` (HttpOnly, SameSite=Strict, Path=/). The cookie holds
:func:`cookie_value` (an HMAC-SHA256 of a fixed label keyed by the token), not the token
itself, so the browser's cookie store never holds the credential. ``GET /health`` is open.
"""
from __future__ import annotations

import hashlib
import hmac
from urllib.parse import parse_qsl, urlencode

from starlette.responses import PlainTextResponse, RedirectResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from spanrl.core.edge import OPEN_ROUTES, check_bearer

COOKIE = "spanrl_dashboard"
_LABEL = b"spanrl-dashboard-session-v1"


def cookie_value(token: str) -> str:
    """Hex HMAC-SHA256 of a fixed label keyed by ``token`` (RFC 2104): what the cookie holds."""
    return hmac.new(token.encode(), _LABEL, hashlib.sha256).hexdigest()


def without_token(query: str) -> str:
    """``query`` with every ``token`` parameter removed (order of the others kept)."""
    return urlencode([(k, v) for k, v in parse_qsl(query, keep_blank_values=True) if k != "token"])


def _cookie(headers: list[tuple[bytes, bytes]]) -> str | None:
    for k, v in headers:
        if k == b"cookie":
            for part in v.decode("latin-1").split(";"):
                name, _, value = part.strip().partition("=")
                if name == COOKIE:
                    return value
    return None


class DashboardAuth:
    """ASGI middleware: bearer header, the session cookie, or ``?token=`` once (module doc);
    anything else gets 401 with the reason (``missing_token`` / ``invalid_token``)."""

    def __init__(self, app: ASGIApp, token: str):
        if not token:
            raise ValueError("DashboardAuth needs a non-empty token")
        self.app, self._token, self._cookie = app, token.encode(), cookie_value(token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) in OPEN_ROUTES:
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        header = next((v for k, v in headers if k == b"authorization"), None)
        if header is not None and check_bearer(header, self._token) is None:
            await self.app(scope, receive, send)
            return
        cookie = _cookie(headers)
        if cookie is not None and hmac.compare_digest(cookie.encode(), self._cookie.encode()):
            await self.app(scope, receive, send)
            return
        query = scope.get("query_string", b"").decode("latin-1")
        given = [v for k, v in parse_qsl(query, keep_blank_values=True) if k == "token"]
        if given and hmac.compare_digest(given[-1].encode(), self._token):
            rest = without_token(query)
            response = RedirectResponse(scope["path"] + (f"?{rest}" if rest else ""), status_code=303)
            response.set_cookie(COOKIE, self._cookie, httponly=True, samesite="strict", path="/")
            await response(scope, receive, send)
            return
        reason = "invalid_token" if given or header is not None or cookie is not None else "missing_token"
        response = PlainTextResponse(
            f"401 {reason}: open this page once with ?token=<SPANRL_AUTH_TOKEN>, or send "
            "'Authorization: Bearer <token>'", status_code=401,
            headers={"WWW-Authenticate": 'Bearer realm="spanrl"'})
        await response(scope, receive, send)
