"""The Faust app: plumbing around spanrl.stream_jobs.assembly and spanrl.stream_jobs.grouping.

    python -m spanrl.stream_jobs.app worker -l info

Agent ``assemble``: spans + rewards + rollouts (co-partitioned by rollout_id) ->
per-rollout state in a table -> transitions (key task_id).
Agent ``group``: transitions -> per-task group state in a table -> samples (key task_id).
Agent ``join``: orphan-spans (no rollout id) + trace links (key trace_id) -> per-trace state
in a table -> joined spans back into spans (key rollout_id) (stream_jobs/joining.py).
All -> dead-letter (key rollout_id). The calls' token data are held in the worker's memory
only (the state keeps each call's span position): when an attempt can end and this worker
lacks them (a parked attempt's late reward; a restart or a rebalance since its calls were
consumed), ``assemble`` re-reads those spans (stream_jobs/spans_reader.py) inside that
event's transaction. See stream_jobs/README.md.

Plumbing only: every decision is made by the pure functions.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import faust

from spanrl.core import claims
from spanrl.core import metrics as prom
from spanrl.core import dead_letters as dl
from spanrl.core.settings import Settings, StreamSettings, check_environment, get_settings
from spanrl.schemas import codec, topics
from spanrl.stream_jobs import assembly, faust_patches, grouping, joining
from spanrl.stream_jobs import metrics as worker_metrics
from spanrl.stream_jobs.air import parse_air_rules
from spanrl.stream_jobs.clock import TimeoutClock
from spanrl.stream_jobs.credit import parse_credit_rule
from spanrl.stream_jobs.spans_reader import SpansReader
from spanrl.stream_jobs.ticking import TickIndex
from spanrl.stream_jobs.waitlist import InputsWaitlist

log = logging.getLogger(__name__)


_S = StreamSettings.default
_HOST = Settings.default("host")


@dataclass(frozen=True)
class StreamConfig:
    """Everything the app reads from the environment: the stream job's section of the
    settings (:class:`spanrl.core.settings.StreamSettings`, README's settings table, which
    also gives each default) and the stack-wide addresses."""

    app_id: str = _S("stream_app_id")
    bootstrap: str = f"{_HOST}:{Settings.default('kafka_port')}"
    web_host: str = _HOST
    web_port: int = Settings.default("faust_web_port")
    spans_topic: str = _S("spans_topic")
    rewards_topic: str = _S("rewards_topic")
    rollouts_topic: str = _S("rollouts_topic")
    transitions_topic: str = _S("transitions_topic")
    samples_topic: str = _S("samples_topic")
    dead_letter_topic: str = _S("dead_letter_topic")
    call_accounts_topic: str = _S("call_accounts_topic")
    orphan_spans_topic: str = _S("orphan_spans_topic")
    #: join spans without a rollout id to the rollout of a proxy call of their trace
    #: (``SPANRL_STREAM_JOIN_TRACES``; a replay turns it off: what joined is on spans already)
    join_traces: bool = _S("stream_join_traces")
    orphan_timeout_s: float = _S("orphan_timeout_s")
    credit_rule: str = _S("credit_rule")
    #: AIR: intermediate rewards from span facts (``SPANRL_AIR_RULES``, stream_jobs/air.py; "": none)
    air_rules: str = _S("air_rules")
    #: whose calls train (``SPANRL_TRAIN_AGENTS``: names, or ``re:EXPR``; None: every call)
    train_agents: assembly.AgentSelector | None = None
    reward_timeout_s: float = _S("reward_timeout_s")
    #: late rewards: a parked attempt takes its final reward this long after its end
    reward_window_s: float = _S("reward_window_s")
    group_timeout_s: float = _S("group_timeout_s")
    rollout_timeout_s: float = _S("rollout_timeout_s")
    settle_s: float = _S("settle_s")
    #: a production rollout (no runner) ends after this long without input (assembly.production_end)
    production_idle_s: float = _S("production_idle_s")
    retain_s: float = _S("stream_retain_s")
    tick_s: float = _S("stream_tick_s")
    commit_interval_s: float = _S("stream_commit_interval_s")
    linger_s: float = _S("stream_linger_s")
    payload_bucket: str = Settings.default("payload_bucket")
    claim_retry_s: float = _S("claim_retry_s")
    #: replication factor of the topics Faust creates (changelogs, tick and trace-link topics);
    #: ``SPANRL_STREAM_REPLICATION_FACTOR``, 3 on a 3-broker cluster (infra/deploy/)
    replication_factor: int = _S("stream_replication_factor")
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "StreamConfig":
        """The config from ``env`` (a mapping of ``SPANRL_*`` names; default: the process
        environment) and the process's stack-wide settings."""
        st = StreamSettings.from_environ(env)
        s = get_settings()
        return cls(
            app_id=st.stream_app_id,
            bootstrap=s.kafka_bootstrap,
            web_host=s.host,
            web_port=s.faust_web_port,
            spans_topic=st.spans_topic,
            rewards_topic=st.rewards_topic,
            rollouts_topic=st.rollouts_topic,
            transitions_topic=st.transitions_topic,
            samples_topic=st.samples_topic,
            dead_letter_topic=st.dead_letter_topic,
            call_accounts_topic=st.call_accounts_topic,
            orphan_spans_topic=st.orphan_spans_topic,
            join_traces=st.stream_join_traces,
            orphan_timeout_s=st.orphan_timeout_s,
            credit_rule=st.credit_rule,
            air_rules=st.air_rules,
            train_agents=assembly.parse_train_agents(st.train_agents),
            reward_timeout_s=st.reward_timeout_s,
            reward_window_s=st.reward_window_s,
            group_timeout_s=st.group_timeout_s,
            rollout_timeout_s=st.rollout_timeout_s,
            settle_s=st.settle_s,
            production_idle_s=st.production_idle_s,
            retain_s=st.stream_retain_s,
            tick_s=st.stream_tick_s,
            commit_interval_s=st.stream_commit_interval_s,
            linger_s=st.stream_linger_s,
            payload_bucket=s.payload_bucket,
            claim_retry_s=st.claim_retry_s,
            replication_factor=st.stream_replication_factor,
        )


