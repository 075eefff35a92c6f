"""OTLP protobuf -> Span / Reward / dead-letter conversion (spanrl.producers.otlp)."""
from __future__ import annotations

import gzip
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from spanrl.producers.otlp import OtlpError, convert_request, decode_request, span_kind
from spanrl.schemas import codec

TRACE = bytes(range(16))
SPAN = bytes(range(100, 108))
PARENT = bytes(range(200, 208))


def kv(key: str, value) -> KeyValue:
    if isinstance(value, bool):
        v = AnyValue(bool_value=value)
    elif isinstance(value, int):
        v = AnyValue(int_value=value)
    elif isinstance(value, float):
        v = AnyValue(double_value=value)
    elif isinstance(value, list):
        v = AnyValue(array_value=ArrayValue(values=[AnyValue(string_value=x) for x in value]))
    else:
        v = AnyValue(string_value=value)
    return KeyValue(key=key, value=v)


def request(spans: list[Span], resource: dict | None = None) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.extend(kv(k, v) for k, v in (resource or {"service.name": "agent"}).items())
    rs.scope_spans.add().spans.extend(spans)
    return req


def span(name: str, attrs: dict, parent: bytes = b"") -> Span:
    return Span(trace_id=TRACE, span_id=SPAN, parent_span_id=parent, name=name,
                start_time_unix_nano=1_700_000_000_000_000_000, end_time_unix_nano=1_700_000_000_500_000_000,
                attributes=[kv(k, v) for k, v in attrs.items()], status=Status(code=Status.STATUS_CODE_OK))


def test_tool_span_to_span_record_exact():
    attrs = {"spanrl.rollout_id": "r1", "spanrl.attempt_id": "0", "spanrl.sequence_id": 3,
             "spanrl.agent_name": "solver", "gen_ai.tool.name": "calculator", "retries": 2,
             "ok": True, "score": 0.5, "tags": ["a", "b"]}
    [c] = convert_request(request([span("tool.calculator", attrs, PARENT)]))
    assert c.dead_reason is None and c.reward is None
    assert c.span == {
        "rollout_id": "r1", "attempt_id": "0", "sequence_id": 3,
        "trace_id": TRACE.hex(), "span_id": SPAN.hex(), "parent_span_id": PARENT.hex(),
        "name": "tool.calculator", "kind": "tool", "source": "otlp",
        "start_time_unix_nano": 1_700_000_000_000_000_000, "end_time_unix_nano": 1_700_000_000_500_000_000,
        "status_code": "OK", "agent_name": "solver",
        "attributes": {"spanrl.rollout_id": "r1", "spanrl.attempt_id": "0", "spanrl.sequence_id": "3",
                       "spanrl.agent_name": "solver", "gen_ai.tool.name": "calculator", "retries": "2",
                       "ok": "true", "score": "0.5", "tags": '["a","b"]'},
        "llm": None, "payload_ref": None,
    }
    # the record encodes and round-trips through the shared codec
    assert codec.decode("span", codec.encode("span", c.span))["attributes"]["tags"] == '["a","b"]'


def test_rollout_from_resource_attributes_and_defaults():
    [c] = convert_request(request([span("work", {})], {"spanrl.rollout_id": "r9", "spanrl.attempt_id": "2"}))
    assert (c.span["rollout_id"], c.span["attempt_id"], c.span["sequence_id"]) == ("r9", "2", -1)
    assert c.span["parent_span_id"] is None and c.span["kind"] == "other"


@pytest.mark.parametrize("name,attrs,kind", [
    ("chat gpt", {}, "chat" and "llm"),
    ("llm.call", {}, "llm"),
    ("whatever", {"gen_ai.request.model": "m"}, "llm"),
    ("whatever", {"gen_ai.tool.name": "t", "gen_ai.request.model": "m"}, "tool"),
    ("tool_x", {}, "tool"),
    ("spanrl.reward", {}, "reward"),
    ("invoke_agent x", {"gen_ai.operation.name": "invoke_agent"}, "agent"),
    ("db.query", {"db.system": "x"}, "other"),
    # OpenInference's own span kinds (its OpenAI instrumentor names the LLM span "ChatCompletion")
    ("Completion", {"openinference.span.kind": "LLM"}, "llm"),
    ("search", {"openinference.span.kind": "TOOL"}, "tool"),
    ("planner", {"openinference.span.kind": "AGENT"}, "agent"),
    ("RunnableSequence", {"openinference.span.kind": "CHAIN"}, "other"),
])
def test_span_kind(name, attrs, kind):
    assert span_kind(name, attrs) == kind


