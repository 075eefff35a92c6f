"""Runners sharing a consumer group hand tasks over (producers/runner.py): the commit of a
tasks partition carries the attempts finished past its offset; a new owner runs only the rest.

Against Kafka, with two runners and one killed mid-task: tests/integration/test_two_runners.py.
"""
from __future__ import annotations

import asyncio
import json

from aiokafka import TopicPartition

from spanrl.core.settings import Settings
from spanrl.producers.runner import COMMIT_METADATA_MAX, Runner, _OffsetTracker, parse_progress, progress_metadata

TP = TopicPartition("tasks", 3)


def test_progress_metadata_round_trip():
    meta = progress_metadata({12: {2, 0}, 10: {1}, 11: set()})
    assert meta == '{"attempts_done":{"10":[1],"12":[0,2]}}'
    assert parse_progress(meta) == {10: frozenset({1}), 12: frozenset({0, 2})}
    assert progress_metadata({}) == "" and progress_metadata({4: set()}) == ""


def test_progress_metadata_stays_within_kafkas_limit():
    done = {o: set(range(64)) for o in range(100, 140)}
    meta = progress_metadata(done)
    assert len(meta) <= COMMIT_METADATA_MAX
    kept = parse_progress(meta)
    assert sorted(kept) == list(range(100, 100 + len(kept))) and 0 < len(kept) < 40  # nearest offsets kept
    assert progress_metadata(done, limit=30) == ""  # not even one offset fits: none


def test_metadata_another_client_wrote_means_no_progress():
    for meta in (None, "", "x", "[]", '{"other": 1}', '{"attempts_done": {"a": [1]}}', '{"attempts_done": 3}'):
        assert parse_progress(meta) == {}, meta


def test_tracker_commits_the_first_unfinished_task_with_later_progress():
    tr = _OffsetTracker()
    for o in (5, 6, 7):
        tr.start(TP, o)
    assert tr.attempt_done(TP, 6, 0) == (5, '{"attempts_done":{"6":[0]}}')
    assert tr.attempt_done(TP, 5, 1) == (5, '{"attempts_done":{"5":[1],"6":[0]}}')
    assert tr.finish(TP, 6) is None  # task 5 still runs
    assert tr.commit_point(TP) == (5, '{"attempts_done":{"5":[1],"6":[0]}}')
    assert tr.finish(TP, 5) == 7
    assert tr.commit_point(TP) == (7, "")  # tasks 5 and 6 done: their progress is gone with them
    assert tr.attempt_done(TP, 7, 3) == (7, '{"attempts_done":{"7":[3]}}')
    assert tr.finish(TP, 7) == 8 and tr.commit_point(TP) is None


def test_tracker_keeps_a_previous_owners_progress_in_its_commits():
    tr = _OffsetTracker()
    tr.start(TP, 9, frozenset({0, 2}))
    assert tr.commit_point(TP) == (9, '{"attempts_done":{"9":[0,2]}}')
    assert tr.attempt_done(TP, 9, 1) == (9, '{"attempts_done":{"9":[0,1,2]}}')
    tr.forget({TP})
    assert tr.commit_point(TP) is None and tr.attempts == {} and tr.pending == {}


class AckingSink:
    """Kafka that acknowledges every record at once, keeping them."""

    def __init__(self):
        self.records = []

    async def produce(self, items) -> None:
        self.records += [(t.name, k, v) for t, k, v in items]

    async def stop(self) -> None:
        return None


def test_run_task_skips_finished_attempts_and_reports_each_end():
    runner = Runner(lambda ctx: 1.0, settings=Settings(_env_file=None), telemetry=False)
    runner.sink = AckingSink()
    ended: list[int] = []

    async def finished(index: int) -> None:
        ended.append(index)

    task = {"task_id": "t1", "payload": json.dumps({}), "group_size": 4, "timeout_s": 10.0}
    results = asyncio.run(runner.run_task(task, frozenset({1, 3}), finished))
    assert [r.status for r in results] == ["succeeded", "succeeded"] and sorted(ended) == [0, 2]
    events = [v for topic, _, v in runner.sink.records if topic == runner.topics.rollouts.name]
    assert sorted(e["status"] for e in events) == ["started", "started", "succeeded", "succeeded"]
    assert asyncio.run(runner.run_task(task, frozenset(range(4)), finished)) == []


# ---- Runner.run's hand-over logic on a scripted group (the consumer and the admin client
# stand in for Kafka's group coordinator: what they return is scripted, what the runner does
# with it is the code under test; tests/integration/test_two_runners.py runs it on Kafka)
class Broker:
    """The group's committed offsets and what the consumer will see, in order."""

    def __init__(self, script: list, committed: dict | None = None):
        self.script = list(script)  # ("msg", offset, task) | ("rebalance",)
        self.committed = dict(committed or {})  # tp -> (offset, metadata)
        self.log: list = []  # what happened, in order


