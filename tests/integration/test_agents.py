"""The paper's other two agents through the real stack (proxy, bridge, Faust, Kafka), with
each LLM call's agent resolved from the framework's own telemetry: the LangGraph
text-to-SQL team (OpenInference LangChain spans) and the OpenAI Agents SDK retrieval agent
(OpenInference Agents SDK spans). No agent sends a spanrl header. The SQL team is then
replayed with only write_query and rewrite_query selected: check_query's calls are
recorded and counted as excluded, never trained."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest

from examples.agents import agent_spec
from spanrl.infra.evaluation import load_agent
from spanrl.infra.replay import ReplayConfig, agent_counts, output_topics, read_topic, replay
from spanrl.producers.runner import Runner, make_task
from spanrl.schemas import topics as T

pytestmark = pytest.mark.integration


def _run_episodes(name: str, tasks: list[dict], settings) -> list:
    runner = Runner(load_agent(agent_spec(name).RUNNER), settings=settings, concurrency=2, timeout_s=300,
                    group_id=f"agtest-{uuid.uuid4().hex[:6]}")

    async def main():
        try:
            return await asyncio.gather(*(runner.run_attempt(
                make_task(json.dumps(t), group_size=2, task_id=t["task_id"], timeout_s=300), k)
                for t in tasks for k in range(2)))
        finally:
            await runner.sink.stop()

    return asyncio.run(main())


def _records_of(settings, topic: T.Topic, ids: set[str], n: int, timeout_s: float = 300) -> list[dict]:
    """Records of ``topic`` for rollouts ``ids``, once ``n`` rollouts have one; fails after
    ``timeout_s`` naming what the stream job counted and dead-lettered meanwhile."""
    deadline = time.monotonic() + timeout_s
    while True:
        recs = [r for r in asyncio.run(read_topic(settings.kafka_bootstrap, topic)) if r["rollout_id"] in ids]
        if len({r["rollout_id"] for r in recs}) >= n:
            return recs
        if time.monotonic() > deadline:
            counters = httpx.get(f"http://{settings.host}:{settings.faust_web_port}/spanrl/counters/", timeout=5).json()
            pytest.fail(f"{len(recs)} records of {topic.name} for {n} rollouts after {timeout_s}s; "
                        f"stream job counters: {counters}")
        time.sleep(2)


def test_rag_agent_calls_are_named_by_the_agents_sdk_telemetry(stack, settings):
    tasks = agent_spec("rag").load_tasks("train", 0, 2)
    attempts = _run_episodes("rag", tasks, settings)
    assert [a.status for a in attempts] == ["succeeded"] * 4, [a.error for a in attempts]
    ids = {a.rollout_id for a in attempts}
    accounts = _records_of(settings, T.CALL_ACCOUNTS, ids, len(ids))
    assert len(accounts) == 4 and all(a["outcome"] == "emitted" for a in accounts)
    for acc in accounts:
        # query_writer (two hops) then answerer, each named by its Agents SDK agent span
        assert [(c["agent_name"], c["agent_source"]) for c in acc["calls"]] == [
            ("query_writer", "telemetry"), ("query_writer", "telemetry"), ("answerer", "telemetry")]
    transitions = _records_of(settings, T.TRANSITIONS, ids, len(ids))
    assert sorted(t["agent_name"] for t in transitions) == ["answerer"] * 4 + ["query_writer"] * 8
    # the reward is the agent's F1 reward of its answer, as emitted with its components
    rewards = {r["rollout_id"]: r for r in _records_of(settings, T.REWARDS, ids, len(ids)) if r["final"]}
    for a in attempts:
        r = rewards[a.rollout_id]
        assert r["value"] == pytest.approx(a.result["reward"]) and set(r["components"]) >= {"f1", "format", "correct"}
        assert r["value"] == pytest.approx(0.9 * r["components"]["f1"] + 0.1 * r["components"]["format"])


def test_sql_team_check_query_is_recorded_and_excluded_on_replay(stack, settings):
    t0_ms = int(time.time() * 1000)
    tasks = agent_spec("sql").load_tasks("train", 0, 2)
    attempts = _run_episodes("sql", tasks, settings)
    assert [a.status for a in attempts] == ["succeeded"] * 4, [a.error for a in attempts]
    ids = {a.rollout_id for a in attempts}
    roles = {"write_query", "check_query", "rewrite_query"}
    accounts = _records_of(settings, T.CALL_ACCOUNTS, ids, len(ids))
    assert len(accounts) == 4
    for acc in accounts:  # the live job trains every agent; each call named by its LangGraph node
        names = [c["agent_name"] for c in acc["calls"]]
        assert names[:2] == ["write_query", "check_query"] and set(names) <= roles, names
        assert {c["agent_source"] for c in acc["calls"]} == {"telemetry"} and all(c["trained"] for c in acc["calls"])
    # the reward comes from executing the SQL on the database
    rewards = {r["rollout_id"]: r for r in _records_of(settings, T.REWARDS, ids, len(ids)) if r["final"]}
    for a in attempts:
        assert rewards[a.rollout_id]["value"] == pytest.approx(a.result["reward"])
        assert set(rewards[a.rollout_id]["components"]) >= {"correct", "format", "executed"}

    # replay the same stored spans, training only the query writers
    suffix = f"sel{uuid.uuid4().hex[:8]}"
    result = replay(ReplayConfig(suffix=suffix, since_ms=t0_ms - 1000, train_agents="write_query,rewrite_query",
                                 timeout_s=400))
    transitions_topic, _, _, accounts_topic = output_topics(suffix)
    replayed = [t for t in asyncio.run(read_topic(settings.kafka_bootstrap, transitions_topic)) if t["rollout_id"] in ids]
    replayed_accounts = [a for a in asyncio.run(read_topic(settings.kafka_bootstrap, accounts_topic))
                         if a["rollout_id"] in ids]
    counts = agent_counts(replayed_accounts)
    checks = counts["check_query"]
    assert checks["calls"] >= 4 and checks["trained"] == 0 and checks["excluded"] == checks["calls"]
    assert counts["write_query"]["excluded"] == 0 and counts["write_query"]["calls"] == 4
    assert {t["agent_name"] for t in replayed} <= {"write_query", "rewrite_query"}
    assert len(replayed) == sum(c["trained"] for name, c in counts.items())
    assert all(a["selection"] == "rewrite_query,write_query" for a in replayed_accounts)
    assert result["train_agents"] == "write_query,rewrite_query"