def test_reward_span_to_reward_record():
    attrs = {"spanrl.rollout_id": "r1", "spanrl.attempt_id": "0", "spanrl.sequence_id": 7,
             "spanrl.reward.value": 0.75, "spanrl.reward.final": True, "spanrl.reward.name": "em",
             "spanrl.reward.component.format": 1.0, "spanrl.reward.component.answer": 0.5}
    [c] = convert_request(request([span("spanrl.reward", attrs)]))
    assert c.span["kind"] == "reward"
    assert c.reward == {"rollout_id": "r1", "attempt_id": "0", "value": 0.75, "final": True, "name": "em",
                        "span_id": None, "timestamp_ms": 1_700_000_000_500,
                        "components": {"format": 1.0, "answer": 0.5}}
    assert codec.decode("reward", codec.encode("reward", c.reward))["components"] == {"format": 1.0, "answer": 0.5}


def test_intermediate_reward_with_int_value_and_span_id():
    attrs = {"spanrl.rollout_id": "r1", "spanrl.reward.value": 1, "spanrl.reward.final": False,
             "spanrl.reward.span_id": "abcd"}
    [c] = convert_request(request([span("spanrl.reward", attrs)]))
    assert (c.reward["value"], c.reward["final"], c.reward["span_id"], c.reward["attempt_id"]) == (1.0, False, "abcd", "0")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "1.0", None])
def test_invalid_reward_dead_lettered(value):
    attrs = {"spanrl.rollout_id": "r1"}
    if value is not None:
        attrs["spanrl.reward.value"] = value
    [c] = convert_request(request([span("spanrl.reward", attrs)]))
    assert c.span is None and c.dead_reason == "invalid_reward" and c.rollout_id == "r1"


def test_span_without_rollout_id_is_an_orphan_keyed_by_trace():
    """No spanrl.rollout_id (a framework's own instrumentation): a span record with empty
    rollout/attempt ids for orphan-spans, to be joined by trace id in the stream app."""
    s = span("ChatCompletion", {"openinference.span.kind": "LLM", "llm.model_name": "policy"}, parent=PARENT)
    [c] = convert_request(request([s]))
    assert (c.orphan, c.dead_reason, c.rollout_id, c.reward) == (True, None, None, None)
    assert c.span == {
        "rollout_id": "", "attempt_id": "", "sequence_id": -1, "trace_id": TRACE.hex(), "span_id": SPAN.hex(),
        "parent_span_id": PARENT.hex(), "name": "ChatCompletion", "kind": "llm", "source": "otlp",
        "start_time_unix_nano": 1_700_000_000_000_000_000, "end_time_unix_nano": 1_700_000_000_500_000_000,
        "status_code": "OK", "agent_name": None,
        "attributes": {"openinference.span.kind": "LLM", "llm.model_name": "policy"}, "llm": None, "payload_ref": None}
    assert codec.decode("span", codec.encode("span", c.span))["rollout_id"] == ""


@pytest.mark.parametrize("trace_id, name, attrs, why", [
    (b"\0" * 16, "chat", {}, "no valid trace id"),
    (b"", "chat", {}, "no valid trace id"),
    (TRACE, "spanrl.reward", {"spanrl.reward.value": 1.0}, "a reward must name its rollout"),
    (TRACE, "chat", {"spanrl.record_to": "eval"}, "evaluation spans are not joined"),
])
def test_span_without_rollout_id_that_cannot_join_is_dead_lettered(trace_id, name, attrs, why):
    s = span(name, attrs)
    s.trace_id = trace_id
    [c] = convert_request(request([s]))
    assert (c.span, c.dead_reason, c.rollout_id, c.orphan) == (None, "no_rollout_id", None, False)
    assert why in c.dead_detail and Span.FromString(c.raw) == s


