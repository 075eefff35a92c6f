"""Bearer-token auth of the bridge and the proxy, and the clients that send the token.

The apps run in-process (fastapi TestClient) on a Sink whose Kafka cannot be reached:
a 401 is answered before anything touches Kafka or vLLM.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from examples.math_agent import agent as math_agent
from spanrl.core.edge import INVALID_TOKEN, MISSING_TOKEN, bearer_headers, check_bearer
from spanrl.core.settings import Settings
from spanrl.producers import bridge, instrument, proxy
from spanrl.producers.kafka import Sink, Topics
from spanrl.producers.runner import RolloutContext, Runner

TOKEN = "tok-5f2b9c1e7a"
UNREACHABLE = "127.0.0.1:1"


def test_check_bearer():
    t = TOKEN.encode()
    assert check_bearer(f"Bearer {TOKEN}".encode(), t) is None
    assert check_bearer(f"bearer {TOKEN}".encode(), t) is None  # the scheme is case-insensitive
    assert check_bearer(f"  BEARER   {TOKEN} ".encode(), t) is None
    for header in (None, b"", b"Basic dG9rOg==", TOKEN.encode()):
        assert check_bearer(header, t) == MISSING_TOKEN
    for header in (b"Bearer", b"Bearer " + t[:-1], b"Bearer " + t + b"x", b"Bearer " + t.upper()):
        assert check_bearer(header, t) == INVALID_TOKEN


def test_bearer_headers():
    assert bearer_headers(None) == {} and bearer_headers("") == {}
    assert bearer_headers(Settings(_env_file=None, auth_token=TOKEN).auth_token) == {"Authorization": f"Bearer {TOKEN}"}


def _apps(token):
    sink = Sink(UNREACHABLE, Topics(), send_timeout_s=1.0)
    return {"bridge": bridge.create_app(sink, credentials=token),
            "proxy": proxy.create_app(sink, "http://127.0.0.1:1", "policy", credentials=token)}


#: every route but GET /health, with a body that would pass if the request got through
ROUTES = {
    "bridge": [("POST", "/v1/traces", {"content": b"", "headers": {"content-type": "application/x-protobuf"}}),
               ("POST", "/v1/rewards", {"json": {"rollout_id": "r", "value": 1.0}}),
               ("GET", "/metrics", {}), ("GET", "/status", {}), ("GET", "/docs", {}), ("GET", "/openapi.json", {})],
    "proxy": [("POST", "/rollouts/r/attempts/0/v1/chat/completions", {"json": {"model": "policy", "messages": []}}),
              ("POST", "/rollouts/r/attempts/0/v1/completions", {"json": {"model": "policy", "prompt": "x"}}),
              ("GET", "/rollouts/r/attempts/0/v1/models", {}),
              ("GET", "/admin/policy_version", {}),
              ("POST", "/admin/policy_version", {"json": {"version": 3}}),
              ("GET", "/metrics", {}), ("GET", "/status", {}), ("GET", "/docs", {})],
}


@pytest.mark.parametrize("service", ["bridge", "proxy"])
def test_every_route_but_health_needs_the_token(service, caplog):
    caplog.set_level(logging.DEBUG)
    with TestClient(_apps(TOKEN)[service]) as client:
        assert client.get("/health").status_code == 200
        seen = []
        for method, path, kw in ROUTES[service]:
            for headers, reason in [({}, MISSING_TOKEN), ({"Authorization": "Bearer nope"}, INVALID_TOKEN),
                                    ({"Authorization": f"Basic {TOKEN}"}, MISSING_TOKEN)]:
                r = client.request(method, path, **{**kw, "headers": {**kw.get("headers", {}), **headers}})
                assert r.status_code == 401, (method, path, headers)
                assert r.headers["www-authenticate"].startswith('Bearer realm="spanrl"')
                got = r.json()["error"]
                assert (got["type"] if service == "proxy" else got) == reason
                seen.append(r)
            ok = client.request(method, path, **{**kw, "headers": {**kw.get("headers", {}),
                                                                   "Authorization": f"Bearer {TOKEN}"}})
            assert ok.status_code != 401, (method, path)
            seen.append(ok)
        metrics = client.get("/status", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    n = len(ROUTES[service])
    assert (metrics["http_401"], metrics[MISSING_TOKEN], metrics[INVALID_TOKEN]) == (3 * n, 2 * n, n)
    for r in seen:  # never echoed
        assert TOKEN not in r.text and all(TOKEN not in v for v in r.headers.values())
    assert TOKEN not in caplog.text


@pytest.mark.parametrize("service", ["bridge", "proxy"])
def test_no_token_configured_means_open(service):
    with TestClient(_apps(None)[service]) as client:
        assert client.get("/metrics").status_code == 200


def test_settings_token_is_secret_and_read_from_a_file(tmp_path, monkeypatch):
    monkeypatch.delenv("SPANRL_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("SPANRL_AUTH_TOKEN_FILE", raising=False)
    monkeypatch.setenv("SPANRL_STATE_DIR", str(tmp_path / "state"))  # no stack secrets there
    s = Settings(_env_file=None, auth_token=TOKEN)
    assert TOKEN not in repr(s) and TOKEN not in str(s) and TOKEN not in repr(s.auth_token)
    assert Settings(_env_file=None).auth_token is None
    monkeypatch.setenv("SPANRL_AUTH_TOKEN", "")
    assert Settings(_env_file=None).auth_token is None  # empty: unset
    monkeypatch.delenv("SPANRL_AUTH_TOKEN")
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    monkeypatch.setenv("SPANRL_AUTH_TOKEN_FILE", str(f))
    assert Settings(_env_file=None).auth_token.get_secret_value() == TOKEN
    monkeypatch.setenv("SPANRL_AUTH_TOKEN", "from-env")  # the variable wins over the file
    assert Settings(_env_file=None).auth_token.get_secret_value() == "from-env"
    monkeypatch.delenv("SPANRL_AUTH_TOKEN")
    f.write_text("\n")
    with pytest.raises(ValidationError, match="is empty"):
        Settings(_env_file=None)


def test_runner_gives_the_agent_the_token_as_api_key(tmp_path):
    runner = Runner(lambda ctx: 0.0, settings=Settings(_env_file=None, auth_token=TOKEN))
    assert runner.api_key == TOKEN
    assert Runner(lambda ctx: 0.0, settings=Settings(_env_file=None, state_dir=tmp_path)).api_key == "spanrl"
    ctx = RolloutContext({}, "t", "r", "0", "http://proxy/rollouts/r/attempts/0/v1", api_key=TOKEN)
    assert TOKEN not in repr(ctx)


def test_otlp_exporter_sends_the_token():
    seen = []

    class Receiver(BaseHTTPRequestHandler):  # stands in for the bridge: records the header, answers 200
        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            seen.append((self.path, self.headers.get("authorization")))
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        provider = instrument.instrument("auth-test", f"http://127.0.0.1:{server.server_port}", set_global=False,
                                         auth_token=TOKEN)
        with provider.get_tracer("t").start_as_current_span("s"):
            pass
        assert provider.force_flush(10_000)
        provider.shutdown()
    finally:
        server.shutdown()
    assert seen == [("/v1/traces", f"Bearer {TOKEN}")]


def test_math_agent_sends_the_token_to_the_proxy(monkeypatch):
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json={
            "id": "c1", "object": "chat.completion", "created": 0, "model": "policy",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Answer: 31"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    real = math_agent.make_client
    monkeypatch.setattr(math_agent, "make_client", lambda base_url, **kw: real(
        base_url, http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)), **kw))
    task = {"task_id": "t", "question": "3*12-5?", "answer": "31", "metadata": {}}
    ctx = RolloutContext(task, "t", "r", "0", "http://proxy.test/rollouts/r/attempts/0/v1", api_key=TOKEN)
    assert math_agent.math_agent(ctx)["reward"] == 1.0
    assert seen == [f"Bearer {TOKEN}"]


def test_reloader_tells_the_proxy_with_the_administrator_token(monkeypatch):
    from spanrl.trainer import reloader

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers.get("authorization"), json.loads(request.content)))
        return httpx.Response(200, json={})

    real_client = httpx.AsyncClient
    monkeypatch.setattr(reloader.httpx, "AsyncClient",
                        lambda **kw: real_client(transport=httpx.MockTransport(handler), **kw))
    monkeypatch.setattr(reloader, "get_settings",
                        lambda: Settings(_env_file=None, auth_token=TOKEN, admin_token="adm-" + TOKEN))
    asyncio.run(reloader.notify_proxy("http://proxy.test", 4, "s3://b/run/4/"))
    assert seen == [("/admin/policy_version", f"Bearer adm-{TOKEN}", {"version": 4, "checkpoint": "s3://b/run/4/"})]


def test_settings_credentials_closed_open_and_the_single_token(tmp_path, monkeypatch):
    from spanrl.core.edge import ADMIN, AGENT, Credentials
    from spanrl.core.settings import AuthNotConfigured

    for name in ("SPANRL_AUTH_TOKEN", "SPANRL_AUTH_TOKEN_FILE", "SPANRL_ADMIN_TOKEN", "SPANRL_AUTH"):
        monkeypatch.delenv(name, raising=False)
    state = tmp_path / "state"  # no stack secrets there
    with pytest.raises(AuthNotConfigured, match="start the stack once"):
        Settings(_env_file=None, state_dir=state).credentials()
    assert Settings(_env_file=None, state_dir=state, auth="OPEN").credentials() is None
    with pytest.raises(ValidationError, match="must be `on` or `open`"):
        Settings(_env_file=None, auth="off")
    single = Settings(_env_file=None, state_dir=state, auth_token=TOKEN).credentials()  # the old one-token setup
    assert single.role(f"Bearer {TOKEN}".encode()) == (ADMIN, None)
    both = Settings(_env_file=None, state_dir=state, auth_token=TOKEN, admin_token="adm-" + TOKEN).credentials()
    assert both == Credentials(agent=(TOKEN,), admin="adm-" + TOKEN)
    assert both.role(f"Bearer {TOKEN}".encode()) == (AGENT, None)
    assert both.role(b"Bearer nope") == (None, "invalid_token") and both.role(None) == (None, "missing_token")
    assert TOKEN not in repr(both)
    with pytest.raises(ValueError, match="must differ"):
        Credentials(agent=(TOKEN,), admin=TOKEN)
