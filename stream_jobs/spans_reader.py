"""Re-reading span records at known offsets (late rewards, stream_jobs/assembly.py).

A parked attempt keeps only each call's span position (topic, partition, offset); when its
final reward comes, the stream app reads those records again with one plain aiokafka
consumer: no consumer group, ``assign`` + ``seek`` to each offset, ``read_committed`` (the
offsets are of committed records: the worker consumed them read_committed). Plumbing only.
"""
from __future__ import annotations

import asyncio
import logging
import time

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError, OffsetOutOfRangeError

log = logging.getLogger(__name__)

Position = tuple[str, int, int]


class SpansReader:
    """Reads the records at given positions. ``retry_s``: how long an offset that returns
    nothing (Kafka unreachable, a slow fetch) is tried before it counts as unreadable;
    ``max_record_bytes``: the largest record the topic takes (a fetch must hold one)."""

    def __init__(self, bootstrap: str, retry_s: float = 30.0, max_record_bytes: int = 8 << 20):
        self.bootstrap, self.retry_s, self.max_record_bytes = bootstrap, retry_s, max_record_bytes
        self._consumer: AIOKafkaConsumer | None = None
        # one read at a time: a read re-assigns the consumer, and a second read in between
        # (another agent of the same worker) made the first one's seek raise IllegalStateError
        # ("No current assignment"), which crashed the grouper agent mid-event (make test,
        # worker SIGKILL: one transition in no sample)
        self._lock = asyncio.Lock()

    async def _started(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            consumer = AIOKafkaConsumer(
                bootstrap_servers=self.bootstrap, group_id=None, enable_auto_commit=False,
                isolation_level="read_committed", auto_offset_reset="none",
                max_partition_fetch_bytes=self.max_record_bytes, fetch_max_bytes=self.max_record_bytes)
            await consumer.start()
            self._consumer = consumer
        return self._consumer

    async def read(self, positions: list[Position]) -> dict[Position, bytes]:
        """position -> record value, for every position whose record could be read; a
        position before the partition's log start (deleted by retention), past an aborted
        or compacted record, or unreadable for ``retry_s`` is left out (logged)."""
        found: dict[Position, bytes] = {}
        if not positions:
            return found
        async with self._lock:
            return await self._read(positions, found)

    async def _read(self, positions: list[Position], found: dict[Position, bytes]) -> dict[Position, bytes]:
        consumer = await self._started()
        wanted: dict[TopicPartition, set[int]] = {}
        for topic, partition, offset in positions:
            wanted.setdefault(TopicPartition(topic, partition), set()).add(offset)
        consumer.assign(list(wanted))
        starts = await consumer.beginning_offsets(list(wanted))
        for tp, offsets in wanted.items():
            for offset in sorted(offsets):
                if (tp.topic, tp.partition, offset) in found:
                    continue
                if offset < starts[tp]:
                    log.warning("spanrl: %s[%d]@%d is before the log start %d (retention)",
                                tp.topic, tp.partition, offset, starts[tp])
                    continue
                for m in await self._fetch_from(consumer, tp, offset):
                    if m.offset in offsets:
                        found[(tp.topic, tp.partition, m.offset)] = m.value
        return found

    async def _fetch_from(self, consumer: AIOKafkaConsumer, tp: TopicPartition, offset: int) -> list:
        """The first records at ``offset`` or after (one fetch); [] if none within retry_s."""
        deadline = time.monotonic() + self.retry_s
        while True:
            consumer.seek(tp, offset)
            try:
                records = (await consumer.getmany(tp, timeout_ms=1000)).get(tp, [])
            except OffsetOutOfRangeError:
                log.warning("spanrl: %s[%d]@%d out of range (retention)", tp.topic, tp.partition, offset)
                return []
            except KafkaError as exc:
                log.warning("spanrl: re-reading %s[%d]@%d: %r", tp.topic, tp.partition, offset, exc)
                records = []
            if records:
                return records
            if time.monotonic() >= deadline:
                log.warning("spanrl: %s[%d]@%d unreadable for %gs", tp.topic, tp.partition, offset, self.retry_s)
                return []
            await asyncio.sleep(0.2)

    async def stop(self) -> None:
        async with self._lock:
            consumer, self._consumer = self._consumer, None
            if consumer is not None:
                await consumer.stop()
