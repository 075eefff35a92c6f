"""Per-task grouping: transitions of a task's rollouts -> GRPO samples.

Pure state logic (no Faust). One state dict per ``task_id`` (plain JSON, for a Faust
table); the transitions themselves wait in a separate ``store`` mapping (a dict: in the app,
the worker's memory, with no changelog). Each waiting transition's member entry keeps the
position of its record on the transitions topic (``m["at"][span_id] = [topic, partition,
offset]``), so a worker that restores the state without the transitions (after a restart or a
rebalance) re-reads them (:func:`missing_reads`) before it adds to or closes the group; a
transition that cannot be read back -> dead letter ``transitions_missing`` for its rollout's
attempt (its samples would not be the ones the group owes), never a crash.

LightningRL (arXiv 2508.03680) s3.3: the transitions of several runs of the same task
form a group and GRPO normalises the episode returns inside it, so every call of
rollout i gets the advantage A_i = (R_i - mean R) / (std R + eps) (DeepSeekMath,
arXiv 2402.03300 s4.1.2; see :func:`spanrl.stream_jobs.credit.grpo_advantages`). The
advantage uses ``episode_return``; the credit rule only changes a transition's
``reward`` field (for losses that use it, e.g. REINFORCE++).

A rollout is *complete* in the group when ``rollout_transition_count`` distinct
transitions of one attempt arrived (idempotent by (rollout_id, attempt_id, span_id)).
The open group of a task closes when ``group_size`` distinct rollouts are complete, or
``group_timeout_s`` after it opened (its first transition). On close:

- the first complete attempt of each rollout is a member; its samples are produced
  (ordered by rollout_id, attempt_id, call_index) with ``group_id = f"{task_id}/{n}"``,
  n = number of earlier groups of this task that produced samples (0, 1, ...);
- other transitions -> dead letters ``group_incomplete`` (attempt not complete) or
  ``superseded_attempt`` (another attempt of that rollout is the member), with the
  encoded transition as payload;
- a later transition of a rollout of a closed group -> ``group_closed``; the same
  transition delivered again after its group closed (a worker restarted after a crash
  re-reads inputs whose state changes were already committed) -> nothing.

The next transition of the task opens a new group (the runner may run a task again).

Late members (rewards that come at different times; stream_jobs/README.md, "Grouping when
rewards come late"). A group never waits for a late reward: it closes as above (waiting
would hold every sibling's transitions for up to the reward window and stall training). A
group that closed *short* (fewer members than ``group_size``) is remembered for
``late_join_s`` as ``state["last_closed"]`` = {group_id, closed_ms, group_size, returns}
(returns only, no transitions). A transition with ``late_reward`` (its attempt was parked,
stream_jobs/assembly.py) that comes while the task has no open group joins that group
late: it waits in ``state["late"][rollout|attempt]`` until its rollout is complete, then
its samples get :func:`late_member_advantage` against the returns of the group so far
(members and earlier late members), the group's id, and ``group_rollouts`` /
``group_mean`` / ``group_std`` of the group with it; the earlier members' samples are not
changed (they are trained already). A late member still incomplete ``group_timeout_s``
after its first transition -> ``group_incomplete``. Any other transition is handled as above.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import MutableMapping

from spanrl.core import dead_letters as dl
from spanrl.core.settings import StreamSettings
from spanrl.schemas import codec
from spanrl.stream_jobs.credit import grpo_advantages, group_stats
from spanrl.stream_jobs.ticking import TickIndex

SAMPLE_VERSION = 2  # schemas/avro/sample.v2.avsc (a transition v2 inside)
RECENT_CLOSED_MAX = 1024
RECENT_CLOSED_SPANS_MAX = 4096


@dataclass(frozen=True)
class GroupingConfig:
    """late_join_s: how long a short closed group takes late members (the app: the reward window)."""

    group_timeout_s: float = StreamSettings.default("group_timeout_s")
    eps: float = 1e-6
    late_join_s: float = StreamSettings.default("reward_window_s")


@dataclass
class GroupOutcome:
    samples: list[dict] = field(default_factory=list)
    dead_letters: list[dict] = field(default_factory=list)


def new_state(task_id: str, partition: int | None = None) -> dict:
    return {"task_id": task_id, "partition": partition, "closed_groups": 0,
            "open": None, "recent_closed": []}


def has_open_group(state: dict) -> bool:
    """Whether the task has an open group (a tick may close it by time-out); a task whose
    groups are all closed waits for its next transition and needs no tick."""
    return state["open"] is not None


#: :func:`tick_due`: no time will change the state (only a transition will); TickIndex.NEVER
NEVER = TickIndex.NEVER


def tick_due(state: dict, config: GroupingConfig) -> int:
    """When :func:`advance` may next change this task state by time alone (ms): the earliest of
    its open group's time-out (``opened_ms + group_timeout_s``) and its late members'
    (``first_ms + group_timeout_s``); :data:`NEVER` with neither. For the app's tick index:
    a tick visits the state then, instead of every open group on every tick (with groups that
    wait for their time-out, e.g. a task label per rollout, thousands of visits a second). Pure."""
    timeout = math.ceil(config.group_timeout_s * 1000)
    due = [m["first_ms"] + timeout for m in state.get("late", {}).values()]
    if state["open"] is not None:
        due.append(state["open"]["opened_ms"] + timeout)
    return min(due) if due else NEVER


def store_key(task_id: str, rollout_id: str, attempt_id: str, span_id: str) -> str:
    return f"{task_id}|{rollout_id}|{attempt_id}|{span_id}"


def missing_reads(state: dict, store: MutableMapping) -> list[tuple[str, list]]:
    """The transitions to re-read before this state is updated: [(store key, [topic,
    partition, offset]), ...] of every waiting transition (open group's members, late
    members) that knows its record's position and is not in ``store``. Empty except after
    a restart or rebalance."""
    tid, wanted = state["task_id"], []
    entries = list(state["open"]["members"].values()) if state["open"] is not None else []
    for m in entries + list(state.get("late", {}).values()):
        at = m.get("at", {})
        for s in m["spans"]:
            key = store_key(tid, m["rollout_id"], m["attempt_id"], s)
            if key not in store and at.get(s) is not None:
                wanted.append((key, at[s]))
    return wanted


def restore_transition(key: str, transition: dict) -> dict | None:
    """``transition`` (a re-read, decoded record) if it is the one stored under ``key``, else None."""
    ids = (transition.get("task_id"), transition.get("rollout_id"), transition.get("attempt_id"),
           transition.get("span_id"))
    return transition if store_key(*ids) == key else None


def _waiting(m: dict, transition: dict, store: MutableMapping, key: str, at) -> None:
    m["spans"].append(transition["span_id"])
    if at is not None:
        m.setdefault("at", {})[transition["span_id"]] = list(at)
    store[key] = transition


def _held(tid: str, m: dict, store: MutableMapping, pop: bool = False) -> list[tuple[str, dict | None]]:
    """[(span id, its transition or None when not held), ...] of a member entry."""
    get = store.pop if pop else store.get
    return [(s, get(store_key(tid, m["rollout_id"], m["attempt_id"], s), None)) for s in m["spans"]]


def _missing_dead(tid: str, m: dict, held: list[tuple[str, dict | None]], now_ms: int) -> list[dict]:
    """Dead letters ``transitions_missing`` for every transition of member ``m`` (payload: the
    transition where it is held)."""
    lost = [s for s, tr in held if tr is None]
    why = (f"{len(lost)} of {len(held)} transitions of this attempt could not be re-read from "
           f"transitions after a restart: {', '.join(lost[:8])}")
    out = []
    for s, tr in held:
        tr = tr or {"rollout_id": m["rollout_id"], "task_id": tid, "attempt_id": m["attempt_id"], "span_id": s}
        out.append(dl.dead_letter(dl.TRANSITIONS_MISSING, dl.GROUPER, now_ms, rollout_id=m["rollout_id"],
                                  task_id=tid, detail=f"attempt {m['attempt_id']} span {s}: {why}",
                                  payload=encoded(tr) if "episode_return" in tr else None))
    return out


def add_transition(state: dict, transition: dict, store: MutableMapping,
                   config: GroupingConfig, now_ms: int, at: tuple[str, int, int] | None = None) -> GroupOutcome:
    """Add one transition (a decoded transition); closes the group when it is full. ``at``:
    (topic, partition, offset) of its record, kept so that it can be re-read."""
    tid, rid, aid, sid = (transition["task_id"], transition["rollout_id"],
                          transition["attempt_id"], transition["span_id"])
    if sid in state.get("closed_spans", ()):
        return GroupOutcome()  # re-delivered after its group closed: counted once
    if rid in state["recent_closed"]:
        return GroupOutcome(dead_letters=[_dead(dl.GROUP_CLOSED, transition, now_ms,
                                                "its group already closed")])
    if f"{rid}|{aid}" in state.get("late", {}) or (
            state["open"] is None and transition.get("late_reward") and late_group(state, config, now_ms)):
        return add_late_member(state, transition, store, config, now_ms, at)
    g = state["open"]
    if g is None:
        g = state["open"] = {"opened_ms": now_ms, "group_size": max(1, int(transition["group_size"])),
                             "members": {}, "completions": 0}
    m = g["members"].setdefault(f"{rid}|{aid}", {
        "rollout_id": rid, "attempt_id": aid, "count": int(transition["rollout_transition_count"]),
        "spans": [], "episode_return": float(transition["episode_return"]), "completed": None})
    if sid in m["spans"]:
        return GroupOutcome()  # re-delivered transition: counted once
    _waiting(m, transition, store, store_key(tid, rid, aid, sid), at)
    if m["completed"] is None and len(m["spans"]) >= m["count"]:
        m["completed"] = g["completions"]  # completion order decides between attempts
        g["completions"] += 1
    if len(_complete_rollouts(g)) >= g["group_size"]:
        return close(state, store, config, now_ms)
    return GroupOutcome()


def advance(state: dict, store: MutableMapping, config: GroupingConfig, now_ms: int) -> GroupOutcome:
    """Close the open group if it has been open ``group_timeout_s`` or longer; dead-letter
    late members incomplete that long."""
    out = GroupOutcome()
    for key in sorted(state.get("late", {})):
        m = state["late"][key]
        if now_ms - m["first_ms"] >= config.group_timeout_s * 1000:
            held = _held(state["task_id"], m, store, pop=True)
            if any(tr is None for _, tr in held):
                out.dead_letters += _missing_dead(state["task_id"], m, held, now_ms)
            else:
                for _, tr in held:
                    out.dead_letters.append(_dead(dl.GROUP_INCOMPLETE, tr, now_ms, f"late member: "
                                                  f"{len(m['spans'])}/{m['count']} transitions in {config.group_timeout_s:g}s"))
            del state["late"][key]
    g = state["open"]
    if g is not None and now_ms - g["opened_ms"] >= config.group_timeout_s * 1000:
        closed = close(state, store, config, now_ms)
        out.samples += closed.samples
        out.dead_letters += closed.dead_letters
    return out


def late_member_advantage(group_returns: list[float], R: float, eps: float = 1e-6) -> float:
    """GRPO advantage of a late member with return R whose group already has ``group_returns``:
    A = (R - mean(G)) / (std(G) + eps) over G = group_returns + [R] (DeepSeekMath, arXiv
    2402.03300 s4.1.2; population std as :func:`spanrl.stream_jobs.credit.grpo_advantages`).
    The advantage it would have had in the group had its reward come in time, the others
    unchanged. Raises ValueError for an empty ``group_returns`` (no group to join)."""
    if not group_returns:
        raise ValueError("a late member needs a group with at least one member")
    return grpo_advantages([*group_returns, R], eps)[-1]


def late_group(state: dict, config: GroupingConfig, now_ms: int) -> dict | None:
    """The task's short closed group a late member may join now (``late_join_s``), or None."""
    g = state.get("last_closed")
    if g is None or now_ms - g["closed_ms"] >= config.late_join_s * 1000:
        return None
    return g


