"""Streamed calls and n > 1 through the proxy, with the real client libraries (OpenAI SDK,
LangChain, OpenAI Agents SDK; the anthropic SDK's ``messages.stream`` for streamed Anthropic
Messages) against the real vLLM and Kafka: each test reads the recorded spans back from Kafka
and checks their token ids and log-probs against what the client saw.

The proxy runs from this checkout as a subprocess on a free port (tests/integration/services.py),
writing to this module's own ``pstest-<id>-*`` topics; ``--reloader-url ''`` keeps its policy
version static, whatever the stack's reloader is doing.
"""
from __future__ import annotations

import asyncio
import json
import uuid

import anthropic
import httpx
import openai
import pytest

from spanrl.infra.stack import Stack
from tests.integration.services import S, of_rollout, own_topics, read_topic, start_service, stop, topic_prefix

pytestmark = pytest.mark.integration
SAY_HI = [{"role": "user", "content": "Say hi to Ada."}]
TOKEN_IDS = {"return_token_ids": True}


@pytest.fixture(scope="module")
def proxy():
    """{"url", "topics"}: a proxy from this checkout on this module's topics (Kafka and vLLM of
    the stack, started if they are not)."""
    Stack(S).start("kafka")
    Stack(S).start("vllm")
    with own_topics("pstest") as topics:
        proc, url = start_service("spanrl.producers.proxy", "--topic-prefix", topic_prefix(topics), "--reloader-url", "")
        try:
            yield {"url": url, "topics": topics}
        finally:
            stop(proc)


class Tokenizer:
    """The served model's tokenizer, to check recorded token ids against the text a client saw
    (a check only: records are never rebuilt from text)."""

    def __init__(self):
        from tokenizers import Tokenizer as HfTokenizer

        self._tok = HfTokenizer.from_file(str(S.model_dir / "tokenizer.json"))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def assert_text(self, ids: list[int], text: str) -> None:
        """``ids`` decode to ``text``, but for a character cut by ``max_tokens``: vLLM's
        incremental detokenizer sends nothing of a token whose bytes end inside a character,
        not even the text before the cut in the same token (SmolLM2's id 40303 is a space plus
        an emoji's first bytes), so such trailing tokens are dropped before comparing."""
        decoded = self.decode(ids)
        while ids and decoded.endswith("\ufffd"):
            ids = ids[:-1]
            decoded = self.decode(ids)
        assert decoded == text


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer()


def base_url(proxy, rid: str) -> str:
    return f"{proxy['url']}/rollouts/{rid}/attempts/0/v1"


def spans_of(proxy, rid: str, n: int, topic=None) -> list[dict]:
    """The ``n`` spans of rollout ``rid`` (in sequence order) once Kafka has them all."""
    topic = topic or proxy["topics"].spans
    spans = of_rollout(read_topic(topic, lambda rs: len(of_rollout(rs, rid)) >= n, 60), rid)
    assert len(spans) == n, spans
    return sorted(spans, key=lambda s: s["sequence_id"])


def dead_letters_of(proxy, rid: str, n: int = 1) -> list[dict]:
    return of_rollout(read_topic(proxy["topics"].dead_letter, lambda rs: len(of_rollout(rs, rid)) >= n, 60), rid)


def seen(chunks) -> dict[int, dict]:
    """choice index -> what an OpenAI SDK client saw of it in chat chunks: text, token ids,
    log-probs; plus the prompt token ids of the first chunk (index -1)."""
    out: dict[int, dict] = {-1: {"prompt": chunks[0].model_extra.get("prompt_token_ids")}}
    for ch in chunks:
        for c in ch.choices:
            o = out.setdefault(c.index, {"text": "", "ids": [], "logprobs": [], "finish": None})
            o["text"] += c.delta.content or ""
            o["ids"] += c.model_extra.get("token_ids") or []
            o["logprobs"] += [t.logprob for t in (c.logprobs.content if c.logprobs and c.logprobs.content else [])]
            o["finish"] = c.finish_reason or o["finish"]
    return out


