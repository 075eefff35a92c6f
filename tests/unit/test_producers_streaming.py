"""Streamed calls (spanrl.producers.streaming): SSE decoding, chunk accumulation into the LlmCall
records a non-streamed answer gives, what the client is sent, and the relay's endings.

Fixtures are real vLLM 0.32 streams (SmolLM2-135M-Instruct served as "policy"), captured with
the requests named below, next to the non-streamed answers of the same requests and seed."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from spanrl.producers.proxy import (
    BadRequest, MissingTokenIds, check_n, check_stream, llm_call_from_response, span_attributes, strip_response,
)
from spanrl.producers.streaming import (
    CHAT, CLIENT_DISCONNECTED, COMPLETIONS, VLLM_STREAM_FAILED, RecordFailed, Relay, SseDecoder,
    StreamAccumulator, error_event, relay, sse_event, strip_chunk, upstream_stream_body,
)

FIXTURES = Path(__file__).parent.parent / "fixtures"
SAY_HI = [{"role": "user", "content": "Say hi."}]
# vllm_chat_stream.sse (stream, include_usage) and vllm_chat_seed7.json (not streamed)
CHAT_REQ = {"model": "policy", "messages": SAY_HI, "max_tokens": 8, "temperature": 0.7, "seed": 7}
# vllm_chat_stream_n2.sse (no include_usage)
CHAT_N2_REQ = {**CHAT_REQ, "max_tokens": 3, "n": 2, "stream": True}
# vllm_completion_stream_n2.sse (include_usage) and vllm_completion_n2_seed7.json
COMPL_N2_REQ = {"model": "policy", "prompt": "2+2=", "max_tokens": 3, "temperature": 0.7, "seed": 7, "n": 2}
SAY_HI_PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
                 19712, 8182, 2, 198, 1, 4093, 198, 36218, 15876, 30, 2, 198, 1, 520, 9531, 198]


def chunks(name: str) -> list[dict]:
    """The JSON chunks of a captured stream, decoded with :class:`SseDecoder` ([DONE] last)."""
    dec, out = SseDecoder(), []
    for line in (FIXTURES / name).read_text().split("\n"):
        out += dec.feed(line)
    assert out[-1] == "[DONE]" and dec.close() == []
    return [json.loads(d) for d in out[:-1]]


def assembled(endpoint: str, name: str) -> dict:
    acc = StreamAccumulator(endpoint)
    for c in chunks(name):
        acc.add(c)
    assert acc.finished()
    return acc.response()


# ------------------------------------------------------------------ SSE
def test_sse_decoder_events():
    dec = SseDecoder()
    lines = [": comment", "data: {\"a\": 1}", "", "", "event: x", "data:first", "data:  second", "id: 3", "",
             "data: [DONE]", ""]
    assert [e for line in lines for e in dec.feed(line)] == ['{"a": 1}', "first\n second", "[DONE]"]
    assert dec.feed("data: cut") == [] and dec.close() == ["cut"] and dec.close() == []


def test_sse_event_format():
    assert sse_event("[DONE]") == b"data: [DONE]\n\n"
    assert sse_event({"a": "é"}, event="e") == 'event: e\ndata: {"a":"é"}\n\n'.encode()
    assert sse_event("x\ny") == b"data: x\ndata: y\n\n"
    assert json.loads(error_event("kafka_unavailable", "no ack", 503)[6:]) == {
        "error": {"message": "no ack", "type": "kafka_unavailable", "code": 503}}


# ------------------------------------------------------------------ accumulator
def test_streamed_chat_gives_the_non_streamed_call():
    """Same request and seed, streamed and not: the same token ids and log-probs (here equal to
    the last bit; the integration test allows 1e-4 for batching)."""
    streamed = llm_call_from_response(CHAT, CHAT_REQ, assembled(CHAT, "vllm_chat_stream.sse"), 2)
    plain = llm_call_from_response(CHAT, CHAT_REQ, json.loads((FIXTURES / "vllm_chat_seed7.json").read_text()), 2)
    assert streamed["prompt_token_ids"] == SAY_HI_PROMPT
    assert streamed["completion_token_ids"] == [19556, 17, 339, 5248, 1535, 288, 4237, 346]
    assert streamed["completion_logprobs"][:3] == [-2.1381871700286865, -1.1135174036026, -0.9176225066184998]
    assert {k: v for k, v in streamed.items() if k != "request_id"} == {k: v for k, v in plain.items() if k != "request_id"}
    assert streamed["request_id"] == "chatcmpl-a47ed4809741bab2"
    assert (streamed["finish_reason"], streamed["max_tokens"], streamed["policy_version"]) == ("length", 8, 2)


def test_streamed_chat_response_shape():
    r = assembled(CHAT, "vllm_chat_stream.sse")
    [c] = r["choices"]
    assert c["message"] == {"role": "assistant", "content": "Hello! I'm here to assist you"}
    assert (r["id"], r["object"], r["model"], r["usage"]) == (
        "chatcmpl-a47ed4809741bab2", "chat.completion", "policy",
        {"prompt_tokens": 33, "total_tokens": 41, "completion_tokens": 8})
    assert [e["token"] for e in c["logprobs"]["content"]] == ["Hello", "!", " I", "'m", " here", " to", " assist", " you"]


def test_streamed_chat_n2_is_two_calls_of_one_prompt():
    r = assembled(CHAT, "vllm_chat_stream_n2.sse")
    calls = [llm_call_from_response(CHAT, CHAT_N2_REQ, r, 0, i) for i in range(2)]
    assert [c["prompt_token_ids"] for c in calls] == [SAY_HI_PROMPT, SAY_HI_PROMPT]
    assert [c["completion_token_ids"] for c in calls] == [[19556, 17, 339], [19556, 665, 28]]
    assert [c["completion_logprobs"] for c in calls] == [
        [-2.1381871700286865, -1.1135141849517822, -0.917621374130249],
        [-2.1381871700286865, -0.8575900197029114, -0.9730546474456787]]
    assert [c["finish_reason"] for c in calls] == ["length", "length"] and r["usage"] is None
    assert [c["message"]["content"] for c in r["choices"]] == ["Hello! I", "Hello there,"]
    with pytest.raises(MissingTokenIds):
        llm_call_from_response(CHAT, CHAT_N2_REQ, r, 0, 2)


def test_streamed_completions_n2_equal_the_non_streamed_answer():
    r = assembled(COMPLETIONS, "vllm_completion_stream_n2.sse")
    plain = json.loads((FIXTURES / "vllm_completion_n2_seed7.json").read_text())
    for i in range(2):
        s, p = (llm_call_from_response(COMPLETIONS, COMPL_N2_REQ, x, 1, i) for x in (r, plain))
        assert {**s, "request_id": ""} == {**p, "request_id": ""}
    assert [c["token_ids"] for c in r["choices"]] == [[35, 25, 198], [34, 27, 36]]
    assert [c["prompt_token_ids"] for c in r["choices"]] == [[34, 27, 34, 45]] * 2
    assert [c["text"] for c in r["choices"]] == ["3)\n", "2+4"]
    assert r["choices"][1]["logprobs"]["token_logprobs"] == [-2.3907079696655273, -2.013737201690674, -1.653696060180664]
    assert r["choices"][1]["logprobs"]["text_offset"] == [0, 1, 2]
    assert r["usage"] == {"prompt_tokens": 4, "total_tokens": 10, "completion_tokens": 6}


def test_text_without_token_ids_is_never_recorded():
    """A chunk with text but no token ids (vLLM not asked for them): the call has no token ids,
    even though ids and log-probs of the other chunks would line up."""
    cs = chunks("vllm_chat_stream.sse")
    cs[2]["choices"][0]["token_ids"] = None
    cs[2]["choices"][0]["logprobs"] = None
    acc = StreamAccumulator(CHAT)
    for c in cs:
        acc.add(c)
    assert acc.response()["choices"][0]["token_ids"] is None
    with pytest.raises(MissingTokenIds):
        llm_call_from_response(CHAT, CHAT_REQ, acc.response(), 0)


def test_eos_chunk_without_text_keeps_its_token():
    acc = StreamAccumulator(CHAT)
    for delta, ids, lp, fin in [({"role": "assistant", "content": ""}, None, None, None),
                                ({"content": "Yes"}, [10539], -0.5, None), ({"content": ""}, [2], -0.25, "stop")]:
        acc.add({"id": "x", "choices": [{"index": 0, "delta": delta, "token_ids": ids, "finish_reason": fin,
                                         "logprobs": None if lp is None else {"content": [{"logprob": lp}]}}]})
    call = llm_call_from_response(CHAT, {"model": "policy"}, {**acc.response(), "prompt_token_ids": [1]}, 0)
    assert (call["completion_token_ids"], call["completion_logprobs"], call["finish_reason"]) == (
        [10539, 2], [-0.5, -0.25], "stop")


def test_streamed_tool_call_deltas_merge():
    acc = StreamAccumulator(CHAT)
    for tc in [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_", "arguments": ""}},
               {"index": 0, "function": {"name": "weather", "arguments": '{"city": '}},
               {"index": 0, "function": {"arguments": '"Paris"}'}},
               {"index": 1, "id": "call_2", "function": {"name": "noop", "arguments": "{}"}}]:
        acc.add({"choices": [{"index": 0, "delta": {"tool_calls": [tc]}, "token_ids": [5]}]})
    assert acc.response()["choices"][0]["message"] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "noop", "arguments": "{}"}}]}
    assert not acc.finished()


@pytest.mark.parametrize("bad", [[], {"choices": {}}, {"choices": [{"delta": {}}]}, {"choices": ["x"]}])
def test_malformed_chunk_is_refused(bad):
    with pytest.raises(ValueError):
        StreamAccumulator(CHAT).add(bad)


# ------------------------------------------------------------------ what is sent
def test_upstream_stream_body_always_asks_usage():
    assert upstream_stream_body({"stream": True}) == {"stream": True, "stream_options": {"include_usage": True}}
    body = {"stream": True, "stream_options": {"include_usage": False, "continuous_usage_stats": True}}
    assert upstream_stream_body(body)["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert body["stream_options"]["include_usage"] is False  # the client's body is not changed


def test_strip_chunk_removes_what_the_client_did_not_ask():
    cs = chunks("vllm_chat_stream.sse")
    plain = {"model": "policy", "messages": SAY_HI, "stream": True}

    def strip(client):
        return [strip_chunk(client, c, lambda x: strip_response(CHAT, client, x)) for c in cs]

    out = strip(plain)
    assert out[-1] is None  # the usage-only chunk
    assert out[0]["prompt_token_ids"] is None and cs[0]["prompt_token_ids"] == SAY_HI_PROMPT
    assert all(c["choices"][0]["token_ids"] is None and c["choices"][0]["logprobs"] is None for c in out[1:-1])
    assert [c["choices"][0]["delta"] for c in out[1:3]] == [{"content": "Hello"}, {"content": "!"}]
    asked = strip({**plain, "logprobs": True, "return_token_ids": True, "stream_options": {"include_usage": True}})
    assert asked == cs
    usage = strip({**plain, "stream_options": {"include_usage": True}})
    assert usage[-1]["usage"] == {"prompt_tokens": 33, "total_tokens": 41, "completion_tokens": 8}
    # continuous usage the client did not ask for comes off every chunk
    with_usage = {**cs[1], "usage": {"prompt_tokens": 33, "completion_tokens": 1, "total_tokens": 34}}
    assert "usage" not in strip_chunk(plain, with_usage, lambda x: x)


# ------------------------------------------------------------------ n
def test_check_n():
    assert [check_n(b) for b in ({}, {"n": 1}, {"n": 3, "temperature": 0.7}, {"n": 2})] == [1, 1, 3, 2]
    for body, reason in [({"n": 0}, "invalid_request"), ({"n": True}, "invalid_request"),
                         ({"n": "2"}, "invalid_request"), ({"n": 2.0}, "invalid_request"),
                         ({"n": 2, "temperature": 0}, "n_requires_sampling")]:
        with pytest.raises(BadRequest) as err:
            check_n(body)
        assert (err.value.status, err.value.reason) == (400, reason), body


def test_check_stream():
    assert [check_stream(b) for b in ({}, {"stream": None}, {"stream": False}, {"stream": True},
                                      {"stream": True, "stream_options": {"include_usage": True}})] == [
        False, False, False, True, True]
    for body in ({"stream": "true"}, {"stream": 1}, {"stream": True, "stream_options": "usage"},
                 {"stream": True, "stream_options": [True]}):
        with pytest.raises(BadRequest) as err:
            check_stream(body)
        assert (err.value.status, err.value.reason) == (400, "invalid_request"), body


def test_span_attributes_per_choice():
    r = json.loads((FIXTURES / "vllm_completion_n2_seed7.json").read_text())
    r["choices"][1]["finish_reason"] = "stop"
    attrs = [span_attributes(COMPLETIONS, COMPL_N2_REQ, r, None, i) for i in range(2)]
    assert [(a["gen_ai.response.finish_reasons"], a["gen_ai.usage.output_tokens"], a["gen_ai.usage.input_tokens"],
             a["spanrl.choice_index"], a["gen_ai.request.choice.count"]) for a in attrs] == [
        ('["length"]', "3", "4", "0", "2"), ('["stop"]', "3", "4", "1", "2")]
    one = span_attributes(CHAT, CHAT_REQ, json.loads((FIXTURES / "vllm_chat_seed7.json").read_text()), "a")
    assert (one["gen_ai.usage.output_tokens"], one["spanrl.agent_name"]) == ("8", "a")
    assert "spanrl.choice_index" not in one and "spanrl.streamed" not in one


# ------------------------------------------------------------------ relay
class Upstream:
    """What :func:`relay` is given, recording what it did."""

    def __init__(self, lines, fail_record: bool = False, raise_at: int | None = None):
        self._lines, self.fail_record, self.raise_at = lines, fail_record, raise_at
        self.recorded, self.interrupted, self.closed, self.lost = [], [], 0, []

    async def lines(self):
        for i, line in enumerate(self._lines):
            if i == self.raise_at:
                raise ConnectionResetError("vLLM went away")
            yield line

    async def record(self, response):
        if self.fail_record:
            raise RecordFailed(503, "kafka_unavailable", "no ack")
        self.recorded.append(response)
        return b"data: [DONE]\n\n"

    async def interrupt(self, reason, detail, partial):
        self.interrupted.append((reason, partial["choices"][0]["token_ids"] if partial["choices"] else None))

    async def close(self):
        self.closed += 1

    def relay(self):
        return relay(Relay(CHAT, self.lines(), lambda c: sse_event(c["id"]), self.record, self.interrupt,
                           self.close, self.lost.append), (ConnectionResetError,))


def stream_lines(name: str = "vllm_chat_stream.sse") -> list[str]:
    return (FIXTURES / name).read_text().split("\n")


def collect(up: Upstream, take: int | None = None) -> list[bytes]:
    async def go():
        out, gen = [], up.relay()
        async for b in gen:
            out.append(b)
            if take is not None and len(out) == take:
                await gen.aclose()  # what EventStreamResponse does when the client goes
                break
        return out
    return asyncio.run(go())


def test_relay_forwards_then_done_after_record():
    up = Upstream(stream_lines())
    out = collect(up)
    assert out == [b"data: chatcmpl-a47ed4809741bab2\n\n"] * 10 + [b"data: [DONE]\n\n"]
    [resp] = up.recorded
    assert resp["choices"][0]["token_ids"] == [19556, 17, 339, 5248, 1535, 288, 4237, 346]
    assert (up.interrupted, up.closed) == ([], 1)


def test_relay_record_failure_ends_with_an_error_not_done():
    up = Upstream(stream_lines(), fail_record=True)
    out = collect(up)
    assert json.loads(out[-1][6:])["error"]["type"] == "kafka_unavailable" and b"[DONE]" not in b"".join(out)
    assert (up.recorded, up.interrupted, up.closed) == ([], [], 1)


def test_relay_client_gone_is_one_dead_letter():
    up = Upstream(stream_lines())
    assert len(collect(up, take=3)) == 3
    assert (up.recorded, up.interrupted, up.closed) == ([], [(CLIENT_DISCONNECTED, [19556, 17])], 1)


def test_relay_cancelled_mid_stream_is_one_dead_letter():
    """Starlette cancels the sending task when the client disconnects (ASGI spec < 2.4)."""
    async def slow_lines():
        for i, line in enumerate(stream_lines()):
            if i == 4:
                await asyncio.sleep(30)
            yield line

    up = Upstream([])
    up.lines = slow_lines

    async def go():
        got: list[bytes] = []

        async def consume():
            async for b in up.relay():
                got.append(b)
        task = asyncio.create_task(consume())
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return got
    assert len(asyncio.run(go())) == 2
    assert (up.interrupted, up.closed) == ([(CLIENT_DISCONNECTED, [19556])], 1)


@pytest.mark.parametrize("lines,raise_at,last_type", [
    (stream_lines()[:-3], None, "vllm_stream_failed"),                                  # no [DONE]
    (stream_lines()[:6] + ['data: {"error": {"message": "engine dead", "code": 500}}', ""], None, "vllm_stream_failed"),
    (stream_lines()[:6] + ['data: {"error": {"message": "x", "type": "InternalServerError"}}', ""], None,
     "InternalServerError"),
    (stream_lines(), 6, "vllm_unavailable"),                                            # transport error
    (stream_lines()[:4] + ["data: {not json", ""], None, "vllm_stream_failed"),
])
def test_relay_vllm_failure_mid_stream(lines, raise_at, last_type):
    up = Upstream(lines, raise_at=raise_at)
    out = collect(up)
    last = json.loads(out[-1][6:])
    assert last["error"].get("type") == last_type and b"[DONE]" not in b"".join(out)
    assert up.recorded == [] and up.closed == 1
    assert [r for r, _ in up.interrupted] == [VLLM_STREAM_FAILED]
    assert len(up.lost) == (1 if raise_at else 0)


def test_relay_failure_is_recorded_before_the_client_can_leave():
    up = Upstream(stream_lines()[:6] + ['data: {"error": {"message": "engine dead", "code": 500}}', ""])
    out = collect(up, take=4)  # the client closes on the error event
    assert json.loads(out[-1][6:])["error"]["code"] == 500
    assert [r for r, _ in up.interrupted] == [VLLM_STREAM_FAILED] and up.closed == 1
