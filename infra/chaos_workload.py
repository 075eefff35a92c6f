"""The chaos run's agent and runner process: a workload of known size and known rewards.

    python -m spanrl.infra.chaos_workload --tasks-topic T --ack-log F [--calls 3] [--pace 0.5]

A :class:`spanrl.producers.runner.Runner` consumes the run's own tasks topic; each attempt makes
``calls`` chat completions through the LLM proxy (real vLLM behind it), then sends one
OTLP tool span and its final reward (:func:`spanrl.infra.ledger.known_reward` of its rollout id)
to an OTLP bridge over HTTP (one of the stack's, by rollout id: :func:`bridge_for`). Every 2xx
answer is appended to ``ack_log`` (JSON lines) before the next step: that log is what the client
was promised, and the ledger checks each entry is in Kafka. The process exits after ``idle_s`` without a new task.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import time
import zlib
from dataclasses import replace
from pathlib import Path

import httpx
import openai
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from spanrl.core.edge import bearer_headers
from spanrl.core.settings import get_settings
from spanrl.infra.ledger import known_reward
from spanrl.producers.kafka import Topics
from spanrl.producers.runner import RolloutContext, Runner
from spanrl.schemas import topics as T

#: how long a client keeps retrying the bridge (503 / connection refused) before giving up
BRIDGE_DEADLINE_S = 120.0


class AckLog:
    """Append-only JSON-lines log of acknowledged requests (flushed per line)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, **entry) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(entry, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    @staticmethod
    def read(path: Path) -> list[dict]:
        if not Path(path).exists():
            return []
        out = []
        for line in Path(path).read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # a line cut by SIGKILL was never acknowledged to anyone
                pass
        return out


def tool_span_request(rollout_id: str, attempt_id: str, span_id: str) -> bytes:
    """One OTLP/HTTP protobuf request holding one tool span of the attempt."""
    req = ExportTraceServiceRequest()
    s = req.resource_spans.add().scope_spans.add().spans.add()
    s.trace_id, s.span_id, s.name = secrets.token_bytes(16), bytes.fromhex(span_id), "tool.chaos_lookup"
    now = time.time_ns()
    s.start_time_unix_nano, s.end_time_unix_nano = now - 1000, now
    for k, v in (("spanrl.rollout_id", rollout_id), ("spanrl.attempt_id", attempt_id)):
        s.attributes.append(KeyValue(key=k, value=AnyValue(string_value=v)))
    return req.SerializeToString()


async def post_until_acked(client: httpx.AsyncClient, url: str, deadline_s: float = BRIDGE_DEADLINE_S,
                           **kwargs) -> httpx.Response:
    """POST until a 2xx; wait Retry-After on 503 and 1 s on connection errors.

    Raises RuntimeError after ``deadline_s`` or on any other status (a 4xx is our bug)."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            r = await client.post(url, **kwargs)
            if r.status_code < 300:
                return r
            if r.status_code != 503:
                raise RuntimeError(f"{url}: {r.status_code} {r.text[:200]}")
            wait = min(5.0, float(r.headers.get("retry-after", "1")))
        except httpx.TransportError:
            wait = 1.0
        if time.monotonic() + wait > deadline:
            raise RuntimeError(f"{url}: not acknowledged within {deadline_s:.0f}s")
        await asyncio.sleep(wait)


def bridge_for(rollout_id: str, bridge_urls: list[str]) -> str:
    """The bridge a rollout's spans and rewards go to: ``bridge_urls[crc32(rollout_id) % n]``
    (stable across processes and restarts, as a load balancer's hash on the rollout would be;
    any bridge could take any export: they are stateless). Raises ValueError for no bridges."""
    if not bridge_urls:
        raise ValueError("no bridge to send to")
    return bridge_urls[zlib.crc32(rollout_id.encode()) % len(bridge_urls)]


def make_agent(calls: int, pace_s: float, acks: AckLog, bridge_urls: list[str], model: str):
    """The async agent callable for :class:`Runner` (see module doc)."""

    async def agent(ctx: RolloutContext) -> None:
        bridge_url = bridge_for(ctx.rollout_id, bridge_urls)
        llm = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=3, timeout=60)
        async with httpx.AsyncClient(timeout=30, headers=bearer_headers(get_settings().auth_token)) as http:
            for t in range(calls):
                r = await llm.chat.completions.create(
                    model=model, max_tokens=4, temperature=1.0,
                    messages=[{"role": "user", "content": f"Task {ctx.task.get('n')}, step {t}: name a number."}])
                acks.add(kind="call", rollout_id=ctx.rollout_id, attempt_id=ctx.attempt_id, request_id=r.id)
                await asyncio.sleep(pace_s)
            span_id = secrets.token_hex(8)
            await post_until_acked(http, f"{bridge_url}/v1/traces",
                                   content=tool_span_request(ctx.rollout_id, ctx.attempt_id, span_id),
                                   headers={"content-type": "application/x-protobuf"})
            acks.add(kind="span", rollout_id=ctx.rollout_id, attempt_id=ctx.attempt_id, span_id=span_id,
                     bridge=bridge_url)
            value = known_reward(ctx.rollout_id)
            await post_until_acked(http, f"{bridge_url}/v1/rewards",
                                   json={"rollout_id": ctx.rollout_id, "attempt_id": ctx.attempt_id,
                                         "value": value, "final": True, "name": "chaos"})
            acks.add(kind="reward", rollout_id=ctx.rollout_id, attempt_id=ctx.attempt_id, value=value)
        await llm.close()

    return agent


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks-topic", required=True)
    p.add_argument("--ack-log", required=True, type=Path)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--pace", type=float, default=0.5)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--idle-s", type=float, default=8.0)
    p.add_argument("--group-id", default="spanrl-chaos-runners")
    a = p.parse_args(argv)
    s = get_settings()
    topics = replace(Topics(), tasks=replace(T.TASKS, name=a.tasks_topic, partitions=1))
    runner = Runner(make_agent(a.calls, a.pace, AckLog(a.ack_log), s.bridge_urls, s.model_name),
                    concurrency=a.concurrency, group_id=a.group_id, topics=topics, timeout_s=300)
    asyncio.run(runner.run(idle_timeout_s=a.idle_s))


if __name__ == "__main__":
    main()
