"""The ledger of one chaos run: every acknowledged LLM call is a transition exactly once or
is dead-lettered with a reason; every transition is in exactly one GRPO sample or a
grouper dead letter; advantages equal a recomputation from the stored returns.

Pure functions over decoded records (dicts as schemas/avro/*.avsc define them), so the
accounting is unit-tested with exact values; ``spanrl.infra.chaos`` feeds it what it read back
from Kafka (read_committed) after a fault. Keys:

- a call / transition is ``(rollout_id, attempt_id, span_id)``;
- an attempt is ``(rollout_id, attempt_id)``.

Dead letters name an attempt in ``detail`` ("attempt A: ...", see
stream_jobs/assembly.py) and, for span-level reasons, the span ("span S ...").
"""
from __future__ import annotations

import math
import re
import statistics
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

from spanrl.core import dead_letters as dl

#: assembler reasons that end a whole attempt (all its calls are dead-lettered with it)
ATTEMPT_REASONS = frozenset({
    dl.NO_LLM_CALLS, dl.NO_REWARD_BEFORE_TIMEOUT, dl.ROLLOUT_FAILED_NO_REWARD, dl.ROLLOUT_TIMEOUT,
    dl.NO_REWARD_BEFORE_WINDOW, dl.LATE_SPANS_MISSING,
    getattr(dl, "UNKNOWN_ROLLOUT", "unknown_rollout"),
})  # (invalid_reward is about one reward event; the attempt may still get a valid one)
#: assembler reasons about one span
SPAN_REASONS = frozenset({dl.MISSING_TOKEN_IDS, dl.LOGPROBS_MISMATCH, dl.LATE_SPAN})
#: grouper reasons: the transition exists but is not in a sample (payload = the transition)
GROUPER_REASONS = frozenset({dl.GROUP_INCOMPLETE, dl.SUPERSEDED_ATTEMPT, dl.GROUP_CLOSED})

_ATTEMPT_RE = re.compile(r"attempt (\S+?):? ")
_SPAN_RE = re.compile(r"span ([0-9a-f]{16})")

Key = tuple[str, str, str]


def known_reward(rollout_id: str) -> float:
    """The reward the chaos agent gives rollout ``rollout_id``: one of 0, .25, .5, .75, 1,
    a function of the id alone, so the ledger can check every transition's return."""
    return (int(rollout_id[:4], 16) % 5) / 4


def dead_letter_scope(d: dict) -> tuple[str, str | None, str | None] | None:
    """What a dead letter covers: ``(rollout_id, attempt_id, span_id or None)``; None when it
    names no rollout or is not an assembler decision about calls."""
    if not d.get("rollout_id") or d.get("reason") not in ATTEMPT_REASONS | SPAN_REASONS:
        return None
    detail = d.get("detail") or ""
    m_a, m_s = _ATTEMPT_RE.search(detail + " "), _SPAN_RE.search(detail)
    attempt = m_a.group(1) if m_a else None
    span = m_s.group(1) if (m_s and d["reason"] in SPAN_REASONS) else None
    return d["rollout_id"], attempt, span


