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

Plumbing only: every decision is made by the pure functions. :func:`make_app` composes
units that each read alone, all given one :class:`~spanrl.stream_jobs.app_context.AppContext`
(app, config, topics, tables, counters, output writers): agent_assemble.py (``assemble``),
agent_group.py (``group``), agent_join.py (``join``), app_ticks.py (the tick timer and how
a tick is handled), app_web.py (the pages); the patches of Faust's internals are in
faust_patches.py.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import faust
from mode.utils.objects import canonshortname

from spanrl.core.settings import Settings, StreamSettings, check_environment, get_settings
from spanrl.core import claims, schema_registry
from spanrl.schemas import topics
from spanrl.stream_jobs import assembly, faust_patches, grouping, joining
from spanrl.stream_jobs.agent_assemble import Assembler, state_parked
from spanrl.stream_jobs.agent_group import Grouper
from spanrl.stream_jobs.agent_join import Joiner
from spanrl.stream_jobs.air import parse_air_rules
from spanrl.stream_jobs.app_context import (MAX_RECORD_BYTES, RAW, AppContext, AppTables, AppTopics, Outputs,
                                            WorkerCounters, max_call_bytes)
from spanrl.stream_jobs.app_ticks import Ticker
from spanrl.stream_jobs.app_web import WebViews
from spanrl.stream_jobs.credit import parse_credit_rule
from spanrl.stream_jobs.transition_store import StoredTransition, TransitionStore, encode_sample

#: what other code and tests import from here (moved to the agent units' modules)
__all__ = ["MAX_RECORD_BYTES", "QuietWorker", "StoredTransition", "StreamConfig", "TransitionStore", "encode_sample",
           "make_app", "make_context", "max_call_bytes", "state_parked"]


_S = StreamSettings.default
_HOST = Settings.default("host")


@dataclass(frozen=True)
class StreamConfig:
    """Everything the app reads from the environment: the stream job's section of the
    settings (:class:`spanrl.core.settings.StreamSettings`; docs/reference/settings.md gives
    each default) and the stack-wide addresses."""

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
    #: finished states kept per partition of each table (stream_jobs/ticking.py FinishedStates)
    retain_max: int = _S("stream_retain_max")
    tick_s: float = _S("stream_tick_s")
    commit_interval_s: float = _S("stream_commit_interval_s")
    session_timeout_s: float = _S("stream_session_timeout_s")
    linger_s: float = _S("stream_linger_s")
    payload_bucket: str = Settings.default("payload_bucket")
    claim_retry_s: float = _S("claim_retry_s")
    #: replication factor of the topics Faust creates (changelogs, tick and trace-link topics);
    #: ``SPANRL_STREAM_REPLICATION_FACTOR``; 0: the stack's (``Settings.kafka_replication_factor``)
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
            retain_max=st.stream_retain_max,
            tick_s=st.stream_tick_s,
            commit_interval_s=st.stream_commit_interval_s,
            session_timeout_s=st.stream_session_timeout_s,
            linger_s=st.stream_linger_s,
            payload_bucket=s.payload_bucket,
            claim_retry_s=st.claim_retry_s,
            replication_factor=st.stream_replication_factor,
        )


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


class _Lifecycle:
    """The app's signal handlers: clients stopped before shutdown, per-partition memory
    forgotten when partitions are revoked."""

    def __init__(self, ticker: Ticker, assembler: Assembler, grouper: Grouper, joiner: Joiner):
        self.ticker, self.assembler, self.grouper, self.joiner = ticker, assembler, grouper, joiner

    async def _stop_ticker(self, app, **kwargs) -> None:
        """Stop the plain clients: the tick producer, the joined spans' producer, the
        end-offsets reader."""
        await self.ticker.stop()
        await self.joiner.stop()
        await self.assembler.stop()

    async def _forget_positions(self, app, revoked, **kwargs) -> None:
        """Another worker may handle these partitions now; when they come back, their
        positions are learnt again from the records handled (until then: settle_s), and the
        calls and waiting transitions re-read from spans and transitions."""
        for tp in revoked:
            self.assembler.forget(tp.partition)
            self.grouper.forget(tp.partition)
        await self.assembler.spans_reader.stop()
        await self.grouper.transitions_reader.stop()


def _faust_app(cfg: StreamConfig) -> faust.App:
    """The Faust app for ``cfg``: exactly-once, in-memory stores recovered from changelogs."""
    return faust.App(
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
        # a killed worker's partitions move after this long without its heartbeats (Faust's
        # default 60 s; heartbeats every broker_heartbeat_interval, Faust's default 3 s)
        broker_session_timeout=cfg.session_timeout_s,
        producer_max_request_size=MAX_RECORD_BYTES,
        # Faust sends every record as soon as it is queued (linger 0): one produce request
        # per changelog write/output. Batching them for 20 ms cut the worker's CPU per
        # run by ~20 % in the bench (docs/measured/benchmarks-archive.md); a commit waits for it at most once.
        producer_linger=cfg.linger_s,
        # 0: the stack's (1 on one broker, 3 on a cluster: SPANRL_KAFKA_BROKERS)
        topic_replication_factor=cfg.replication_factor or get_settings().kafka_replication_factor,
        Worker=QuietWorker,  # no spinner: it set the root logger to DEBUG (QuietWorker)
    )