def test_openai_sdk_chat_stream_records_what_the_client_saw(proxy):
    """Streamed with token ids and log-probs asked, then the same request not streamed (same
    seed): the span holds exactly what the client was streamed, and both calls agree."""
    rid = uuid.uuid4().hex
    client = openai.OpenAI(base_url=base_url(proxy, rid), api_key="unused", max_retries=0)
    ask = dict(model=S.model_name, messages=SAY_HI, max_tokens=12, temperature=0.9, seed=1234, logprobs=True,
               extra_body=TOKEN_IDS)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **ask))
    plain = client.chat.completions.create(**ask)
    got = seen(chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(got[0]["ids"]) > 0
    assert all(c.usage is None for c in chunks[:-1])
    streamed, unstreamed = spans_of(proxy, rid, 2)
    llm = streamed["llm"]
    assert llm["prompt_token_ids"] == got[-1]["prompt"] == plain.model_extra["prompt_token_ids"]
    assert llm["completion_token_ids"] == got[0]["ids"]
    assert llm["completion_logprobs"] == pytest.approx(got[0]["logprobs"], rel=1e-6)
    assert (llm["finish_reason"], llm["max_tokens"], llm["temperature"], llm["request_id"]) == (
        got[0]["finish"], 12, 0.9, chunks[0].id)
    assert streamed["attributes"]["spanrl.streamed"] == "true"
    assert streamed["attributes"]["gen_ai.usage.output_tokens"] == str(len(got[0]["ids"]))
    # token fidelity: streamed and not, same seed -> same tokens and log-probs
    assert got[0]["text"] == plain.choices[0].message.content
    assert unstreamed["llm"]["completion_token_ids"] == llm["completion_token_ids"]
    assert unstreamed["llm"]["completion_logprobs"] == pytest.approx(llm["completion_logprobs"], abs=1e-4)


def test_openai_sdk_plain_stream_gets_only_what_it_asked(proxy, tokenizer):
    """No logprobs, no token ids, no include_usage asked: none are sent, all are recorded."""
    rid = uuid.uuid4().hex
    client = openai.OpenAI(base_url=base_url(proxy, rid), api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(model=S.model_name, messages=SAY_HI, max_tokens=10,
                                                 temperature=0.7, stream=True))
    assert all(c.usage is None and c.choices for c in chunks)  # no usage-only last chunk
    assert all(c.choices[0].logprobs is None and not c.choices[0].model_extra.get("token_ids") for c in chunks)
    assert chunks[0].model_extra.get("prompt_token_ids") is None
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    [span] = spans_of(proxy, rid, 1)
    llm = span["llm"]
    assert len(llm["completion_logprobs"]) == len(llm["completion_token_ids"]) > 0
    tokenizer.assert_text(llm["completion_token_ids"], text)
    assert span["attributes"]["gen_ai.usage.input_tokens"] == str(len(llm["prompt_token_ids"]))


def test_openai_sdk_completions_stream(proxy):
    rid = uuid.uuid4().hex
    client = openai.OpenAI(base_url=base_url(proxy, rid), api_key="unused", max_retries=0)
    chunks = list(client.completions.create(model=S.model_name, prompt="2+2=", max_tokens=6, temperature=0.8,
                                            logprobs=1, stream=True, stream_options={"include_usage": True},
                                            extra_body=TOKEN_IDS))
    usage = chunks[-1].usage
    text = [c for c in chunks if c.choices]
    ids = [i for c in text for i in c.choices[0].model_extra["token_ids"]]
    lps = [x for c in text for x in c.choices[0].logprobs.token_logprobs]
    [span] = spans_of(proxy, rid, 1)
    llm = span["llm"]
    assert llm["prompt_token_ids"] == text[0].choices[0].model_extra["prompt_token_ids"]
    assert (llm["completion_token_ids"], usage.completion_tokens, usage.prompt_tokens) == (
        ids, len(ids), len(llm["prompt_token_ids"]))
    assert llm["completion_logprobs"] == pytest.approx(lps, rel=1e-6)
    assert span["name"] == "completions"


@pytest.mark.parametrize("stream", [False, True])
def test_n2_each_choice_is_its_own_call(proxy, stream):
    """n=2: the client gets both choices; each is a span of its own (same prompt, its own
    completion, its own sequence id, span id and choice index), all in the rollout."""
    rid = uuid.uuid4().hex
    client = openai.OpenAI(base_url=base_url(proxy, rid), api_key="unused", max_retries=0)
    ask = dict(model=S.model_name, messages=SAY_HI, max_tokens=8, temperature=1.0, n=2, logprobs=True,
               extra_body=TOKEN_IDS)
    if stream:
        got = seen(list(client.chat.completions.create(stream=True, **ask)))
        prompt = got[-1]["prompt"]
    else:
        out = client.chat.completions.create(**ask)
        got = {c.index: {"text": c.message.content, "ids": c.model_extra["token_ids"],
                         "logprobs": [t.logprob for t in c.logprobs.content]} for c in out.choices}
        prompt = out.model_extra["prompt_token_ids"]
    assert sorted(k for k in got if k >= 0) == [0, 1]
    spans = spans_of(proxy, rid, 2)
    assert [s["sequence_id"] for s in spans] == [0, 1] and len({s["span_id"] for s in spans}) == 2
    for s in spans:
        i = int(s["attributes"]["spanrl.choice_index"])
        assert s["attributes"]["gen_ai.request.choice.count"] == "2"
        assert s["llm"]["prompt_token_ids"] == prompt
        assert s["llm"]["completion_token_ids"] == got[i]["ids"]
        assert s["llm"]["completion_logprobs"] == pytest.approx(got[i]["logprobs"], rel=1e-6)
    assert sorted(int(s["attributes"]["spanrl.choice_index"]) for s in spans) == [0, 1]


def test_eval_route_streams_to_the_eval_topics(proxy):
    """``/eval/{sampling}/...`` streamed: the sampling's temperature is applied and the call is
    recorded on ``spans.eval``, like a non-streamed evaluation call."""
    from spanrl.producers.kafka import Topics

    rid = uuid.uuid4().hex
    url = f"{proxy['url']}/eval/0.5/rollouts/{rid}/attempts/0/v1"
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=S.model_name, messages=SAY_HI, max_tokens=4, stream=True) if c.choices)
    assert text
    eval_spans = Topics.with_prefix(topic_prefix(proxy["topics"]), Topics.evaluation()).spans
    [span] = spans_of(proxy, rid, 1, eval_spans)
    assert span["llm"]["temperature"] == 0.5


