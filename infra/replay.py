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

With an end time (``until_ms``) or a new reward function (``reward``) the replay first copies
its window of the inputs into ``spans.<suffix>`` / ``rewards.<suffix>`` / ``rollouts.<suffix>``
(spanrl/infra/replay_inputs.py; the rewards re-scored on the way) and its workers read those.
``workers`` Faust workers of the replay's consumer group share the input partitions (each
with its own data directory and web port), as the stack's stream workers do.
"""
from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from spanrl.core.settings import Settings, StreamSettings, TrainerConfig, child_env, env_value, get_settings
from spanrl.infra.replay_inputs import INPUTS, ReplayError, copy_inputs
from spanrl.infra.stack import ROOT, ensure_topics, stop_process_group
from spanrl.schemas import decode
from spanrl.schemas import topics as T


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
    per sample); until_ms: replay the records before this time only (None: up to the end now);
    reward: ``package.module:function`` re-scoring each attempt (spanrl/infra/replay_inputs.py;
    None: the recorded rewards); workers: Faust workers sharing the input partitions;
    timeout_s: give up when the workers have not caught up by then (None: never)."""

    suffix: str
    credit_rule: str = "identical"
    train_agents: str | None = None
    air_rules: str | None = None
    since_ms: int | None = None
    train_from: str | None = None
    train_updates: int = 1
    train_max_batch: int | None = None
    until_ms: int | None = None
    reward: str | None = None
    workers: int = 1
    timeout_s: float | None = None
    quiet_s: float = 8.0


def base_or_checkpoint(spec: str | None) -> tuple[str, int] | None:
    """``RUN:VERSION`` of the checkpoint a replay's training starts from, or None to start
    from the base model: ``base``, ``RUN:0`` (version 0 of every run is the base model: a
    run's first checkpoint is version 1) and None. Raises ValueError for anything else. Pure."""
    if spec is None or spec.strip() == "base":
        return None
    run, sep, version = spec.strip().partition(":")
    if not sep or not run or not version.isdigit():
        raise ValueError(f"--train-from must be RUN:VERSION or base, got {spec!r}")
    return None if int(version) == 0 else (run, int(version))


def check_checkpoint(s: Settings, spec: str | None) -> str | None:
    """The trainer's ``init_from`` for ``spec`` (:func:`base_or_checkpoint`): None for the base
    model, else ``RUN:VERSION`` once MinIO holds that version's manifest. Raises ReplayError
    naming what is missing (before anything is replayed)."""
    found = base_or_checkpoint(spec)
    if found is None:
        return None
    from spanrl.trainer import checkpoint

    run, version = found
    try:
        manifest = checkpoint.read_manifest(checkpoint.make_client(s), s.checkpoint_bucket, run, version)
    except Exception as exc:  # minio errors, connection refused
        raise ReplayError(f"cannot read checkpoint {run}:{version} from MinIO: {exc!r}") from exc
    if manifest is None:
        known = checkpoint.latest_version_in_store(checkpoint.make_client(s), s.checkpoint_bucket, run)
        raise ReplayError(f"no checkpoint {run}:{version} (no s3://{s.checkpoint_bucket}/{run}/{version:06d}/manifest.json;"
                          f" {f'latest is {known}' if known else 'the run has none'}); use {run}:0 or base to train "
                          "from the base model")
    return f"{run}:{version}"


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


def check_tokenizer(spans: Iterable[dict], model_dir: Path) -> str | None:
    """The tokenizer hash of ``model_dir`` (spanrl.core.tokenizer_id), once the token ids of
    ``spans``' calls were made by that tokenizer or by one not recorded (span v1); raises
    ReplayError when a call's recorded tokenizer hash differs (its ids mean other text)."""
    from spanrl.core.tokenizer_id import mismatch, tokenizer_sha256

    target = tokenizer_sha256(model_dir)
    problem = mismatch(((sp["llm"].get("tokenizer"), sp["llm"].get("tokenizer_sha256"))
                        for sp in spans if sp.get("llm")), Path(model_dir).name, target)
    if problem:
        raise ReplayError(f"refusing to train token ids on {model_dir}: {problem}")
    return target


async def _window_spans(s: Settings, since_ms: int | None, until_ms: int | None) -> list[dict]:
    from spanrl.infra.replay_inputs import read_window, window

    raw = await read_window(s.kafka_bootstrap, T.SPANS.name, await window(s.kafka_bootstrap, T.SPANS, since_ms, until_ms))
    return [decode(T.SPANS.record, r.value) for r in raw]


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


