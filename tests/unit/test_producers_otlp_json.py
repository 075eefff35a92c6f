"""OTLP/JSON (``application/json``, the JavaScript SDK exporter's default) in the bridge:
the same spans as protobuf give the same records, a body the real JavaScript exporter sent
(tests/fixtures/otlp_json_js) gives the records it should, and bad bodies are refused as
protobuf's are. In-process, Kafka replaced by a recording sink (test_producers_bridge.py)."""
from __future__ import annotations

import base64
import gzip
import json
import math
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from google.protobuf import json_format
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from spanrl.producers import bridge
from spanrl.producers.kafka import Topics
from spanrl.producers.otlp import JSON, PROTOBUF, OtlpError, convert_request, decode_request, hex_ids_to_base64
from spanrl.schemas import codec
from tests.unit.test_producers_bridge import RecordingSink  # Kafka that acks at once

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "otlp_json_js"
TRACE, OTHER_TRACE = bytes(range(16)), bytes(range(16, 32))
SPAN, PARENT, LINKED = bytes(range(100, 108)), bytes(range(200, 208)), bytes(range(50, 58))
T0 = 1_700_000_000_123_456_789  # ns: past 2**53, so a double would lose it


def kv(key: str, value: AnyValue) -> KeyValue:
    return KeyValue(key=key, value=value)


def ints(*xs: int) -> AnyValue:
    return AnyValue(array_value=ArrayValue(values=[AnyValue(int_value=x) for x in xs]))


def doubles(*xs: float) -> AnyValue:
    return AnyValue(array_value=ArrayValue(values=[AnyValue(double_value=x) for x in xs]))


def every_kind_request() -> ExportTraceServiceRequest:
    """Two resources; an LLM span with token ids (zeros in them: the array fast path checks
    those), log-probs, every AnyValue kind, events (one an exception), links and a parent; a
    reward span; an orphan (no rollout id) and a span with no trace id (dead letter)."""
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.extend([kv("service.name", AnyValue(string_value="agent")),
                                   kv("spanrl.rollout_id", AnyValue(string_value="r1"))])
    ss = rs.scope_spans.add()
    ss.scope.name, ss.scope.version = "spanrl-test", "1.0"
    llm = ss.spans.add(
        trace_id=TRACE, span_id=SPAN, parent_span_id=PARENT, name="chat smollm2", kind=Span.SPAN_KIND_CLIENT,
        start_time_unix_nano=T0, end_time_unix_nano=T0 + 400_000_001, flags=257, trace_state="k=v",
        dropped_attributes_count=1, status=Status(code=Status.STATUS_CODE_OK, message="fine"))
    llm.attributes.extend([
        kv("spanrl.attempt_id", AnyValue(string_value="0")),
        kv("spanrl.sequence_id", AnyValue(int_value=7)),
        kv("gen_ai.request.model", AnyValue(string_value="smollm2")),
        kv("spanrl.llm.policy_version", AnyValue(int_value=4)),
        kv("spanrl.llm.prompt_token_ids", ints(1, 0, 9690, 2**31 - 1, 0)),
        kv("spanrl.llm.completion_token_ids", ints(17, 0, 2)),
        kv("spanrl.llm.completion_logprobs", doubles(-0.25, 0.0, -1e-9)),
        kv("text", AnyValue(string_value="héllo \u2603 \"q\"")),
        kv("flag", AnyValue(bool_value=True)),
        kv("big", AnyValue(int_value=-(2**63))),
        kv("ratio", AnyValue(double_value=0.1)),
        kv("nan", AnyValue(double_value=math.nan)),
        kv("inf", AnyValue(double_value=-math.inf)),
        kv("blob", AnyValue(bytes_value=b"\0\xff\x10")),
        kv("mixed", AnyValue(array_value=ArrayValue(values=[
            AnyValue(int_value=1), AnyValue(double_value=0.5), AnyValue(string_value="s"), AnyValue()]))),
        kv("empty_array", AnyValue(array_value=ArrayValue())),
        kv("map", AnyValue(kvlist_value=KeyValueList(values=[
            kv("a", AnyValue(int_value=0)), kv("b", ints(3, 4)), kv("c", AnyValue(bool_value=False))]))),
        kv("unset", AnyValue()),
    ])
    ev = llm.events.add(time_unix_nano=T0 + 1, name="first_token")
    ev.attributes.append(kv("token.index", AnyValue(int_value=0)))
    exc = llm.events.add(time_unix_nano=T0 + 2, name="exception")
    exc.attributes.extend([kv("exception.type", AnyValue(string_value="ValueError")),
                           kv("exception.message", AnyValue(string_value="bad"))])
    link = llm.links.add(trace_id=OTHER_TRACE, span_id=LINKED, trace_state="a=b", flags=1)
    link.attributes.append(kv("link.kind", AnyValue(string_value="retry")))
    reward = ss.spans.add(trace_id=TRACE, span_id=PARENT, name="spanrl.reward",
                          start_time_unix_nano=T0, end_time_unix_nano=T0 + 5)
    reward.attributes.extend([kv("spanrl.reward.value", AnyValue(double_value=0.75)),
                              kv("spanrl.reward.component.format", AnyValue(int_value=1))])
    other = req.resource_spans.add()
    other.resource.attributes.append(kv("service.name", AnyValue(string_value="framework")))
    spans = other.scope_spans.add().spans
    orphan = spans.add(trace_id=OTHER_TRACE, span_id=LINKED, name="ChatCompletion", kind=Span.SPAN_KIND_INTERNAL,
                       start_time_unix_nano=1, end_time_unix_nano=2, status=Status(code=Status.STATUS_CODE_ERROR))
    orphan.attributes.append(kv("openinference.span.kind", AnyValue(string_value="LLM")))
    spans.add(span_id=SPAN, name="no trace")  # no rollout id, no trace id: dead letter
    return req


