"""The dashboard's way in with auth on (spanrl/core/edge.py: the agent or the administrator
token reads the pages; a write, any method but GET and HEAD, would need the administrator's:
the dashboard has none today).

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

from spanrl.core.edge import ADMIN, ADMIN_ONLY, OPEN_ROUTES, Credentials, as_credentials

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


#: methods that only read
READS = frozenset({"GET", "HEAD"})


class DashboardAuth:
    """ASGI middleware: bearer header, the session cookie, or ``?token=`` once (module doc);
    anything else gets 401 with the reason (``missing_token`` / ``invalid_token``), a write
    without the administrator's token 403 ``admin_only``."""

    def __init__(self, app: ASGIApp, credentials: Credentials | str):
        creds = as_credentials(credentials)
        if creds is None:
            raise ValueError("DashboardAuth needs credentials")
        self.app, self.credentials = app, creds
        #: cookie value -> the role of the token it was made from
        self._cookies = {cookie_value(t): r for r, t in [*(("agent", t) for t in creds.agent), (ADMIN, creds.admin)]}

    def _role(self, headers, query: str) -> tuple[str | None, str, bool]:
        """(role or None, 401 reason, whether ``?token=`` gave the role)."""
        header = next((v for k, v in headers if k == b"authorization"), None)
        if header is not None:
            role, reason = self.credentials.role(header)
            if role is not None:
                return role, "", False
        cookie = _cookie(headers)
        if cookie is not None:
            for value, role in self._cookies.items():
                if hmac.compare_digest(cookie.encode(), value.encode()):
                    return role, "", False
        given = [v for k, v in parse_qsl(query, keep_blank_values=True) if k == "token"]
        if given:
            role, _ = self.credentials.role(b"Bearer " + given[-1].encode())
            if role is not None:
                return role, "", True
        return None, ("invalid_token" if given or header is not None or cookie is not None else "missing_token"), False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) in OPEN_ROUTES:
            await self.app(scope, receive, send)
            return
        query = scope.get("query_string", b"").decode("latin-1")
        role, reason, from_query = self._role(scope["headers"], query)
        if role is None:
            response = PlainTextResponse(
                f"401 {reason}: open this page once with ?token=<agent or administrator token>, or send "
                "'Authorization: Bearer <token>'", status_code=401,
                headers={"WWW-Authenticate": 'Bearer realm="spanrl"'})
        elif scope["method"] not in READS and role != ADMIN:
            response = PlainTextResponse(f"403 {ADMIN_ONLY}: a write needs the administrator token", status_code=403)
        elif from_query:
            token = [v for k, v in parse_qsl(query, keep_blank_values=True) if k == "token"][-1]
            rest = without_token(query)
            response = RedirectResponse(scope["path"] + (f"?{rest}" if rest else ""), status_code=303)
            response.set_cookie(COOKIE, cookie_value(token), httponly=True, samesite="strict", path="/")
        else:
            await self.app(scope, receive, send)
            return
        await response(scope, receive, send)
