"""The count bound on finished states (``SPANRL_STREAM_RETAIN_MAX``, issue 21): the assembler's
and the grouper's writes delete the partition's oldest finished states beyond it, open ones
never, and count what they deleted. Plain dicts stand in for the Faust tables (the agents
only get, set and delete keys)."""
from types import SimpleNamespace

import pytest

from spanrl.stream_jobs import grouping
from spanrl.stream_jobs.agent_assemble import Assembler
from spanrl.stream_jobs.agent_group import Grouper
from spanrl.stream_jobs.app import StreamConfig
from spanrl.stream_jobs.app_context import WorkerCounters
from spanrl.stream_jobs.assembly import AssemblyConfig


def _ctx(keep: int) -> SimpleNamespace:
    return SimpleNamespace(cfg=StreamConfig(app_id="unit-retain", retain_max=keep), tables=SimpleNamespace(
        rollouts={}, groups={}), assembly_cfg=AssemblyConfig(), grouping_cfg=grouping.GroupingConfig(),
        metrics=WorkerCounters())


def _rollout(rid: str, partition: int, done_ms: int | None) -> dict:
    attempt = {"done": None if done_ms is None else "emitted", "done_ms": done_ms, "status": None,
               "last_ms": 0, "parked_ms": None}
    return {"rollout_id": rid, "partition": partition, "attempts": {"0": attempt}}


def test_assembler_keeps_the_newest_finished_rollouts_per_partition():
    ctx = _ctx(keep=2)
    a = Assembler(ctx)
    a.put("open", _rollout("open", 0, None))          # open: never deleted by the bound
    for i in range(4):
        a.put(f"r{i}", _rollout(f"r{i}", 0, 1000 + i))
    a.put("q0", _rollout("q0", 1, 1000))              # another partition: a bound of its own
    assert sorted(ctx.tables.rollouts) == ["open", "q0", "r2", "r3"]
    assert ctx.metrics.counters["rollouts_evicted"] == 2
    assert (a.finished.count(0), a.finished.count(1)) == (2, 1)
    a.put("r2", _rollout("r2", 0, None))              # r2 got a new attempt: open again
    a.put("r4", _rollout("r4", 0, 2000))
    assert sorted(ctx.tables.rollouts) == ["open", "q0", "r2", "r3", "r4"]


def test_grouper_keeps_the_newest_task_states_without_an_open_group():
    ctx = _ctx(keep=2)
    g = Grouper(ctx)
    busy = grouping.new_state("busy", 0)
    busy["open"] = {"opened_ms": 0}                   # an open group: waits for its time-out
    g.put("busy", busy)
    for i in range(3):
        g.put(f"t{i}", grouping.new_state(f"t{i}", 0))
    assert sorted(ctx.tables.groups) == ["busy", "t1", "t2"]
    assert ctx.metrics.counters["tasks_evicted"] == 1


def test_retain_max_is_at_least_one():
    from spanrl.core.settings import StreamSettings

    with pytest.raises(ValueError, match="must be >= 1"):
        StreamSettings.from_environ({"SPANRL_STREAM_RETAIN_MAX": "0"})
    assert StreamSettings.from_environ({}).stream_retain_max == 10000
