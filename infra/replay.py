"""Replay: rebuild transitions and samples from the stored topics under a new credit
rule (and AIR rules, agent selection), into new topics, then optionally train a new run
from a chosen checkpoint.

The Kafka log is the source of truth (spans, rewards and rollouts are kept forever), so
a replay is the same Faust job run again as a new consumer group (a new app id) that
starts at the beginning of the inputs, or at the first offsets at or after a timestamp
(Kafka ListOffsets by time, ``offsets_for_times``), and writes to
``transitions.<suffix>`` / ``samples.<suffix>`` / ``dead-letter.<suffix>``. The
original topics are never written. The replay does not run the trace join
(``SPANRL_STREAM_JOIN_TRACES=false``, stream_jobs/joining.py): the spans that joined a
rollout by trace id were written to ``spans`` when they joined, so the replay reads them
there like any other span (running the join again would write ``spans``).
"""
from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from spanrl.core.settings import Settings, StreamSettings, TrainerConfig, child_env, env_value, get_settings
from spanrl.infra.stack import ROOT, ensure_topics, stop_process_group
from spanrl.schemas import decode
from spanrl.schemas import topics as T

INPUTS = (T.SPANS, T.REWARDS, T.ROLLOUTS)


@dataclass
class ReplayConfig:
    """suffix: names the output topics and the replay's app id; credit_rule: see
    spanrl.stream_jobs.credit.parse_credit_rule; since_ms: replay from this time (None: from the
    beginning); train_from: ``RUN:VERSION`` checkpoint to train a new run from (None: no
    training); train_updates: updates of that training; train_agents: whose calls become
    transitions (``SPANRL_TRAIN_AGENTS`` syntax: names or ``re:EXPR``; None: every call), so
    the same stored spans can train a different set of agents; air_rules: AIR's intermediate
    rewards (``SPANRL_AIR_RULES`` syntax, spanrl.stream_jobs.air.parse_air_rules; None: none),
    so the same spans give transitions with and without them; train_max_batch: samples per
    update of that training (None: the trainer's default, 64; an update on CPU takes seconds
    per sample)."""

    suffix: str
    credit_rule: str = "identical"
    train_agents: str | None = None
    air_rules: str | None = None
    since_ms: int | None = None
    train_from: str | None = None
    train_updates: int = 1
    train_max_batch: int | None = None
    timeout_s: float = 600.0
    quiet_s: float = 8.0


def output_topics(suffix: str) -> tuple[T.Topic, T.Topic, T.Topic, T.Topic]:
    """(transitions, samples, dead-letter, call-accounts) topics of a replay."""
    return (T.derived(T.TRANSITIONS, suffix), T.derived(T.SAMPLES, suffix), T.derived(T.DEAD_LETTER, suffix),
            T.derived(T.CALL_ACCOUNTS, suffix))


