"""Bridge, proxy and runner against the real Kafka and vLLM (``spanrl stack up``).

Bridge and proxy run as subprocesses (``python -m spanrl.producers.bridge|proxy``) on free
ports, writing to unique ``prtest-<id>-*`` topics created from ``Topic.config()``.
Fixtures start only the stack components a test needs (``spanrl.infra.stack.Stack.start``, as
``make demo`` does): ``kafka_stack`` needs Kafka, ``stack`` Kafka and vLLM.
"""
from __future__ import annotations

import asyncio
import gzip
import json
import math
import secrets
import socket
import uuid

import httpx
import openai
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from spanrl.infra.stack import Stack
from spanrl.producers import instrument as inst
from spanrl.producers.kafka import Topics, create_topics
from spanrl.producers.otlp import convert_request, decode_request
from spanrl.producers.runner import Runner, publish_tasks
from spanrl.schemas import codec
from tests.integration.services import S, admin_headers, of_rollout, own_topics, read_topic, start_service, stop
from tests.integration.services import topic_prefix as _prefix

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _process_provider_restored():
    """Tests here call ``instrument()`` with their own (private) bridges, which makes that
    provider the process's and binds the frameworks' instrumentations to it; afterwards the
    process's provider (if any) is put back, so a later test's runner does not export to a
    bridge that is gone."""
    before = inst._provider
    yield
    inst._provider = before
    if before is not None:
        inst.instrument_frameworks(before)


@pytest.fixture(scope="module")
def topics():
    """This module's ``prtest-<id>-*`` topics on the stack's Kafka (started if it is not)."""
    Stack(S).start("kafka")
    with own_topics("prtest") as t:
        yield t


@pytest.fixture(scope="module")
def kafka_stack(topics):
    """Bridge and proxy on this module's topics; enough for everything vLLM is not asked for."""
    procs = []
    try:
        bridge, bridge_url = start_service("spanrl.producers.bridge", "--topic-prefix", _prefix(topics),
                                           "--max-body-bytes", "100000")
        procs.append(bridge)
        proxy, proxy_url = start_service("spanrl.producers.proxy", "--topic-prefix", _prefix(topics))
        procs.append(proxy)
        yield {"topics": topics, "bridge": bridge_url, "proxy": proxy_url}
    finally:
        for p in procs:
            stop(p)


@pytest.fixture(scope="module")
def stack(kafka_stack):
    """``kafka_stack`` with vLLM behind the proxy (started if it is not)."""
    Stack(S).start("vllm")
    return kafka_stack


# --------------------------------------------------------------------- bridge
def test_otel_spans_and_reward_reach_kafka(kafka_stack):
    topics = kafka_stack["topics"]
    provider = inst.instrument("itest-agent", kafka_stack["bridge"], set_global=False)
    tracer = provider.get_tracer("itest")
    rid = uuid.uuid4().hex
    with inst.rollout_context(rid, "0", agent_name="solver"):
        with tracer.start_as_current_span("tool.search", attributes={"gen_ai.tool.name": "search", "hits": 3}):
            pass
        inst.emit_reward(0.8, format=1.0)
    with tracer.start_as_current_span("orphan") as orphan:  # no rollout context
        trace_id = format(orphan.get_span_context().trace_id, "032x")
    assert inst.flush()
    provider.shutdown()

    # the exporter got 2xx, so everything is already in Kafka
    spans = of_rollout(read_topic(topics.spans, lambda rs: len(of_rollout(rs, rid)) >= 2, 5), rid)
    assert sorted((s["sequence_id"], s["name"], s["kind"]) for s in spans) == [
        (0, "tool.search", "tool"), (1, "spanrl.reward", "reward")]
    tool = next(s for s in spans if s["kind"] == "tool")
    assert (tool["source"], tool["agent_name"], tool["attributes"]["hits"]) == ("otlp", "solver", "3")
    rewards = read_topic(topics.rewards, lambda rs: bool(of_rollout(rs, rid)), 5)
    [(key, reward)] = [(k, r) for k, r in rewards if r["rollout_id"] == rid]
    assert key == rid and (reward["value"], reward["final"], reward["components"]) == (0.8, True, {"format": 1.0})
    # the span without a rollout id waits on orphan-spans, keyed by its trace id, to be joined
    # by trace in the stream app (stream_jobs/joining.py); it is not dead-lettered at the bridge
    orphans = read_topic(topics.orphan_spans, lambda rs: any(k == trace_id for k, _ in rs), 5)
    [(_, o)] = [(k, r) for k, r in orphans if k == trace_id]
    assert (o["name"], o["rollout_id"], o["attempt_id"], o["trace_id"]) == ("orphan", "", "", trace_id)
    metrics = httpx.get(kafka_stack["bridge"] + "/status").json()
    assert metrics["spans"] >= 2 and metrics["orphan_spans"] >= 1


