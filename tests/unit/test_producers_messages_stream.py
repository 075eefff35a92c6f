"""Streamed Anthropic Messages: vLLM's chat stream -> the Messages stream events
(spanrl.producers.messages.MessageEvents), exact event sequences, every event checked against the
``anthropic`` package's ``RawMessageStreamEvent`` and the whole stream read by the anthropic SDK's
own stream parser (``messages.stream``, ``messages.create(stream=True)``) over an
``httpx2.MockTransport`` (anthropic 2.14 sends with httpx2); then the proxy app itself with a
stand-in vLLM and Kafka. Fixtures: vLLM 0.32's chat streams (tests/fixtures/vllm_chat_stream_*.sse,
see test_producers_responses_stream.py); the other streams are built in vLLM's chunk format
(``vllm_stream``) for what the served model rarely does (text before a call, two calls, a stop string).
"""
from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import httpx2
import pytest
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from spanrl.producers import messages as M
from spanrl.producers.proxy import sse_events
from spanrl.producers.streaming import SseDecoder, StreamAccumulator

FIXTURES = Path(__file__).parent.parent / "fixtures"
ASK = {"model": "policy", "max_tokens": 48, "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}
PROMPT = [1, 9690, 198, 2]


def fixture_chunks(name: str) -> list[dict]:
    """The parsed chunks of a captured vLLM chat stream (without its ``[DONE]``)."""
    decoder, out = SseDecoder(), []
    for line in (FIXTURES / name).read_text().split("\n"):
        out += [json.loads(d) for d in decoder.feed(line) if d != "[DONE]"]
    return out


def call_delta(index: int, name: str | None = None, arguments: str | None = None) -> dict:
    """A chat ``tool_calls`` delta as vLLM's hermes parser streams it: the first of a call has
    its id, type and whole name, the others a piece of the arguments."""
    if name is not None:
        return {"id": f"chatcmpl-tool-{index}", "type": "function", "index": index, "function": {"name": name}}
    return {"index": index, "function": {"arguments": arguments}}


def vllm_stream(*steps, finish: str = "stop", stop_reason=None) -> list[dict]:
    """vLLM's chunks of one chat call: the role chunk with the prompt ids, one token chunk per
    step (a string: text; a dict: a tool-call delta; None: a token with no delta, such as the
    ``<tool_call>`` tag's), the end-of-sequence chunk with the finish reason, the usage chunk."""
    head = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "policy"}
    out = [{**head, "prompt_token_ids": PROMPT,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    for i, step in enumerate(steps):
        delta = {"content": step} if isinstance(step, str) else {"content": None, "tool_calls": [step]} if step else {}
        out.append({**head, "choices": [{"index": 0, "delta": delta, "token_ids": [100 + i], "finish_reason": None,
                                         "logprobs": {"content": [{"token": "t", "logprob": -0.5}]}}]})
    out.append({**head, "choices": [{"index": 0, "delta": {"content": ""}, "token_ids": [2], "finish_reason": finish,
                                     "stop_reason": stop_reason,
                                     "logprobs": {"content": [{"token": "<|im_end|>", "logprob": -0.1}]}}]})
    n = len(steps) + 1
    return out + [{**head, "choices": [], "usage": {"prompt_tokens": len(PROMPT), "completion_tokens": n,
                                                     "total_tokens": len(PROMPT) + n}}]


def translate(chunks: list[dict]) -> tuple[list[dict], dict]:
    """Every Messages event of a chat stream (each checked against anthropic's
    ``RawMessageStreamEvent``), and the assembled chat answer (what the proxy records)."""
    events, acc, out = M.MessageEvents(), StreamAccumulator("chat.completions"), []
    for chunk in chunks:
        acc.add(chunk)
        out += events.chunk(chunk)
    out += events.finish(acc.response())
    for event in out:
        if event["type"] != "ping":  # not in the union; the SDK skips pings
            TypeAdapter(RawMessageStreamEvent).validate_python(event)
    return out, acc.response()


def kinds(events: list[dict]) -> list[tuple]:
    """(type, block index, delta text or partial JSON) of each event."""
    out = []
    for e in events:
        delta = e.get("delta") or {}
        out.append((e["type"], e.get("index"), delta.get("text", delta.get("partial_json"))))
    return out


def sdk_client(sse: bytes, seen: list | None = None) -> anthropic.Anthropic:
    """The real anthropic client, its HTTP answered with ``sse`` (requests kept in ``seen``)."""
    def answer(request: httpx2.Request) -> httpx2.Response:
        if seen is not None:
            seen.append(json.loads(request.content))
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=sse)
    return anthropic.Anthropic(api_key="unused", base_url="http://proxy", max_retries=0,
                               http_client=httpx2.Client(transport=httpx2.MockTransport(answer)))


def sdk_final(sse: bytes) -> tuple[list[str], anthropic.types.Message]:
    """What ``client.messages.stream(...)`` gives for ``sse``: its event types and ``get_final_message()``."""
    with sdk_client(sse).messages.stream(**ASK) as stream:
        seen = [e.type for e in stream]
        return seen, stream.get_final_message()


def as_answer(message) -> dict:
    """A message the SDK parsed, in :func:`messages.message_response`'s shape."""
    return {"id": message.id, "type": message.type, "role": message.role, "model": message.model,
            "content": [b.model_dump(include={"type", "text", "id", "name", "input"}) for b in message.content],
            "stop_reason": message.stop_reason, "stop_sequence": message.stop_sequence,
            "usage": {"input_tokens": message.usage.input_tokens, "output_tokens": message.usage.output_tokens}}


START = {"type": "message_start", "message": {
    "id": "chatcmpl-x", "type": "message", "role": "assistant", "model": "policy", "content": [],
    "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 4, "output_tokens": 0}}}


def test_text_only_real_stream():
    events, answer = translate(fixture_chunks("vllm_chat_stream_text.sse"))
    assert kinds(events) == [("message_start", None, None), ("ping", None, None), ("content_block_start", 0, None)] + [
        ("content_block_delta", 0, t) for t in ["The", " answer", " is", " ", "4", "."]] + [
        ("content_block_stop", 0, None), ("message_delta", None, None), ("message_stop", None, None)]
    assert events[0]["message"]["usage"] == {"input_tokens": 30, "output_tokens": 0}  # the prompt's 30 ids
    assert events[2]["content_block"] == {"type": "text", "text": ""}
    assert events[-2] == {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                          "usage": {"input_tokens": 30, "output_tokens": 7}}
    seen, final = sdk_final(sse_events(events))
    assert seen[-1] == "message_stop" and "text" in seen
    assert as_answer(final) == M.message_response(answer) == {
        "id": "chatcmpl-b1a6ce698207fc78", "type": "message", "role": "assistant", "model": "policy",
        "content": [{"type": "text", "text": "The answer is 4."}], "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": 30, "output_tokens": 7}}


def test_forced_tool_call_real_stream():
    """A named ``tool_choice`` (vLLM's finish reason ``stop``): a ``tool_use`` block whose input
    streams as the hermes parser read it; ``stop_reason`` ``tool_use`` as non-streamed."""
    events, answer = translate(fixture_chunks("vllm_chat_stream_tool_call.sse"))
    assert kinds(events) == [("message_start", None, None), ("ping", None, None), ("content_block_start", 0, None)] + [
        ("content_block_delta", 0, p) for p in ['{"', "city", '":', ' "', "Paris", '"}']] + [
        ("content_block_stop", 0, None), ("message_delta", None, None), ("message_stop", None, None)]
    assert events[2]["content_block"] == {"type": "tool_use", "id": "chatcmpl-tool-a9f8c8853e1c6b37",
                                          "name": "get_weather", "input": {}}
    assert events[-2]["delta"]["stop_reason"] == "tool_use" and events[-2]["usage"]["output_tokens"] == 32
    seen, final = sdk_final(sse_events(events))
    assert "input_json" in seen and seen[-1] == "message_stop"
    assert as_answer(final) == M.message_response(answer)
    assert final.content[0].input == {"city": "Paris"} and final.stop_reason == "tool_use"


def test_text_then_a_tool_call():
    events, answer = translate(vllm_stream(
        "Let me", " check.", None, call_delta(0, "get_weather"), call_delta(0, arguments='{"city": '),
        call_delta(0, arguments='"Oslo"}'), None, finish="tool_calls"))
    assert events == [
        START, {"type": "ping"},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Let me"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " check."}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1, "content_block": {
            "type": "tool_use", "id": "chatcmpl-tool-0", "name": "get_weather", "input": {}}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '{"city": '}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '"Oslo"}'}},
        {"type": "content_block_stop", "index": 1},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
         "usage": {"input_tokens": 4, "output_tokens": 8}},
        {"type": "message_stop"}]
    _, final = sdk_final(sse_events(events))
    assert as_answer(final) == M.message_response(answer)
    assert [(b.type, getattr(b, "text", None), getattr(b, "input", None)) for b in final.content] == [
        ("text", "Let me check.", None), ("tool_use", None, {"city": "Oslo"})]


