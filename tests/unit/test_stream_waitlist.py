"""The emission rule's waitlist (stream_jobs/waitlist.py) against the rule itself
(assembly.inputs_consumed), exact cases and a randomized comparison."""
import random

from spanrl.stream_jobs import assembly
from spanrl.stream_jobs.waitlist import InputsWaitlist


def test_let_out_once_every_role_is_passed():
    w = InputsWaitlist()
    w.note("r1", {"spans": 10, "rewards": 3})
    w.note("r2", {"spans": 5, "rewards": 7})
    w.note("r3", {"spans": 5, "rewards": 1})
    assert w.ready({"spans": 4, "rewards": 9}) == [] and len(w) == 3
    assert sorted(w.ready({"spans": 5, "rewards": 9})) == ["r2", "r3"]
    assert "r1" in w and "r2" not in w
    assert w.ready({"spans": 10, "rewards": 2}) == []  # spans passed, rewards not yet
    assert w.ready({"spans": 10, "rewards": 3}) == ["r1"] and len(w) == 0


def test_a_role_without_a_position_passes_nothing():
    w = InputsWaitlist()
    w.note("r1", {"spans": 0, "rewards": 0})
    assert w.ready({"spans": 100}) == []
    assert w.ready({"spans": 100, "rewards": 0}) == ["r1"]


def test_noted_again_and_cancelled():
    w = InputsWaitlist()
    w.note("r1", {"spans": 10, "rewards": 0})
    w.note("r1", {"spans": 10, "rewards": 0})  # same bound: one entry
    w.note("r1", {"spans": 20, "rewards": 0})  # a later attempt's bound replaces it
    assert w.ready({"spans": 15, "rewards": 5}) == []
    assert w.ready({"spans": 20, "rewards": 5}) == ["r1"]
    w.note("r2", {"spans": 1, "rewards": 1})
    w.note("r2", None)
    assert w.ready({"spans": 99, "rewards": 99}) == [] and len(w) == 0


def test_same_as_scanning_every_waiting_rollout():
    rnd = random.Random(7)
    for _ in range(200):
        w, scan = InputsWaitlist(), {}
        pos = {"spans": 0, "rewards": 0}
        for step in range(60):
            if rnd.random() < 0.4:
                rid = f"r{rnd.randrange(12)}"
                need = None if rnd.random() < 0.1 else {
                    "spans": pos["spans"] + rnd.randrange(8), "rewards": pos["rewards"] + rnd.randrange(4)}
                w.note(rid, need)
                if need is None:
                    scan.pop(rid, None)
                else:
                    scan[rid] = need
            role = rnd.choice(["spans", "rewards"])
            pos[role] += rnd.randrange(3)
            expected = sorted(r for r, need in scan.items() if assembly.inputs_consumed(need, pos))
            for r in expected:
                del scan[r]
            assert sorted(w.ready(pos)) == expected, (step, pos)