def test_langchain_stream_and_astream(proxy, tokenizer):
    from langchain_openai import ChatOpenAI

    rid = uuid.uuid4().hex
    llm = ChatOpenAI(base_url=base_url(proxy, rid), api_key="unused", model=S.model_name, max_tokens=10,
                     temperature=0.7, max_retries=0)
    texts = ["".join(c.content for c in llm.stream("Say hi to Ada."))]

    async def astream():
        return "".join([c.content async for c in llm.astream("Say hi to Bob.")])
    texts.append(asyncio.run(astream()))
    assert all(texts)
    spans = spans_of(proxy, rid, 2)
    for span, text in zip(spans, texts):
        tokenizer.assert_text(span["llm"]["completion_token_ids"], text)
        assert span["attributes"]["spanrl.streamed"] == "true"


def test_agents_sdk_run_streamed(proxy, tokenizer):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner
    from openai.types.responses import ResponseTextDeltaEvent

    rid = uuid.uuid4().hex

    async def go():
        client = openai.AsyncOpenAI(base_url=base_url(proxy, rid), api_key="unused", max_retries=0)
        agent = Agent(name="greeter", instructions="Answer in a few words.",
                      model=OpenAIChatCompletionsModel(model=S.model_name, openai_client=client),
                      model_settings=ModelSettings(max_tokens=10, temperature=0.7))
        result = Runner.run_streamed(agent, "Say hi to Ada.", run_config=RunConfig(tracing_disabled=True))
        deltas = [e.data.delta async for e in result.stream_events()
                  if e.type == "raw_response_event" and isinstance(e.data, ResponseTextDeltaEvent)]
        await client.close()
        return deltas, result.final_output

    deltas, final = asyncio.run(go())
    assert len(deltas) > 1 and "".join(deltas) == final
    [span] = spans_of(proxy, rid, 1)
    tokenizer.assert_text(span["llm"]["completion_token_ids"], final)


