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
        (traces, {"content": b"{}", "headers": {"content-type": "application/json"}}, 415, "unsupported_media_type"),
        (traces, {"content": b"x", "headers": {**PB, "content-encoding": "br"}}, 415, "unsupported_encoding"),
        (rewards, {"content": b'{"rollout_id": "r", "value": Infinity}', "headers": {"content-type": "application/json"}},
         400, "invalid_reward"),
        (rewards, {"content": b'{"rollout_id": "r", "value": 1e999}', "headers": {"content-type": "application/json"}},
         400, "invalid_reward"),
        (rewards, {"content": b'{"rollout_id": "r", "value": 1.0, "components": {"c": -Infinity}}',
                   "headers": {"content-type": "application/json"}}, 400, "invalid_reward"),
        # JSON "\ud800" is a lone surrogate: pydantic refuses it (and the 422 must not echo it)
        (rewards, {"content": b'{"rollout_id": "\\ud800", "value": 1.0}', "headers": {"content-type": "application/json"}},
         422, "invalid_request"),
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
    m = client.get("/metrics").json()
    assert {k: m[k] for k in ("http_400", "http_415", "http_422", "invalid_otlp", "unsupported_media_type",
                              "unsupported_encoding", "invalid_reward", "invalid_request", "invalid_json")} == {
        "http_400": 7, "http_415": 2, "http_422": 4, "invalid_otlp": 3, "unsupported_media_type": 1,
        "unsupported_encoding": 1, "invalid_reward": 3, "invalid_request": 4, "invalid_json": 1}
    assert (m["inflight_bytes"], m["max_inflight_bytes"]) == (0, 64 << 20)
    assert "spans" not in m and "rewards" not in m
