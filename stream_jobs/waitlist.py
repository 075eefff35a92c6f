"""Which waiting rollouts the positions now let out: an in-memory index for the emission rule.

The emission rule (stream_jobs/assembly.py, :func:`~spanrl.stream_jobs.assembly.inputs_consumed`):
an ended attempt with an *inputs bound* (per input role, the end offset of its partition when
its terminal event was consumed) is emitted once the worker has processed its partition past
every role's bound. The app used to test every waiting rollout of a partition after every
input record: O(waiting) per record. In a sustained run the terminal events run ahead of the
spans they bound (the topics are read side by side), so thousands wait, and that scan took
~14 % of the worker's time at 1,000 spans/s (BENCHMARKS.md, issue 11) and grew with the backlog.

:class:`InputsWaitlist` keeps, per role, a min-heap of bounds. A rollout sits in the heap of
the first role (in sorted order) its bound is not yet passed on; when that role's position
passes it, it moves on to its next unpassed role, or is let out. Positions only grow while the
worker owns the partition (after a rebalance the app starts a fresh waitlist), so a role once
passed needs no second look. Each record then costs O(1) (a peek per role) plus O(log n) per
rollout that moves. A rollout noted again with another bound gets a fresh entry; the old one is
skipped when it surfaces (lazy deletion).

In memory only, like the positions it is compared with; not state.
"""
from __future__ import annotations

import heapq
import itertools


class InputsWaitlist:
    """Waiting rollouts of one partition: rollout id -> inputs bound (role -> end offset)."""

    def __init__(self) -> None:
        self._need: dict[str, dict[str, int]] = {}
        self._heaps: dict[str, list[tuple[int, int, str, tuple]]] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._need)

    def __contains__(self, rollout_id: str) -> bool:
        return rollout_id in self._need

    def note(self, rollout_id: str, need: dict[str, int] | None) -> None:
        """Wait for ``need`` (None or empty: stop waiting). Noting the same bound again is a no-op."""
        if not need:
            self._need.pop(rollout_id, None)
            return
        if self._need.get(rollout_id) == need:
            return
        self._need[rollout_id] = dict(need)
        key = tuple(sorted(need.items()))
        role, end = key[0]
        heapq.heappush(self._heaps.setdefault(role, []), (end, next(self._seq), rollout_id, key))

    def ready(self, positions: dict[str, int]) -> list[str]:
        """The rollouts whose bound ``positions`` (role -> next offset to process) passes on
        every role, in the order they were let out; they stop waiting. A role without a
        position passes nothing (:func:`~spanrl.stream_jobs.assembly.inputs_consumed` is None
        then: the settle-time fallback decides)."""
        out: list[str] = []
        moved = True
        while moved:
            moved = False
            for role, heap in list(self._heaps.items()):
                pos = positions.get(role)
                while heap and pos is not None and heap[0][0] <= pos:
                    _, _, rid, key = heapq.heappop(heap)
                    if tuple(sorted(self._need.get(rid, {}).items())) != key:
                        continue  # noted again since, or no longer waiting
                    nxt = next(((r, e) for r, e in key if positions.get(r) is None or positions[r] < e), None)
                    if nxt is None:
                        del self._need[rid]
                        out.append(rid)
                    else:
                        heapq.heappush(self._heaps.setdefault(nxt[0], []), (nxt[1], next(self._seq), rid, key))
                        moved = True
        return out
