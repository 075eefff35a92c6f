"""What the stream app's agents share (stream_jobs/app.py builds it, each agent unit reads it).

:class:`AppContext` is the whole of it: the Faust app and the config, the pure modules'
configs, the topics the agents write, the tables, the worker's counters (:class:`WorkerCounters`,
behind ``/metrics`` and ``/spanrl/counters/``) and the output writers (:class:`Outputs`:
transitions, samples, call accounts, dead letters). The agents themselves live in
agent_assemble.py (spans + rewards + rollouts -> transitions), agent_group.py
(transitions -> samples), agent_join.py (orphan spans + trace links -> spans), the tick
timer in app_ticks.py, the web pages in app_web.py.

Nothing here imports stream_jobs/app.py: ``python -m spanrl.stream_jobs.app`` runs that
file as ``__main__``, and importing it again under its own name would build a second app.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import faust

from spanrl.core import claims
from spanrl.core import metrics as prom
from spanrl.schemas import codec, topics
from spanrl.stream_jobs import assembly, grouping, joining
from spanrl.core import dead_letters as dl
from spanrl.stream_jobs import metrics as worker_metrics
from spanrl.stream_jobs.transition_store import encode_sample

if TYPE_CHECKING:
    from spanrl.stream_jobs.app import StreamConfig

#: largest record any spanrl topic takes; Faust's producer refuses larger requests
#: (its default, 1 MB, is below the topics' limit)
MAX_RECORD_BYTES = max(t.max_message_bytes for t in topics.ALL)

#: every topic the app reads or writes carries bytes: the agents decode and encode (schemas/codec.py)
RAW = dict(key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")


def max_call_bytes() -> int:
    """Largest call store value (assembly.encode_call) whose transition, and sample,
    still fit their topics with ``claims.CLAIM_MARGIN_BYTES`` to spare (ids and strings)."""
    return min(topics.TRANSITIONS.max_message_bytes, topics.SAMPLES.max_message_bytes) - claims.CLAIM_MARGIN_BYTES


def now_ms() -> int:
    """The wall clock in ms (what the pure modules take as ``now``)."""
    return int(time.time() * 1000)


def record_ms(msg) -> int | None:
    """A Kafka record's timestamp in ms (Faust gives seconds as a float), None if unset."""
    return int(msg.timestamp * 1000) if msg.timestamp else None


def key_text(key: bytes | None) -> str | None:
    """A record key as text, None when absent or not UTF-8."""
    try:
        return key.decode() if key else None
    except UnicodeDecodeError:
        return None


def with_source(record: dict, message, payload: bytes | None) -> dict:
    """A dead-letter record with the source topic, partition and offset of ``message`` and,
    unless it names one, ``payload`` as its payload."""
    r = {**record, "source_topic": message.topic, "source_partition": message.partition,
         "source_offset": message.offset}
    if payload is not None and r.get("payload") is None:
        r["payload"] = payload
    return r


def dead_letter_value(record: dict) -> tuple[dict, bytes]:
    """The dead-letter record as sent and its encoding: without its payload (the detail then
    says how many bytes were left out) when it would not fit the dead-letter topic."""
    value = codec.encode("dead_letter", record)
    if not claims.fits(len(value), topics.DEAD_LETTER.max_message_bytes):
        record = {**record, "payload": None,
                  "detail": f"{record['detail']} [payload of {len(record['payload'] or b'')} bytes left out: too large]"}
        value = codec.encode("dead_letter", record)
    return record, value


def oversize(record: dict, what: str, size: int, limit: int, now: int) -> dict:
    """The ``oversize`` dead letter of a transition or a sample (``what``) whose record of
    ``size`` bytes exceeds its topic's ``limit``."""
    # assembly.max_call_bytes keeps calls well below this; ids/strings of absurd length remain
    t = record.get("transition", record)
    return dl.dead_letter(dl.OVERSIZE, dl.ASSEMBLER if what == "transition" else dl.GROUPER, now,
                          rollout_id=t["rollout_id"], task_id=t["task_id"],
                          detail=f"{what} of attempt {t['attempt_id']} span {t['span_id']}: "
                                 f"{size} bytes > {limit}")


