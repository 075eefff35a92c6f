import math

from schemas import codec
from stream_jobs import assembly
from stream_jobs.credit import parse_credit_rule

S = 1000  # ms per second
CFG = assembly.AssemblyConfig(reward_timeout_s=10, rollout_timeout_s=100, settle_s=2)

def span(sid, seq, kind="llm", agent="solver", completion=(5, 6), llm=True, attempt="a0", source="proxy"):
    return {"rollout_id": "r1", "attempt_id": attempt, "sequence_id": seq, "span_id": sid, "kind": kind,
            "agent_name": agent, "source": source,
            "llm": None if not llm else {
                "model": "policy", "policy_version": 3, "prompt_token_ids": [1, 2, seq],
                "completion_token_ids": list(completion),
                "completion_logprobs": [-0.25] * len(completion), "request_id": sid}}

def lifecycle(status, attempt="a0"):
    return {"rollout_id": "r1", "attempt_id": attempt, "task_id": "t1", "status": status, "group_size": 4}

def reward(value, final=True, attempt="a0"):
    return {"rollout_id": "r1", "attempt_id": attempt, "value": value, "final": final, "timestamp_ms": 1}

def run(events, cfg=CFG, until_s=20):
    """Feed (t_seconds, kind, record) events, then advance to until_s; returns (outcome, state, store)."""
    state, store, out = assembly.new_state("r1"), {}, assembly.Outcome()
    for t, kind, rec in events:
        now = int(t * S)
        if kind == "span":
            out.extend(assembly.add_span(state, rec, store, cfg, now))
        elif kind == "reward":
            out.extend(assembly.add_reward(state, rec, now))
        else:
            out.extend(assembly.add_rollout_event(state, rec, now))
        out.extend(assembly.advance(state, store, cfg, now))
    out.extend(assembly.advance(state, store, cfg, int(until_s * S)))
    return out, state, store

def test_identical_credit_three_calls_in_call_order_any_arrival_order():
    out, state, store = run([
        (0, "reward", reward(0.75)),
        (0, "life", lifecycle("succeeded")),
        (0.5, "span", span("c", 30)),
        (0.5, "span", span("tool", 15, kind="tool", llm=False)),
        (1, "span", span("a", 10)),
        (1, "life", lifecycle("started")),
        (1, "span", span("b", 20)),
    ])
    assert out.dead_letters == []
    trs = out.transitions
    assert [t["span_id"] for t in trs] == ["a", "b", "c"]
    assert [t["call_index"] for t in trs] == [0, 1, 2]
    assert [t["reward"] for t in trs] == [0.75, 0.75, 0.75]
    assert all(t["episode_return"] == 0.75 and t["rollout_transition_count"] == 3 for t in trs)
    assert all(t["task_id"] == "t1" and t["group_size"] == 4 and t["status"] == "succeeded" for t in trs)
    assert trs[0]["behaviour_logprobs"] == [-0.25, -0.25] and trs[0]["prompt_token_ids"] == [1, 2, 10]
    for t in trs:  # matches the schema exactly
        assert codec.decode("transition", codec.encode("transition", t)) == t
    assert store == {}  # tokens released
    # emitted once: more time and re-deliveries produce nothing
    again = assembly.advance(state, store, CFG, 99 * S)
    assert again.transitions == [] and again.dead_letters == []

def test_waits_settle_time_before_emitting():
    state, store = assembly.new_state("r1"), {}
    assembly.add_span(state, span("a", 1), store, CFG, 0)
    assembly.add_rollout_event(state, lifecycle("succeeded"), 0)
    assembly.add_reward(state, reward(1.0), 0)
    assert assembly.advance(state, store, CFG, 0).transitions == []
    assembly.add_span(state, span("b", 2), store, CFG, 1 * S)  # arrives within settle
    assert assembly.advance(state, store, CFG, 1999).transitions == []
    assert [t["span_id"] for t in assembly.advance(state, store, CFG, 2 * S).transitions] == ["a", "b"]
    late = assembly.add_span(state, span("c", 3), store, CFG, 3 * S)
    assert [d["reason"] for d in late.dead_letters] == ["late_span"]

def test_duplicate_span_counted_once():
    out, _, _ = run([(0, "span", span("a", 1)), (0, "span", span("a", 1)), (0, "span", span("b", 2)),
                     (0, "span", span("a", 1)), (1, "life", lifecycle("succeeded")), (1, "reward", reward(1.0)),
                     (1, "reward", reward(1.0))])
    assert [t["span_id"] for t in out.transitions] == ["a", "b"]
    assert out.transitions[0]["rollout_transition_count"] == 2

