"""Streamed Responses: vLLM's chat stream -> the Responses API's events
(spanrl.producers.responses.ResponseEvents), exact values. Fixtures: vLLM 0.32's chat streams as the
proxy asks for them (``return_token_ids``, ``logprobs``, usage), ``vllm_chat_stream_text.sse``
from the stack's vLLM, ``vllm_chat_stream_tool_call.sse`` from one with
``--tool-call-parser hermes`` and a named ``tool_choice``."""
from __future__ import annotations

import json
from pathlib import Path

from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from spanrl.producers import responses as R
from spanrl.producers.streaming import SseDecoder, StreamAccumulator

FIXTURES = Path(__file__).parent.parent / "fixtures"
WEATHER_TOOL = {"name": "get_weather", "type": "function", "description": "Weather of a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def stream_chunks(name: str) -> list[dict]:
    """The parsed chunks of a captured vLLM chat stream (without its ``[DONE]``)."""
    decoder, out = SseDecoder(), []
    for line in (FIXTURES / name).read_text().split("\n"):
        out += [json.loads(d) for d in decoder.feed(line) if d != "[DONE]"]
    return out


def stream_events(name: str, body: dict) -> tuple[list[dict], dict]:
    """Every Responses event of a captured stream (each checked against the openai package's
    ``ResponseStreamEvent`` union), and the non-streamed Response of the same answer."""
    chat_body, acc = R.chat_request(body), StreamAccumulator("chat.completions")
    events = R.ResponseEvents(body, chat_body)
    out = []
    for chunk in stream_chunks(name):
        acc.add(chunk)
        out += events.chunk(chunk)
    out += events.finish(acc.response())
    for event in out:
        TypeAdapter(ResponseStreamEvent).validate_python(event)
    return out, R.response_object(body, chat_body, acc.response())


STREAM_TEXT = {"model": "policy", "instructions": "Be brief.", "input": "What is 2+2? Answer with a number only.",
               "max_output_tokens": 32, "temperature": 0, "include": [R.LOGPROBS_INCLUDE]}


def test_stream_of_text():
    events, whole = stream_events("vllm_chat_stream_text.sse", STREAM_TEXT)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    mid, where = "msg_b1a6ce698207fc78", {"item_id": "msg_b1a6ce698207fc78", "output_index": 0}
    assert [(e["type"], e.get("delta")) for e in events] == [
        ("response.created", None), ("response.in_progress", None), ("response.output_item.added", None),
        ("response.content_part.added", None)] + [
        ("response.output_text.delta", d) for d in ["The", " answer", " is", " ", "4", "."]] + [
        ("response.output_text.done", None), ("response.content_part.done", None),
        ("response.output_item.done", None), ("response.completed", None)]
    created = events[0]["response"]
    assert (created["id"], created["status"], created["output"], created["usage"]) == (
        "resp_b1a6ce698207fc78", "in_progress", [], None)
    assert events[2]["item"] == {"type": "message", "id": mid, "role": "assistant", "status": "in_progress",
                                 "content": []}
    assert events[4] == {"type": "response.output_text.delta", "sequence_number": 4, **where, "content_index": 0,
                         "delta": "The", "logprobs": [{"token": "The", "logprob": -1.8846266269683838,
                                                       "top_logprobs": []}]}
    done = events[10]
    assert (done["text"], len(done["logprobs"])) == ("The answer is 4.", 7)  # 6 text tokens + <|im_end|>
    final = events[-1]["response"]
    assert (final["status"], final["usage"]["input_tokens"], final["usage"]["output_tokens"]) == ("completed", 30, 7)
    assert final == whole  # the same Response as the non-streamed answer's


def test_stream_of_a_tool_call():
    body = {"model": "policy", "instructions": "Be brief.", "input": "What is the weather in Paris?",
            "max_output_tokens": 48, "temperature": 0, "tools": [WEATHER_TOOL],
            "tool_choice": {"type": "function", "name": "get_weather"}}
    events, whole = stream_events("vllm_chat_stream_tool_call.sse", body)
    fid = "fc_897db024ec8a8c0f_0"
    assert [(e["type"], e.get("delta")) for e in events] == [
        ("response.created", None), ("response.in_progress", None), ("response.output_item.added", None)] + [
        ("response.function_call_arguments.delta", d) for d in ['{"', "city", '":', ' "', "Paris", '"}']] + [
        ("response.function_call_arguments.done", None), ("response.output_item.done", None),
        ("response.completed", None)]
    assert events[2]["item"] == {"type": "function_call", "id": fid, "call_id": "chatcmpl-tool-a9f8c8853e1c6b37",
                                 "name": "get_weather", "arguments": "", "status": "in_progress"}
    assert events[9] == {"type": "response.function_call_arguments.done", "sequence_number": 9, "item_id": fid,
                         "output_index": 0, "name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert events[-1]["response"] == whole and whole["output"] == [events[10]["item"]]


def test_stream_cut_at_max_tokens_ends_incomplete():
    chunks = stream_chunks("vllm_chat_stream_text.sse")
    events = R.ResponseEvents({"model": "policy", "input": "x"}, {"model": "policy"})
    for chunk in chunks[:3]:  # role, "The", " answer"
        events.chunk(chunk)
    cut = {"id": chunks[0]["id"], "created": 1, "model": "policy",
           "usage": {"prompt_tokens": 30, "completion_tokens": 2, "total_tokens": 32},
           "choices": [{"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "The answer"}}]}
    closing = events.finish(cut)
    assert [e["type"] for e in closing] == ["response.output_text.done", "response.content_part.done",
                                            "response.output_item.done", "response.incomplete"]
    assert closing[0]["logprobs"] == [] and closing[2]["item"]["status"] == "incomplete"
    assert (closing[-1]["response"]["status"], closing[-1]["response"]["incomplete_details"]) == (
        "incomplete", {"reason": "max_output_tokens"})


def test_stream_without_text_or_calls_gives_an_empty_message():
    events = R.ResponseEvents({"model": "policy", "input": "x"}, {"model": "policy"})
    answer = {"id": "chatcmpl-e", "created": 1, "model": "policy", "usage": None,
              "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": None}}]}
    out = events.finish(answer)
    assert [e["type"] for e in out] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert out[-1]["response"]["output"] == R.response_object({"model": "policy", "input": "x"}, {}, answer)["output"]


def test_stream_error_event_continues_the_sequence():
    events = R.ResponseEvents({"model": "policy", "input": "x"}, {"model": "policy"})
    first = events.chunk(stream_chunks("vllm_chat_stream_text.sse")[0])
    err = events.error("kafka_unavailable", "Kafka did not acknowledge")
    assert [e["sequence_number"] for e in first] == [0, 1]
    assert err == {"type": "error", "sequence_number": 2, "code": "kafka_unavailable",
                   "message": "Kafka did not acknowledge", "param": None}
    TypeAdapter(ResponseStreamEvent).validate_python(err)