def account_keys(account: dict) -> list[tuple[str, str]]:
    """The ``calls_by_agent`` keys a call account adds one to: (agent, trained | excluded)
    per call, ``(unresolved)`` for a call without an agent name."""
    return [(c["agent_name"] or "(unresolved)", "trained" if c["trained"] else "excluded") for c in account["calls"]]


@dataclass
class WorkerCounters:
    """The worker's counters (this process), read by ``/spanrl/counters/`` and ``/metrics``."""

    counters: Counter = field(default_factory=Counter)
    dead_reasons: Counter = field(default_factory=Counter)
    agent_counts: Counter = field(default_factory=Counter)  # (agent, trained | excluded) -> calls
    emitted_by: Counter = field(default_factory=Counter)  # emitted attempts by the rule that let them out
    reward_clock: worker_metrics.RewardToTransition = field(default_factory=worker_metrics.RewardToTransition)
    registry: Any = None
    reward_to_transition: Any = None

    def __post_init__(self) -> None:
        # /metrics: the counters above at scrape time, and reward consumed -> transition sent
        self.registry = prom.registry(
            lambda: worker_metrics.worker_families(self.counters, self.dead_reasons, self.agent_counts))
        self.reward_to_transition = prom.latency_histogram(
            self.registry, "spanrl_worker_reward_to_transition_seconds",
            "per attempt: its final reward consumed -> its first transition sent (queued in the transaction)")


@dataclass
class AppTopics:
    """The topics the agents write and the app's internal ones (named by its id)."""

    rollout_ticks: faust.TopicT
    task_ticks: faust.TopicT
    transitions: faust.TopicT
    samples: faust.TopicT
    dead: faust.TopicT
    accounts: faust.TopicT
    trace_links: faust.TopicT
    join_ticks: faust.TopicT
    #: the tick topics the timer writes: the join's only when the join runs
    ticks: list[faust.TopicT]

    @classmethod
    def declare(cls, app: faust.App, cfg: "StreamConfig") -> "AppTopics":
        """The app's topic objects for ``cfg`` (declaring nothing on the broker yet)."""
        # Timeouts: a timer cannot write tables or produce inside a transaction (no event),
        # so it produces tick records to internal topics, one per partition; the agents
        # handle a tick like any input, inside that partition's transaction.
        rollout_ticks = app.topic(f"{cfg.app_id}-rollout-ticks", **RAW)
        task_ticks = app.topic(f"{cfg.app_id}-group-ticks", **RAW)
        transitions = app.topic(cfg.transitions_topic, **RAW)
        samples = app.topic(cfg.samples_topic, **RAW)
        dead = app.topic(cfg.dead_letter_topic, **RAW)
        accounts = app.topic(cfg.call_accounts_topic, **RAW)
        # the trace join's repartition topic: proxy calls' (trace id -> rollout attempt), keyed by
        # trace id like orphan-spans; private to the app (named by its id) like the tick topics
        trace_links = app.topic(f"{cfg.app_id}-trace-links", **RAW)
        join_ticks = app.topic(f"{cfg.app_id}-join-ticks", **RAW)
        return cls(rollout_ticks, task_ticks, transitions, samples, dead, accounts, trace_links, join_ticks,
                   [rollout_ticks, task_ticks] + ([join_ticks] if cfg.join_traces else []))


