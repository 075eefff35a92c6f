"""Responses API <-> chat completions translation (spanrl.producers.responses), exact values.

The request bodies are what the clients sent (captured from openai-agents 0.24 and
langchain-openai 1.7.4 with openai 3.57); the chat answers are vLLM 0.32's
(tests/fixtures: ``vllm_chat_completion.json``, and ``vllm_chat_tool_call.json``: a named
``tool_choice`` with the stack's hermes tool-call parser and SmolLM2 tools template)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai.types.responses import Response

from spanrl.core.edge import BadRequest
from spanrl.producers import responses as R

FIXTURES = Path(__file__).parent.parent / "fixtures"
WEATHER_PARAMS = {"properties": {"city": {"title": "City", "type": "string"}}, "required": ["city"],
                  "title": "get_weather_args", "type": "object", "additionalProperties": False}
AGENTS_TOOL = {"name": "get_weather", "parameters": WEATHER_PARAMS, "strict": True, "type": "function",
               "description": "Weather of a city."}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                              "parameters": WEATHER_PARAMS, "strict": True}}
# the Agents SDK's first and second turn (ModelSettings(temperature=0, max_tokens=16,
# tool_choice="get_weather", parallel_tool_calls=False, top_p=0.9))
AGENTS_TURN1 = {"model": "policy", "include": [], "input": [{"content": "weather in Paris?", "role": "user"}],
                "instructions": "Be brief.", "max_output_tokens": 16, "parallel_tool_calls": False,
                "temperature": 0.0, "tool_choice": {"type": "function", "name": "get_weather"},
                "tools": [AGENTS_TOOL], "top_p": 0.9}
AGENTS_TURN2 = {"model": "policy", "include": [], "input": [
    {"content": "weather in Paris?", "role": "user"},
    {"arguments": "{\"city\": \"Paris\"}", "call_id": "call_1", "name": "get_weather", "type": "function_call",
     "id": "fc_1", "status": "completed"},
    {"call_id": "call_1", "output": "sunny", "type": "function_call_output"}],
    "instructions": "Be brief.", "max_output_tokens": 16, "parallel_tool_calls": False, "temperature": 0.0,
    "tools": [AGENTS_TOOL], "top_p": 0.9}
LANGCHAIN = {"model": "policy", "stream": False, "input": [{"content": "hello", "role": "user", "type": "message"}],
             "max_output_tokens": 8}


def load(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def test_agents_sdk_first_turn():
    assert R.chat_request(AGENTS_TURN1) == {
        "model": "policy",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather in Paris?"}],
        "tools": [CHAT_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 16, "temperature": 0.0, "top_p": 0.9, "parallel_tool_calls": False}


def test_agents_sdk_second_turn_with_the_call_and_its_output():
    assert R.chat_request(AGENTS_TURN2)["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def test_langchain_invoke():
    assert R.chat_request(LANGCHAIN) == {"model": "policy", "messages": [{"role": "user", "content": "hello"}],
                                         "max_tokens": 8, "stream": False}


def test_string_input_parts_and_a_turn_with_text_and_two_calls():
    body = {"model": "m", "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Looking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "one"}]},
        {"type": "function_call_output", "call_id": "c2", "output": "two"}]}
    assert R.chat_request(body)["messages"] == [
        {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Looking."}], "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "one"}]},
        {"role": "tool", "tool_call_id": "c2", "content": "two"}]
    assert R.chat_request({"model": "m", "input": "hi", "instructions": "sys"})["messages"] == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]


def test_text_format_becomes_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "A", "schema": schema,
                                                            "strict": True}}}
    assert R.chat_request(body)["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "A", "schema": schema, "strict": True}}
    assert R.chat_request({**body, "text": {"format": {"type": "json_object"}}})["response_format"] == {
        "type": "json_object"}
    assert "response_format" not in R.chat_request({**body, "text": {"format": {"type": "text"}}})


def test_sampling_extras_logprobs_and_accepted_fields_pass():
    body = {"model": "m", "input": "x", "seed": 7, "stop": ["\n"], "top_k": 5, "top_logprobs": 2,
            "include": ["message.output_text.logprobs", "reasoning.encrypted_content"], "store": True,
            "metadata": {"k": "v"}, "user": "u", "background": False, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "truncation": "disabled", "service_tier": "auto",
            "moderation": None}  # an unknown field left null is no request
    assert R.chat_request(body) == {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2,
                                    "seed": 7, "stop": ["\n"], "top_k": 5}
    assert R.wants_logprobs(body) and not R.wants_logprobs(LANGCHAIN)


@pytest.mark.parametrize("change, reason, param", [
    ({"previous_response_id": "resp_1"}, "stateful_not_supported", "previous_response_id"),
    ({"conversation": "conv_1"}, "stateful_not_supported", "conversation"),
    ({"background": True}, "stateful_not_supported", "background"),
    ({"prompt": {"id": "pmpt_1"}}, "stateful_not_supported", "prompt"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "stateful_not_supported", "input[0]"),
    ({"reasoning": {"effort": "low"}}, "reasoning_not_supported", "reasoning"),
    ({"truncation": "auto"}, "unsupported_parameter", "truncation"),
    ({"text": {"verbosity": "low"}}, "unsupported_parameter", "text.verbosity"),
    ({"n": 2}, "unsupported_parameter", "n"),
    ({"tools": [{"type": "web_search"}]}, "unsupported_tool", "tools[0]"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "unsupported_tool_choice", "tool_choice"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "unsupported_input_item", "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}]},
     "unsupported_content", "input[0]"),
    ({"input": [{"role": "tool", "content": "x"}]}, "invalid_request", "input[0]"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "invalid_request", "input[0]"),
    ({"input": 3}, "invalid_request", "input"),
    ({"include": "message.output_text.logprobs"}, "invalid_request", "include"),
    ({"text": {"format": {"type": "json_schema", "name": "A"}}}, "invalid_request", "text.format"),
])
def test_refused_with_the_field_named(change, reason, param):
    with pytest.raises(BadRequest) as err:
        R.chat_request({"model": "m", "input": "x", **change})
    assert (err.value.status, err.value.reason, err.value.param) == (400, reason, param)
    assert err.value.detail.startswith(param + ":")


def test_response_of_a_real_chat_answer_cut_at_max_tokens():
    chat = load("vllm_chat_completion.json")
    body = {"model": "policy", "input": "Say hi.", "max_output_tokens": 8, "temperature": 0.7, "metadata": {"k": "v"}}
    out = R.response_object(body, R.chat_request(body), chat)
    assert out == {
        "id": "resp_94077dc6fef8c2af", "object": "response", "created_at": 1796078279, "status": "incomplete",
        "error": None, "incomplete_details": {"reason": "max_output_tokens"}, "instructions": None,
        "metadata": {"k": "v"}, "model": "policy",
        "output": [{"type": "message", "id": "msg_94077dc6fef8c2af", "role": "assistant", "status": "incomplete",
                    "content": [{"type": "output_text", "text": "I'm so glad you're here.", "annotations": []}]}],
        "parallel_tool_calls": True, "temperature": 0.7, "top_p": None, "max_output_tokens": 8,
        "top_logprobs": None, "tool_choice": "auto", "tools": [], "text": {"format": {"type": "text"}},
        "previous_response_id": None, "reasoning": None, "truncation": "disabled", "background": False,
        "user": None, "usage": {"input_tokens": 33, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                                "output_tokens": 8, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 41}}
    parsed = Response.model_validate(out)  # the openai package's own type accepts it
    assert parsed.output_text == "I'm so glad you're here." and parsed.usage.output_tokens == 8


def test_response_logprobs_when_included():
    chat = load("vllm_chat_completion.json")
    body = {"model": "policy", "input": "Say hi.", "include": [R.LOGPROBS_INCLUDE]}
    [part] = R.response_object(body, R.chat_request(body), chat)["output"][0]["content"]
    assert part["logprobs"][:2] == [
        {"token": "I", "bytes": [73], "logprob": -2.1747641563415527, "top_logprobs": []},
        {"token": "'m", "bytes": [39, 109], "logprob": -0.13739120960235596, "top_logprobs": []}]
    assert [t["logprob"] for t in part["logprobs"]] == [t["logprob"] for t in chat["choices"][0]["logprobs"]["content"]]


def test_response_of_a_real_tool_call():
    chat = load("vllm_chat_tool_call.json")
    out = R.response_object(AGENTS_TURN1, R.chat_request(AGENTS_TURN1), chat)
    assert (out["status"], out["incomplete_details"], out["parallel_tool_calls"], out["tool_choice"]) == (
        "completed", None, False, {"type": "function", "name": "get_weather"})
    assert out["output"] == [{"type": "function_call", "id": "fc_a362b1845cece419_0",
                              "call_id": "chatcmpl-tool-8a04c109ff04177f", "name": "get_weather",
                              "arguments": "{\"city\": \"Paris\"}", "status": "completed"}]
    assert out["usage"]["input_tokens"] == 196 and out["usage"]["output_tokens"] == 32
    assert Response.model_validate(out).output[0].call_id == "chatcmpl-tool-8a04c109ff04177f"


def test_output_items_text_and_calls():
    choice = {"finish_reason": "tool_calls", "logprobs": {"content": [{"token": "a", "logprob": -1.0, "bytes": [97]}]},
              "message": {"content": "Let me look.", "tool_calls": [
                  {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}
    assert R.output_items(choice, "x", logprobs=True) == [
        {"type": "message", "id": "msg_x", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},  # no logprobs with calls
        {"type": "function_call", "id": "fc_x_0", "call_id": "t1", "name": "f", "arguments": "{}",
         "status": "completed"}]
    empty = {"finish_reason": "stop", "message": {"content": None}}
    assert R.output_items(empty, "y", logprobs=False) == [
        {"type": "message", "id": "msg_y", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "", "annotations": []}]}]


@pytest.mark.parametrize("finish, expected", [
    ("stop", ("completed", None)), ("tool_calls", ("completed", None)), (None, ("completed", None)),
    ("length", ("incomplete", {"reason": "max_output_tokens"})),
    ("content_filter", ("incomplete", {"reason": "content_filter"})),
])
def test_status_of_finish_reason(finish, expected):
    assert R.status_of(finish) == expected


def test_usage_and_ids():
    assert R.usage({"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                    "prompt_tokens_details": {"cached_tokens": 4}}) == {
        "input_tokens": 10, "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0}, "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 13}
    assert R.usage(None) is None
    assert R.response_id("chatcmpl-abc") == "resp_abc"



def test_proxy_responses_routes_refuse_before_vllm():
    """``/v1/responses`` (and its eval route): refused while translating, before vLLM or Kafka
    (both unreachable here), the OpenAI error naming the field as ``param``."""
    from fastapi.testclient import TestClient

    from spanrl.producers.kafka import Sink, Topics
    from spanrl.producers.proxy import create_app

    app = create_app(Sink("127.0.0.1:1", Topics(), send_timeout_s=1.0), "http://127.0.0.1:1", "policy")
    cases = [({"previous_response_id": "resp_1"}, 400, "stateful_not_supported", "previous_response_id"),
             ({"tools": [{"type": "file_search"}]}, 400, "unsupported_tool", "tools[0]"),
             ({"stream": "yes"}, 400, "invalid_request", None),
             ({"model": "gpt-5"}, 404, "model_not_found", None)]
    with TestClient(app) as client:
        for url in ("/rollouts/r/attempts/0/v1/responses", "/eval/0/rollouts/r/attempts/0/v1/responses"):
            for change, status, reason, param in cases:
                r = client.post(url, json={"model": "policy", "input": "hi", **change})
                assert (r.status_code, r.json()["error"]["type"], r.json()["error"].get("param")) == (
                    status, reason, param)
        m = client.get("/status").json()
    assert (m["responses_requests"], m["eval_requests"], m["stateful_not_supported"], m["http_404"]) == (8, 4, 2, 2)
