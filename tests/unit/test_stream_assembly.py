import math

import pytest

from spanrl.schemas import codec
from spanrl.stream_jobs import air, assembly
from spanrl.stream_jobs.credit import parse_credit_rule

S = 1000  # ms per second
CFG = assembly.AssemblyConfig(reward_timeout_s=10, rollout_timeout_s=100, settle_s=2)
#: no late-reward window: an ended attempt without a final reward is dead-lettered at reward_timeout_s
NO_WINDOW = assembly.AssemblyConfig(reward_timeout_s=10, rollout_timeout_s=100, settle_s=2, reward_window_s=0)

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

def test_n_choices_of_one_request_are_n_transitions():
    """The proxy records each choice of an n=2 request as its own span (same prompt, same trace
    parent, own span id and sequence id): two transitions, both credited with R, in sequence
    order; a later call of the attempt follows them."""
    def choice(sid, seq, completion):
        s = span(sid, seq, completion=completion)
        s["llm"]["prompt_token_ids"] = [1, 2, 3]
        return {**s, "parent_span_id": "p1", "attributes": {"spanrl.choice_index": str(seq)}}
    out, _, _ = run([(0, "span", choice("c1", 1, (8,))), (0, "span", choice("c0", 0, (5, 6))),
                     (0, "span", span("next", 2)), (1, "life", lifecycle("succeeded")), (1, "reward", reward(0.5))])
    assert out.dead_letters == []
    assert [(t["span_id"], t["prompt_token_ids"], t["completion_token_ids"], t["reward"])
            for t in out.transitions] == [("c0", [1, 2, 3], [5, 6], 0.5), ("c1", [1, 2, 3], [8], 0.5),
                                          ("next", [1, 2, 2], [5, 6], 0.5)]
    assert [t["rollout_transition_count"] for t in out.transitions] == [3, 3, 3]

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
    out, _, store = run([(0, "span", span("a", 1)), (0, "life", lifecycle("succeeded"))], NO_WINDOW, until_s=9.9)
    assert out.dead_letters == []
    out, _, store = run([(0, "span", span("a", 1)), (0, "life", lifecycle("succeeded"))], NO_WINDOW, until_s=10)
    assert [d["reason"] for d in out.dead_letters] == ["no_reward_before_timeout"]
    assert out.dead_letters[0]["rollout_id"] == "r1" and out.dead_letters[0]["task_id"] == "t1"
    assert store == {}

def test_failed_without_reward_and_failed_with_reward():
    out, _, _ = run([(0, "span", span("a", 1)), (0, "life", lifecycle("failed"))], NO_WINDOW)
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
                     (0, "reward", reward(1.0, attempt="a1"))], NO_WINDOW)
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
    # telemetry naming no agent, without a parent and stating no fact (AIR) links nothing: no trace
    assert not assembly.add_span(state, span("step", 1, kind="chain", llm=False, agent=None), store, CFG, 0).changed
    assert not assembly.add_span(state, span("otel", 2, llm=False, source="otlp", agent=None), store, CFG, 0).changed
    assert state == assembly.new_state("r1") and store == {}
    # a tool span states a fact (tool_ok): kept, once
    assert assembly.add_span(state, span("tool", 1, kind="tool", llm=False, agent=None), store, CFG, 0).changed
    assert state["attempts"]["a0"]["facts"] == {"tool": [None, "tool_ok"]}
    assert not assembly.add_span(state, span("tool", 1, kind="tool", llm=False, agent=None), store, CFG, 0).changed
    # a span naming an agent is a link; the same link again changes nothing
    assert assembly.add_span(state, span("node", 2, kind="chain", llm=False, agent="solver"), store, CFG, 0).changed
    assert state["attempts"]["a0"]["links"] == {"node": [None, "solver"]}
    assert not assembly.add_span(state, span("node", 2, kind="chain", llm=False, agent="solver"), store, CFG, 0).changed
    assert assembly.add_span(state, span("a", 3), store, CFG, 0).changed
    assert assembly.add_reward(state, reward(1.0), 0).changed
    assert assembly.add_rollout_event(state, lifecycle("succeeded"), 0).changed
    # selection happens when the attempt ends: a call of an unselected agent is kept until then
    critic = assembly.AssemblyConfig(agents=frozenset({"critic"}))
    assert assembly.add_span(state, span("b", 4), store, critic, 0).changed

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


# ---- agents of calls: resolution through the trace, selection, call accounts ----------

def fw(sid, parent, agent=None, kind="chain", attempt="a0"):
    """A framework span (bridge, no token data) with its trace parent."""
    return {**span(sid, -1, kind=kind, agent=agent, llm=False, attempt=attempt, source="otlp"),
            "parent_span_id": parent}


