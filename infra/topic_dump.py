"""Topic dumps: Kafka records as they are stored (topic, key, value bytes, timestamp, headers),
one JSON object a line, to archive a piece of the log and restore it into a cluster.

A line: ``{"topic": "spans", "key": "r-1", "timestamp_ms": 1764547200600, "headers": [["name",
"<hex>"]], "value_hex": "<hex>"}`` (other fields are kept for people and ignored). Values are
written back byte for byte, in any framing the codec reads (the Confluent one, or the 0x53
framing of older records: ``tests/fixtures/archived/topic_dump.jsonl``); a record goes to the
partition its key hashes to, as the original producer's did, so records of one rollout stay
co-partitioned. ``spanrl topics dump`` / ``spanrl topics restore`` (infra/cli.py).
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer, TopicPartition


@dataclass(frozen=True)
class DumpRecord:
    """One stored Kafka record."""

    topic: str
    key: bytes | None
    value: bytes
    timestamp_ms: int
    headers: tuple[tuple[str, bytes], ...] = ()

    def line(self) -> str:
        return json.dumps({"topic": self.topic, "key": None if self.key is None else self.key.decode(),
                           "timestamp_ms": self.timestamp_ms,
                           "headers": [[k, v.hex()] for k, v in self.headers], "value_hex": self.value.hex()})


def parse_dump(text: str) -> list[DumpRecord]:
    """The records of a dump's text; ValueError naming the line for a malformed one. Pure."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            key = row.get("key")
            ts = row["timestamp_ms"]
            if not isinstance(row["topic"], str) or not row["topic"] or isinstance(ts, bool) \
                    or not isinstance(ts, int) or ts < 0 or not (key is None or isinstance(key, str)):
                raise ValueError("topic must be a name, timestamp_ms an integer >= 0, key a string or null")
            out.append(DumpRecord(row["topic"], None if key is None else key.encode(), bytes.fromhex(row["value_hex"]),
                                  ts, tuple((str(k), bytes.fromhex(v)) for k, v in row.get("headers", []))))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"dump line {n}: {type(exc).__name__}: {exc}") from None
    return out


def shifted(records: Iterable[DumpRecord], end_ms: int) -> list[DumpRecord]:
    """``records`` with their timestamps moved by one amount so that the latest is ``end_ms``
    (their order and spacing kept): restored "now", a replay's time window (``--since`` /
    ``--until``) finds them after the records already there. Pure."""
    records = list(records)
    if not records:
        return []
    delta = end_ms - max(r.timestamp_ms for r in records)
    return [DumpRecord(r.topic, r.key, r.value, r.timestamp_ms + delta, r.headers) for r in records]


async def restore(bootstrap: str, records: Iterable[DumpRecord], rename: Mapping[str, str] | None = None
                  ) -> dict[str, int]:
    """Produce ``records`` in order (idempotent, acks=all), each to ``rename.get(topic, topic)``
    with its key, value, timestamp and headers; returns records written per topic. The topics
    must exist (``spanrl stack up`` creates spanrl's)."""
    from spanrl.producers.kafka import make_producer

    counts: Counter[str] = Counter()
    producer = make_producer(bootstrap)
    await producer.start()
    try:
        for r in records:
            topic = (rename or {}).get(r.topic, r.topic)
            await producer.send_and_wait(topic, r.value, key=r.key, timestamp_ms=r.timestamp_ms,
                                         headers=list(r.headers) or None)
            counts[topic] += 1
    finally:
        await producer.stop()
    return dict(counts)


async def dump(bootstrap: str, topics: Iterable[str], keys: set[str] | None = None) -> list[DumpRecord]:
    """Every committed record of ``topics`` now (those whose key is in ``keys`` when given), in
    timestamp order."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed",
                                enable_auto_commit=False)
    await consumer.start()
    out: list[DumpRecord] = []
    try:
        known = await consumer.topics()  # fetches the cluster's metadata
        for topic in topics:
            if topic not in known:
                raise ValueError(f"no topic {topic!r}")
            tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
            consumer.assign(tps)
            ends = await consumer.end_offsets(tps)
            await consumer.seek_to_beginning(*tps)
            empty = 0
            while empty < 3 and not all([await consumer.position(tp) >= ends[tp] for tp in tps]):
                batch = await consumer.getmany(timeout_ms=1000)
                empty = 0 if batch else empty + 1
                for tp, msgs in batch.items():
                    out += [DumpRecord(topic, m.key, m.value, m.timestamp, tuple((k, bytes(v)) for k, v in m.headers))
                            for m in msgs if m.offset < ends[tp] and m.value is not None
                            and (keys is None or (m.key or b"").decode() in keys)]
    finally:
        await consumer.stop()
    return sorted(out, key=lambda r: r.timestamp_ms)
