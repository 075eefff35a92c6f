"""The proxy's client APIs behind one interface (spanrl.producers.client_apis) and the routes
generated from the table of client APIs × route families (spanrl.producers.proxy)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
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


# ------------------------------------------------------------------ the table
def test_the_routes_are_the_table_of_apis_by_families():
    from spanrl.producers.client_apis import CLIENT_APIS, ClientApi, StreamEvents
    from spanrl.producers.proxy import ROUTE_FAMILIES, client_routes

    assert all(isinstance(api, ClientApi) for api in CLIENT_APIS)
    assert all(isinstance(api.stream({}, {}), StreamEvents) for api in CLIENT_APIS)
    assert [api.name for api in CLIENT_APIS] == ["chat_completions", "completions", "responses", "messages"]
    assert list(ROUTE_FAMILIES) == ["rollout", "eval", "production"]
    routes = client_routes()
    assert {("POST", path) for _, path, _ in routes} == {(m, p) for m, p in SERVED if m == "POST" and "/admin/" not in p}
    assert len(routes) == 12 == len({path for _, path, _ in routes})
    assert [(family, api.name) for family, _, api in routes[:5]] == [
        ("rollout", "chat_completions"), ("rollout", "completions"), ("rollout", "responses"),
        ("rollout", "messages"), ("eval", "chat_completions")]


def test_another_api_is_one_row():
    from spanrl.producers.client_apis import VllmApi
    from spanrl.producers.proxy import client_routes
    from spanrl.producers.streaming import CHAT

    extra = VllmApi("chat_again", "/chat_again", CHAT)
    assert [(family, path) for family, path, _ in client_routes((extra,))] == [
        ("rollout", ROLLOUT + "/chat_again"), ("eval", EVAL + "/chat_again"), ("production", "/v1/chat_again")]


# ------------------------------------------------------------------ the conversions, on small hand-made inputs
USER = [{"role": "user", "content": "Hi?"}]
#: a chat chunk as vLLM streams it with token ids and log-probs asked
CHUNK = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "policy",
         "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"},
                      "logprobs": {"content": [{"token": "Hi", "logprob": -0.5}]}, "finish_reason": None,
                      "token_ids": [5]}],
         "prompt_token_ids": [1, 2]}
USAGE_CHUNK = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "policy",
               "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}}
#: vLLM's chat answer (non-streamed, or assembled from a stream)
ANSWER = {"id": "chatcmpl-1", "object": "chat.completion", "created": 7, "model": "policy",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"},
                       "logprobs": {"content": [{"token": "Hi", "logprob": -0.5}, {"token": "<end>", "logprob": -0.1}]},
                       "finish_reason": "stop", "stop_reason": None, "token_ids": [5, 2]}],
          "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4},
          "prompt_token_ids": [1, 2]}


def events_of(sse: bytes) -> list[tuple[str | None, dict | str]]:
    """(event name, data) of each server-sent event in ``sse`` (hand-split: one data line each)."""
    out = []
    for block in sse.decode().split("\n\n")[:-1]:
        name, data = None, None
        for line in block.split("\n"):
            key, _, value = line.partition(": ")
            if key == "event":
                name = value
            elif key == "data":
                data = value if value == "[DONE]" else json.loads(value)
        out.append((name, data))
    return out


def test_chat_completions_is_vllm_s_own_api_minus_what_was_not_asked():
    from spanrl.producers.client_apis import CHAT_COMPLETIONS_API as api

    body = {"model": "policy", "messages": USER}
    assert api.vllm_request(body) is body  # the proxy adds the seed / eval temperature to the client's body
    assert (api.endpoint, api.upstream_path, api.span_api, api.counter) == (
        "chat.completions", "/v1/chat/completions", None, None)
    assert api.answer(body, body, ANSWER) == {
        **ANSWER, "prompt_token_ids": None,
        "choices": [{**ANSWER["choices"][0], "logprobs": None, "token_ids": None}]}
    asked = {**body, "logprobs": True, "return_token_ids": True}
    assert api.answer(asked, asked, ANSWER) == ANSWER
    stream = api.stream(body, body)
    assert events_of(stream.chunk(CHUNK)) == [(None, {
        **CHUNK, "prompt_token_ids": None, "choices": [{**CHUNK["choices"][0], "logprobs": None, "token_ids": None}]})]
    assert stream.chunk(USAGE_CHUNK) == b""  # usage not asked: the usage-only chunk is not sent
    usage = {**body, "stream_options": {"include_usage": True}}
    assert events_of(api.stream(usage, usage).chunk(USAGE_CHUNK)) == [(None, USAGE_CHUNK)]
    assert stream.finish(ANSWER) == b"data: [DONE]\n\n"
    assert stream.error("kafka_unavailable", "no ack", 503) == (
        b'data: {"error":{"message":"no ack","type":"kafka_unavailable","code":503}}\n\n')


def test_completions_is_vllm_s_own_api_minus_what_was_not_asked():
    from spanrl.producers.client_apis import COMPLETIONS_API as api

    body = {"model": "policy", "prompt": "2+2="}
    answer = {"id": "cmpl-1", "object": "text_completion", "model": "policy",
              "choices": [{"index": 0, "text": "4", "prompt_token_ids": [1, 2], "token_ids": [3],
                           "logprobs": {"tokens": ["4"], "token_logprobs": [-0.2]}, "finish_reason": "length"}]}
    assert api.vllm_request(body) is body
    assert (api.endpoint, api.upstream_path, api.route) == ("completions", "/v1/completions", "/completions")
    assert api.answer(body, body, answer)["choices"] == [
        {**answer["choices"][0], "prompt_token_ids": None, "token_ids": None, "logprobs": None}]
    zero = {**body, "logprobs": 0}  # completions: logprobs 0 asks for them (the chosen token's)
    assert api.answer(zero, zero, answer)["choices"][0]["logprobs"] == answer["choices"][0]["logprobs"]
    chunk = {"id": "cmpl-1", "object": "text_completion", "model": "policy",
             "choices": [{"index": 0, "text": "4", "token_ids": [3], "logprobs": None, "finish_reason": None}]}
    assert events_of(api.stream(body, body).chunk(chunk)) == [
        (None, {**chunk, "choices": [{**chunk["choices"][0], "token_ids": None}]})]
    assert api.stream(body, body).finish(answer) == b"data: [DONE]\n\n"


def test_responses_api_conversions():
    from spanrl.producers.client_apis import RESPONSES_API as api
    from spanrl.core.edge import BadRequest

    body = {"model": "policy", "input": "Hi?", "instructions": "Be brief.", "max_output_tokens": 4}
    chat = api.vllm_request(body)
    assert chat == {"model": "policy", "max_tokens": 4,
                    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]}
    assert (api.endpoint, api.upstream_path, api.span_api, api.counter) == (
        "chat.completions", "/v1/chat/completions", "responses", "responses_requests")
    with pytest.raises(BadRequest) as refused:
        api.vllm_request({**body, "previous_response_id": "resp_0"})
    assert (refused.value.status, refused.value.reason, refused.value.param) == (
        400, "stateful_not_supported", "previous_response_id")
    out = api.answer(body, chat, ANSWER)
    assert (out["id"], out["object"], out["status"], out["instructions"], out["max_output_tokens"]) == (
        "resp_1", "response", "completed", "Be brief.", 4)
    assert out["output"] == [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                              "content": [{"type": "output_text", "text": "Hi", "annotations": []}]}]
    assert (out["usage"]["input_tokens"], out["usage"]["output_tokens"]) == (2, 2)
    stream = api.stream(body, chat)
    first = events_of(stream.chunk(CHUNK))
    assert [name for name, _ in first] == ["response.created", "response.in_progress", "response.output_item.added",
                                           "response.content_part.added", "response.output_text.delta"]
    assert all(name == data["type"] for name, data in first)
    assert first[-1][1]["delta"] == "Hi" and first[0][1]["sequence_number"] == 0
    last = events_of(stream.finish(ANSWER))
    assert [name for name, _ in last] == ["response.output_text.done", "response.content_part.done",
                                          "response.output_item.done", "response.completed"]
    assert last[-1][1]["response"]["output"] == out["output"]
    assert events_of(stream.error("kafka_unavailable", "no ack", 503)) == [("error", {
        "type": "error", "sequence_number": 9, "code": "kafka_unavailable", "message": "no ack", "param": None})]
    assert events_of(api.stream(body, chat).chunk(CHUNK))[0][1]["sequence_number"] == 0  # one state per call


def test_messages_api_conversions():
    from spanrl.producers.client_apis import MESSAGES_API as api
    from spanrl.core.edge import BadRequest

    body = {"model": "policy", "max_tokens": 4, "system": "Be brief.", "messages": USER, "stop_sequences": ["."]}
    chat = api.vllm_request(body)
    assert chat == {"model": "policy", "max_tokens": 4, "stop": ["."],
                    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]}
    assert (api.endpoint, api.upstream_path, api.span_api, api.counter, api.route) == (
        "chat.completions", "/v1/chat/completions", "anthropic.messages", "messages_requests", "/messages")
    with pytest.raises(BadRequest) as refused:  # messages.MessagesError, as every API refuses
        api.vllm_request({**body, "thinking": {"type": "enabled"}})
    assert (refused.value.status, refused.value.reason, refused.value.param) == (400, "thinking_not_supported", None)
    assert api.answer(body, chat, ANSWER) == {
        "id": "chatcmpl-1", "type": "message", "role": "assistant", "model": "policy",
        "content": [{"type": "text", "text": "Hi"}], "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": 2, "output_tokens": 2}}
    stream = api.stream(body, chat)
    assert events_of(stream.chunk(CHUNK)) == [
        ("message_start", {"type": "message_start", "message": {
            "id": "chatcmpl-1", "type": "message", "role": "assistant", "model": "policy", "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 2, "output_tokens": 0}}}),
        ("ping", {"type": "ping"}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "Hi"}})]
    assert events_of(stream.finish(ANSWER)) == [
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                           "usage": {"input_tokens": 2, "output_tokens": 2}}),
        ("message_stop", {"type": "message_stop"})]
    assert stream.error("kafka_unavailable", "no ack", 503) == (
        b'event: error\ndata: {"type":"error","error":{"type":"kafka_unavailable","message":"no ack"}}\n\n')


# ------------------------------------------------------------------ every generated route, through the app
class AckingSink:
    """Stands in for the proxy's Kafka sink: acknowledges every record, keeping ``(topic, key, value)``."""

    def __init__(self):
        self.topics, self.started, self.sent = Topics(), True, []

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def produce_raw(self, items) -> None:
        self.sent += [(t.name, k, v) for t, k, v in items]


