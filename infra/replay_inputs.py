"""A replay's own inputs: the stored ``spans``, ``rewards`` and ``rollouts`` between two
times, copied into ``spans.<suffix>`` / ``rewards.<suffix>`` / ``rollouts.<suffix>``, the
final rewards optionally re-scored by a user's function on the way.

Used by spanrl/infra/replay.py when a replay has an end time (``--until``) or a new
reward (``--reward``): the replay's Faust worker then reads these topics instead of the
originals, so it sees exactly the window and the new returns, and the credit rule, AIR,
grouping and the trainer run unchanged (stream_jobs/credit.py, grouping.py). Each copy
keeps the record's partition, key, bytes and Kafka timestamp (the partitions of a derived
topic are the original's: the keys land where they were). The originals are never written.

A re-scored final reward replaces each final reward event of the attempt (the stream job
takes the last final one: stream_jobs/credit.py ``episode_return``), with ``name`` the
function's reference and the recorded value kept as component ``recorded``; intermediate
rewards (``final=false``) are copied as they are. The pure parts (which records a window
holds, what the function is given, which reward records come out) are tested in
tests/unit/test_replay_inputs.py; the Kafka copy in tests/integration/test_replay_reward.py.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from spanrl.schemas import topics as T

INPUTS = (T.SPANS, T.REWARDS, T.ROLLOUTS)
#: rollout statuses after which an attempt is over (spanrl.producers.runner)
TERMINAL = ("succeeded", "failed", "timeout")

#: ``score(task, calls, recorded_reward) -> new final reward or None`` (docs/replay.md)
RewardFn = Callable[[dict, list[dict], "float | None"], "float | None"]


class ReplayError(RuntimeError):
    """A replay refused or failed, with a reason a user can act on."""


@dataclass(frozen=True)
class Stored:
    """One record as read from Kafka, decoded (``record``) or not (None)."""

    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes
    record: dict | None = None


def offset_ranges(first: dict[int, int | None], stop: dict[int, int | None], ends: dict[int, int]
                  ) -> dict[int, tuple[int, int]]:
    """partition -> ``[start, stop)`` offsets of a time window, from Kafka ListOffsets by time
    (``offsets_for_times``: the first offset whose timestamp is at or after the time, None
    when there is none) for the window's start (``first``) and end (``stop``; a partition
    absent or None there: up to ``ends``, the end offsets now). Pure."""
    out: dict[int, tuple[int, int]] = {}
    for p, end in sorted(ends.items()):
        lo = first.get(p, 0)
        hi = stop.get(p)
        lo = end if lo is None else lo
        hi = end if hi is None else min(hi, end)
        out[p] = (lo, max(lo, hi))
    return out


def task_view(task: dict | None, task_id: str) -> dict:
    """What a reward function gets as the task: the ``tasks`` record with its ``payload``
    parsed from JSON (a text that is not JSON stays text), or ``{"task_id", "payload":
    None}`` when the tasks topic no longer holds it (its retention is 7 days: topics.py)."""
    if task is None:
        return {"task_id": task_id, "payload": None}
    out = {k: v for k, v in task.items() if k != "schema_version"}
    try:
        out["payload"] = json.loads(task["payload"])
    except (TypeError, ValueError):
        pass
    return out


def _json_or_none(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def call_view(span: dict) -> dict:
    """What a reward function gets of one recorded LLM call (a proxy span with ``llm``): the
    request's messages and the answer's messages as the client sent and got them
    (``input_messages`` / ``output_messages``, OpenAI chat format; None for records written
    before they were kept or with ``SPANRL_CAPTURE_MESSAGES=false``), the request's tools and
    options (``request``), the token ids and the behaviour log-probs, the model, the
    tokenizer's identity, the agent and the span's ids. Pure."""
    llm = span["llm"] or {}
    return {
        "span_id": span["span_id"], "sequence_id": span["sequence_id"], "agent_name": span.get("agent_name"),
        "model": llm.get("model"), "policy_version": llm.get("policy_version"),
        "input_messages": _json_or_none(llm.get("input_messages")),
        "output_messages": _json_or_none(llm.get("output_messages")),
        "request": _json_or_none(llm.get("request")),
        "tokenizer": llm.get("tokenizer"), "tokenizer_sha256": llm.get("tokenizer_sha256"),
        "prompt_token_ids": list(llm.get("prompt_token_ids") or []),
        "completion_token_ids": list(llm.get("completion_token_ids") or []),
        "completion_logprobs": list(llm.get("completion_logprobs") or []),
        "finish_reason": llm.get("finish_reason"),
    }


def attempts_to_score(rollouts: Iterable[dict], rewards: Iterable[dict]) -> dict[tuple[str, str], dict]:
    """``(rollout_id, attempt_id)`` -> ``{"task_id", "status", "recorded": the last final
    reward value or None}`` of every attempt that has a final reward or ended ``succeeded``
    (a failed or timed-out attempt without a reward is left as it was), in order of first
    appearance. Pure."""
    tasks: dict[tuple[str, str], dict] = {}
    for ev in rollouts:
        a = tasks.setdefault((ev["rollout_id"], ev["attempt_id"]), {"task_id": ev["task_id"], "status": "started"})
        if ev["status"] in TERMINAL and a["status"] == "started":
            a["status"] = ev["status"]
    recorded: dict[tuple[str, str], float] = {}
    for r in rewards:
        if r.get("final", True):
            recorded[(r["rollout_id"], r["attempt_id"])] = float(r["value"])
    out: dict[tuple[str, str], dict] = {}
    for key, a in tasks.items():
        if key in recorded or a["status"] == "succeeded":
            out[key] = {"task_id": a["task_id"], "status": a["status"], "recorded": recorded.get(key)}
    return out


def new_returns(attempts: dict[tuple[str, str], dict], tasks: dict[str, dict], spans: Iterable[dict],
                fn: RewardFn, ref: str = "reward") -> dict[tuple[str, str], float | None]:
    """Each attempt's new final reward: ``fn(task_view, [call_view per LLM call in
    sequence order], recorded)``. ``tasks``: task_id -> decoded ``tasks`` record. Raises
    :class:`ReplayError` naming the attempt when ``fn`` raises or returns something other
    than a finite number or None."""
    calls: dict[tuple[str, str], list[dict]] = {}
    for span in spans:
        if span.get("llm") is not None:
            calls.setdefault((span["rollout_id"], span["attempt_id"]), []).append(span)
    out: dict[tuple[str, str], float | None] = {}
    for key, a in attempts.items():
        views = [call_view(s) for s in sorted(calls.get(key, []), key=lambda s: s["sequence_id"])]
        try:
            value = fn(task_view(tasks.get(a["task_id"]), a["task_id"]), views, a["recorded"])
        except Exception as exc:  # the user's code: any error stops the replay, named
            raise ReplayError(f"reward function {ref} raised on rollout {key[0]} attempt {key[1]}: "
                              f"{type(exc).__name__}: {exc}") from exc
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise ReplayError(f"reward function {ref} returned {value!r} for rollout {key[0]} attempt {key[1]}; "
                              "expected a finite number or None")
        out[key] = None if value is None else float(value)
    return out


def rewritten_rewards(rewards: list[Stored], rollouts: list[Stored], returns: dict[tuple[str, str], float | None],
                      ref: str) -> list[Stored]:
    """The reward records of the replay's ``rewards.<suffix>`` (decoded in ``record``; the
    caller encodes those whose ``value`` is empty), in the order read: a final reward of a re-scored attempt carries
    the new value (``name`` = ``ref``, the recorded value as component ``recorded``) or is
    dropped when the new value is None; other rewards unchanged. An attempt re-scored to a
    value that had no final reward gets one, on its rollout's partition, timed at its
    terminal rollout event. Pure."""
    out: list[Stored] = []
    seen: set[tuple[str, str]] = set()
    for r in rewards:
        rec = r.record
        key = (rec["rollout_id"], rec["attempt_id"])
        if not rec.get("final", True) or key not in returns:
            out.append(r)
            continue
        seen.add(key)
        if returns[key] is None:
            continue
        new = {**rec, "value": returns[key], "name": ref,
               "components": {**(rec.get("components") or {}), "recorded": float(rec["value"])}}
        out.append(Stored(r.partition, r.offset, r.timestamp_ms, r.key, b"", new))
    ended: dict[tuple[str, str], Stored] = {}
    for ev in rollouts:
        key = (ev.record["rollout_id"], ev.record["attempt_id"])
        if ev.record["status"] in TERMINAL and key not in ended:
            ended[key] = ev
    for key, value in returns.items():
        if key in seen or value is None or key not in ended:
            continue
        ev = ended[key]
        rec = {"rollout_id": key[0], "attempt_id": key[1], "value": value, "final": True, "name": ref,
               "span_id": None, "timestamp_ms": ev.record["timestamp_ms"], "components": {}}
        out.append(Stored(ev.partition, -1, ev.timestamp_ms, ev.key, b"", rec))
    return out


# ---------------------------------------------------------------- Kafka plumbing
async def read_window(bootstrap: str, topic: str, ranges: dict[int, tuple[int, int]]) -> list[Stored]:
    """The committed records of ``topic`` in ``ranges`` (partition -> ``[start, stop)``),
    read read_committed, not decoded."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    wanted = {TopicPartition(topic, p): r for p, r in ranges.items() if r[1] > r[0]}
    if not wanted:
        return []
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed",
                                enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign(list(wanted))
        for tp, (lo, _) in wanted.items():
            consumer.seek(tp, lo)
        out: list[Stored] = []
        empty = 0
        while empty < 3:  # transaction markers take offsets: the last ones may hold no record
            if all([await consumer.position(tp) >= hi for tp, (_, hi) in wanted.items()]):
                break
            batch = await consumer.getmany(timeout_ms=1000, max_records=20000)
            empty = 0 if batch else empty + 1
            for tp, msgs in batch.items():
                out += [Stored(tp.partition, m.offset, m.timestamp, m.key, m.value)
                        for m in msgs if m.offset < wanted[tp][1]]
        return out
    finally:
        await consumer.stop()