#: the id fields OTLP/JSON writes as hex (under either name)
ID_KEYS = {"traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id"}
#: the 64-bit integer fields of a trace export, which proto3 JSON writes as strings
INT64_KEYS = {"intValue", "startTimeUnixNano", "endTimeUnixNano", "timeUnixNano",
              "int_value", "start_time_unix_nano", "end_time_unix_nano", "time_unix_nano"}


def otlp_json(req: ExportTraceServiceRequest, snake: bool = False, enum_names: bool = False,
              int64_numbers: bool = False) -> bytes:
    """``req`` as an OTLP/JSON body, written independently of the decoder: protobuf's own
    proto3 JSON printer, then its base64 ids rewritten as hex (OTLP's exception).
    ``snake``: the proto field names; ``enum_names``: enums as names, not integers;
    ``int64_numbers``: 64-bit integers as JSON numbers, not strings."""
    def walk(x):
        if isinstance(x, list):
            return [walk(v) for v in x]
        if not isinstance(x, dict):
            return x
        return {k: (base64.b64decode(v).hex() if k in ID_KEYS else
                    int(v) if k in INT64_KEYS and int64_numbers else walk(v)) for k, v in x.items()}

    d = json_format.MessageToDict(req, preserving_proto_field_name=snake, use_integers_for_enums=not enum_names)
    return json.dumps(walk(d)).encode()


def records(req: ExportTraceServiceRequest) -> list[tuple]:
    """Every outcome of ``req`` as comparable bytes: Avro span / reward record, dead-letter
    reason, the protobuf span kept for a dead letter's payload."""
    return [(c.rollout_id, c.dead_reason, c.dead_detail, c.raw, c.orphan, c.record_to,
             None if c.span is None else codec.encode("span", c.span),
             None if c.reward is None else codec.encode("reward", c.reward)) for c in convert_request(req)]


@pytest.mark.parametrize("variant", [{}, {"snake": True}, {"enum_names": True}, {"int64_numbers": True},
                                     {"snake": True, "enum_names": True, "int64_numbers": True}])
