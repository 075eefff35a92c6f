"""A production session through the real load balancer in front of two real proxies, one of
which stops mid-session: the calls keep their order.

nginx runs the repository's config (rendered as tests/unit/test_load_balancer.py renders it)
in front of two proxy processes on this module's own topics, both before the stack's vLLM. A
session (the production route, ``x-spanrl-rollout-id``) makes two calls, which reach one
proxy; that proxy stops; nginx passes the next two calls to the other one. Each proxy numbered
its calls from 0 and stamped its instance; the spans' offsets in the rollout's partition,
read back from Kafka, put the four calls in the order they were made, and the assembler
(stream_jobs/assembly.py) emits them in that order (spanrl/core/call_order.py).
"""
from __future__ import annotations

import asyncio
import subprocess
import time
import uuid

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from spanrl.core.call_order import INSTANCE
from spanrl.core.production import ROLLOUT_HEADER
from spanrl.infra.stack import Stack
from spanrl.schemas import codec
from tests.integration.services import S, own_topics, start_service, stop, topic_prefix
from tests.unit.test_call_order import assemble
from tests.unit.test_load_balancer import CONFIGS, NGINX, free_port, render

pytestmark = pytest.mark.integration


@pytest.fixture
def units(tmp_path):
    """(nginx's URL, [(proxy process, its URL)] x 2, topics)."""
    Stack(S).start("vllm")
    with own_topics("lbtest") as topics:
        procs = []
        nginx = None
        try:
            for _ in range(2):
                procs.append(start_service("spanrl.producers.proxy", "--topic-prefix", topic_prefix(topics)))
            port = free_port()
            conf = tmp_path / "nginx.conf"
            conf.write_text(render(CONFIGS[0], [int(url.rsplit(":", 1)[1]) for _, url in procs], port, tmp_path))
            nginx = subprocess.Popen([NGINX, "-e", str(tmp_path / "error.log"), "-p", str(tmp_path), "-c", str(conf)])
            deadline = time.monotonic() + 10
            while True:
                try:
                    httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                    break
                except httpx.HTTPError:
                    assert nginx.poll() is None and time.monotonic() < deadline, (tmp_path / "error.log").read_text()
                    time.sleep(0.1)
            yield f"http://127.0.0.1:{port}", procs, topics
        finally:
            if nginx is not None:
                nginx.terminate()
                nginx.wait(10)
            for proc, _ in procs:
                if proc.poll() is None:
                    stop(proc)


def spans_with_offsets(topics, rollout_id: str, n: int, timeout_s: float = 20.0) -> list[tuple[int, int, dict]]:
    """(partition, offset, span) of the rollout's first ``n`` spans, in log order."""
    async def go():
        c = AIOKafkaConsumer(bootstrap_servers=S.kafka_bootstrap, enable_auto_commit=False,
                             isolation_level="read_committed")
        await c.start()
        try:
            tps = [TopicPartition(topics.spans.name, p) for p in range(topics.spans.partitions)]
            c.assign(tps)
            await c.seek_to_beginning(*tps)
            out: list = []
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and len(out) < n:
                for msgs in (await c.getmany(timeout_ms=300)).values():
                    out += [(m.partition, m.offset, codec.decode(topics.spans.record, m.value)) for m in msgs
                            if m.key == rollout_id.encode()]
            return sorted(out, key=lambda x: x[1])
        finally:
            await c.stop()
    return asyncio.run(go())


@pytest.mark.timeout(300)
def test_a_session_moved_by_a_unit_failure_keeps_its_call_order(units):
    url, procs, topics = units
    rid = f"lb-{uuid.uuid4().hex[:12]}"

    def call(k: int) -> None:  # call k asks for k + 1 tokens: its span says which call it was
        r = httpx.post(url + "/v1/chat/completions", headers={ROLLOUT_HEADER: rid}, timeout=120, json={
            "model": S.model_name, "max_tokens": k + 1, "messages": [{"role": "user", "content": f"Step {k}."}]})
        assert r.status_code == 200 and r.headers[ROLLOUT_HEADER] == rid, r.text

    call(0)
    call(1)
    served = [httpx.get(u + "/status", timeout=5).json().get("production_requests", 0) for _, u in procs]
    assert sorted(served) == [0, 2]  # the balancer kept the session on one unit
    first = served.index(2)
    stop(procs[first][0])  # the session's unit fails
    call(2)
    call(3)
    assert httpx.get(procs[1 - first][1] + "/status", timeout=5).json()["production_requests"] == 2

    spans = spans_with_offsets(topics, rid, 4)
    assert len({p for p, _, _ in spans}) == 1 and len(spans) == 4  # one partition: the rollout's
    assert [s["llm"]["max_tokens"] for _, _, s in spans] == [1, 2, 3, 4]  # the log holds the calls in order
    assert [s["sequence_id"] for _, _, s in spans] == [0, 1, 0, 1]  # two counters
    instances = [s["attributes"][INSTANCE] for _, _, s in spans]
    assert instances[0] == instances[1] != instances[2] == instances[3]
    out = assemble(rid, "0", [(s, (topics.spans.name, p, o)) for p, o, s in spans])
    assert out.dead_letters == []
    assert [t["span_id"] for t in out.transitions] == [s["span_id"] for _, _, s in spans]
