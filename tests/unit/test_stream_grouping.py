import pytest

from spanrl.schemas import codec
from spanrl.stream_jobs import grouping

S = 1000
EPS = 1e-6
CFG = grouping.GroupingConfig(group_timeout_s=30)


def tr(rid, i, R, n=2, task="t1", group_size=2, attempt="a0", late=False):
    return {"schema_version": 2, "reward_delay_ms": 7_200_000 if late else 1000, "late_reward": late, "rollout_id": rid, "attempt_id": attempt, "span_id": f"{rid}-{attempt}-{i}",
            "task_id": task, "group_size": group_size, "sequence_id": i, "call_index": i,
            "rollout_transition_count": n, "agent_name": None, "model": "policy", "policy_version": 0,
            "prompt_token_ids": [1], "completion_token_ids": [2], "behaviour_logprobs": [-0.5],
            "episode_return": R, "reward": R, "credit_rule": "identical", "status": "succeeded",
            "intermediate_reward": 0.0, "air_rules": ""}


def feed(state, store, records, now=0):
    out = grouping.GroupOutcome()
    for r in records:
        o = grouping.add_transition(state, r, store, CFG, now)
        out.samples += o.samples
        out.dead_letters += o.dead_letters
    return out


def test_group_closes_at_group_size_with_grpo_advantages():
    state, store = grouping.new_state("t1"), {}
    # group_size 4, calls arrive interleaved and out of order
    records = [tr(rid, i, R, group_size=4) for rid, i, R in [
        ("r1", 1, 1.0), ("r2", 0, 0.0), ("r3", 0, 0.0), ("r1", 0, 1.0), ("r2", 1, 0.0), ("r3", 1, 0.0),
        ("r4", 0, 1.0)]]
    out = feed(state, store, records)
    assert out.samples == []  # r4 incomplete
    out = feed(state, store, [tr("r4", 1, 1.0, group_size=4)])
    s = out.samples
    assert [(x["transition"]["rollout_id"], x["transition"]["call_index"]) for x in s] == [
        ("r1", 0), ("r1", 1), ("r2", 0), ("r2", 1), ("r3", 0), ("r3", 1), ("r4", 0), ("r4", 1)]
    # returns [1, 0, 0, 1]: mean 0.5, population std 0.5
    a = 0.5 / (0.5 + EPS)
    assert [x["advantage"] for x in s] == [a, a, -a, -a, -a, -a, a, a]
    assert {(x["group_id"], x["group_rollouts"], x["group_mean"], x["group_std"]) for x in s} == {
        ("t1/0", 4, 0.5, 0.5)}
    for x in s:
        assert codec.decode("sample", codec.encode("sample", x)) == x
    assert store == {} and state["open"] is None and state["closed_groups"] == 1


def test_duplicate_transition_counted_once():
    state, store = grouping.new_state("t1"), {}
    out = feed(state, store, [tr("r1", 0, 1.0), tr("r1", 0, 1.0), tr("r2", 0, 0.0), tr("r2", 1, 0.0)])
    assert out.samples == []  # r1 has 1 of 2
    out = feed(state, store, [tr("r1", 1, 1.0)])
    assert len(out.samples) == 4
    a = 0.5 / (0.5 + EPS)
    assert [x["advantage"] for x in out.samples] == [a, a, -a, -a]


def test_second_group_for_same_task_after_close():
    state, store = grouping.new_state("t1"), {}
    first = feed(state, store, [tr("r1", 0, 1.0, n=1), tr("r2", 0, 0.0, n=1)])
    assert {x["group_id"] for x in first.samples} == {"t1/0"}
    late = feed(state, store, [tr("r1", 1, 1.0, n=1)])  # another call of closed rollout r1
    assert [d["reason"] for d in late.dead_letters] == ["group_closed"]
    second = feed(state, store, [tr("r3", 0, 3.0, n=1), tr("r4", 0, 1.0, n=1)])
    assert {x["group_id"] for x in second.samples} == {"t1/1"}
    assert [x["advantage"] for x in second.samples] == [1 / (1 + EPS), -1 / (1 + EPS)]
    assert second.samples[0]["group_mean"] == 2.0 and second.samples[0]["group_std"] == 1.0


