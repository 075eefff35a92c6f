"""spanrl.infra.ledger: the chaos run's accounting (exact counts on hand-built records)."""
from __future__ import annotations

import math

import pytest

from spanrl.infra.ledger import account, advantage_mismatches, dead_letter_scope, known_reward

RA, RB, RC = "a000" + "0" * 28, "a001" + "0" * 28, "a002" + "0" * 28  # known rewards 0, .25, .5


def call(rid, sid, request_id=None):
    return {"rollout_id": rid, "attempt_id": "0", "span_id": sid, "source": "proxy", "kind": "llm",
            "llm": {"request_id": request_id or f"req-{sid}"}}


def transition(rid, sid, ret=None):
    return {"rollout_id": rid, "attempt_id": "0", "span_id": sid, "task_id": "t",
            "episode_return": known_reward(rid) if ret is None else ret}


def sample(t, group_id, advantage):
    return {"transition": t, "group_id": group_id, "advantage": advantage}


def test_known_reward_is_a_function_of_the_id():
    assert [known_reward(r) for r in (RA, RB, RC)] == [0.0, 0.25, 0.5]
    assert known_reward("0004") == 1.0


def test_dead_letter_scope_reads_attempt_and_span():
    assert dead_letter_scope({"rollout_id": RA, "reason": "rollout_timeout",
                              "detail": "attempt 0: no terminal lifecycle event within 30s"}) == (RA, "0", None)
    assert dead_letter_scope({"rollout_id": RA, "reason": "late_span",
                              "detail": "attempt 0 already emitted; span 00000000000000ff"}) == (RA, "0", "00000000000000ff")
    assert dead_letter_scope({"rollout_id": RA, "reason": "group_closed", "detail": "x"}) is None
    assert dead_letter_scope({"rollout_id": None, "reason": "rollout_timeout", "detail": "attempt 0: x"}) is None


def test_clean_run_balances():
    calls = [call(RA, "1" * 16), call(RA, "2" * 16), call(RB, "3" * 16), call(RC, "4" * 16)]
    ts = [transition(RA, "1" * 16), transition(RA, "2" * 16), transition(RB, "3" * 16)]
    adv = [-0.125 / (0.125 + 1e-6), 0.125 / (0.125 + 1e-6)]  # (R - 0.125) / (0.125 + eps)
    samples = [sample(ts[0], "t/0", adv[0]), sample(ts[1], "t/0", adv[0]), sample(ts[2], "t/0", adv[1])]
    dead = [{"rollout_id": RC, "reason": "rollout_failed_no_reward", "detail": "attempt 0: status failed, ..."}]
    events = [{"rollout_id": r, "attempt_id": "0", "status": s} for r, s in
              ((RA, "started"), (RA, "succeeded"), (RB, "succeeded"), (RC, "failed"))]
    acked = [{"kind": "call", "rollout_id": RA, "request_id": "req-" + "1" * 16},
             {"kind": "reward", "rollout_id": RA, "attempt_id": "0"},
             {"kind": "span", "rollout_id": RB, "span_id": "9" * 16}]
    acc = account(calls=calls, events=events, transitions=ts, samples=samples, dead_letters=dead,
                  rewards=[{"rollout_id": RA, "attempt_id": "0"}],
                  spans=[{"rollout_id": RB, "span_id": "9" * 16}], acked=acked)
    d = acc.to_dict()
    assert (d["calls_acknowledged"], d["transitions"], d["dead_lettered"], d["missing"], d["duplicated"],
            d["samples"], d["samples_missing"], d["advantage_mismatches"], d["acked_not_in_kafka"]) == \
        (4, 3, 1, 0, 0, 3, 0, 0, 0)
    assert d["attempts"] == {"failed": 1, "succeeded": 2}
    assert d["dead_letter_reasons"] == {"rollout_failed_no_reward": 1}
    assert d["ok"] is True and d["problems"] == []