def call(sid, seq, parent, agent=None, attempt="a0"):
    """A proxy call whose traceparent named ``parent``; ``agent``: the x-spanrl-agent header."""
    return {**span(sid, seq, agent=agent, attempt=attempt), "parent_span_id": parent}


def sql_team_events():
    """A LangGraph write_query -> check_query -> rewrite_query episode as OpenInference and
    the proxy record it: each call's traceparent is its node's span (or the chat model's
    span inside it); the calls arrive before some of the node spans."""
    return [
        (0, "span", call("c1", 1, "n-write")),
        (0, "span", call("c2", 2, "llm-check")),
        (0, "span", call("c3", 3, "n-rewrite")),
        (0, "span", call("c4", 4, None)),            # a call with no trace context
        (0.5, "span", fw("graph", None)),
        (0.5, "span", fw("n-write", "graph", "write_query")),
        (0.5, "span", fw("n-check", "graph", "check_query")),
        (0.5, "span", fw("llm-check", "n-check", kind="llm")),
        (0.5, "span", fw("n-rewrite", "graph", "rewrite_query")),
        (1, "life", lifecycle("succeeded")), (1, "reward", reward(1.0)),
    ]


def test_resolve_agent_walks_the_trace():
    links = {"gen": ["agent", None], "agent": ["root", "answerer"], "root": [None, None],
             "x": ["y", None], "y": ["x", None]}
    assert assembly.resolve_agent({"agent_name": None, "parent": "gen"}, links) == ("answerer", "telemetry")
    assert assembly.resolve_agent({"agent_name": None, "parent": "agent"}, links) == ("answerer", "telemetry")
    assert assembly.resolve_agent({"agent_name": "hdr", "parent": "gen"}, links) == ("hdr", "call")
    assert assembly.resolve_agent({"agent_name": None, "parent": "root"}, links) == (None, "unresolved")
    assert assembly.resolve_agent({"agent_name": None, "parent": "missing"}, links) == (None, "unresolved")
    assert assembly.resolve_agent({"agent_name": None, "parent": None}, links) == (None, "unresolved")
    assert assembly.resolve_agent({"agent_name": None, "parent": "x"}, links) == (None, "unresolved")  # cycle
    deep = {f"s{i}": [f"s{i + 1}", None] for i in range(100)} | {"s100": [None, "far"]}
    assert assembly.resolve_agent({"agent_name": None, "parent": "s0"}, deep) == (None, "unresolved")
    assert assembly.resolve_agent({"agent_name": None, "parent": "s40"}, deep) == ("far", "telemetry")


def test_parse_train_agents():
    assert assembly.parse_train_agents(None) is None and assembly.parse_train_agents("  ") is None
    sel = assembly.parse_train_agents("write_query, rewrite_query,")
    assert sel.names == frozenset({"write_query", "rewrite_query"}) and sel.describe() == "rewrite_query,write_query"
    assert sel.selects("write_query") and not sel.selects("check_query") and not sel.selects(None)
    rx = assembly.parse_train_agents("re:(re)?write_query")
    assert rx.selects("write_query") and rx.selects("rewrite_query") and not rx.selects("write_query2")
    assert rx.describe() == "re:(re)?write_query"
    for bad in ("re:(", ",", " , "):
        try:
            assembly.parse_train_agents(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} accepted")


def test_selective_training_by_resolved_agent_with_call_accounts():
    cfg = assembly.AssemblyConfig(agents=assembly.parse_train_agents("write_query,rewrite_query"), settle_s=2)
    out, state, store = run(sql_team_events(), cfg)
    assert out.dead_letters == [] and store == {}
    trs = out.transitions
    assert [(t["span_id"], t["agent_name"]) for t in trs] == [("c1", "write_query"), ("c3", "rewrite_query")]
    assert [t["call_index"] for t in trs] == [0, 1] and {t["rollout_transition_count"] for t in trs} == {2}
    [acc] = out.accounts
    assert acc["outcome"] == "emitted" and acc["selection"] == "rewrite_query,write_query" and acc["task_id"] == "t1"
    assert [(c["span_id"], c["agent_name"], c["agent_source"], c["trained"]) for c in acc["calls"]] == [
        ("c1", "write_query", "telemetry", True), ("c2", "check_query", "telemetry", False),
        ("c3", "rewrite_query", "telemetry", True), ("c4", None, "unresolved", False)]
    assert codec.decode("call_account", codec.encode("call_account", acc)) == acc
    # a framework span after the attempt ended changes nothing
    assert not assembly.add_span(state, fw("late", "graph", "write_query"), store, cfg, 30 * S).changed