def _otlp_body(attrs: dict) -> bytes:
    req = ExportTraceServiceRequest()
    s = req.resource_spans.add().scope_spans.add().spans.add()
    s.trace_id, s.span_id, s.name = b"\1" * 16, b"\2" * 8, "spanrl.reward"
    for k, v in attrs.items():
        s.attributes.append(KeyValue(key=k, value=AnyValue(**{"double_value" if isinstance(v, float) else "string_value": v})))
    return req.SerializeToString()


def test_bridge_rejects_bad_input(kafka_stack):
    bridge, topics = kafka_stack["bridge"], kafka_stack["topics"]
    url = bridge + "/v1/traces"
    pb = {"content-type": "application/x-protobuf"}
    before = httpx.get(bridge + "/status").json()
    assert httpx.post(url, content=b"{}", headers={"content-type": "text/plain"}).status_code == 415  # JSON is OTLP/JSON now
    assert httpx.post(url, content=b"", headers=pb).status_code == 400
    assert httpx.post(url, content=b"\xff\x01garbage", headers=pb).status_code == 400
    assert httpx.post(url, content=b"\0" * 200_000, headers=pb).status_code == 413
    # invalid UTF-8 in a string field: protobuf refuses the request (proto3 strings are UTF-8)
    bad_utf8 = _otlp_body({"spanrl.rollout_id": "RID-PLACEHOLDER"}).replace(b"RID-PLACEHOLDER", b"RID-\xff\xfePLACEHOLD")
    r = httpx.post(url, content=bad_utf8, headers=pb)
    assert (r.status_code, r.json()["error"]) == (400, "invalid_otlp")

    rid, inf_rid = uuid.uuid4().hex, uuid.uuid4().hex
    for rollout, value in [(rid, math.nan), (inf_rid, math.inf)]:
        r = httpx.post(url, content=gzip.compress(_otlp_body({"spanrl.rollout_id": rollout, "spanrl.reward.value": value})),
                       headers={**pb, "content-encoding": "gzip"})
        assert r.status_code == 200
        resp = ExportTraceServiceResponse.FromString(r.content)
        assert resp.partial_success.rejected_spans == 1 and "invalid_reward" in resp.partial_success.error_message
    dead = read_topic(topics.dead_letter, lambda rs: bool(of_rollout(rs, rid)) and bool(of_rollout(rs, inf_rid)), 5)
    for rollout, value in [(rid, "nan"), (inf_rid, "inf")]:
        [(key, d)] = [(k, d) for k, d in dead if d["rollout_id"] == rollout]
        assert (key, d["reason"], d["stage"]) == (rollout, "invalid_reward", "bridge")
        assert value in d["detail"] and d["payload"]  # the protobuf span, for a look later

    rurl = bridge + "/v1/rewards"
    js = {"content-type": "application/json"}
    assert httpx.post(rurl, json={"attempt_id": "0", "value": 1.0}).status_code == 422
    for body in (b'{"rollout_id": "x", "value": NaN}', b'{"rollout_id": "x", "value": Infinity}',
                 b'{"rollout_id": "x", "value": -1e999}', b'{"rollout_id": "x", "value": 1, "components": {"c": Infinity}}'):
        r = httpx.post(rurl, content=body, headers=js)
        assert (r.status_code, r.json()["error"]) == (400, "invalid_reward"), body
    assert httpx.post(rurl, json={"rollout_id": rid, "attempt_id": "0", "value": 0.25, "final": True,
                                  "name": "judge"}).status_code == 200
    rewards = read_topic(topics.rewards, lambda rs: bool(of_rollout(rs, rid)), 5)
    assert [(r["value"], r["name"]) for r in of_rollout(rewards, rid)] == [(0.25, "judge")]
    after = httpx.get(bridge + "/status").json()
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in (
        "unsupported_media_type", "invalid_otlp", "body_too_large", "dead_letter.invalid_reward",
        "invalid_reward", "invalid_request", "rewards")}
    assert grew == {"unsupported_media_type": 1, "invalid_otlp": 3, "body_too_large": 1, "dead_letter.invalid_reward": 2,
                    "invalid_reward": 4, "invalid_request": 1, "rewards": 1}