def _now_ms() -> int:
    return int(time.time() * 1000)


class StoredTransition(Mapping):
    """A waiting transition as the grouper's store holds it: its Avro record (``record``,
    schemas/avro/transition.v2.avsc: ~2.4 KB for 512 + 128 tokens, where the decoded dict
    takes ~10x that in memory) and its fields other than the token arrays; the arrays are
    decoded only if something reads them. The grouper reads ids, counts and returns; a
    sample is then encoded around ``record`` (codec.encode_around) and a dead letter carries
    it as its payload, so the arrays are never decoded again."""

    ARRAYS = frozenset({"prompt_token_ids", "completion_token_ids", "behaviour_logprobs"})
    __slots__ = ("record", "_small", "_full")

    def __init__(self, record: bytes, transition: dict):
        self.record = record
        self._small = {k: v for k, v in transition.items() if k not in self.ARRAYS}
        self._full: dict | None = None

    def _decoded(self) -> dict:
        if self._full is None:
            self._full = codec.decode("transition", self.record)
        return self._full

    def __getitem__(self, key: str):
        return self._small[key] if key in self._small else self._decoded()[key]

    def __iter__(self):
        return iter(self._decoded())

    def __len__(self) -> int:
        return len(self._decoded())


class TransitionStore(MutableMapping):
    """The grouper's store of waiting transitions (stream_jobs/grouping.py): key ->
    :class:`StoredTransition`, in memory."""

    def __init__(self):
        self.records: dict[str, StoredTransition] = {}
        self._source: tuple[dict, bytes] | None = None

    def put_record(self, key: str, value: bytes, transition: dict) -> None:
        """Hold ``transition``, decoded from the record ``value`` (re-read after a restart)."""
        self.records[key] = StoredTransition(value, transition)

    def decoded_from(self, transition: dict | None, value: bytes) -> dict | None:
        """Note that ``transition`` was decoded from the record ``value``: stored, it keeps
        those bytes instead of being encoded again. Returns ``transition``."""
        self._source = (transition, value)
        return transition

    def __getitem__(self, key: str) -> StoredTransition:
        return self.records[key]

    def __setitem__(self, key: str, transition: Mapping) -> None:
        if isinstance(transition, StoredTransition):
            self.records[key] = transition
            return
        src = self._source
        value = src[1] if src is not None and src[0] is transition else codec.encode("transition", dict(transition))
        self.records[key] = StoredTransition(value, transition)

    def __delitem__(self, key: str) -> None:
        del self.records[key]

    def __contains__(self, key) -> bool:
        return key in self.records

    def __iter__(self):
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)


def encode_sample(sample: dict) -> bytes:
    """A sample dict (grouping's) as its record: around the stored transition's record when
    it has one of the version the sample embeds (codec.encode_around: no decode/encode of
    its token arrays), else :func:`codec.encode` of the decoded transition."""
    tr = sample["transition"]
    if isinstance(tr, StoredTransition):
        value = codec.encode_around("sample", {k: v for k, v in sample.items() if k != "transition"},
                                    "transition", tr.record)
        if value is not None:
            return value
        tr = dict(tr)
    return codec.encode("sample", {**sample, "transition": tr})


#: largest record any spanrl topic takes; Faust's producer refuses larger requests
#: (its default, 1 MB, is below the topics' limit)
MAX_RECORD_BYTES = max(t.max_message_bytes for t in topics.ALL)


def max_call_bytes() -> int:
    """Largest call store value (assembly.encode_call) whose transition, and sample,
    still fit their topics with ``claims.CLAIM_MARGIN_BYTES`` to spare (ids and strings)."""
    return min(topics.TRANSITIONS.max_message_bytes, topics.SAMPLES.max_message_bytes) - claims.CLAIM_MARGIN_BYTES


class QuietWorker(faust.Worker):
    """The Faust worker the app runs (``Worker`` setting), without its terminal spinner.

    Faust gotcha (faust-streaming 0.15, ``faust.worker.Worker.on_setup_root_logger``): at a
    log level of WARN or above the worker keeps a progress spinner and, so that it turns on
    every log record, adds a DEBUG handler and sets the *root logger* to DEBUG. Every
    ``log.debug`` of aiokafka and Faust (several per record produced: "send: topic=...",
    "Sending (key=... value=...)") then builds a LogRecord and walks the stack for its
    caller, only for the handlers to drop it: 4.7 % of the worker's CPU in the sustained
    benchmark (issue 11; the bench ran ``-l warn``). The spinner is dropped; the root logger
    keeps the level asked for. Upstream report (not filed from here): "Worker sets the root
    logger to DEBUG when loglevel >= WARN to drive the spinner, so every debug call in the
    process pays for a LogRecord; the spinner should use a filter or a level-aware handler,
    or be off when stdout is not a TTY."
    """

    def on_setup_root_logger(self, logger, level: int) -> None:
        self.spinner = None
        super().on_setup_root_logger(logger, level)