def test_client_that_goes_away_is_one_dead_letter(proxy):
    """The client reads a few events and closes: no span, one dead letter client_disconnected
    holding the tokens generated so far (what the client was sent, and maybe a few more). That
    the client had tokens while vLLM was still generating (no finish reason, far below
    max_tokens) also shows the proxy forwards as it goes, not after the whole answer."""
    rid = uuid.uuid4().hex
    sent: list[int] = []
    with httpx.stream("POST", base_url(proxy, rid) + "/chat/completions", timeout=30, json={
            "model": S.model_name, "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 400, "temperature": 0.7, "stream": True, "return_token_ids": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                sent += json.loads(line[6:])["choices"][0].get("token_ids") or []
            if len(sent) >= 3:
                break
    [dead] = dead_letters_of(proxy, rid)
    assert (dead["reason"], dead["stage"]) == ("client_disconnected", "proxy")
    partial = json.loads(dead["payload"])["partial_response"]["choices"][0]
    assert partial["token_ids"][:len(sent)] == sent and len(partial["token_ids"]) < 400
    assert partial["finish_reason"] is None
    assert of_rollout(read_topic(proxy["topics"].spans, lambda rs: False, 2), rid) == []
    m = httpx.get(proxy["url"] + "/status").json()
    assert m["dead_letter.client_disconnected"] >= 1


def test_stream_without_kafka_never_says_done(proxy):
    """Kafka unreachable: the answer streams, but instead of [DONE] the stream ends with an
    error event kafka_unavailable, which the OpenAI SDK raises (LangChain's stream and the
    Agents SDK's run_streamed too)."""
    proc, url = start_service("spanrl.producers.proxy", "--kafka-bootstrap", f"{S.host}:1", "--reloader-url", "",
                              env={"SPANRL_KAFKA_SEND_TIMEOUT_S": "1"})
    try:
        client = openai.OpenAI(base_url=f"{url}/rollouts/r/attempts/0/v1", api_key="unused", max_retries=0)
        texts = []
        with pytest.raises(openai.APIError) as err:
            for c in client.chat.completions.create(model=S.model_name, messages=SAY_HI, max_tokens=4, stream=True):
                texts.append(c.choices[0].delta.content)
        assert "kafka" in str(err.value).lower() and texts
        # libraries built on the SDK raise it too
        from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner
        from langchain_openai import ChatOpenAI

        with pytest.raises(openai.APIError):
            list(ChatOpenAI(base_url=f"{url}/rollouts/r/attempts/0/v1", api_key="unused", model=S.model_name,
                            max_tokens=2, max_retries=0).stream("hi"))

        async def agent_run():
            aclient = openai.AsyncOpenAI(base_url=f"{url}/rollouts/r/attempts/0/v1", api_key="unused", max_retries=0)
            # max_tokens: the error comes at the stream's end, after however much the model writes
            agent = Agent(name="g", model=OpenAIChatCompletionsModel(model=S.model_name, openai_client=aclient),
                          model_settings=ModelSettings(max_tokens=2))
            result = Runner.run_streamed(agent, "hi", run_config=RunConfig(tracing_disabled=True), max_turns=1)
            try:
                async for _ in result.stream_events():
                    pass
            finally:
                await aclient.close()
        with pytest.raises(openai.APIError):
            asyncio.run(agent_run())
        raw = httpx.post(f"{url}/rollouts/r/attempts/0/v1/chat/completions", timeout=30, json={
            "model": S.model_name, "messages": SAY_HI, "max_tokens": 2, "stream": True}).text
        assert "[DONE]" not in raw and '"type":"kafka_unavailable"' in raw
        assert httpx.get(url + "/status").json()["kafka_unavailable"] == 4
    finally:
        stop(proc)


def test_streamed_refusals_are_plain_4xx(proxy):
    """What is refused before anything streams is an ordinary OpenAI-shaped error."""
    base = base_url(proxy, "r") + "/chat/completions"
    for body, status, reason in [
        ({"model": S.model_name, "messages": SAY_HI, "stream": True, "n": 2, "temperature": 0}, 400,
         "n_requires_sampling"),
        ({"model": "gpt-4", "messages": SAY_HI, "stream": True}, 404, "model_not_found"),
    ]:
        r = httpx.post(base, json=body)
        assert (r.status_code, r.json()["error"]["type"]) == (status, reason)
    # refused by vLLM before it streams (max_tokens over the context): vLLM's 400 as it is
    r = httpx.post(base, json={"model": S.model_name, "messages": SAY_HI, "stream": True, "max_tokens": 10**6})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json") and r.json()["error"]


# ------------------------------------------------------------------ streamed Anthropic Messages
WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                            "required": ["city"], "additionalProperties": False}}


