"""The abuse battery, in-process: every HTTP route of the bridge, the proxy, the trainer, the
reloader and the dashboard x {no credential, a wrong one, the agent token, the administrator
token}, then oversized and malformed bodies. A refusal is a 4xx with a reason, answered
before anything is written (the producers' recording sink, the trainer's requested offsets,
the reloader's history), and the service stays healthy. tests/integration/test_auth_battery.py
runs the same against the real stack."""
from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient as AioClient
from aiohttp.test_utils import TestServer
from fastapi.testclient import TestClient

from spanrl.core.edge import ADMIN_ONLY, INVALID_TOKEN, MISSING_TOKEN, Credentials
from spanrl.core.settings import Settings, TrainerConfig
from spanrl.infra.stack import Stack
from spanrl.producers import bridge, proxy
from spanrl.producers.kafka import Topics
from spanrl.trainer.reloader import Reloader, ReloaderConfig
from spanrl.trainer.train import Trainer, http_app
from tests.unit.test_producers_bridge import RecordingSink

AGENT, ADMIN = "agent-tok-5c1f", "admin-tok-9e2d"
CREDS = Credentials(agent=(AGENT,), admin=ADMIN)
WHO = {"none": {}, "wrong": {"Authorization": "Bearer not-a-token"},
       "agent": {"Authorization": f"Bearer {AGENT}"}, "admin": {"Authorization": f"Bearer {ADMIN}"}}
PB = {"content-type": "application/x-protobuf"}


def _bridge_routes() -> list[tuple[str, str, dict, bool]]:
    """(method, path, request keywords, administrator only) of every bridge route but /health."""
    return [("POST", "/v1/traces", {"content": b"", "headers": PB}, False),
            ("POST", "/v1/rewards", {"json": {"rollout_id": "r", "value": 1.0}}, False),
            ("POST", "/v1/rollouts/r/end", {"json": {"status": "succeeded"}}, False),
            ("GET", "/status", {}, False), ("GET", "/metrics", {}, False),
            ("GET", "/docs", {}, False), ("GET", "/openapi.json", {}, False)]


def _proxy_routes() -> list[tuple[str, str, dict, bool]]:
    """Every proxy route but /health: the client-API routes of every family, their /models,
    the admin routes."""
    out = [("POST", path.format(sampling="0", rollout_id="r", attempt_id="0"),
            {"json": {"model": "policy", "messages": [{"role": "user", "content": "x"}]}}, False)
           for _, path, _ in proxy.client_routes()]
    out += [("GET", prefix.format(sampling="0", rollout_id="r", attempt_id="0") + "/models", {}, False)
            for prefix in proxy.ROUTE_FAMILIES.values()]
    return out + [("GET", "/admin/policy_version", {}, True),
                  ("POST", "/admin/policy_version", {"json": {"version": 3}}, True),
                  ("POST", "/admin/policy_unsynced", {"json": {"reason": "battery"}}, True),
                  ("GET", "/status", {}, False), ("GET", "/metrics", {}, False), ("GET", "/docs", {}, False)]


def _producers(max_body_bytes: int = 1 << 20):
    sink = RecordingSink(Topics.with_prefix("battery-"))
    apps = {"bridge": bridge.create_app(sink, max_body_bytes=max_body_bytes, credentials=CREDS,
                                        claim_client=object(), payload_bucket="b"),
            "proxy": proxy.create_app(sink, "http://127.0.0.1:1", "policy", credentials=CREDS, claim_client=object(),
                                      payload_bucket="b", max_body_bytes=max_body_bytes)}
    return sink, apps


def _reason(service: str, r) -> str:
    body = r.json()
    return body["error"]["type"] if service == "proxy" else body["error"]


