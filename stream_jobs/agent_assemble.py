"""Agent ``assemble``: spans + rewards + rollouts (co-partitioned by rollout_id) ->
per-rollout state in the ``rollouts`` table -> transitions (key task_id), call accounts and
dead letters. The decisions are stream_jobs/assembly.py's; this is the plumbing around them:

- the calls' token data (``assembly.encode_call`` bytes) per partition, in this worker's
  memory only (no changelog): each call in the rollout state keeps its span's position
  (``at``), and a worker that recovers the state without the data (after a crash or a
  rebalance) re-reads them from spans when the attempt can end (:meth:`Assembler.advance`).
  Before, a changelogged table held them: one 3 KB record per call and one tombstone, the
  largest share of the worker's produce traffic (docs/measured/benchmarks-archive.md);
- the emission rule's positions (``assembly.inputs_consumed``), in memory only: per
  partition the next offset to process of each input topic (one past the last record
  handled), and the rollouts whose attempts wait for those positions to pass their inputs
  bound (a heap per role, stream_jobs/waitlist.py). After a rebalance both start empty;
  attempts then fall back to the settle_s grace;
- the tick index (stream_jobs/ticking.py): the rollout states a tick visits;
- the finished rollout states per partition (``ticking.FinishedStates``): beyond
  ``SPANRL_STREAM_RETAIN_MAX`` of them the oldest are deleted at the next write on that
  partition (also before ``SPANRL_STREAM_RETAIN_S``), so the table's size is bounded by a
  setting, not by the rate times the retention time. An input of a deleted rollout starts a
  fresh state (a span or reward without a lifecycle event ends ``unknown_rollout``; the
  attempt's transitions went out long before);
- a span of a proxy call with a ``traceparent`` also goes out as a trace link, re-keyed by
  trace id for the ``join`` agent (agent_join.py).
"""
from __future__ import annotations

import logging
import time
from typing import Any

from spanrl.core import claims
from spanrl.schemas import codec
from spanrl.stream_jobs import assembly, joining
from spanrl.core import dead_letters as dl
from spanrl.stream_jobs.app_context import MAX_RECORD_BYTES, AppContext, key_text, now_ms
from spanrl.stream_jobs.app_ticks import ticked
from spanrl.stream_jobs.clock import TimeoutClock
from spanrl.stream_jobs.faust_patches import handling
from spanrl.stream_jobs.spans_reader import SpansReader
from spanrl.stream_jobs.ticking import FinishedStates, TickIndex, evict_finished
from spanrl.stream_jobs.waitlist import InputsWaitlist

log = logging.getLogger(__name__)


def state_parked(state: dict) -> int:
    """Parked, unfinished attempts of one rollout state (assembly's ``parked_ms``)."""
    return sum(1 for a in state["attempts"].values() if a["done"] is None and a.get("parked_ms") is not None)


def input_kinds(cfg) -> dict[str, tuple[str, str, str]]:
    """Input topic -> (record type, counter, emission-rule role) for the three inputs of
    ``cfg`` (a StreamConfig)."""
    return {cfg.spans_topic: ("span", "spans_in", "spans"),
            cfg.rewards_topic: ("reward", "rewards_in", "rewards"),
            cfg.rollouts_topic: ("rollout", "rollout_events_in", "rollouts")}