def test_decode_gzip_and_errors():
    body = request([span("x", {"spanrl.rollout_id": "r"})]).SerializeToString()
    assert decode_request(gzip.compress(body), "gzip") == decode_request(body)
    for bad, enc, status in [(b"", None, 400), (b"\xff\xff\xff", None, 400), (b"nogzip", "gzip", 400),
                             (body, "br", 415), (gzip.compress(b"\0" * 1000), "gzip", 413)]:
        with pytest.raises(OtlpError) as e:
            decode_request(bad, enc, max_bytes=500)
        assert e.value.status == status


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512), st.sampled_from([None, "gzip", "identity"]))
def test_decoding_random_bytes_raises_only_otlp_error(data, encoding):
    try:
        req = decode_request(data, encoding)
    except OtlpError as exc:
        assert exc.status in (400, 413, 415)
        return
    for c in convert_request(req):  # whatever parsed must convert without raising
        assert (c.span is None) != (c.dead_reason is None)
        if c.span is not None:
            codec.encode("span", c.span)


def _int_array(key: str, values: list) -> KeyValue:
    items = [AnyValue(double_value=x) if isinstance(x, float) else AnyValue(int_value=x) for x in values]
    return KeyValue(key=key, value=AnyValue(array_value=ArrayValue(values=items)))


@pytest.mark.parametrize("prompt_key,completion_key", [
    ("spanrl.llm.prompt_token_ids", "spanrl.llm.completion_token_ids"),
    ("prompt_token_ids", "response_token_ids"),  # Agent Lightning's tracer keys
])
def test_llm_span_with_token_id_attributes_gets_llm_record(prompt_key, completion_key):
    s = span("openai.chat.completion", {"spanrl.rollout_id": "r1", "gen_ai.system": "openai",
                                        "gen_ai.request.model": "policy", "gen_ai.response.id": "resp-1",
                                        "spanrl.llm.policy_version": 3})
    s.attributes.extend([_int_array(prompt_key, [1, 2, 3]), _int_array(completion_key, [4, 5]),
                         _int_array("spanrl.llm.completion_logprobs", [-0.5, -0.25])])
    [c] = convert_request(request([s]))
    assert c.span["kind"] == "llm" and c.span["source"] == "otlp"
    assert c.span["llm"] == {
        "model": "policy", "policy_version": 3, "prompt_token_ids": [1, 2, 3], "completion_token_ids": [4, 5],
        "completion_logprobs": [-0.5, -0.25], "temperature": 1.0, "top_p": 1.0, "max_tokens": None,
        "finish_reason": None, "request_id": "resp-1"}
    # token data is stored once (in llm), not again as JSON text among the attributes
    assert not any(k in c.span["attributes"] for k in (prompt_key, completion_key, "spanrl.llm.completion_logprobs",
                                                       "spanrl.llm.policy_version"))
    assert codec.decode("span", codec.encode("span", c.span))["llm"]["completion_token_ids"] == [4, 5]


def test_llm_span_without_or_with_bad_token_ids_has_no_llm_record():
    [c] = convert_request(request([span("chat", {"spanrl.rollout_id": "r1", "gen_ai.system": "openai"})]))
    assert c.span["llm"] is None
    s = span("chat", {"spanrl.rollout_id": "r1", "gen_ai.system": "openai", "prompt_token_ids": ["a"],
                      "response_token_ids": ["b"]})
    [c] = convert_request(request([s]))
    assert c.span["llm"] is None and c.span["attributes"]["response_token_ids"] == '["b"]'


def test_exception_event_becomes_attributes_for_air():
    """The span record has no events: the last ``exception`` event's type and message (not
    its stacktrace) become attributes; the span's own attributes win; a span without one is
    unchanged. (AIR's exception/timeout facts, stream_jobs/air.py.)"""
    pb = span("tool.lookup", {"spanrl.rollout_id": "r1", "exception.message": "own"})
    pb.status.CopyFrom(Status(code=Status.STATUS_CODE_ERROR, message="TimeoutError: slow"))
    first = pb.events.add(name="exception")
    first.attributes.extend([kv("exception.type", "ValueError")])
    pb.events.add(name="log").attributes.extend([kv("exception.type", "NotAnException")])
    last = pb.events.add(name="exception")
    last.attributes.extend([kv("exception.type", "TimeoutError"), kv("exception.message", "x" * 600),
                            kv("exception.stacktrace", "Traceback ...")])
    [c] = convert_request(request([pb]))
    attrs = c.span["attributes"]
    assert (attrs["exception.type"], attrs["exception.message"]) == ("TimeoutError", "own")
    assert "exception.stacktrace" not in attrs and c.span["status_code"] == "ERROR" and c.span["kind"] == "tool"
    pb2 = span("tool.lookup", {"spanrl.rollout_id": "r1"})
    pb2.events.add(name="exception").attributes.extend([kv("exception.message", "m" * 600)])
    [c2] = convert_request(request([pb2]))
    assert c2.span["attributes"]["exception.message"] == "m" * 500 and "exception.type" not in c2.span["attributes"]
    [c3] = convert_request(request([span("tool.lookup", {"spanrl.rollout_id": "r1"})]))
    assert c3.span["attributes"] == {"spanrl.rollout_id": "r1"}