#: a small valid request of each client API
REQUESTS = {"chat_completions": {"model": "policy", "messages": USER, "max_tokens": 4},
            "completions": {"model": "policy", "prompt": "2+2=", "max_tokens": 4},
            "responses": {"model": "policy", "input": "Hi?", "max_output_tokens": 4},
            "messages": {"model": "policy", "messages": USER, "max_tokens": 4}}


def test_each_generated_route_serves_its_api_on_its_family():
    """Each route of the table: the API's vLLM call (path, translated body), the span's
    ``spanrl.api`` and topic of its family (eval: ``spans.eval``; production: the rollout
    header), the answer in the API's shape."""
    import httpx
    from fastapi.testclient import TestClient

    from spanrl.producers.proxy import client_routes
    from spanrl.schemas import codec

    fixtures = Path(__file__).parent.parent / "fixtures"
    sent: list[tuple[str, dict]] = []

    def vllm(request: httpx.Request) -> httpx.Response:
        sent.append((request.url.path, json.loads(request.content)))
        name = "vllm_chat_completion.json" if request.url.path == "/v1/chat/completions" else "vllm_completion.json"
        return httpx.Response(200, json=json.loads((fixtures / name).read_text()))

    sink = AckingSink()
    app = create_app(sink, "http://vllm", "policy", claim_client=object(), payload_bucket="b")
    shapes = {"chat_completions": "chat.completion", "completions": "text_completion", "responses": "response",
              "messages": "message"}
    with TestClient(app) as client:
        app.state.client = httpx.AsyncClient(base_url="http://vllm", transport=httpx.MockTransport(vllm))
        for family, path, api in client_routes():
            sent.clear()
            sink.sent.clear()
            url = path.replace("{sampling}", "0").replace("{rollout_id}", "r1").replace("{attempt_id}", "0")
            r = client.post(url, json=REQUESTS[api.name], headers={"x-spanrl-rollout-id": "p1"})
            assert r.status_code == 200, (url, r.text)
            answer = r.json()
            assert answer.get("object", answer.get("type")) == shapes[api.name]
            [(upstream_path, upstream)] = sent
            assert upstream_path == api.upstream_path
            assert upstream["return_token_ids"] is True and ("messages" in upstream) == (api.name != "completions")
            assert (upstream.get("temperature") == 0.0) == (family == "eval")
            [(topic, key, value)] = sink.sent
            span = codec.decode("span", value)
            assert (topic, key) == ({"eval": "spans.eval"}.get(family, "spans"), "p1" if family == "production" else "r1")
            assert span["attributes"].get("spanrl.api") == api.span_api
            assert span["name"] == api.endpoint
            assert (r.headers.get("x-spanrl-rollout-id") == "p1") == (family == "production")
        status = client.get("/status").json()
    assert (status["requests"], status["eval_requests"], status["production_requests"]) == (12, 4, 4)
    assert (status["responses_requests"], status["messages_requests"], status["spans"]) == (3, 3, 12)