def test_without_a_selector_every_call_trains_unresolved_ones_included():
    out, _, _ = run(sql_team_events(), assembly.AssemblyConfig(settle_s=2))
    assert [(t["span_id"], t["agent_name"]) for t in out.transitions] == [
        ("c1", "write_query"), ("c2", "check_query"), ("c3", "rewrite_query"), ("c4", None)]
    assert [c["trained"] for c in out.accounts[0]["calls"]] == [True] * 4 and out.accounts[0]["selection"] == "all"


def test_header_overrides_telemetry_and_regex_selection():
    events = [(0, "span", call("c1", 1, "n-write", agent="writer-v2")), (0, "span", fw("n-write", None, "write_query")),
              (0, "span", call("c2", 2, "n-write")), (1, "life", lifecycle("succeeded")), (1, "reward", reward(0.5))]
    cfg = assembly.AssemblyConfig(agents=assembly.parse_train_agents("re:writer-.*"), settle_s=0)
    out, _, _ = run(events, cfg)
    assert [(t["span_id"], t["agent_name"]) for t in out.transitions] == [("c1", "writer-v2")]
    assert [(c["agent_name"], c["agent_source"]) for c in out.accounts[0]["calls"]] == [
        ("writer-v2", "call"), ("write_query", "telemetry")]


def test_every_call_excluded_is_a_no_llm_calls_dead_letter_with_its_account():
    cfg = assembly.AssemblyConfig(agents=frozenset({"planner"}), settle_s=0)
    out, _, store = run(sql_team_events(), cfg)
    assert out.transitions == [] and store == {}
    [d] = out.dead_letters
    assert d["reason"] == "no_llm_calls" and "4 calls of agents not selected by planner" in d["detail"]
    [acc] = out.accounts
    assert acc["outcome"] == "no_llm_calls" and not any(c["trained"] for c in acc["calls"])


def test_timed_out_attempt_has_an_account_too():
    out, _, _ = run([(0, "span", call("c1", 1, "n")), (0, "span", fw("n", None, "solver"))], until_s=200)
    assert [d["reason"] for d in out.dead_letters] == ["rollout_timeout"]
    assert [(c["agent_name"], c["trained"]) for c in out.accounts[0]["calls"]] == [("solver", False)]


def test_agent_counts_of_call_accounts():
    from spanrl.infra.replay import agent_counts

    out, _, _ = run(sql_team_events(), assembly.AssemblyConfig(
        agents=assembly.parse_train_agents("write_query,rewrite_query"), settle_s=0))
    twice = out.accounts * 2
    assert agent_counts(twice) == {
        "(unresolved)": {"calls": 2, "trained": 0, "excluded": 2},
        "check_query": {"calls": 2, "trained": 0, "excluded": 2},
        "rewrite_query": {"calls": 2, "trained": 2, "excluded": 0},
        "write_query": {"calls": 2, "trained": 2, "excluded": 0}}
    assert agent_counts([]) == {}


# ---- the emission rule: inputs bound vs positions (no wall-clock wait) ----

def acked(status="succeeded", attempt="a0"):
    return {**lifecycle(status, attempt), "inputs_acked": True}

def test_inputs_consumed_rule():
    bound = {"spans": 10, "rewards": 4}
    assert assembly.inputs_consumed(bound, {"spans": 10, "rewards": 4}) is True
    assert assembly.inputs_consumed(bound, {"spans": 12, "rewards": 9, "rollouts": 3}) is True
    assert assembly.inputs_consumed(bound, {"spans": 9, "rewards": 4}) is False
    assert assembly.inputs_consumed(bound, {"spans": 9}) is False      # one known behind: False
    assert assembly.inputs_consumed(bound, {"spans": 10}) is None      # rewards position unknown
    assert assembly.inputs_consumed(None, {"spans": 10, "rewards": 4}) is None
    assert assembly.inputs_consumed(bound, None) is None
    assert assembly.inputs_consumed({}, {}) is True

