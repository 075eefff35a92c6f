"""The trace join (stream_jobs/joining.py): orphan spans + trace links -> joined spans or
``no_rollout_id`` dead letters, with exact records."""
from spanrl.schemas import codec
from spanrl.stream_jobs import assembly, joining

S = 1000  # ms per second
TID = "9d2d1ede8da0c9eed1392c9c58431527"
CFG = joining.JoinConfig(orphan_timeout_s=10, orphan_topic="orphan-spans")


def orphan(sid, parent=None, name="ChatCompletion", kind="llm", agent=None, **extra):
    """An orphan-spans record as the bridge writes it (producers/otlp.py)."""
    return {"schema_version": codec.latest_version("span"), "rollout_id": "", "attempt_id": "", "sequence_id": -1, "trace_id": TID,
            "span_id": sid, "parent_span_id": parent, "name": name, "kind": kind, "source": "otlp",
            "start_time_unix_nano": 1, "end_time_unix_nano": 2, "status_code": "OK", "agent_name": agent,
            "attributes": {"llm.model_name": "policy"}, "llm": None, "payload_ref": None, **extra}


def proxy_span(rid="r1", aid="0", sid="c" * 16, parent="a" * 16, trace_id=TID):
    return {"rollout_id": rid, "attempt_id": aid, "sequence_id": 0, "trace_id": trace_id, "span_id": sid,
            "parent_span_id": parent, "name": "chat.completions", "kind": "llm", "source": "proxy"}


def link(rid="r1", aid="0", parent="a" * 16):
    return joining.trace_link(proxy_span(rid, aid, parent=parent), 5)


def feed(state, store, sid, at_ms, offset, **kw):
    span = orphan(sid, **kw)
    return joining.add_orphan(state, span, codec.encode("span", span), offset, store, at_ms)


def test_trace_link_only_for_proxy_calls_with_a_trace_parent():
    assert joining.trace_link(proxy_span(), 5) == {
        "schema_version": 1, "trace_id": TID, "rollout_id": "r1", "attempt_id": "0", "span_id": "c" * 16,
        "parent_span_id": "a" * 16, "timestamp_ms": 5}
    assert codec.decode("trace_link", codec.encode("trace_link", link()))["rollout_id"] == "r1"
    assert joining.trace_link(proxy_span(parent=None), 5) is None          # random trace id of the proxy
    assert joining.trace_link({**proxy_span(), "source": "otlp"}, 5) is None  # the agent's own span
    assert joining.trace_link(proxy_span(trace_id="0" * 32), 5) is None
    assert joining.trace_link(proxy_span(trace_id="t" * 32), 5) is None


def test_orphans_wait_then_join_the_first_linked_attempt_in_arrival_order():
    state, store = joining.new_state(TID, 2), {}
    assert feed(state, store, "b" * 16, 1 * S, offset=7, parent="a" * 16).spans == []
    assert feed(state, store, "a" * 16, 2 * S, offset=8, name="agent run", kind="agent", agent="planner").changed
    assert state["waiting"] == {"b" * 16: {"since_ms": 1000, "offset": 7}, "a" * 16: {"since_ms": 2000, "offset": 8}}
    assert sorted(store) == [f"{TID}|{'a' * 16}", f"{TID}|{'b' * 16}"]

    out = joining.add_link(state, link(), store, 3 * S)
    assert out.dead_letters == [] and out.changed
    assert [(s["span_id"], s["rollout_id"], s["attempt_id"]) for s in out.spans] == [
        ("b" * 16, "r1", "0"), ("a" * 16, "r1", "0")]
    assert out.spans[0] == {**orphan("b" * 16, parent="a" * 16), "rollout_id": "r1", "attempt_id": "0",
                            "attributes": {"llm.model_name": "policy", "spanrl.joined_by": "trace"}}
    assert out.spans[1]["agent_name"] == "planner" and out.spans[1]["kind"] == "agent"
    assert store == {} and state["waiting"] == {} and state["settled"] == ["b" * 16, "a" * 16]
    assert state["attempts"] == [["r1", "0"]] and state["parents"] == {"a" * 16: ["r1", "0"]}
    assert state["last_ms"] == 3000
    for s in out.spans:  # a span.v1 record as it is
        assert codec.decode("span", codec.encode("span", s)) == s