@pytest.mark.parametrize("service", ["bridge", "proxy"])
def test_producers_every_route_by_every_credential(service):
    sink, apps = _producers()
    routes = _bridge_routes() if service == "bridge" else _proxy_routes()
    with TestClient(apps[service]) as c:
        refused = []
        for method, path, kw, admin_only in routes:
            for who, want in [("none", (401, MISSING_TOKEN)), ("wrong", (401, INVALID_TOKEN)),
                              *([("agent", (403, ADMIN_ONLY))] if admin_only else [])]:
                r = c.request(method, path, **{**kw, "headers": {**kw.get("headers", {}), **WHO[who]}})
                assert (r.status_code, _reason(service, r)) == want, (method, path, who)
                refused.append(r)
        assert sink.sent == []  # nothing reached Kafka
        assert c.get("/health").status_code == 200
        for method, path, kw, admin_only in routes:
            for who in (("admin",) if admin_only else ("agent", "admin")):
                r = c.request(method, path, **{**kw, "headers": {**kw.get("headers", {}), **WHO[who]}})
                assert r.status_code not in (401, 403), (method, path, who, r.text)
        status = c.get("/status", headers=WHO["admin"]).json()
    n_admin = sum(a for *_, a in routes)
    assert (status["http_401"], status[MISSING_TOKEN], status[INVALID_TOKEN], status.get("http_403", 0)) == (
        2 * len(routes), len(routes), len(routes), n_admin)
    for r in refused:
        assert AGENT not in r.text and ADMIN not in r.text


def test_a_late_human_rating_goes_through_the_administrator():
    """One agent token: any agent may post a reward for a rollout (they share the credential);
    the administrator posts late ratings for any rollout (docs/operations.md, Credentials)."""
    sink, apps = _producers()
    with TestClient(apps["bridge"]) as c:
        r = c.post("/v1/rewards", json={"rollout_id": "r-late", "value": 0.75, "name": "human"}, headers=WHO["admin"])
    assert (r.status_code, [(t, k) for t, k, _ in sink.sent]) == (200, [("battery-rewards", "r-late")])


def test_producers_refuse_oversized_and_malformed_bodies_and_write_nothing():
    sink, apps = _producers(max_body_bytes=1000)
    admin = WHO["admin"]
    with TestClient(apps["bridge"]) as b, TestClient(apps["proxy"]) as p:
        got = [
            (b.post("/v1/traces", content=b"\0" * 1001, headers={**PB, **admin}), (413, "body_too_large")),
            (b.post("/v1/traces", content=b"\xff\x01garbage", headers={**PB, **admin}), (400, "invalid_otlp")),
            (b.post("/v1/rewards", content=b"{", headers={"content-type": "application/json", **admin}),
             (422, "invalid_request")),  # FastAPI's JSON decode error, in the bridge's shape
            (b.post("/v1/rewards", content=b'{"rollout_id": "r", "value": NaN}',
                    headers={"content-type": "application/json", **admin}), (400, "invalid_reward")),
            (b.post("/v1/rollouts/r/end", json={"status": "maybe"}, headers=admin), (422, "invalid_request")),
        ]
        for r, want in got:
            assert (r.status_code, r.json()["error"]) == want, r.text
        chat = "/rollouts/r/attempts/0/v1/chat/completions"
        got = [
            (p.post(chat, content=b"{" + b" " * 1000 + b"}", headers={"content-type": "application/json", **admin}),
             (413, "body_too_large")),
            (p.post(chat, content=b"{", headers={"content-type": "application/json", **admin}), (400, "invalid_json")),
            (p.post(chat, content=b"x", headers={"content-type": "text/plain", **admin}),
             (415, "unsupported_media_type")),
            (p.post("/admin/policy_version", json={"version": "three"}, headers=admin), (422, "invalid_request")),
        ]
        for r, want in got:
            assert (r.status_code, r.json()["error"]["type"]) == want, r.text
        assert b.get("/health").status_code == p.get("/health").status_code == 200
        assert p.get("/admin/policy_version", headers=admin).json()["version"] == 0  # the bad post changed nothing
    assert sink.sent == []


