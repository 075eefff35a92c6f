"""Agent ``join``: orphan-spans (no rollout id) + trace links (key trace_id) -> per-trace
state in the ``traces`` table (+ ``orphans``: records of spans waiting for a link) -> joined
spans back into ``spans`` (key rollout_id), and ``no_rollout_id`` dead letters. The
decisions are stream_jobs/joining.py's. Registered only when ``SPANRL_STREAM_JOIN_TRACES``
is on (a replay turns it off: what joined is on spans already).
"""
from __future__ import annotations

import asyncio
from typing import Any

from spanrl.schemas import codec
from spanrl.core import dead_letters as dl
from spanrl.stream_jobs import joining
from spanrl.stream_jobs.app_context import MAX_RECORD_BYTES, AppContext, now_ms
from spanrl.stream_jobs.app_ticks import ticked
from spanrl.stream_jobs.clock import TimeoutClock
from spanrl.stream_jobs.faust_patches import handling


class Joiner:
    """The ``join`` agent (:meth:`run`) and its plain producer of joined spans."""

    def __init__(self, ctx: AppContext):
        self.ctx = ctx
        self.traces = ctx.tables.traces
        self.orphans = ctx.tables.orphans
        self.clock = TimeoutClock()
        self.producer: Any = None  # made on first use

    async def send_joined(self, records: list[dict]) -> None:
        """Joined spans go back to ``spans`` with a plain (non-transactional) idempotent
        producer, acknowledged before the orphan's offset can commit: ``spans`` then holds no
        transaction markers, so its offsets are contiguous records, which the emission rule
        (assembly.inputs_consumed) counts on. At least once: after a crash the join may send
        a span again; the assembler counts a span id once."""
        from aiokafka import AIOKafkaProducer

        cfg = self.ctx.cfg
        producer = self.producer
        if producer is None:
            producer = self.producer = AIOKafkaProducer(
                bootstrap_servers=cfg.bootstrap, enable_idempotence=True, acks="all",
                max_request_size=MAX_RECORD_BYTES)
            await producer.start()
        acks = [await producer.send(cfg.spans_topic, codec.encode("span", sp), key=sp["rollout_id"].encode())
                for sp in records]
        await asyncio.gather(*acks)  # all acknowledged before the orphans' offsets can commit
        self.ctx.metrics.counters["spans_joined"] += len(records)

    async def on_tick(self, tid: str, state: dict, now: int) -> None:
        """A tick's visit of one trace state: dropped once expired, else its orphans' time-outs."""
        if joining.expired(state, now, self.ctx.cfg.retain_s):
            del self.traces[tid]
            return
        out = joining.advance(state, self.orphans, self.ctx.join_cfg, now)
        if out.changed:
            self.traces[tid] = state
            await self.ctx.outputs.send_dead(out.dead_letters)

    async def run(self, stream) -> None:
        """The agent: every orphan span, trace link and tick of its partitions, in order; no
        commit falls inside the handling of one (faust_patches.handling)."""
        async for event in stream.events():
            async with handling(self.ctx.app):
                await self.handle(event.message)

    async def handle(self, msg) -> None:
        """One orphan span, trace link or tick record."""
        ctx = self.ctx
        cfg, counters, join_ticks = ctx.cfg, ctx.metrics.counters, ctx.topics.join_ticks
        now = now_ms()
        if await ticked(msg, now, join_ticks, self.clock, self.traces, self.on_tick):
            return
        is_orphan = msg.topic == cfg.orphan_spans_topic
        counters["orphans_in" if is_orphan else "trace_links_in"] += 1
        try:
            record = codec.decode("span" if is_orphan else "trace_link", msg.value)
        except codec.SchemaError as exc:
            await ctx.outputs.send_dead([dl.dead_letter(exc.reason, dl.JOINER, now, detail=exc.detail)],
                                        msg, msg.value)
            return
        tid = record["trace_id"]
        state = self.traces.get(tid) or joining.new_state(tid, msg.partition)
        if is_orphan:
            out = joining.add_orphan(state, record, msg.value, msg.offset, self.orphans, now)
        else:
            out = joining.add_link(state, record, self.orphans, now)
        if out.changed:
            self.traces[tid] = state
        await self.send_joined(out.spans)

    async def stop(self) -> None:
        """Stop the joined spans' producer, if one was made."""
        producer, self.producer = self.producer, None
        if producer is not None:
            await producer.stop()