def test_an_orphan_after_the_link_joins_at_once_and_redeliveries_change_nothing():
    state, store = joining.new_state(TID, 0), {}
    joining.add_link(state, link(), store, 1 * S)
    again = joining.add_link(state, link(), store, 2 * S)
    assert (again.spans, again.changed) == ([], False)
    out = feed(state, store, "b" * 16, 3 * S, offset=0)
    assert [(s["span_id"], s["rollout_id"]) for s in out.spans] == [("b" * 16, "r1")] and store == {}
    dup = feed(state, store, "b" * 16, 4 * S, offset=1)
    assert (dup.spans, dup.changed) == ([], False)


def test_each_orphan_joins_one_attempt_its_calls_or_the_latest_linked():
    """A trace that spans several attempts (a retry, a service loop under one root span): a
    call's parent span joins that call's attempt; any other span the latest linked attempt."""
    state, store = joining.new_state(TID, 0), {}
    joining.add_link(state, link("r1", "0", parent="1" * 16), store, 0)
    feed(state, store, "b" * 16, 1 * S, offset=0)
    assert joining.add_link(state, link("r2", "0", parent="2" * 16), store, 2 * S).spans == []  # b stays with r1
    attempts = {sid: (sp["rollout_id"], sp["attempt_id"]) for sid in ("1" * 16, "2" * 16, "d" * 16)
                for sp in feed(state, store, sid, 3 * S, offset=1).spans}
    assert attempts == {"1" * 16: ("r1", "0"), "2" * 16: ("r2", "0"), "d" * 16: ("r2", "0")}
    # r1 calls again: it is the latest attempt now; the same call parent again tells nothing new
    assert joining.add_link(state, link("r1", "0", parent="3" * 16), store, 4 * S).changed
    assert not joining.add_link(state, link("r1", "0", parent="3" * 16), store, 5 * S).changed
    assert state["attempts"] == [["r2", "0"], ["r1", "0"]]
    assert [sp["rollout_id"] for sp in feed(state, store, "e" * 16, 6 * S, offset=2).spans] == ["r1"]


def test_a_long_trace_keeps_a_bounded_state():
    state, store = joining.new_state(TID, 0), {}
    n = joining.MAX_REMEMBERED + 10
    for i in range(n):
        joining.add_link(state, link(f"r{i}", "0", parent=f"{i:016x}"), store, i)
        feed(state, store, f"{i + n:016x}", i, offset=i)
    assert len(state["attempts"]) == len(state["parents"]) == len(state["settled"]) == joining.MAX_REMEMBERED
    assert state["attempts"][-1] == [f"r{n - 1}", "0"] and f"{n - 1:016x}" in state["parents"]
    assert "0" * 15 + "1" not in state["parents"]  # the oldest went first


def test_no_link_within_the_timeout_is_no_rollout_id_with_the_record_as_payload():
    state, store = joining.new_state(TID, 3), {}
    span = orphan("b" * 16)
    raw = codec.encode("span", span)
    joining.add_orphan(state, span, raw, 41, store, 1 * S)
    assert joining.advance(state, store, CFG, 10999) == joining.JoinOutcome()
    out = joining.advance(state, store, CFG, 11 * S)
    assert out.spans == [] and out.changed
    assert out.dead_letters == [{
        "schema_version": 1, "reason": "no_rollout_id", "stage": "joiner", "source_topic": "orphan-spans",
        "source_partition": 3, "source_offset": 41, "rollout_id": None, "task_id": None, "payload": raw,
        "timestamp_ms": 11000,
        "detail": f"span {'b' * 16} of trace {TID} has no spanrl.rollout_id, and no LLM proxy call of its "
                  "trace came within 10s (a call joins a trace when its HTTP request carries the W3C traceparent)"}]
    assert store == {} and state["waiting"] == {} and state["settled"] == ["b" * 16]
    # once dead-lettered: a late link, a re-delivery and more ticks change nothing
    assert joining.add_link(state, link(), store, 12 * S).spans == []
    assert feed(state, store, "b" * 16, 13 * S, offset=41).changed is False
    assert joining.advance(state, store, CFG, 99 * S).dead_letters == []