def add_late_member(state: dict, transition: dict, store: MutableMapping, config: GroupingConfig,
                    now_ms: int, at: tuple[str, int, int] | None = None) -> GroupOutcome:
    """Add a transition of a late member; its samples once its rollout is complete."""
    tid, rid, aid, sid = (transition["task_id"], transition["rollout_id"],
                          transition["attempt_id"], transition["span_id"])
    key = f"{rid}|{aid}"
    m = state.setdefault("late", {}).setdefault(key, {
        "rollout_id": rid, "attempt_id": aid, "count": int(transition["rollout_transition_count"]),
        "spans": [], "episode_return": float(transition["episode_return"]), "first_ms": now_ms})
    if sid in m["spans"]:
        return GroupOutcome()
    _waiting(m, transition, store, store_key(tid, rid, aid, sid), at)
    if len(m["spans"]) < m["count"]:
        return GroupOutcome()
    out = GroupOutcome()
    held = _held(tid, m, store, pop=True)
    if any(tr is None for _, tr in held):
        del state["late"][key]
        out.dead_letters += _missing_dead(tid, m, held, now_ms)
        return out
    g = state["last_closed"]
    returns = [*g["returns"], m["episode_return"]]
    adv = late_member_advantage(g["returns"], m["episode_return"], config.eps)
    mean, std = group_stats(returns)
    calls = [tr for _, tr in held]
    for tr in sorted(calls, key=lambda t: t["call_index"]):
        out.samples.append({"schema_version": SAMPLE_VERSION, "transition": tr, "advantage": adv, "group_id": g["group_id"],
                            "group_rollouts": len(returns), "group_mean": mean, "group_std": std})
    g["returns"] = returns
    del state["late"][key]
    state["recent_closed"] = (state["recent_closed"] + [rid])[-RECENT_CLOSED_MAX:]
    state["closed_spans"] = (state.get("closed_spans", []) + sorted(m["spans"]))[-RECENT_CLOSED_SPANS_MAX:]
    return out


