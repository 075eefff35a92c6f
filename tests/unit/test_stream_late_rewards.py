"""Late rewards (stream_jobs/assembly.py): parking after reward_timeout_s, re-reading the
spans when the final reward comes, the reward window; an injected clock throughout."""
import pytest

from spanrl.schemas import codec
from spanrl.stream_jobs import assembly

S, H, DAY = 1000, 3600 * 1000, 24 * 3600 * 1000  # ms
CFG = assembly.AssemblyConfig(reward_timeout_s=60, settle_s=2)  # the default window: 7 days
END = 1_000_000  # the runner's timestamp_ms of the terminal event
TOPIC = "spans"


def span(sid, seq, completion, attempt="a0"):
    return {"rollout_id": "r1", "attempt_id": attempt, "sequence_id": seq, "span_id": sid, "kind": "llm",
            "agent_name": "solver", "source": "proxy", "parent_span_id": None,
            "llm": {"model": "policy", "policy_version": 3, "prompt_token_ids": [1, 2, seq],
                    "completion_token_ids": list(completion),
                    "completion_logprobs": [-0.5] * len(completion), "request_id": sid}}


#: the spans topic of the test: (partition, offset) -> span record; offsets as the worker consumed them
LOG = {(2, 40): span("c0", 0, (5, 6)), (2, 41): span("c1", 1, (7,)), (2, 45): span("c2", 2, (8, 9, 10))}


def lifecycle(status):
    return {"rollout_id": "r1", "attempt_id": "a0", "task_id": "t1", "status": status, "group_size": 4,
            "timestamp_ms": END}


def reward(value, ts):
    return {"rollout_id": "r1", "attempt_id": "a0", "value": value, "final": True, "timestamp_ms": ts}


def ended_attempt():
    """An attempt whose three calls were consumed at t=0..0.2 s and that ended at t=1 s."""
    state, store = assembly.new_state("r1", 2), {}
    for i, ((p, off), sp) in enumerate(LOG.items()):
        assert assembly.add_span(state, sp, store, CFG, i * 100, at=(TOPIC, p, off)).dead_letters == []
    assembly.add_rollout_event(state, lifecycle("started"), 0)
    assembly.add_rollout_event(state, lifecycle("succeeded"), 1 * S)
    return state, store


def reread(state, store, log=LOG):
    """What the app does before advance (stream_jobs/app.py advance_rollout): re-read the
    wanted spans (from ``log``) into the store; returns the store."""
    for aid, reads in assembly.missing_reads(state, store, CFG).items():
        for sid, (topic, p, off) in reads:
            assert topic == TOPIC
            if (p, off) in log:
                value = assembly.restore_call("r1", aid, sid, log[(p, off)])
                if value is not None:
                    store[assembly.store_key("r1", aid, sid)] = value
    return store


def on_time():
    state, store = ended_attempt()
    assembly.add_reward(state, reward(0.75, END + 3 * S), 4 * S)
    assert assembly.advance(state, store, CFG, 4 * S).transitions == []  # settle wait
    out = assembly.advance(state, store, CFG, 6 * S)
    assert store == {} and out.dead_letters == []
    return out


def test_reward_two_hours_after_the_end_gives_the_on_time_transitions():
    expected = on_time().transitions
    assert [(t["span_id"], t["late_reward"], t["reward_delay_ms"]) for t in expected] == [
        ("c0", False, 3000), ("c1", False, 3000), ("c2", False, 3000)]

    state, store = ended_attempt()
    assert len(store) == 3
    assert assembly.advance(state, store, CFG, 1 * S + 59_999).changed is False  # still waiting
    parked = assembly.advance(state, store, CFG, 61 * S)
    assert parked.changed and parked.transitions == [] and parked.dead_letters == []
    assert store == {} and state["attempts"]["a0"]["parked_ms"] == 61 * S  # no token data held
    assert [c["at"] for c in state["attempts"]["a0"]["calls"].values()] == [
        [TOPIC, 2, 40], [TOPIC, 2, 41], [TOPIC, 2, 45]]
    assert assembly.missing_reads(state, store, CFG) == {}  # nothing to read before a final reward
    assert assembly.advance(state, store, CFG, 1 * H).changed is False

    now = 1 * S + 2 * H
    assembly.add_reward(state, reward(0.75, END + 2 * H), now)
    assert assembly.missing_reads(state, store, CFG) == {
        "a0": [("c0", [TOPIC, 2, 40]), ("c1", [TOPIC, 2, 41]), ("c2", [TOPIC, 2, 45])]}
    out = assembly.advance(state, reread(state, store), CFG, now)  # no settle wait
    assert out.dead_letters == [] and store == {}
    assert [(t["late_reward"], t["reward_delay_ms"]) for t in out.transitions] == [(True, 2 * H)] * 3
    same = ("late_reward", "reward_delay_ms")
    assert [{k: v for k, v in t.items() if k not in same} for t in out.transitions] == \
        [{k: v for k, v in t.items() if k not in same} for t in expected]
    assert out.transitions[2]["completion_token_ids"] == [8, 9, 10] and out.transitions[2]["reward"] == 0.75
    assert [a["outcome"] for a in out.accounts] == ["emitted"]
    for t in out.transitions:
        assert codec.decode("transition", codec.encode("transition", t)) == t
    assert state["attempts"]["a0"]["done"] == "emitted"
    assert assembly.advance(state, store, CFG, now + 1).transitions == []