def test_bridge_kafka_down_is_503():
    proc, url = start_service("spanrl.producers.bridge", "--kafka-bootstrap", "127.0.0.1:1")
    try:
        r = httpx.post(url + "/v1/traces", content=_otlp_body({"spanrl.rollout_id": "r", "spanrl.reward.value": 1.0}),
                       headers={"content-type": "application/x-protobuf"}, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"]
    finally:
        stop(proc)


def test_bridge_bounds_records_waiting_for_acks(tmp_path):
    """A Kafka that takes connections but never answers: the first requests wait the send
    timeout and get 503 kafka_unavailable; those that would overfill the in-flight bound get
    503 buffer_full at once; nothing is answered 2xx."""
    timeout_s = 2.0
    body = _otlp_body({"spanrl.rollout_id": "bp", "spanrl.reward.value": 1.0})
    size = sum(len(codec.encode(t, c.span if t == "span" else c.reward)) + len("bp")
               for c in convert_request(decode_request(body)) for t in ("span", "reward"))
    with socket.socket() as silent:  # listens, never accepts: connects succeed, requests hang
        silent.bind((S.host, 0))
        silent.listen(128)
        proc, url = start_service("spanrl.producers.bridge", "--kafka-bootstrap", f"{S.host}:{silent.getsockname()[1]}",
                                  "--max-inflight-bytes", str(2 * size + size // 2),
                                  env={"SPANRL_KAFKA_SEND_TIMEOUT_S": str(timeout_s)})
        try:
            answered: list[str] = []  # errors in the order the answers came

            async def one(client):
                r = await client.post(url + "/v1/traces", content=body, headers={"content-type": "application/x-protobuf"})
                answered.append(r.json()["error"])
                return r.status_code, r.json()["error"], r.headers.get("retry-after")

            async def go():
                async with httpx.AsyncClient(timeout=30) as client:
                    calls = [asyncio.create_task(one(client)) for _ in range(6)]
                    while len(answered) < 4 and not all(c.done() for c in calls):
                        await asyncio.sleep(0.02)
                    # the moment 4 were answered: what the bridge holds, and who is still waiting
                    waiting = (await client.get(url + "/status")).json()
                    first = list(answered)
                    return await asyncio.gather(*calls), first, waiting

            answers, first, waiting = asyncio.run(go())
            metrics = httpx.get(url + "/status").json()
        finally:
            stop(proc)
    full = [a for a in answers if a[1] == "buffer_full"]
    unavailable = [a for a in answers if a[1] == "kafka_unavailable"]
    assert (len(full), len(unavailable)) == (4, 2)
    assert all(status == 503 and retry == "1" for status, _, retry in full)
    assert all(status == 503 and retry for status, _, retry in unavailable)
    # order, not wall-clock bounds: the overflowing requests were refused while the first two
    # still waited for Kafka (their records in flight), and those two ended with kafka_unavailable
    assert first == ["buffer_full"] * 4 and answered[4:] == ["kafka_unavailable"] * 2
    assert waiting["inflight_bytes"] == 2 * size and waiting["max_inflight_bytes"] == 2 * size + size // 2
    assert (metrics["buffer_full"], metrics["kafka_unavailable"], metrics["inflight_bytes"]) == (4, 2, 0)
    assert "spans" not in metrics


def test_bearer_token_on_bridge_and_proxy(topics, tmp_path):
    """With SPANRL_AUTH_TOKEN set (the agent token; the administrator's is the stack's): no or
    a wrong token -> 401, the agent token -> through but 403 on an admin route, which takes the
    administrator's; the token never shows in what the services print. (vLLM is not needed: a
    proxy call that got past auth answers 503 vllm_unavailable.)"""
    token = "itest-" + secrets.token_urlsafe(24)
    env = {"SPANRL_AUTH_TOKEN": token}
    logs = {name: tmp_path / f"{name}.log" for name in ("bridge", "proxy")}
    bridge, bridge_url = start_service("spanrl.producers.bridge", "--topic-prefix", _prefix(topics), env=env,
                                       output=logs["bridge"])
    proxy = None
    try:
        proxy, proxy_url = start_service("spanrl.producers.proxy", "--topic-prefix", _prefix(topics),
                                         "--vllm-url", "http://127.0.0.1:1", "--reloader-url", "",
                                         env=env, output=logs["proxy"])
        rid = uuid.uuid4().hex
        body = _otlp_body({"spanrl.rollout_id": rid, "spanrl.reward.value": 0.5})
        pb = {"content-type": "application/x-protobuf"}
        good, wrong = {"Authorization": f"Bearer {token}"}, {"Authorization": f"Bearer {token}x"}
        for url in (bridge_url, proxy_url):
            assert httpx.get(url + "/health").status_code == 200  # open: liveness probes carry no secret
            for headers, reason in [({}, "missing_token"), (wrong, "invalid_token")]:
                r = httpx.get(url + "/metrics", headers=headers)
                assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
                assert reason in r.text and token not in r.text

        # bridge: OTLP through the SDK exporter with and without the token
        for t, ok in [(None, False), (token + "x", False), (token, True)]:
            provider = inst.instrument("itest-auth", bridge_url, set_global=False, auth_token=t)
            with inst.rollout_context(rid, "0"):
                with provider.get_tracer("itest").start_as_current_span(f"tool.auth-{ok}"):
                    pass
            assert provider.force_flush(10_000) is True
            provider.shutdown()
        assert httpx.post(bridge_url + "/v1/traces", content=body, headers={**pb, **wrong}).status_code == 401
        r = httpx.post(bridge_url + "/v1/traces", content=body, headers={**pb, **good})
        assert r.status_code == 200
        spans = read_topic(topics.spans, lambda rs: len(of_rollout(rs, rid)) >= 2, 10)
        assert sorted(s["name"] for s in of_rollout(spans, rid)) == ["spanrl.reward", "tool.auth-True"]
        rewards = read_topic(topics.rewards, lambda rs: bool(of_rollout(rs, rid)), 5)
        assert [r["value"] for r in of_rollout(rewards, rid)] == [0.5]
        bm = httpx.get(bridge_url + "/status", headers=good).json()
        # instrument(auth_token=None) sends this process's agent token, the stack's (not this
        # bridge's: invalid), or none when the stack has none (missing)
        missing = 2 if S.auth_token is None else 1
        assert (bm["spans"], bm["http_401"], bm["missing_token"], bm["invalid_token"]) == (2, 5, missing, 5 - missing)

        # proxy: the OpenAI SDK sends api_key as the bearer token
        base = f"{proxy_url}/rollouts/{rid}/attempts/0/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key=token + "x", max_retries=0).models.list()
        with pytest.raises(openai.InternalServerError) as past_auth:
            openai.OpenAI(base_url=base, api_key=token, max_retries=0).chat.completions.create(
                model=S.model_name, messages=[{"role": "user", "content": "x"}])
        assert past_auth.value.status_code == 503 and "vllm_unavailable" in str(past_auth.value.body)
        assert httpx.post(proxy_url + "/admin/policy_version", json={"version": 3}).status_code == 401
        r = httpx.post(proxy_url + "/admin/policy_version", json={"version": 3}, headers=good)
        assert (r.status_code, r.json()["error"]["type"]) == (403, "admin_only")
        assert httpx.post(proxy_url + "/admin/policy_version", json={"version": 3},
                          headers=admin_headers()).json()["version"] == 3
        pm = httpx.get(proxy_url + "/status", headers=good).json()
        assert (pm["http_401"], pm["http_403"], pm["vllm_unavailable"], pm["policy_version"]) == (4, 1, 1, 3)
    finally:
        for p in (bridge, proxy):
            if p is not None:
                stop(p)
    for name, path in logs.items():
        printed = path.read_text(errors="replace")
        assert token not in printed, f"{name} printed the token"


def test_runner_agent_and_reloader_through_a_proxy_with_a_token(stack, tmp_path, monkeypatch):
    """The runner hands the agent the token as ``ctx.api_key``; the call is recorded; the
    reloader's policy-version update carries the administrator token."""
    from spanrl.core.settings import Settings
    from spanrl.trainer import reloader

    token = "itest-" + secrets.token_urlsafe(24)
    settings = Settings(auth_token=token)
    own = Topics.with_prefix(_prefix(stack["topics"]) + "tok-")  # its rollouts stay out of the runner tests'
    asyncio.run(create_topics(S.kafka_bootstrap, own.all()))
    log = tmp_path / "proxy.log"
    proc, proxy_url = start_service("spanrl.producers.proxy", "--topic-prefix", _prefix(own),
                                    env={"SPANRL_AUTH_TOKEN": token}, output=log)
    try:
        monkeypatch.setattr(reloader, "get_settings", lambda: settings)
        asyncio.run(reloader.notify_proxy(proxy_url, 5, "s3://b/run/5/"))
        assert httpx.get(proxy_url + "/admin/policy_version", headers=admin_headers()).json()["version"] == 5

        async def agent(ctx):
            async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
                await client.chat.completions.create(model=S.model_name, max_tokens=3,
                                                     messages=[{"role": "user", "content": "hi"}])
            return 1.0

        runner = Runner(agent, proxy_url=proxy_url, topics=own, settings=settings)
        [[result]] = asyncio.run(runner.run_tasks([{"payload": "{}", "group_size": 1}]))
    finally:
        stop(proc)
    assert (result.status, result.error) == ("succeeded", None)
    spans = read_topic(own.spans, lambda rs: bool(of_rollout(rs, result.rollout_id)), 10)
    [span] = of_rollout(spans, result.rollout_id)
    assert (span["source"], span["llm"]["policy_version"]) == ("proxy", 5)
    assert token not in log.read_text(errors="replace")


# --------------------------------------------------------------------- proxy
def test_proxy_records_exact_tokens(stack):
    proxy, topics = stack["proxy"], stack["topics"]
    assert httpx.post(proxy + "/admin/policy_version", json={"version": 7, "checkpoint": "s3://b/run/7/"}).status_code == 200
    assert httpx.get(proxy + "/admin/policy_version").json()["version"] == 7
    rid = uuid.uuid4().hex
    client = openai.OpenAI(base_url=f"{proxy}/rollouts/{rid}/attempts/0/v1", api_key="unused",
                           default_headers={"x-spanrl-agent": "solver"})
    assert [m.id for m in client.models.list().data] == [S.model_name]
    asked = client.chat.completions.create(model=S.model_name, messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=8, temperature=0.7, logprobs=True,
                                           extra_body={"return_token_ids": True})
    plain = client.chat.completions.create(model=S.model_name, messages=[{"role": "user", "content": "2+2?"}],
                                           max_tokens=6)
    compl = client.completions.create(model=S.model_name, prompt="2+2=", max_tokens=4)

    # what the client did not ask for is stripped
    assert plain.choices[0].logprobs is None and plain.choices[0].model_extra.get("token_ids") is None
    assert plain.model_extra.get("prompt_token_ids") is None
    assert compl.choices[0].logprobs is None

    spans = of_rollout(read_topic(topics.spans, lambda rs: len(of_rollout(rs, rid)) >= 3, 10), rid)
    assert [s["sequence_id"] for s in spans] == [0, 1, 2]  # one partition per key keeps order
    first = spans[0]
    llm = first["llm"]
    assert llm["prompt_token_ids"] == asked.model_extra["prompt_token_ids"]
    assert llm["completion_token_ids"] == asked.choices[0].model_extra["token_ids"]
    assert llm["completion_logprobs"] == pytest.approx([t.logprob for t in asked.choices[0].logprobs.content], rel=1e-6)
    assert len(llm["completion_logprobs"]) == len(llm["completion_token_ids"]) == asked.usage.completion_tokens
    assert (llm["policy_version"], llm["model"], llm["temperature"], llm["max_tokens"], llm["request_id"]) == \
        (7, S.model_name, 0.7, 8, asked.id)
    assert (first["source"], first["kind"], first["name"], first["agent_name"]) == ("proxy", "llm", "chat.completions", "solver")
    assert first["attributes"]["gen_ai.usage.output_tokens"] == str(asked.usage.completion_tokens)
    assert len(first["trace_id"]) == 32 and len(first["span_id"]) == 16
    # token ids are recorded even when the client did not ask for them
    for s in spans[1:]:
        assert len(s["llm"]["completion_logprobs"]) == len(s["llm"]["completion_token_ids"]) > 0
        assert s["llm"]["prompt_token_ids"]
    assert spans[2]["name"] == "completions" and spans[2]["llm"]["policy_version"] == 7


def test_proxy_rejects_bad_input(kafka_stack):
    proxy = kafka_stack["proxy"]
    base = f"{proxy}/rollouts/r/attempts/0/v1/chat/completions"
    msg = [{"role": "user", "content": "x"}]
    before = httpx.get(proxy + "/status").json()
    cases = [
        ({"model": S.model_name, "messages": msg, "n": 0}, 400, "invalid_request"),
        ({"model": S.model_name, "messages": msg, "n": 2, "temperature": 0}, 400, "n_requires_sampling"),
        ({"model": "gpt-4", "messages": msg}, 404, "model_not_found"),
    ]
    for body, status, reason in cases:
        r = httpx.post(base, json=body)
        assert (r.status_code, r.json()["error"]["type"]) == (status, reason)
    js = {"content-type": "application/json"}
    raw_cases = [
        (b"{not json", js, 400, "invalid_json"),
        (b"", js, 400, "invalid_json"),                                             # empty body
        (b'{"model": "\xff\xfe", "messages": []}', js, 400, "invalid_json"),        # not UTF-8
        (b'{"model": "policy", "messages": [], "temperature": NaN}', js, 400, "invalid_json"),
        (json.dumps({"model": S.model_name, "messages": msg}).encode(), {"content-type": "text/plain"},
         415, "unsupported_media_type"),                                           # JSON, but sent as text
        (json.dumps({"model": S.model_name, "messages": msg}).encode(), {}, 415, "unsupported_media_type"),
    ]
    for raw, headers, status, reason in raw_cases:
        r = httpx.post(base, content=raw, headers=headers)
        assert (r.status_code, r.json()["error"]["type"]) == (status, reason), raw
    after = httpx.get(proxy + "/status").json()
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in (
        "requests", "http_400", "http_404", "http_415", "invalid_json", "unsupported_media_type", "spans")}
    assert grew == {"requests": 9, "http_400": 6, "http_404": 1, "http_415": 2, "invalid_json": 4,
                    "unsupported_media_type": 2, "spans": 0}


def test_proxy_vllm_down_is_503(kafka_stack):
    proc, url = start_service("spanrl.producers.proxy", "--vllm-url", "http://127.0.0.1:1",
                              "--topic-prefix", _prefix(kafka_stack["topics"]))
    try:
        assert httpx.get(url + "/health").json()["vllm"] is False
        r = httpx.post(url + "/rollouts/r/attempts/0/v1/chat/completions",
                       json={"model": S.model_name, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and r.headers["retry-after"]
    finally:
        stop(proc)


# --------------------------------------------------------------------- runner
def test_runner_runs_groups_and_publishes_lifecycle(stack):
    topics = stack["topics"]
    proxy_url = stack["proxy"]

    async def agent(ctx):
        if ctx.task["mode"] == "fail":
            raise RuntimeError("boom")
        if ctx.task["mode"] == "slow":
            await asyncio.sleep(30)
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key="unused")
        out = await client.chat.completions.create(model=S.model_name, max_tokens=4,
                                                   messages=[{"role": "user", "content": ctx.task["q"]}])
        await client.close()
        ctx.emit_reward(0.5, final=False, name="format")
        return 1.0 if out.choices[0].message.content else 0.0

    async def go():
        ids = await publish_tasks([
            {"payload": json.dumps({"mode": "ok", "q": "Name a color."}), "group_size": 2, "timeout_s": 60},
            {"payload": json.dumps({"mode": "fail"}), "group_size": 1},
            {"payload": json.dumps({"mode": "slow"}), "group_size": 1, "timeout_s": 1.0},
        ], S.kafka_bootstrap, topics)
        runner = Runner(agent, concurrency=4, group_id=f"prtest-{uuid.uuid4().hex[:6]}",
                        proxy_url=proxy_url, topics=topics)
        results = await asyncio.wait_for(runner.run(max_tasks=3), 90)
        return ids, results

    ids, results = asyncio.run(go())
    by_task = {rs[0].task_id: rs for rs in results}
    assert [r.status for r in by_task[ids[0]]] == ["succeeded", "succeeded"]
    assert by_task[ids[1]][0].status == "failed" and "boom" in by_task[ids[1]][0].error
    assert by_task[ids[2]][0].status == "timeout"

    events = read_topic(topics.rollouts, lambda rs: len(rs) >= 8, 10)
    assert len(events) == 8
    for key, e in events:
        assert key == e["rollout_id"] and e["task_id"] in ids
    ok_rids = {r.rollout_id for r in by_task[ids[0]]}
    for rid in ok_rids:
        assert [e["status"] for k, e in events if k == rid] == ["started", "succeeded"]
        assert all(e["group_size"] == 2 for k, e in events if k == rid)
    rewards = read_topic(topics.rewards, lambda rs: sum(r["rollout_id"] in ok_rids for _, r in rs) >= 4, 10)
    got = sorted((r["name"], r["value"], r["final"]) for _, r in rewards if r["rollout_id"] in ok_rids)
    assert got == [("format", 0.5, False)] * 2 + [("reward", 1.0, True)] * 2
    spans = read_topic(topics.spans, lambda rs: sum(k in ok_rids for k, _ in rs) >= 2, 10)
    assert {k for k, s in spans if s["source"] == "proxy"} >= ok_rids


def test_runner_sync_agent_otel_spans_and_commits(stack):
    topics = stack["topics"]
    provider = inst.instrument("itest-sync-agent", stack["bridge"], set_global=False)
    tracer = provider.get_tracer("itest")

    def agent(ctx):  # sync: runs in a thread, the rollout context follows it there
        with tracer.start_as_current_span("tool.lookup", attributes={"gen_ai.tool.name": "lookup"}):
            client = openai.OpenAI(base_url=ctx.base_url, api_key="unused")
            client.chat.completions.create(model=S.model_name, max_tokens=3,
                                           messages=[{"role": "user", "content": "hi"}])
        inst.emit_reward(0.2, final=False, name="tool_ok")  # through OTel and the bridge
        return 0.3

    group = f"prtest-{uuid.uuid4().hex[:6]}"
    tasks = Topics.with_prefix(topics.spans.name.removesuffix("spans") + "sync-").tasks

    async def go():
        await create_topics(S.kafka_bootstrap, (tasks,))
        t = Topics(topics.spans, topics.rewards, topics.rollouts, tasks, topics.dead_letter)
        [tid] = await publish_tasks([{"payload": "{}", "group_size": 2}], S.kafka_bootstrap, t)
        results = await asyncio.wait_for(Runner(agent, group_id=group, proxy_url=stack["proxy"], topics=t).run(max_tasks=1), 60)
        c = AIOKafkaConsumer(bootstrap_servers=S.kafka_bootstrap, group_id=group, enable_auto_commit=False)
        await c.start()
        try:
            tps = [TopicPartition(tasks.name, p) for p in range(tasks.partitions)]
            committed = {tp: await c.committed(tp) for tp in tps}
            ends = await c.end_offsets(tps)
        finally:
            await c.stop()
        return tid, results, committed, ends

    tid, [results], committed, ends = asyncio.run(go())
    provider.shutdown()
    assert [r.status for r in results] == ["succeeded", "succeeded"]
    assert {tp: committed[tp] or 0 for tp in committed} == ends  # the task's offset is committed
    rids = {r.rollout_id for r in results}
    spans = read_topic(topics.spans, lambda rs: sum(k in rids for k, _ in rs) >= 6, 10)
    mine = [(k, s["source"], s["name"], s["sequence_id"]) for k, s in spans if k in rids]
    for rid in rids:
        assert sorted(x[1:] for x in mine if x[0] == rid) == [
            ("otlp", "spanrl.reward", 1), ("otlp", "tool.lookup", 0), ("proxy", "chat.completions", 0)]
    rewards = read_topic(topics.rewards, lambda rs: sum(k in rids for k, _ in rs) >= 4, 10)
    assert sorted((r["name"], r["value"]) for k, r in rewards if k in rids) == [("reward", 0.3)] * 2 + [("tool_ok", 0.2)] * 2


def test_run_seed_makes_sampling_repeatable(stack):
    """Runner(seed=7) twice on the same task (group of 3, two calls per attempt, temperature
    1, real vLLM through the proxy): every rollout index samples the same token ids in both
    runs, and the indices differ from each other; another run seed samples differently."""
    topics, proxy_url = stack["topics"], stack["proxy"]

    async def agent(ctx):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key="unused")
        out = []
        for q in ("Name an animal.", "Name a city."):
            r = await client.chat.completions.create(model=S.model_name, max_tokens=16, temperature=1.0,
                                                     messages=[{"role": "user", "content": q}],
                                                     extra_body={"return_token_ids": True})
            out.append(tuple(r.choices[0].model_extra["token_ids"]))
        await client.close()
        ctx.emit_reward(0.0)
        return {"calls": out}

    async def one_run(seed: int) -> list[tuple]:
        runner = Runner(agent, concurrency=3, proxy_url=proxy_url, topics=topics, seed=seed)
        groups = await asyncio.wait_for(runner.run_tasks([{"task_id": "seeded-task", "group_size": 3}]), 120)
        for a in groups[0]:
            assert a.status == "succeeded", a.error
        return [tuple(a.result["calls"]) for a in groups[0]]

    first, again, other = asyncio.run(one_run(7)), asyncio.run(one_run(7)), asyncio.run(one_run(8))
    assert first == again  # gather keeps index order: attempt k is rollout index k
    assert len(set(first)) == 3  # each index its own seed
    assert other != first