def test_acked_attempt_emits_as_soon_as_positions_pass_the_bound():
    """No settle wait: emitted at the same instant the worker has read up to the bound, and
    not a millisecond before even if settle_s has long passed."""
    state, store = assembly.new_state("r1"), {}
    assembly.add_span(state, span("a", 1), store, CFG, 0)
    assembly.add_reward(state, reward(1.0), 0)
    assert assembly.wants_inputs_bound(state, acked())
    assembly.add_rollout_event(state, acked(), 0, inputs_bound={"spans": 7, "rewards": 3})
    assert not assembly.wants_inputs_bound(state, acked())  # only the first terminal event
    assert state["attempts"]["a0"]["inputs_bound"] == {"rewards": 3, "spans": 7}
    assert assembly.awaiting_inputs(state) == {"rewards": 3, "spans": 7}
    # spans partition read up to offset 5 only: wait, even 60 s later (settle_s is 2)
    assert assembly.advance(state, store, CFG, 0, {"spans": 5, "rewards": 3}).transitions == []
    assert assembly.advance(state, store, CFG, 60 * S, {"spans": 6, "rewards": 3}).transitions == []
    assembly.add_span(state, span("b", 2), store, CFG, 60 * S)  # the span at offset 6
    out = assembly.advance(state, store, CFG, 60 * S, {"spans": 7, "rewards": 3})
    assert [t["span_id"] for t in out.transitions] == ["a", "b"]
    assert assembly.awaiting_inputs(state) is None

def test_acked_attempt_emits_at_once_when_already_read():
    state, store = assembly.new_state("r1"), {}
    assembly.add_span(state, span("a", 1), store, CFG, 0)
    assembly.add_reward(state, reward(0.5), 0)
    assembly.add_rollout_event(state, acked(), 5, inputs_bound={"spans": 1, "rewards": 1})
    out = assembly.advance(state, store, CFG, 5, {"spans": 1, "rewards": 1, "rollouts": 9})
    assert [(t["span_id"], t["reward"]) for t in out.transitions] == [("a", 0.5)]

def test_unknown_positions_fall_back_to_settle_time():
    """Just after a restart the worker knows no positions: the bound cannot be checked, so
    the settle_s grace applies as for events that do not say inputs_acked."""
    state, store = assembly.new_state("r1"), {}
    assembly.add_span(state, span("a", 1), store, CFG, 0)
    assembly.add_reward(state, reward(1.0), 0)
    assembly.add_rollout_event(state, acked(), 0, inputs_bound={"spans": 1, "rewards": 1})
    assert assembly.advance(state, store, CFG, 0, {"rewards": 1}).transitions == []
    assert assembly.advance(state, store, CFG, 1999, {"rewards": 1}).transitions == []
    assert len(assembly.advance(state, store, CFG, 2000, {"rewards": 1}).transitions) == 1

def test_bound_is_ignored_without_inputs_acked_and_reward_still_required():
    state, store = assembly.new_state("r1"), {}
    assembly.add_span(state, span("a", 1), store, CFG, 0)
    assert not assembly.wants_inputs_bound(state, lifecycle("succeeded"))
    assembly.add_rollout_event(state, lifecycle("succeeded"), 0, inputs_bound={"spans": 1, "rewards": 0})
    assert "inputs_bound" not in state["attempts"]["a0"] and assembly.awaiting_inputs(state) is None
    # an acked attempt without its final reward waits for it (and times out as before)
    s2, st2 = assembly.new_state("r1"), {}
    assembly.add_span(s2, span("a", 1), st2, CFG, 0)
    assembly.add_rollout_event(s2, acked(), 0, inputs_bound={"spans": 1, "rewards": 0})
    assert assembly.advance(s2, st2, CFG, 1 * S, {"spans": 1, "rewards": 0}).transitions == []
    no_window = assembly.AssemblyConfig(reward_timeout_s=10, rollout_timeout_s=100, settle_s=2, reward_window_s=0)
    out = assembly.advance(s2, st2, no_window, 10 * S, {"spans": 1, "rewards": 0})
    assert [d["reason"] for d in out.dead_letters] == ["no_reward_before_timeout"]
# ---- AIR: intermediate rewards from span facts ---------------------------------------

def timed(rec, start_ns=None, end_ns=None, status=None, **attrs):
    """``rec`` with OTel times, a status and attributes (the bridge's span record fields)."""
    out = {**rec, "start_time_unix_nano": start_ns, "end_time_unix_nano": end_ns, "attributes": attrs}
    if status:
        out["status_code"] = status
    return out


def air_events():
    """Calls a (ends 10), b (ends 30), c (ends 50) of R = 1; tool t1 errors after a, tool t2
    times out after b, tool t3 succeeds after c, a validator fails before any call ended."""
    tool = lambda sid, seq, **kw: timed(span(sid, seq, kind="tool", llm=False, agent=None, source="otlp"), **kw)  # noqa: E731
    return [
        (0, "span", timed(span("a", 0), 1, 10)), (0, "span", timed(span("b", 1), 20, 30)),
        (0, "span", timed(span("c", 2), 40, 50)),
        (0, "span", tool("t1", 0, start_ns=12, end_ns=14, status="ERROR")),
        (0, "span", tool("t2", 1, start_ns=30, end_ns=39, status="ERROR", **{"exception.type": "TimeoutError"})),
        (0, "span", tool("t3", 2, start_ns=55, end_ns=56, status="OK")),
        (0, "span", timed(span("v", 3, kind="other", llm=False, agent=None, source="otlp"), 0, 1,
                          **{"spanrl.verdict": "fail"})),
        (1, "life", lifecycle("succeeded")), (1, "reward", reward(1.0)),
    ]


