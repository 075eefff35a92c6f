"""spanrl.stream_jobs.clock.TimeoutClock: ticks are judged behind the wall clock while a backlog is read."""
from spanrl.stream_jobs.clock import TimeoutClock

S = 1000


def test_no_input_yet_skips_ticks_for_the_grace_period():
    c = TimeoutClock(quiet_s=5, grace_s=10)
    assert c.tick_now(0, 100 * S) is None
    assert c.tick_now(0, 109 * S) is None
    assert c.tick_now(0, 110 * S) == 110 * S
    assert c.tick_now(1, 110 * S) is None  # per partition


def test_backlog_lag_holds_the_clock_back_until_quiet():
    c = TimeoutClock(quiet_s=5, grace_s=10)
    c.saw_input(2, now_ms=200 * S, record_ms=165 * S)   # read 35 s after it was written
    assert c.tick_now(2, 201 * S) == 166 * S
    c.saw_input(2, now_ms=202 * S, record_ms=201 * S)   # backlog drained: lag 1 s
    assert c.tick_now(2, 203 * S) == 202 * S
    assert c.tick_now(2, 207 * S) == 207 * S             # quiet for 5 s: wall clock
    c.saw_input(3, now_ms=300 * S, record_ms=None)      # no timestamp: no lag
    assert c.tick_now(3, 301 * S) == 301 * S
