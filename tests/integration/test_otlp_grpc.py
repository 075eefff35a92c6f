"""OTLP/gRPC against the real Kafka: an agent configured only by the OpenTelemetry
environment variables (``OTEL_EXPORTER_OTLP_PROTOCOL=grpc``, ``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_EXPORTER_OTLP_HEADERS``; tests/fixtures/otlp_env_agent.py, no spanrl code) exports to
the bridge's gRPC port and its spans are in Kafka when its exporter got the answer: first a
bridge from this checkout on this module's own topics with a bearer token, then the stack's
own bridge (``spanrl stack up`` starts it with ``SPANRL_BRIDGE_GRPC_PORT``)."""
from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
import uuid

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from spanrl.core.edge import bearer_headers, token_value
from spanrl.infra.stack import Stack
from spanrl.producers.kafka import Topics
from spanrl.schemas import codec
from tests.integration.services import S, free_port, of_rollout, own_topics, read_topic, start_service, stop
from tests.integration.services import topic_prefix as _prefix
from tests.unit.test_producers_otlp_grpc import ENV_AGENT, otel_env

pytestmark = pytest.mark.integration


def run_agent(rollout_id: str, endpoint: str, token: str | None, *args: str) -> subprocess.CompletedProcess:
    """The agent with OTEL_* naming an OTLP/gRPC export to ``endpoint`` (and nothing else)."""
    return subprocess.run([sys.executable, str(ENV_AGENT), rollout_id, *args], env=otel_env("grpc", endpoint, token),
                          capture_output=True, text=True, timeout=90)


@pytest.fixture(scope="module")
def bridge():
    """A bridge from this checkout with a gRPC port of its own and a bearer token."""
    Stack(S).start("kafka")
    token = "grpc-" + secrets.token_urlsafe(16)
    grpc_port = free_port()
    with own_topics("grpctest") as topics:
        proc, url = start_service("spanrl.producers.bridge", "--topic-prefix", _prefix(topics),
                                  "--grpc-port", str(grpc_port), env={"SPANRL_AUTH_TOKEN": token})
        try:
            yield topics, url, f"http://{S.host}:{grpc_port}", token
        finally:
            stop(proc)


def test_env_configured_grpc_exporter_reaches_kafka(bridge):
    topics, url, endpoint, token = bridge
    rid = f"grpc-{uuid.uuid4().hex[:12]}"
    done = run_agent(rid, endpoint, token)
    assert done.returncode == 0, done.stderr
    spans = of_rollout(read_topic(topics.spans, lambda rs: len(of_rollout(rs, rid)) >= 3, 10), rid)
    by_name = {s["name"]: s for s in spans}
    assert sorted(by_name) == ["agent.solve", "spanrl.reward", "tool.search"]
    assert (by_name["tool.search"]["kind"], by_name["tool.search"]["source"]) == ("tool", "otlp")
    assert by_name["agent.solve"]["agent_name"] == "solver"
    assert by_name["tool.search"]["parent_span_id"] == by_name["agent.solve"]["span_id"]
    rewards = of_rollout(read_topic(topics.rewards, lambda rs: bool(of_rollout(rs, rid)), 10), rid)
    assert [(r["value"], r["attempt_id"]) for r in rewards] == [(0.5, "0")]
    status = httpx.get(url + "/status", headers=bearer_headers(token)).json()
    assert status["grpc_requests"] >= 1 and status["spans"] >= 3

    # a wrong token: UNAUTHENTICATED (not retried), nothing recorded
    wrong = f"grpc-{uuid.uuid4().hex[:12]}"
    done = run_agent(wrong, endpoint, "not-the-token")
    assert done.returncode == 0 and "UNAUTHENTICATED" in done.stderr, done.stderr
    after = httpx.get(url + "/status", headers=bearer_headers(token)).json()
    assert after["grpc_UNAUTHENTICATED"] >= 1 and after["invalid_token"] >= 1
    assert not of_rollout(read_topic(topics.spans, lambda rs: False, 3), wrong)


def _end_offsets(topic) -> dict[int, int]:
    async def go():
        c = AIOKafkaConsumer(bootstrap_servers=S.kafka_bootstrap)
        await c.start()
        try:
            tps = [TopicPartition(topic.name, p) for p in range(topic.partitions)]
            return {tp.partition: o for tp, o in (await c.end_offsets(tps)).items()}
        finally:
            await c.stop()

    return asyncio.run(go())


def _read_from(topic, offsets: dict[int, int], rid: str, want: int, timeout_s: float = 20.0) -> list[dict]:
    """Records of rollout ``rid`` on ``topic`` after ``offsets`` (the stack's topics are long)."""
    async def go():
        c = AIOKafkaConsumer(bootstrap_servers=S.kafka_bootstrap, enable_auto_commit=False,
                             isolation_level="read_committed")
        await c.start()
        try:
            tps = [TopicPartition(topic.name, p) for p in offsets]
            c.assign(tps)
            for tp in tps:
                c.seek(tp, offsets[tp.partition])
            out: list[dict] = []
            deadline = asyncio.get_running_loop().time() + timeout_s
            while len(out) < want and asyncio.get_running_loop().time() < deadline:
                for msgs in (await c.getmany(timeout_ms=300)).values():
                    out += [r for m in msgs if m.key == rid.encode()
                            for r in [codec.decode(topic.record, m.value)]]
            return out
        finally:
            await c.stop()

    return asyncio.run(go())


def test_the_stacks_bridge_serves_otlp_grpc():
    """``spanrl stack up``'s bridge listens on SPANRL_BRIDGE_GRPC_PORT and says so in status; a
    bridge started before it had a gRPC receiver is not healthy and is restarted here. The
    spans are evaluation spans (``spanrl.record_to=eval``): the stack's stream job and
    trainer never see them."""
    stack = Stack(S)
    stack.start("kafka")
    if stack.running("bridge") and not stack.healthy("bridge"):
        stack.stop("bridge")
    stack.start("bridge")
    [(_, running, healthy, where)] = [row for row in stack.status() if row[0] == "bridge"]
    assert running and healthy and S.bridge_grpc_endpoint in where
    topics = Topics.evaluation()
    before = _end_offsets(topics.spans)
    rid = f"grpc-stack-{uuid.uuid4().hex[:12]}"
    done = run_agent(rid, S.bridge_grpc_endpoint, token_value(S.auth_token), "eval")
    assert done.returncode == 0, done.stderr
    spans = _read_from(topics.spans, before, rid, 3)
    assert sorted(s["name"] for s in spans) == ["agent.solve", "spanrl.reward", "tool.search"]
    assert httpx.get(S.bridge_url + "/status", headers=bearer_headers(S.auth_token)).json()["grpc_port"] == \
        S.bridge_grpc_port