def anthropic_client(base: str, rid: str, **kwargs) -> anthropic.Anthropic:
    """The anthropic client of rollout ``rid`` on the proxy at ``base`` (the SDK adds ``/v1/messages``)."""
    return anthropic.Anthropic(base_url=f"{base}/rollouts/{rid}/attempts/0", api_key="unused", max_retries=0, **kwargs)


def streamed_message(client: anthropic.Anthropic, **ask):
    """``client.messages.stream(**ask)`` read to its end: (the events' types, the text pieces,
    the tool input pieces, ``get_final_message()``)."""
    with client.messages.stream(model=S.model_name, **ask) as stream:
        events = list(stream)
        final = stream.get_final_message()
    return ([e.type for e in events], [e.text for e in events if e.type == "text"],
            [e.partial_json for e in events if e.type == "input_json"], final)


def assert_message_is_the_call(span: dict, final) -> None:
    """``span`` is the record of the streamed Messages answer ``final``."""
    llm = span["llm"]
    assert (span["attributes"]["spanrl.api"], span["attributes"]["spanrl.streamed"]) == ("anthropic.messages", "true")
    assert span["attributes"]["gen_ai.response.id"] == final.id == llm["request_id"]
    assert len(llm["prompt_token_ids"]) == final.usage.input_tokens
    assert len(llm["completion_token_ids"]) == len(llm["completion_logprobs"]) == final.usage.output_tokens


def test_anthropic_sdk_messages_stream_records_what_the_client_saw(proxy, tokenizer):
    """Streamed Messages text: ``message_start`` first, ``message_stop`` last, the text in pieces
    as vLLM generated it; the span's completion ids decode to that text, and the same request
    not streamed (same sampling seed) gives the same tokens."""
    rid = uuid.uuid4().hex
    client = anthropic_client(proxy["url"], rid, default_headers={"x-spanrl-sampling-seed": "1234"})
    ask = dict(max_tokens=12, system="Be brief.", messages=[{"role": "user", "content": "Say hi to Ada."}],
               extra_body={"temperature": 0.9})
    kinds, texts, _, final = streamed_message(client, **ask)
    plain = client.messages.create(model=S.model_name, **ask)
    assert (kinds[0], kinds[-1]) == ("message_start", "message_stop") and len(texts) >= 2
    [block] = final.content
    assert block.type == "text" and "".join(texts) == block.text
    streamed, unstreamed = spans_of(proxy, rid, 2)
    assert_message_is_the_call(streamed, final)
    llm = streamed["llm"]
    tokenizer.assert_text(llm["completion_token_ids"], block.text)
    assert final.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[llm["finish_reason"]]
    assert tokenizer.decode(llm["prompt_token_ids"]).startswith("system\nBe brief.")
    # token fidelity: streamed and not, same seed -> same tokens and the same answer
    assert unstreamed["llm"]["completion_token_ids"] == llm["completion_token_ids"]
    assert unstreamed["llm"]["completion_logprobs"] == pytest.approx(llm["completion_logprobs"], abs=1e-4)
    assert (plain.content[0].text, plain.stop_reason, plain.usage.output_tokens) == (
        block.text, final.stop_reason, final.usage.output_tokens)


