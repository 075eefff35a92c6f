"""The pure parts of a replay: where training starts (``--train-from``), the progress count,
a time window's offsets, and the re-scoring of recorded attempts by a new reward function
(spanrl/infra/replay.py, spanrl/infra/replay_inputs.py)."""
from __future__ import annotations

import json

import pytest
from aiokafka import TopicPartition

from spanrl.infra.replay import base_or_checkpoint, progress_of
from spanrl.infra.replay_inputs import (ReplayError, Stored, attempts_to_score, call_view, new_returns,
                                        offset_ranges, rewritten_rewards, task_view)


@pytest.mark.parametrize("spec, expected", [
    (None, None), ("base", None), ("run-a:0", None), ("run-a:000", None), ("run-a:3", ("run-a", 3)),
    (" run-a:12 ", ("run-a", 12)),
])
def test_train_from_zero_or_base_is_the_base_model(spec, expected):
    assert base_or_checkpoint(spec) == expected


@pytest.mark.parametrize("spec", ["run-a", "run-a:", ":3", "run-a:v3", "run-a:-1", "latest"])
def test_train_from_malformed_is_refused_with_the_form(spec):
    with pytest.raises(ValueError, match="RUN:VERSION or base"):
        base_or_checkpoint(spec)


def test_progress_counts_offsets_from_the_start_to_the_ends():
    a, b, c = (TopicPartition("spans", p) for p in range(3))
    ends = {a: 10, b: 4, c: 0}
    start = {a: 2, b: 0}
    assert progress_of(start, {a: 2, b: 0}, ends) == (0, 12)
    assert progress_of(start, {a: 7, b: 4}, ends) == (9, 12)
    # committed past the end (transaction markers) counts as the end
    assert progress_of(start, {a: 11, b: 5, c: 1}, ends) == (12, 12)


def test_offset_ranges_of_a_window():
    # partition 0: since at 3, until at 8; 1: nothing at/after since; 2: no until record -> end
    assert offset_ranges({0: 3, 1: None, 2: 0}, {0: 8, 1: None, 2: None}, {0: 10, 1: 6, 2: 5}) == {
        0: (3, 8), 1: (6, 6), 2: (0, 5)}
    # no since: from 0; until before since is empty, never negative
    assert offset_ranges({}, {0: 4}, {0: 9, 1: 2}) == {0: (0, 4), 1: (0, 2)}
    assert offset_ranges({0: 5}, {0: 2}, {0: 9}) == {0: (5, 5)}


def test_task_view_parses_the_payload_and_survives_an_expired_task():
    rec = {"schema_version": 1, "task_id": "t1", "payload": json.dumps({"answer": 42}), "group_size": 4,
           "timeout_s": 60.0, "created_ms": 5}
    assert task_view(rec, "t1") == {"task_id": "t1", "payload": {"answer": 42}, "group_size": 4, "timeout_s": 60.0,
                                    "created_ms": 5}
    assert task_view({**rec, "payload": "not json"}, "t1")["payload"] == "not json"
    assert task_view(None, "t9") == {"task_id": "t9", "payload": None}


def _span(rid, aid, seq, completion, messages=None, output=None, kind="llm"):
    llm = None if kind != "llm" else {
        "model": "policy", "policy_version": 2, "prompt_token_ids": [1, 2], "completion_token_ids": completion,
        "completion_logprobs": [-0.5] * len(completion), "finish_reason": "stop",
        "input_messages": None if messages is None else json.dumps(messages),
        "output_messages": None if output is None else json.dumps(output)}
    return {"rollout_id": rid, "attempt_id": aid, "sequence_id": seq, "span_id": f"s{seq}", "agent_name": None,
            "llm": llm}


def test_call_view_gives_messages_and_tokens():
    view = call_view(_span("r", "a", 3, [7, 8], [{"role": "user", "content": "2+2?"}],
                           [{"role": "assistant", "content": "4"}]))
    assert view == {"span_id": "s3", "sequence_id": 3, "agent_name": None, "model": "policy", "policy_version": 2,
                    "input_messages": [{"role": "user", "content": "2+2?"}],
                    "output_messages": [{"role": "assistant", "content": "4"}], "request": None,
                    "tokenizer": None, "tokenizer_sha256": None, "prompt_token_ids": [1, 2],
                    "completion_token_ids": [7, 8], "completion_logprobs": [-0.5, -0.5], "finish_reason": "stop"}
    # a record written before messages were kept: None, token ids still there
    assert call_view(_span("r", "a", 0, [9]))["input_messages"] is None


def _ev(rid, aid, status, task="t1", ts=100):
    return {"rollout_id": rid, "attempt_id": aid, "task_id": task, "status": status, "timestamp_ms": ts}


def _rw(rid, aid, value, final=True, ts=50):
    return {"rollout_id": rid, "attempt_id": aid, "value": value, "final": final, "name": "reward", "span_id": None,
            "timestamp_ms": ts, "components": {}}


def test_attempts_to_score_takes_rewarded_or_succeeded_attempts():
    rollouts = [_ev("r1", "a1", "started"), _ev("r1", "a1", "succeeded"), _ev("r2", "a1", "started"),
                _ev("r2", "a1", "failed"), _ev("r3", "a1", "started"), _ev("r3", "a1", "succeeded"),
                _ev("r4", "a1", "timeout", task="t2")]
    rewards = [_rw("r1", "a1", 0.0), _rw("r1", "a1", 1.0), _rw("r2", "a1", 0.25), _rw("r3", "a1", 0.5, final=False)]
    assert attempts_to_score(rollouts, rewards) == {
        ("r1", "a1"): {"task_id": "t1", "status": "succeeded", "recorded": 1.0},  # the last final one
        ("r2", "a1"): {"task_id": "t1", "status": "failed", "recorded": 0.25},
        ("r3", "a1"): {"task_id": "t1", "status": "succeeded", "recorded": None},  # intermediate only
    }