def test_missing_token_ids_dead_letters_that_span_only():
    out, _, _ = run([(0, "span", span("a", 1)), (0, "span", span("b", 2, llm=False)),
                     (0, "span", span("c", 3, completion=())), (0, "span", span("c", 3, completion=())),
                     (1, "life", lifecycle("succeeded")), (1, "reward", reward(2.0))])
    assert [d["reason"] for d in out.dead_letters] == ["missing_token_ids", "missing_token_ids"]
    assert [t["span_id"] for t in out.transitions] == ["a"]
    assert out.transitions[0]["rollout_transition_count"] == 1

def test_agent_telemetry_of_llm_calls_is_not_training_data():
    """An llm span from the agent's own OTel instrumentation (bridge, no token data) is the
    same call the proxy recorded; it is neither a transition nor a dead letter."""
    out, _, _ = run([(0, "span", span("a", 1)), (0, "span", span("otel", 2, llm=False, source="otlp")),
                     (1, "life", lifecycle("succeeded")), (1, "reward", reward(1.0))])
    assert [t["span_id"] for t in out.transitions] == ["a"] and out.dead_letters == []

def test_agent_filter_selects_calls():
    cfg = assembly.AssemblyConfig(agents=frozenset({"solver"}), settle_s=0)
    out, _, _ = run([(0, "span", span("a", 1, agent="solver")), (0, "span", span("b", 2, agent="critic")),
                     (0, "life", lifecycle("succeeded")), (0, "reward", reward(1.0))], cfg)
    assert [t["span_id"] for t in out.transitions] == ["a"] and out.dead_letters == []

def test_discounted_credit_rule():
    cfg = assembly.AssemblyConfig(credit_rule=parse_credit_rule("discounted:0.5"), settle_s=0)
    out, _, _ = run([(0, "span", span("a", 1)), (0, "span", span("b", 2)), (0, "span", span("c", 3)),
                     (0, "life", lifecycle("succeeded")), (0, "reward", reward(8.0))], cfg)
    assert [t["reward"] for t in out.transitions] == [2.0, 4.0, 8.0]
    assert {t["credit_rule"] for t in out.transitions} == {"discounted:0.5"}

def test_intermediate_rewards_do_not_finish_or_add():
    out, _, _ = run([(0, "span", span("a", 1)), (0, "reward", reward(5.0, final=False)),
                     (0, "life", lifecycle("succeeded")), (0, "reward", reward(1.0)),
                     (0, "reward", reward(3.0, final=False))])
    assert [t["reward"] for t in out.transitions] == [1.0]

def test_no_llm_calls():
    out, _, _ = run([(0, "span", span("tool", 1, kind="tool", llm=False)),
                     (0, "life", lifecycle("succeeded")), (0, "reward", reward(1.0))])
    assert out.transitions == [] and [d["reason"] for d in out.dead_letters] == ["no_llm_calls"]

def test_succeeded_without_reward_times_out():
    out, _, store = run([(0, "span", span("a", 1)), (0, "life", lifecycle("succeeded"))], until_s=9.9)
    assert out.dead_letters == []
    out, _, store = run([(0, "span", span("a", 1)), (0, "life", lifecycle("succeeded"))], until_s=10)
    assert [d["reason"] for d in out.dead_letters] == ["no_reward_before_timeout"]
    assert out.dead_letters[0]["rollout_id"] == "r1" and out.dead_letters[0]["task_id"] == "t1"
    assert store == {}

def test_failed_without_reward_and_failed_with_reward():
    out, _, _ = run([(0, "span", span("a", 1)), (0, "life", lifecycle("failed"))])
    assert [d["reason"] for d in out.dead_letters] == ["rollout_failed_no_reward"]
    out, _, _ = run([(0, "span", span("a", 1)), (0, "life", lifecycle("timeout")), (1, "reward", reward(0.0))])
    assert [(t["status"], t["reward"]) for t in out.transitions] == [("timeout", 0.0)]

def test_no_lifecycle_end_times_out():
    out, _, _ = run([(0, "span", span("a", 1)), (0, "life", lifecycle("started"))], until_s=99)
    assert out.dead_letters == []
    out, state, _ = run([(0, "span", span("a", 1)), (0, "life", lifecycle("started"))], until_s=100)
    assert [d["reason"] for d in out.dead_letters] == ["rollout_timeout"]
    assert not assembly.expired(state, 100 * S, retain_s=50)
    assert assembly.expired(state, 150 * S, retain_s=50)

def test_invalid_reward():
    out, _, _ = run([(0, "span", span("a", 1)), (0, "life", lifecycle("succeeded")),
                     (0, "reward", reward(math.nan)), (1, "reward", reward(1.0))])
    assert [d["reason"] for d in out.dead_letters] == ["invalid_reward"]
    assert [t["reward"] for t in out.transitions] == [1.0]

def test_attempts_are_assembled_separately():
    out, _, _ = run([(0, "span", span("a", 1, attempt="a0")), (0, "life", lifecycle("failed", "a0")),
                     (0, "span", span("b", 1, attempt="a1")), (0, "life", lifecycle("succeeded", "a1")),
                     (0, "reward", reward(1.0, attempt="a1"))])
    assert [(t["attempt_id"], t["span_id"]) for t in out.transitions] == [("a1", "b")]
    assert [d["reason"] for d in out.dead_letters] == ["rollout_failed_no_reward"]