@dataclass
class Account:
    """Counts of one fault run (what results/chaos.json reports per fault)."""

    calls_acknowledged: int = 0      # proxy LLM spans in Kafka for this run's rollouts (expected)
    transitions: int = 0             # distinct transition keys produced
    dead_lettered: int = 0           # calls covered by an assembler dead letter
    missing: int = 0                 # calls neither in transitions nor dead-lettered
    duplicated: int = 0              # extra copies of transitions (+ samples) by key
    conflicting: int = 0             # calls both transitioned and dead-lettered
    unexpected: int = 0              # transitions whose call is not among the acknowledged ones
    return_mismatches: int = 0       # transitions whose episode return != the known reward
    samples: int = 0                 # distinct sample keys
    samples_missing: int = 0         # transitions in no sample and no grouper dead letter
    samples_duplicated: int = 0      # extra copies of samples by key
    advantage_mismatches: int = 0    # samples whose advantage != GRPO recomputed in its group
    acked_not_in_kafka: int = 0      # client-acknowledged calls/rewards/spans absent from Kafka
    attempts: dict = field(default_factory=dict)       # terminal status -> count
    dead_letter_reasons: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)       # first few concrete examples

    @property
    def ok(self) -> bool:
        return not (self.missing or self.duplicated or self.conflicting or self.unexpected
                    or self.return_mismatches or self.samples_missing or self.samples_duplicated
                    or self.advantage_mismatches or self.acked_not_in_kafka)

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def account(*, calls: list[dict], events: list[dict], transitions: list[dict], samples: list[dict],
            dead_letters: list[dict], rewards: list[dict] | None = None, spans: list[dict] | None = None,
            acked: list[dict] | None = None, check_returns: bool = True, eps: float = 1e-6) -> Account:
    """Account for one run's records.

    calls: proxy LLM spans (span.v1, ``source == "proxy"``) of the run's rollouts;
    events: rollout.v1 lifecycle events of the run; transitions / samples: transition.v1 /
    sample.v1 of the run's rollouts; dead_letters: dead_letter.v1 naming the run's rollouts
    (grouper ones carry the encoded transition as payload, decoded by the caller into
    ``d["transition"]``); rewards / spans: reward.v1 and span.v1 of the run (for the
    acknowledgement check); acked: the client's log of 2xx answers, dicts with ``kind``
    in {call, reward, span} and ``rollout_id`` plus ``request_id`` (call) / ``span_id`` (span).
    check_returns: compare every transition's episode_return with :func:`known_reward`.
    """
    acc = Account()
    keys = {(c["rollout_id"], c["attempt_id"], c["span_id"]) for c in calls}
    acc.calls_acknowledged = len(keys)

    t_count = Counter((t["rollout_id"], t["attempt_id"], t["span_id"]) for t in transitions)
    acc.transitions = len(t_count)
    acc.duplicated = sum(n - 1 for n in t_count.values())
    acc.unexpected = len(set(t_count) - keys)

    dead_attempts: set[tuple[str, str | None]] = set()
    dead_spans: set[Key] = set()
    reasons: Counter = Counter()
    for d in dead_letters:
        reasons[d["reason"]] += 1
        scope = dead_letter_scope(d)
        if scope is None:
            continue
        rid, aid, sid = scope
        if sid is not None:
            dead_spans.add((rid, aid or "0", sid))
        else:
            dead_attempts.add((rid, aid))
    acc.dead_letter_reasons = dict(sorted(reasons.items()))

    def dead(k: Key) -> bool:
        return k in dead_spans or (k[0], k[1]) in dead_attempts or (k[0], None) in dead_attempts

    for k in sorted(keys):
        is_t, is_d = k in t_count, dead(k)
        acc.dead_lettered += is_d and not is_t
        if is_t and is_d:
            acc.conflicting += 1
            _note(acc, f"call {k} both transitioned and dead-lettered")
        if not is_t and not is_d:
            acc.missing += 1
            _note(acc, f"call {k} neither transitioned nor dead-lettered")

    status = {}
    for e in events:
        if e["status"] != "started":
            status.setdefault((e["rollout_id"], e["attempt_id"]), e["status"])
    acc.attempts = dict(sorted(Counter(status.values()).items()))

    if check_returns:
        for t in transitions:
            if not math.isclose(t["episode_return"], known_reward(t["rollout_id"]), abs_tol=1e-9):
                acc.return_mismatches += 1
                _note(acc, f"transition {t['rollout_id']}/{t['span_id']}: return {t['episode_return']}")

    # samples: each transition in exactly one sample or one grouper dead letter
    s_count = Counter((s["transition"]["rollout_id"], s["transition"]["attempt_id"], s["transition"]["span_id"])
                      for s in samples)
    acc.samples = len(s_count)
    acc.samples_duplicated = sum(n - 1 for n in s_count.values())
    grouped_out = {(d["transition"]["rollout_id"], d["transition"]["attempt_id"], d["transition"]["span_id"])
                   for d in dead_letters if d.get("reason") in GROUPER_REASONS and d.get("transition")}
    for k in sorted(t_count):
        if k not in s_count and k not in grouped_out:
            acc.samples_missing += 1
            _note(acc, f"transition {k} in no sample and no grouper dead letter")
    acc.advantage_mismatches = advantage_mismatches(samples, eps, acc)

    if acked:
        request_ids = {(c["rollout_id"], (c.get("llm") or {}).get("request_id")) for c in calls}
        reward_keys = {(r["rollout_id"], r["attempt_id"]) for r in rewards or []}
        span_keys = {(s["rollout_id"], s["span_id"]) for s in spans or []}
        for a in acked:
            if a["kind"] == "call":
                present = (a["rollout_id"], a["request_id"]) in request_ids
            elif a["kind"] == "reward":
                present = (a["rollout_id"], a.get("attempt_id", "0")) in reward_keys
            else:
                present = (a["rollout_id"], a["span_id"]) in span_keys
            if not present:
                acc.acked_not_in_kafka += 1
                _note(acc, f"acknowledged {a['kind']} of {a['rollout_id']} not in Kafka")
    return acc


