"""Bounded in-memory views of spanrl's topics, for the dashboard (pure: no Kafka, no HTTP).

The tailer (``infra/dashboard/app.py``) hands every decoded record to :meth:`Views.add`;
the pages read the summaries below. Bounds: at most ``max_rollouts`` rollouts (default
2000; the service: ``SPANRL_DASHBOARD_MAX_ROLLOUTS``, 5000; the oldest rollout, by first record seen, is evicted with its spans, rewards and
transitions), ``max_spans_per_rollout`` spans each (default 200), and ``max_events``
(default 2000) of each of dead letters and checkpoint announcements. A span is kept
without its log-probs (only token ids, to decode the text on demand).
"""
from __future__ import annotations

import json
from collections import OrderedDict, deque
from dataclasses import dataclass, field

#: rollout lifecycle statuses that end an attempt (producers/runner.py)
TERMINAL = ("succeeded", "failed", "timeout")


@dataclass
class Rollout:
    """Everything seen of one rollout id (all its attempts)."""

    rollout_id: str
    task_id: str | None = None
    runner_id: str | None = None
    group_size: int | None = None
    #: attempt_id -> {"status", "started_ms", "ended_ms", "error"}
    attempts: dict[str, dict] = field(default_factory=dict)
    spans: list[dict] = field(default_factory=list)
    rewards: list[dict] = field(default_factory=list)
    #: span_id -> {"reward", "episode_return", "policy_version", "advantage" (None until sampled)}
    transitions: dict[str, dict] = field(default_factory=dict)
    #: span_id -> {"agent_name", "agent_source", "trained"}
    accounts: dict[str, dict] = field(default_factory=dict)
    dead_letters: list[dict] = field(default_factory=list)
    #: latest time (unix ms) of any record of the rollout: lifecycle event, span end,
    #: reward, call account, dead letter (the rollouts table is sorted by it)
    last_ms: int = 0
    #: the latest call account's outcome: ``emitted`` or the attempt's dead-letter reason
    outcome: str | None = None

    def seen(self, ms: int | None) -> None:
        if ms is not None and ms > self.last_ms:
            self.last_ms = ms


def slim_span(span: dict) -> dict:
    """The span without its per-token log-probs (the heaviest part the pages never show)."""
    llm = span.get("llm")
    if llm is None:
        return dict(span)
    return {**span, "llm": {k: v for k, v in llm.items() if k != "completion_logprobs"}}


