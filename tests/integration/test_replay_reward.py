"""A new reward on old episodes, on the real stack: ``replay(reward="module:function")``
re-scores each recorded attempt of a time window and trains on the new returns through the
stream job's credit and grouping.

One task (its record written to ``tasks``, as a main job does) runs as a group of two
attempts through the stack's proxy (real vLLM): the first makes one call, the second two;
both record R = 1. The grader below gives ``2 R - calls`` (1 and 0) and reads the task's
payload. A third attempt after ``until`` must not be replayed. The replay's transitions
carry the new returns, its samples the group's new advantages (+1, -1 over one group
of returns 1 and 0: population std 0.5), and a run trained from the base model publishes
version 1.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import openai
import pytest

from spanrl.infra.replay import ReplayConfig, output_topics, read_topic, replay
from spanrl.producers.kafka import make_producer
from spanrl.producers.runner import Runner
from spanrl.schemas import encode
from spanrl.schemas import topics as T
from spanrl.trainer import checkpoint

pytestmark = pytest.mark.integration

SEEN: list[tuple] = []


def grader(task, calls, recorded_reward):
    """The replay's new reward: ``2 R - number of calls`` (the task's payload must be there)."""
    SEEN.append((task["payload"], len(calls), recorded_reward))
    assert task["payload"] == {"answer": 4}
    return 2 * recorded_reward - len(calls)


def _agent(model: str):
    attempts = {"n": 0}

    async def agent(ctx) -> float:
        attempts["n"] += 1
        calls = 1 if attempts["n"] == 1 else 2
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            for _ in range(calls):
                await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "Compute 2+2."}], max_tokens=4)
        return 1.0
    return agent


async def _write_task(bootstrap: str, task: dict) -> None:
    producer = make_producer(bootstrap)
    await producer.start()
    try:
        await producer.send_and_wait(T.TASKS.name, encode("task", {**task, "created_ms": int(time.time() * 1000)}),
                                     key=task["task_id"].encode())
    finally:
        await producer.stop()


def test_a_new_reward_changes_the_returns_and_trains(stack, settings, scratch_run):
    since_ms = int(time.time() * 1000) - 1000
    task = {"task_id": f"rescore-{uuid.uuid4().hex[:8]}", "payload": json.dumps({"answer": 4}), "group_size": 2,
            "timeout_s": 60.0}
    asyncio.run(_write_task(settings.kafka_bootstrap, task))
    runner = Runner(_agent(settings.model_name), settings=settings, concurrency=1, timeout_s=60)
    [attempts] = asyncio.run(runner.run_tasks([task]))
    assert [a.status for a in attempts] == ["succeeded"] * 2, [a.error for a in attempts]
    time.sleep(1.5)
    until_ms = int(time.time() * 1000)
    time.sleep(1.5)
    late = {**task, "task_id": f"late-{uuid.uuid4().hex[:8]}", "group_size": 1}
    [[after]] = asyncio.run(Runner(_agent(settings.model_name), settings=settings, concurrency=1,
                                   timeout_s=60).run_tasks([late]))
    assert after.status == "succeeded"

    suffix = f"rw{uuid.uuid4().hex[:8]}"
    scratch_run(f"replay-{suffix}")
    result = replay(ReplayConfig(suffix=suffix, since_ms=since_ms, until_ms=until_ms,
                                 reward=f"{__name__}:grader", train_from="base", train_updates=1,
                                 train_max_batch=3, timeout_s=300, quiet_s=4))
    ids = {a.rollout_id: a for a in attempts}
    calls = {attempts[0].rollout_id: 1, attempts[1].rollout_id: 2}
    new = {k.split("/")[0]: v for k, v in result["returns"].items() if k.split("/")[0] in ids}
    assert new == {rid: {"recorded": 1.0, "new": 2.0 - n} for rid, n in calls.items()}
    assert sorted(SEEN) == [({"answer": 4}, 1, 1.0), ({"answer": 4}, 2, 1.0)]

    transitions_topic, samples_topic, _, _ = output_topics(suffix)
    replayed = asyncio.run(read_topic(settings.kafka_bootstrap, transitions_topic))
    assert after.rollout_id not in {t["rollout_id"] for t in replayed}  # after until: not replayed
    mine = [t for t in replayed if t["rollout_id"] in ids]
    assert sorted((t["rollout_id"], t["episode_return"]) for t in mine) == sorted(
        [(attempts[0].rollout_id, 1.0)] + [(attempts[1].rollout_id, 0.0)] * 2)
    samples = [s for s in asyncio.run(read_topic(settings.kafka_bootstrap, samples_topic))
               if s["transition"]["rollout_id"] in ids]
    assert len(samples) == 3
    for s in samples:  # GRPO over returns (1, 0): mean 0.5, population std 0.5
        assert s["group_mean"] == pytest.approx(0.5) and s["group_std"] == pytest.approx(0.5)
        assert s["advantage"] == pytest.approx(1.0 if s["transition"]["episode_return"] == 1.0 else -1.0, abs=1e-4)

    run = result["training"]["run"]
    assert result["training"]["from"] == "base"
    manifest = checkpoint.read_manifest(checkpoint.make_client(settings), settings.checkpoint_bucket, run, 1)
    assert manifest is not None and manifest["run"] == run and manifest["parent_version"] == 0  # from the base
    assert list(manifest["trained_offsets"]) == [f"{samples_topic.name}:0"]


def test_train_from_an_unknown_checkpoint_is_refused_before_replaying(stack, settings):
    from spanrl.infra.replay_inputs import ReplayError

    suffix = f"nock{uuid.uuid4().hex[:8]}"
    with pytest.raises(ReplayError, match=r"no checkpoint no-such-run:3 .*use no-such-run:0 or base"):
        replay(ReplayConfig(suffix=suffix, train_from="no-such-run:3"))
    names = asyncio.run(_topic_names(settings.kafka_bootstrap))
    assert f"transitions.{suffix}" not in names  # refused before anything was created


async def _topic_names(bootstrap: str) -> set[str]:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()