def test_expiry_only_when_nothing_waits():
    state, store = joining.new_state(TID, 0), {}
    feed(state, store, "b" * 16, 0, offset=0)
    assert not joining.expired(state, 10_000 * S, retain_s=60)  # still waiting: the timeout decides
    joining.advance(state, store, CFG, 20 * S)
    assert not joining.expired(state, 59 * S, retain_s=60)
    assert joining.expired(state, 60 * S, retain_s=60)
    assert not joining.expired(joining.new_state(TID), 60 * S, retain_s=60)  # never touched


def test_joined_llm_span_is_context_not_a_call():
    """An OTel LLM span that describes a proxy-recorded call (even one carrying token ids)
    joins as a link: one transition (the proxy's), no missing_token_ids."""
    tokens = {"model": "policy", "policy_version": 0, "prompt_token_ids": [1], "completion_token_ids": [2],
              "completion_logprobs": [-0.5], "temperature": 1.0, "top_p": 1.0, "max_tokens": None,
              "finish_reason": None, "request_id": "x"}
    claim = orphan("e" * 16, name="big", payload_ref="s3://spanrl-payloads/orphan-spans/k.avro", attributes={})
    state, store = joining.new_state(TID, 0), {}
    joining.add_link(state, link(), store, 0)
    agent = feed(state, store, "a" * 16, 0, offset=0, name="agent run", kind="agent", agent="planner").spans[0]
    oi_llm = feed(state, store, "b" * 16, 0, offset=1, parent="a" * 16, llm=tokens).spans[0]
    big = joining.add_orphan(state, claim, codec.encode("span", claim), 2, store, 0).spans[0]
    assert oi_llm["llm"] is None and big["payload_ref"] is None
    assert big["attributes"] == {"spanrl.joined_by": "trace",
                                 "spanrl.orphan_payload_ref": "s3://spanrl-payloads/orphan-spans/k.avro"}

    call = {**proxy_span(parent="b" * 16), "agent_name": None, "status_code": "OK", "attributes": {},
            "llm": {**tokens, "prompt_token_ids": [1, 2, 3], "completion_token_ids": [4, 5],
                    "completion_logprobs": [-0.25, -0.5]}}
    cfg = assembly.AssemblyConfig(reward_timeout_s=10, rollout_timeout_s=100, settle_s=0)
    a_state, a_store, out = assembly.new_state("r1"), {}, assembly.Outcome()
    for sp in (oi_llm, agent, big, call):
        out.extend(assembly.add_span(a_state, sp, a_store, cfg, 0))
    out.extend(assembly.add_rollout_event(a_state, {"rollout_id": "r1", "attempt_id": "0", "task_id": "t",
                                                    "status": "succeeded", "group_size": 1}, 0))
    out.extend(assembly.add_reward(a_state, {"rollout_id": "r1", "attempt_id": "0", "value": 1.0, "final": True}, 0))
    out.extend(assembly.advance(a_state, a_store, cfg, 1))
    assert out.dead_letters == []
    assert [(t["span_id"], t["agent_name"], t["completion_token_ids"]) for t in out.transitions] == [
        ("c" * 16, "planner", [4, 5])]  # the call's agent, through the joined LLM span to the agent span
    [account] = out.accounts
    assert [(c["span_id"], c["agent_source"]) for c in account["calls"]] == [("c" * 16, "telemetry")]


def test_stream_config_reads_the_join_settings_and_a_replay_app_has_no_join():
    from spanrl.stream_jobs.app import StreamConfig, make_app

    cfg = StreamConfig.from_env({"SPANRL_ORPHAN_SPANS_TOPIC": "x-orphan-spans", "SPANRL_ORPHAN_TIMEOUT_S": "5"})
    assert (cfg.orphan_spans_topic, cfg.join_traces, cfg.orphan_timeout_s) == ("x-orphan-spans", True, 5.0)
    assert (StreamConfig.from_env({}).orphan_spans_topic, StreamConfig.from_env({}).orphan_timeout_s) == (
        "orphan-spans", 300.0)
    for off in ("false", "0", "no", "OFF"):
        assert StreamConfig.from_env({"SPANRL_STREAM_JOIN_TRACES": off}).join_traces is False
    live = make_app(StreamConfig(app_id="unit-live"))
    replay = make_app(StreamConfig(app_id="unit-replay", join_traces=False))  # what infra/replay.py runs
    assert sorted(a.split(".")[-1] for a in live.agents) == ["assemble", "group", "join"]
    assert sorted(a.split(".")[-1] for a in replay.agents) == ["assemble", "group"]


