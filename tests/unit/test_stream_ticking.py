from spanrl.stream_jobs import assembly
from spanrl.stream_jobs.ticking import TickIndex


def test_live_keys_every_tick_finished_keys_once_at_expiry():
    ix = TickIndex()
    assert not ix.scanned(0)
    ix.note(0, "x", None)  # before the scan: ignored, the scan will see it
    ix.rebuild(0, [("a", None), ("b", 500), ("c", 200)], expires_at=lambda s: s)
    assert ix.scanned(0) and ix.size(0) == (1, 2)
    assert ix.visit(0, 100) == ["a"]
    assert ix.visit(0, 200) == ["a", "c"]
    assert ix.visit(0, 300) == ["a"]             # c visited once
    ix.note(0, "b", None)                          # b got a new attempt: live again
    ix.note(0, "d", 250)
    assert ix.visit(0, 1000) == ["a", "b", "d"]    # b's old expiry entry is stale
    ix.note(0, "a", 2000)
    ix.note(0, "a", 3000)                          # re-noted: only the newest expiry counts
    assert ix.visit(0, 2500) == ["b"]
    assert ix.visit(0, 3000) == ["b", "a"]
    ix.drop(0, "b")
    assert ix.visit(0, 4000) == [] and ix.size(0) == (0, 0)
    ix.forget(0)
    assert not ix.scanned(0) and ix.visit(0, 9999) == []


def test_partitions_are_apart():
    ix = TickIndex()
    ix.rebuild(0, [("a", None)], expires_at=lambda s: s)
    ix.rebuild(1, [("b", None)], expires_at=lambda s: s)
    ix.note(1, "c", 5)
    assert ix.visit(0, 10) == ["a"] and ix.visit(1, 10) == ["b", "c"]


def test_expires_at_is_retain_after_the_last_finished_attempt():
    state = assembly.new_state("r1")
    assert assembly.expires_at(state, 60) is None  # no attempt
    state["attempts"] = {"0": {"done": "emitted", "done_ms": 1000}, "1": {"done": None, "done_ms": None}}
    assert assembly.expires_at(state, 60) is None
    state["attempts"]["1"] = {"done": "dead_letter", "done_ms": 4000}
    assert assembly.expires_at(state, 60) == 64_000
    assert not assembly.expired(state, 63_999, 60) and assembly.expired(state, 64_000, 60)


def test_never_due_keys_leave_the_index():
    ix = TickIndex()
    ix.rebuild(0, [("open", None), ("closed", TickIndex.NEVER)], expires_at=lambda s: s)
    assert ix.visit(0, 10**12) == ["open"] and ix.size(0) == (1, 0)
    ix.note(0, "open", TickIndex.NEVER)   # its group closed
    ix.note(0, "closed", None)            # a new transition opened a group
    assert ix.visit(0, 10**12) == ["closed"]


def test_finished_states_keep_the_newest_per_partition():
    import pytest

    from spanrl.stream_jobs.ticking import FinishedStates

    f = FinishedStates()
    for key in ("a", "b", "c", "d"):
        f.note(0, key, True)
    f.note(1, "x", True)
    f.note(0, "b", False)          # b opened again (a new attempt): not finished
    f.note(0, "a", True)           # a seen finished again: now the newest
    assert (f.count(0), f.count(1), f.total()) == (3, 1, 4)
    assert f.excess(0, 3) == []
    assert f.excess(0, 1) == ["c", "d"] and f.count(0) == 1   # oldest first, no longer tracked
    assert f.excess(0, 1) == [] and f.excess(1, 1) == []
    f.drop(0, "a")
    f.forget(1)
    assert f.total() == 0
    with pytest.raises(ValueError, match="keep must be >= 1"):
        f.excess(0, 0)


def test_dropped_keys_do_not_keep_heap_entries_until_their_expiry():
    ix = TickIndex()
    ix.rebuild(0, [], expires_at=lambda s: s)
    for i in range(200):
        ix.note(0, f"k{i}", 10_000 + i)
    for i in range(190):                       # deleted long before they expire (the count bound)
        ix.drop(0, f"k{i}")
    # rebuilt once stale entries passed 2 x due + 64: at most that many entries remain
    assert ix.size(0) == (0, 10) and ix.heap_size(0) <= 2 * 10 + TickIndex.COMPACT_SLACK
    assert ix.visit(0, 20_000) == [f"k{i}" for i in range(190, 200)]