def expected_advantage(group_returns: list[float], R: float, eps: float = 1e-6) -> float:
    """GRPO's outcome advantage of return ``R`` in a group whose returns are ``group_returns``
    (``R`` among them): ``(R - mean) / (pstdev + eps)``, 0 for a group of one (DeepSeekMath,
    arXiv 2402.03300 s4.1.2; population std, as the stream job states it). Written here apart
    from the stream job's own ``credit.grpo_advantages`` on purpose, with the standard
    library's ``statistics``: the ledger checks the stream job's arithmetic, so it must not call
    it. Examples: ``([0, .25], 0) = -0.125 / (0.125 + eps)``, ``([0, .25, .5], .5) = +1.2247``."""
    if len(group_returns) <= 1:
        return 0.0
    return (R - statistics.fmean(group_returns)) / (statistics.pstdev(group_returns) + eps)


def advantage_mismatches(samples: list[dict], eps: float = 1e-6, acc: Account | None = None) -> int:
    """Samples whose advantage differs (abs 1e-9) from GRPO recomputed over their group
    (one return per member rollout attempt; :func:`expected_advantage`); a late member
    (stream_jobs/grouping.py) against the group at close, the late members before it and itself."""
    groups: dict[str, dict[tuple[str, str], tuple[int, float]]] = defaultdict(dict)
    for s in samples:
        t = s["transition"]
        groups[s["group_id"]][(t["rollout_id"], t["attempt_id"])] = (s.get("group_rollouts", 0), t["episode_return"])
    expected: dict[tuple[str, str, str], float] = {}
    for gid, members in groups.items():
        # the members at close share the smallest group_rollouts; late members
        # (stream_jobs/grouping.py) came one by one after, each with one more
        closed = min(n for n, _ in members.values())
        order = sorted(m for m, (n, _) in members.items() if n == closed)
        returns = [members[m][1] for m in order]
        for m, R in zip(order, returns):
            expected[(gid, *m)] = expected_advantage(returns, R, eps)
        for m in sorted((m for m in members if members[m][0] > closed), key=lambda m: members[m][0]):
            returns.append(members[m][1])
            expected[(gid, *m)] = expected_advantage(returns, members[m][1], eps)
    bad = 0
    for s in samples:
        t = s["transition"]
        want = expected[(s["group_id"], t["rollout_id"], t["attempt_id"])]
        if not math.isclose(s["advantage"], want, rel_tol=0, abs_tol=1e-9):
            bad += 1
            if acc is not None:
                _note(acc, f"sample {t['rollout_id']}/{t['span_id']}: advantage {s['advantage']} != {want}")
    return bad


def _note(acc: Account, text: str, keep: int = 10) -> None:
    if len(acc.problems) < keep:
        acc.problems.append(text)