def test_two_tool_calls():
    events, answer = translate(vllm_stream(
        call_delta(0, "get_weather"), call_delta(0, arguments='{"city": "Paris"}'),
        call_delta(1, "get_time"), call_delta(1, arguments='{"zone"'), call_delta(1, arguments=': "CET"}'),
        finish="tool_calls"))
    assert events[2:-2] == [
        {"type": "content_block_start", "index": 0, "content_block": {
            "type": "tool_use", "id": "chatcmpl-tool-0", "name": "get_weather", "input": {}}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta",
                                                              "partial_json": '{"city": "Paris"}'}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1, "content_block": {
            "type": "tool_use", "id": "chatcmpl-tool-1", "name": "get_time", "input": {}}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '{"zone"'}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": ': "CET"}'}},
        {"type": "content_block_stop", "index": 1}]
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    _, final = sdk_final(sse_events(events))
    assert as_answer(final) == M.message_response(answer)
    assert [(b.id, b.name, b.input) for b in final.content] == [
        ("chatcmpl-tool-0", "get_weather", {"city": "Paris"}), ("chatcmpl-tool-1", "get_time", {"zone": "CET"})]


def test_stream_ending_by_max_tokens():
    """vLLM's real text stream cut after " answer" (finish reason ``length``): ``max_tokens``."""
    chunks = fixture_chunks("vllm_chat_stream_text.sse")[:3]  # role, "The", " answer"
    cut = {"id": chunks[0]["id"], "model": "policy", "choices": [{"index": 0, "delta": {"content": " is"},
                                                                   "token_ids": [314], "finish_reason": "length"}]}
    usage = {"id": chunks[0]["id"], "model": "policy", "choices": [],
             "usage": {"prompt_tokens": 30, "completion_tokens": 3, "total_tokens": 33}}
    events, answer = translate(chunks + [cut, usage])
    assert kinds(events)[2:] == [("content_block_start", 0, None), ("content_block_delta", 0, "The"),
                                 ("content_block_delta", 0, " answer"), ("content_block_delta", 0, " is"),
                                 ("content_block_stop", 0, None), ("message_delta", None, None),
                                 ("message_stop", None, None)]
    assert events[-2] == {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                          "usage": {"input_tokens": 30, "output_tokens": 3}}
    _, final = sdk_final(sse_events(events))
    assert (final.content[0].text, final.stop_reason) == ("The answer is", "max_tokens")


