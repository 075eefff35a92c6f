"""Two runners in one consumer group, one killed mid-task: every task's attempts finish once.

Each runner is its own process (``Runner.run`` on this module's own topics of the stack's
Kafka); the agent sleeps, so an attempt lasts long enough to be cut. Runner A is SIGKILLed
while it has attempts under way; runner B takes its partitions over (the group's session
time-out, then a rebalance), reads the commits' metadata and runs only the attempts A did not
finish (producers/runner.py, ``Runner.run``). The lifecycle events on ``rollouts`` then show,
per task, exactly ``group_size`` terminal events; A's cut attempts stay ``started`` (the stream
job times them out). A second test lets B join while A works: A finishes its tasks in flight
before its partitions go, B runs none of them again.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from spanrl.infra.stack import Stack
from spanrl.producers.runner import publish_tasks
from tests.integration.services import ROOT, S, own_topics, read_topic, topic_prefix

pytestmark = pytest.mark.integration

TERMINAL = {"succeeded", "failed", "timeout"}
GROUP_SIZE = 3
RUNNER = '''
import asyncio, sys

from spanrl.producers.kafka import Topics
from spanrl.producers.runner import Runner

prefix, group, runner_id, bootstrap = sys.argv[1:5]


async def agent(ctx):
    await asyncio.sleep(ctx.task["sleep_s"])
    return 1.0

runner = Runner(agent, concurrency=4, group_id=group, bootstrap=bootstrap, topics=Topics.with_prefix(prefix),
                runner_id=runner_id, telemetry=False)
asyncio.run(runner.run(idle_timeout_s=25))
'''


@pytest.fixture
def topics():
    Stack(S).start("kafka")
    with own_topics("tworun") as t:
        yield t


def start_runner(script: Path, topics, group: str, runner_id: str, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, str(script), topic_prefix(topics), group, runner_id, S.kafka_bootstrap],
                                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=out,
                                stderr=subprocess.STDOUT)


def lifecycle(topics, want=lambda rs: False, timeout_s: float = 5.0) -> list[dict]:
    return [r for _, r in read_topic(topics.rollouts, want, timeout_s)]


def terminal_per_task(events: list[dict]) -> Counter:
    return Counter(e["task_id"] for e in events if e["status"] in TERMINAL)


def committed_all(topics, group: str) -> bool:
    async def go():
        c = AIOKafkaConsumer(bootstrap_servers=S.kafka_bootstrap, group_id=group, enable_auto_commit=False)
        await c.start()
        try:
            tps = [TopicPartition(topics.tasks.name, p) for p in range(topics.tasks.partitions)]
            ends = await c.end_offsets(tps)
            return all((await c.committed(tp) or 0) == ends[tp] for tp in tps)
        finally:
            await c.stop()
    return asyncio.run(go())


def publish(topics, n: int, sleep_s: float) -> list[str]:
    return asyncio.run(publish_tasks([{"payload": json.dumps({"sleep_s": sleep_s}), "group_size": GROUP_SIZE,
                                       "timeout_s": 60} for _ in range(n)], S.kafka_bootstrap, topics))


@pytest.mark.timeout(300)
def test_a_killed_runners_attempts_finish_once_elsewhere(topics, tmp_path):
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    group = f"tworun-{uuid.uuid4().hex[:6]}"
    ids = publish(topics, 12, sleep_s=3.0)
    a = start_runner(script, topics, group, "A", tmp_path / "a.log")
    b = start_runner(script, topics, group, "B", tmp_path / "b.log")
    try:
        # both runners own partitions and A has attempts under way, some finished
        def a_mid_task(rs):
            a_started = {r["rollout_id"] for _, r in rs if r["runner_id"] == "A" and r["status"] == "started"}
            a_ended = {r["rollout_id"] for _, r in rs if r["runner_id"] == "A" and r["status"] in TERMINAL}
            b_started = any(r["runner_id"] == "B" for _, r in rs)
            return b_started and len(a_ended) >= 1 and len(a_started - a_ended) >= 1
        assert a_mid_task(read_topic(topics.rollouts, a_mid_task, 90)), (tmp_path / "a.log").read_text()[-3000:]
        a.send_signal(signal.SIGKILL)
        a.wait(10)
        cut = lifecycle(topics)
        a_started = {e["rollout_id"] for e in cut if e["runner_id"] == "A" and e["status"] == "started"}
        a_ended = {e["rollout_id"] for e in cut if e["runner_id"] == "A" and e["status"] in TERMINAL}

        lifecycle(topics, lambda rs: set(terminal_per_task([r for _, r in rs])) == set(ids)
                  and min(terminal_per_task([r for _, r in rs]).values()) >= GROUP_SIZE, 180)
        assert b.wait(120) == 0, (tmp_path / "b.log").read_text()[-3000:]  # idle, then out
        events = lifecycle(topics, timeout_s=3)  # everything, after B stopped
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert terminal_per_task(events) == {tid: GROUP_SIZE for tid in ids}  # none missing, none twice
    after_kill = {e["rollout_id"] for e in events if e["runner_id"] == "A" and e["status"] in TERMINAL}
    assert after_kill == a_ended  # A's cut attempts never end ...
    assert a_started - a_ended  # ... and there were some
    b_tasks = {e["task_id"] for e in events if e["runner_id"] == "B"}
    a_tasks = {e["task_id"] for e in events if e["runner_id"] == "A"}
    assert a_tasks & b_tasks  # B finished tasks A had begun
    assert committed_all(topics, group)


@pytest.mark.timeout(240)
def test_a_joining_runner_takes_over_without_rerunning(topics, tmp_path):
    """B joins while A has tasks in flight: A finishes them before its partitions go (the
    rebalance waits for it), B starts after them; no attempt runs twice, none is cut."""
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    group = f"tworun-{uuid.uuid4().hex[:6]}"
    ids = publish(topics, 16, sleep_s=1.5)  # B's partitions get some of those left: all but 1 in 4096
    a = start_runner(script, topics, group, "A", tmp_path / "a.log")
    b = None
    try:
        read_topic(topics.rollouts, lambda rs: any(r["status"] == "started" for _, r in rs), 60)
        b = start_runner(script, topics, group, "B", tmp_path / "b.log")
        assert a.wait(150) == 0, (tmp_path / "a.log").read_text()[-3000:]
        assert b.wait(60) == 0, (tmp_path / "b.log").read_text()[-3000:]
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    events = lifecycle(topics, timeout_s=3)
    assert terminal_per_task(events) == {tid: GROUP_SIZE for tid in ids}
    started = Counter(e["status"] for e in events)
    assert started["started"] == started["succeeded"] == len(ids) * GROUP_SIZE  # nothing cut, nothing twice
    assert {e["runner_id"] for e in events} == {"A", "B"}
    assert committed_all(topics, group)