def fakes(broker: Broker):
    from aiokafka.structs import OffsetAndMetadata

    from spanrl.producers.kafka import Topics
    from spanrl.schemas import codec

    topics = Topics()

    class Message:
        def __init__(self, offset, task):
            self.topic, self.partition, self.offset = TP.topic, TP.partition, offset
            self.key, self.value = task["task_id"].encode(), codec.encode(topics.tasks.record, task)

    class Consumer:
        def __init__(self, **kwargs):
            self.listener = None
            self.assigned = False

        async def start(self):
            pass

        async def stop(self):
            pass

        def subscribe(self, topics, listener):
            self.listener = listener

        async def getmany(self, timeout_ms, max_records):
            if not self.assigned:  # the first poll joins the group
                self.assigned = True
                await self.listener.on_partitions_assigned({TP})
                broker.log.append("assigned")
            if not broker.script:
                await asyncio.sleep(timeout_ms / 1000)
                return {}
            step = broker.script.pop(0)
            if step[0] == "rebalance":
                await asyncio.sleep(0.05)  # the attempts under way get going
                broker.log.append("revoking")
                await self.listener.on_partitions_revoked({TP})
                broker.log.append("revoked")
                await self.listener.on_partitions_assigned({TP})
                return {}
            return {TP: [Message(step[1], step[2])]}

        async def commit(self, offsets):
            for tp, point in offsets.items():
                broker.committed[tp] = point
                broker.log.append(("commit", *point))

    class Admin:
        def __init__(self, **kwargs):
            pass

        async def start(self):
            pass

        async def close(self):
            pass

        async def list_consumer_group_offsets(self, group_id, partitions=None):
            return {tp: OffsetAndMetadata(*broker.committed[tp]) for tp in partitions or [] if tp in broker.committed}

    return Consumer, Admin


def run_runner(monkeypatch, broker: Broker, sleep_s: float = 0.0, idle_s: float = 0.3):
    from aiokafka import admin

    from spanrl.producers import runner as runner_module

    consumer, admin_client = fakes(broker)
    monkeypatch.setattr(runner_module, "AIOKafkaConsumer", consumer)
    monkeypatch.setattr(admin, "AIOKafkaAdminClient", admin_client)

    async def agent(ctx):
        await asyncio.sleep(sleep_s)
        return 1.0

    r = Runner(agent, settings=Settings(_env_file=None), telemetry=False, concurrency=4)
    r.sink = AckingSink()
    return asyncio.run(r.run(idle_timeout_s=idle_s))


def task(task_id: str, group_size: int = 4) -> dict:
    return {"task_id": task_id, "payload": "{}", "group_size": group_size, "timeout_s": 10.0, "created_ms": 1}


def test_a_new_owner_runs_only_the_attempts_not_finished(monkeypatch):
    """A runner killed mid-task committed task 5 with its attempts 0 and 2 finished: the next
    owner runs attempts 1 and 3 of it, then task 6 whole, committing after each attempt."""
    broker = Broker([("msg", 5, task("t5")), ("msg", 6, task("t6", 2))],
                    committed={TP: (5, '{"attempts_done":{"5":[0,2]}}')})
    results = run_runner(monkeypatch, broker)
    assert [[r.status for r in rs] for rs in results] == [["succeeded"] * 2, ["succeeded"] * 2]
    assert [len(rs) for rs in results] == [2, 2] and [rs[0].task_id for rs in results] == ["t5", "t6"]
    commits = [e for e in broker.log if e != "assigned"]
    assert commits[0] == ("commit", 5, '{"attempts_done":{"5":[0,1,2]}}') or \
        commits[0] == ("commit", 5, '{"attempts_done":{"5":[0,2,3]}}')
    assert ("commit", 5, '{"attempts_done":{"5":[0,1,2,3]}}') in commits  # all four, before the task's end
    assert commits[-1] == ("commit", 7, "") and broker.committed[TP] == (7, "")


def test_a_rebalance_waits_for_the_tasks_in_flight(monkeypatch):
    """Partitions are revoked while two tasks run: the runner finishes and commits both before
    it lets them go, and starts nothing meanwhile."""
    broker = Broker([("msg", 0, task("t0", 2)), ("msg", 1, task("t1", 2)), ("rebalance",),
                     ("msg", 2, task("t2", 1))])
    results = run_runner(monkeypatch, broker, sleep_s=0.3, idle_s=1.5)  # the drain is no idle time
    assert sorted(rs[0].task_id for rs in results) == ["t0", "t1", "t2"]
    revoking, revoked = broker.log.index("revoking"), broker.log.index("revoked")
    during = broker.log[revoking + 1:revoked]
    assert ("commit", 2, "") in during  # both tasks done and committed before the partition went
    assert broker.log[-1] == ("commit", 3, "")