def test_tool_call_cut_by_max_tokens_keeps_its_partial_input():
    events, answer = translate(vllm_stream(call_delta(0, "get_weather"), call_delta(0, arguments='{"city": "Par'),
                                           finish="length"))
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
    _, final = sdk_final(sse_events(events))
    # the SDK reads the partial JSON as far as it goes (an unfinished string is left out)
    assert (final.content[0].type, final.content[0].input, final.stop_reason) == ("tool_use", {}, "max_tokens")


def test_stop_sequence():
    events, answer = translate(vllm_stream("Hi", " Ada", finish="stop", stop_reason="\n\n"))
    assert events[2:] == [
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": " Ada"}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "stop_sequence", "stop_sequence": "\n\n"},
         "usage": {"input_tokens": 4, "output_tokens": 3}},
        {"type": "message_stop"}]
    _, final = sdk_final(sse_events(events))
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "\n\n")


def test_nothing_generated_is_one_empty_text_block():
    events, answer = translate(vllm_stream())
    assert events == [START, {"type": "ping"},
                      {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                      {"type": "content_block_stop", "index": 0},
                      {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                       "usage": {"input_tokens": 4, "output_tokens": 1}},
                      {"type": "message_stop"}]
    assert as_answer(sdk_final(sse_events(events))[1]) == M.message_response(answer)


def test_finish_without_any_chunk_still_starts_the_message():
    answer = {"id": "chatcmpl-e", "model": "policy", "prompt_token_ids": PROMPT, "usage": None,
              "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": None}}]}
    events = M.MessageEvents().finish(answer)
    assert [e["type"] for e in events] == ["message_start", "ping", "content_block_start", "content_block_stop",
                                           "message_delta", "message_stop"]
    assert events[0]["message"]["id"] == "chatcmpl-e" and events[0]["message"]["usage"]["input_tokens"] == 4


