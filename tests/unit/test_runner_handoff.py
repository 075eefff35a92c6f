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
