"""The Responses API through the stack's proxy (``settings.proxy_url``), vLLM and Kafka, with
the real clients: the OpenAI Agents SDK's default model (``Agent(model=name)`` resolved by an
``OpenAIProvider`` to ``OpenAIResponsesModel``), LangChain ``ChatOpenAI(use_responses_api=True)``
and the OpenAI SDK's ``responses.create``. Each model turn must be one span (a chat call,
``spanrl.api`` ``responses``) whose completion token ids are what the answer came from: decoded with the
served model's tokenizer they give the answer's text, and their count is the Response's
``usage.output_tokens``."""
from __future__ import annotations

import asyncio
import json
import uuid

import openai
import pytest

from spanrl.infra.replay import read_records, topics_end_offsets
from spanrl.schemas import decode
from spanrl.schemas import topics as T
from tests.integration.services import agent_key, start_service, stop

# the base weights (conftest.base_policy): a trained version that earlier tests left served may
# not stop within max_tokens=32, and the Agents SDK raises on an incomplete response
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("base_policy")]
QUESTION = "What is 2+2? Answer with a number only."  # SmolLM2-135M greedy: "The answer is 4." (7 tokens)


@pytest.fixture(scope="module")
def tokenizer(settings):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(settings.model_dir)


def base_url(settings, rid: str, prefix: str = "") -> str:
    return f"{settings.proxy_url}{prefix}/rollouts/{rid}/attempts/0/v1"


def ends(settings, topic: T.Topic = T.SPANS) -> dict[int, int]:
    return {tp.partition: o for tp, o in asyncio.run(topics_end_offsets(settings, [topic])).items()}


def spans_of(settings, rid: str, since: dict[int, int], topic: T.Topic = T.SPANS) -> list[dict]:
    """The proxy's spans of rollout ``rid`` written after ``since`` (the proxy answers after
    Kafka's ack, so they are there when the client has its answer), in sequence order; not
    the client's own OTel spans that may join the rollout by trace id (stream_jobs/joining.py)."""
    records = asyncio.run(read_records(settings.kafka_bootstrap, topic.name, since))
    spans = [s for s in (decode(topic.record, v) for _, _, k, v in records if k == rid.encode())
             if s["source"] == "proxy"]
    return sorted(spans, key=lambda s: s["sequence_id"])


def assert_answer_is_the_call(span: dict, text: str, input_tokens: int, output_tokens: int, tokenizer) -> None:
    """``span`` is the record of the call the client's answer ``text`` (and its token counts)
    came from."""
    llm = span["llm"]
    assert (span["name"], span["source"], span["kind"]) == ("chat.completions", "proxy", "llm")
    assert span["attributes"]["spanrl.api"] == "responses"
    decoded = tokenizer.decode(llm["completion_token_ids"], skip_special_tokens=True)
    # vLLM's detokenizer holds back a trailing incomplete UTF-8 sequence (the ids end mid-character,
    # e.g. max_output_tokens=2), which decode() renders as U+FFFD: the answer is the text before it
    assert decoded == text or (decoded.endswith("\ufffd") and decoded.rstrip("\ufffd") == text), (decoded, text)
    assert len(llm["completion_logprobs"]) == len(llm["completion_token_ids"]) == output_tokens
    assert len(llm["prompt_token_ids"]) == input_tokens


def agents_run_config(settings, rid: str, prefix: str = ""):
    from agents import RunConfig
    from agents.models.openai_provider import OpenAIProvider

    client = openai.AsyncOpenAI(base_url=base_url(settings, rid, prefix), api_key=agent_key(), max_retries=0)
    # tracing off for this run only: nothing goes to OpenAI, other tests' processors stay
    return RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)


