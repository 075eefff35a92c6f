"""The Faust worker's Prometheus metrics: its counters as families, and reward -> transition latency.

Pure parts (no Faust): :func:`worker_families` turns the worker's own counters (the ones
``/spanrl/counters/`` shows) into Prometheus families at scrape time, so nothing is counted
twice; :class:`RewardToTransition` pairs, per attempt, the moment its final reward was
consumed with the moment its first transition was sent (queued in the worker's transaction;
read_committed readers see it at the next commit, at most ``commit_interval_s`` later).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from spanrl.core import metrics as prom

#: worker counter key -> help text (keys as stream_jobs/app.py counts them)
WORKER_COUNTERS = {
    "spans_in": "span records consumed",
    "rewards_in": "reward records consumed",
    "rollout_events_in": "rollout lifecycle events consumed",
    "transitions_out": "transitions sent",
    "samples_out": "GRPO samples sent",
    "dead_letters_out": "dead letters sent (all reasons)",
    "call_accounts_out": "call accounts sent (one per ended attempt)",
    "trace_links_out": "trace links sent (proxy calls re-keyed by trace id)",
    "trace_links_in": "trace links consumed by the join",
    "orphans_in": "orphan spans (no rollout id) consumed by the join",
    "spans_joined": "orphan spans joined to a rollout and sent to spans",
    "spans_reread": "calls whose token data were re-read from spans (late rewards; after a restart or rebalance)",
    "transitions_reread": "waiting transitions re-read from transitions after a restart or rebalance",
    "rollouts_evicted": "finished rollout states deleted by SPANRL_STREAM_RETAIN_MAX before SPANRL_STREAM_RETAIN_S",
    "tasks_evicted": "task states without an open group deleted by SPANRL_STREAM_RETAIN_MAX",
}


def worker_families(counters: Mapping[str, int], dead_reasons: Mapping[str, int],
                    agent_counts: Mapping[tuple[str, str], int]) -> list:
    """Families of the worker's counters: ``spanrl_worker_<key>_total`` for each key of
    :data:`WORKER_COUNTERS` (0 until counted), ``spanrl_worker_dead_letters_total{reason}``
    from ``dead_reasons`` and ``spanrl_worker_calls_total{agent, trained}`` from
    ``agent_counts`` (``(agent, "trained" | "excluded") -> calls``; trained = "true" |
    "false")."""
    out = [prom.CounterMetricFamily(f"spanrl_worker_{key}", text, value=float(counters.get(key, 0)))
           for key, text in WORKER_COUNTERS.items()]
    out.append(prom.labelled_counter("spanrl_worker_dead_letters", "dead letters sent, by reason code",
                                     "reason", dead_reasons))
    calls = prom.CounterMetricFamily("spanrl_worker_calls", "LLM calls of ended attempts, by agent and "
                                     "whether they train", labels=["agent", "trained"])
    for (agent, how), n in sorted(agent_counts.items()):
        calls.add_metric([agent, "true" if how == "trained" else "false"], float(n))
    out.append(calls)
    return out


class RewardToTransition:
    """Reward consumed -> transition sent, per attempt (seconds on one monotonic clock).

    :meth:`reward_consumed` notes the first final reward of ``(rollout_id, attempt_id)``
    (later ones keep the first time); :meth:`transition_sent` returns the seconds since then
    for the attempt's first transition and forgets the attempt (its later transitions
    return None, as does an attempt whose reward this worker did not see, e.g. consumed
    before a restart). At most ``max_pending`` attempts are remembered: the oldest is
    forgotten first (attempts dead-lettered instead of emitted never send a transition).
    Raises ValueError for ``max_pending < 1``."""

    def __init__(self, max_pending: int = 10_000):
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.max_pending = max_pending
        self._pending: OrderedDict[tuple[str, str], float] = OrderedDict()

    def reward_consumed(self, rollout_id: str, attempt_id: str, now_s: float) -> None:
        key = (rollout_id, attempt_id)
        if key in self._pending:
            return
        self._pending[key] = now_s
        if len(self._pending) > self.max_pending:
            self._pending.popitem(last=False)

    def transition_sent(self, rollout_id: str, attempt_id: str, now_s: float) -> float | None:
        start = self._pending.pop((rollout_id, attempt_id), None)
        return None if start is None else now_s - start

    def __len__(self) -> int:
        return len(self._pending)
