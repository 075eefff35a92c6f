"""The stream app's units, each alone (stream_jobs/app_context.py, app_ticks.py, app_web.py,
agent_*.py): the pure pieces with hand-written expected values, the units on stand-ins for
Faust's topics, tables and messages."""
import asyncio
from collections import Counter
from types import SimpleNamespace

from faust.types import TP

from spanrl.core import dead_letters as dl
from spanrl.stream_jobs.agent_assemble import input_kinds
from spanrl.stream_jobs.app import StreamConfig, make_app
from spanrl.stream_jobs.app_context import (Outputs, WorkerCounters, account_keys, dead_letter_value, key_text,
                                            oversize, record_ms, with_source)
from spanrl.stream_jobs.app_ticks import ticked
from spanrl.stream_jobs.app_web import counters_json, health
from spanrl.stream_jobs.clock import TimeoutClock

MSG = SimpleNamespace(topic="spans", partition=2, offset=41, timestamp=1700000000.25, key=b"r-1", value=b"\x00")


def test_with_source_names_the_input_and_keeps_a_payload_already_there():
    rec = dl.dead_letter(dl.SCHEMA_ERROR, dl.ASSEMBLER, 5, detail="bad")
    got = with_source(rec, MSG, b"raw")
    assert (got["source_topic"], got["source_partition"], got["source_offset"], got["payload"]) == (
        "spans", 2, 41, b"raw")
    assert rec["source_topic"] is None  # the record given is not changed
    assert with_source({**rec, "payload": b"own"}, MSG, b"raw")["payload"] == b"own"
    assert with_source(rec, MSG, None)["payload"] is None


def test_a_dead_letter_too_large_for_its_topic_goes_without_its_payload():
    small = dl.dead_letter(dl.SCHEMA_ERROR, dl.ASSEMBLER, 5, detail="bad", payload=b"x" * 10)
    assert dead_letter_value(small)[0] is small
    big = {**small, "payload": b"x" * 50_000_000}
    sent, value = dead_letter_value(big)
    assert sent["payload"] is None
    assert sent["detail"] == "bad [payload of 50000000 bytes left out: too large]"
    assert len(value) < 1000


def test_oversize_names_the_attempt_the_span_and_the_sizes():
    t = {"rollout_id": "r-1", "task_id": "t-1", "attempt_id": "a-0", "span_id": "s-3"}
    assert oversize(t, "transition", 9000, 8000, 1234) == dl.dead_letter(
        "oversize", "assembler", 1234, rollout_id="r-1", task_id="t-1",
        detail="transition of attempt a-0 span s-3: 9000 bytes > 8000")
    assert oversize({"transition": t}, "sample", 9, 8, 1)["stage"] == "grouper"
    assert oversize({"transition": t}, "sample", 9, 8, 1)["detail"] == "sample of attempt a-0 span s-3: 9 bytes > 8"


def test_account_keys_one_per_call():
    account = {"calls": [{"agent_name": "solver", "trained": True}, {"agent_name": None, "trained": False},
                         {"agent_name": "solver", "trained": True}]}
    assert account_keys(account) == [("solver", "trained"), ("(unresolved)", "excluded"), ("solver", "trained")]


def test_message_helpers():
    assert record_ms(MSG) == 1700000000250
    assert record_ms(SimpleNamespace(timestamp=None)) is None
    assert (key_text(b"r-1"), key_text(None), key_text(b""), key_text(b"\xff")) == ("r-1", None, None, None)


def test_input_kinds_of_a_config():
    assert input_kinds(StreamConfig(spans_topic="s", rewards_topic="w", rollouts_topic="l")) == {
        "s": ("span", "spans_in", "spans"), "w": ("reward", "rewards_in", "rewards"),
        "l": ("rollout", "rollout_events_in", "rollouts")}


def test_counters_json():
    m = WorkerCounters()
    m.counters.update({"spans_in": 3, "transitions_out": 2, "spans_joined": 1, "rollouts_evicted": 7})
    m.dead_reasons["late_span"] += 1
    m.agent_counts.update({("solver", "trained"): 2, ("critic", "excluded"): 1})
    m.emitted_by["inputs_acked"] += 2
    assert counters_json(m, calls_held=4, transitions_held=5) == {
        "spans_in": 3, "rewards_in": 0, "rollout_events_in": 0, "transitions_out": 2, "samples_out": 0,
        "dead_letters_out": {"late_span": 1}, "call_accounts_out": 0,
        "calls_by_agent": {"critic|excluded": 1, "solver|trained": 2},
        "trace_links_out": 0, "trace_links_in": 0, "orphans_in": 0, "spans_joined": 1,
        "inputs_bounds_read": 0, "emitted_by": {"inputs_acked": 2},
        "attempts_parked": 0, "spans_reread": 0, "late_rewards_emitted": 0, "calls_held": 4,
        "transitions_held": 5, "transitions_reread": 0, "rollouts_evicted": 7, "tasks_evicted": 0}