def test_json_decodes_to_the_message_and_records_of_the_same_protobuf(variant):
    req = every_kind_request()
    body = otlp_json(req, **variant)
    decoded = decode_request(body, content_type=JSON)
    # the same message, NaN included (compared as bytes: NaN != NaN)
    assert decoded.SerializeToString(deterministic=True) == req.SerializeToString(deterministic=True)
    assert decode_request(gzip.compress(body), "gzip", content_type=JSON) == decoded
    assert records(decoded) == records(decode_request(req.SerializeToString())) == records(req)
    # and what those records hold (the parts the JSON mapping could get wrong)
    llm, reward_span, orphan, dead = convert_request(decoded)
    assert (llm.span["trace_id"], llm.span["span_id"], llm.span["parent_span_id"]) == (
        TRACE.hex(), SPAN.hex(), PARENT.hex())
    assert (llm.span["start_time_unix_nano"], llm.span["end_time_unix_nano"]) == (T0, T0 + 400_000_001)
    assert llm.span["llm"]["prompt_token_ids"] == [1, 0, 9690, 2**31 - 1, 0]
    assert llm.span["llm"]["completion_token_ids"] == [17, 0, 2]
    assert llm.span["llm"]["completion_logprobs"] == [-0.25, 0.0, -1e-9]
    assert (llm.span["llm"]["policy_version"], llm.span["sequence_id"], llm.span["status_code"]) == (4, 7, "OK")
    attrs = llm.span["attributes"]
    assert {k: attrs[k] for k in ("text", "flag", "big", "ratio", "nan", "inf", "blob", "mixed", "empty_array",
                                  "map", "unset", "exception.type")} == {
        "text": "héllo \u2603 \"q\"", "flag": "true", "big": str(-(2**63)), "ratio": "0.1", "nan": "NaN",
        "inf": "-Infinity", "blob": "AP8Q", "mixed": '[1,0.5,"s",null]', "empty_array": "[]",
        "map": '{"a":0,"b":[3,4],"c":false}', "unset": "null", "exception.type": "ValueError"}
    assert reward_span.reward == {"rollout_id": "r1", "attempt_id": "0", "value": 0.75, "final": True,
                                  "name": "reward", "span_id": None, "timestamp_ms": (T0 + 5) // 1_000_000,
                                  "components": {"format": 1.0}}
    assert (orphan.orphan, orphan.span["trace_id"], orphan.span["kind"], orphan.span["status_code"]) == (
        True, OTHER_TRACE.hex(), "llm", "ERROR")
    assert dead.dead_reason == "no_rollout_id"


def test_hex_ids_to_base64_rewrites_only_span_and_link_ids():
    body = {"resourceSpans": [{"resource": {"attributes": [{"key": "traceId", "value": {"stringValue": "x"}}]},
                               "scopeSpans": [{"spans": [
                                   {"traceId": "0AF7651916CD43DD8448EB211C80319C", "span_id": "00f067aa0ba902b7",
                                    "parentSpanId": "", "links": [{"traceId": "00" * 16, "spanId": None}],
                                    "attributes": [{"key": "b", "value": {"bytesValue": "AP8Q"}}]},
                                   "not a span"]}]}],
            "resource_spans": "not a list"}
    out = hex_ids_to_base64(body)
    span = out["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert (span["traceId"], span["span_id"], span["parentSpanId"]) == (
        base64.b64encode(bytes.fromhex("0af7651916cd43dd8448eb211c80319c")).decode(),
        base64.b64encode(bytes.fromhex("00f067aa0ba902b7")).decode(), "")
    assert span["links"] == [{"traceId": "AAAAAAAAAAAAAAAAAAAAAA==", "spanId": None}]
    assert span["attributes"] == [{"key": "b", "value": {"bytesValue": "AP8Q"}}]  # bytesValue stays base64
    assert out["resourceSpans"][0]["resource"] == body["resourceSpans"][0]["resource"]
    assert out["resourceSpans"][0]["scopeSpans"][0]["spans"][1] == "not a span"
    assert out["resource_spans"] == "not a list"
    # pure: the input is as it was
    assert body["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"] == "0AF7651916CD43DD8448EB211C80319C"


