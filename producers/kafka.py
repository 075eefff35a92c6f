"""Kafka plumbing shared by the producers: topic set, idempotent producer, acked sends.

Every record is produced with ``enable_idempotence=True, acks=all`` and zstd, keyed by
``rollout_id`` (utf-8); a send is only reported as done once the broker acknowledged it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from spanrl.core.settings import TopicSettings, default_replication
from spanrl.schemas import codec, topics
from spanrl.schemas.topics import Topic

#: seconds a produce may take before the caller is told Kafka is unavailable
SEND_TIMEOUT_S = 15.0


class KafkaUnavailable(RuntimeError):
    """Kafka did not acknowledge in time (or could not be reached)."""


@dataclass(frozen=True)
class Topics:
    """The topics the producers write/read; overridable for tests (``with_prefix``)."""

    spans: Topic = topics.SPANS
    rewards: Topic = topics.REWARDS
    rollouts: Topic = topics.ROLLOUTS
    tasks: Topic = topics.TASKS
    dead_letter: Topic = topics.DEAD_LETTER
    #: spans without a rollout id, keyed by trace id (the stream app joins them by trace)
    orphan_spans: Topic = topics.ORPHAN_SPANS

    @classmethod
    def with_prefix(cls, prefix: str, base: "Topics | None" = None) -> "Topics":
        """The same topics (of ``base``, default the training set) named ``prefix + name``
        (e.g. ``prtest-1a2b-spans``)."""
        base = base or cls()
        return cls(**{f.name: dataclasses.replace(getattr(base, f.name), name=prefix + getattr(base, f.name).name)
                      for f in dataclasses.fields(cls)})

    @classmethod
    def evaluation(cls) -> "Topics":
        """The evaluation topic set: ``spans.eval``, ``rewards.eval``, ``rollouts.eval``,
        ``dead-letter.eval`` (tasks are handed to the evaluator's runner directly)."""
        return cls(spans=topics.SPANS_EVAL, rewards=topics.REWARDS_EVAL, rollouts=topics.ROLLOUTS_EVAL,
                   dead_letter=topics.DEAD_LETTER_EVAL)

    @classmethod
    def from_env(cls) -> "Topics":
        """Default topics, prefixed by ``$SPANRL_TOPIC_PREFIX`` when set."""
        prefix = TopicSettings().topic_prefix
        return cls.with_prefix(prefix) if prefix else cls()

    def all(self) -> tuple[Topic, ...]:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def make_producer(bootstrap: str, **overrides) -> AIOKafkaProducer:
    """An idempotent, acks=all, zstd producer (not started)."""
    kwargs = dict(
        bootstrap_servers=bootstrap,
        enable_idempotence=True,
        acks="all",
        compression_type="zstd",
        max_request_size=max(t.max_message_bytes for t in Topics().all()),
        request_timeout_ms=int(SEND_TIMEOUT_S * 1000),
        linger_ms=5,
    )
    kwargs.update(overrides)
    return AIOKafkaProducer(**kwargs)


class Sink:
    """A lazily (re)started producer that encodes records and waits for their acks.

    ``produce`` raises :class:`KafkaUnavailable` when Kafka cannot be reached or does
    not acknowledge within ``send_timeout_s`` (default ``SEND_TIMEOUT_S``; the services
    pass ``SPANRL_KAFKA_SEND_TIMEOUT_S``); callers turn that into a 503.
    """

    def __init__(self, bootstrap: str, topics: Topics | None = None, send_timeout_s: float = SEND_TIMEOUT_S):
        self.bootstrap = bootstrap
        self.topics = topics or Topics.from_env()
        self.send_timeout_s = send_timeout_s
        self._producer: AIOKafkaProducer | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        async with self._lock:
            if self._producer is not None:
                return
            producer = make_producer(self.bootstrap, request_timeout_ms=int(self.send_timeout_s * 1000))
            try:
                await asyncio.wait_for(producer.start(), self.send_timeout_s)
            except (KafkaError, OSError, asyncio.TimeoutError) as exc:
                await _quiet_stop(producer)
                raise KafkaUnavailable(f"cannot start producer on {self.bootstrap}: {exc!r}") from exc
            self._producer = producer

    @property
    def started(self) -> bool:
        return self._producer is not None

    async def stop(self) -> None:
        async with self._lock:
            if self._producer is not None:
                await _quiet_stop(self._producer)
                self._producer = None

    async def produce(self, items: list[tuple[Topic, str | None, dict]]) -> None:
        """Encode each ``(topic, key, record)`` as ``topic.record`` and wait for all acks."""
        if not items:
            return
        encoded = [(t, k, codec.encode(t.record, r)) for t, k, r in items]
        await self.produce_raw(encoded)

    async def produce_raw(self, items: list[tuple[Topic, str | None, bytes]]) -> None:
        await self.start()
        assert self._producer is not None
        try:
            async def _all() -> None:
                futures = [await self._producer.send(t.name, v, key=None if k is None else k.encode())
                           for t, k, v in items]
                await asyncio.gather(*futures)
            await asyncio.wait_for(_all(), self.send_timeout_s)
        except (KafkaError, OSError, asyncio.TimeoutError) as exc:
            # an idempotent producer whose batch failed is not safe to reuse: start afresh
            producer, self._producer = self._producer, None
            await _quiet_stop(producer)
            raise KafkaUnavailable(f"kafka did not acknowledge: {exc!r}") from exc


async def _quiet_stop(producer: AIOKafkaProducer | None) -> None:
    if producer is None:
        return
    try:
        await asyncio.wait_for(producer.stop(), 5)
    except Exception:  # noqa: BLE001 - best effort on a broken connection
        pass


async def create_topics(bootstrap: str, wanted: tuple[Topic, ...], replication_factor: int | None = None) -> None:
    """Create ``wanted`` topics that do not exist yet, with ``replication_factor`` replicas
    (None: ``settings.default_replication`` of the brokers the cluster reports now; the stack and
    a cluster's one-shot set-up job, infra/setup_job.py, pass theirs). Raises the KafkaError
    of a topic Kafka refused (:func:`check_created`)."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        if replication_factor is None:
            replication_factor = default_replication(len((await admin.describe_cluster())["brokers"]))
        existing = set(await admin.list_topics())
        # replicated topics: an acks=all write needs 2 replicas in sync (Kafka docs, min.insync.replicas)
        isr = {"min.insync.replicas": "2"} if replication_factor > 1 else {}
        unique = {t.name: t for t in wanted}  # one request may not name a topic twice (Kafka: error 42)
        new = [NewTopic(t.name, t.partitions, replication_factor, topic_configs={**t.config(), **isr})
               for t in unique.values() if t.name not in existing]
        if new:
            response = await admin.create_topics(new)
            check_created(response.topic_errors)
    finally:
        await admin.close()


def check_created(topic_errors: list[tuple]) -> None:
    """Raise the KafkaError of the first topic a CreateTopics response refused (its
    ``topic_errors``: ``(topic, error_code[, error_message])``; 36, already exists, is no
    error here). E.g. ``InvalidReplicationFactorError`` while a cluster's brokers register."""
    from aiokafka.errors import TopicAlreadyExistsError, for_code

    for topic, code, *message in topic_errors:
        if code not in (0, TopicAlreadyExistsError.errno):
            raise for_code(code)(f"topic {topic}: {message[0] if message and message[0] else 'refused'}")


async def delete_topics(bootstrap: str, names: list[str]) -> None:
    """Delete topics by name (test cleanup)."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        doomed = [n for n in names if n in existing]
        if doomed:
            await admin.delete_topics(doomed)
    finally:
        await admin.close()
