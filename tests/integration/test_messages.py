"""Anthropic Messages through the proxy with the real ``anthropic`` client against the stack.

vLLM's own ``/v1/messages`` returns no token ids or log-probs, so the proxy serves Messages from
chat completions (producers/messages.py) and records each call like a chat call, with the exact
token ids and log-probs; the span has ``spanrl.api = anthropic.messages``. Streamed Messages
(``messages.stream``) are tested in test_proxy_streaming.py, against a proxy from this checkout.
"""
from __future__ import annotations

import uuid

import anthropic
import pytest

from tests.integration.services import agent_key

pytestmark = pytest.mark.integration

WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                            "required": ["city"], "additionalProperties": False}}
GREEDY = {"temperature": 0.0}  # anthropic 2.14's messages.create has no temperature parameter


def test_messages_text_tool_use_and_tool_result_are_recorded_with_exact_tokens(settings, spans_of, tokenizer):
    rid = uuid.uuid4().hex
    # the SDK appends /v1/messages to its base URL
    client = anthropic.Anthropic(base_url=f"{settings.proxy_url}/rollouts/{rid}/attempts/0", api_key=agent_key(),
                                 max_retries=0)
    text = client.messages.create(model=settings.model_name, max_tokens=12, system="Be brief.",
                                  messages=[{"role": "user", "content": "Say hi."}], extra_body=GREEDY)
    assert text.type == "message" and text.content[0].type == "text"
    assert text.stop_reason in ("end_turn", "max_tokens")

    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = client.messages.create(model=settings.model_name, max_tokens=48, tools=[WEATHER], messages=ask,
                                    tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    [use] = [b for b in forced.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"] in ("Paris", "Oslo") and forced.stop_reason == "tool_use"

    result = client.messages.create(
        model=settings.model_name, max_tokens=12, tools=[WEATHER], extra_body=GREEDY,
        messages=ask + [{"role": "assistant", "content": [b.model_dump() for b in forced.content]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny."}]}])
    assert result.content and result.usage.input_tokens > forced.usage.input_tokens

    spans = spans_of(rid)
    assert len(spans) == 3 and all(s["attributes"]["spanrl.api"] == "anthropic.messages" for s in spans)
    for span, answer in zip(spans, (text, forced, result)):
        llm = span["llm"]
        assert len(llm["prompt_token_ids"]) == answer.usage.input_tokens
        assert len(llm["completion_token_ids"]) == len(llm["completion_logprobs"]) == answer.usage.output_tokens
        assert span["attributes"]["gen_ai.response.id"] == answer.id
    # the text block is the decoded completion (its end-of-turn token aside)
    assert text.content[0].text == tokenizer.decode(spans[0]["llm"]["completion_token_ids"], skip_special_tokens=True)
    assert tokenizer.decode(spans[0]["llm"]["prompt_token_ids"]).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    # the tool_use block is the call the recorded tokens spell
    assert f'{{"name": "get_weather", "arguments": {{"city": "{use.input["city"]}"}}}}' in \
        tokenizer.decode(spans[1]["llm"]["completion_token_ids"])
    assert spans[1]["attributes"]["spanrl.tool_calls"] == '["get_weather"]'
    # the tool result reached the next prompt
    assert "<tool_response>\nSunny.\n</tool_response>" in tokenizer.decode(spans[2]["llm"]["prompt_token_ids"])


def test_messages_refusals_are_400_with_a_reason(settings):
    client = anthropic.Anthropic(base_url=f"{settings.proxy_url}/rollouts/{uuid.uuid4().hex}/attempts/0",
                                 api_key=agent_key(), max_retries=0)
    image = {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/a.png"}}
    for kwargs, reason in [({"messages": [{"role": "user", "content": [image]}]}, "unsupported_content"),
                           ({"messages": [{"role": "user", "content": "x"}], "thinking": {
                               "type": "enabled", "budget_tokens": 1024}}, "thinking_not_supported")]:
        with pytest.raises(anthropic.BadRequestError) as exc:
            client.messages.create(model=settings.model_name, max_tokens=8, **kwargs)
        assert exc.value.body["error"]["type"] == reason