def test_after_the_window_the_dead_letter():
    state, store = ended_attempt()
    assembly.advance(state, store, CFG, 61 * S)
    assert assembly.advance(state, store, CFG, 1 * S + 7 * DAY - 1).dead_letters == []
    out = assembly.advance(state, store, CFG, 1 * S + 7 * DAY)
    assert out.dead_letters == [{
        "schema_version": 1, "reason": "no_reward_before_window", "stage": "assembler",
        "detail": "attempt a0: status succeeded, no final reward within 604800s (the reward window); "
                  "3 llm calls dropped",
        "source_topic": None, "source_partition": None, "source_offset": None,
        "rollout_id": "r1", "task_id": "t1", "payload": None, "timestamp_ms": 1 * S + 7 * DAY}]
    assert [a["outcome"] for a in out.accounts] == ["no_reward_before_window"]
    late = assembly.add_reward(state, reward(1.0, END + 8 * DAY), 8 * DAY)
    assert [d["reason"] for d in late.dead_letters] == ["late_reward"]


def test_parked_spans_deleted_by_retention_are_a_dead_letter():
    state, store = ended_attempt()
    assembly.advance(state, store, CFG, 61 * S)
    now = 3 * H
    assembly.add_reward(state, reward(1.0, END + 3 * H), now)
    kept = {k: v for k, v in LOG.items() if k[1] >= 41}  # retention moved the log start to offset 41
    out = assembly.advance(state, reread(state, store, kept), CFG, now)
    assert out.transitions == []
    assert [(d["reason"], d["detail"]) for d in out.dead_letters] == [(
        "late_spans_missing", "attempt a0: final reward 10800000 ms after the end, but 1 of 3 parked calls "
                              "could not be re-read from spans (deleted by retention, or no longer the span "
                              "recorded): c0")]
    assert [a["outcome"] for a in out.accounts] == ["late_spans_missing"]
    # a record at the offset that is another span is no more that call than a missing one
    assert assembly.restore_call("r1", "a0", "c0", LOG[(2, 41)]) is None
    assert assembly.restore_call("r1", "a0", "c0", LOG[(2, 40)]) == assembly.encode_call(LOG[(2, 40)]["llm"])


def test_a_call_that_comes_while_parked_is_kept_without_its_tokens():
    state, store = ended_attempt()
    assembly.advance(state, store, CFG, 61 * S)
    log = {**LOG, (2, 90): span("c3", 3, (11,))}
    assembly.add_span(state, log[(2, 90)], store, CFG, 70 * S, at=(TOPIC, 2, 90))
    assert store == {}
    assembly.add_reward(state, reward(0.5, END + 100 * S), 100 * S)
    out = assembly.advance(state, reread(state, store, log), CFG, 100 * S)
    assert [(t["span_id"], t["call_index"], t["rollout_transition_count"], t["reward_delay_ms"])
            for t in out.transitions] == [("c0", 0, 4, 100_000), ("c1", 1, 4, 100_000), ("c2", 2, 4, 100_000),
                                          ("c3", 3, 4, 100_000)]


def test_a_call_without_a_position_keeps_its_tokens_while_parked():
    """(A state written before late rewards: its calls have no ``at``.)"""
    state, store = ended_attempt()
    assembly.add_span(state, span("old", 5, (12,)), store, CFG, 500)
    assembly.advance(state, store, CFG, 61 * S)
    assert list(store) == ["r1|a0|old"]
    assembly.add_reward(state, reward(1.0, END + 2 * H), 2 * H)
    assert [sid for sid, _ in assembly.missing_reads(state, store, CFG)["a0"]] == ["c0", "c1", "c2"]
    out = assembly.advance(state, reread(state, store), CFG, 2 * H)
    assert [t["span_id"] for t in out.transitions] == ["c0", "c1", "c2", "old"] and store == {}