async def window(bootstrap: str, topic: T.Topic, since_ms: int | None, until_ms: int | None
                 ) -> dict[int, tuple[int, int]]:
    """:func:`offset_ranges` of ``topic`` for ``[since_ms, until_ms)`` (None: open)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed",
                                enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic.name, p) for p in range(topic.partitions)]
        ends = await consumer.end_offsets(tps)

        async def at(ms: int | None) -> dict[int, int | None]:
            if ms is None:
                return {}
            found = await consumer.offsets_for_times({tp: ms for tp in tps})
            return {tp.partition: (f.offset if f else None) for tp, f in found.items()}
        return offset_ranges(await at(since_ms) if since_ms is not None else {},
                             await at(until_ms), {tp.partition: e for tp, e in ends.items()})
    finally:
        await consumer.stop()


def _decoded(topic: T.Topic, records: list[Stored]) -> list[Stored]:
    from spanrl.schemas import decode

    return [Stored(r.partition, r.offset, r.timestamp_ms, r.key, r.value, decode(topic.record, r.value))
            for r in records]


async def full_spans(spans: list[dict], settings) -> list[dict]:
    """Decoded ``spans``, a claim-checked one (``payload_ref``) read back from MinIO."""
    from spanrl.core import claims
    from spanrl.schemas import decode

    client = None
    out = []
    for span in spans:
        if span.get("payload_ref"):
            client = client or claims.make_client(settings)
            span = claims.check_claimed(span, decode("span", await claims.resolve_claim(client, span["payload_ref"])))
        out.append(span)
    return out


async def copy_inputs(settings, suffix: str, since_ms: int | None, until_ms: int | None,
                      reward_fn: RewardFn | None = None, reward_ref: str = "", log=print) -> dict:
    """Copy the inputs' records in ``[since_ms, until_ms)`` into ``<input>.<suffix>`` (created
    here), the final rewards re-scored by ``reward_fn`` when given; returns the counts and,
    with a function, each attempt's recorded and new return (``returns``)."""
    from spanrl.infra.stack import ensure_topics
    from spanrl.producers.kafka import make_producer
    from spanrl.schemas import encode

    bootstrap = settings.kafka_bootstrap
    targets = {t.name: T.derived(t, suffix) for t in INPUTS}
    await ensure_topics(bootstrap, tuple(targets.values()))
    used = [t.name for t in targets.values()
            if any(hi > lo for lo, hi in (await window(bootstrap, t, None, None)).values())]
    if used:  # a second copy would append the window again
        raise ReplayError(f"{', '.join(used)} already hold records: suffix {suffix!r} was used by another replay; "
                          "choose a new --suffix")
    got = {t.name: await read_window(bootstrap, t.name, await window(bootstrap, t, since_ms, until_ms))
           for t in INPUTS}
    result: dict[str, Any] = {"copied": {t.name: len(got[t.name]) for t in INPUTS}}
    if reward_fn is not None:
        rollouts = _decoded(T.ROLLOUTS, got[T.ROLLOUTS.name])
        rewards = _decoded(T.REWARDS, got[T.REWARDS.name])
        attempts = attempts_to_score([r.record for r in rollouts], [r.record for r in rewards])
        wanted = {a["task_id"] for a in attempts.values()}
        tasks = {}
        for r in _decoded(T.TASKS, await read_window(bootstrap, T.TASKS.name,
                                                         await window(bootstrap, T.TASKS, None, None))):
            if r.record["task_id"] in wanted:
                tasks[r.record["task_id"]] = r.record
        spans = await full_spans([r.record for r in _decoded(T.SPANS, got[T.SPANS.name])], settings)
        returns = new_returns(attempts, tasks, spans, reward_fn, reward_ref)
        log(f"re-scored {len(returns)} attempts with {reward_ref}")
        out_rewards = rewritten_rewards(rewards, rollouts, returns, reward_ref)
        got[T.REWARDS.name] = [Stored(r.partition, r.offset, r.timestamp_ms, r.key,
                                      r.value or encode("reward", r.record), r.record) for r in out_rewards]
        result["returns"] = {f"{k[0]}/{k[1]}": {"recorded": attempts[k]["recorded"], "new": v}
                             for k, v in returns.items()}
    producer = make_producer(bootstrap)
    await producer.start()
    try:
        for name, records in got.items():
            futures = [await producer.send(targets[name].name, r.value, key=r.key, partition=r.partition,
                                           timestamp_ms=r.timestamp_ms) for r in records]
            for f in futures:
                await f
    finally:
        await producer.stop()
    result["written"] = {targets[n].name: len(v) for n, v in got.items()}
    return result