class Views:
    """The dashboard's state, fed one record at a time (see module docstring for bounds)."""

    def __init__(self, max_rollouts: int = 2000, max_spans_per_rollout: int = 200, max_events: int = 2000):
        if min(max_rollouts, max_spans_per_rollout, max_events) < 1:
            raise ValueError("every bound must be at least 1")
        self.max_rollouts = max_rollouts
        self.max_spans = max_spans_per_rollout
        self.rollouts: OrderedDict[str, Rollout] = OrderedDict()
        self.dead_letters: deque[dict] = deque(maxlen=max_events)
        self.checkpoints: deque[dict] = deque(maxlen=max_events)
        #: record counts per topic kind since the start (all records read, evicted or not)
        self.counts: dict[str, int] = {}
        self.evicted = 0

    def _rollout(self, rollout_id: str) -> Rollout:
        r = self.rollouts.get(rollout_id)
        if r is None:
            r = self.rollouts[rollout_id] = Rollout(rollout_id)
            while len(self.rollouts) > self.max_rollouts:
                self.rollouts.popitem(last=False)
                self.evicted += 1
        return r

    def add(self, kind: str, rec: dict) -> None:
        """Take one decoded record; ``kind`` is its topic's record type (``span``, ``rollout``,
        ``reward``, ``transition``, ``sample``, ``dead_letter``, ``call_account``, ``checkpoint``).
        Raises ValueError for another kind."""
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if kind == "checkpoint":
            self.checkpoints.append(rec)
            return
        if kind == "dead_letter":
            self.dead_letters.append(rec)
            if rec.get("rollout_id"):
                r = self._rollout(rec["rollout_id"])
                r.dead_letters.append(rec)
                r.seen(rec["timestamp_ms"])
            return
        if kind == "sample":
            t = rec["transition"]
            r = self._rollout(t["rollout_id"])
            r.transitions.setdefault(t["span_id"], _transition_view(t))["advantage"] = rec["advantage"]
            return
        handler = {"span": self._span, "rollout": self._lifecycle, "reward": self._reward,
                   "transition": self._transition, "call_account": self._account}.get(kind)
        if handler is None:
            raise ValueError(f"unknown record kind {kind!r}")
        handler(self._rollout(rec["rollout_id"]), rec)

    def _span(self, r: Rollout, rec: dict) -> None:
        if len(r.spans) < self.max_spans:
            r.spans.append(slim_span(rec))
        r.seen(rec["end_time_unix_nano"] // 1_000_000)

    def _lifecycle(self, r: Rollout, rec: dict) -> None:
        r.task_id, r.runner_id, r.group_size = rec["task_id"], rec["runner_id"], rec["group_size"]
        a = r.attempts.setdefault(rec["attempt_id"], {"status": None, "started_ms": None, "ended_ms": None,
                                                       "error": None})
        a["status"] = rec["status"]
        r.seen(rec["timestamp_ms"])
        if rec["status"] == "started":
            a["started_ms"] = rec["timestamp_ms"]
        else:
            a["ended_ms"], a["error"] = rec["timestamp_ms"], rec.get("error")

    def _reward(self, r: Rollout, rec: dict) -> None:
        r.rewards.append(rec)
        r.seen(rec["timestamp_ms"])

    def _transition(self, r: Rollout, rec: dict) -> None:
        view = r.transitions.setdefault(rec["span_id"], _transition_view(rec))
        view.update({k: v for k, v in _transition_view(rec).items() if k != "advantage"})
        r.task_id = r.task_id or rec["task_id"]

    def _account(self, r: Rollout, rec: dict) -> None:
        r.task_id = r.task_id or rec.get("task_id")
        r.outcome = rec["outcome"]
        r.seen(rec["timestamp_ms"])
        for c in rec["calls"]:
            r.accounts[c["span_id"]] = {"agent_name": c["agent_name"], "agent_source": c["agent_source"],
                                        "trained": c["trained"], "outcome": rec["outcome"]}


def _transition_view(t: dict) -> dict:
    return {"reward": t["reward"], "episode_return": t["episode_return"], "policy_version": t["policy_version"],
            "agent_name": t.get("agent_name"), "advantage": None}


def rollout_summary(r: Rollout) -> dict:
    """One row of the rollouts table: task, status of the latest attempt (without lifecycle
    events, e.g. an agent the trainer never launched: ``emitted`` or the dead-letter reason
    of its call account, else ``dead-lettered`` / ``unknown``), attempts, final reward of the
    latest attempt (None before one), LLM calls (spans with a recorded call: the proxy's, the
actions) and tool calls (spans of kind ``tool``), policy versions, agents,
    duration (s, first start to last end; None while running), dead-letter reasons."""
    latest = max(r.attempts, key=lambda a: (r.attempts[a]["started_ms"] or 0, a)) if r.attempts else None
    status = r.attempts[latest]["status"] if latest else (
        r.outcome or ("dead-lettered" if r.dead_letters else "unknown"))
    finals = [w["value"] for w in r.rewards if w["final"] and (latest is None or w["attempt_id"] == latest)]
    llm = [s for s in r.spans if s.get("llm")]  # the recorded calls (proxy), not a framework's LLM spans
    starts = [a["started_ms"] for a in r.attempts.values() if a["started_ms"] is not None]
    ends = [a["ended_ms"] for a in r.attempts.values() if a["ended_ms"] is not None]
    running = any(a["status"] not in TERMINAL for a in r.attempts.values())
    agents = sorted({a["agent_name"] for a in r.accounts.values() if a["agent_name"]}
                    | {s["agent_name"] for s in llm if s.get("agent_name")})
    return {
        "rollout_id": r.rollout_id, "last_ms": r.last_ms, "task_id": r.task_id, "runner_id": r.runner_id, "status": status,
        "attempts": len(r.attempts), "attempt_statuses": {k: v["status"] for k, v in r.attempts.items()},
        "reward": finals[-1] if finals else None,
        "llm_calls": len(llm), "tool_calls": sum(1 for s in r.spans if s["kind"] == "tool"),
        "policy_versions": sorted({s["llm"]["policy_version"] for s in llm if s.get("llm")}),
        "agents": agents,
        "duration_s": (max(ends) - min(starts)) / 1000 if starts and ends and not running else None,
        "dead_letter_reasons": sorted({d["reason"] for d in r.dead_letters}),
    }


def matches(row: dict, runner: str = "", task: str = "", status: str = "", agent: str = "") -> bool:
    """Whether a :func:`rollout_summary` row passes the filters: ``task`` and ``runner`` are
    substrings of its task id / runner id, ``status`` equals its status, ``agent`` is one of
    its agents; an empty filter passes everything."""
    return ((not runner or runner in (row["runner_id"] or "")) and (not task or task in (row["task_id"] or ""))
            and (not status or row["status"] == status) and (not agent or agent in row["agents"]))


def dead_letter_matches(d: dict, task: str = "", reason: str = "") -> bool:
    """Whether a dead letter passes the filters: ``task`` a substring of its task id,
    ``reason`` equal to its reason code; an empty filter passes everything."""
    return (not task or task in (d.get("task_id") or "")) and (not reason or d["reason"] == reason)


def waterfall(r: Rollout, attempt_id: str | None = None) -> list[dict]:
    """The spans of one attempt (default: every attempt) in sequence order, each with its
    start and end in seconds from the attempt's first span start (``t0_s``, ``t1_s``), plus the
    attempt's rewards as zero-length ``reward`` entries at their timestamps. Sorted by
    (attempt_id, sequence_id); rewards after the spans of their attempt."""
    spans = [s for s in r.spans if attempt_id is None or s["attempt_id"] == attempt_id]
    if not spans:
        return []
    origin = min(s["start_time_unix_nano"] for s in spans)
    rows = [{"kind": s["kind"], "name": s["name"], "attempt_id": s["attempt_id"], "sequence_id": s["sequence_id"],
             "span_id": s["span_id"], "t0_s": (s["start_time_unix_nano"] - origin) / 1e9,
             "t1_s": (s["end_time_unix_nano"] - origin) / 1e9, "span": s}
            for s in sorted(spans, key=lambda s: (s["attempt_id"], s["sequence_id"], s["start_time_unix_nano"]))]
    for w in r.rewards:
        if attempt_id is None or w["attempt_id"] == attempt_id:
            t = (w["timestamp_ms"] * 1_000_000 - origin) / 1e9
            rows.append({"kind": "reward", "name": f"{w['name']} = {w['value']:g}", "attempt_id": w["attempt_id"],
                         "sequence_id": None, "span_id": w.get("span_id"), "t0_s": t, "t1_s": t, "span": None})
    return sorted(rows, key=lambda x: (x["attempt_id"], x["sequence_id"] is None, x["sequence_id"] or 0))


def training_rows(checkpoints: list[dict], run: str | None = None) -> list[dict]:
    """Per published policy version of ``run`` (default: every run): its metrics and when it
    was published, and the release gate's decision on it (``served_ms`` / ``refused_ms`` and
    ``gate``: the decision's reason and reward difference, from the announcements with event
    ``served`` / ``refused`` whose ``detail`` is the gate record as JSON; trainer/reloader.py).
    Sorted by (run, version)."""
    out: dict[tuple[str, int], dict] = {}
    for c in checkpoints:
        if run is not None and c["run"] != run:
            continue
        row = out.setdefault((c["run"], c["version"]), {"run": c["run"], "version": c["version"], "step": None,
                                                        "published_ms": None, "served_ms": None,
                                                        "refused_ms": None, "metrics": {}, "gate": None,
                                                        "uri": c["uri"]})
        event = c.get("event", "published")
        if event == "published":
            row.update(step=c["step"], published_ms=c["created_ms"], metrics=dict(c["metrics"]), uri=c["uri"])
        elif event in ("served", "refused"):
            row[f"{event}_ms"] = c["created_ms"]
            try:
                row["gate"] = json.loads(c.get("detail") or "null")["decision"]
            except (ValueError, TypeError, KeyError):
                row["gate"] = None
    return [out[k] for k in sorted(out)]


def loaded_times(history: list[dict], run: str) -> dict[int, int]:
    """Policy version -> when (unix ms) vLLM last loaded it, from the reloader's ``/status``
    ``history`` entries with ``reloaded`` true (the reloader keeps its last 50) of ``run``
    (the uri's ``s3://BUCKET/RUN/`` part; the base model, version 0, has uri "")."""
    out: dict[int, int] = {}
    for h in history:
        uri = h.get("uri") or ""
        if h.get("reloaded") and h.get("at_ms") is not None and (uri == "" or uri.split("/")[3:4] == [run]):
            out[int(h["version"])] = max(out.get(int(h["version"]), 0), int(h["at_ms"]))
    return out


def rate_per_s(timestamps_ms: list[int], now_ms: int, window_s: float = 60.0) -> float:
    """Records per second over the last ``window_s`` seconds before ``now_ms``: the count of
    timestamps in ``(now_ms - window_s*1000, now_ms]`` divided by ``window_s``. Raises
    ValueError for a non-positive window."""
    if window_s <= 0:
        raise ValueError("window_s must be positive")
    lo = now_ms - window_s * 1000
    return sum(1 for t in timestamps_ms if lo < t <= now_ms) / window_s


def consumer_lag(end_offsets: dict[tuple[str, int], int], committed: dict[tuple[str, int], int | None]
                 ) -> dict[str, int]:
    """Per topic: the sum over its partitions of end offset minus the group's committed
    offset (Kafka's consumer lag); a partition the group never committed counts from 0.
    Keys of both maps are (topic, partition)."""
    lag: dict[str, int] = {}
    for (topic, part), end in end_offsets.items():
        done = committed.get((topic, part)) or 0
        lag[topic] = lag.get(topic, 0) + max(0, end - done)
    return lag