def test_agents_sdk_default_model_run(stack, settings, tokenizer):
    from agents import Agent, ModelSettings, Runner

    rid, since = uuid.uuid4().hex, ends(settings)
    agent = Agent(name="solver", instructions="Be brief.", model=settings.model_name,
                  model_settings=ModelSettings(temperature=0, max_tokens=32))
    result = asyncio.run(Runner.run(agent, QUESTION, run_config=agents_run_config(settings, rid)))
    [raw] = result.raw_responses
    [span] = spans_of(settings, rid, since)
    assert_answer_is_the_call(span, result.final_output, raw.usage.input_tokens, raw.usage.output_tokens, tokenizer)
    assert result.final_output.strip()
    prompt = tokenizer.decode(span["llm"]["prompt_token_ids"])
    assert "Be brief." in prompt and QUESTION in prompt  # instructions became the system message
    assert (span["llm"]["temperature"], span["llm"]["max_tokens"], span["llm"]["finish_reason"]) == (0.0, 32, "stop")


def test_langchain_use_responses_api_invoke(stack, settings, tokenizer):
    from langchain_openai import ChatOpenAI

    rid, since = uuid.uuid4().hex, ends(settings)
    llm = ChatOpenAI(model=settings.model_name, base_url=base_url(settings, rid), api_key=agent_key(),
                     use_responses_api=True, temperature=0, max_tokens=32, max_retries=0)
    message = llm.invoke([("system", "Be brief."), ("user", QUESTION)])
    [span] = spans_of(settings, rid, since)
    usage = message.usage_metadata
    assert_answer_is_the_call(span, message.text, usage["input_tokens"], usage["output_tokens"], tokenizer)
    assert message.response_metadata["id"] == "resp_" + span["llm"]["request_id"].removeprefix("chatcmpl-")


def test_openai_sdk_logprobs_and_eval_route(stack, settings, tokenizer):
    """``include`` output_text log-probs are the recorded behaviour log-probs; the same API
    under ``/eval/0/`` records greedily on ``spans.eval``."""
    rid, since = uuid.uuid4().hex, ends(settings)
    client = openai.OpenAI(base_url=base_url(settings, rid), api_key=agent_key(), max_retries=0)
    r = client.responses.create(model=settings.model_name, instructions="Be brief.", input=QUESTION,
                                temperature=0, max_output_tokens=32, include=["message.output_text.logprobs"])
    [span] = spans_of(settings, rid, since)
    assert_answer_is_the_call(span, r.output_text, r.usage.input_tokens, r.usage.output_tokens, tokenizer)
    assert (r.status, r.id) == ("completed", "resp_" + span["llm"]["request_id"].removeprefix("chatcmpl-"))
    seen = [t.logprob for t in r.output[0].content[0].logprobs]
    assert span["llm"]["completion_logprobs"] == pytest.approx(seen, rel=1e-6)  # float32 on the wire

    eval_rid, eval_since = uuid.uuid4().hex, ends(settings, T.SPANS_EVAL)
    client = openai.OpenAI(base_url=base_url(settings, eval_rid, "/eval/0"), api_key=agent_key(), max_retries=0)
    r = client.responses.create(model=settings.model_name, input=QUESTION, temperature=0.9, max_output_tokens=32)
    [span] = spans_of(settings, eval_rid, eval_since, T.SPANS_EVAL)
    assert (span["llm"]["temperature"], r.temperature) == (0.0, 0.0)  # the route's sampling, echoed
    assert_answer_is_the_call(span, r.output_text, r.usage.input_tokens, r.usage.output_tokens, tokenizer)


def test_agents_sdk_structured_output(stack, settings, tokenizer):
    """``output_type`` → ``text.format`` json_schema → chat ``response_format``: vLLM's
    structured output makes the completion the JSON the agent parses."""
    from agents import Agent, ModelSettings, Runner
    from pydantic import BaseModel

    class Answer(BaseModel):
        value: int

    rid, since = uuid.uuid4().hex, ends(settings)
    agent = Agent(name="solver", instructions="Be brief.", model=settings.model_name, output_type=Answer,
                  model_settings=ModelSettings(temperature=0, max_tokens=32))
    result = asyncio.run(Runner.run(agent, "What is 2+2?", run_config=agents_run_config(settings, rid)))
    [raw] = result.raw_responses
    [span] = spans_of(settings, rid, since)
    text = raw.output[0].content[0].text
    assert isinstance(result.final_output, Answer) and Answer.model_validate_json(text) == result.final_output
    assert_answer_is_the_call(span, text, raw.usage.input_tokens, raw.usage.output_tokens, tokenizer)

