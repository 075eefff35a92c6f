"""Which waiting rollouts the positions now let out: an in-memory index for the emission rule.

The emission rule (stream_jobs/assembly.py, :func:`~spanrl.stream_jobs.assembly.inputs_consumed`):
an ended attempt with an *inputs bound* (per input role, the end offset of its partition when
its terminal event was consumed) is emitted once the worker has processed its partition past
every role's bound. The app used to test every waiting rollout of a partition after every
input record: O(waiting) per record. In a sustained run the terminal events run ahead of the
spans they bound (the topics are read side by side), so thousands wait, and that scan took
~14 % of the worker's time at 1,000 spans/s (docs/measured/benchmarks-archive.md) and grew with the backlog.

:class:`InputsWaitlist` keeps, per role, a min-heap of bounds. A rollout sits in the heap of
the first role (in sorted order) that its bound is *known* not to be passed on: a role with a
position below its bound. When that role's position passes it, it moves on to its next such
role, or is let out. A role without a position (no record of it handled on the partition since
the worker started) is never waited on: :func:`~spanrl.stream_jobs.assembly.inputs_consumed`
is then None, not False, and the app's settle-time fallback (a tick) decides. A rollout must
leave the waitlist at exactly the moment the rule stops saying False: the app's tick index
takes a False rollout off every tick (``NEVER``) and counts on the waitlist to hand it back
(CI, worker fault: a rollout whose rewards position was unknown sat in the rewards heap for
good while its spans passed; one attempt never left, 3 calls neither transitioned nor
dead-lettered). Positions only grow while the worker owns the partition (after a rebalance
the app starts a fresh waitlist), so a role once passed needs no second look. Each record
then costs O(1) (a peek per role) plus O(log n) per rollout that moves. A rollout noted
again with another bound gets a fresh entry; the old one is skipped when it surfaces (lazy
deletion).

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

    def note(self, rollout_id: str, need: dict[str, int] | None, positions: dict[str, int] | None = None) -> bool:
        """Wait for ``need`` while ``positions`` (role -> next offset to process) are known to
        be behind it on some role; None, empty or not behind on any known role: stop waiting.
        Returns whether the rollout waits. Noting the same bound again is a no-op."""
        role_end = _first_behind(need, positions) if need else None
        if role_end is None:
            self._need.pop(rollout_id, None)
            return False
        if self._need.get(rollout_id) == need:
            return True
        self._need[rollout_id] = dict(need)
        key = tuple(sorted(need.items()))
        heapq.heappush(self._heaps.setdefault(role_end[0], []), (role_end[1], next(self._seq), rollout_id, key))
        return True

    def ready(self, positions: dict[str, int]) -> list[str]:
        """The rollouts whose bound ``positions`` passes on every role that has a position
        (:func:`~spanrl.stream_jobs.assembly.inputs_consumed` no longer False), in the order
        they were let out; they stop waiting."""
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
                    nxt = _first_behind(dict(key), positions)
                    if nxt is None:
                        del self._need[rid]
                        out.append(rid)
                    else:
                        heapq.heappush(self._heaps.setdefault(nxt[0], []), (nxt[1], next(self._seq), rid, key))
                        moved = True
        return out


def _first_behind(need: dict[str, int], positions: dict[str, int] | None) -> tuple[str, int] | None:
    """The first role (sorted) whose known position is below ``need``'s bound, as (role, bound)."""
    if not positions:
        return None
    return next(((r, e) for r, e in sorted(need.items()) if positions.get(r) is not None and positions[r] < e), None)