def test_malformed_arguments_stop_at_the_last_json_prefix():
    """Leading whitespace waits for the piece after it; once the arguments stop being an
    object's beginning nothing more of them is sent (the SDK would raise on it), and the
    stop reason is the non-streamed one (no call with an object's arguments: ``end_turn``)."""
    events, answer = translate(vllm_stream(
        call_delta(0, "f"), call_delta(0, arguments=" "), call_delta(0, arguments='{"a"'),
        call_delta(0, arguments=" x"), call_delta(0, arguments="}"), finish="tool_calls"))
    assert [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"] == [' {"a"']
    assert events[-2]["delta"]["stop_reason"] == "end_turn"
    assert M.message_response(answer)["content"] == [{"type": "text", "text": '{"name": "f", "arguments": " {\\"a\\" x}"}'}]
    _, final = sdk_final(sse_events(events))
    assert (final.content[0].type, final.content[0].input, final.stop_reason) == ("tool_use", {}, "end_turn")


@pytest.mark.parametrize("text, prefix", [
    ("{", True), ('{"ci', True), ('{"city": "Pa', True), ('{"city": "Paris"}', True), (' {"a": [1, ', True),
    ("", False), ("  ", False), ("[1", False), ('"x', False), ('{"a" x', False), ("1", False)])
def test_object_prefix(text, prefix):
    assert M.object_prefix(text) is prefix


def test_error_event_is_raised_by_the_sdk():
    err = M.MessageEvents.error("kafka_unavailable", "Kafka did not acknowledge")
    assert err == {"type": "error", "error": {"type": "kafka_unavailable", "message": "Kafka did not acknowledge"}}
    head = translate(fixture_chunks("vllm_chat_stream_text.sse"))[0][:4]  # start, ping, block start, "The"
    sse = sse_events(head + [err])
    assert sse.endswith(b'event: error\ndata: {"type":"error","error":{"type":"kafka_unavailable",'
                        b'"message":"Kafka did not acknowledge"}}\n\n')
    texts = []
    with pytest.raises(anthropic.APIStatusError) as exc:
        with sdk_client(sse).messages.stream(**ASK) as stream:
            for text in stream.text_stream:
                texts.append(text)
    assert texts == ["The"] and exc.value.body["error"]["type"] == "kafka_unavailable"


def test_create_stream_true_gives_the_raw_events():
    events, _ = translate(fixture_chunks("vllm_chat_stream_tool_call.sse"))
    seen: list[dict] = []
    raw = list(sdk_client(sse_events(events), seen).messages.create(stream=True, **ASK))
    assert seen[0]["stream"] is True
    assert [e.type for e in raw] == [e["type"] for e in events if e["type"] != "ping"]
    assert raw[1].content_block.name == "get_weather" and raw[-2].delta.stop_reason == "tool_use"


# ------------------------------------------------------------------ through the proxy app
class AckingSink:
    """Stands in for the proxy's Kafka sink: acknowledges (or, ``down``, refuses) every record,
    keeping ``(topic name, key, value)``."""

    def __init__(self, topics, down: bool = False):
        self.topics, self.down, self.started, self.sent = topics, down, True, []

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def produce_raw(self, items) -> None:
        from spanrl.producers.kafka import KafkaUnavailable

        if self.down:
            raise KafkaUnavailable("no ack")
        self.sent += [(t.name, k, v) for t, k, v in items]


def proxy_stream(fixture: str, body: dict, down: bool = False) -> tuple[bytes, list[dict], AckingSink]:
    """A streamed ``/v1/messages`` call through the proxy app, vLLM answering with the captured
    ``fixture`` stream: the bytes the client got, the bodies vLLM was sent, the sink."""
    from fastapi.testclient import TestClient

    from spanrl.producers.kafka import Topics
    from spanrl.producers.proxy import create_app

    upstream: list[dict] = []

    def vllm(request: httpx.Request) -> httpx.Response:
        upstream.append(json.loads(request.content))
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=(FIXTURES / fixture).read_bytes())
    sink = AckingSink(Topics(), down)
    app = create_app(sink, "http://vllm", "policy", claim_client=object(), payload_bucket="b")
    with TestClient(app) as client:
        app.state.client = httpx.AsyncClient(base_url="http://vllm", transport=httpx.MockTransport(vllm))
        r = client.post("/rollouts/r1/attempts/0/v1/messages", json=body)
    assert (r.status_code, r.headers["content-type"]) == (200, "text/event-stream; charset=utf-8")
    return r.content, upstream, sink