def _aio(make_app, requests: list[tuple[str, str, dict]]) -> list[tuple[int, dict | str]]:
    """The answers of the app ``make_app()`` (one per event loop) to ``requests`` ((method,
    path, keywords)), in order."""

    async def go():
        async with AioClient(TestServer(make_app())) as c:
            out = []
            for method, path, kw in requests:
                r = await c.request(method, path, **kw)
                text = await r.text()
                try:
                    out.append((r.status, json.loads(text)))
                except ValueError:
                    out.append((r.status, text))
            return out

    return asyncio.run(go())


def _settings(tmp_path, **kw) -> Settings:
    return Settings(_env_file=None, state_dir=tmp_path / "state", vllm_port=1, proxy_port=1, **kw)


def test_trainer_routes_by_credential_and_bad_bodies(tmp_path):
    trainer = Trainer(TrainerConfig(run="battery", batching="barrier", http=False, log_path=tmp_path / "t.jsonl"),
                      settings=_settings(tmp_path))
    def app():
        return http_app(trainer.status, **trainer.http_routes(), credentials=CREDS, max_body_bytes=1000)

    train = {"json": {"until": {"samples:0": 5}}}
    refusals = [("GET", "/status", {}), ("GET", "/metrics", {}), ("POST", "/admin/train", train)]
    answers = _aio(app, [(m, p, {**kw, "headers": WHO["none"]}) for m, p, kw in refusals]
                   + [(m, p, {**kw, "headers": WHO["wrong"]}) for m, p, kw in refusals]
                   + [("POST", "/admin/train", {**train, "headers": WHO["agent"]}),
                      ("POST", "/admin/train", {"data": b"{" * 1001, "headers": WHO["admin"]}),
                      ("POST", "/admin/train", {"data": b"{", "headers": WHO["admin"]}),
                      ("POST", "/admin/train", {"json": [1], "headers": WHO["admin"]}),
                      ("POST", "/admin/train", {"json": {"until": {"samples:x": 1}}, "headers": WHO["admin"]}),
                      ("GET", "/health", {})])
    assert [(s, b["error"]) for s, b in answers[:-1]] == (
        [(401, MISSING_TOKEN)] * 3 + [(401, INVALID_TOKEN)] * 3
        + [(403, ADMIN_ONLY), (413, "too_large"), (400, "invalid_json"), (400, "invalid_json"), (400, "invalid_until")])
    assert answers[-1] == (200, {"ok": True})
    assert trainer._train_until == {} and trainer.state.train_until == {}  # nothing asked for
    ok = _aio(app, [("GET", "/status", {"headers": WHO["agent"]}),
                    ("POST", "/admin/train", {**train, "headers": WHO["admin"]})])
    assert ok[0][0] == 200 and ok[1] == (202, {"until": {"samples:0": 5}})
    assert trainer._train_until == {0: 5}


def test_reloader_routes_by_credential_and_bad_bodies(tmp_path):
    reloader = Reloader(ReloaderConfig(run="battery", http=False), settings=_settings(tmp_path))
    def app():
        return http_app(reloader.status, **reloader.http_routes(), credentials=CREDS)

    pin = {"json": {"run": "battery", "version": 1}}
    refusals = [("GET", "/status", {}), ("GET", "/metrics", {}), ("GET", "/policy", {}),
                ("POST", "/admin/pin", pin), ("POST", "/admin/unpin", {"json": {}})]
    answers = _aio(app, [(m, p, {**kw, "headers": WHO["none"]}) for m, p, kw in refusals]
                   + [(m, p, {**kw, "headers": WHO["agent"]}) for m, p, kw in refusals if p.startswith("/admin/")]
                   + [("POST", "/admin/pin", {"data": b"{", "headers": WHO["admin"]}),
                      ("POST", "/admin/pin", {"json": {"version": "one"}, "headers": WHO["admin"]}),
                      ("GET", "/health", {})])
    assert [(s, b["error"]) for s, b in answers[:-1]] == (
        [(401, MISSING_TOKEN)] * 5 + [(403, ADMIN_ONLY)] * 2 + [(400, "invalid_json"), (400, "bad_request")])
    assert answers[-1] == (200, {"ok": True})
    assert (reloader.history, reloader.pinned) == ([], None)  # nothing pinned, nothing recorded
    ok = _aio(app, [("GET", "/policy", {"headers": WHO["agent"]}), ("POST", "/admin/unpin", {"headers": WHO["admin"]})])
    assert ok[0] == (200, {"version": 0, "checkpoint": "", "synced": False})  # vLLM at port 1: not synced
    assert ok[1][0] == 200 and ok[1][1]["pinned"] is None and reloader.history == []


