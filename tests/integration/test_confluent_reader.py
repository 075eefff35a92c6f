"""A third-party reader of the log, on the real stack: confluent-kafka's Consumer with its
``AvroDeserializer`` and ``SchemaRegistryClient`` pointed at the stack's schema registry
(Apicurio Registry's Confluent-compatible API) reads the ``spans`` and ``transitions`` records
of an attempt run through the stack's proxy, with no spanrl code, and gets what spanrl's own
decoder gets. The registry holds every schema under ``<topic>-value`` with the BACKWARD rule
and judges a change that drops a field without a default incompatible."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from spanrl.infra.replay import end_offsets
from spanrl.producers.runner import Runner
from spanrl.schemas import codec
from spanrl.schemas import topics as T
from tests.integration.test_export_stack import _agent  # one call "Say yes.", R = 1

pytestmark = pytest.mark.integration


def _read(settings, topic: str, start: dict[int, int], key: str, done, timeout_s: float = 90) -> list[tuple]:
    """``(value bytes, deserialized)`` of the records of ``topic`` keyed ``key`` from ``start``
    (partition -> offset), read by confluent-kafka until ``done(records so far)`` or ``timeout_s``."""
    deserialize = AvroDeserializer(SchemaRegistryClient({"url": settings.schema_registry_url}))
    consumer = Consumer({"bootstrap.servers": settings.kafka_bootstrap, "group.id": f"confluent-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "isolation.level": "read_committed"})
    consumer.assign([TopicPartition(topic, p, o) for p, o in start.items()])
    out: list[tuple] = []
    deadline = time.monotonic() + timeout_s
    try:
        while not done(out) and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is None or msg.error() or (msg.key() or b"").decode() != key:
                continue
            out.append((msg.value(), deserialize(msg.value(), SerializationContext(topic, MessageField.VALUE))))
    finally:
        consumer.close()
    return out


def test_confluent_kafka_reads_spans_and_transitions_through_the_registry(stack, settings):
    starts = {t: asyncio.run(end_offsets(settings.kafka_bootstrap, t.name)) for t in (T.SPANS, T.TRANSITIONS)}
    task = {"task_id": f"confluent-{uuid.uuid4().hex[:8]}", "payload": json.dumps({}), "group_size": 1,
            "timeout_s": 60}
    [[attempt]] = asyncio.run(Runner(_agent(settings.model_name), settings=settings, concurrency=1,
                                     timeout_s=60).run_tasks([task]))
    assert attempt.status == "succeeded", attempt.error

    spans = _read(settings, T.SPANS.name, starts[T.SPANS], attempt.rollout_id,
                  done=lambda out: any(got["llm"] for _, got in out))  # the proxy's span of the call
    assert any(got["llm"] for _, got in spans), "no call span of the attempt read"
    transitions = _read(settings, T.TRANSITIONS.name, starts[T.TRANSITIONS], task["task_id"], done=lambda out: out)
    assert len(transitions) == 1
    for (value, got), record_type in [*((s, "span") for s in spans), (transitions[0], "transition")]:
        assert value[:5] == b"\x00" + codec.DEFAULT.schema_id(record_type, codec.latest_version(record_type)).to_bytes(
            4, "big")
        assert got == codec.decode(record_type, value)
    llm = next(got["llm"] for _, got in spans if got["llm"])
    assert transitions[0][1]["completion_token_ids"] == llm["completion_token_ids"]
    assert transitions[0][1]["rollout_id"] == attempt.rollout_id


def test_the_registry_holds_the_subjects_under_the_backward_rule(stack, settings):
    url = settings.schema_registry_url
    subjects = httpx.get(f"{url}/subjects").json()
    assert {"spans-value", "transitions-value", "samples-value", "spanrl.Span"} <= set(subjects)
    assert httpx.get(f"{url}/config").json()["compatibilityLevel"] == settings.schema_compatibility == "BACKWARD"
    versions = httpx.get(f"{url}/subjects/spans-value/versions").json()
    assert [httpx.get(f"{url}/subjects/spans-value/versions/{v}").json()["id"] for v in versions] == [1, 2]
    span = json.loads(codec.DEFAULT.registry_schema("span", 2))
    # a new version that adds a field with no default: data written before it cannot be read
    bad = {**span, "fields": span["fields"] + [{"name": "must_have", "type": "string"}]}
    r = httpx.post(f"{url}/compatibility/subjects/spans-value/versions/latest", json={"schema": json.dumps(bad)},
                   headers={"Content-Type": "application/vnd.schemaregistry.v1+json"})
    assert r.status_code == 200 and r.json()["is_compatible"] is False
    good = {**span, "fields": span["fields"] + [{"name": "may_have", "type": "string", "default": ""}]}
    r = httpx.post(f"{url}/compatibility/subjects/spans-value/versions/latest", json={"schema": json.dumps(good)},
                   headers={"Content-Type": "application/vnd.schemaregistry.v1+json"})
    assert r.status_code == 200 and r.json()["is_compatible"] is True