def _named(sid, rid, aid, parent=None, how="gen_ai"):
    """The framework's LLM span of a call answered with a minted id (no traceparent needed)."""
    import json

    from spanrl.core import response_ids

    rid_ = response_ids.mint("chatcmpl-77", rid, aid)
    attrs = {"gen_ai.response.id": rid_} if how == "gen_ai" else {
        "output.value": json.dumps({"id": rid_, "choices": []}), "output.mime_type": "application/json"}
    return orphan(sid, parent=parent, attributes=attrs)


def test_a_span_naming_its_attempt_by_response_id_joins_and_releases_its_trace():
    """No trace link ever comes (the client sent no traceparent): the agent span waits; the
    LLM span's minted response id names attempt r7/1, so both join it, in arrival order."""
    state, store = joining.new_state(TID, 1), {}
    agent = orphan("a" * 16, name="agent run", kind="agent", agent="planner")
    assert joining.add_orphan(state, agent, codec.encode("span", agent), 4, store, 1 * S, CFG).spans == []
    llm = _named("b" * 16, "r7", "1", parent="a" * 16, how="openinference")
    out = joining.add_orphan(state, llm, codec.encode("span", llm), 5, store, 2 * S, CFG)
    assert out.dead_letters == [] and out.changed
    assert [(s["span_id"], s["rollout_id"], s["attempt_id"], s["attributes"]["spanrl.joined_by"]) for s in out.spans] \
        == [("a" * 16, "r7", "1", "trace"), ("b" * 16, "r7", "1", "response_id")]
    assert out.spans[1]["attributes"]["spanrl.joined_response_id"] == "chatcmpl-77~spanrl~r7~1"
    assert out.spans[0]["agent_name"] == "planner" and store == {} and state["waiting"] == {}
    assert state["attempts"] == [["r7", "1"]] and state["parents"] == {"b" * 16: ["r7", "1"]}
    # a later span of the trace joins the same attempt at once; a re-delivery changes nothing
    assert [s["rollout_id"] for s in feed(state, store, "c" * 16, 3 * S, offset=6).spans] == ["r7"]
    again = joining.add_orphan(state, llm, codec.encode("span", llm), 5, store, 4 * S, CFG)
    assert (again.spans, again.dead_letters, again.changed) == ([], [], False)


def test_response_id_and_traceparent_naming_different_attempts_is_dead_lettered_not_guessed():
    state, store = joining.new_state(TID, 3), {}
    joining.add_link(state, link("r1", "0", parent="b" * 16), store, 1 * S)  # the proxy saw b's traceparent
    llm = _named("b" * 16, "r2", "0")
    raw = codec.encode("span", llm)
    out = joining.add_orphan(state, llm, raw, 9, store, 2 * S, CFG)
    assert out.spans == [] and out.changed and state["settled"] == ["b" * 16]
    [d] = out.dead_letters
    assert (d["reason"], d["stage"], d["source_topic"], d["source_partition"], d["source_offset"], d["payload"]) == (
        "ambiguous_join", "joiner", "orphan-spans", 3, 9, raw)
    assert "names attempt 0 of rollout r2, its traceparent links attempt 0 of rollout r1" in d["detail"]
    # the same attempt both ways is no conflict
    state2 = joining.new_state(TID, 0)
    joining.add_link(state2, link("r2", "0", parent="b" * 16), {}, 1 * S)
    ok = joining.add_orphan(state2, llm, raw, 9, {}, 2 * S, CFG)
    assert [(s["rollout_id"], s["attributes"]["spanrl.joined_by"]) for s in ok.spans] == [("r2", "response_id")]