def test_timeout_closes_with_complete_rollouts_and_dead_letters_the_rest():
    state, store = grouping.new_state("t1"), {}
    feed(state, store, [tr("r1", 0, 1.0, group_size=3), tr("r1", 1, 1.0, group_size=3),
                        tr("r2", 0, 0.0, group_size=3), tr("r2", 1, 0.0, group_size=3),
                        tr("r3", 0, 5.0, group_size=3)], now=0)
    early = grouping.advance(state, store, CFG, 29 * S)
    assert early.samples == [] and early.dead_letters == []
    out = grouping.advance(state, store, CFG, 30 * S)
    assert [x["transition"]["rollout_id"] for x in out.samples] == ["r1", "r1", "r2", "r2"]
    assert {x["group_rollouts"] for x in out.samples} == {2}
    assert [(d["reason"], d["rollout_id"], d["stage"]) for d in out.dead_letters] == [
        ("group_incomplete", "r3", "grouper")]
    assert codec.decode("transition", out.dead_letters[0]["payload"])["span_id"] == "r3-a0-0"
    assert store == {}


def test_group_of_one_after_timeout_has_zero_advantage():
    state, store = grouping.new_state("t1"), {}
    feed(state, store, [tr("r1", 0, 1.0, n=1)], now=0)
    out = grouping.advance(state, store, CFG, 30 * S)
    assert [(x["advantage"], x["group_rollouts"], x["group_std"]) for x in out.samples] == [(0.0, 1, 0.0)]


def test_second_attempt_of_same_rollout_is_superseded():
    state, store = grouping.new_state("t1"), {}
    out = feed(state, store, [tr("r1", 0, 1.0, n=1, group_size=3), tr("r1", 0, 0.0, n=1, group_size=3, attempt="a1"),
                              tr("r2", 0, 0.0, n=1, group_size=3)])
    assert out.samples == []  # two distinct rollouts of three
    out = grouping.advance(state, store, CFG, 30 * S)
    assert [(x["transition"]["rollout_id"], x["transition"]["attempt_id"]) for x in out.samples] == [
        ("r1", "a0"), ("r2", "a0")]
    assert [(d["reason"], d["rollout_id"]) for d in out.dead_letters] == [("superseded_attempt", "r1")]


def test_transition_read_again_after_its_group_closed_is_a_no_op():
    """A restarted worker re-reads inputs whose state changes were already committed (the
    changelog may run ahead of the source offsets): a closed group's transition read again
    yields nothing; a new call of a closed rollout is still dead-lettered group_closed."""
    state, store = grouping.new_state("t1"), {}
    first = [tr("r1", 0, 1.0), tr("r1", 1, 1.0), tr("r2", 0, 0.0), tr("r2", 1, 0.0)]
    assert len(feed(state, store, first).samples) == 4
    assert state["closed_spans"] == ["r1-a0-0", "r1-a0-1", "r2-a0-0", "r2-a0-1"]
    again = feed(state, store, first)
    assert (again.samples, again.dead_letters) == ([], [])
    late = feed(state, store, [tr("r1", 2, 1.0, n=3)])
    assert [d["reason"] for d in late.dead_letters] == ["group_closed"]
    assert store == {}


# --- rollouts of one task whose rewards come at different times (late members)

def short_group(now=0):
    """Task t1, group_size 4: r1 (R=1) and r2 (R=0) in time, the group closes short at 30 s."""
    state, store = grouping.new_state("t1"), {}
    feed(state, store, [tr(rid, i, R, group_size=4) for rid, R in (("r1", 1.0), ("r2", 0.0)) for i in (0, 1)], now)
    out = grouping.advance(state, store, CFG, now + 30 * S)
    assert [x["advantage"] for x in out.samples] == [0.5 / (0.5 + EPS)] * 2 + [-0.5 / (0.5 + EPS)] * 2
    assert state["last_closed"] == {"group_id": "t1/0", "closed_ms": now + 30 * S, "group_size": 4,
                                    "returns": [1.0, 0.0]}
    return state, store