async def _group_positions(s: Settings, group: str, ends: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
    """Committed offset of ``group`` on each partition of ``ends`` (0 where none), capped at
    the end offset (transactional markers take an offset each: committed may be beyond)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=s.kafka_bootstrap)
    await admin.start()
    try:
        committed = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    return {tp: min(end, committed[tp].offset if tp in committed and committed[tp].offset >= 0 else 0)
            for tp, end in ends.items()}


def progress_of(start: dict[TopicPartition, int], now: dict[TopicPartition, int], ends: dict[TopicPartition, int]
                ) -> tuple[int, int]:
    """(offsets consumed since ``start``, offsets to consume from ``start`` to ``ends``) over
    all partitions; the replay has caught up when the two are equal. Pure."""
    total = sum(max(0, end - start.get(tp, 0)) for tp, end in ends.items())
    done = sum(max(0, min(now.get(tp, 0), end) - start.get(tp, 0)) for tp, end in ends.items())
    return done, total


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


def replay(cfg: ReplayConfig, settings: Settings | None = None, log=print,
           progress: Callable[[int, int], None] | None = None) -> dict:
    """Run the replay described by ``cfg``; returns counts and, if trained, the new run.
    ``progress(done, total)`` is called about every second with the input offsets consumed.

    Raises ValueError for a bad option and ReplayError (before anything is written where it
    can: an unknown checkpoint, a reward function that does not import) when the replay
    cannot be done, RuntimeError if a worker exits or they do not catch up in ``timeout_s``.
    """
    s = settings or get_settings()
    from spanrl.core.plugins import resolve
    from spanrl.stream_jobs.air import parse_air_rules
    from spanrl.stream_jobs.assembly import parse_train_agents
    from spanrl.stream_jobs.credit import parse_credit_rule

    parse_train_agents(cfg.train_agents)  # ValueError before anything starts
    air = parse_air_rules(cfg.air_rules)
    parse_credit_rule(cfg.credit_rule)
    if cfg.workers < 1:
        raise ValueError(f"workers must be at least 1, got {cfg.workers}")
    if cfg.since_ms is not None and cfg.until_ms is not None and cfg.until_ms <= cfg.since_ms:
        raise ValueError("until must be after since")
    reward_fn = None
    if cfg.reward:
        try:
            reward_fn = resolve(cfg.reward)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ReplayError(f"reward function {cfg.reward!r} does not load: {type(exc).__name__}: {exc}") from exc
        if not callable(reward_fn):
            raise ReplayError(f"reward function {cfg.reward!r} is not callable")
    init_from = check_checkpoint(s, cfg.train_from) if cfg.train_from else None
    if cfg.train_from:  # the ids trained must be the trainer's tokenizer's (claim-checked spans: not read here)
        check_tokenizer(asyncio.run(_window_spans(s, cfg.since_ms, cfg.until_ms)), TrainerConfig().base_dir or s.model_dir)
    transitions, samples, dead, accounts = output_topics(cfg.suffix)
    app_id = f"spanrl-replay-{cfg.suffix}"
    asyncio.run(ensure_topics(s.kafka_bootstrap, (transitions, samples, dead, accounts)))
    t0 = time.monotonic()
    inputs = dict(zip(("spans_topic", "rewards_topic", "rollouts_topic"), (t.name for t in INPUTS)))
    result: dict = {}
    if cfg.until_ms is not None or reward_fn is not None:
        copied = asyncio.run(copy_inputs(s, cfg.suffix, cfg.since_ms, cfg.until_ms, reward_fn, cfg.reward or "", log))
        result.update(inputs_copied=copied["written"], **({"returns": copied["returns"]} if "returns" in copied else {}))
        inputs = {k: T.derived(t, cfg.suffix).name for k, t in zip(inputs, INPUTS)}
        source = tuple(T.derived(t, cfg.suffix) for t in INPUTS)
    else:
        source = INPUTS
        if cfg.since_ms is not None:
            asyncio.run(_seek_group_to_time(s, app_id, cfg.since_ms))
    ends = asyncio.run(topics_end_offsets(s, source))
    start = asyncio.run(_group_positions(s, app_id, ends))
    state = (ROOT / s.state_dir).resolve()
    (state / "logs").mkdir(parents=True, exist_ok=True)
    env = child_env({"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"},
                    StreamSettings.env(stream_app_id=app_id, credit_rule=cfg.credit_rule, air_rules=cfg.air_rules or "",
                                       transitions_topic=transitions.name, samples_topic=samples.name,
                                       dead_letter_topic=dead.name, call_accounts_topic=accounts.name,
                                       train_agents=cfg.train_agents or "", stream_join_traces=False,
                                       group_timeout_s=env_value("SPANRL_GROUP_TIMEOUT_S", "30"), **inputs))
    log_path = state / "logs" / f"replay-{cfg.suffix}.log"
    workers = []
    with open(log_path, "ab") as out:
        for i in range(cfg.workers):
            datadir = state / "replay" / cfg.suffix / f"worker-{i}"
            datadir.mkdir(parents=True, exist_ok=True)
            workers.append(subprocess.Popen(
                [sys.executable, "-m", "spanrl.stream_jobs.app", "--datadir", str(datadir), "worker", "-l", "info"],
                cwd=ROOT, env={**env, **Settings.env(faust_web_port=_free_port())}, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True))
    try:
        deadline = None if cfg.timeout_s is None else time.monotonic() + cfg.timeout_s
        while True:
            done, total = progress_of(start, asyncio.run(_group_positions(s, app_id, ends)), ends)
            if progress:
                progress(done, total)
            if done >= total:
                break
            for w in workers:
                if w.poll() is not None:
                    raise RuntimeError(f"replay worker exited {w.returncode}; see {log_path}")
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"replay did not catch up in {cfg.timeout_s}s ({done}/{total}); see {log_path}")
            time.sleep(1.0)
        log(f"replay consumed the inputs ({time.monotonic() - t0:.1f}s); waiting for groups to close")
        last, stable_since = None, time.monotonic()
        while time.monotonic() - stable_since < cfg.quiet_s and (deadline is None or time.monotonic() < deadline):
            now = asyncio.run(topics_end_offsets(s, (samples, dead, accounts)))  # moves iff something was written
            if now != last:
                last, stable_since = now, time.monotonic()
            time.sleep(1.0)
    finally:
        for w in workers:
            stop_process_group(w)
    result = {"suffix": cfg.suffix, "credit_rule": cfg.credit_rule, "air_rules": air.describe() if air else "",
              "app_id": app_id, "workers": cfg.workers, "reward": cfg.reward or "recorded",
              "transitions_topic": transitions.name, "samples_topic": samples.name,
              "transitions": asyncio.run(_count(s, transitions)), "samples": asyncio.run(_count(s, samples)),
              "dead_letters": asyncio.run(_count(s, dead)), "replay_s": round(time.monotonic() - t0, 1),
              "inputs_offsets": total,
              "train_agents": cfg.train_agents or "all",
              "calls_by_agent": agent_counts(asyncio.run(read_topic(s.kafka_bootstrap, accounts))), **result}
    if cfg.train_from:
        result["training"] = train_replayed(cfg, samples.name, s, log, init_from)
    return result


def train_replayed(cfg: ReplayConfig, samples_topic: str, s: Settings, log=print, init_from: str | None = None
                   ) -> dict:
    """Train run ``replay-<suffix>`` from checkpoint ``init_from`` (``RUN:VERSION``; None: the
    base model) on the replayed samples."""
    run = f"replay-{cfg.suffix}"
    batch = {} if cfg.train_max_batch is None else {"max_batch": cfg.train_max_batch, "min_batch": cfg.train_max_batch}
    env = child_env({"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
                    TrainerConfig.env(run=run, samples_topic=samples_topic, start="earliest",
                                      max_updates=cfg.train_updates, http=False, idle_flush_s="3",
                                      # updates of train_max_batch samples, or what 3 s idle leaves
                                      batching="stream",
                                      # replayed samples are off-policy by design (made by the original
                                      # run's versions): trained with the importance ratio capped
                                      # (trainer/staleness.py), not refused
                                      stale_policy=env_value("SPANRL_TRAINER_STALE_POLICY", "keep"), **batch,
                                      **({"init_from": init_from} if init_from else {})))
    if not init_from:  # the base model: no init_from, whatever this process's environment says
        env.pop(TrainerConfig.env_name("init_from"), None)
    log(f"training run {run} from {init_from or 'the base model'} on {samples_topic}")
    state = (ROOT / s.state_dir).resolve()
    with open(state / "logs" / f"trainer-{run}.log", "ab") as out:
        rc = subprocess.call([sys.executable, "-m", "spanrl.trainer.train"], cwd=ROOT, env=env, stdout=out,
                             stderr=subprocess.STDOUT, timeout=cfg.timeout_s)
    if rc != 0:
        raise RuntimeError(f"replay training exited {rc}; see {state / 'logs' / f'trainer-{run}.log'}")
    return {"run": run, "from": init_from or "base", "updates": cfg.train_updates}