def test_stateful_requests_get_a_400_naming_the_feature(stack, settings, tokenizer):
    from agents import Agent, ModelSettings, Runner

    rid, since = uuid.uuid4().hex, ends(settings)
    client = openai.OpenAI(base_url=base_url(settings, rid), api_key=agent_key(), max_retries=0)
    for field, value in [("previous_response_id", "resp_1"), ("conversation", "conv_1"), ("background", True)]:
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=settings.model_name, input="hi", **{field: value})
        assert (err.value.status_code, err.value.body["type"], err.value.body["param"]) == (
            400, "stateful_not_supported", field)
        assert err.value.body["message"].startswith(field)
    agent = Agent(name="solver", model=settings.model_name, model_settings=ModelSettings(max_tokens=4))
    with pytest.raises(openai.BadRequestError) as err:
        asyncio.run(Runner.run(agent, "hi", previous_response_id="resp_1", run_config=agents_run_config(settings, rid)))
    assert err.value.body["param"] == "previous_response_id"
    # store alone changes nothing here: answered, and recorded like any call
    r = client.responses.create(model=settings.model_name, input="hi", store=True, max_output_tokens=2)
    [span] = spans_of(settings, rid, since)  # the refused requests recorded nothing
    assert span["llm"]["request_id"].removeprefix("chatcmpl-") == r.id.removeprefix("resp_")
    assert_answer_is_the_call(span, r.output_text, r.usage.input_tokens, r.usage.output_tokens, tokenizer)


def test_agents_sdk_function_tool_through_responses(stack, settings, tokenizer):
    """A forced function call (named ``tool_choice``: structured output, any model), its
    output sent back as a ``function_call_output`` item, then the answer: two turns, two
    spans; the first turn's completion tokens are the call (needs vLLM's tool-call parser)."""
    from agents import Agent, ModelSettings, Runner, function_tool

    @function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        return f"sunny in {city}"

    rid, since = uuid.uuid4().hex, ends(settings)
    agent = Agent(name="solver", instructions="Be brief.", model=settings.model_name, tools=[get_weather],
                  model_settings=ModelSettings(temperature=0, max_tokens=48, tool_choice="get_weather"))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=3,
                                    run_config=agents_run_config(settings, rid)))
    first, second = result.raw_responses
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather"
    spans = spans_of(settings, rid, since)
    assert [s["sequence_id"] for s in spans] == [0, 1]
    assert len(spans[0]["llm"]["completion_token_ids"]) == first.usage.output_tokens
    # the call's arguments are in the recorded completion (hermes: <tool_call>{"name", "arguments"}</tool_call>)
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.arguments in tokenizer.decode(spans[0]["llm"]["completion_token_ids"])
    assert "sunny in Paris" in tokenizer.decode(spans[1]["llm"]["prompt_token_ids"])  # the tool's output went back
    assert_answer_is_the_call(spans[1], result.final_output, second.usage.input_tokens, second.usage.output_tokens,
                              tokenizer)