def _complete_rollouts(g: dict) -> dict[str, dict]:
    """rollout_id -> its first complete attempt's member entry."""
    best: dict[str, dict] = {}
    for m in g["members"].values():
        if m["completed"] is not None:
            cur = best.get(m["rollout_id"])
            if cur is None or m["completed"] < cur["completed"]:
                best[m["rollout_id"]] = m
    return best


def close(state: dict, store: MutableMapping, config: GroupingConfig, now_ms: int) -> GroupOutcome:
    """Close the open group: samples for its complete rollouts, dead letters for the rest."""
    out = GroupOutcome()
    g = state["open"]
    if g is None:
        return out
    tid = state["task_id"]
    members = sorted(_complete_rollouts(g).values(), key=lambda m: (m["rollout_id"], m["attempt_id"]))
    held = {(m["rollout_id"], m["attempt_id"]): _held(tid, m, store) for m in g["members"].values()}
    lost = {k for k, h in held.items() if any(tr is None for _, tr in h)}
    members = [m for m in members if (m["rollout_id"], m["attempt_id"]) not in lost]
    chosen = {(m["rollout_id"], m["attempt_id"]) for m in members}
    if members:
        returns = [m["episode_return"] for m in members]
        advantages = grpo_advantages(returns, config.eps)  # DeepSeekMath s4.1.2
        mean, std = group_stats(returns)
        group_id = f"{tid}/{state['closed_groups']}"
        state["closed_groups"] += 1
        # a short group takes late members (module doc); a full one, or none, does not
        state["last_closed"] = None if len(members) >= g["group_size"] else {
            "group_id": group_id, "closed_ms": now_ms, "group_size": g["group_size"], "returns": returns}
        for m, adv in zip(members, advantages):
            calls = [tr for _, tr in held[(m["rollout_id"], m["attempt_id"])]]
            for tr in sorted(calls, key=lambda t: t["call_index"]):
                out.samples.append({
                    "schema_version": codec.latest_version("sample"), "transition": tr, "advantage": adv,
                    "group_id": group_id, "group_rollouts": len(members),
                    "group_mean": mean, "group_std": std,
                })
    for key in sorted(g["members"]):
        m = g["members"][key]
        if (m["rollout_id"], m["attempt_id"]) in chosen:
            continue
        if (m["rollout_id"], m["attempt_id"]) in lost:
            out.dead_letters += _missing_dead(tid, m, held[(m["rollout_id"], m["attempt_id"])], now_ms)
            continue
        if m["completed"] is None:
            reason, why = dl.GROUP_INCOMPLETE, f"{len(m['spans'])}/{m['count']} transitions at close"
        else:
            reason, why = dl.SUPERSEDED_ATTEMPT, "another attempt of this rollout is in the group"
        for _, tr in held[(m["rollout_id"], m["attempt_id"])]:
            out.dead_letters.append(_dead(reason, tr, now_ms, why))
    for m in g["members"].values():
        for s in m["spans"]:
            store.pop(store_key(tid, m["rollout_id"], m["attempt_id"], s), None)
    rids = sorted({m["rollout_id"] for m in g["members"].values()})
    state["recent_closed"] = (state["recent_closed"] + rids)[-RECENT_CLOSED_MAX:]
    spans = sorted(s for m in g["members"].values() for s in m["spans"])
    state["closed_spans"] = (state.get("closed_spans", []) + spans)[-RECENT_CLOSED_SPANS_MAX:]
    state["open"] = None
    return out


def encoded(transition) -> bytes:
    """A transition's record: the ``record`` a store may keep with it (the app's
    StoredTransition), else encoded here."""
    record = getattr(transition, "record", None)
    return record if record is not None else codec.encode("transition", dict(transition))


def _dead(reason: str, transition: dict, now_ms: int, why: str) -> dict:
    return dl.dead_letter(
        reason, dl.GROUPER, now_ms, rollout_id=transition["rollout_id"], task_id=transition["task_id"],
        detail=f"attempt {transition['attempt_id']} span {transition['span_id']}: {why}",
        payload=encoded(transition))