def test_state_is_json():
    import json
    _, state, _ = run([(0, "span", span("a", 1)), (0, "life", lifecycle("succeeded"))], until_s=1)
    assert json.loads(json.dumps(state)) == state

def test_reward_for_a_rollout_never_seen_is_unknown_rollout():
    out, state, _ = run([(5, "reward", reward(1.0))], until_s=104.999)
    assert out.dead_letters == []
    out, state, store = run([(5, "reward", reward(1.0))], until_s=105)
    assert out.transitions == [] and store == {}
    assert out.dead_letters == [{
        "schema_version": 1, "reason": "unknown_rollout", "stage": "assembler",
        "detail": "attempt a0: no lifecycle event and no llm call within 100s; 1 rewards dropped",
        "source_topic": None, "source_partition": None, "source_offset": None,
        "rollout_id": "r1", "task_id": None, "payload": None, "timestamp_ms": 105 * S}]
    assert state["attempts"]["a0"]["done"] == "dead_letter"
    # a lifecycle event, or a call alone, makes it a known rollout that timed out
    out, _, _ = run([(0, "life", lifecycle("started")), (5, "reward", reward(1.0))], until_s=105)
    assert [d["reason"] for d in out.dead_letters] == ["rollout_timeout"]
    out, _, _ = run([(0, "span", span("a", 1)), (5, "reward", reward(1.0))], until_s=105)
    assert [(d["reason"], d["task_id"]) for d in out.dead_letters] == [("rollout_timeout", None)]


# --- store format (encode_call / decode_call) and write-back flags

CALL = {"model": "m", "policy_version": 3, "prompt_token_ids": [1, 2], "completion_token_ids": [5],
        "completion_logprobs": [-0.25]}
# u8 1 | i64 3 | u32 2 | u32 1 | i32 1, 2 | i32 5 | f32 -0.25 | "m"
CALL_BYTES = bytes.fromhex("01" "0300000000000000" "02000000" "01000000"
                           "01000000" "02000000" "05000000" "000080be" "6d")

def test_encode_call_exact_bytes_and_back():
    assert assembly.encode_call(CALL) == CALL_BYTES
    assert assembly.decode_call(CALL_BYTES) == CALL
    big = {**CALL, "prompt_token_ids": [2**31 - 1, -2**31, 0], "model": "pölicy",
           "completion_token_ids": [], "completion_logprobs": []}
    assert assembly.decode_call(assembly.encode_call(big)) == big

def test_decode_call_reads_the_json_of_older_workers():
    import json
    assert assembly.decode_call(json.dumps(CALL).encode()) == CALL

def test_store_holds_encoded_calls():
    state, store = assembly.new_state("r1"), {}
    assembly.add_span(state, span("a", 7, completion=(5, 6)), store, CFG, 0)
    assert store == {"r1|a0|a": bytes.fromhex(
        "01" "0300000000000000" "03000000" "02000000" "01000000" "02000000" "07000000"
        "05000000" "06000000" "000080be" "000080be") + b"policy"}

def test_changed_only_when_the_state_changed():
    state, store = assembly.new_state("r1"), {}
    assert not assembly.add_span(state, span("tool", 1, kind="tool", llm=False), store, CFG, 0).changed
    assert not assembly.add_span(state, span("otel", 2, llm=False, source="otlp"), store, CFG, 0).changed
    assert state == assembly.new_state("r1") and store == {}
    assert assembly.add_span(state, span("a", 3), store, CFG, 0).changed
    assert assembly.add_reward(state, reward(1.0), 0).changed
    assert assembly.add_rollout_event(state, lifecycle("succeeded"), 0).changed
    critic = assembly.AssemblyConfig(agents=frozenset({"critic"}))
    assert not assembly.add_span(state, span("b", 4), store, critic, 0).changed

def test_oversize_call_dead_letters_that_span_only():
    # header 17 + 4 bytes per id and log-prob + 6 ("policy"): span a 17 + 28 + 6 = 51, span b 59
    cfg = assembly.AssemblyConfig(settle_s=0, max_call_bytes=58)
    out, _, store = run([(0, "span", span("a", 1)), (0, "span", span("b", 2, completion=(5, 6, 7))),
                         (1, "life", lifecycle("succeeded")), (1, "reward", reward(1.0))], cfg)
    assert [d["reason"] for d in out.dead_letters] == ["oversize"]
    assert out.dead_letters[0]["detail"] == ("span b: call data 59 bytes > 58 "
                                             "(its transition would not fit the topic)")
    assert [(t["span_id"], t["rollout_transition_count"]) for t in out.transitions] == [("a", 1)]
    assert store == {}