#: what the JavaScript exporter's two spans (tests/fixtures/otlp_json_js/export.js) become
JS_TRACE = "0af7651916cd43dd8448eb211c80319c"
JS_RECORDS = [
    {"rollout_id": "r-js", "attempt_id": "0", "sequence_id": 0, "trace_id": JS_TRACE,
     "span_id": "00f067aa0ba902b7", "parent_span_id": "b7ad6b7169203331", "name": "chat smollm2", "kind": "llm",
     "source": "otlp", "start_time_unix_nano": 1_700_000_000_100_000_001,
     "end_time_unix_nano": 1_700_000_000_400_000_000, "status_code": "OK", "agent_name": "solver",
     "attributes": {"spanrl.rollout_id": "r-js", "spanrl.attempt_id": "0", "spanrl.sequence_id": "0",
                    "gen_ai.operation.name": "chat", "gen_ai.request.model": "smollm2-135m",
                    "llm.temperature": "0.7", "llm.stream": "false", "tags": '["math","eval"]'},
     "llm": {"model": "smollm2-135m", "policy_version": 3, "prompt_token_ids": [1, 9690, 198, 0, 2],
             "completion_token_ids": [17, 2767, 0],
             # JavaScript sent the 0 as an intValue (an integral number); the record has floats
             "completion_logprobs": [-0.25, 0.0, -1.5],
             "temperature": 1.0, "top_p": 1.0, "max_tokens": None, "finish_reason": None,
             "request_id": "00f067aa0ba902b7"},
     "payload_ref": None},
    {"rollout_id": "r-js", "attempt_id": "0", "sequence_id": -1, "trace_id": JS_TRACE,
     "span_id": "b7ad6b7169203331", "parent_span_id": None, "name": "agent.solve", "kind": "agent",
     "source": "otlp", "start_time_unix_nano": 1_700_000_000_000_000_000,
     "end_time_unix_nano": 1_700_000_000_500_000_000, "status_code": "ERROR", "agent_name": "solver",
     "attributes": {"exception.type": "TimeoutError", "exception.message": "tool took too long",
                    "spanrl.rollout_id": "r-js", "spanrl.attempt_id": "0", "task.tries": "2"},
     "llm": None, "payload_ref": None},
]


@pytest.mark.parametrize("name", ["request.json", "request.json.gz"])
def test_body_of_the_javascript_exporter_decodes_to_the_expected_records(name):
    headers = json.loads((FIXTURE / "request.headers.json").read_text())[name]
    assert headers["Content-Type"] == JSON and headers["User-Agent"] == "OTel-OTLP-Exporter-JavaScript/0.223.1"
    req = decode_request((FIXTURE / name).read_bytes(), headers.get("Content-Encoding"), content_type=JSON)
    out = convert_request(req)
    assert [c.span for c in out] == JS_RECORDS
    assert all(c.rollout_id == "r-js" and c.dead_reason is None and c.reward is None for c in out)
    llm = req.resource_spans[0].scope_spans[0].spans[0]
    assert (llm.kind, llm.flags, llm.events[0].time_unix_nano) == (
        Span.SPAN_KIND_CLIENT, 257, 1_700_000_000_150_000_000)
    assert (llm.links[0].trace_id.hex(), llm.links[0].span_id.hex()) == ("4bf92f3577b34da6a3ce929d0e0e4736",
                                                                        "53995c3f42cd8ad8")


def test_bridge_sends_the_same_kafka_records_for_json_and_protobuf(monkeypatch):
    monkeypatch.setattr(bridge, "now_ms", lambda: 1_700_000_000_000)  # the dead letter's time
    req = every_kind_request()
    sent, answers = [], []
    for body, headers in [(req.SerializeToString(), {"content-type": PROTOBUF}),
                          (otlp_json(req), {"content-type": "application/json"}),
                          (gzip.compress(otlp_json(req, snake=True)),
                           {"content-type": "Application/JSON; charset=utf-8", "content-encoding": "gzip"})]:
        sink = RecordingSink(Topics.with_prefix("t-"))
        with TestClient(bridge.create_app(sink, claim_client=object(), payload_bucket="b")) as c:
            answers.append(c.post("/v1/traces", content=body, headers=headers))
        sent.append(sink.sent)
    assert sent[0] == sent[1] == sent[2]
    assert [(topic, key) for topic, key, _ in sent[0]] == [
        ("t-spans", "r1"), ("t-spans", "r1"), ("t-rewards", "r1"), ("t-orphan-spans", OTHER_TRACE.hex()),
        ("t-dead-letter", None)]
    pb, *js = answers
    assert pb.headers["content-type"] == PROTOBUF
    assert ExportTraceServiceResponse.FromString(pb.content).partial_success.rejected_spans == 1
    for r in js:  # proto3 JSON of the same response: int64 as a string
        assert (r.status_code, r.headers["content-type"]) == (200, "application/json")
        assert r.json() == {"partialSuccess": {"rejectedSpans": "1", "errorMessage": "dead-lettered: no_rollout_id=1"}}