def test_health():
    assert health("w", 3, False, False, True) == (
        {"ok": True, "app_id": "w", "assigned_partitions": 3, "rebalancing": False, "in_recovery": False}, 200)
    assert health("w", 0, False, False, False)[1] == 503
    assert health("w", 3, True, False, True) == (
        {"ok": False, "app_id": "w", "assigned_partitions": 3, "rebalancing": True, "in_recovery": False}, 503)


class _Topic:
    def __init__(self, name):
        self.name, self.sent = name, []

    def get_topic_name(self):
        return self.name

    async def send(self, key=None, value=None):
        self.sent.append((key, value))


def test_ticked_visits_the_states_of_the_ticked_partition_only():
    ticks, clock, seen = _Topic("w-rollout-ticks"), TimeoutClock(), []
    table = {"r-1": {"partition": 2}, "r-2": {"partition": 1}, "r-3": {"partition": 2}}

    async def handle(key, state, now):
        seen.append((key, now))

    async def main():
        is_tick = await ticked(MSG, 1700000000500, ticks, clock, table, handle)  # an input
        tick = SimpleNamespace(topic="w-rollout-ticks", partition=2, timestamp=None)
        return is_tick, await ticked(tick, 1700000003500, ticks, clock, table, handle)

    # the input's lag (250 ms) holds the clock back while inputs keep coming (stream_jobs/clock.py)
    assert asyncio.run(main()) == (False, True)
    assert seen == [("r-1", 1700000003250), ("r-3", 1700000003250)]


def test_outputs_send_dead_letters_with_their_source_and_count_them():
    from spanrl.schemas import codec

    topics_ = SimpleNamespace(dead=_Topic("dead-letter"))
    m = WorkerCounters()
    out = Outputs(topics_, m)
    recs = [dl.dead_letter(dl.SCHEMA_ERROR, dl.ASSEMBLER, 7, detail="bad", rollout_id="r-1"),
            dl.dead_letter(dl.LATE_SPAN, dl.ASSEMBLER, 7)]
    asyncio.run(out.send_dead(recs, MSG, b"raw"))
    assert [k for k, _ in topics_.dead.sent] == [b"r-1", None]
    first = codec.decode("dead_letter", topics_.dead.sent[0][1])
    assert (first["source_topic"], first["source_offset"], first["payload"]) == ("spans", 41, b"raw")
    assert (m.counters["dead_letters_out"], m.dead_reasons) == (2, Counter({"schema_error": 1, "late_span": 1}))


def test_revoked_partitions_are_forgotten_by_each_agent_and_pages_answer():
    app = make_app(StreamConfig(app_id="unit-units"))
    ctx = app.spanrl_context
    lifecycle = next(iter(app.on_partitions_revoked._filter_receivers[
        app.on_partitions_revoked._create_id(app)])).__self__
    a, g = lifecycle.assembler, lifecycle.grouper
    a.positions.update({1: {"spans": 5}, 2: {"spans": 9}})
    a.calls.update({1: {"k": b"x"}, 2: {"k": b"y", "l": b"z"}})
    g.store(2).records["t"] = object()  # a waiting transition

    class Request:
        query = {}

    async def main():
        views = app.web.views
        counters = await views["/spanrl/counters/"].get(Request())
        held = await views["/spanrl/held/"].get(Request())
        await app.on_partitions_revoked.send({TP("spans", 2)})  # as Faust's rebalance does
        await app.on_before_shutdown.send()  # no client was made: nothing to stop
        return counters, held

    counters, held = asyncio.run(main())
    import json

    assert json.loads(counters.body)["calls_held"] == 3 and json.loads(counters.body)["transitions_held"] == 1
    assert sorted(json.loads(held.body)["partitions"]) == ["1", "2"]
    assert (a.positions, list(a.calls), g.stores) == ({1: {"spans": 5}}, [1], {})
    assert ctx.metrics.counters == Counter()