def test_missing_duplicated_and_unacknowledged_are_counted():
    calls = [call(RA, "1" * 16), call(RA, "2" * 16), call(RB, "3" * 16)]
    t1 = transition(RA, "1" * 16)
    ts = [t1, t1, transition(RB, "3" * 16, ret=0.1), transition(RC, "5" * 16)]
    samples = [sample(t1, "t/0", 0.0), sample(t1, "t/0", 0.0)]
    dead = [{"rollout_id": RB, "reason": "late_span", "detail": "attempt 0 already emitted; span " + "3" * 16},
            {"rollout_id": RC, "reason": "group_closed", "detail": "",
             "transition": transition(RC, "5" * 16)}]
    acked = [{"kind": "call", "rollout_id": RA, "request_id": "nope"}]
    acc = account(calls=calls, events=[], transitions=ts, samples=samples, dead_letters=dead, acked=acked)
    assert (acc.transitions, acc.missing, acc.duplicated, acc.conflicting, acc.unexpected, acc.return_mismatches,
            acc.samples, acc.samples_missing, acc.samples_duplicated, acc.acked_not_in_kafka) == \
        (3, 1, 1, 1, 1, 1, 1, 1, 1, 1)
    assert not acc.ok
    assert "call ('" + RA + "', '0', '" + "2" * 16 + "') neither transitioned nor dead-lettered" in acc.problems


def test_advantage_recomputed_per_group():
    ta, tb, tc = transition(RA, "1" * 16), transition(RB, "2" * 16), transition(RC, "3" * 16)
    std = math.sqrt(0.125 / 3)  # returns 0, .25, .5: mean .25, population variance (.0625 * 2) / 3
    a = [-0.25 / (std + 1e-6), 0.0, 0.25 / (std + 1e-6)]
    good = [sample(ta, "t/0", a[0]), sample(tb, "t/0", a[1]), sample(tc, "t/0", a[2])]
    assert advantage_mismatches(good) == 0
    assert a[0] == pytest.approx(-1.2247, abs=1e-4)
    off = [sample(ta, "t/0", a[0]), sample(tb, "t/0", a[1]), sample(tc, "t/0", a[2] * (1 - 1e-3))]
    assert advantage_mismatches(off) == 1  # a formula that is 0.1 % off is caught
    bad = [sample(ta, "t/0", a[0]), sample(tb, "t/0", a[1]), sample(tc, "t/1", 0.0)]  # tc alone in its group
    assert advantage_mismatches(bad) == 2  # ta, tb now form a 2-member group: advantages -1, +1


def test_late_members_are_recomputed_against_the_group_before_them():
    """Returns 0 and .25 closed the group (2 rollouts); .5 joined late (3), then 1.0 (4)."""
    ta, tb, tc = transition(RA, "1" * 16), transition(RB, "2" * 16), transition(RC, "3" * 16)
    td = transition("0004" + "0" * 28, "4" * 16)
    on_time = [-0.125 / (0.125 + 1e-6), 0.125 / (0.125 + 1e-6)]
    late_c = 0.25 / (math.sqrt(0.125 / 3) + 1e-6)  # against 0, .25, .5: mean .25
    # against 0, .25, .5, 1: mean .4375, population variance (.19141 + .03516 + .00391 + .31641) / 4
    late_d = (1.0 - 0.4375) / (math.sqrt(0.546875 / 4) + 1e-6)
    good = [{**sample(ta, "t/0", on_time[0]), "group_rollouts": 2}, {**sample(tb, "t/0", on_time[1]), "group_rollouts": 2},
            {**sample(tc, "t/0", late_c), "group_rollouts": 3}, {**sample(td, "t/0", late_d), "group_rollouts": 4}]
    assert advantage_mismatches(good) == 0
    assert late_c == pytest.approx(1.2247, abs=1e-4) and late_d == pytest.approx(1.5213, abs=1e-4)
    # recomputed over all four as one group, the on-time members' advantages would differ
    assert advantage_mismatches([{**s, "group_rollouts": 4} for s in good]) == 3
