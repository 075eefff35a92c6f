"""vLLM response -> LlmCall extraction, response stripping, sequence counters (spanrl.producers.proxy)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from spanrl.producers.proxy import (
    CHAT, COMPLETIONS, BadRequest, MissingTokenIds, SequenceCounter, llm_call_from_response, parse_body,
    parse_traceparent, span_attributes,
    strip_response, tool_attributes, upstream_body,
)
from spanrl.schemas import codec

FIXTURES = Path(__file__).parent.parent / "fixtures"
# the requests that produced the captured fixtures (vLLM 0.32, SmolLM2-135M-Instruct as "policy")
CHAT_REQ = {"model": "policy", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8,
            "temperature": 0.7}
COMPL_REQ = {"model": "policy", "prompt": "2+2=", "max_tokens": 5, "temperature": 0.0}
# vLLM started with --enable-auto-tool-choice --tool-call-parser hermes and spanrl's chat template
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
TOOL_REQ = {"model": "policy", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "max_tokens": 48, "temperature": 0.0, "tools": [WEATHER], "tool_choice": "required"}


def load(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def test_chat_llm_call_from_real_vllm_response():
    resp = load("vllm_chat_completion.json")
    llm = llm_call_from_response(CHAT, CHAT_REQ, resp, policy_version=3)
    assert llm["prompt_token_ids"] == resp["prompt_token_ids"] and len(llm["prompt_token_ids"]) == 33
    assert llm["completion_token_ids"] == [57, 5248, 588, 18948, 346, 2316, 1535, 30]
    assert llm["completion_logprobs"] == [t["logprob"] for t in resp["choices"][0]["logprobs"]["content"]]
    assert llm["completion_logprobs"][0] == pytest.approx(-2.1747641563415527)
    assert (llm["model"], llm["policy_version"], llm["temperature"], llm["top_p"], llm["max_tokens"],
            llm["finish_reason"], llm["request_id"]) == ("policy", 3, 0.7, 1.0, 8, "length", "chatcmpl-94077dc6fef8c2af")
    span = {"rollout_id": "r", "attempt_id": "0", "sequence_id": 0, "trace_id": "0" * 32, "span_id": "1" * 16,
            "name": CHAT, "kind": "llm", "source": "proxy", "start_time_unix_nano": 1, "end_time_unix_nano": 2,
            "llm": llm}
    back = codec.decode("span", codec.encode("span", span))["llm"]
    assert back["completion_token_ids"] == llm["completion_token_ids"]
    assert back["completion_logprobs"] == pytest.approx(llm["completion_logprobs"], rel=1e-6)  # float32 on the wire


def test_completion_llm_call_from_real_vllm_response():
    resp = load("vllm_completion.json")
    llm = llm_call_from_response(COMPLETIONS, COMPL_REQ, resp, policy_version=0)
    assert llm["prompt_token_ids"] == [34, 27, 34, 45]
    assert llm["completion_token_ids"] == [33, 33, 28, 588, 260]
    assert llm["completion_logprobs"] == resp["choices"][0]["logprobs"]["token_logprobs"]
    assert (llm["temperature"], llm["finish_reason"]) == (0.0, "length")


def test_tool_call_llm_call_from_real_vllm_response():
    resp = load("vllm_chat_tool_call.json")
    llm = llm_call_from_response(CHAT, TOOL_REQ, resp, policy_version=1)
    # the completion is the text the hermes parser read the call from:
    # '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    assert llm["completion_token_ids"] == [44, 19324, 79, 4350, 46, 198, 39428, 1245, 1799, 476, 87, 305, 79, 29624,
                                           1002, 476, 24370, 1799, 9583, 20721, 1799, 476, 38634, 23597, 109, 198,
                                           9617, 19324, 79, 4350, 46, 2]
    assert len(llm["prompt_token_ids"]) == 196 and llm["prompt_token_ids"] == resp["prompt_token_ids"]
    assert len(llm["completion_logprobs"]) == 32 and llm["completion_logprobs"][0] == 0.0  # forced by the grammar
    assert (llm["finish_reason"], llm["max_tokens"], llm["temperature"]) == ("tool_calls", 48, 0.0)
    assert resp["choices"][0]["message"]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                          "arguments": '{"city": "Paris"}'}


def test_tool_attributes():
    resp = load("vllm_chat_tool_call.json")
    assert tool_attributes(TOOL_REQ, resp) == {"spanrl.tools": '["get_weather"]', "spanrl.tool_choice": '"required"',
                                               "spanrl.tool_calls": '["get_weather"]'}
    named = {**TOOL_REQ, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    assert tool_attributes(named, resp)["spanrl.tool_choice"] == '{"type": "function", "function": {"name": "get_weather"}}'
    assert tool_attributes(CHAT_REQ, load("vllm_chat_completion.json")) == {}
    # malformed entries are skipped, never raise
    odd = {"tools": [WEATHER, "x", {"function": None}, {"function": {"name": 3}}]}
    reply = {"choices": [{"message": {"tool_calls": [None, {"function": {"name": "a"}}]}}]}
    assert tool_attributes(odd, reply) == {"spanrl.tools": '["get_weather"]', "spanrl.tool_calls": '["a"]'}
    assert tool_attributes({"tools": "x", "tool_choice": None}, {"choices": []}) == {}
    attrs = span_attributes(CHAT, TOOL_REQ, resp, None)
    assert attrs["gen_ai.response.finish_reasons"] == '["tool_calls"]' and attrs["spanrl.tool_calls"] == '["get_weather"]'


@pytest.mark.parametrize("mutate", [
    lambda r: r.pop("prompt_token_ids"),
    lambda r: r["choices"][0].pop("token_ids"),
    lambda r: r["choices"][0].update(logprobs=None),
    lambda r: r["choices"][0]["logprobs"]["content"].pop(),
    lambda r: r.update(choices=[]),
])
def test_missing_token_ids_or_logprobs(mutate):
    resp = load("vllm_chat_completion.json")
    mutate(resp)
    with pytest.raises(MissingTokenIds):
        llm_call_from_response(CHAT, CHAT_REQ, resp, 0)


def test_upstream_body_asks_for_ids_and_logprobs():
    assert upstream_body(CHAT, CHAT_REQ) == {**CHAT_REQ, "logprobs": True, "return_token_ids": True}
    assert upstream_body(COMPLETIONS, COMPL_REQ)["logprobs"] == 1
    assert upstream_body(COMPLETIONS, {**COMPL_REQ, "logprobs": 5})["logprobs"] == 5


def test_strip_response_removes_what_client_did_not_ask():
    resp = load("vllm_chat_completion.json")
    out = strip_response(CHAT, CHAT_REQ, resp)
    assert out["prompt_token_ids"] is None and out["choices"][0]["token_ids"] is None
    assert out["choices"][0]["logprobs"] is None
    assert out["choices"][0]["message"] == resp["choices"][0]["message"] and out["usage"] == resp["usage"]
    assert resp["prompt_token_ids"] is not None  # the input is not mutated
    assert strip_response(CHAT, {**CHAT_REQ, "logprobs": True, "return_token_ids": True}, resp) == resp
    kept = strip_response(CHAT, {**CHAT_REQ, "logprobs": True}, resp)
    assert kept["choices"][0]["logprobs"] == resp["choices"][0]["logprobs"] and kept["prompt_token_ids"] is None
    c = strip_response(COMPLETIONS, COMPL_REQ, load("vllm_completion.json"))["choices"][0]
    assert (c["prompt_token_ids"], c["token_ids"], c["logprobs"]) == (None, None, None)


def test_sequence_counter_per_attempt():
    s = SequenceCounter()
    assert [s.next("a", "0") for _ in range(3)] == [0, 1, 2]
    assert s.next("a", "1") == 0 and s.next("b", "0") == 0 and s.next("a", "0") == 3


def test_traceparent():
    tid, sid = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    assert parse_traceparent(f"00-{tid}-{sid}-01") == (tid, sid)
    for bad in [None, "", "junk", f"00-{'0' * 32}-{sid}-01", f"00-{tid}-zzzzzzzzzzzzzzzz-01"]:
        assert parse_traceparent(bad) is None


JSON = "application/json"


@pytest.mark.parametrize("ctype,raw,status,reason", [
    (None, b'{"model": "policy"}', 415, "unsupported_media_type"),
    ("text/plain", b'{"model": "policy"}', 415, "unsupported_media_type"),  # a cross-site form could send it
    ("application/x-www-form-urlencoded", b"model=policy", 415, "unsupported_media_type"),
    (JSON, b"", 400, "invalid_json"),
    (JSON, b'{"model": "p\xff\xfe"}', 400, "invalid_json"),            # not UTF-8
    (JSON, b"\xef\xbb\xbf{}", 400, "invalid_json"),                   # BOM (RFC 8259 s8.1: MUST NOT)
    (JSON, b'{"model": "policy"', 400, "invalid_json"),
    (JSON, b'{"temperature": NaN}', 400, "invalid_json"),
    (JSON, b'{"temperature": -Infinity}', 400, "invalid_json"),
    (JSON, b'{"temperature": 1e999}', 400, "invalid_json"),           # overflows to inf
    (JSON, b'{"messages": [{"content": "\\ud800"}]}', 400, "invalid_json"),  # lone surrogate
    (JSON, b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json"),    # nesting past the recursion limit
    (JSON, b'[{"model": "policy"}]', 400, "invalid_request"),
])
def test_parse_body_refuses(ctype, raw, status, reason):
    with pytest.raises(BadRequest) as err:
        parse_body(ctype, raw)
    assert (err.value.status, err.value.reason) == (status, reason)


def test_parse_body_accepts_json_objects():
    body = {"model": "policy", "messages": [{"role": "user", "content": "é \ud83d\ude00"}], "temperature": 0.5}
    raw = json.dumps(body).encode()  # \ud83d\ude00 escapes: a valid surrogate pair
    assert parse_body(JSON, raw) == {**body, "messages": [{"role": "user", "content": "é 😀"}]}
    assert parse_body("Application/JSON; charset=utf-8", b'{"n": 1}') == {"n": 1}
    assert parse_body("application/vnd.api+json", b"{}") == {}


def test_proxy_bad_input_is_counted():
    """Bad bodies are answered before vLLM or Kafka (both unreachable here) and counted."""
    from fastapi.testclient import TestClient

    from spanrl.producers.kafka import Sink, Topics
    from spanrl.producers.proxy import create_app

    app = create_app(Sink("127.0.0.1:1", Topics(), send_timeout_s=1.0), "http://127.0.0.1:1", "policy")
    url = "/rollouts/r/attempts/0/v1/chat/completions"
    with TestClient(app) as client:
        for ctype, raw in [("text/plain", b'{"model": "policy", "messages": []}'), (JSON, b""),
                           (JSON, b'{"model": "\xff"}'), (JSON, b'{"temperature": Infinity}')]:
            r = client.post(url, content=raw, headers={"content-type": ctype})
            assert r.status_code in (400, 415) and r.json()["error"]["code"] == r.status_code
        assert client.post("/admin/policy_version", json={"version": "x"}).status_code == 422
        m = client.get("/status").json()
    assert {k: m.get(k) for k in ("requests", "http_400", "http_415", "http_422", "invalid_json",
                                  "unsupported_media_type", "invalid_request", "spans")} == {
        "requests": 4, "http_400": 3, "http_415": 1, "http_422": 1, "invalid_json": 3,
        "unsupported_media_type": 1, "invalid_request": 1, "spans": None}


def test_proxy_messages_route_refuses_before_vllm():
    """``/v1/messages`` refusals: parsed and translated before vLLM or Kafka (unreachable here)."""
    from fastapi.testclient import TestClient

    from spanrl.producers.kafka import Sink, Topics
    from spanrl.producers.proxy import create_app

    app = create_app(Sink("127.0.0.1:1", Topics(), send_timeout_s=1.0), "http://127.0.0.1:1", "policy")
    user = [{"role": "user", "content": "x"}]
    with TestClient(app) as client:
        for url in ("/rollouts/r/attempts/0/v1/messages", "/eval/0/rollouts/r/attempts/0/v1/messages"):
            for body, status, reason in [
                ({"model": "policy", "messages": user}, 400, "invalid_request"),
                ({"model": "policy", "max_tokens": 4, "messages": user, "stream": "yes"}, 400, "invalid_request"),
                ({"model": "other", "max_tokens": 4, "messages": user}, 404, "model_not_found"),
            ]:
                r = client.post(url, json=body)
                assert (r.status_code, r.json()["error"]["type"]) == (status, reason)
        m = client.get("/status").json()
    assert (m["messages_requests"], m["eval_requests"], m["http_400"], m["http_404"]) == (6, 3, 4, 2)


def test_production_routes_take_the_rollout_from_headers():
    """The plain ``/v1`` routes (agents no runner launched): a bad rollout header is 400
    ``invalid_rollout_header`` naming it, before vLLM or Kafka (unreachable here); an answer
    carries the rollout id, minted when the app sent none."""
    from fastapi.testclient import TestClient

    from spanrl.producers.kafka import Sink, Topics
    from spanrl.producers.proxy import create_app

    app = create_app(Sink("127.0.0.1:1", Topics(), send_timeout_s=1.0), "http://127.0.0.1:1", "policy")
    body = {"model": "other", "messages": [{"role": "user", "content": "x"}]}
    with TestClient(app) as client:
        bad = client.post("/v1/chat/completions", json=body, headers={"x-spanrl-group-size": "0"})
        named = client.post("/v1/chat/completions", json=body, headers={"x-spanrl-rollout-id": "chat-9"})
        minted = client.post("/v1/completions", json={"model": "other", "prompt": "x"})
        m = client.get("/status").json()
    assert (bad.status_code, bad.json()["error"]["type"], bad.json()["error"]["param"]) == (
        400, "invalid_rollout_header", "x-spanrl-group-size")
    assert (named.status_code, named.headers["x-spanrl-rollout-id"]) == (404, "chat-9")  # model_not_found
    assert minted.status_code == 404 and minted.headers["x-spanrl-rollout-id"].startswith("prod-")
    assert (m["production_requests"], m["invalid_rollout_header"], m["model_not_found"]) == (2, 1, 2)
