"""The emission rule's waitlist (stream_jobs/waitlist.py) against the rule itself
(assembly.inputs_consumed), exact cases and a randomized comparison: a rollout waits exactly
while the rule says False for it, and is let out as soon as it does not."""
import random

from spanrl.stream_jobs import assembly
from spanrl.stream_jobs.waitlist import InputsWaitlist


def test_let_out_once_every_role_is_passed():
    w = InputsWaitlist()
    at = {"spans": 4, "rewards": 0}
    assert w.note("r1", {"spans": 10, "rewards": 3}, at)
    assert w.note("r2", {"spans": 5, "rewards": 7}, at)
    assert w.note("r3", {"spans": 5, "rewards": 1}, at)
    assert w.ready({"spans": 4, "rewards": 9}) == [] and len(w) == 3
    assert sorted(w.ready({"spans": 5, "rewards": 9})) == ["r2", "r3"]
    assert "r1" in w and "r2" not in w
    assert w.ready({"spans": 10, "rewards": 2}) == []  # spans passed, rewards not yet
    assert w.ready({"spans": 10, "rewards": 3}) == ["r1"] and len(w) == 0


def test_a_role_without_a_position_is_not_waited_on():
    """The CI failure (worker fault): after a restart the rewards partition's only record had
    been handled by the killed worker, so the new one never learnt a rewards position. The
    rollout was queued under rewards and never let out while spans passed its bound; the tick
    index had taken it off every tick (the rule said False then), so nothing advanced it again."""
    w = InputsWaitlist()
    bound = {"spans": 4, "rewards": 1}
    assert w.note("r1", bound, {"rollouts": 2, "spans": 3})  # spans known behind: it waits
    assert w.ready({"rollouts": 2, "spans": 3}) == []
    assert w.ready({"rollouts": 2, "spans": 4}) == ["r1"]  # rule: None now, the settle fallback decides
    assert assembly.inputs_consumed(bound, {"rollouts": 2, "spans": 4}) is None
    assert not w.note("r2", bound, {"rollouts": 2})  # nothing known behind: no wait (None)
    assert not w.note("r3", bound, None) and len(w) == 0


def test_noted_again_and_cancelled():
    w = InputsWaitlist()
    at = {"spans": 0, "rewards": 0}
    w.note("r1", {"spans": 10, "rewards": 0}, at)
    w.note("r1", {"spans": 10, "rewards": 0}, at)  # same bound: one entry
    w.note("r1", {"spans": 20, "rewards": 0}, at)  # a later attempt's bound replaces it
    assert w.ready({"spans": 15, "rewards": 5}) == []
    assert w.ready({"spans": 20, "rewards": 5}) == ["r1"]
    w.note("r2", {"spans": 1, "rewards": 1}, at)
    w.note("r2", None, at)
    assert w.ready({"spans": 99, "rewards": 99}) == [] and len(w) == 0
    assert not w.note("r3", {"spans": 1, "rewards": 1}, {"spans": 1, "rewards": 1})  # passed already


def test_same_as_scanning_every_waiting_rollout():
    rnd = random.Random(7)
    for _ in range(300):
        w, scan = InputsWaitlist(), {}
        pos: dict[str, int] = {}  # roles become known one by one, as after a restart
        for step in range(60):
            if rnd.random() < 0.4:
                rid = f"r{rnd.randrange(12)}"
                need = None if rnd.random() < 0.1 else {
                    "spans": pos.get("spans", 0) + rnd.randrange(8), "rewards": pos.get("rewards", 0) + rnd.randrange(4)}
                waits = w.note(rid, need, dict(pos))
                assert waits == (need is not None and assembly.inputs_consumed(need, pos) is False), (step, pos, need)
                if waits:
                    scan[rid] = need
                else:
                    scan.pop(rid, None)
            role = rnd.choice(["spans", "rewards"])
            if role in pos or rnd.random() < 0.3:
                pos[role] = pos.get(role, 0) + rnd.randrange(3)
            expected = sorted(r for r, need in scan.items() if assembly.inputs_consumed(need, pos) is not False)
            for r in expected:
                del scan[r]
            assert sorted(w.ready(dict(pos))) == expected, (step, pos)