def test_late_member_joins_its_short_group_with_the_advantage_it_would_have_had():
    state, store = short_group()
    two_hours = 2 * 3600 * S
    out = feed(state, store, [tr("r3", 1, 1.0, group_size=4, late=True)], two_hours)
    assert out.samples == [] and state["open"] is None  # waits for the rest of r3
    out = feed(state, store, [tr("r3", 0, 1.0, group_size=4, late=True)], two_hours)
    # G = [1, 0, 1]: mean 2/3, population std sqrt(2)/3; A = (1 - 2/3) / (sqrt(2)/3 + eps)
    a = (1 - 2 / 3) / (2 ** 0.5 / 3 + EPS)
    assert [(x["transition"]["call_index"], x["advantage"], x["group_id"], x["group_rollouts"]) for x in out.samples] \
        == [(0, pytest.approx(a, abs=1e-12), "t1/0", 3), (1, pytest.approx(a, abs=1e-12), "t1/0", 3)]
    assert out.samples[0]["group_mean"] == pytest.approx(2 / 3) and out.samples[0]["group_std"] == pytest.approx(2 ** 0.5 / 3)
    assert out.samples[0]["advantage"] == grouping.late_member_advantage([1.0, 0.0], 1.0)
    for x in out.samples:
        assert codec.decode("sample", codec.encode("sample", x)) == x
    assert store == {} and state["last_closed"]["returns"] == [1.0, 0.0, 1.0]
    # a second late member: against the group with the first late one; R=0 -> G = [1, 0, 1, 0]
    out = feed(state, store, [tr("r4", i, 0.0, group_size=4, late=True) for i in (0, 1)], two_hours + S)
    assert [x["advantage"] for x in out.samples] == [-0.5 / (0.5 + EPS)] * 2
    assert {(x["group_rollouts"], x["group_mean"], x["group_std"]) for x in out.samples} == {(4, 0.5, 0.5)}
    # read again: nothing; another call of a late member: group_closed
    assert feed(state, store, [tr("r4", 0, 0.0, group_size=4, late=True)], two_hours + S).samples == []
    again = feed(state, store, [tr("r3", 2, 1.0, n=3, group_size=4, late=True)], two_hours + S)
    assert [d["reason"] for d in again.dead_letters] == ["group_closed"]


def test_late_member_rules_open_group_full_group_and_window():
    # an open group of the task: a late transition is a member of it like any other
    state, store = short_group()
    feed(state, store, [tr("r5", 0, 1.0, n=1, group_size=4)], 40 * S)
    feed(state, store, [tr("r3", 0, 0.0, n=1, group_size=4, late=True)], 41 * S)
    assert sorted(state["open"]["members"]) == ["r3|a0", "r5|a0"] and state.get("late", {}) == {}
    # not late (an on-time rollout of the next run of the task): a new group, not the short one
    state, store = short_group()
    feed(state, store, [tr("r6", 0, 1.0, n=1, group_size=4)], 3600 * S)
    assert list(state["open"]["members"]) == ["r6|a0"] and state.get("late", {}) == {}
    # past late_join_s: a new group
    cfg = grouping.GroupingConfig(group_timeout_s=30, late_join_s=60)
    state, store = short_group()
    grouping.add_transition(state, tr("r3", 0, 1.0, n=1, group_size=4, late=True), store, cfg, 90 * S)
    assert list(state["open"]["members"]) == ["r3|a0"]
    # a full group takes no late members
    state, store = grouping.new_state("t1"), {}
    feed(state, store, [tr("r1", 0, 1.0, n=1), tr("r2", 0, 0.0, n=1)])
    assert state["last_closed"] is None
    feed(state, store, [tr("r3", 0, 1.0, n=1, late=True)], 60 * S)
    assert list(state["open"]["members"]) == ["r3|a0"]


def test_incomplete_late_member_times_out():
    state, store = short_group()
    feed(state, store, [tr("r3", 0, 1.0, group_size=4, late=True)], 100 * S)
    assert grouping.advance(state, store, CFG, 129 * S).dead_letters == []
    out = grouping.advance(state, store, CFG, 130 * S)
    assert [(d["reason"], d["rollout_id"], d["detail"]) for d in out.dead_letters] == [
        ("group_incomplete", "r3", "attempt a0 span r3-a0-0: late member: 1/2 transitions in 30s")]
    assert store == {} and state["late"] == {}