def agent_counts(accounts: list[dict]) -> dict[str, dict[str, int]]:
    """Per agent name (``(unresolved)`` for calls whose agent was not resolved): calls seen,
    trained (became transitions) and excluded, from decoded call-account records, sorted
    by name. Pure."""
    out: dict[str, dict[str, int]] = {}
    for acc in accounts:
        for c in acc["calls"]:
            e = out.setdefault(c["agent_name"] or "(unresolved)", {"calls": 0, "trained": 0, "excluded": 0})
            e["calls"] += 1
            e["trained" if c["trained"] else "excluded"] += 1
    return dict(sorted(out.items()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def topics_end_offsets(s: Settings, wanted: tuple[T.Topic, ...] | list[T.Topic]) -> dict[TopicPartition, int]:
    """End offset (read_committed: the last stable offset) of every partition of ``wanted``."""
    consumer = AIOKafkaConsumer(bootstrap_servers=s.kafka_bootstrap, isolation_level="read_committed")
    await consumer.start()
    try:
        parts = [TopicPartition(t.name, p) for t in wanted for p in range(t.partitions)]
        return await consumer.end_offsets(parts)
    finally:
        await consumer.stop()


async def _seek_group_to_time(s: Settings, group: str, since_ms: int) -> None:
    """Commit, for consumer group ``group``, the first offset at/after ``since_ms`` on each input."""
    consumer = AIOKafkaConsumer(bootstrap_servers=s.kafka_bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        parts = [TopicPartition(t.name, p) for t in INPUTS for p in range(t.partitions)]
        consumer.assign(parts)
        found = await consumer.offsets_for_times({tp: since_ms for tp in parts})
        ends = await consumer.end_offsets(parts)
        await consumer.commit({tp: (found[tp].offset if found[tp] else ends[tp]) for tp in parts})
    finally:
        await consumer.stop()


async def _group_caught_up(s: Settings, group: str, ends: dict[TopicPartition, int]) -> bool:
    admin = AIOKafkaAdminClient(bootstrap_servers=s.kafka_bootstrap)
    await admin.start()
    try:
        committed = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    for tp, end in ends.items():
        if end == 0:
            continue
        meta = committed.get(tp)
        # transactional markers take an offset each: committed may be end or beyond
        if meta is None or meta.offset < end:
            return False
    return True


async def read_records(bootstrap: str, topic: str, start: dict[int, int] | None = None
                       ) -> list[tuple[int, int, bytes | None, bytes]]:
    """``(partition, offset, key, value)`` of every committed record of ``topic`` from
    ``start`` (partition -> offset; default the beginning) up to the end offsets taken now.

    Reads read_committed (records of aborted transactions are invisible); stops when every
    partition reached its end offset, or after three empty polls (transaction markers
    take offsets too, so the last offsets may hold no record).
    """
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed",
                                enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in await _partitions_of(consumer, topic)]
        if not tps:
            return []
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        for tp in tps:
            consumer.seek(tp, (start or {}).get(tp.partition, 0))
        out: list[tuple[int, int, bytes | None, bytes]] = []
        empty = 0
        while empty < 3:
            if all([await consumer.position(tp) >= ends[tp] for tp in tps]):
                break
            batch = await consumer.getmany(timeout_ms=1000, max_records=20000)
            empty = 0 if batch else empty + 1
            for tp, msgs in batch.items():
                out += [(tp.partition, m.offset, m.key, m.value) for m in msgs if m.offset < ends[tp]]
        return out
    finally:
        await consumer.stop()


async def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    """partition -> end offset (read_committed: the last stable offset) of ``topic`` now."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed")
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in await _partitions_of(consumer, topic)]
        return {tp.partition: off for tp, off in (await consumer.end_offsets(tps)).items()}
    finally:
        await consumer.stop()


async def _partitions_of(consumer: AIOKafkaConsumer, topic: str) -> list[int]:
    parts = consumer.partitions_for_topic(topic)
    if not parts:
        await consumer._client.force_metadata_update()  # aiokafka has no public refresh
        parts = consumer.partitions_for_topic(topic)
    return sorted(parts or [])


async def read_topic(bootstrap: str, topic: T.Topic) -> list[dict]:
    """Every committed record of ``topic`` from the beginning to its end now, decoded
    (see :func:`read_records`)."""
    return [decode(topic.record, v) for _, _, _, v in await read_records(bootstrap, topic.name)]


async def _count(s: Settings, topic: T.Topic) -> int:
    return len(await read_topic(s.kafka_bootstrap, topic))


def replay(cfg: ReplayConfig, settings: Settings | None = None, log=print) -> dict:
    """Run the replay described by ``cfg``; returns counts and, if trained, the new run.

    Raises RuntimeError if the replay worker exits or does not catch up in ``timeout_s``.
    """
    s = settings or get_settings()
    from spanrl.stream_jobs.air import parse_air_rules
    from spanrl.stream_jobs.assembly import parse_train_agents
    from spanrl.stream_jobs.credit import parse_credit_rule

    parse_train_agents(cfg.train_agents)  # ValueError before anything starts
    air = parse_air_rules(cfg.air_rules)
    parse_credit_rule(cfg.credit_rule)
    transitions, samples, dead, accounts = output_topics(cfg.suffix)
    app_id = f"spanrl-replay-{cfg.suffix}"
    asyncio.run(ensure_topics(s.kafka_bootstrap, (transitions, samples, dead, accounts)))
    ends = asyncio.run(topics_end_offsets(s, INPUTS))
    if cfg.since_ms is not None:
        asyncio.run(_seek_group_to_time(s, app_id, cfg.since_ms))
    state = (ROOT / s.state_dir).resolve()
    (state / "logs").mkdir(parents=True, exist_ok=True)
    env = child_env({"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"},
                    StreamSettings.env(stream_app_id=app_id, credit_rule=cfg.credit_rule, air_rules=cfg.air_rules or "",
                                       transitions_topic=transitions.name, samples_topic=samples.name,
                                       dead_letter_topic=dead.name, call_accounts_topic=accounts.name,
                                       train_agents=cfg.train_agents or "", stream_join_traces=False,
                                       group_timeout_s=env_value("SPANRL_GROUP_TIMEOUT_S", "30")),
                    Settings.env(faust_web_port=_free_port()))
    log_path = state / "logs" / f"replay-{cfg.suffix}.log"
    t0 = time.monotonic()
    with open(log_path, "ab") as out:
        worker = subprocess.Popen([sys.executable, "-m", "spanrl.stream_jobs.app", "worker", "-l", "info"],
                                  cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + cfg.timeout_s
        while not asyncio.run(_group_caught_up(s, app_id, ends)):
            if worker.poll() is not None:
                raise RuntimeError(f"replay worker exited {worker.returncode}; see {log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"replay did not catch up in {cfg.timeout_s}s; see {log_path}")
            time.sleep(1.0)
        log(f"replay consumed the inputs ({time.monotonic() - t0:.1f}s); waiting for groups to close")
        last, stable_since = None, time.monotonic()
        while time.monotonic() - stable_since < cfg.quiet_s and time.monotonic() < deadline:
            now = asyncio.run(topics_end_offsets(s, (samples, dead, accounts)))  # moves iff something was written
            if now != last:
                last, stable_since = now, time.monotonic()
            time.sleep(1.0)
    finally:
        stop_process_group(worker)
    result = {"suffix": cfg.suffix, "credit_rule": cfg.credit_rule, "air_rules": air.describe() if air else "",
              "app_id": app_id,
              "transitions_topic": transitions.name, "samples_topic": samples.name,
              "transitions": asyncio.run(_count(s, transitions)), "samples": asyncio.run(_count(s, samples)),
              "dead_letters": asyncio.run(_count(s, dead)), "replay_s": round(time.monotonic() - t0, 1),
              "train_agents": cfg.train_agents or "all",
              "calls_by_agent": agent_counts(asyncio.run(read_topic(s.kafka_bootstrap, accounts)))}
    if cfg.train_from:
        result["training"] = train_replayed(cfg, samples.name, s, log)
    return result


def train_replayed(cfg: ReplayConfig, samples_topic: str, s: Settings, log=print) -> dict:
    """Train run ``replay-<suffix>`` from checkpoint ``cfg.train_from`` on the replayed samples."""
    run = f"replay-{cfg.suffix}"
    batch = {} if cfg.train_max_batch is None else {"max_batch": cfg.train_max_batch, "min_batch": cfg.train_max_batch}
    env = child_env({"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
                    TrainerConfig.env(run=run, samples_topic=samples_topic, init_from=cfg.train_from, start="earliest",
                                      max_updates=cfg.train_updates, http=False, idle_flush_s="3",
                                      # updates of train_max_batch samples, or what 3 s idle leaves
                                      batching="stream",
                                      # replayed samples are off-policy by design (made by the original
                                      # run's versions): trained with the importance ratio capped
                                      # (trainer/staleness.py), not refused
                                      stale_policy=env_value("SPANRL_TRAINER_STALE_POLICY", "keep"), **batch))
    log(f"training run {run} from {cfg.train_from} on {samples_topic}")
    state = (ROOT / s.state_dir).resolve()
    with open(state / "logs" / f"trainer-{run}.log", "ab") as out:
        rc = subprocess.call([sys.executable, "-m", "spanrl.trainer.train"], cwd=ROOT, env=env, stdout=out,
                             stderr=subprocess.STDOUT, timeout=cfg.timeout_s)
    if rc != 0:
        raise RuntimeError(f"replay training exited {rc}; see {state / 'logs' / f'trainer-{run}.log'}")
    return {"run": run, "from": cfg.train_from, "updates": cfg.train_updates}
