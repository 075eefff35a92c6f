"""What every service's HTTP edge shares, without a web framework: bearer-token auth with
two roles (RFC 6750 ``Authorization: Bearer``) and :class:`BadRequest`, the refusal of a
client request.

Roles (:class:`Credentials`): an *agent* token (``SPANRL_AUTH_TOKEN``) may use what an agent
needs, the proxy's LLM routes and the bridge's traces, rewards and rollout-end routes, and
read ``/status`` and ``/metrics``; the *administrator* token (``SPANRL_ADMIN_TOKEN``) may use
every route, the ``/admin/*`` ones only it. With auth on (``SPANRL_AUTH=on``, the default;
the stack generates both tokens, spanrl/core/credentials.py) every request but a health
check must carry one: none or an unknown one -> 401 (``missing_token`` / ``invalid_token``,
``WWW-Authenticate: Bearer``), an agent token on an admin route -> 403 (``admin_only``);
:func:`authorize` is the rule, each service's middleware applies it before reading the body,
so nothing is written on a refusal. Tokens are compared in constant time and never logged or
echoed. Clients send them with :func:`bearer_headers`.
"""
from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass

from pydantic import SecretStr

MISSING_TOKEN = "missing_token"
INVALID_TOKEN = "invalid_token"
ADMIN_ONLY = "admin_only"
AGENT, ADMIN = "agent", "admin"
#: (method, path) answered without a token: liveness probes carry no secret
OPEN_ROUTES = frozenset({("GET", "/health"), ("GET", "/spanrl/health/")})
#: the prefix of every administrator route (proxy, trainer, reloader)
ADMIN_PREFIX = "/admin/"


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


@dataclass(frozen=True)
class Credentials:
    """The tokens a service accepts: ``agent`` (one or more agent tokens) and ``admin``."""

    agent: tuple[str, ...]
    admin: str

    def __post_init__(self):
        if not self.admin or not self.agent or not all(self.agent):
            raise ValueError("Credentials need a non-empty administrator token and agent token(s)")
        if self.admin in self.agent:
            raise ValueError("the administrator token must differ from every agent token")

    def __repr__(self) -> str:  # never print a token
        return f"Credentials(agent=<{len(self.agent)} token(s)>, admin=<set>)"

    def role(self, authorization: bytes | None) -> tuple[str | None, str | None]:
        """``(role, None)`` for a header carrying a known token, else ``(None, 401 reason)``.
        Every known token is compared (constant time each), so the time does not say which."""
        reason = MISSING_TOKEN
        role = None
        for name, token in [(ADMIN, self.admin), *((AGENT, t) for t in self.agent)]:
            got = check_bearer(authorization, token.encode())
            if got is None and role is None:
                role = name
            elif got == INVALID_TOKEN:
                reason = INVALID_TOKEN
        return (role, None) if role else (None, reason)


def as_credentials(value: "Credentials | SecretStr | str | None") -> Credentials | None:
    """:class:`Credentials` from what a service's ``create_app`` was given: None (open), the
    credentials, or one token (legacy single-token mode: it is both the agent and the
    administrator token)."""
    if value is None or isinstance(value, Credentials):
        return value
    token = token_value(value)
    return None if token is None else _SingleToken(token)


class _SingleToken(Credentials):
    """One token for both roles (``as_credentials`` of a plain token)."""

    def __init__(self, token: str):
        object.__setattr__(self, "agent", (token,))
        object.__setattr__(self, "admin", token)

    def role(self, authorization: bytes | None) -> tuple[str | None, str | None]:
        reason = check_bearer(authorization, self.admin.encode())
        return (ADMIN, None) if reason is None else (None, reason)


def is_admin_route(path: str) -> bool:
    """Whether ``path`` is an administrator route (``/admin/...``)."""
    return path.startswith(ADMIN_PREFIX)


def authorize(credentials: Credentials | None, method: str, path: str,
              authorization: bytes | None) -> tuple[int, str, str] | None:
    """None when the request may pass, else ``(status, reason, detail)``: 401 without a known
    token, 403 for an agent token on an administrator route. ``credentials`` None: open."""
    if credentials is None or (method, path) in OPEN_ROUTES:
        return None
    role, reason = credentials.role(authorization)
    if role is None:
        detail = ("this route needs 'Authorization: Bearer <token>' (the agent or administrator token: "
                  "SPANRL_AUTH_TOKEN / SPANRL_ADMIN_TOKEN, or the stack's state_dir/secrets)"
                  if reason == MISSING_TOKEN else "the bearer token is not one this service accepts")
        return 401, reason, detail
    if role != ADMIN and is_admin_route(path):
        return 403, ADMIN_ONLY, f"{path} is an administrator route: it needs the administrator token"
    return None


def www_authenticate(reason: str) -> str:
    """The ``WWW-Authenticate`` value of a 401 with ``reason`` (RFC 6750 s3)."""
    return 'Bearer realm="spanrl"' if reason == MISSING_TOKEN else 'Bearer realm="spanrl", error="invalid_token"'


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` exposes a port only to this machine (``localhost``, 127.0.0.0/8,
    ::1); ``0.0.0.0``, a LAN address or another name: beyond loopback."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def service_credentials(settings, service: str, log) -> Credentials | None:
    """What ``service`` accepts, from ``settings`` (``Settings.credentials``: raises
    ``AuthNotConfigured`` when auth is on without tokens); open mode is said loudly."""
    creds = settings.credentials()
    if creds is None:
        log.warning("*** %s runs OPEN (SPANRL_AUTH=open): no credential is checked; anyone who reaches %s "
                    "may call every route, admin ones included. For a laptop demo only. ***", service, settings.host)
    return creds