def _grader(task, calls, recorded):
    """Stricter grader: 1 when the last answer says the task's answer, else 0; -1 without calls."""
    if not calls:
        return -1.0
    said = calls[-1]["output_messages"][0]["content"]
    return 1.0 if said == str(task["payload"]["answer"]) else 0.0


def test_new_returns_give_the_function_task_calls_in_order_and_recorded_reward():
    seen = []

    def spy(task, calls, recorded):
        seen.append((task["payload"], [c["sequence_id"] for c in calls], recorded))
        return _grader(task, calls, recorded)

    attempts = {("r1", "a1"): {"task_id": "t1", "status": "succeeded", "recorded": 1.0},
                ("r2", "a1"): {"task_id": "t1", "status": "succeeded", "recorded": 1.0},
                ("r3", "a1"): {"task_id": "t1", "status": "succeeded", "recorded": None}}
    tasks = {"t1": {"task_id": "t1", "payload": json.dumps({"answer": 4}), "group_size": 2}}
    spans = [_span("r1", "a1", 1, [5], output=[{"role": "assistant", "content": "4"}]),
             _span("r1", "a1", 0, [5], output=[{"role": "assistant", "content": "3"}]),
             _span("r1", "a1", 2, [], kind="tool"),
             _span("r2", "a1", 0, [6], output=[{"role": "assistant", "content": "5"}])]
    assert new_returns(attempts, tasks, spans, spy) == {("r1", "a1"): 1.0, ("r2", "a1"): 0.0, ("r3", "a1"): -1.0}
    assert seen == [({"answer": 4}, [0, 1], 1.0), ({"answer": 4}, [0], 1.0), ({"answer": 4}, [], None)]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "1.0", True])
def test_new_returns_refuse_what_is_not_a_finite_number(bad):
    attempts = {("r1", "a1"): {"task_id": "t1", "status": "succeeded", "recorded": 1.0}}
    with pytest.raises(ReplayError, match="rollout r1 attempt a1; expected a finite number or None"):
        new_returns(attempts, {}, [], lambda t, c, r: bad, "pkg:bad")


def test_new_returns_name_the_attempt_when_the_function_raises():
    attempts = {("r1", "a1"): {"task_id": "t1", "status": "succeeded", "recorded": 1.0}}
    with pytest.raises(ReplayError, match=r"pkg:f raised on rollout r1 attempt a1: KeyError: 'payload'"):
        new_returns(attempts, {}, [], lambda t, c, r: {}["payload"], "pkg:f")


def _stored(rec, partition=0, offset=0, ts=10):
    return Stored(partition, offset, ts, rec["rollout_id"].encode(), b"orig", rec)


def test_rewritten_rewards_replace_drop_keep_and_add():
    rewards = [_stored(_rw("r1", "a1", 1.0), 0, 0, 11), _stored(_rw("r1", "a1", 0.5, final=False), 0, 1, 12),
               _stored(_rw("r2", "a1", 1.0), 1, 0, 13), _stored(_rw("r9", "a1", 0.75), 1, 1, 14)]
    rollouts = [_stored(_ev("r3", "a1", "started", ts=20), 2, 0, 20),
                _stored(_ev("r3", "a1", "succeeded", ts=30), 2, 1, 31)]
    returns = {("r1", "a1"): 0.0, ("r2", "a1"): None, ("r3", "a1"): 2.5}
    out = rewritten_rewards(rewards, rollouts, returns, "pkg.grader:score")
    assert [(r.partition, r.timestamp_ms, r.value, r.record["rollout_id"], r.record["value"], r.record["final"],
             r.record["name"], r.record["components"]) for r in out] == [
        (0, 11, b"", "r1", 0.0, True, "pkg.grader:score", {"recorded": 1.0}),  # re-scored: to encode
        (0, 12, b"orig", "r1", 0.5, False, "reward", {}),  # intermediate: as it was
        # r2 re-scored to None: its final reward is dropped
        (1, 14, b"orig", "r9", 0.75, True, "reward", {}),  # not re-scored: as it was
        (2, 31, b"", "r3", 2.5, True, "pkg.grader:score", {}),  # no recorded reward: added at its end
    ]
    assert out[-1].record["timestamp_ms"] == 30 and out[-1].key == b"r3"


@pytest.mark.parametrize("args, reason", [
    (["--train-from", "run-a"], "--train-from must be RUN:VERSION or base, got 'run-a'"),
    (["--reward", "no_such_module_here:score"], "reward function 'no_such_module_here:score' does not load"),
    (["--since", "2026-12-02", "--until", "2026-12-01"], "until must be after since"),
])
def test_cli_refuses_bad_replays_with_a_reason_not_a_traceback(args, reason):
    """Refused before anything is read or written (no Kafka here): exit 1 and the reason."""
    from typer.testing import CliRunner

    from spanrl.infra import cli

    out = CliRunner().invoke(cli.app, ["replay", "--suffix", "x", *args], env={"COLUMNS": "300"})
    assert out.exit_code == 1 and "replay refused" in out.output and "Traceback" not in out.output
    assert reason in " ".join(out.output.split())