def test_late_member_advantage():
    assert grouping.late_member_advantage([1.0, 0.0, 0.0], 1.0, 0.0) == pytest.approx(1.0)  # G=[1,0,0,1]
    assert grouping.late_member_advantage([1.0], 1.0) == 0.0  # G=[1,1]: std 0, no signal
    with pytest.raises(ValueError):
        grouping.late_member_advantage([], 1.0)


# --- waiting transitions lost with a worker (the app holds them in memory only; the state keeps
# --- each one's position on transitions, stream_jobs/grouping.py)

def fed_with_positions(records, offset0=100):
    """State and store after ``records``, each at transitions[2]@offset0+i; the log of them."""
    state, store, log = grouping.new_state("t1", 2), {}, {}
    for i, r in enumerate(records):
        at = ("transitions", 2, offset0 + i)
        log[at] = r
        assert grouping.add_transition(state, r, store, CFG, 0, at=at).dead_letters == []
    return state, store, log


def restarted(state):
    import json
    return json.loads(json.dumps(state)), {}


def reread(state, store, log):
    """What the app does before each update (stream_jobs/app.py reread_transitions)."""
    for key, at in grouping.missing_reads(state, store):
        found = log.get(tuple(at))
        if found is not None and grouping.restore_transition(key, found) is not None:
            store[key] = found
    return store


def test_a_restored_group_rereads_its_transitions_and_closes_as_before():
    records = [tr("r1", 0, 1.0), tr("r2", 0, 0.0), tr("r1", 1, 1.0)]
    expected = feed(*fed_with_positions(records)[:2], [tr("r2", 1, 0.0)]).samples
    state, store, log = fed_with_positions(records)
    assert grouping.missing_reads(state, store) == []
    state, store = restarted(state)
    assert grouping.missing_reads(state, store) == [
        ("t1|r1|a0|r1-a0-0", ["transitions", 2, 100]), ("t1|r1|a0|r1-a0-1", ["transitions", 2, 102]),
        ("t1|r2|a0|r2-a0-0", ["transitions", 2, 101])]
    out = grouping.add_transition(state, tr("r2", 1, 0.0), reread(state, store, log), CFG, 0,
                                  at=("transitions", 2, 103))
    assert out.samples == expected and out.dead_letters == [] and store == {}


def test_a_transition_that_cannot_be_reread_dead_letters_its_attempt_not_the_group():
    records = [tr("r1", 0, 1.0, group_size=3), tr("r1", 1, 1.0, group_size=3), tr("r2", 0, 0.0, group_size=3),
               tr("r2", 1, 0.0, group_size=3), tr("r3", 0, 0.5, group_size=3)]
    state, store, log = fed_with_positions(records)
    state, store = restarted(state)
    del log[("transitions", 2, 101)]  # r1's second transition: gone
    out = grouping.add_transition(state, tr("r3", 1, 0.5, group_size=3), reread(state, store, log), CFG, 0)
    # r2 and r3 are the group (returns 0.0, 0.5); r1's two transitions are dead letters
    assert [(s["transition"]["span_id"], s["group_rollouts"]) for s in out.samples] == [
        ("r2-a0-0", 2), ("r2-a0-1", 2), ("r3-a0-0", 2), ("r3-a0-1", 2)]
    a = 0.25 / (0.25 + EPS)
    assert [s["advantage"] for s in out.samples] == [-a, -a, a, a]
    assert [(d["reason"], d["detail"], d["payload"] is not None) for d in out.dead_letters] == [
        ("transitions_missing", f"attempt a0 span r1-a0-{i}: 1 of 2 transitions of this attempt could not be "
                                "re-read from transitions after a restart: r1-a0-1", i == 0) for i in (0, 1)]
    assert store == {} and state["open"] is None


