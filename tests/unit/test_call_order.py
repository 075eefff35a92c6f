"""An attempt's call order when two proxy processes numbered its calls (spanrl/core/call_order.py),
alone and through the assembler (stream_jobs/assembly.py)."""
from __future__ import annotations

from spanrl.core.call_order import INSTANCE, call_order, split_over_proxies
from spanrl.stream_jobs import assembly

SPANS = "spans"


def call(seq, instance=None, offset=None, partition=2):
    c = {"sequence_id": seq}
    if instance is not None:
        c["instance"] = instance
    if offset is not None:
        c["at"] = [SPANS, partition, offset]
    return c


#: a session of four successive calls: unit A numbered the first two, failed, unit B the
#: next two (each proxy counts from 0); their span records' offsets in the rollout's partition
MOVED = {"d1": call(0, "A", 10), "c2": call(1, "A", 12), "b3": call(0, "B", 15), "a4": call(1, "B", 17)}


def test_one_proxy_orders_by_sequence_id_then_span_id():
    calls = {"x": call(1, "A", 5), "y": call(0, "A", 9), "z": call(1, "A", 7)}
    assert not split_over_proxies(calls)
    assert call_order(calls) == ["y", "x", "z"]  # offsets play no part


def test_two_proxies_order_by_the_partitions_offsets():
    assert split_over_proxies(MOVED)
    assert call_order(MOVED) == ["d1", "c2", "b3", "a4"]
    # what sequence ids alone give: both counters' 0 first, the second call last but one
    assert sorted(MOVED, key=lambda s: (MOVED[s]["sequence_id"], s)) == ["b3", "d1", "a4", "c2"]


def test_two_proxies_without_every_position_fall_back_to_sequence_ids():
    missing = {**MOVED, "a4": call(1, "B")}
    assert call_order(missing) == ["b3", "d1", "a4", "c2"]
    other_partition = {**MOVED, "a4": call(1, "B", 3, partition=5)}
    assert call_order(other_partition) == ["b3", "d1", "a4", "c2"]


def test_calls_without_an_instance_are_never_a_split():
    """An agent's own telemetry numbers its calls itself (one counter per attempt); a span of
    a proxy from before instances has none: sequence ids order them."""
    assert not split_over_proxies({"p": call(0, None, 4), "q": call(1, None, 2)})
    mixed = {"p": call(1, "A", 2), "q": call(0, None, 4)}
    assert not split_over_proxies(mixed) and call_order(mixed) == ["q", "p"]


def span(sid, seq, instance):
    return {"rollout_id": "r1", "attempt_id": "a0", "sequence_id": seq, "span_id": sid, "kind": "llm",
            "agent_name": "solver", "source": "proxy", "attributes": {INSTANCE: instance},
            "llm": {"model": "policy", "policy_version": 3, "prompt_token_ids": [1, 2, seq],
                    "completion_token_ids": [5, 6], "completion_logprobs": [-0.25, -0.25], "request_id": sid}}


def assemble(rollout_id: str, attempt_id: str, spans: list[tuple[dict, tuple]], task_id: str | None = None):
    """The assembler's outcome for one attempt: its (span, position) in log order, a terminal
    lifecycle event for task ``task_id`` (None: a production attempt, no runner), a final
    reward, then time for the settle wait."""
    cfg = assembly.AssemblyConfig(reward_timeout_s=10, rollout_timeout_s=100, settle_s=2)
    state, store, out = assembly.new_state(rollout_id), {}, assembly.Outcome()
    events = [("span", s, at) for s, at in spans]
    if task_id is not None:
        events.append(("life", {"rollout_id": rollout_id, "attempt_id": attempt_id, "task_id": task_id,
                                "status": "succeeded", "group_size": 1}, None))
    events.append(("reward", {"rollout_id": rollout_id, "attempt_id": attempt_id, "value": 1.0, "final": True,
                              "timestamp_ms": 1}, None))
    for kind, record, at in events:
        if kind == "span":
            out.extend(assembly.add_span(state, record, store, cfg, 0, at=at))
        elif kind == "life":
            out.extend(assembly.add_rollout_event(state, record, 0))
        else:
            out.extend(assembly.add_reward(state, record, 0))
        out.extend(assembly.advance(state, store, cfg, 0))
    return out.extend(assembly.advance(state, store, cfg, 20_000))


def test_assembler_emits_a_moved_session_in_call_order():
    """The session above through the assembler, its spans read in partition order: the
    transitions' call indices follow the calls, their sequence ids stay the proxies' own."""
    ordered = sorted(MOVED.items(), key=lambda kv: kv[1]["at"][2])
    out = assemble("r1", "a0", [(span(sid, c["sequence_id"], c["instance"]), (SPANS, 2, c["at"][2]))
                                for sid, c in ordered], task_id="t1")
    assert out.dead_letters == []
    assert [(t["span_id"], t["call_index"], t["sequence_id"]) for t in out.transitions] == [
        ("d1", 0, 0), ("c2", 1, 1), ("b3", 2, 0), ("a4", 3, 1)]
    assert [c["span_id"] for c in out.accounts[0]["calls"]] == ["d1", "c2", "b3", "a4"]
