"""Tool calls through the proxy with the real clients (OpenAI SDK, OpenAI Agents SDK, LangChain) against
the stack's vLLM, which runs with a tool-call parser (``settings.vllm_tool_call_parser``) and
spanrl's chat template. Each call is recorded with the exact tokens the parser read the calls from.

The tools' arguments are enums and the tools ``strict``: vLLM then constrains the arguments to
the schema (``--tool-strict-level`` auto honours a tool's ``strict``), so a named or required
``tool_choice`` completes within a few dozen tokens whatever the policy weights are. The RAG agent's
``search`` takes a free-string query, which a sampled forced call can run past its token budget
(test_rag_agent_tool_path_against_the_stack says how that test allows for it).
"""
from __future__ import annotations

import asyncio
import json
import re
import uuid
from typing import Literal

import openai
import pytest
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool

from tests.integration.services import agent_key

pytestmark = pytest.mark.integration

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _client(settings, rollout_id: str, cls=openai.OpenAI):
    return cls(base_url=f"{settings.proxy_url}/rollouts/{rollout_id}/attempts/0/v1", api_key=agent_key(), max_retries=0)


def _calls_in(text: str) -> list[dict]:
    """The ``{"name", "arguments"}`` objects of the ``<tool_call>`` blocks in a completion."""
    return [json.loads(m) for m in CALL.findall(text)]


def test_named_tool_choice_is_recorded_with_the_tokens_of_the_call(settings, spans_of, tokenizer):
    rid = uuid.uuid4().hex
    r = _client(settings, rid).chat.completions.create(
        model=settings.model_name, messages=ASK, tools=[WEATHER], max_tokens=48, temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body={"return_token_ids": True})
    choice = r.choices[0]
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    assert choice.finish_reason == "stop"  # OpenAI's (and vLLM's) finish reason of a named tool call
    [span] = spans_of(rid)
    llm = span["llm"]
    assert llm["completion_token_ids"] == choice.model_extra["token_ids"]
    assert llm["prompt_token_ids"] == r.model_extra["prompt_token_ids"]
    assert len(llm["completion_logprobs"]) == len(llm["completion_token_ids"]) == r.usage.completion_tokens
    # the recorded tokens are the text vLLM's parser read the call from
    assert _calls_in(tokenizer.decode(llm["completion_token_ids"])) == [
        {"name": "get_weather", "arguments": json.loads(call.function.arguments)}]
    # the prompt lists the tool (spanrl's chat template)
    prompt = tokenizer.decode(llm["prompt_token_ids"])
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    assert llm["finish_reason"] == "stop"
    assert (span["attributes"]["spanrl.tools"], span["attributes"]["spanrl.tool_calls"]) == \
        ('["get_weather"]', '["get_weather"]')


def test_tool_choice_required_and_auto_are_served_and_recorded(settings, spans_of, tokenizer):
    rid = uuid.uuid4().hex
    client = _client(settings, rid)
    required = client.chat.completions.create(model=settings.model_name, messages=ASK, tools=[WEATHER],
                                              tool_choice="required", max_tokens=48, temperature=0.0)
    assert required.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in required.choices[0].message.tool_calls] == ["get_weather"]
    # auto: 200 whatever the small model answers (text, or a call the parser found)
    auto = client.chat.completions.create(model=settings.model_name, messages=ASK, tools=[WEATHER],
                                          tool_choice="auto", max_tokens=16, temperature=0.0)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    none = client.chat.completions.create(model=settings.model_name, messages=ASK, tools=[WEATHER],
                                          tool_choice="none", max_tokens=8, temperature=0.0)
    assert not none.choices[0].message.tool_calls
    first, second, third = spans_of(rid)
    assert first["llm"]["finish_reason"] == "tool_calls"
    assert first["attributes"]["spanrl.tool_choice"] == '"required"'
    assert [c["name"] for c in _calls_in(tokenizer.decode(first["llm"]["completion_token_ids"]))] == ["get_weather"]
    assert second["llm"]["finish_reason"] == auto.choices[0].finish_reason
    assert second["attributes"]["spanrl.tool_choice"] == '"auto"'
    assert len(second["llm"]["completion_token_ids"]) == auto.usage.completion_tokens
    assert third["attributes"]["spanrl.tool_choice"] == '"none"' and "spanrl.tool_calls" not in third["attributes"]
    assert "<tools>" in tokenizer.decode(third["llm"]["prompt_token_ids"])  # vLLM keeps the tools in the prompt