def test_air_rewards_the_call_that_caused_each_fact_span():
    """tool_error -0.1, timeout -0.5 (first rule in the order written wins per span),
    tool_ok +0.05; identical credit: r_t = R + i_t. t2 started when b ended (ties go to b)."""
    rule = parse_credit_rule("identical").with_air(air.parse_air_rules("timeout:-0.5,tool_error:-0.1,tool_ok:0.05"))
    out, state, _ = run(air_events(), cfg=assembly.AssemblyConfig(credit_rule=rule, settle_s=0))
    trs = out.transitions
    assert [t["span_id"] for t in trs] == ["a", "b", "c"]
    assert [t["intermediate_reward"] for t in trs] == [-0.1, -0.5, 0.05]
    assert [t["reward"] for t in trs] == [0.9, 0.5, 1.05]
    assert all(t["episode_return"] == 1.0 and t["air_rules"] == "timeout:-0.5,tool_error:-0.1,tool_ok:0.05"
               and t["credit_rule"] == "identical" for t in trs)
    assert state["attempts"]["a0"]["facts"]["t2"] == [30, "tool_error", "exception", "timeout"]
    for t in trs:
        assert codec.decode("transition", codec.encode("transition", t)) == t


def test_air_return_to_go_and_unselected_causes():
    """return_to_go:0.5, i = [-0.1, -0.1, +0.05] -> G_2 = 0.05 + R, G_t = i_t + 0.5 G_{t+1};
    with only a and c selected (b's agent excluded), t2 (caused by b) rewards no call."""
    rules = air.parse_air_rules("tool_error:-0.1,tool_ok:0.05,verdict_fail:-1")
    rule = parse_credit_rule("return_to_go:0.5").with_air(rules)
    out, _, _ = run(air_events(), cfg=assembly.AssemblyConfig(credit_rule=rule, settle_s=0))
    # i = [-0.1 (t1), -0.1 (t2: tool_error first), 0.05 (t3)]; the verdict came before any call
    assert [t["intermediate_reward"] for t in out.transitions] == [-0.1, -0.1, 0.05]
    assert [t["reward"] for t in out.transitions] == pytest.approx([-0.1 + 0.5 * (-0.1 + 0.5 * 1.05),
                                                                    -0.1 + 0.5 * 1.05, 1.05])
    events = [(t, k, {**r, "agent_name": "critic"} if k == "span" and r["span_id"] == "b" else r)
              for t, k, r in air_events()]
    cfg = assembly.AssemblyConfig(credit_rule=parse_credit_rule("identical").with_air(rules), settle_s=0,
                                  agents=frozenset({"solver"}))
    out, _, _ = run(events, cfg=cfg)
    assert [(t["span_id"], t["intermediate_reward"], t["reward"]) for t in out.transitions] == [
        ("a", -0.1, 0.9), ("c", 0.05, 1.05)]


def test_without_air_rules_transitions_are_as_before():
    out, _, _ = run(air_events(), cfg=assembly.AssemblyConfig(settle_s=0))
    assert [(t["reward"], t["intermediate_reward"], t["air_rules"]) for t in out.transitions] == [(1.0, 0.0, "")] * 3


def test_a_call_without_traceparent_takes_its_agent_from_the_span_joined_by_its_response_id():
    """The proxy's record of a call made with no traceparent has no parent; its minted response
    id links it to the framework's LLM span joined by that id, whose parent names the agent."""
    from spanrl.core import response_ids

    minted = response_ids.mint("chatcmpl-5", "r1", "0")
    call = {"sequence_id": 0, "agent_name": None, "end_ns": 1,
            "parent": response_ids.call_link({"gen_ai.response.id": minted})}
    assert call["parent"] == "response:" + minted
    links = {"response:" + minted: ["f" * 16, None], "f" * 16: ["a" * 16, None], "a" * 16: [None, "planner"]}
    assert assembly.resolve_agent(call, links) == ("planner", "telemetry")
    assert assembly.resolve_agent(call, {}) == (None, "unresolved")  # the framework span never came