def test_a_record_that_is_another_transition_is_not_restored():
    assert grouping.restore_transition("t1|r1|a0|r1-a0-0", tr("r1", 0, 1.0)) is not None
    assert grouping.restore_transition("t1|r1|a0|r1-a0-0", tr("r1", 1, 1.0)) is None
    assert grouping.restore_transition("t1|r1|a0|r1-a0-0", tr("r1", 0, 1.0, task="t2")) is None


def test_the_apps_transition_store_holds_avro_records():
    from spanrl.stream_jobs.app import StoredTransition, TransitionStore

    store, t = TransitionStore(), tr("r1", 0, 1.0)
    store["k"] = t
    assert store.records["k"].record[:1] == bytes([codec.MAGIC]) and store["k"] == t and "k" in store
    assert len(store) == 1
    raw2 = codec.encode("transition", tr("r2", 0, 0.0))
    store.put_record("j", raw2, codec.decode("transition", raw2))
    assert store.pop("j")["rollout_id"] == "r2" and store.pop("j", None) is None and list(store) == ["k"]
    raw = codec.encode("transition", tr("r3", 0, 0.0))
    decoded = store.decoded_from(codec.decode("transition", raw), raw)
    store["i"] = decoded  # the record it came from is kept as it is, not encoded again
    assert store.records["i"].record is raw
    store["h"] = dict(decoded)  # another dict: encoded
    assert store.records["h"].record is not raw and store["h"] == decoded
    # the small fields without decoding; the arrays decoded on demand
    held = store["i"]
    assert isinstance(held, StoredTransition) and held._full is None
    assert (held["rollout_id"], held["call_index"], held["episode_return"]) == ("r3", 0, 0.0) and held._full is None
    assert held["completion_token_ids"] == [2] and held._full is not None
    assert grouping.encoded(held) is raw and grouping.encoded(decoded) == raw


def test_samples_from_the_apps_store_are_the_records_codec_encode_writes():
    """A group closed over StoredTransitions: each sample's record is written around the stored
    transition's record (app.encode_sample), byte for byte what codec.encode writes for it."""
    from spanrl.stream_jobs.app import TransitionStore, encode_sample

    state, store = grouping.new_state("t1"), TransitionStore()
    records = [tr("r1", 0, 1.0), tr("r1", 1, 1.0), tr("r2", 0, 0.0), tr("r2", 1, 0.0)]
    out = grouping.GroupOutcome()
    for r in records:
        raw = codec.encode("transition", r)
        o = grouping.add_transition(state, store.decoded_from(codec.decode("transition", raw), raw), store, CFG, 0)
        out.samples += o.samples
    assert [s["transition"]["span_id"] for s in out.samples] == ["r1-a0-0", "r1-a0-1", "r2-a0-0", "r2-a0-1"]
    assert all(s["transition"]._full is None for s in out.samples)  # the arrays were never decoded
    for s in out.samples:
        plain = {**s, "transition": dict(s["transition"])}
        assert encode_sample(s) == codec.encode("sample", plain)
        assert codec.decode("sample", encode_sample(s)) == codec.decode("sample", codec.encode("sample", plain))
    assert len(store) == 0


def test_tick_due_is_the_open_groups_and_late_members_time_out():
    state, store = grouping.new_state("t1"), {}
    assert grouping.tick_due(state, CFG) == grouping.NEVER
    grouping.add_transition(state, tr("r1", 0, 1.0), store, CFG, 5 * S)
    assert grouping.tick_due(state, CFG) == 35 * S  # opened at 5 s, group_timeout_s 30
    assert grouping.advance(state, store, CFG, 35 * S - 1).dead_letters == [] and state["open"] is not None
    closed = grouping.advance(state, store, CFG, 35 * S)
    assert [d["reason"] for d in closed.dead_letters] == ["group_incomplete"] and state["open"] is None
    assert grouping.tick_due(state, CFG) == grouping.NEVER
    grouping.add_transition(state, tr("r2", 0, 1.0, n=1), store, CFG, 40 * S)  # a group of one member
    grouping.advance(state, store, CFG, 70 * S)  # closes short: takes late members
    grouping.add_transition(state, tr("r3", 0, 0.0, late=True), store, CFG, 80 * S)  # 1 of 2: waits
    assert "r3|a0" in state["late"] and grouping.tick_due(state, CFG) == 110 * S