def test_proxy_streams_messages_and_records_the_call():
    from spanrl.schemas import codec

    body = {**ASK, "stream": True, "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "get_weather"}}
    sse, upstream, sink = proxy_stream("vllm_chat_stream_tool_call.sse", body)
    [sent] = upstream
    assert (sent["stream"], sent["return_token_ids"], sent["logprobs"], sent["stream_options"]) == (
        True, True, True, {"include_usage": True})
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    [(topic, key, value)] = sink.sent
    span = codec.decode("span", value)
    assert (topic, key, span["attributes"]["spanrl.api"], span["attributes"]["spanrl.streamed"]) == (
        "spans", "r1", "anthropic.messages", "true")
    assert span["llm"]["completion_token_ids"][-6:] == [9617, 19324, 79, 4350, 46, 2]  # </tool_call><|im_end|>
    assert len(span["llm"]["completion_token_ids"]) == 32 and len(span["llm"]["prompt_token_ids"]) == 182
    assert sse.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    seen, final = sdk_final(sse)
    assert (final.content[0].input, final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == (
        {"city": "Paris"}, "tool_use", 182, 32)
    assert final.id == span["attributes"]["gen_ai.response.id"] == "chatcmpl-897db024ec8a8c0f~spanrl~r1~0"


def test_proxy_stream_without_the_ack_ends_with_an_error_event():
    sse, _, sink = proxy_stream("vllm_chat_stream_text.sse", {**ASK, "stream": True}, down=True)
    assert sink.sent == [] and b"message_stop" not in sse and b"message_delta" not in sse
    assert sse.endswith(b'event: error\ndata: {"type":"error","error":{"type":"kafka_unavailable","message":"no ack"}}\n\n')
    with pytest.raises(anthropic.APIStatusError) as exc:
        sdk_final(sse)
    assert exc.value.body["error"]["type"] == "kafka_unavailable"