def test_dashboard_reads_with_either_token_and_writes_only_as_administrator(tmp_path):
    from spanrl.infra.dashboard.app import create_app

    s = _settings(tmp_path, auth_token=AGENT, admin_token=ADMIN, base_model_dir="/nonexistent", trainer_port=1,
                  reloader_port=1, kafka_port=1, minio_port=1)
    pages = ["/", "/training", "/pipeline", "/api/rollouts", "/rollouts/nope"]
    with TestClient(create_app(s, tail=False, eval_dirs=[tmp_path])) as c:
        for path in pages:
            assert [c.get(path, headers=WHO[w]).status_code for w in ("none", "wrong")] == [401, 401], path
            for who in ("agent", "admin"):
                assert c.get(path, headers=WHO[who]).status_code in (200, 404), (path, who)
        r = c.post("/", headers=WHO["agent"])
        assert (r.status_code, r.text.split(":")[0]) == (403, f"403 {ADMIN_ONLY}")
        assert c.post("/", headers=WHO["admin"]).status_code == 405  # past auth: the dashboard has no writes
        assert c.post("/", headers=WHO["none"]).status_code == 401
        assert c.get("/health").status_code == 200


def test_the_stack_makes_its_secrets_once_and_prints_the_tokens_once(tmp_path, capsys):
    s = _settings(tmp_path)
    assert (s.auth_token, s.admin_token) == (None, None)
    stack = Stack(s)
    assert stack.ensure_credentials() == ["agent_token", "admin_token", "checkpoint_key"]
    err = capsys.readouterr().err
    agent, admin = s.auth_token.get_secret_value(), s.admin_token.get_secret_value()
    assert f"  agent_token: {agent}\n  admin_token: {admin}\n" in err and "checkpoint_key:" not in err
    assert Settings(_env_file=None, state_dir=tmp_path / "state").credentials() == Credentials(agent=(agent,), admin=admin)
    assert Stack(_settings(tmp_path)).ensure_credentials() == []  # a later start: reused, not shown
    assert capsys.readouterr().err == ""
    open_stack = Stack(_settings(tmp_path / "open", auth="open"))
    assert open_stack.ensure_credentials() == []
    assert "SPANRL_AUTH=open" in capsys.readouterr().err and not (tmp_path / "open" / "state" / "secrets").exists()


def test_an_anthropic_clients_x_api_key_is_a_bearer_token():
    _, apps = _producers()
    messages = {"model": "policy", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    with TestClient(apps["proxy"]) as c:
        answers = [c.post("/rollouts/r/attempts/0/v1/messages", json=messages, headers={"x-api-key": key})
                   for key in (AGENT, "not-a-token")]
        admin_route = c.get("/admin/policy_version", headers={"x-api-key": AGENT})
        both = c.get("/status", headers={"x-api-key": AGENT, "Authorization": "Bearer not-a-token"})
    assert answers[0].status_code not in (401, 403) and answers[1].status_code == 401
    assert (admin_route.status_code, both.status_code) == (403, 401)  # Authorization, when sent, is what counts


def test_a_chunked_body_growing_past_the_limit_is_refused_before_it_is_read_whole():
    sink, apps = _producers(max_body_bytes=1000)

    def chunks():  # no Content-Length: the proxy counts what it reads
        for _ in range(50):
            yield b" " * 100

    with TestClient(apps["proxy"]) as c:
        r = c.post("/rollouts/r/attempts/0/v1/chat/completions", content=chunks(),
                   headers={"content-type": "application/json", **WHO["agent"]})
    assert (r.status_code, r.json()["error"]["type"]) == (413, "body_too_large")
    assert "content-length" not in r.request.headers and sink.sent == []