class Assembler:
    """The ``assemble`` agent (:meth:`run`) and the worker memory it keeps (see the module doc)."""

    def __init__(self, ctx: AppContext):
        self.ctx = ctx
        cfg = ctx.cfg
        self.rollouts = ctx.tables.rollouts
        self.calls: dict[int, dict[str, bytes]] = {}
        self.positions: dict[int, dict[str, int]] = {}
        self.waiting: dict[int, InputsWaitlist] = {}
        self.index = TickIndex()  # the rollout states a tick visits (stream_jobs/ticking.py)
        self.finished = FinishedStates()  # finished states per partition, oldest first (the count bound)
        # ticks judge timeouts behind the wall clock while a backlog is read (stream_jobs/clock.py)
        self.clock = TimeoutClock()
        self.spans_reader = SpansReader(cfg.bootstrap, cfg.claim_retry_s, MAX_RECORD_BYTES)
        self.offsets_reader: Any = None  # a plain consumer for end offsets, made on first use
        self.kinds = input_kinds(cfg)

    def call_data(self, partition: int) -> dict[str, bytes]:
        """The calls' token data this worker holds for ``partition``."""
        return self.calls.setdefault(partition, {})

    async def claimed(self, record: dict, msg) -> dict | None:
        """The span behind a claim record (``payload_ref``, spanrl/core/claims.py), or None
        after dead-lettering ``claim_unresolved``."""
        cfg = self.ctx.cfg
        try:
            data = await claims.resolve_claim(self.ctx.claim_client, record["payload_ref"], cfg.payload_bucket,
                                              cfg.claim_retry_s)
            return claims.check_claimed(record, codec.decode("span", data))
        except (claims.ClaimError, codec.SchemaError) as exc:
            await self.ctx.outputs.send_dead([dl.dead_letter(dl.CLAIM_UNRESOLVED, dl.ASSEMBLER, now_ms(),
                                                             detail=str(exc), rollout_id=record["rollout_id"])],
                                             msg, msg.value)
            return None

    async def reread_span(self, rid: str, aid: str, sid: str, value: bytes | None) -> bytes | None:
        """The store value of a parked call from its re-read span record (claim resolved
        again), or None (the attempt then ends ``late_spans_missing``)."""
        if value is None:
            return None
        cfg = self.ctx.cfg
        try:
            span = codec.decode("span", value)
            if span.get("payload_ref"):
                data = await claims.resolve_claim(self.ctx.claim_client, span["payload_ref"], cfg.payload_bucket,
                                                  cfg.claim_retry_s)
                span = claims.check_claimed(span, codec.decode("span", data))
        except (claims.ClaimError, codec.SchemaError) as exc:
            log.warning("spanrl: re-read span %s of %s/%s: %s", sid, rid, aid, exc)
            return None
        return assembly.restore_call(rid, aid, sid, span)

    async def advance(self, state: dict, now: int, pos: dict[str, int] | None) -> assembly.Outcome:
        """assembly.advance (``pos``: the partition's positions, the emission rule). An attempt
        that could end now but whose calls' token data are not in this worker's memory (a
        parked attempt whose late reward came; calls handled by a worker that stopped, or
        before a rebalance) first gets them re-read from spans, inside this event's
        transaction: what it emits commits with the event."""
        counters, acfg = self.ctx.metrics.counters, self.ctx.assembly_cfg
        store = self.call_data(state["partition"])
        parked = state_parked(state)
        wanted = assembly.missing_reads(state, store, acfg)
        if wanted:
            rid, n = state["rollout_id"], 0
            records = await self.spans_reader.read([tuple(at) for reads in wanted.values() for _, at in reads])
            for aid, reads in wanted.items():
                for sid, at in reads:
                    value = await self.reread_span(rid, aid, sid, records.get(tuple(at)))
                    if value is not None:
                        store[assembly.store_key(rid, aid, sid)] = value
                        n += 1
            counters["spans_reread"] += n
        out = assembly.advance(state, store, acfg, now, pos)
        counters["attempts_parked"] += max(0, state_parked(state) - parked)
        counters["late_rewards_emitted"] += len({t["attempt_id"] for t in out.transitions if t["late_reward"]})
        return out

    def expiry(self, state: dict) -> int | None:
        """The state's next tick time (assembly.tick_due); notes whether it is finished (the
        count bound's list). ``NEVER`` (an attempt's inputs bound
        is known not to be passed yet) takes it off every tick, so it is put on the waitlist
        here, whichever path computed it (a record, a tick, the index's rebuild after a
        restart): the waitlist hands it back the moment the positions no longer hold it."""
        p = state["partition"]
        due = assembly.tick_due(state, self.ctx.assembly_cfg, self.ctx.cfg.retain_s, self.positions.get(p))
        self.finished.note(p, state["rollout_id"], assembly.expires_at(state, self.ctx.cfg.retain_s) is not None)
        if due == TickIndex.NEVER:
            self.note_waiting(p, state["rollout_id"], state)
        return due

    def put(self, rid: str, state: dict) -> None:
        """Write the state (a changelog record) and re-index it at its next tick time; then
        delete the partition's oldest finished states beyond ``SPANRL_STREAM_RETAIN_MAX``
        (tombstones in the same transaction)."""
        p = state["partition"]
        self.rollouts[rid] = state
        self.index.note(p, rid, self.expiry(state))
        self.ctx.metrics.counters["rollouts_evicted"] += evict_finished(
            self.rollouts, self.index, self.finished, p, self.ctx.cfg.retain_max)

    async def inputs_bound(self, partition: int) -> dict[str, int]:
        """End offsets (high watermarks) of the spans and rewards partitions ``partition``,
        read now: a bound on every input of an attempt whose terminal event, sent after
        those inputs were acknowledged, has just been consumed."""
        from aiokafka import AIOKafkaConsumer
        from aiokafka.structs import TopicPartition

        cfg = self.ctx.cfg
        reader = self.offsets_reader
        if reader is None:
            reader = self.offsets_reader = AIOKafkaConsumer(bootstrap_servers=cfg.bootstrap,
                                                            enable_auto_commit=False)
            await reader.start()
        tps = {"spans": TopicPartition(cfg.spans_topic, partition),
               "rewards": TopicPartition(cfg.rewards_topic, partition)}
        ends = await reader.end_offsets(list(tps.values()))
        self.ctx.metrics.counters["inputs_bounds_read"] += 1
        return {role: int(ends[tp]) for role, tp in tps.items()}

    def note_waiting(self, partition: int, rid: str, state: dict) -> None:
        """Called right after ``state`` was advanced with its partition's positions: it waits
        while a known position is behind its attempts' inputs bound (the rule says False);
        otherwise that advance has seen what the rule can tell (what it still lacks, e.g. its
        reward, is an input of its own; an unknown position leaves it to the settle fallback)."""
        need = assembly.awaiting_inputs(state)
        if need is not None or partition in self.waiting:
            self.waiting.setdefault(partition, InputsWaitlist()).note(rid, need, self.positions.get(partition))

    async def release_waiting(self, partition: int, now: int) -> None:
        """Advance the rollouts of ``partition`` whose inputs bound the positions now pass."""
        pos = self.positions.get(partition, {})
        for rid in self.waiting[partition].ready(pos):
            state = self.rollouts.get(rid)
            if state is None:
                continue
            out = await self.advance(state, now, pos)
            # re-indexed also when unchanged: the index had it as NEVER, and the positions
            # that let it out may leave it to the settle fallback (a tick) instead
            if out.changed:
                self.put(rid, state)
            else:
                self.index.note(partition, rid, self.expiry(state))
            self.note_waiting(partition, rid, state)
            await self.ctx.outputs.emit(out)

    async def on_tick(self, rid: str, state: dict, now: int) -> None:
        """A tick's visit of one rollout state: dropped once expired, else advanced."""
        if assembly.expired(state, now, self.ctx.cfg.retain_s):
            del self.rollouts[rid]
            self.index.drop(state["partition"], rid)
            self.finished.drop(state["partition"], rid)
            return
        p = state.get("partition")
        out = await self.advance(state, now, self.positions.get(p))
        if out.changed:
            self.put(rid, state)
            self.note_waiting(p, rid, state)
            await self.ctx.outputs.emit(out)
        else:  # the visit took it off the index's due list: back on it at its next due time
            self.index.note(p, rid, self.expiry(state))

    async def run(self, stream) -> None:
        """The agent: every span, reward, lifecycle event and tick of its partitions, in order;
        no commit falls inside the handling of one (faust_patches.handling)."""
        async for event in stream.events():
            async with handling(self.ctx.app):
                await self.handle(event.message)

    async def handle(self, msg) -> None:
        """One span, reward, lifecycle event or tick record: the rollout state's update, then
        what it lets out."""
        ctx = self.ctx
        cfg, counters, outputs = ctx.cfg, ctx.metrics.counters, ctx.outputs
        rollout_ticks, trace_links = ctx.topics.rollout_ticks, ctx.topics.trace_links
        now = now_ms()
        if await ticked(msg, now, rollout_ticks, self.clock, self.rollouts, self.on_tick,
                        self.index, self.expiry):
            return
        record_type, counter, role = self.kinds[msg.topic]
        counters[counter] += 1
        # handled from here on, also when it is dead-lettered below
        self.positions.setdefault(msg.partition, {})[role] = msg.offset + 1
        try:
            record = codec.decode(record_type, msg.value)
        except codec.SchemaError as exc:
            await outputs.send_dead([dl.dead_letter(
                exc.reason, dl.ASSEMBLER, now, detail=exc.detail,
                rollout_id=key_text(msg.key))], msg, msg.value)
            return
        rid = record["rollout_id"]
        if record_type == "span" and record.get("payload_ref") and record.get("kind") == "llm":
            record = await self.claimed(record, msg)  # only llm calls can be training data
            if record is None:
                return
            now = now_ms()
        state = self.rollouts.get(rid) or assembly.new_state(rid, msg.partition)
        p = msg.partition
        if record_type == "span" and cfg.join_traces:
            link = joining.trace_link(record, now)
            if link is not None:  # re-keyed by trace id for the join agent
                await trace_links.send(key=link["trace_id"].encode(), value=codec.encode("trace_link", link))
                counters["trace_links_out"] += 1
        if record_type == "span":
            out = assembly.add_span(state, record, self.call_data(p), ctx.assembly_cfg, now,
                                    at=(msg.topic, msg.partition, msg.offset))
        elif record_type == "reward":
            if record.get("final", True):  # for the reward -> transition histogram (/metrics)
                ctx.metrics.reward_clock.reward_consumed(rid, record["attempt_id"], time.monotonic())
            out = assembly.add_reward(state, record, now)
        else:
            bound = await self.inputs_bound(p) if assembly.wants_inputs_bound(state, record) else None
            out = assembly.add_rollout_event(state, record, now, bound)
        pos = self.positions[p]
        input_dead, changed = out.dead_letters, out.changed
        out = await self.advance(state, now, pos)
        if changed or out.changed:  # a table write is a changelog record
            self.put(rid, state)
        self.note_waiting(p, rid, state)
        await outputs.send_dead(input_dead, msg, msg.value)
        await outputs.emit(out)
        if self.waiting.get(p):
            await self.release_waiting(p, now)

    def forget(self, partition: int) -> None:
        """Another worker may handle ``partition`` now: its positions, waitlist, calls' token
        data and index go; when it comes back they are learnt again from the records handled
        (until then: settle_s), and the calls re-read from spans."""
        self.positions.pop(partition, None)
        self.waiting.pop(partition, None)
        self.calls.pop(partition, None)  # the next owner re-reads what it needs from spans
        self.index.forget(partition)
        self.finished.forget(partition)

    async def stop(self) -> None:
        """Stop the end-offsets reader, if one was made."""
        reader, self.offsets_reader = self.offsets_reader, None
        if reader is not None:
            await reader.stop()
