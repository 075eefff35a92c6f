"""AIR on the real stack: the same spans replayed with intermediate rewards on give other
``reward`` values than without them, exactly where a tool call failed.

An agent run by the runner makes two calls through the stack's proxy (real vLLM) and, after
each, runs the math agent's calculator (examples/math_agent/agent.py ``run_calculator``),
whose OTel tool span reaches the stack's bridge: ``1/0`` after call 0 (the span fails:
``tool_error``), ``2+2`` after call 1 (``tool_ok``); final reward R = 1. The stack's worker
assembles it without AIR (``transitions``); a replay of the same stored spans with
``SPANRL_AIR_RULES=tool_error:-0.25,tool_ok:0.05`` writes ``transitions.<suffix>``: call 0
gets R - 0.25, call 1 R + 0.05, same token ids.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import openai
import pytest

from examples.math_agent.agent import run_calculator
from spanrl.infra.replay import ReplayConfig, output_topics, read_topic, replay
from spanrl.producers.runner import Runner
from spanrl.schemas import topics as T

pytestmark = pytest.mark.integration


def _agent(model: str):
    async def agent(ctx) -> float:
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            for expr in ("1/0", "2+2"):
                await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": f"Compute {expr}."}], max_tokens=4)
                run_calculator(expr)  # the tool runs after the call whose answer asked for it
        return 1.0
    return agent


def _wait_transitions(bootstrap: str, topic: T.Topic, rid: str, n: int, timeout_s: float) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        got = [t for t in asyncio.run(read_topic(bootstrap, topic)) if t["rollout_id"] == rid]
        if len(got) >= n or time.monotonic() > deadline:
            return sorted(got, key=lambda t: t["call_index"])
        time.sleep(1.0)


def test_air_on_and_off_from_the_same_spans(stack, settings):
    since_ms = int(time.time() * 1000) - 1000
    task = {"task_id": f"air-{uuid.uuid4().hex[:8]}", "payload": json.dumps({}), "group_size": 1, "timeout_s": 60}
    runner = Runner(_agent(settings.model_name), settings=settings, concurrency=1, timeout_s=60)
    [[attempt]] = asyncio.run(runner.run_tasks([task]))
    assert attempt.status == "succeeded", attempt.error
    rid = attempt.rollout_id

    off = _wait_transitions(settings.kafka_bootstrap, T.TRANSITIONS, rid, 2, 90)  # the stack's worker: no AIR
    assert [(t["reward"], t["intermediate_reward"], t["air_rules"]) for t in off] == [(1.0, 0.0, "")] * 2

    suffix = f"air{uuid.uuid4().hex[:8]}"
    result = replay(ReplayConfig(suffix=suffix, air_rules="tool_error:-0.25,tool_ok:0.05", since_ms=since_ms,
                                 timeout_s=240, quiet_s=4))
    assert result["air_rules"] == "tool_error:-0.25,tool_ok:0.05"
    on = _wait_transitions(settings.kafka_bootstrap, output_topics(suffix)[0], rid, 2, 30)
    assert [t["span_id"] for t in on] == [t["span_id"] for t in off]
    assert [t["completion_token_ids"] for t in on] == [t["completion_token_ids"] for t in off]
    assert [t["intermediate_reward"] for t in on] == [-0.25, 0.05]
    assert [t["reward"] for t in on] == [0.75, 1.05]
    assert all(t["episode_return"] == 1.0 and t["air_rules"] == "tool_error:-0.25,tool_ok:0.05" for t in on)