# ------------------------------------------------------------------ streamed
def test_agents_sdk_default_model_run_streamed(stack, settings, tokenizer):
    from agents import Agent, ModelSettings, Runner

    rid, since = uuid.uuid4().hex, ends(settings)
    agent = Agent(name="solver", instructions="Be brief.", model=settings.model_name,
                  model_settings=ModelSettings(temperature=0, max_tokens=32))

    async def run():
        result = Runner.run_streamed(agent, QUESTION, run_config=agents_run_config(settings, rid))
        kinds = [event.data.type async for event in result.stream_events() if event.type == "raw_response_event"]
        return result, kinds

    result, kinds = asyncio.run(run())
    deltas = kinds.count("response.output_text.delta")
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert deltas >= 2  # the text came in pieces, as vLLM generated it
    [raw] = result.raw_responses
    [span] = spans_of(settings, rid, since)
    assert_answer_is_the_call(span, result.final_output, raw.usage.input_tokens, raw.usage.output_tokens, tokenizer)
    assert span["attributes"]["spanrl.streamed"] == "true"
    assert raw.response_id == "resp_" + span["llm"]["request_id"].removeprefix("chatcmpl-")


def test_langchain_use_responses_api_stream(stack, settings, tokenizer):
    from langchain_openai import ChatOpenAI

    rid, since = uuid.uuid4().hex, ends(settings)
    llm = ChatOpenAI(model=settings.model_name, base_url=base_url(settings, rid), api_key=agent_key(),
                     use_responses_api=True, temperature=0, max_tokens=32, max_retries=0)
    chunks = list(llm.stream([("system", "Be brief."), ("user", QUESTION)]))
    assert len([c for c in chunks if c.text]) >= 2
    message = chunks[0]
    for c in chunks[1:]:
        message += c
    [span] = spans_of(settings, rid, since)
    usage = message.usage_metadata
    assert_answer_is_the_call(span, message.text, usage["input_tokens"], usage["output_tokens"], tokenizer)


@pytest.mark.slow
def test_streamed_response_without_kafka_ends_with_an_error_event(stack, settings):
    """Kafka unreachable: the text streams, then an ``error`` event ``kafka_unavailable``
    instead of ``response.completed``; the Agents SDK and LangChain raise on it."""
    from agents import Agent, ModelSettings, RunConfig, Runner
    from agents.exceptions import ModelBehaviorError
    from agents.models.openai_provider import OpenAIProvider
    from langchain_openai import ChatOpenAI

    proc, url = start_service("spanrl.producers.proxy", "--kafka-bootstrap", f"{settings.host}:1",
                              "--reloader-url", "", env={"SPANRL_KAFKA_SEND_TIMEOUT_S": "1"})
    try:
        base = f"{url}/rollouts/r/attempts/0/v1"
        client = openai.OpenAI(base_url=base, api_key=agent_key(), max_retries=0)
        kinds = [(e.type, getattr(e, "code", None)) for e in client.responses.create(
            model=settings.model_name, input=QUESTION, temperature=0, max_output_tokens=32, stream=True)]
        assert ("response.output_text.delta", None) in kinds and kinds[-1] == ("error", "kafka_unavailable")
        assert "response.completed" not in {k for k, _ in kinds}

        agent = Agent(name="solver", model=settings.model_name, model_settings=ModelSettings(temperature=0, max_tokens=32))

        async def agent_run():
            aclient = openai.AsyncOpenAI(base_url=base, api_key=agent_key(), max_retries=0)
            run = Runner.run_streamed(agent, QUESTION, max_turns=1, run_config=RunConfig(
                model_provider=OpenAIProvider(openai_client=aclient), tracing_disabled=True))
            async for _ in run.stream_events():
                pass

        with pytest.raises(ModelBehaviorError, match="kafka_unavailable"):
            asyncio.run(agent_run())
        with pytest.raises(ValueError, match="kafka_unavailable"):
            list(ChatOpenAI(model=settings.model_name, base_url=base, api_key=agent_key(), use_responses_api=True,
                            max_tokens=8, max_retries=0).stream("hi"))
        with pytest.raises(openai.APIStatusError) as err:  # not streamed: the answer waits for the ack
            client.responses.create(model=settings.model_name, input="hi", max_output_tokens=2)
        assert (err.value.status_code, err.value.body["type"]) == (503, "kafka_unavailable")
    finally:
        stop(proc)