def test_agents_sdk_function_tool_runs_and_the_model_answers(settings, spans_of, tokenizer):
    rid = uuid.uuid4().hex
    ran: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """Current weather of a city.

        Args:
            city: the city.
        """
        ran.append(city)
        return f"Sunny and 21 C in {city}."

    model = OpenAIChatCompletionsModel(model=settings.model_name,
                                       openai_client=_client(settings, rid, openai.AsyncOpenAI))
    agent = Agent(name="weather", instructions="Answer with the weather.", model=model, tools=[get_weather],
                  model_settings=ModelSettings(tool_choice="get_weather", max_tokens=32, temperature=0.0))
    # the SDK forces the first turn, then resets tool_choice (reset_tool_choice) and the model answers;
    # a third turn would be the model calling again instead
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=3,
                                    run_config=RunConfig(tracing_disabled=True)))
    assert len(ran) == 1 and result.final_output is not None
    spans = spans_of(rid)
    assert len(spans) == len(result.raw_responses) >= 2
    forced, answer = spans[0], spans[1]
    assert forced["attributes"]["spanrl.tool_calls"] == '["get_weather"]'
    [made] = _calls_in(tokenizer.decode(forced["llm"]["completion_token_ids"]))
    assert made == {"name": "get_weather", "arguments": {"city": ran[0]}}
    # the next prompt holds the call as the model made it, and the tool's output
    prompt = tokenizer.decode(answer["llm"]["prompt_token_ids"])
    assert json.dumps(made) in prompt
    assert f"<tool_response>\nSunny and 21 C in {ran[0]}.\n</tool_response>" in prompt
    assert forced["attributes"]["spanrl.tool_choice"] == '{"type": "function", "function": {"name": "get_weather"}}'
    assert "spanrl.tool_choice" not in answer["attributes"]  # reset: no tool_choice sent, vLLM's default is auto
    assert answer["attributes"]["spanrl.tools"] == '["get_weather"]'


def test_rag_agent_tool_path_against_the_stack(settings, spans_of):
    from examples.rag_agent.agent import MAX_TOKENS, run_episode
    from examples.rag_agent.tasks import load_tasks

    [task] = load_tasks("heldout", 1000, 1)
    # The search tool's ``query`` is a free string (at most MAX_QUERY_CHARS characters), not an enum,
    # and vLLM's JSON grammar allows any whitespace: a sampled (T = 1) forced call of the 135M model
    # can run past MAX_TOKENS before the call closes (whitespace, or 40 characters of a script that
    # takes several tokens each), and then no call is parsed and nothing is searched (1 of 30
    # episodes, 2026-12-07). Such an episode says nothing about the tool path; up to three are run
    # for one whose forced call closed (all three truncated: ~4e-5).
    for _ in range(3):
        rid = uuid.uuid4().hex
        episode = asyncio.run(run_episode(task, f"{settings.proxy_url}/rollouts/{rid}/attempts/0/v1",
                                          agent_key(), tool_mode=True))
        spans = spans_of(rid)
        assert episode["mode"] == "tool" and spans
        if episode["tool_calls"]:
            break
        # nothing searched: only because the forced first turn ran out of tokens
        assert episode["calls"] == len(spans) == 1
        assert len(spans[0]["llm"]["completion_token_ids"]) == MAX_TOKENS
        assert json.loads(spans[0]["attributes"]["gen_ai.response.finish_reasons"]) == ["length"]
    assert episode["tool_calls"] >= 1  # the forced first turn searched
    assert len(spans) == episode["calls"] >= 2
    assert spans[0]["attributes"]["spanrl.tool_calls"] == '["search"]'
    assert json.loads(spans[0]["attributes"]["spanrl.tool_choice"]) == {"type": "function", "function": {"name": "search"}}


def test_langchain_bind_tools_with_a_named_tool_choice(settings, spans_of):
    from langchain_openai import ChatOpenAI

    rid = uuid.uuid4().hex
    llm = ChatOpenAI(model=settings.model_name, base_url=f"{settings.proxy_url}/rollouts/{rid}/attempts/0/v1",
                     api_key=agent_key(), max_retries=0, max_tokens=48, temperature=0.0)
    reply = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("What is the weather in Paris?")
    [call] = reply.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Oslo")
    [span] = spans_of(rid)
    assert span["attributes"]["spanrl.tool_calls"] == '["get_weather"]'
    assert len(span["llm"]["completion_token_ids"]) == reply.usage_metadata["output_tokens"]
