"""Which states a tick must visit: an in-memory index beside a Faust table.

A tick on partition p judges the timeouts of the states that live on p
(stream_jobs/app.py). Visiting every state of the table on every tick costs
O(states) per tick, and a table keeps finished rollouts for ``SPANRL_STREAM_RETAIN_S``
(1 h) so that re-deliveries stay no-ops: in a sustained run that is ~10^5 states, visited
8 times a second. The index keeps, per partition, the *live* keys (a timeout may fire:
visited on every tick) apart from the *finished* ones, which only need one visit, when
they expire (a min-heap by expiry time).

The index is not state: it is rebuilt from the table (one scan of the partition's keys)
at the first tick of a partition after the worker starts or the partition comes back.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any


class TickIndex:
    """Live keys and expiry times per partition. ``expires_at`` (ms) None: live;
    :data:`NEVER`: finished and never due (kept in the table, no tick needs it)."""

    NEVER = -1
    #: stale heap entries tolerated beyond twice the due ones before :meth:`drop` rebuilds the heap
    COMPACT_SLACK = 64

    def __init__(self) -> None:
        self._live: dict[int, set[str]] = {}
        self._due: dict[int, dict[str, int]] = {}
        self._heap: dict[int, list[tuple[int, str]]] = {}

    def scanned(self, partition: int) -> bool:
        """Whether the partition's keys are indexed (else: :meth:`rebuild` first)."""
        return partition in self._live

    def rebuild(self, partition: int, items: Iterable[tuple[str, Any]], expires_at: Callable[[Any], int | None]) -> None:
        """Index ``(key, state)`` pairs of ``partition`` (a scan of the table)."""
        self.forget(partition)
        self._live[partition] = set()
        for key, state in items:
            self.note(partition, key, expires_at(state))

    def note(self, partition: int, key: str, expires_at: int | None) -> None:
        """The state ``key`` of ``partition`` was written: live, or finished until ``expires_at``."""
        if partition not in self._live:
            return  # not scanned yet: the scan at the next tick will see this key
        due = self._due.setdefault(partition, {})
        if expires_at is None:
            self._live[partition].add(key)
            due.pop(key, None)
        elif expires_at == self.NEVER:
            self._live[partition].discard(key)
            due.pop(key, None)
        else:
            self._live[partition].discard(key)
            if due.get(key) != expires_at:
                due[key] = expires_at
                heapq.heappush(self._heap.setdefault(partition, []), (expires_at, key))

    def drop(self, partition: int, key: str) -> None:
        """The state ``key`` was deleted. Its heap entry stays until it surfaces (lazy deletion),
        unless stale entries outnumber the live ones: then the heap is rebuilt from the due
        times (a state deleted by ``SPANRL_STREAM_RETAIN_MAX`` would otherwise keep its entry,
        and its key, until its expiry ``SPANRL_STREAM_RETAIN_S`` later)."""
        self._live.get(partition, set()).discard(key)
        due = self._due.get(partition, {})
        due.pop(key, None)
        heap = self._heap.get(partition)
        if heap is not None and len(heap) > 2 * len(due) + self.COMPACT_SLACK:
            self._heap[partition] = [(t, k) for k, t in due.items()]
            heapq.heapify(self._heap[partition])

    def heap_size(self, partition: int) -> int:
        """Entries in the partition's expiry heap, stale ones included."""
        return len(self._heap.get(partition, ()))

    def visit(self, partition: int, now_ms: int) -> list[str]:
        """Keys a tick at ``now_ms`` visits: every live key (sorted) and every finished key
        whose expiry time has come (each once; it is live or re-noted after the visit)."""
        keys = sorted(self._live.get(partition, ()))
        heap, due = self._heap.get(partition, []), self._due.get(partition, {})
        while heap and heap[0][0] <= now_ms:
            t, key = heapq.heappop(heap)
            if due.get(key) == t:  # else a stale entry: re-noted or dropped since
                del due[key]
                keys.append(key)
        return keys

    def forget(self, partition: int) -> None:
        """Drop the partition's index (revoked; rebuilt by the next scan)."""
        self._live.pop(partition, None)
        self._due.pop(partition, None)
        self._heap.pop(partition, None)

    def size(self, partition: int) -> tuple[int, int]:
        """(live keys, finished keys) of ``partition``."""
        return len(self._live.get(partition, ())), len(self._due.get(partition, {}))


class FinishedStates:
    """Per partition, the keys of a table's *finished* states (nothing left to wait for: kept
    only so that re-deliveries stay no-ops) in the order they were last written or scanned
    finished, so that at most ``keep`` of them stay (:meth:`excess`): the worker's memory is bounded by
    ``SPANRL_STREAM_RETAIN_MAX`` as well as by ``SPANRL_STREAM_RETAIN_S`` (issue 21). A state
    that opens again (a new attempt, a new group) leaves the list; one seen finished again goes
    to its end. Rebuilt like the tick index (the scan after a restart or rebalance), then in the
    scan's order. Not state: memory of this worker only."""

    def __init__(self) -> None:
        self._keys: dict[int, dict[str, None]] = {}

    def note(self, partition: int, key: str, finished: bool) -> None:
        """The state ``key`` of ``partition`` was written or scanned: finished or not."""
        keys = self._keys.setdefault(partition, {})
        keys.pop(key, None)
        if finished:
            keys[key] = None

    def drop(self, partition: int, key: str) -> None:
        """The state ``key`` was deleted."""
        self._keys.get(partition, {}).pop(key, None)

    def excess(self, partition: int, keep: int) -> list[str]:
        """The oldest finished keys of ``partition`` beyond the newest ``keep`` (to be deleted
        by the caller), no longer tracked. ``keep`` >= 1, else ValueError."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        keys = self._keys.get(partition, {})
        n = len(keys) - keep
        if n <= 0:
            return []
        doomed = [k for k, _ in zip(keys, range(n))]
        for k in doomed:
            del keys[k]
        return doomed

    def forget(self, partition: int) -> None:
        """Drop the partition's list (revoked; rebuilt by the next scan)."""
        self._keys.pop(partition, None)

    def count(self, partition: int) -> int:
        """Finished keys tracked for ``partition``."""
        return len(self._keys.get(partition, ()))

    def total(self) -> int:
        """Finished keys tracked over every partition."""
        return sum(map(len, self._keys.values()))


def evict_finished(table, index: TickIndex, finished: FinishedStates, partition: int, keep: int) -> int:
    """Delete from ``table`` (a Faust table: a changelog tombstone each, in the current event's
    transaction) the oldest finished states of ``partition`` beyond ``keep``
    (:meth:`FinishedStates.excess`) and take them off ``index``; returns how many went."""
    doomed = finished.excess(partition, keep)
    for key in doomed:
        if table.get(key) is not None:
            del table[key]
        index.drop(partition, key)
    return len(doomed)
