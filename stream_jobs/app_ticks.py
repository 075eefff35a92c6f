"""Timeouts in the stream app: the tick timer and how an agent handles a tick record.

A Faust timer cannot write tables or produce inside a transaction (it has no event), so
:class:`Ticker` produces one empty record per partition of each tick topic every
``SPANRL_STREAM_TICK_S``; each agent consumes its tick topic beside its inputs and handles a
tick like any input, inside that partition's transaction (:func:`ticked`). Which states a
tick visits: stream_jobs/ticking.py; at what time it judges them: stream_jobs/clock.py.
"""
from __future__ import annotations

import logging
from typing import Any

from spanrl.stream_jobs.app_context import AppContext, record_ms
from spanrl.stream_jobs.clock import TimeoutClock
from spanrl.stream_jobs.ticking import TickIndex

log = logging.getLogger(__name__)


async def ticked(msg, now: int, ticks, clock: TimeoutClock, table, handle,
                 index: TickIndex | None = None, expires_at=None) -> bool:
    """Whether ``msg`` is a record of the tick topic ``ticks``. A tick on partition p is
    judged at ``clock``'s time for p (None: skipped) and ``await handle(key, state, time)``
    runs for every state of ``table`` that lives on p (its changelog writes belong to p's
    transaction) - with an ``index`` (stream_jobs/ticking.py), only for its live states and
    those due to expire (``expires_at(state)``); any other record is an input, noted by
    ``clock``."""
    if msg.topic != ticks.get_topic_name():
        clock.saw_input(msg.partition, now, record_ms(msg))
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


class Ticker:
    """The timer (``app.timer``, every ``tick_s``) that writes one empty record to every
    partition of each tick topic, with a plain (non-transactional) producer made on first
    use: a tick is visible at once to the read_committed consumer, and a duplicated tick is
    harmless."""

    def __init__(self, ctx: AppContext):
        self.ctx = ctx
        self.producer: Any = None

    async def tick(self) -> None:
        """One tick on every partition of every tick topic; a failure is logged, never raised
        (a missed tick only delays timeouts)."""
        from aiokafka import AIOKafkaProducer

        try:
            producer = self.producer
            if producer is None:
                producer = AIOKafkaProducer(bootstrap_servers=self.ctx.cfg.bootstrap)
                await producer.start()
                self.producer = producer
            for name in (t.get_topic_name() for t in self.ctx.topics.ticks):
                for p in sorted(await producer.partitions_for(name)):
                    await producer.send(name, b"", partition=p)
        except Exception:  # a missed tick only delays timeouts; never crash the worker
            log.exception("spanrl: tick failed")

    async def stop(self) -> None:
        """Stop the producer, if one was made."""
        producer, self.producer = self.producer, None
        if producer is not None:
            await producer.stop()