def test_bridge_answers_an_accepted_json_export_with_an_empty_json_response():
    sink = RecordingSink(Topics.with_prefix("t-"))
    headers = json.loads((FIXTURE / "request.headers.json").read_text())["request.json.gz"]
    with TestClient(bridge.create_app(sink, claim_client=object(), payload_bucket="b")) as c:
        r = c.post("/v1/traces", content=(FIXTURE / "request.json.gz").read_bytes(),
                   headers={k: v for k, v in headers.items() if k != "Transfer-Encoding"})
        status = c.get("/status").json()
    assert (r.status_code, r.headers["content-type"], r.json()) == (200, "application/json", {})
    assert [v for _, _, v in sink.sent] == [codec.encode("span", record) for record in JS_RECORDS]
    assert status["spans"] == 2


SPAN_PATH = "resourceSpans[0].scopeSpans[0].spans[0]"


def one_span_json(**span) -> bytes:
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "s", **span}]}]}]}).encode()


@pytest.mark.parametrize("body,detail", [
    (b'{"resourceSpans": [', "not JSON: Expecting value: line 1 column 20 (char 19)"),
    (b"[]", "an OTLP/JSON ExportTraceServiceRequest is an object, got list"),
    (one_span_json(attributes=[{"key": "x", "value": {"doubleValue": "NaN!"}}]).replace(b'"NaN!"', b"NaN"),
     "not JSON: NaN is not JSON (proto3 JSON writes a double's NaN / Infinity as a string)"),
    (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "\xff"}]}]}]}',
     "OTLP/JSON body is not UTF-8: invalid start byte at byte 56"),
    (one_span_json(traceId="0af7651916cd43dd8448eb211c80319"),
     f'{SPAN_PATH}.traceId must be 32 hex digits (OTLP/JSON ids are hex, not base64), got '
     f'"0af7651916cd43dd8448eb211c80319" (31 characters)'),
    (one_span_json(traceId="CvdlGRbNQ92ESOshHIAxnA=="),  # base64, as plain proto3 JSON would write it
     f'{SPAN_PATH}.traceId must be 32 hex digits (OTLP/JSON ids are hex, not base64), got '
     f'"CvdlGRbNQ92ESOshHIAxnA==" (24 characters)'),
    (one_span_json(span_id="00f067aa0ba902bz"),
     f'{SPAN_PATH}.span_id must be 16 hex digits (OTLP/JSON ids are hex, not base64), got "00f067aa0ba902bz" '
     f'(16 characters)'),
    (one_span_json(links=[{"spanId": 12}]),
     f"{SPAN_PATH}.links[0].spanId must be 16 hex digits (OTLP/JSON ids are hex, not base64), got 12"),
])
def test_bad_json_bodies_raise_otlp_error_400_with_the_reason(body, detail):
    with pytest.raises(OtlpError) as exc:
        decode_request(body, content_type=JSON)
    assert (exc.value.status, exc.value.detail) == (400, detail)


@pytest.mark.parametrize("span,where", [
    ({"startTimeUnixNano": 1.5}, "startTimeUnixNano"),
    ({"startTimeUnixNano": "1e3"}, "startTimeUnixNano"),
    ({"attributes": [{"key": "x", "value": {"intValue": "9223372036854775808"}}]}, "attributes.value.intValue"),
    ({"attributes": [{"key": "x", "value": {"intValue": 1, "stringValue": "y"}}]}, "attributes.value"),
    # a JSON number too large for a double (json.dumps cannot write 1e999: put in below)
    ({"attributes": [{"key": "x", "value": {"doubleValue": "1e999"}}]}, "attributes.value"),
    ({"name": "\ud800"}, "name"),  # a lone surrogate: not a protobuf string
    ({"attributes": {"key": "x"}}, None),  # not a list: the parser says so, without a field chain
])
def test_json_the_proto3_parser_refuses_is_a_400_naming_the_field(span, where):
    body = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}).encode().replace(b'"1e999"', b"1e999")
    with pytest.raises(OtlpError) as exc:
        decode_request(body, content_type=JSON)
    # the parser's own words after the field (protobuf's, may change with its version)
    fields = "" if where is None else f"resourceSpans.scopeSpans.spans.{where}: "
    prefix = f"not an ExportTraceServiceRequest: {fields}"
    assert exc.value.status == 400 and exc.value.detail.startswith(prefix), exc.value.detail
    if where is None:
        assert exc.value.detail.endswith("at ExportTraceServiceRequest.resourceSpans[0].scopeSpans[0].spans[0]")