def make_context(app: faust.App, cfg: StreamConfig) -> AppContext:
    """What the agents share: the pure modules' configs from ``cfg``, the topics, the tables
    (made on ``app`` here, in this order), the counters and the output writers."""
    assembly_cfg = assembly.AssemblyConfig(
        credit_rule=parse_credit_rule(cfg.credit_rule).with_air(parse_air_rules(cfg.air_rules)), agents=cfg.train_agents,
        reward_timeout_s=cfg.reward_timeout_s, rollout_timeout_s=cfg.rollout_timeout_s,
        settle_s=cfg.settle_s, max_call_bytes=max_call_bytes(), production_idle_s=cfg.production_idle_s,
        reward_window_s=cfg.reward_window_s)
    grouping_cfg = grouping.GroupingConfig(group_timeout_s=cfg.group_timeout_s, late_join_s=cfg.reward_window_s)
    join_cfg = joining.JoinConfig(orphan_timeout_s=cfg.orphan_timeout_s, orphan_topic=cfg.orphan_spans_topic)
    metrics = WorkerCounters()
    app_topics = AppTopics.declare(app, cfg)
    tables = AppTables.declare(app)
    return AppContext(app=app, cfg=cfg, assembly_cfg=assembly_cfg, grouping_cfg=grouping_cfg, join_cfg=join_cfg,
                      topics=app_topics, tables=tables, metrics=metrics, outputs=Outputs(app_topics, metrics),
                      claim_client=claims.make_client())


#: agents are named as when they were functions of this module (Faust's default name)
_AGENT_PREFIX = canonshortname(_faust_app).rsplit(".", 1)[0]


def make_app(config: StreamConfig | None = None) -> faust.App:
    """Build the stream app for ``config`` (default: from the environment): the agents
    ``assemble``, ``group`` and (with ``join_traces``) ``join``, the tick timer, the signal
    handlers and the web pages, each a unit of its own module reading one :class:`AppContext`."""
    cfg = config or StreamConfig.from_env()
    faust_patches.install()  # refuses a faust-streaming the patches were not verified against
    # records of a schema id this checkout does not know (a newer writer's): ask the registry
    schema_registry.install(get_settings().schema_registry_url)
    app = _faust_app(cfg)
    ctx = make_context(app, cfg)
    assembler, grouper, joiner, ticker = Assembler(ctx), Grouper(ctx), Joiner(ctx), Ticker(ctx)
    rollout_partitions, task_partitions = topics.SPANS.partitions, topics.TRANSITIONS.partitions
    t = ctx.topics
    # internal=True: Faust declares (creates if missing) these topics with `partitions`
    # before subscribing - that is how the tick topic gets the inputs' partition count
    # (a consumer's metadata request would auto-create it with the broker default).
    # The input topics themselves already exist (infra creates them). The order of the
    # agents is the order of the assignor's co-partition groups (transactional ids).
    app.agent(app.topic(cfg.spans_topic, cfg.rewards_topic, cfg.rollouts_topic, t.rollout_ticks.get_topic_name(),
                        internal=True, partitions=rollout_partitions, **RAW),
              name=f"{_AGENT_PREFIX}.assemble")(assembler.run)
    app.agent(app.topic(cfg.transitions_topic, t.task_ticks.get_topic_name(), internal=True,
                        partitions=task_partitions, **RAW),
              name=f"{_AGENT_PREFIX}.group")(grouper.run)
    if cfg.join_traces:  # co-partitioned by trace id; the tick topic gets their partition count
        app.agent(app.topic(cfg.orphan_spans_topic, t.trace_links.get_topic_name(), t.join_ticks.get_topic_name(),
                            internal=True, partitions=rollout_partitions, **RAW),
                  name=f"{_AGENT_PREFIX}.join")(joiner.run)
    app.timer(interval=cfg.tick_s)(ticker.tick)
    lifecycle = _Lifecycle(ticker, assembler, grouper, joiner)
    app.on_before_shutdown.connect(lifecycle._stop_ticker)
    app.on_partitions_revoked.connect(lifecycle._forget_positions)
    WebViews(ctx, assembler, grouper).register(app)
    app.spanrl_config = cfg  # for introspection in tests
    app.spanrl_context = ctx
    return app


if __name__ == "__main__":
    check_environment()  # before the app reads its settings: a misspelt SPANRL_* stops the worker here
app = make_app()

if __name__ == "__main__":
    app.main()
