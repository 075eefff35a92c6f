"""When may a tick time something out? The worker's clock for timeouts, per partition.

Timeouts (rollout, reward, group) say "nothing arrived within X seconds". That is only
true once the worker has read what Kafka holds: after a restart it first works through
a backlog, and a tick judged by the wall clock would time out attempts whose inputs are
still waiting in that backlog (`make chaos`, worker fault: attempts dead-lettered
``rollout_timeout`` right after recovery, their spans then ``late_span``).

So a tick on partition p is judged at ``now - lag``, where lag is the consumer lag of the
last input read on p (processing time minus the record's timestamp): while a backlog is
being read the lag is large and the clock runs behind; once inputs stop arriving for
``quiet_s`` the partition is caught up and the clock is the wall clock again. Before any
input of p was read, ticks in the first ``grace_s`` after the worker's first tick on p
do nothing (the backlog may not have been fetched yet).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TimeoutClock:
    """Per-partition timeout clock (milliseconds since the epoch throughout)."""

    quiet_s: float = 5.0
    grace_s: float = 10.0
    _lag_ms: dict[int, int] = field(default_factory=dict)
    _last_input_ms: dict[int, int] = field(default_factory=dict)
    _first_tick_ms: dict[int, int] = field(default_factory=dict)

    def saw_input(self, partition: int, now_ms: int, record_ms: int | None) -> None:
        """An input record of ``partition`` with timestamp ``record_ms`` was read at ``now_ms``."""
        self._lag_ms[partition] = max(0, now_ms - record_ms) if record_ms else 0
        self._last_input_ms[partition] = now_ms

    def tick_now(self, partition: int, now_ms: int) -> int | None:
        """The time a tick on ``partition`` at ``now_ms`` judges timeouts by; None: skip it."""
        if partition not in self._last_input_ms:
            first = self._first_tick_ms.setdefault(partition, now_ms)
            return now_ms if now_ms - first >= self.grace_s * 1000 else None
        if now_ms - self._last_input_ms[partition] >= self.quiet_s * 1000:
            return now_ms  # caught up: nothing read for quiet_s
        return now_ms - self._lag_ms[partition]