def test_json_enum_names_protobuf_does_not_know_are_ignored_as_unknown_fields_are():
    body = one_span_json(kind="client", status={"code": "STATUS_CODE_ERROR"})
    span = decode_request(body, content_type=JSON).resource_spans[0].scope_spans[0].spans[0]
    assert (span.kind, span.status.code) == (Span.SPAN_KIND_UNSPECIFIED, Status.STATUS_CODE_ERROR)


#: JSON values near the shape of a request: OTLP's field names as keys, ids, numbers, nesting
_KEYS = st.sampled_from(["resourceSpans", "resource_spans", "scopeSpans", "spans", "traceId", "span_id",
                         "parentSpanId", "links", "attributes", "key", "value", "intValue", "doubleValue",
                         "arrayValue", "values", "kvlistValue", "startTimeUnixNano", "kind", "status", "code", "x"])
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["", "00" * 8, "00" * 16, "ab" * 16, "NaN", "Infinity", "1", "\ud800"]) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_KEYS, inner, max_size=4), max_leaves=30)


_SPANS = st.lists(st.dictionaries(_KEYS, _JSON, max_size=5), max_size=3).map(
    lambda spans: {"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]})


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_KEYS, _JSON, max_size=3) | _SPANS)
def test_decoding_random_json_raises_only_otlp_error(obj):
    try:
        req = decode_request(json.dumps(obj).encode(), content_type=JSON)
    except OtlpError as exc:
        assert exc.status == 400
        return
    for c in convert_request(req):  # whatever parsed must convert without raising
        assert (c.span is None) != (c.dead_reason is None)
        if c.span is not None:
            try:
                codec.encode("span", c.span)
            except codec.SchemaError:  # e.g. a fixed64 time over Avro's long: the bridge dead-letters it
                pass


def test_json_unknown_fields_are_ignored_and_null_is_the_default():
    body = one_span_json(traceId="00" * 16, parentSpanId=None, newField={"x": 1}, status={"code": 2, "future": 1})
    span = decode_request(body, content_type=JSON).resource_spans[0].scope_spans[0].spans[0]
    assert (span.trace_id, span.parent_span_id, span.status.code) == (bytes(16), b"", 2)


def test_bridge_refuses_bad_json_like_bad_protobuf():
    with TestClient(bridge.create_app(RecordingSink(Topics()), max_body_bytes=1000, claim_client=object(),
                                      payload_bucket="b", credentials="s3cret")) as c:
        auth = {"authorization": "Bearer s3cret"}
        js = {**auth, "content-type": "application/json"}
        answers = [
            c.post("/v1/traces", content=b"{", headers=js),
            c.post("/v1/traces", content=one_span_json(traceId="abc"), headers=js),
            c.post("/v1/traces", content=b"", headers=js),
            c.post("/v1/traces", content=b"x" * 1001, headers=js),
            c.post("/v1/traces", content=gzip.compress(b" " * 1001), headers={**js, "content-encoding": "gzip"}),
            c.post("/v1/traces", content=b"{}", headers={**js, "content-encoding": "br"}),
            c.post("/v1/traces", content=b"{}", headers={**auth, "content-type": "text/plain"}),
            c.post("/v1/traces", content=b"{}", headers={"content-type": "application/json"}),
        ]
        status = c.get("/status", headers=auth).json()
    assert [(r.status_code, r.json()["error"]) for r in answers] == [
        (400, "invalid_otlp"), (400, "invalid_otlp"), (400, "invalid_otlp"), (413, "body_too_large"),
        (413, "body_too_large"), (415, "unsupported_encoding"), (415, "unsupported_media_type"),
        (401, "missing_token")]
    assert answers[1].json()["detail"].startswith(f"{SPAN_PATH}.traceId must be 32 hex digits")
    assert answers[6].json()["detail"] == ("Content-Type must be application/x-protobuf (OTLP/HTTP protobuf) "
                                           "or application/json (OTLP/JSON), got 'text/plain'")
    assert {k: status[k] for k in ("invalid_otlp", "body_too_large", "unsupported_media_type", "http_400")} == {
        "invalid_otlp": 3, "body_too_large": 2, "unsupported_media_type": 1, "http_400": 3}