def test_sdk_recorded_exception_reaches_the_span_record():
    """The OTel SDK's own path: an exception raised in ``start_as_current_span`` is recorded as
    an ``exception`` event and sets status ERROR; the OTLP exporter's encoder turns it into the
    protobuf the bridge receives; the span record then carries AIR's exception / timeout facts."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from spanrl.producers import instrument
    from spanrl.stream_jobs.air import span_facts

    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(instrument.RolloutStampProcessor())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with instrument.rollout_context("r1", "0"):
        with pytest.raises(TimeoutError):
            with provider.get_tracer("t").start_as_current_span("tool.fetch", attributes={"gen_ai.tool.name": "fetch"}):
                raise TimeoutError("upstream took too long")
    [c] = convert_request(encode_spans(exporter.get_finished_spans()))
    assert (c.span["kind"], c.span["status_code"], c.span["rollout_id"]) == ("tool", "ERROR", "r1")
    assert c.span["attributes"]["exception.type"] == "TimeoutError"
    assert c.span["attributes"]["exception.message"] == "upstream took too long"
    assert span_facts(c.span) == ["tool_error", "exception", "timeout"]


def test_array_value_fast_path_gives_what_the_item_by_item_path_gives():
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue

    from spanrl.producers import otlp

    def arr(*items):
        return ArrayValue(values=[AnyValue(**item) for item in items]).values

    def slow(values):
        return [otlp.any_value(x) for x in values]

    cases = [
        arr(*({"int_value": v} for v in (5, 0, 7, -3))),        # token ids, one 0
        arr(*({"double_value": v} for v in (-0.5, 0.0, -2.25))),  # log-probs, one 0.0
        arr({"int_value": 5}, {"double_value": 1.5}),          # mixed: a non-zero double reads as int 0
        arr({"int_value": 5}, {"bool_value": True}),           # a bool reads as int 0 too
        arr({"int_value": 5}, {}),                             # an empty item: None
        arr({"double_value": 1.0}, {"int_value": 2}),
        arr({"string_value": "a"}, {"int_value": 0}),
        arr(),
    ]
    expected = [[5, 0, 7, -3], [-0.5, 0.0, -2.25], [5, 1.5], [5, True], [5, None], [1.0, 2], ["a", 0], []]
    for values, want in zip(cases, expected):
        got = otlp.array_value(values)
        assert got == want == slow(values) and [type(x) for x in got] == [type(x) for x in slow(values)]


def test_llm_from_attrs_takes_int_token_ids_only_and_float_logprobs():
    from spanrl.producers.otlp import llm_from_attrs

    attrs = {"spanrl.llm.prompt_token_ids": [1, 2], "spanrl.llm.completion_token_ids": [3, 4],
             "spanrl.llm.completion_logprobs": [-0.5, -1.0]}
    got = llm_from_attrs(attrs, "s")
    assert (got["prompt_token_ids"], got["completion_token_ids"], got["completion_logprobs"]) == (
        [1, 2], [3, 4], [-0.5, -1.0])
    assert llm_from_attrs({**attrs, "spanrl.llm.prompt_token_ids": [1, True]}, "s") is None
    assert llm_from_attrs({**attrs, "spanrl.llm.completion_token_ids": [3, 4.0]}, "s") is None
    mixed = llm_from_attrs({**attrs, "spanrl.llm.completion_logprobs": [-1, -0.5, True, "x"]}, "s")
    assert mixed["completion_logprobs"] == [-1.0, -0.5] and type(mixed["completion_logprobs"][0]) is float