@dataclass
class AppTables:
    """The changelogged tables, in the order they are made (their names give the changelog
    topics ``<app_id>-<name>-changelog``)."""

    rollouts: Any
    groups: Any
    traces: Any
    orphans: Any

    @classmethod
    def declare(cls, app: faust.App) -> "AppTables":
        """The four tables on ``app``: rollout states, group states, trace states (json), and
        the records of orphan spans waiting for a link (raw)."""
        # Faust serializes a table's changelog with the serializer it derives from the Table's
        # own key_type/value_type (bytes -> raw, else json), not with a Schema's serializers,
        # and decodes it on recovery with value_type: dict (not a faust.Record) fails there and
        # every changelog record was dropped, so value_type is None (json) or bytes (raw).
        rollout_partitions, task_partitions = topics.SPANS.partitions, topics.TRANSITIONS.partitions
        rollouts = app.Table("rollouts", partitions=rollout_partitions, default=None, key_type=str, value_type=None)
        groups = app.Table("groups", partitions=task_partitions, default=None, key_type=str, value_type=None)
        traces = app.Table("traces", partitions=rollout_partitions, default=None, key_type=str, value_type=None)
        orphans = app.Table("orphans", partitions=rollout_partitions, default=None, key_type=str, value_type=bytes)
        return cls(rollouts, groups, traces, orphans)


class Outputs:
    """The agents' writers: every record they produce goes through one of these, inside the
    transaction of the event being handled (faust_patches: the source partition's)."""

    def __init__(self, topics_: AppTopics, metrics: WorkerCounters):
        self.topics = topics_
        self.metrics = metrics

    async def send_dead(self, records: list[dict], message=None, payload: bytes | None = None) -> None:
        """Dead letters, with ``message``'s source position (and ``payload``) when given."""
        c = self.metrics
        for r in records:
            if message is not None:
                r = with_source(r, message, payload)
            key = r["rollout_id"].encode() if r.get("rollout_id") else None
            r, value = dead_letter_value(r)
            await self.topics.dead.send(key=key, value=value)
            c.counters["dead_letters_out"] += 1
            c.dead_reasons[r["reason"]] += 1

    async def send_accounts(self, records: list[dict]) -> None:
        """Call accounts (key rollout_id), counted per agent and trained | excluded."""
        c = self.metrics
        for r in records:
            await self.topics.accounts.send(key=r["rollout_id"].encode(), value=codec.encode("call_account", r))
            c.counters["call_accounts_out"] += 1
            for k in account_keys(r):
                c.agent_counts[k] += 1

    async def send_transitions(self, records: list[dict]) -> None:
        """Transitions (key task_id) in call order; one too large for its topic is dead-lettered."""
        c = self.metrics
        limit = topics.TRANSITIONS.max_message_bytes
        for t in records:  # in call order
            value = codec.encode("transition", t)
            if not claims.fits(len(value), limit):
                await self.send_dead([oversize(t, "transition", len(value), limit, now_ms())])
                continue
            await self.topics.transitions.send(key=t["task_id"].encode(), value=value)
            c.counters["transitions_out"] += 1
            waited = c.reward_clock.transition_sent(t["rollout_id"], t["attempt_id"], time.monotonic())
            if waited is not None:
                c.reward_to_transition.observe(waited)

    async def send_samples(self, records: list[dict]) -> None:
        """Samples (key task_id); one too large for its topic is dead-lettered."""
        limit = topics.SAMPLES.max_message_bytes
        for s in records:
            value = encode_sample(s)
            if not claims.fits(len(value), limit):
                await self.send_dead([oversize(s, "sample", len(value), limit, now_ms())])
                continue
            await self.topics.samples.send(key=s["transition"]["task_id"].encode(), value=value)
            self.metrics.counters["samples_out"] += 1

    async def emit(self, out: assembly.Outcome) -> None:
        """What one advance of a rollout state let out: transitions, dead letters, accounts."""
        self.metrics.emitted_by.update(out.emitted_by)
        await self.send_transitions(out.transitions)
        await self.send_dead(out.dead_letters)
        await self.send_accounts(out.accounts)


@dataclass
class AppContext:
    """Everything an agent unit may use: the app, its config, the pure modules' configs,
    topics, tables, counters and output writers. Built once by ``make_app``."""

    app: faust.App
    cfg: "StreamConfig"
    assembly_cfg: assembly.AssemblyConfig
    grouping_cfg: grouping.GroupingConfig
    join_cfg: joining.JoinConfig
    topics: AppTopics
    tables: AppTables
    metrics: WorkerCounters
    outputs: Outputs
    #: the S3 client claim-checked spans are resolved with (spanrl/core/claims.py)
    claim_client: Any = None
