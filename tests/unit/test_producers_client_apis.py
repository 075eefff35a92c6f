"""The proxy's client APIs behind one interface (spanrl.producers.client_apis) and the routes
generated from the table of client APIs × route families (spanrl.producers.proxy)."""
from __future__ import annotations

from fastapi.routing import APIRoute

from spanrl.producers.kafka import Sink, Topics
from spanrl.producers.proxy import create_app

ROLLOUT = "/rollouts/{rollout_id}/attempts/{attempt_id}/v1"
EVAL = "/eval/{sampling}/rollouts/{rollout_id}/attempts/{attempt_id}/v1"
#: every (method, path) the proxy served when its 12 client-API handlers were written by hand
#: (read off producers/proxy.py before the routes were generated from the table)
SERVED = {
    ("POST", ROLLOUT + "/chat/completions"), ("POST", ROLLOUT + "/completions"),
    ("POST", ROLLOUT + "/messages"), ("POST", ROLLOUT + "/responses"),
    ("POST", EVAL + "/chat/completions"), ("POST", EVAL + "/completions"),
    ("POST", EVAL + "/messages"), ("POST", EVAL + "/responses"),
    ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
    ("POST", "/v1/messages"), ("POST", "/v1/responses"),
    ("GET", ROLLOUT + "/models"), ("GET", EVAL + "/models"), ("GET", "/v1/models"),
    ("GET", "/admin/policy_version"), ("POST", "/admin/policy_version"), ("POST", "/admin/policy_unsynced"),
    ("GET", "/health"), ("GET", "/status"), ("GET", "/metrics"),
}


def served(app) -> list[tuple[str, str]]:
    """(method, path) of every route the app's handlers serve (FastAPI's docs pages aside)."""
    return [(method, route.path) for route in app.routes if isinstance(route, APIRoute) for method in route.methods]


def test_the_proxy_serves_the_same_paths():
    app = create_app(Sink("127.0.0.1:1", Topics(), send_timeout_s=1.0), "http://127.0.0.1:1", "policy")
    routes = served(app)
    assert len(routes) == len(set(routes))
    assert set(routes) == SERVED