def make_app(config: StreamConfig | None = None) -> faust.App:
    """Build the stream app for ``config`` (default: from the environment)."""
    cfg = config or StreamConfig.from_env()
    faust_patches.install()
    app = faust.App(
        cfg.app_id,
        broker="kafka://" + cfg.bootstrap,
        processing_guarantee="exactly_once",
        store="memory://",  # state recovers from the changelog topics
        web_host=cfg.web_host,
        web_bind=cfg.web_host,  # Faust binds 0.0.0.0 unless told; everything stays on loopback
        web_port=cfg.web_port,
        topic_allow_declare=True,  # Faust declares only its internal topics (changelogs, ticks)
        topic_disable_leader=True,
        # exactly-once: outputs become visible to read_committed readers only when the
        # transaction commits, every broker_commit_interval (Faust default 2.8 s); the
        # bench profile showed this wait, not CPU, bounding reward -> transition latency
        broker_commit_interval=cfg.commit_interval_s,
        producer_max_request_size=MAX_RECORD_BYTES,
        # Faust sends every record as soon as it is queued (linger 0): one produce request
        # per changelog write/output. Batching them for 20 ms cut the worker's CPU per
        # run by ~20 % in the bench (BENCHMARKS.md); a commit waits for it at most once.
        producer_linger=cfg.linger_s,
        topic_replication_factor=cfg.replication_factor,
        Worker=QuietWorker,  # no spinner: it set the root logger to DEBUG (QuietWorker)
    )
    assembly_cfg = assembly.AssemblyConfig(
        credit_rule=parse_credit_rule(cfg.credit_rule).with_air(parse_air_rules(cfg.air_rules)), agents=cfg.train_agents,
        reward_timeout_s=cfg.reward_timeout_s, rollout_timeout_s=cfg.rollout_timeout_s,
        settle_s=cfg.settle_s, max_call_bytes=max_call_bytes(), production_idle_s=cfg.production_idle_s,
        reward_window_s=cfg.reward_window_s)
    grouping_cfg = grouping.GroupingConfig(group_timeout_s=cfg.group_timeout_s, late_join_s=cfg.reward_window_s)
    join_cfg = joining.JoinConfig(orphan_timeout_s=cfg.orphan_timeout_s, orphan_topic=cfg.orphan_spans_topic)
    rollout_partitions = topics.SPANS.partitions
    task_partitions = topics.TRANSITIONS.partitions
    counters: Counter = Counter()
    # ticks judge timeouts behind the wall clock while a backlog is read (stream_jobs/clock.py)
    rollout_clock, group_clock, join_clock = TimeoutClock(), TimeoutClock(), TimeoutClock()
    dead_reasons: Counter = Counter()
    agent_counts: Counter = Counter()  # (agent, trained | excluded) -> calls
    emitted_by: Counter = Counter()  # emitted attempts by the rule that let them out
    # /metrics: the counters above at scrape time, and reward consumed -> transition sent
    registry = prom.registry(lambda: worker_metrics.worker_families(counters, dead_reasons, agent_counts))
    reward_to_transition = prom.latency_histogram(
        registry, "spanrl_worker_reward_to_transition_seconds",
        "per attempt: its final reward consumed -> its first transition sent (queued in the transaction)")
    reward_clock = worker_metrics.RewardToTransition()

    raw = dict(key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
    # Timeouts: a timer cannot write tables or produce inside a transaction (no event),
    # so it produces tick records to internal topics, one per partition; the agents
    # handle a tick like any input, inside that partition's transaction.
    rollout_ticks = app.topic(f"{cfg.app_id}-rollout-ticks", **raw)
    task_ticks = app.topic(f"{cfg.app_id}-group-ticks", **raw)
    transitions_out = app.topic(cfg.transitions_topic, **raw)
    samples_out = app.topic(cfg.samples_topic, **raw)
    dead_out = app.topic(cfg.dead_letter_topic, **raw)
    accounts_out = app.topic(cfg.call_accounts_topic, **raw)
    # the trace join's repartition topic: proxy calls' (trace id -> rollout attempt), keyed by
    # trace id like orphan-spans; private to the app (named by its id) like the tick topics
    trace_links = app.topic(f"{cfg.app_id}-trace-links", **raw)
    join_ticks = app.topic(f"{cfg.app_id}-join-ticks", **raw)
    tick_topics = [rollout_ticks, task_ticks] + ([join_ticks] if cfg.join_traces else [])

    # Faust serializes a table's changelog with the serializer it derives from the Table's
    # own key_type/value_type (bytes -> raw, else json), not with a Schema's serializers,
    # and decodes it on recovery with value_type: dict (not a faust.Record) fails there and
    # every changelog record was dropped, so value_type is None (json) or bytes (raw).
    rollouts = app.Table("rollouts", partitions=rollout_partitions, default=None, key_type=str, value_type=None)
    # The calls' token data (assembly.encode_call bytes), per partition, in this worker's
    # memory only: no changelog. Each call in the rollout state keeps its span's position
    # (``at``), so a worker that recovers the state without the data (after a crash or a
    # rebalance) re-reads them from spans when the attempt can end (advance_rollout). Before,
    # a changelogged table held them: one 3 KB record per call and one tombstone, the
    # largest share of the worker's produce traffic (BENCHMARKS.md, issue 11).
    calls: dict[int, dict[str, bytes]] = {}

    def call_data(partition: int) -> dict[str, bytes]:
        return calls.setdefault(partition, {})

    groups = app.Table("groups", partitions=task_partitions, default=None, key_type=str, value_type=None)
    # The transitions waiting in open groups, per partition, in this worker's memory only (as
    # their Avro records, TransitionStore): the group state keeps each one's position on
    # transitions, and a worker that restores a state without them re-reads them (group agent).
    # Before, a changelogged table held them (a 2.4 KB record and a tombstone per transition).
    waiting_transitions: dict[int, TransitionStore] = {}

    def group_store(partition: int) -> "TransitionStore":
        store = waiting_transitions.get(partition)
        if store is None:
            store = waiting_transitions[partition] = TransitionStore()
        return store
    # trace join: state per trace id (json), and the records of orphans waiting for a link (raw)
    traces = app.Table("traces", partitions=rollout_partitions, default=None, key_type=str, value_type=None)
    orphans = app.Table("orphans", partitions=rollout_partitions, default=None, key_type=str, value_type=bytes)
    claim_client = claims.make_client()
    spans_reader = SpansReader(cfg.bootstrap, cfg.claim_retry_s, MAX_RECORD_BYTES)  # the assemble agent's
    transitions_reader = SpansReader(cfg.bootstrap, cfg.claim_retry_s, MAX_RECORD_BYTES)  # the group agent's

    async def send_dead(records: list[dict], message=None, payload: bytes | None = None) -> None:
        for r in records:
            if message is not None:
                r = {**r, "source_topic": message.topic, "source_partition": message.partition,
                     "source_offset": message.offset}
                if payload is not None and r.get("payload") is None:
                    r["payload"] = payload
            key = r["rollout_id"].encode() if r.get("rollout_id") else None
            value = codec.encode("dead_letter", r)
            if not claims.fits(len(value), topics.DEAD_LETTER.max_message_bytes):
                r = {**r, "payload": None,
                     "detail": f"{r['detail']} [payload of {len(r['payload'] or b'')} bytes left out: too large]"}
                value = codec.encode("dead_letter", r)
            await dead_out.send(key=key, value=value)
            counters["dead_letters_out"] += 1
            dead_reasons[r["reason"]] += 1

    def oversize(record: dict, what: str, size: int, limit: int) -> dict:
        # assembly.max_call_bytes keeps calls well below this; ids/strings of absurd length remain
        t = record.get("transition", record)
        return dl.dead_letter(dl.OVERSIZE, dl.ASSEMBLER if what == "transition" else dl.GROUPER, _now_ms(),
                              rollout_id=t["rollout_id"], task_id=t["task_id"],
                              detail=f"{what} of attempt {t['attempt_id']} span {t['span_id']}: "
                                     f"{size} bytes > {limit}")

    async def send_accounts(records: list[dict]) -> None:
        for r in records:
            await accounts_out.send(key=r["rollout_id"].encode(), value=codec.encode("call_account", r))
            counters["call_accounts_out"] += 1
            for c in r["calls"]:
                agent_counts[(c["agent_name"] or "(unresolved)", "trained" if c["trained"] else "excluded")] += 1

    async def send_transitions(records: list[dict]) -> None:
        limit = topics.TRANSITIONS.max_message_bytes
        for t in records:  # in call order
            value = codec.encode("transition", t)
            if not claims.fits(len(value), limit):
                await send_dead([oversize(t, "transition", len(value), limit)])
                continue
            await transitions_out.send(key=t["task_id"].encode(), value=value)
            counters["transitions_out"] += 1
            waited = reward_clock.transition_sent(t["rollout_id"], t["attempt_id"], time.monotonic())
            if waited is not None:
                reward_to_transition.observe(waited)

    async def send_samples(records: list[dict]) -> None:
        limit = topics.SAMPLES.max_message_bytes
        for s in records:
            value = encode_sample(s)
            if not claims.fits(len(value), limit):
                await send_dead([oversize(s, "sample", len(value), limit)])
                continue
            await samples_out.send(key=s["transition"]["task_id"].encode(), value=value)
            counters["samples_out"] += 1

    async def claimed(record: dict, msg) -> dict | None:
        """The span behind a claim record (``payload_ref``, spanrl/core/claims.py), or None
        after dead-lettering ``claim_unresolved``."""
        try:
            data = await claims.resolve_claim(claim_client, record["payload_ref"], cfg.payload_bucket,
                                              cfg.claim_retry_s)
            return claims.check_claimed(record, codec.decode("span", data))
        except (claims.ClaimError, codec.SchemaError) as exc:
            await send_dead([dl.dead_letter(dl.CLAIM_UNRESOLVED, dl.ASSEMBLER, _now_ms(), detail=str(exc),
                                            rollout_id=record["rollout_id"])], msg, msg.value)
            return None

    async def reread_span(rid: str, aid: str, sid: str, value: bytes | None) -> bytes | None:
        """The store value of a parked call from its re-read span record (claim resolved
        again), or None (the attempt then ends ``late_spans_missing``)."""
        if value is None:
            return None
        try:
            span = codec.decode("span", value)
            if span.get("payload_ref"):
                data = await claims.resolve_claim(claim_client, span["payload_ref"], cfg.payload_bucket,
                                                  cfg.claim_retry_s)
                span = claims.check_claimed(span, codec.decode("span", data))
        except (claims.ClaimError, codec.SchemaError) as exc:
            log.warning("spanrl: re-read span %s of %s/%s: %s", sid, rid, aid, exc)
            return None
        return assembly.restore_call(rid, aid, sid, span)

    async def advance_rollout(state: dict, now: int, pos: dict[str, int] | None) -> assembly.Outcome:
        """assembly.advance (``pos``: the partition's positions, the emission rule). An attempt
        that could end now but whose calls' token data are not in this worker's memory (a
        parked attempt whose late reward came; calls handled by a worker that stopped, or
        before a rebalance) first gets them re-read from spans, inside this event's
        transaction: what it emits commits with the event."""
        store = call_data(state["partition"])
        parked = state_parked(state)
        wanted = assembly.missing_reads(state, store, assembly_cfg)
        if wanted:
            rid, n = state["rollout_id"], 0
            records = await spans_reader.read([tuple(at) for reads in wanted.values() for _, at in reads])
            for aid, reads in wanted.items():
                for sid, at in reads:
                    value = await reread_span(rid, aid, sid, records.get(tuple(at)))
                    if value is not None:
                        store[assembly.store_key(rid, aid, sid)] = value
                        n += 1
            counters["spans_reread"] += n
        out = assembly.advance(state, store, assembly_cfg, now, pos)
        counters["attempts_parked"] += max(0, state_parked(state) - parked)
        counters["late_rewards_emitted"] += len({t["attempt_id"] for t in out.transitions if t["late_reward"]})
        return out

    kinds = {cfg.spans_topic: ("span", "spans_in"), cfg.rewards_topic: ("reward", "rewards_in"),
             cfg.rollouts_topic: ("rollout", "rollout_events_in")}
    roles = {cfg.spans_topic: "spans", cfg.rewards_topic: "rewards", cfg.rollouts_topic: "rollouts"}
    # The emission rule (assembly.inputs_consumed), in memory only: per partition the next
    # offset to process of each input topic (one past the last record handled), and the
    # rollouts whose attempts wait for those positions to pass their inputs bound (a heap per
    # role, stream_jobs/waitlist.py: O(1) per record instead of a scan of every waiting
    # rollout). After a rebalance both start empty; attempts then fall back to the settle_s grace.
    positions: dict[int, dict[str, int]] = {}
    waiting: dict[int, InputsWaitlist] = {}
    plain: dict[str, Any] = {}  # non-transactional clients, made on first use
    rollout_index = TickIndex()  # the rollout states a tick visits (stream_jobs/ticking.py)

    def rollout_expiry(state: dict) -> int | None:
        """The state's next tick time (assembly.tick_due). ``NEVER`` (an attempt's inputs bound
        is known not to be passed yet) takes it off every tick, so it is put on the waitlist
        here, whichever path computed it (a record, a tick, the index's rebuild after a
        restart): the waitlist hands it back the moment the positions no longer hold it."""
        p = state["partition"]
        due = assembly.tick_due(state, assembly_cfg, cfg.retain_s, positions.get(p))
        if due == TickIndex.NEVER:
            note_waiting(p, state["rollout_id"], state)
        return due

    group_index = TickIndex()  # the task states a tick visits: at their groups' time-outs (grouping.tick_due)

    def group_expiry(state: dict) -> int | None:
        return grouping.tick_due(state, grouping_cfg)

    def put_group(tid: str, state: dict) -> None:
        groups[tid] = state
        group_index.note(state["partition"], tid, group_expiry(state))

    def put_rollout(rid: str, state: dict) -> None:
        rollouts[rid] = state
        rollout_index.note(state["partition"], rid, rollout_expiry(state))

    async def inputs_bound(partition: int) -> dict[str, int]:
        """End offsets (high watermarks) of the spans and rewards partitions ``partition``,
        read now: a bound on every input of an attempt whose terminal event, sent after
        those inputs were acknowledged, has just been consumed."""
        from aiokafka import AIOKafkaConsumer
        from aiokafka.structs import TopicPartition

        reader = plain.get("offsets")
        if reader is None:
            reader = plain["offsets"] = AIOKafkaConsumer(bootstrap_servers=cfg.bootstrap, enable_auto_commit=False)
            await reader.start()
        tps = {"spans": TopicPartition(cfg.spans_topic, partition),
               "rewards": TopicPartition(cfg.rewards_topic, partition)}
        ends = await reader.end_offsets(list(tps.values()))
        counters["inputs_bounds_read"] += 1
        return {role: int(ends[tp]) for role, tp in tps.items()}

    async def emit(out: assembly.Outcome) -> None:
        emitted_by.update(out.emitted_by)
        await send_transitions(out.transitions)
        await send_dead(out.dead_letters)
        await send_accounts(out.accounts)

    def note_waiting(partition: int, rid: str, state: dict) -> None:
        """Called right after ``state`` was advanced with its partition's positions: it waits
        while a known position is behind its attempts' inputs bound (the rule says False);
        otherwise that advance has seen what the rule can tell (what it still lacks, e.g. its
        reward, is an input of its own; an unknown position leaves it to the settle fallback)."""
        need = assembly.awaiting_inputs(state)
        if need is not None or partition in waiting:
            waiting.setdefault(partition, InputsWaitlist()).note(rid, need, positions.get(partition))

    async def release_waiting(partition: int, now: int) -> None:
        """Advance the rollouts of ``partition`` whose inputs bound the positions now pass."""
        pos = positions.get(partition, {})
        for rid in waiting[partition].ready(pos):
            state = rollouts.get(rid)
            if state is None:
                continue
            out = await advance_rollout(state, now, pos)
            # re-indexed also when unchanged: the index had it as NEVER, and the positions
            # that let it out may leave it to the settle fallback (a tick) instead
            if out.changed:
                put_rollout(rid, state)
            else:
                rollout_index.note(partition, rid, rollout_expiry(state))
            note_waiting(partition, rid, state)
            await emit(out)

    # internal=True: Faust declares (creates if missing) these topics with `partitions`
    # before subscribing - that is how the tick topic gets the inputs' partition count
    # (a consumer's metadata request would auto-create it with the broker default).
    # The input topics themselves already exist (infra creates them).
    @app.agent(app.topic(cfg.spans_topic, cfg.rewards_topic, cfg.rollouts_topic,
                         rollout_ticks.get_topic_name(), internal=True,
                         partitions=rollout_partitions, **raw))
    async def assemble(stream):
        async for event in stream.events():
            msg = event.message
            now = _now_ms()
            if await _ticked(msg, now, rollout_ticks, rollout_clock, rollouts, _tick_rollout,
                             rollout_index, rollout_expiry):
                continue
            record_type, counter = kinds[msg.topic]
            counters[counter] += 1
            # handled from here on, also when it is dead-lettered below
            positions.setdefault(msg.partition, {})[roles[msg.topic]] = msg.offset + 1
            try:
                record = codec.decode(record_type, msg.value)
            except codec.SchemaError as exc:
                await send_dead([dl.dead_letter(
                    exc.reason, dl.ASSEMBLER, now, detail=exc.detail,
                    rollout_id=_key_text(msg.key))], msg, msg.value)
                continue
            rid = record["rollout_id"]
            if record_type == "span" and record.get("payload_ref") and record.get("kind") == "llm":
                record = await claimed(record, msg)  # only llm calls can be training data
                if record is None:
                    continue
                now = _now_ms()
            state = rollouts.get(rid) or assembly.new_state(rid, msg.partition)
            p = msg.partition
            if record_type == "span" and cfg.join_traces:
                link = joining.trace_link(record, now)
                if link is not None:  # re-keyed by trace id for the join agent
                    await trace_links.send(key=link["trace_id"].encode(), value=codec.encode("trace_link", link))
                    counters["trace_links_out"] += 1
            if record_type == "span":
                out = assembly.add_span(state, record, call_data(p), assembly_cfg, now,
                                        at=(msg.topic, msg.partition, msg.offset))
            elif record_type == "reward":
                if record.get("final", True):  # for the reward -> transition histogram (/metrics)
                    reward_clock.reward_consumed(rid, record["attempt_id"], time.monotonic())
                out = assembly.add_reward(state, record, now)
            else:
                bound = await inputs_bound(p) if assembly.wants_inputs_bound(state, record) else None
                out = assembly.add_rollout_event(state, record, now, bound)
            pos = positions[p]
            input_dead, changed = out.dead_letters, out.changed
            out = await advance_rollout(state, now, pos)
            if changed or out.changed:  # a table write is a changelog record
                put_rollout(rid, state)
            note_waiting(p, rid, state)
            await send_dead(input_dead, msg, msg.value)
            await emit(out)
            if waiting.get(p):
                await release_waiting(p, now)

    async def _tick_rollout(rid: str, state: dict, now: int) -> None:
        if assembly.expired(state, now, cfg.retain_s):
            del rollouts[rid]
            rollout_index.drop(state["partition"], rid)
            return
        p = state.get("partition")
        out = await advance_rollout(state, now, positions.get(p))
        if out.changed:
            put_rollout(rid, state)
            note_waiting(p, rid, state)
            await emit(out)
        else:  # the visit took it off the index's due list: back on it at its next due time
            rollout_index.note(p, rid, rollout_expiry(state))

    async def reread_transitions(state: dict) -> "TransitionStore":
        """The state's partition's transition store, with every waiting transition of
        ``state`` this worker does not hold re-read from the transitions topic (after a restart
        or rebalance; a transition that cannot be read back stays missing: grouping
        dead-letters its attempt ``transitions_missing``)."""
        store = group_store(state["partition"])
        wanted = grouping.missing_reads(state, store)
        if wanted:
            records = await transitions_reader.read([tuple(at) for _, at in wanted])
            for key, at in wanted:
                value = records.get(tuple(at))
                try:
                    tr = grouping.restore_transition(key, codec.decode("transition", value)) if value else None
                except codec.SchemaError:
                    tr = None
                if tr is not None:
                    store.put_record(key, value, tr)
                    counters["transitions_reread"] += 1
        return store

    async def _tick_group(tid: str, state: dict, now: int) -> None:
        out = grouping.advance(state, await reread_transitions(state), grouping_cfg, now)
        if out.samples or out.dead_letters:
            put_group(tid, state)
            await send_samples(out.samples)
            await send_dead(out.dead_letters)
        else:  # the visit took it off the index's due list: back on it at its next due time
            group_index.note(state["partition"], tid, group_expiry(state))

    @app.agent(app.topic(cfg.transitions_topic, task_ticks.get_topic_name(), internal=True,
                         partitions=task_partitions, **raw))
    async def group(stream):
        async for event in stream.events():
            msg = event.message
            now = _now_ms()
            if await _ticked(msg, now, task_ticks, group_clock, groups, _tick_group, group_index, group_expiry):
                continue
            try:
                tr = codec.decode("transition", msg.value)
            except codec.SchemaError as exc:
                await send_dead([dl.dead_letter(exc.reason, dl.GROUPER, now, detail=exc.detail)],
                                msg, msg.value)
                continue
            state = groups.get(tr["task_id"]) or grouping.new_state(tr["task_id"], msg.partition)
            store = await reread_transitions(state)
            out = grouping.add_transition(state, store.decoded_from(tr, msg.value), store, grouping_cfg, now,
                                          at=(msg.topic, msg.partition, msg.offset))
            store.decoded_from(None, b"")
            put_group(tr["task_id"], state)
            await send_samples(out.samples)
            await send_dead(out.dead_letters)

    async def send_joined(records: list[dict]) -> None:
        """Joined spans go back to ``spans`` with a plain (non-transactional) idempotent
        producer, acknowledged before the orphan's offset can commit: ``spans`` then holds no
        transaction markers, so its offsets are contiguous records, which the emission rule
        (assembly.inputs_consumed) counts on. At least once: after a crash the join may send
        a span again; the assembler counts a span id once."""
        from aiokafka import AIOKafkaProducer

        producer = plain.get("joined")
        if producer is None:
            producer = plain["joined"] = AIOKafkaProducer(
                bootstrap_servers=cfg.bootstrap, enable_idempotence=True, acks="all",
                max_request_size=MAX_RECORD_BYTES)
            await producer.start()
        acks = [await producer.send(cfg.spans_topic, codec.encode("span", sp), key=sp["rollout_id"].encode())
                for sp in records]
        await asyncio.gather(*acks)  # all acknowledged before the orphans' offsets can commit
        counters["spans_joined"] += len(records)

    async def _tick_trace(tid: str, state: dict, now: int) -> None:
        if joining.expired(state, now, cfg.retain_s):
            del traces[tid]
            return
        out = joining.advance(state, orphans, join_cfg, now)
        if out.changed:
            traces[tid] = state
            await send_dead(out.dead_letters)

    async def join(stream):
        async for event in stream.events():
            msg = event.message
            now = _now_ms()
            if await _ticked(msg, now, join_ticks, join_clock, traces, _tick_trace):
                continue
            is_orphan = msg.topic == cfg.orphan_spans_topic
            counters["orphans_in" if is_orphan else "trace_links_in"] += 1
            try:
                record = codec.decode("span" if is_orphan else "trace_link", msg.value)
            except codec.SchemaError as exc:
                await send_dead([dl.dead_letter(exc.reason, dl.JOINER, now, detail=exc.detail)], msg, msg.value)
                continue
            tid = record["trace_id"]
            state = traces.get(tid) or joining.new_state(tid, msg.partition)
            if is_orphan:
                out = joining.add_orphan(state, record, msg.value, msg.offset, orphans, now)
            else:
                out = joining.add_link(state, record, orphans, now)
            if out.changed:
                traces[tid] = state
            await send_joined(out.spans)

    if cfg.join_traces:  # co-partitioned by trace id; the tick topic gets their partition count
        app.agent(app.topic(cfg.orphan_spans_topic, trace_links.get_topic_name(), join_ticks.get_topic_name(),
                            internal=True, partitions=rollout_partitions, **raw))(join)

    ticker: dict[str, Any] = {}

    @app.timer(interval=cfg.tick_s)
    async def tick() -> None:
        # A plain (non-transactional) producer: a tick is visible at once to the
        # read_committed consumer, and a duplicated tick is harmless.
        from aiokafka import AIOKafkaProducer

        try:
            producer = ticker.get("producer")
            if producer is None:
                producer = AIOKafkaProducer(bootstrap_servers=cfg.bootstrap)
                await producer.start()
                ticker["producer"] = producer
            for name in (t.get_topic_name() for t in tick_topics):
                for p in sorted(await producer.partitions_for(name)):
                    await producer.send(name, b"", partition=p)
        except Exception:  # a missed tick only delays timeouts; never crash the worker
            log.exception("spanrl: tick failed")

    @app.on_before_shutdown.connect
    async def _stop_ticker(app, **kwargs) -> None:
        for client in [ticker.pop("producer", None), plain.pop("joined", None), plain.pop("offsets", None)]:
            if client is not None:
                await client.stop()

    @app.on_partitions_revoked.connect
    async def _forget_positions(app, revoked, **kwargs) -> None:
        # another worker may handle these partitions now; when they come back, their
        # positions are learnt again from the records handled (until then: settle_s)
        for tp in revoked:
            positions.pop(tp.partition, None)
            waiting.pop(tp.partition, None)
            calls.pop(tp.partition, None)  # the next owner re-reads what it needs from spans
            waiting_transitions.pop(tp.partition, None)  # ... and from transitions
            rollout_index.forget(tp.partition)
            group_index.forget(tp.partition)
        await spans_reader.stop()
        await transitions_reader.stop()

    @app.page("/spanrl/counters/")
    async def counters_view(web, request):
        return web.json({
            "spans_in": counters["spans_in"], "rewards_in": counters["rewards_in"],
            "rollout_events_in": counters["rollout_events_in"],
            "transitions_out": counters["transitions_out"], "samples_out": counters["samples_out"],
            "dead_letters_out": dict(dead_reasons),
            "call_accounts_out": counters["call_accounts_out"],
            "calls_by_agent": {f"{agent}|{how}": n for (agent, how), n in sorted(agent_counts.items())},
            "trace_links_out": counters["trace_links_out"], "trace_links_in": counters["trace_links_in"],
            "orphans_in": counters["orphans_in"], "spans_joined": counters["spans_joined"],
            "inputs_bounds_read": counters["inputs_bounds_read"], "emitted_by": dict(emitted_by),
            # late rewards: attempts parked (this process), parked calls re-read, late emissions,
            # and the call store's size now (what the worker holds in memory of token data)
            "attempts_parked": counters["attempts_parked"], "spans_reread": counters["spans_reread"],
            "late_rewards_emitted": counters["late_rewards_emitted"], "calls_held": sum(map(len, calls.values())),
            "transitions_held": sum(map(len, waiting_transitions.values())),
            "transitions_reread": counters["transitions_reread"],
        })

    @app.page("/spanrl/held/")
    async def held_view(web, request):
        """What this worker holds, per partition: the emission rule's positions, rollouts
        waiting for them, the tick index (live keys, finished keys due), calls' token data.
        ``?rollout=<id>``: that rollout's state and where the worker has it (chaos forensics:
        an attempt that never left)."""
        parts = sorted(set(positions) | set(waiting) | set(calls))
        out: dict[str, Any] = {"partitions": {str(p): {
            "positions": positions.get(p), "waiting": len(waiting.get(p, ())),
            "index_scanned": rollout_index.scanned(p),
            **dict(zip(("index_live", "index_due"), rollout_index.size(p))), "calls_held": len(calls.get(p, ())),
        } for p in parts}}
        rid = request.query.get("rollout")
        if rid:
            state = rollouts.get(rid)
            out["rollout"] = None if state is None else {
                "partition": state["partition"],
                "attempts": {aid: {k: a.get(k) for k in ("status", "done", "ready_ms", "ended_ms", "parked_ms",
                                                         "inputs_bound", "last_ms")}
                             | {"calls": len(a["calls"]), "rewards": len(a["rewards"])}
                             for aid, a in state["attempts"].items()},
                "awaiting_inputs": assembly.awaiting_inputs(state),
                "waiting": rid in waiting.get(state["partition"], ()),
                "index_live": rid in rollout_index._live.get(state["partition"], ()),
                "index_due_at": rollout_index._due.get(state["partition"], {}).get(rid),
                "tick_due": rollout_expiry(state),
            }
        return web.json(out)

    @app.page("/metrics")
    async def metrics_view(web, request):
        """The counters above and the reward -> transition histogram, Prometheus text format."""
        return web.bytes(prom.exposition(registry), headers={"Content-Type": prom.CONTENT_TYPE})

    @app.page("/spanrl/health/")
    async def health_view(web, request):
        """200 once the worker processes records: partitions assigned, not rebalancing,
        table recovery done (Faust's web server answers long before that); 503 until then."""
        assigned = len(app.consumer.assignment()) if app.consumer is not None else 0
        ready = bool(assigned) and not app.rebalancing and not app.in_recovery \
            and app.tables.recovery.completed.is_set()
        return web.json({"ok": ready, "app_id": cfg.app_id, "assigned_partitions": assigned,
                         "rebalancing": bool(app.rebalancing), "in_recovery": bool(app.in_recovery)},
                        status=200 if ready else 503)

    app.spanrl_config = cfg  # for introspection in tests
    return app


async def _ticked(msg, now: int, ticks, clock: TimeoutClock, table, handle,
                  index: TickIndex | None = None, expires_at=None) -> bool:
    """Whether ``msg`` is a record of the tick topic ``ticks``. A tick on partition p is
    judged at ``clock``'s time for p (None: skipped) and ``await handle(key, state, time)``
    runs for every state of ``table`` that lives on p (its changelog writes belong to p's
    transaction) - with an ``index`` (stream_jobs/ticking.py), only for its live states and
    those due to expire (``expires_at(state)``); any other record is an input, noted by
    ``clock``."""
    if msg.topic != ticks.get_topic_name():
        clock.saw_input(msg.partition, now, _record_ms(msg))
        return False
    p = msg.partition
    tick_now = clock.tick_now(p, now)
    if tick_now is None:
        return True
    if index is None:
        keys = list(table.keys())
    else:
        if not index.scanned(p):
            index.rebuild(p, ((k, s) for k, s in ((k, table.get(k)) for k in list(table.keys()))
                              if s is not None and s.get("partition") == p), expires_at)
        keys = index.visit(p, tick_now)
    for key in keys:
        state = table.get(key)
        if state is None:
            if index is not None:
                index.drop(p, key)
        elif state.get("partition") == p:
            await handle(key, state, tick_now)
    return True


def state_parked(state: dict) -> int:
    """Parked, unfinished attempts of one rollout state (assembly's ``parked_ms``)."""
    return sum(1 for a in state["attempts"].values() if a["done"] is None and a.get("parked_ms") is not None)


def _record_ms(msg) -> int | None:
    """A Kafka record's timestamp in ms (Faust gives seconds as a float), None if unset."""
    return int(msg.timestamp * 1000) if msg.timestamp else None


def _key_text(key: bytes | None) -> str | None:
    try:
        return key.decode() if key else None
    except UnicodeDecodeError:
        return None


if __name__ == "__main__":
    check_environment()  # before the app reads its settings: a misspelt SPANRL_* stops the worker here
app = make_app()

if __name__ == "__main__":
    app.main()
