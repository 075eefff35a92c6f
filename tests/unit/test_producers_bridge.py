"""The bridge's in-flight bound and its answers to bad input (in-process, Kafka unreachable:
every case here is answered before anything is sent)."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from spanrl.producers.bridge import InflightBuffer, create_app
from spanrl.producers.kafka import Sink, Topics

PB = {"content-type": "application/x-protobuf"}


def test_inflight_buffer_bounds_bytes_waiting_for_acks():
    b = InflightBuffer(100)
    assert b.try_reserve(60) and b.used == 60
    assert b.try_reserve(40) and b.used == 100  # exactly full is allowed
    assert not b.try_reserve(1) and b.used == 100  # a refusal reserves nothing
    b.release(60)
    assert not b.try_reserve(61) and b.try_reserve(60) and b.used == 100
    b.release(100)
    assert b.used == 0
    assert b.try_reserve(250) and b.used == 250  # alone, a request over the bound still goes
    assert not b.try_reserve(1)
    assert b.try_reserve(0) and b.used == 250  # nothing to wait for is never refused
    b.release(250)
    with pytest.raises(ValueError):
        b.release(1)
    with pytest.raises(ValueError):
        InflightBuffer(0)


def otlp_with_name(name: bytes) -> bytes:
    """An ExportTraceServiceRequest whose span name is the raw bytes ``name`` (may be bad UTF-8)."""
    req = ExportTraceServiceRequest()
    s = req.resource_spans.add().scope_spans.add().spans.add()
    s.trace_id, s.span_id, s.name = b"\1" * 16, b"\2" * 8, "NAME"
    s.attributes.append(KeyValue(key="spanrl.rollout_id", value=AnyValue(string_value="r1")))
    body = req.SerializeToString()
    # the length prefix of "NAME" (4) stays right as long as the replacement has 4 bytes
    assert len(name) == 4 and body.count(b"NAME") == 1
    return body.replace(b"NAME", name)


@pytest.fixture
def client():
    with TestClient(create_app(Sink("127.0.0.1:1", Topics(), send_timeout_s=1.0))) as c:
        yield c


def test_bad_input_answers_and_counters(client):
    traces, rewards = "/v1/traces", "/v1/rewards"
    cases = [
        # invalid UTF-8 in an OTLP string field: protobuf (proto3 string) refuses the whole request
        (traces, {"content": otlp_with_name(b"N\xff\xfeE"), "headers": PB}, 400, "invalid_otlp"),
        (traces, {"content": otlp_with_name(b"N\xc3(E"), "headers": PB}, 400, "invalid_otlp"),
        (traces, {"content": b"", "headers": PB}, 400, "invalid_otlp"),
        (traces, {"content": b"{}", "headers": {"content-type": "text/plain"}}, 415, "unsupported_media_type"),
        (traces, {"content": b"x", "headers": {**PB, "content-encoding": "br"}}, 415, "unsupported_encoding"),
        (rewards, {"content": b'{"rollout_id": "r", "value": Infinity}', "headers": {"content-type": "application/json"}},
         400, "invalid_reward"),
        (rewards, {"content": b'{"rollout_id": "r", "value": 1e999}', "headers": {"content-type": "application/json"}},
         400, "invalid_reward"),
        (rewards, {"content": b'{"rollout_id": "r", "value": 1.0, "components": {"c": -Infinity}}',
                   "headers": {"content-type": "application/json"}}, 400, "invalid_reward"),
        # JSON "\ud800" is a lone surrogate: not a rollout id (spanrl/core/ids.py; the 400 must not echo it raw)
        (rewards, {"content": b'{"rollout_id": "\\ud800", "value": 1.0}', "headers": {"content-type": "application/json"}},
         400, "invalid_id"),
        (rewards, {"content": b'{"rollout_id": "r", "value": 1.0', "headers": {"content-type": "application/json"}},
         422, "invalid_request"),
        (rewards, {"content": b'{"rollout_id": "\xff\xfe", "value": 1.0}', "headers": {"content-type": "application/json"}},
         400, "invalid_json"),  # not UTF-8: FastAPI cannot parse the body
        (rewards, {"content": b'{"rollout_id": "r", "value": 1.0}', "headers": {"content-type": "text/plain"}},
         422, "invalid_request"),
        (rewards, {"json": {"value": 1.0}}, 422, "invalid_request"),
    ]
    for path, kw, status, reason in cases:
        r = client.post(path, **kw)
        assert r.status_code == status, (kw, r.text)
        assert r.json()["error"] == reason
    m = client.get("/status").json()
    assert {k: m[k] for k in ("http_400", "http_415", "http_422", "invalid_otlp", "unsupported_media_type",
                              "unsupported_encoding", "invalid_reward", "invalid_request", "invalid_json",
                              "invalid_id")} == {
        "http_400": 8, "http_415": 2, "http_422": 3, "invalid_otlp": 3, "unsupported_media_type": 1,
        "unsupported_encoding": 1, "invalid_reward": 3, "invalid_request": 3, "invalid_json": 1, "invalid_id": 1}
    assert (m["inflight_bytes"], m["max_inflight_bytes"]) == (0, 64 << 20)
    assert "spans" not in m and "rewards" not in m


class RecordingSink(Sink):
    """A Sink that acknowledges every record at once and keeps ``(topic name, key, value)``."""

    def __init__(self, topics: Topics):
        super().__init__("unused:0", topics)
        self.sent: list[tuple[str, str | None, bytes]] = []

    async def start(self) -> None:
        return None

    async def produce_raw(self, items) -> None:
        self.sent += [(t.name, k, v) for t, k, v in items]


def test_spans_without_rollout_id_go_to_orphan_spans_keyed_by_trace_id():
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    from spanrl.schemas import codec

    req = ExportTraceServiceRequest()
    spans = req.resource_spans.add().scope_spans.add().spans
    framework = spans.add(trace_id=b"\1" * 16, span_id=b"\2" * 8, name="ChatCompletion")
    framework.attributes.append(KeyValue(key="openinference.span.kind", value=AnyValue(string_value="LLM")))
    spans.add(trace_id=b"\0" * 16, span_id=b"\3" * 8, name="no trace")     # cannot join: dead letter
    stamped = spans.add(trace_id=b"\1" * 16, span_id=b"\4" * 8, name="tool.search")
    stamped.attributes.append(KeyValue(key="spanrl.rollout_id", value=AnyValue(string_value="r1")))
    sink = RecordingSink(Topics.with_prefix("t-"))
    with TestClient(create_app(sink, claim_client=object(), payload_bucket="b")) as c:
        r = c.post("/v1/traces", content=req.SerializeToString(), headers=PB)
        metrics = c.get("/status").json()
    assert r.status_code == 200
    answer = ExportTraceServiceResponse.FromString(r.content).partial_success
    assert (answer.rejected_spans, answer.error_message) == (1, "dead-lettered: no_rollout_id=1")
    assert [(topic, key) for topic, key, _ in sink.sent] == [
        ("t-orphan-spans", "01" * 16), ("t-dead-letter", None), ("t-spans", "r1")]
    orphan = codec.decode("span", sink.sent[0][2])
    assert (orphan["rollout_id"], orphan["attempt_id"], orphan["span_id"], orphan["kind"]) == ("", "", "02" * 8, "llm")
    assert codec.decode("dead_letter", sink.sent[1][2])["reason"] == "no_rollout_id"
    assert (metrics["orphan_spans"], metrics["spans"], metrics["dead_letter.no_rollout_id"]) == (1, 1, 1)


def test_rollout_end_is_a_terminal_lifecycle_event_on_rollouts():
    """``POST /v1/rollouts/{rid}/end`` (a production agent's explicit end): one rollout.v1
    record keyed by the rollout id; task "" and group size 0 unless given (the calls' win)."""
    from spanrl.schemas import codec

    sink = RecordingSink(Topics.with_prefix("t-"))
    with TestClient(create_app(sink)) as c:
        plain = c.post("/v1/rollouts/chat-1/end")
        failed = c.post("/v1/rollouts/chat-2/end", json={"status": "failed", "task_id": "faq", "group_size": 2,
                                                        "error": "user left"})
        bad = [c.post("/v1/rollouts/chat-3/end", json={"status": "started"}),
               c.post("/v1/rollouts/chat-3/end", json={"group_size": -1}),
               c.post("/v1/rollouts/-x/end")]
        metrics = c.get("/status").json()
    assert (plain.status_code, plain.json()) == (200, {"status": "ok", "rollout_id": "chat-1"})
    assert failed.status_code == 200
    assert [(r.status_code, r.json()["error"]) for r in bad] == [
        (422, "invalid_request"), (422, "invalid_request"), (400, "invalid_id")]
    assert [(topic, key) for topic, key, _ in sink.sent] == [("t-rollouts", "chat-1"), ("t-rollouts", "chat-2")]
    events = [codec.decode("rollout", v) for _, _, v in sink.sent]
    assert [(e["rollout_id"], e["attempt_id"], e["task_id"], e["status"], e["group_size"], e["runner_id"], e["error"])
            for e in events] == [("chat-1", "0", "", "succeeded", 0, "bridge", None),
                                 ("chat-2", "0", "faq", "failed", 2, "bridge", "user left")]
    assert metrics["rollout_ends"] == 2
