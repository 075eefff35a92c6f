"""AIR: span facts, rule parsing, which call caused a span, intermediate rewards (stream_jobs/air.py)."""
import pytest

from spanrl.stream_jobs import air


def sp(kind="tool", status="UNSET", **attrs):
    return {"kind": kind, "status_code": status, "attributes": attrs}


@pytest.mark.parametrize("span,facts", [
    (sp(status="ERROR"), ["tool_error"]),
    (sp(status="OK"), ["tool_ok"]),
    (sp(), ["tool_ok"]),
    (sp(status="ERROR", **{"exception.type": "ValueError"}), ["tool_error", "exception"]),
    (sp(status="ERROR", **{"exception.type": "httpx.ReadTimeout"}), ["tool_error", "exception", "timeout"]),
    (sp(kind="other", **{"error.type": "timeout"}), ["timeout"]),
    (sp(kind="agent", **{"exception.type": "KeyError"}), ["exception"]),
    (sp(kind="other", **{"spanrl.verdict": "PASS"}), ["verdict_pass"]),
    (sp(kind="chain", **{"spanrl.verdict": "false"}), ["verdict_fail"]),
    (sp(kind="chain", **{"spanrl.verdict": "maybe"}), []),
    (sp(kind="agent", status="ERROR"), []),
    ({"kind": "chain"}, []),
])
def test_span_facts(span, facts):
    assert air.span_facts(span) == facts


def test_parse_air_rules():
    assert air.parse_air_rules(None) is None
    assert air.parse_air_rules(" ") is None and air.parse_air_rules("off") is None and air.parse_air_rules("None") is None
    rules = air.parse_air_rules(" timeout:-0.5, tool_error:-0.1 ,tool_ok:+0.05,")
    assert rules.rules == (("timeout", -0.5), ("tool_error", -0.1), ("tool_ok", 0.05))
    assert rules.describe() == "timeout:-0.5,tool_error:-0.1,tool_ok:0.05"
    assert air.parse_air_rules(rules.describe()) == rules


@pytest.mark.parametrize("bad,message", [
    ("tool_eror:-1", "unknown fact 'tool_eror'"),
    ("tool_error", "has no reward"),
    ("tool_error:", "has no reward"),
    ("tool_error:x", "reward of tool_error: 'x' is not a number"),
    ("tool_error:inf", "must be finite"),
    ("tool_error:nan", "must be finite"),
    ("tool_error:-1,tool_error:-2", "given twice"),
    (",", "no rule"),
])
def test_bad_air_rules_are_clear_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        air.parse_air_rules(bad)


def test_first_rule_in_written_order_wins_per_span():
    rules = air.parse_air_rules("timeout:-0.5,tool_error:-0.1")
    assert rules.span_reward(["tool_error", "exception", "timeout"]) == -0.5
    assert rules.span_reward(["tool_error"]) == -0.1
    assert rules.span_reward(["tool_ok"]) is None
    assert air.parse_air_rules("tool_error:-0.1,timeout:-0.5").span_reward(["tool_error", "timeout"]) == -0.1


def test_cause_is_the_nearest_preceding_call_in_time():
    calls = {"a": {"end_ns": 10, "sequence_id": 0}, "b": {"end_ns": 30, "sequence_id": 1},
             "n1": {"end_ns": 30, "sequence_id": 2}, "old": {"sequence_id": 3}}
    assert air.cause_of(12, calls) == "a"
    assert air.cause_of(10, calls) == "a"          # ended at the span's start: caused it
    assert air.cause_of(31, calls) == "n1"         # same end time: the later call (sequence id)
    assert air.cause_of(9, calls) is None          # before any call ended
    assert air.cause_of(None, calls) is None       # a span without a time
    assert air.cause_of(100, {"old": {"sequence_id": 0}}) is None  # a call without an end time


def test_intermediate_rewards_sum_over_the_spans_a_call_caused():
    calls = {"a": {"end_ns": 10, "sequence_id": 0}, "b": {"end_ns": 30, "sequence_id": 1},
             "x": {"end_ns": 20, "sequence_id": 2}}
    facts = {"t1": [12, "tool_error"], "t2": [14, "tool_error"], "t3": [35, "tool_error", "timeout"],
             "t4": [5, "tool_ok"], "t5": [21, "tool_error"], "t6": [40, "verdict_pass"]}
    rules = air.parse_air_rules("timeout:-0.5,tool_error:-0.25,tool_ok:1,verdict_pass:0.5")
    # a: t1 + t2 = -0.5; b: t3 (timeout first) + t6 = 0; x (not trained) caused t5; t4 before any call
    assert air.intermediate_rewards(calls, facts, ["a", "b"], rules) == [-0.5, 0.0]
    assert air.intermediate_rewards(calls, facts, ["b", "x"], rules) == [0.0, -0.25]
    assert air.intermediate_rewards(calls, facts, ["a", "b"], None) == [0.0, 0.0]
    assert air.intermediate_rewards(calls, {}, ["a"], rules) == [0.0]
