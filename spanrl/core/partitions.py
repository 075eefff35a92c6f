"""A topic's partitions as an aiokafka consumer sees them, waiting for the metadata.

A consumer that has just started (or a topic just created) may not know the topic's
partitions yet; :func:`topic_partitions` asks the cluster again until it does. The trainer
reads ``samples`` and ``checkpoints`` with it, the reloader ``checkpoints``.
"""
from __future__ import annotations

import asyncio
import time


async def topic_partitions(consumer, topic: str, wait_s: float = 10.0) -> list[int]:
    """The sorted partition numbers of ``topic`` known to ``consumer`` (a started
    ``AIOKafkaConsumer``), refreshing its metadata every 0.2 s for up to ``wait_s``
    seconds; ``[]`` when the topic has none by then (it does not exist)."""
    deadline = time.monotonic() + wait_s
    while True:
        parts = consumer.partitions_for_topic(topic)
        if parts:
            return sorted(parts)
        if time.monotonic() > deadline:
            return []
        await consumer._client.force_metadata_update()  # aiokafka has no public refresh
        await asyncio.sleep(0.2)
