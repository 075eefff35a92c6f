"""The stream app end to end against the real Kafka (settings.kafka_bootstrap).

Runs ``python -m stream_jobs.app worker`` as a subprocess on private topics
(``sjtest-<uuid>-*``) and a private app id, produces 2 tasks x 2 rollouts x 2 LLM calls
(+ a tool span, a re-delivered span, one undecodable record) and checks exactly what
reaches transitions, samples and dead-letter.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

from infra.stack import stop_process_group

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from infra.settings import get_settings
from schemas import codec, topics

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
EPS = 1e-6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _span(rid, seq, sid, kind="llm", prompt=(1, 2), completion=(3, 4)):
    return {
        "rollout_id": rid, "attempt_id": "a0", "sequence_id": seq, "trace_id": "t" * 32,
        "span_id": sid, "name": "chat" if kind == "llm" else "tool", "kind": kind,
        "source": "proxy" if kind == "llm" else "otlp", "start_time_unix_nano": seq,
        "end_time_unix_nano": seq + 1, "agent_name": "solver",
        "llm": None if kind != "llm" else {
            "model": "policy", "policy_version": 0, "prompt_token_ids": list(prompt),
            "completion_token_ids": list(completion), "completion_logprobs": [-0.5] * len(completion),
            "request_id": f"req-{sid}"},
    }


def _rollout_event(rid, task, status):
    return {"rollout_id": rid, "attempt_id": "a0", "task_id": task, "status": status,
            "group_size": 2, "timestamp_ms": 1}


async def _run(names: dict[str, str], web_port: int, proc: subprocess.Popen, deadline: float):
    bootstrap = get_settings().kafka_bootstrap
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    returns = {("task-a", "ra1"): 1.0, ("task-a", "ra2"): 0.0,
               ("task-b", "rb1"): 2.0, ("task-b", "rb2"): 0.0}
    try:
        for (task, rid), R in returns.items():
            key = rid.encode()
            # out of order on purpose: lifecycle end first, calls in reverse order
            await producer.send_and_wait(names["rollouts"], codec.encode("rollout", _rollout_event(rid, task, "started")), key=key)
            await producer.send_and_wait(names["spans"], codec.encode("span", _span(rid, 2, f"{rid}-c2", completion=(7, 8, 9))), key=key)
            await producer.send_and_wait(names["spans"], codec.encode("span", _span(rid, 1, f"{rid}-tool", kind="tool")), key=key)
            await producer.send_and_wait(names["spans"], codec.encode("span", _span(rid, 0, f"{rid}-c0")), key=key)
            await producer.send_and_wait(names["spans"], codec.encode("span", _span(rid, 0, f"{rid}-c0")), key=key)  # re-delivered
            await producer.send_and_wait(names["rollouts"], codec.encode("rollout", _rollout_event(rid, task, "succeeded")), key=key)
            await producer.send_and_wait(names["rewards"], codec.encode("reward", {
                "rollout_id": rid, "attempt_id": "a0", "value": R, "final": True, "timestamp_ms": 2}), key=key)
        await producer.send_and_wait(names["spans"], b"not avro at all", key=b"rbad")
    finally:
        await producer.stop()

    consumer = AIOKafkaConsumer(names["transitions"], names["samples"], names["dead-letter"],
                                bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                isolation_level="read_committed", group_id=None)
    await consumer.start()
    got = {"transitions": [], "samples": [], "dead-letter": []}
    by_topic = {names[k]: k for k in got}
    try:
        while time.monotonic() < deadline:
            assert proc.poll() is None, "worker died"
            batch = await consumer.getmany(timeout_ms=500)
            for tp, msgs in batch.items():
                kind = by_topic[tp.topic]
                for m in msgs:
                    record = codec.decode({"transitions": "transition", "samples": "sample",
                                           "dead-letter": "dead_letter"}[kind], m.value)
                    got[kind].append((m.key, record))
            if len(got["transitions"]) >= 8 and len(got["samples"]) >= 8 and got["dead-letter"]:
                await asyncio.sleep(2)  # anything extra would show up now
                for tp, msgs in (await consumer.getmany(timeout_ms=1000)).items():
                    got[by_topic[tp.topic]] += [(m.key, None) for m in msgs]
                break
    finally:
        await consumer.stop()
    counters = json.loads(urllib.request.urlopen(
        f"http://127.0.0.1:{web_port}/spanrl/counters/", timeout=5).read())
    return got, counters, returns


async def _admin(op, names, app_id=None):
    admin = AIOKafkaAdminClient(bootstrap_servers=get_settings().kafka_bootstrap)
    await admin.start()
    try:
        if op == "create":
            base = {"spans": topics.SPANS, "rewards": topics.REWARDS, "rollouts": topics.ROLLOUTS,
                    "transitions": topics.TRANSITIONS, "samples": topics.SAMPLES,
                    "dead-letter": topics.DEAD_LETTER}
            await admin.create_topics([NewTopic(names[k], t.partitions, 1, topic_configs=t.config())
                                       for k, t in base.items()])
        else:
            existing = await admin.list_topics()
            doomed = [t for t in existing if t in names.values() or (app_id and t.startswith(app_id))]
            if doomed:
                await admin.delete_topics(doomed)
    finally:
        await admin.close()


def test_stream_app_end_to_end(tmp_path, stack):
    suffix = uuid.uuid4().hex[:8]
    names = {k: f"sjtest-{suffix}-{k}" for k in
             ("spans", "rewards", "rollouts", "transitions", "samples", "dead-letter")}
    app_id = f"sjtest-stream-{suffix}"
    web_port = _free_port()
    asyncio.run(_admin("create", names))
    env = {**os.environ, "SPANRL_STREAM_APP_ID": app_id, "SPANRL_FAUST_WEB_PORT": str(web_port),
           "SPANRL_SPANS_TOPIC": names["spans"], "SPANRL_REWARDS_TOPIC": names["rewards"],
           "SPANRL_ROLLOUTS_TOPIC": names["rollouts"], "SPANRL_TRANSITIONS_TOPIC": names["transitions"],
           "SPANRL_SAMPLES_TOPIC": names["samples"], "SPANRL_DEAD_LETTER_TOPIC": names["dead-letter"],
           "SPANRL_REWARD_TIMEOUT_S": "30", "SPANRL_GROUP_TIMEOUT_S": "60"}
    log = open(tmp_path / "worker.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "stream_jobs.app", "worker", "-l", "info"],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        got, counters, returns = asyncio.run(_run(names, web_port, proc, time.monotonic() + 80))
    finally:
        stop_process_group(proc, grace_s=15)
        log.close()
        try:
            asyncio.run(_admin("delete", names, app_id))
        except Exception:
            pass
    worker_log = (tmp_path / "worker.log").read_text(errors="replace")[-4000:]

    # transitions: 4 rollouts x 2 calls, each rollout in call order, reward = R (identical credit)
    trs = got["transitions"]
    assert len(trs) == 8, (counters, got["dead-letter"], worker_log)
    by_rollout: dict[str, list[dict]] = {}
    for key, t in trs:
        assert key == t["task_id"].encode()
        by_rollout.setdefault(t["rollout_id"], []).append(t)
    for (task, rid), R in returns.items():
        ts = by_rollout[rid]
        assert [t["span_id"] for t in ts] == [f"{rid}-c0", f"{rid}-c2"]
        assert [t["call_index"] for t in ts] == [0, 1]
        assert all(t["task_id"] == task and t["rollout_transition_count"] == 2 for t in ts)
        assert [t["reward"] for t in ts] == [R, R]
        assert [t["episode_return"] for t in ts] == [R, R]
        assert ts[1]["completion_token_ids"] == [7, 8, 9]
        assert ts[1]["behaviour_logprobs"] == [-0.5, -0.5, -0.5]
        assert all(t["status"] == "succeeded" and t["credit_rule"] == "identical" for t in ts)

    # samples: GRPO inside each task, population std
    samples = got["samples"]
    assert len(samples) == 8, worker_log
    adv = {("task-a", "ra1"): 0.5 / (0.5 + EPS), ("task-a", "ra2"): -0.5 / (0.5 + EPS),
           ("task-b", "rb1"): 1.0 / (1.0 + EPS), ("task-b", "rb2"): -1.0 / (1.0 + EPS)}
    for key, s in samples:
        t = s["transition"]
        assert key == t["task_id"].encode()
        assert s["group_id"] == f"{t['task_id']}/0"
        assert s["group_rollouts"] == 2
        assert s["advantage"] == pytest.approx(adv[(t["task_id"], t["rollout_id"])], abs=1e-12)
        assert (s["group_mean"], s["group_std"]) == ((0.5, 0.5) if t["task_id"] == "task-a" else (1.0, 1.0))

    # dead letters: exactly the undecodable record
    dead = got["dead-letter"]
    assert len(dead) == 1, dead
    key, d = dead[0]
    assert d["reason"] == "schema_error" and d["stage"] == "assembler"
    assert d["source_topic"] == names["spans"] and d["payload"] == b"not avro at all"
    assert d["rollout_id"] == "rbad" and d["source_offset"] is not None

    assert counters == {"spans_in": 17, "rewards_in": 4, "rollout_events_in": 8,
                        "transitions_out": 8, "samples_out": 8,
                        "dead_letters_out": {"schema_error": 1}}