def test_anthropic_sdk_messages_stream_with_tools(proxy, tokenizer):
    """A forced tool call streamed: a ``tool_use`` block whose ``input_json`` pieces join to its
    input, ``stop_reason`` ``tool_use``, the call the recorded tokens spell; then its
    ``tool_result`` streamed back in the next turn reaches the next prompt."""
    rid = uuid.uuid4().hex
    client = anthropic_client(proxy["url"], rid)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kinds, texts, pieces, forced = streamed_message(
        client, max_tokens=48, tools=[WEATHER], messages=ask, tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0.0})
    [use] = [b for b in forced.content if b.type == "tool_use"]
    assert (use.name, forced.stop_reason, kinds[-1]) == ("get_weather", "tool_use", "message_stop")
    assert use.input["city"] in ("Paris", "Oslo") and json.loads("".join(pieces)) == use.input and len(pieces) >= 2
    kinds2, _, _, result = streamed_message(
        client, max_tokens=12, tools=[WEATHER], extra_body={"temperature": 0.0},
        messages=ask + [{"role": "assistant", "content": [b.model_dump(include={"type", "id", "name", "input", "text"})
                                                          for b in forced.content]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny."}]}])
    assert kinds2[-1] == "message_stop" and result.content
    first, second = spans_of(proxy, rid, 2)
    assert_message_is_the_call(first, forced)
    assert_message_is_the_call(second, result)
    assert f'{{"name": "get_weather", "arguments": {{"city": "{use.input["city"]}"}}}}' in \
        tokenizer.decode(first["llm"]["completion_token_ids"])
    assert first["attributes"]["spanrl.tool_calls"] == '["get_weather"]'
    assert "<tool_response>\nSunny.\n</tool_response>" in tokenizer.decode(second["llm"]["prompt_token_ids"])


def test_messages_stream_without_kafka_never_sends_message_stop():
    """Kafka unreachable: the text streams, then Anthropic's ``event: error`` with
    ``kafka_unavailable`` instead of ``message_delta`` / ``message_stop``; the SDK raises it."""
    proc, url = start_service("spanrl.producers.proxy", "--kafka-bootstrap", f"{S.host}:1", "--reloader-url", "",
                              env={"SPANRL_KAFKA_SEND_TIMEOUT_S": "1"})
    try:
        texts = []
        with pytest.raises(anthropic.APIStatusError) as err:
            with anthropic_client(url, "r").messages.stream(
                    model=S.model_name, max_tokens=4, messages=[{"role": "user", "content": "Say hi."}]) as stream:
                for text in stream.text_stream:
                    texts.append(text)
        assert err.value.body["error"]["type"] == "kafka_unavailable" and texts
        raw = httpx.post(f"{url}/rollouts/r/attempts/0/v1/messages", timeout=30, json={
            "model": S.model_name, "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": "hi"}]}).text
        assert raw.startswith("event: message_start\n") and "message_stop" not in raw
        assert '"type":"error","error":{"type":"kafka_unavailable"' in raw
        assert httpx.get(url + "/status").json()["kafka_unavailable"] == 2
    finally:
        stop(proc)
