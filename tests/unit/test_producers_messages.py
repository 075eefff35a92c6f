"""Anthropic Messages <-> chat completions translation (spanrl.producers.messages)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from spanrl.producers.messages import MessagesError, chat_request, message_response

FIXTURES = Path(__file__).parent.parent / "fixtures"
WEATHER = {"name": "get_weather", "description": "Current weather",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_text_conversation():
    body = {"model": "policy", "max_tokens": 16, "system": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}],
            "messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."},
                         {"role": "user", "content": [{"type": "text", "text": "Again."}]}],
            "stop_sequences": ["\n\n"], "temperature": 0.5, "top_k": 5, "metadata": {"user_id": "u"}}
    assert chat_request(body) == {
        "model": "policy", "max_tokens": 16, "temperature": 0.5, "top_k": 5, "stop": ["\n\n"],
        "messages": [{"role": "system", "content": "Be\nbrief."}, {"role": "user", "content": "Say hi."},
                     {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again."}]}


def test_tools_tool_use_and_tool_results():
    body = {"model": "policy", "max_tokens": 48, "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            "messages": [
                {"role": "user", "content": "Weather in Paris and Oslo?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Looking.", "citations": None},
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "t2", "name": "get_weather", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "Sunny."},
                    {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                     "content": [{"type": "text", "text": "no station"}]},
                    {"type": "text", "text": "And?"}]}]}
    out = chat_request(body)
    assert out["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                                              "parameters": WEATHER["input_schema"]}}]
    assert (out["tool_choice"], out["parallel_tool_calls"]) == ({"type": "function", "function": {"name": "get_weather"}}, False)
    assert out["messages"][1:] == [
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "t2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Sunny."},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: no station"},
        {"role": "user", "content": "And?"}]


@pytest.mark.parametrize("choice, chat", [({"type": "auto"}, "auto"), ({"type": "any"}, "required"),
                                          ({"type": "none"}, "none")])
def test_tool_choice(choice, chat):
    out = chat_request({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                        "tools": [WEATHER], "tool_choice": choice})
    assert out["tool_choice"] == chat and "parallel_tool_calls" not in out


def test_stream_is_passed_on():
    """``stream`` goes to the chat request as it is (the proxy's ``check_stream`` refuses a
    non-boolean with 400 ``invalid_request``); absent, none is sent."""
    ask = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    assert chat_request({**ask, "stream": True})["stream"] is True
    assert chat_request({**ask, "stream": "yes"})["stream"] == "yes"
    assert "stream" not in chat_request(ask)


def test_output_config_format_is_a_json_schema_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    out = chat_request({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],
                        "output_config": {"format": {"type": "json_schema", "schema": schema}, "effort": "low"}})
    assert out["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


USER = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("body, reason", [
    ({"messages": USER}, "invalid_request"),                                           # no max_tokens
    ({"max_tokens": 0, "messages": USER}, "invalid_request"),
    ({"max_tokens": True, "messages": USER}, "invalid_request"),
    ({"max_tokens": 4, "messages": []}, "invalid_request"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "invalid_request"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": 3}]}, "invalid_request"),
    ({"max_tokens": 4, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking_not_supported"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/a.png"}}]}]}, "unsupported_content"),
    ({"max_tokens": 4, "messages": [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hm", "signature": "s"}]}]}, "unsupported_content"),
    ({"max_tokens": 4, "system": [{"type": "image"}], "messages": USER}, "unsupported_content"),
    ({"max_tokens": 4, "messages": USER, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "unsupported_tool"),
    ({"max_tokens": 4, "messages": USER, "tool_choice": {"type": "tool"}}, "invalid_request"),
    ({"max_tokens": 4, "messages": USER, "tool_choice": {"type": "sometimes"}}, "invalid_request"),
    ({"max_tokens": 4, "messages": USER, "output_config": {"format": {"type": "regex"}}}, "invalid_request"),
])
def test_refused(body, reason):
    with pytest.raises(MessagesError) as exc:
        chat_request({"model": "m", **body})
    assert (exc.value.status, exc.value.reason) == (400, reason)


def test_message_response_of_a_real_vllm_tool_call():
    chat = json.loads((FIXTURES / "vllm_chat_tool_call.json").read_text())
    call = chat["choices"][0]["message"]["tool_calls"][0]
    assert message_response(chat) == {
        "id": "chatcmpl-a362b1845cece419", "type": "message", "role": "assistant", "model": "policy",
        "content": [{"type": "tool_use", "id": call["id"], "name": "get_weather", "input": {"city": "Paris"}}],
        "stop_reason": "tool_use", "stop_sequence": None, "usage": {"input_tokens": 196, "output_tokens": 32}}


def test_message_response_of_a_real_vllm_text_answer():
    chat = json.loads((FIXTURES / "vllm_chat_completion.json").read_text())
    out = message_response(chat)
    assert out["content"] == [{"type": "text", "text": "I'm so glad you're here."}]
    assert (out["stop_reason"], out["usage"]) == ("max_tokens", {"input_tokens": 33, "output_tokens": 8})


@pytest.mark.parametrize("choice, reason", [
    ({"finish_reason": "stop", "stop_reason": None}, ("end_turn", None)),
    ({"finish_reason": "stop", "stop_reason": 2}, ("end_turn", None)),          # an eos token id
    ({"finish_reason": "stop", "stop_reason": "\n\n"}, ("stop_sequence", "\n\n")),
    ({"finish_reason": "length"}, ("max_tokens", None)),
])
def test_stop_reasons(choice, reason):
    out = message_response({"choices": [{"message": {"content": "a"}, **choice}]})
    assert (out["stop_reason"], out["stop_sequence"]) == reason


def test_empty_answer_and_unparsable_arguments():
    assert message_response({"choices": [{"message": {"content": ""}, "finish_reason": "stop"}]})["content"] == \
        [{"type": "text", "text": ""}]
    bad = {"choices": [{"finish_reason": "tool_calls", "message": {"content": None, "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "[1"}}]}}]}
    out = message_response(bad)
    assert out["content"] == [{"type": "text", "text": '{"name": "f", "arguments": "[1"}'}]
    assert out["stop_reason"] == "end_turn"
