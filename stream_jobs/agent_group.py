"""Agent ``group``: transitions -> per-task group state in the ``groups`` table -> samples
(key task_id) and dead letters. The decisions are stream_jobs/grouping.py's.

The transitions waiting in open groups are held per partition in this worker's memory only,
as their Avro records (stream_jobs/transition_store.py): the group state keeps each one's
position on ``transitions``, and a worker that restores a state without them re-reads them
(:meth:`Grouper.reread_transitions`) before the state is next updated.

A task state with no open group and no late member waiting (``grouping.tick_due`` is NEVER)
is finished until the task's next transition; beyond ``SPANRL_STREAM_RETAIN_MAX`` such states
per partition the oldest are deleted (``ticking.FinishedStates``), so a run whose task ids do
not repeat (production agents, one task per conversation) holds a bounded table. A deleted
task's next transition starts it afresh: its group numbering restarts at ``<task>/0`` and a
short group it closed can no longer take late members (they form a group of their own).
"""
from __future__ import annotations

from spanrl.schemas import codec
from spanrl.core import dead_letters as dl
from spanrl.stream_jobs import grouping
from spanrl.stream_jobs.app_context import MAX_RECORD_BYTES, AppContext, now_ms
from spanrl.stream_jobs.app_ticks import ticked
from spanrl.stream_jobs.clock import TimeoutClock
from spanrl.stream_jobs.faust_patches import handling
from spanrl.stream_jobs.spans_reader import SpansReader
from spanrl.stream_jobs.ticking import FinishedStates, TickIndex, evict_finished
from spanrl.stream_jobs.transition_store import TransitionStore


class Grouper:
    """The ``group`` agent (:meth:`run`) and the worker memory it keeps (see the module doc)."""

    def __init__(self, ctx: AppContext):
        self.ctx = ctx
        self.groups = ctx.tables.groups
        self.stores: dict[int, TransitionStore] = {}
        self.index = TickIndex()  # the task states a tick visits: at their groups' time-outs (grouping.tick_due)
        self.finished = FinishedStates()  # task states without an open group, oldest first (the count bound)
        self.clock = TimeoutClock()
        cfg = ctx.cfg
        self.transitions_reader = SpansReader(cfg.bootstrap, cfg.claim_retry_s, MAX_RECORD_BYTES)

    def store(self, partition: int) -> TransitionStore:
        """The waiting transitions this worker holds for ``partition``."""
        store = self.stores.get(partition)
        if store is None:
            store = self.stores[partition] = TransitionStore()
        return store

    def expiry(self, state: dict) -> int | None:
        """The state's next tick time (grouping.tick_due); notes whether it is finished."""
        due = grouping.tick_due(state, self.ctx.grouping_cfg)
        self.finished.note(state["partition"], state["task_id"], due == grouping.NEVER)
        return due

    def put(self, tid: str, state: dict) -> None:
        """Write the state (a changelog record) and re-index it at its next tick time; then
        delete the partition's oldest finished task states beyond ``SPANRL_STREAM_RETAIN_MAX``."""
        p = state["partition"]
        self.groups[tid] = state
        self.index.note(p, tid, self.expiry(state))
        self.ctx.metrics.counters["tasks_evicted"] += evict_finished(
            self.groups, self.index, self.finished, p, self.ctx.cfg.retain_max)

    async def reread_transitions(self, state: dict) -> TransitionStore:
        """The state's partition's transition store, with every waiting transition of
        ``state`` this worker does not hold re-read from the transitions topic (after a restart
        or rebalance; a transition that cannot be read back stays missing: grouping
        dead-letters its attempt ``transitions_missing``)."""
        store = self.store(state["partition"])
        wanted = grouping.missing_reads(state, store)
        if wanted:
            records = await self.transitions_reader.read([tuple(at) for _, at in wanted])
            for key, at in wanted:
                value = records.get(tuple(at))
                try:
                    tr = grouping.restore_transition(key, codec.decode("transition", value)) if value else None
                except codec.SchemaError:
                    tr = None
                if tr is not None:
                    store.put_record(key, value, tr)
                    self.ctx.metrics.counters["transitions_reread"] += 1
        return store

    async def on_tick(self, tid: str, state: dict, now: int) -> None:
        """A tick's visit of one task state: its groups' time-outs."""
        out = grouping.advance(state, await self.reread_transitions(state), self.ctx.grouping_cfg, now)
        if out.samples or out.dead_letters:
            self.put(tid, state)
            await self.ctx.outputs.send_samples(out.samples)
            await self.ctx.outputs.send_dead(out.dead_letters)
        else:  # the visit took it off the index's due list: back on it at its next due time
            self.index.note(state["partition"], tid, self.expiry(state))

    async def run(self, stream) -> None:
        """The agent: every transition and tick of its partitions, in order; no commit falls
        inside the handling of one (faust_patches.handling)."""
        async for event in stream.events():
            async with handling(self.ctx.app):
                await self.handle(event.message)

    async def handle(self, msg) -> None:
        """One transition or tick record: the group state's update, then its samples and
        dead letters."""
        ctx = self.ctx
        outputs, task_ticks = ctx.outputs, ctx.topics.task_ticks
        now = now_ms()
        if await ticked(msg, now, task_ticks, self.clock, self.groups, self.on_tick, self.index, self.expiry):
            return
        try:
            tr = codec.decode("transition", msg.value)
        except codec.SchemaError as exc:
            await outputs.send_dead([dl.dead_letter(exc.reason, dl.GROUPER, now, detail=exc.detail)],
                                    msg, msg.value)
            return
        state = self.groups.get(tr["task_id"]) or grouping.new_state(tr["task_id"], msg.partition)
        store = await self.reread_transitions(state)
        out = grouping.add_transition(state, store.decoded_from(tr, msg.value), store, ctx.grouping_cfg, now,
                                      at=(msg.topic, msg.partition, msg.offset))
        store.decoded_from(None, b"")
        self.put(tr["task_id"], state)
        await outputs.send_samples(out.samples)
        await outputs.send_dead(out.dead_letters)

    def forget(self, partition: int) -> None:
        """Another worker may handle ``partition`` now: its waiting transitions and index go
        (the next owner re-reads what it needs from transitions)."""
        self.stores.pop(partition, None)
        self.index.forget(partition)
        self.finished.forget(partition)