@pytest.mark.parametrize("waited_s,window_s,expected", [
    (59.999, 7 * 86400, "wait"), (60, 7 * 86400, "park"), (7 * 86400 - 0.001, 7 * 86400, "park"),
    (7 * 86400, 7 * 86400, "window"), (59.999, 0, "wait"), (60, 0, "timeout"), (60, 60, "timeout")])
def test_no_reward_wait(waited_s, window_s, expected):
    cfg = assembly.AssemblyConfig(reward_timeout_s=60, reward_window_s=window_s)
    assert assembly.no_reward_wait(int(waited_s * 1000), cfg) == expected


def test_reward_delay_ms():
    a = {"rewards": [], "ended_event_ms": 100}
    assert assembly.reward_delay_ms(a) is None
    a["rewards"] = [{"value": 1.0, "final": True, "timestamp_ms": 350},
                    {"value": 0.2, "final": False, "timestamp_ms": 900}]
    assert assembly.reward_delay_ms(a) == 250  # the final reward's, not the intermediate one's
    a["rewards"].append({"value": 0.0, "final": True, "timestamp_ms": 40})
    assert assembly.reward_delay_ms(a) == 0  # stamped before the end
    assert assembly.reward_delay_ms({**a, "ended_event_ms": None}) is None


def test_only_succeeded_attempts_park():
    cfg = assembly.AssemblyConfig(reward_timeout_s=10, reward_window_s=100)
    assert assembly.no_reward_wait(10_000, cfg, "succeeded") == "park"
    assert assembly.no_reward_wait(10_000, cfg, "failed") == "timeout"
    assert assembly.no_reward_wait(9_999, cfg, "timeout") == "wait"
    assert assembly.no_reward_wait(10_000, cfg, "timeout") == "timeout"


# --- token data lost with a worker (the app keeps them in memory only; the state's positions
# --- are what its changelog restores)

def recovered(state):
    """The state as the next worker restores it from the changelog: the same JSON, no token data."""
    import json
    return json.loads(json.dumps(state)), {}


def test_a_recovered_attempt_rereads_every_call_when_it_can_end():
    expected = on_time().transitions
    state, store = ended_attempt()
    state, store = recovered(state)
    assert assembly.missing_reads(state, store, CFG) == {}  # terminal, but no final reward yet
    assembly.add_reward(state, reward(0.75, END + 3 * S), 4 * S)
    assert assembly.missing_reads(state, store, CFG) == {
        "a0": [("c0", [TOPIC, 2, 40]), ("c1", [TOPIC, 2, 41]), ("c2", [TOPIC, 2, 45])]}
    assert assembly.advance(state, reread(state, store), CFG, 4 * S).transitions == []  # settle wait
    assert len(store) == 3 and assembly.missing_reads(state, store, CFG) == {}  # read once, kept
    out = assembly.advance(state, store, CFG, 6 * S)
    assert out.transitions == expected and out.dead_letters == [] and store == {}
    assert out.emitted_by == ["settle_s"]


def test_an_open_attempt_is_not_reread_before_its_terminal_event():
    state, store = assembly.new_state("r1", 2), {}
    for i, ((p, off), sp) in enumerate(LOG.items()):
        assembly.add_span(state, sp, store, CFG, i * 100, at=(TOPIC, p, off))
    assembly.add_rollout_event(state, lifecycle("started"), 0)
    state, store = recovered(state)
    assembly.add_reward(state, reward(0.75, END), 1 * S)
    assert assembly.missing_reads(state, store, CFG) == {}  # it cannot end yet: nothing to read
    assembly.add_rollout_event(state, lifecycle("succeeded"), 2 * S)
    assert [sid for sid, _ in assembly.missing_reads(state, store, CFG)["a0"]] == ["c0", "c1", "c2"]


def test_a_lost_call_that_cannot_be_reread_is_a_dead_letter():
    state, store = ended_attempt()
    state, store = recovered(state)
    assembly.add_reward(state, reward(1.0, END + 3 * S), 4 * S)
    kept = {k: v for k, v in LOG.items() if k != (2, 41)}
    assert assembly.advance(state, reread(state, store, kept), CFG, 4 * S).dead_letters == []  # settle wait
    assert [sid for sid, _ in assembly.missing_reads(state, store, CFG)["a0"]] == ["c1"]  # tried again
    out = assembly.advance(state, reread(state, store, kept), CFG, 6 * S)
    assert out.transitions == []
    assert [(d["reason"], d["detail"]) for d in out.dead_letters] == [(
        "spans_missing", "attempt a0: 1 of 3 calls' token data were lost with a worker and could not be "
                         "re-read from spans (deleted by retention, or no longer the span recorded): c1")]
    assert [a["outcome"] for a in out.accounts] == ["spans_missing"] and store == {}
