"""When a tick must visit a rollout state (assembly.tick_due / attempt_due): exact cases, and
the invariant the tick index relies on, on random input sequences: advancing before the due
time changes nothing; at it, something happens."""
import copy
import json
import random

from spanrl.stream_jobs import assembly

S = 1000
CFG = assembly.AssemblyConfig(reward_timeout_s=10, rollout_timeout_s=100, settle_s=2, production_idle_s=30,
                              reward_window_s=500)


def span(sid, seq, attempt="a0"):
    return {"rollout_id": "r1", "attempt_id": attempt, "sequence_id": seq, "span_id": sid, "kind": "llm",
            "agent_name": "solver", "source": "proxy",
            "llm": {"model": "policy", "policy_version": 3, "prompt_token_ids": [1, 2], "completion_token_ids": [5],
                    "completion_logprobs": [-0.25], "request_id": sid}}


def lifecycle(status, attempt="a0", acked=False):
    return {"rollout_id": "r1", "attempt_id": attempt, "task_id": "t1", "status": status, "group_size": 4,
            "inputs_acked": acked, "timestamp_ms": 1}


def reward(value, attempt="a0"):
    return {"rollout_id": "r1", "attempt_id": attempt, "value": value, "final": True, "timestamp_ms": 1}


def test_each_wait_has_its_due_time():
    state, store = assembly.new_state("r1"), {}
    assembly.add_rollout_event(state, lifecycle("started"), 1 * S)
    assembly.add_span(state, span("c0", 0), store, CFG, 3 * S)
    assert assembly.tick_due(state, CFG, 3600) == 103 * S  # rollout timeout after the last input
    assembly.add_rollout_event(state, lifecycle("succeeded"), 5 * S)
    assert assembly.tick_due(state, CFG, 3600) == 15 * S  # reward timeout after the end
    assembly.advance(state, store, CFG, 15 * S)  # parked
    assert assembly.tick_due(state, CFG, 3600) == 505 * S  # its reward window
    assembly.add_reward(state, reward(1.0), 20 * S)
    out = assembly.advance(state, store, CFG, 20 * S)
    assert out.emitted_by == ["late_reward"]  # (a call added without a position keeps its tokens)
    assert assembly.tick_due(state, CFG, 3600) == 20 * S + 3600 * S  # done: expiry


def test_an_ended_attempt_with_a_reward_waits_for_its_bound_or_settles():
    state, store = assembly.new_state("r1"), {}
    assembly.add_span(state, span("c0", 0), store, CFG, 0)
    assembly.add_reward(state, reward(1.0), 0)
    assembly.add_rollout_event(state, lifecycle("succeeded", acked=True), 1 * S, {"spans": 10, "rewards": 4})
    assert assembly.advance(state, store, CFG, 1 * S, {"spans": 5, "rewards": 4}).transitions == []
    assert assembly.tick_due(state, CFG, 3600, {"spans": 5, "rewards": 4}) == assembly.NEVER  # the positions will
    assert assembly.tick_due(state, CFG, 3600, None) == 3 * S  # positions unknown: the settle fallback
    assert assembly.tick_due(state, CFG, 3600, {"spans": 10}) == 3 * S


def test_a_production_attempt_ends_idle_and_two_attempts_take_the_earliest():
    state, store = assembly.new_state("r1"), {}
    assembly.add_span(state, span("c0", 0), store, CFG, 2 * S)
    state["attempts"]["a0"]["production"] = True
    assert assembly.tick_due(state, CFG, 3600) == 32 * S  # idle end before the rollout timeout
    assembly.add_rollout_event(state, lifecycle("started", attempt="a1"), 4 * S)
    assembly.add_rollout_event(state, lifecycle("succeeded", attempt="a1"), 6 * S)
    assert assembly.tick_due(state, CFG, 3600) == 16 * S  # a1's reward timeout comes first


def _random_state(rnd):
    """A rollout state after a random input sequence (two attempts; some inputs acked, some not)."""
    state, store, t, out = assembly.new_state("r1"), {}, 0, None
    pos = {"spans": 0, "rewards": 0}
    for i in range(rnd.randrange(1, 9)):
        t += rnd.randrange(0, 40) * 100
        aid = rnd.choice(["a0", "a1"])
        kind = rnd.choice(["span", "span", "reward", "started", "succeeded", "failed", "tick"])
        if kind == "span":
            assembly.add_span(state, span(f"c{i}", i, aid), store, CFG, t)
            pos["spans"] += 1
        elif kind == "reward":
            assembly.add_reward(state, reward(rnd.choice([0.0, 1.0]), aid), t)
            pos["rewards"] += 1
        elif kind in ("started", "succeeded", "failed"):
            acked = rnd.random() < 0.5
            bound = {"spans": pos["spans"] + rnd.randrange(2), "rewards": pos["rewards"]} if acked else None
            assembly.add_rollout_event(state, lifecycle(kind, aid, acked), t, bound)
        out = assembly.advance(state, store, CFG, t, dict(pos))
    return state, store, t, dict(pos)


def test_nothing_changes_before_the_due_time_and_something_does_at_it():
    rnd = random.Random(11)
    checked = {"timed": 0, "never": 0, "every_tick": 0}
    for _ in range(3000):
        state, store, t, pos = _random_state(rnd)
        due = assembly.tick_due(state, CFG, 3600, pos)
        if due is None:
            checked["every_tick"] += 1
            continue
        if due == assembly.NEVER:
            checked["never"] += 1
            for later in (t + 1, t + 10**7):
                s2, st2 = copy.deepcopy(state), dict(store)
                out = assembly.advance(s2, st2, CFG, later, pos)
                assert not out.changed or s2 == state, (json.dumps(state), later)
            continue
        checked["timed"] += 1
        if all(a["done"] is not None for a in state["attempts"].values()):  # the app deletes it then
            assert assembly.expired(state, due, 3600) and not assembly.expired(state, due - 1, 3600)
            continue
        if due - 1 >= t:
            s2, st2 = copy.deepcopy(state), dict(store)
            out = assembly.advance(s2, st2, CFG, due - 1, pos)
            assert (out.transitions, out.dead_letters) == ([], []) and s2 == state, (json.dumps(state), due)
        s3, st3 = copy.deepcopy(state), dict(store)
        out = assembly.advance(s3, st3, CFG, max(due, t), pos)
        assert out.changed, (json.dumps(state), due)
    assert min(checked.values()) > 20, checked
