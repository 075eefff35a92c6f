"""Every patch of Faust's internals the worker needs, in one place (faust-streaming 0.15).

:func:`install` applies them (idempotent; stream_jobs/app.py calls it before it builds the
app) after :func:`check_version`, which refuses a Faust they were not verified against.
Each patch names what it works around and carries the text of the upstream report (the
faust-streaming tracker's known issues it relates to are cited; where none says it
exactly, the report below is the one to file). Unit tests, each failing without its patch
(checked by disabling each in turn): tests/unit/test_faust_patches.py (send: the source
partition's transaction; commit: the queued changelog writes go first; recovery highwaters;
resume; the commit between events; one changelog record per changed key per commit, and
at a revocation; the version refused with what to do, at make_app),
tests/unit/test_faust_buffer_drain.py
(the drain, and the write the background sender holds); end to end: test_stream_app /
test_chaos (worker SIGKILL: 0 lost, 0 duplicated).

1. :func:`_install_source_partition_transactions`: records produced while handling an event
   go in the transaction of the event's source partition; and the commit drains the producer
   buffer first (:func:`drain_producer_buffer`).

   Upstream report: "exactly_once: table changelog writes can miss the transaction that
   commits their input's offset. ``Table.__setitem__`` queues the changelog record in the
   ProducerBuffer (``send_soon``); ``Consumer._commit_offsets`` in transactional mode calls
   ``TransactionManager.commit`` without draining the buffer (only the non-transactional
   branch flushes, PR #273), and ``ProducerBuffer.flush()`` itself gives up after 0.1 s per
   message and ignores the message its background task holds. A SIGKILL after such a commit
   loses the state change while the input's offset is committed: the restarted worker never
   reads the input again. Seen as lost table updates after kill -9 (robinhood/faust#340).
   Expected: the commit of offsets O carries every changelog write made while handling the
   events below O. Also: TransactionManager.send picks the transaction by the destination
   topic's partition and co-partition group, so a record for a topic the app does not consume
   raises KeyError and one sent to another partition commits independently of its source."

2. :func:`_install_recovery_highwaters`: table recovery asks the broker where each changelog
   partition ends.

   Upstream report: "exactly_once: with isolation_level=read_committed, Recovery reads each
   changelog's highwater from the consumer's fetch state (``AIOKafkaConsumerThread._highwaters``),
   which is empty before the first fetch, so every changelog reads as empty (-1) and a
   restarted worker starts with empty tables. Related: faust-streaming#47, robinhood/faust#658
   (the LSO of a partition without a position during a rebalance). Expected: ListOffsets
   (last stable offset), as outside transactions."

3. :func:`_install_resume_keeps_live_queues`: resuming a flow that is not suspended leaves
   the agents' queues alone.

   Upstream report: "Records lost after a restart with exactly_once (the first records of a
   partition after its committed offset). At the end of table recovery, ``Recovery`` resumes
   the stream partitions, awaits ``consumer.perform_seek()``, then calls
   ``app.flow_control.resume()``. The flow is already active (recovery resumed it to read the
   changelogs), and mode's ``FlowControlEvent.resume()`` clears every ``clear_on_resume``
   queue regardless, dropping the records the fetcher delivered to the agents while the seek
   was awaited. ``Consumer._drain_messages`` had already moved ``_read_offset`` past them, so
   they are not delivered again, and the next commit passes their offsets. Seen as a span, a
   reward or a lifecycle event that a restarted worker never handled while its offset was
   committed (spanrl CI, worker SIGKILL, 1 run in 3-5). Expected: resume() clears queues only
   when it ends a suspension; revoked partitions' records are already cleared by
   ``flow_control.clear()`` in ``on_partitions_revoked``."

4. :class:`EventBarrier` (taken by the commit of patch 1; agents hold :func:`handling` around
   each event): a commit never falls inside the handling of an event.

   Upstream report: "exactly_once: a commit can split the outputs of one event between two
   transactions. ``Consumer._commit_handler`` commits every ``broker_commit_interval`` as a
   task of its own, concurrently with the agents. An agent that writes a table and then awaits
   its sends (``await topic.send()`` yields to the loop) can have the changelog write and the
   first sends committed while the rest go into the next transaction; a SIGKILL aborts that
   one, and the restarted worker, given the event again (its offset was not committed),
   restores the state that says the outputs were made. Seen as a GRPO group whose samples
   were partly lost (spanrl CI, worker SIGKILL: 8 of 36 transitions in no sample, 4 samples
   of the group with advantages computed over members whose samples never came). Expected:
   the commit runs between events (as Kafka Streams commits between records on its stream
   thread): an event's table writes and its sends are in one transaction."

5. :class:`ChangelogWrites` (``Table.on_key_set`` / ``on_key_del`` note the key; the commit
   of patch 1 and the revocation write each noted key once, with its value then): one
   changelog record per changed key per transaction, not one per write.

   Upstream report: "exactly_once: every Table write is its own changelog record. A state
   updated by ten events between two commits is serialised and produced ten times, though
   only the last value is read back on recovery and the ten commit (or abort) together.
   Kafka Streams forwards one record per key per commit from its record cache
   (``statestore.cache.max.bytes``); with a transaction per commit nothing else can be
   observed. Expected (exactly_once only): a write marks the key; the commit sends the
   key's value as it is then (a tombstone if it was deleted) before committing the offsets,
   and a revocation does the same before the revoked transactions stop."
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator

from faust.streams import current_event

log = logging.getLogger(__name__)

#: faust-streaming versions these patches were verified against (make chaos, worker fault)
VERIFIED_VERSIONS = ("0.15.3",)
#: mode-streaming (Faust's service library, FlowControlEvent) versions, likewise
VERIFIED_MODE_VERSIONS = ("0.7.1",)


def check_version() -> str:
    """The installed faust-streaming version. Raises RuntimeError, naming it and the
    verified ones, when the patches were not verified against it (or against the installed
    mode-streaming): they may patch code that moved, or no longer be needed, and
    exactly-once would then rest on an unchecked guess."""
    from importlib.metadata import version

    for dist, verified in (("faust-streaming", VERIFIED_VERSIONS), ("mode-streaming", VERIFIED_MODE_VERSIONS)):
        v = version(dist)
        if v not in verified:
            raise RuntimeError(
                f"{dist} {v} is installed, but stream_jobs/faust_patches.py was verified against "
                f"{', '.join(verified)} only: install one of those (pyproject.toml pins faust-streaming, which brings mode-streaming), or re-verify "
                f"the patches (tests/unit/test_faust_patches.py, tests/unit/test_faust_buffer_drain.py, "
                f"make chaos ARGS='--faults worker') and add {v} to its verified versions")
    return version("faust-streaming")


def install() -> None:
    """Apply every patch (idempotent)."""
    check_version()
    _install_source_partition_transactions()
    _install_recovery_highwaters()
    _install_resume_keeps_live_queues()
    _install_coalesced_changelog_writes()


def _install_source_partition_transactions() -> None:
    """Two Faust gotchas (faust-streaming 0.15, processing_guarantee="exactly_once").

    Faust's TransactionManager picks the transaction of a produced record from the
    *destination* topic's partition and co-partition group. For an output topic the app
    does not consume (samples, dead-letter) the group lookup raises KeyError; for a
    record sent to another partition than its source it lands in another partition's
    transaction, which commits independently of the source offsets. We send every
    record produced while handling an event in the transaction of that event's source
    partition - the one that commits the event's offset and its table changelog writes
    - which is what Kafka's consume-transform-produce pattern (KIP-98) prescribes.
    Sends outside an event (none in this app) keep Faust's behaviour.
    """
    from faust.transport.consumer import TransactionManager

    if getattr(TransactionManager.send, "_spanrl_patched", False):
        return
    original = TransactionManager.send

    async def send(self, topic, key, value, partition, timestamp, headers, *, transactional_id=None):
        event = current_event()
        if event is not None:
            tp = event.message.tp
            try:
                group = self.app.assignor.group_for_topic(tp.topic)
            except KeyError:
                group = None
            if group is not None:
                tid = f"{self.app.conf.id}-{group}-{tp.partition}"
                return await self.producer.send(topic, key, value, partition, timestamp, headers,
                                                transactional_id=tid)
        return await original(self, topic, key, value, partition, timestamp, headers,
                              transactional_id=transactional_id)

    send._spanrl_patched = True
    TransactionManager.send = send

    # Second gotcha: table writes are *buffered* (Table -> changelog topic send_soon ->
    # ProducerBuffer, drained by a background task), and in exactly_once mode Faust
    # commits the source offsets (Consumer._commit_offsets -> TransactionManager.commit)
    # without draining that buffer first - only the non-transactional branch flushes. A
    # changelog write could then miss the transaction that commits its input's offset and
    # land in the next one; a crash aborts that one, and the restarted worker restores a
    # state without the input while the input is never read again (`make chaos`, worker
    # fault: 13 of 72 calls lost). We drain the buffer into the open transactions before
    # committing. Writes of events not yet in `offsets` may ride along - whole: patch 4 (the
    # EventBarrier) keeps the commit out of an event's handling, so such an event's state
    # write goes with all of its outputs, and re-reading it after a crash is a no-op (the
    # assembly and grouping updates are idempotent).
    # Faust's own Producer.flush() does not drain it: ProducerBuffer.flush_atmost waits 0.1 s
    # per message for the background sender and returns on that time-out with messages
    # still queued, and it does not wait for the one the sender holds. On 2 busy cores that
    # happened (CI, worker fault: a span, a reward and a terminal event whose offsets were
    # committed while their state writes died with the killed worker; 4 attempts, 13 of 36
    # calls missing): :func:`drain_producer_buffer` sends every queued write itself and
    # waits for the sender's.
    original_commit = TransactionManager.commit

    async def commit(self, offsets, start_new_transaction: bool = True):
        async with event_barrier(self.app).committing():  # patch 4: between events, never inside one
            changelog_writes(self.app).flush()  # patch 5: each key changed since the last commit, once
            await drain_producer_buffer(self.app.producer.buffer)
            await self.producer.flush()
            return await original_commit(self, offsets, start_new_transaction=start_new_transaction)

    commit._spanrl_patched = True
    TransactionManager.commit = commit
    _count_buffer_sends()


def _count_buffer_sends() -> None:
    """Count the writes Faust's background sender holds (taken off ``pending``, not yet
    handed to the Kafka producer), for :func:`drain_producer_buffer`."""
    from faust.transport.producer import ProducerBuffer

    if getattr(ProducerBuffer._send_pending, "_spanrl_patched", False):
        return
    original = ProducerBuffer._send_pending

    async def _send_pending(self, fut) -> None:
        self._spanrl_sending = getattr(self, "_spanrl_sending", 0) + 1
        try:
            await original(self, fut)
        finally:
            self._spanrl_sending -= 1

    _send_pending._spanrl_patched = True
    ProducerBuffer._send_pending = _send_pending


async def drain_producer_buffer(buffer) -> int:
    """Hand every write queued in Faust's ProducerBuffer (table changelog writes are
    queued there: ``Table.__setitem__`` cannot await) to the Kafka producer now, and wait
    until the background sender holds none either. After it returns, each write made
    before the call sits in its transactional producer (``producer.flush()`` then sends
    it), so a transaction committed next carries it. Returns how many this call sent.
    Never gives up on a slow sender (Faust's ``flush_atmost`` does, after 0.1 s)."""
    sent = 0
    while True:
        while True:
            try:
                fut = buffer.pending.get_nowait()
            except asyncio.QueueEmpty:
                break
            await buffer._send_pending(fut)
            sent += 1
        if not getattr(buffer, "_spanrl_sending", 0) and buffer.pending.empty():
            return sent
        await asyncio.sleep(0.001)  # the background sender finishes the write it holds


class EventBarrier:
    """Patch 4: agents handle events while no commit runs; a commit waits until no event is
    being handled, and events that come while it waits wait for it (the commit goes first,
    so a busy worker still commits every ``broker_commit_interval``). Many events may be
    handled at once (one per agent); commits run one at a time (Faust's ``_commit_fut``), and
    overlapping ones (a rebalance's beside the timer's) are counted."""

    def __init__(self) -> None:
        self.handling_now = 0
        self.committing_now = 0
        self._idle = asyncio.Event()  # no event is being handled
        self._idle.set()
        self._open = asyncio.Event()  # no commit runs or waits
        self._open.set()

    @contextlib.asynccontextmanager
    async def handling(self) -> AsyncIterator[None]:
        """Around the handling of one event: its table writes and sends."""
        while not self._open.is_set():
            await self._open.wait()
        self.handling_now += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.handling_now -= 1
            if not self.handling_now:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def committing(self) -> AsyncIterator[None]:
        """Around a commit: waits for the events being handled, holds new ones off."""
        self.committing_now += 1
        self._open.clear()
        try:
            await self._idle.wait()
            yield
        finally:
            self.committing_now -= 1
            if not self.committing_now:
                self._open.set()


def _of_app(app, attr: str, make):
    """The object the patches keep on ``app`` under ``attr``, made by ``make()`` on first use."""
    obj = getattr(app, attr, None)
    if obj is None:
        obj = make()
        setattr(app, attr, obj)
    return obj


def event_barrier(app) -> EventBarrier:
    """The app's :class:`EventBarrier` (made on first use)."""
    return _of_app(app, "_spanrl_event_barrier", EventBarrier)


def handling(app) -> contextlib.AbstractAsyncContextManager:
    """``async with handling(app):`` around an agent's handling of one event (patch 4)."""
    return event_barrier(app).handling()


def _install_recovery_highwaters() -> None:
    """Faust gotcha (faust-streaming 0.15, processing_guarantee="exactly_once").

    Table recovery reads where each changelog partition ends from aiokafka's
    ``last_stable_offset(tp)``, which is only known after a fetch of that partition. At
    recovery nothing has been fetched yet, so every changelog reads as empty (-1) and a
    restarted worker starts with empty tables: pending calls, rollout states and groups
    were lost on every restart. We ask the broker instead (ListOffsets with the
    consumer's read_committed isolation returns the last stable offset, KIP-98), which
    is what Faust already does outside transactions.
    """
    from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread

    if getattr(AIOKafkaConsumerThread._highwaters, "_spanrl_patched", False):
        return

    async def _highwaters(self, partitions):
        return await self._ensure_consumer().end_offsets(partitions)

    _highwaters._spanrl_patched = True
    AIOKafkaConsumerThread._highwaters = _highwaters


def _install_resume_keeps_live_queues() -> None:
    """``FlowControlEvent.resume()`` clears the managed queues only when it ends a
    suspension (patch 3 in the module doc)."""
    from mode.utils.queues import FlowControlEvent

    if getattr(FlowControlEvent.resume, "_spanrl_patched", False):
        return
    original = FlowControlEvent.resume

    def resume(self) -> None:
        if self._suspend.is_set():
            original(self)  # ends a suspension: clears, as upstream
        else:
            self._resume.set()  # already flowing: the queued records are live, keep them

    resume._spanrl_patched = True
    FlowControlEvent.resume = resume



class ChangelogWrites:
    """Patch 5: the table keys written since the last commit, per table, with the changelog
    partition of each (the source partition of the event that wrote it). :meth:`flush`
    queues one changelog record per key - its value now, or a tombstone - in Faust's
    ProducerBuffer, which the commit then drains into the open transactions (patch 1). Only
    with ``processing_guarantee="exactly_once"``: elsewhere nothing would flush it, and
    writes go out one by one as upstream."""

    def __init__(self) -> None:
        self.keys: dict[object, dict[object, int]] = {}  # table -> key -> changelog partition
        self.noted = 0  # writes (sets and deletes) noted since start
        self.sent = 0  # changelog records sent for them

    def note(self, table, key, partition: int) -> None:
        """A write of ``key`` in ``table`` (partition: where its changelog record goes)."""
        self.keys.setdefault(table, {})[key] = partition
        self.noted += 1

    def flush(self) -> int:
        """Queue each noted key's changelog record (its table's value now, or a tombstone
        when the key is gone); returns how many. Synchronous: nothing can write between."""
        keys, self.keys = self.keys, {}
        n = 0
        for table, written in keys.items():
            data = table.data
            for key, partition in written.items():
                if key in data:
                    table.send_changelog(partition, key, data[key])
                else:  # deleted since: a tombstone
                    table.send_changelog(partition, key, None, value_serializer="raw")
                n += 1
        self.sent += n
        return n


def changelog_writes(app) -> ChangelogWrites:
    """The app's :class:`ChangelogWrites` (made on first use)."""
    return _of_app(app, "_spanrl_changelog_writes", ChangelogWrites)


def _install_coalesced_changelog_writes() -> None:
    """Patch 5 (module doc): in exactly-once mode a table write notes its key for the next
    commit instead of queueing a changelog record; a revocation flushes the noted keys into
    the transactions before they stop, as upstream's writes would have been."""
    from faust.tables.table import Table
    from faust.transport.consumer import TransactionManager

    if getattr(Table.on_key_set, "_spanrl_patched", False):
        return
    original_set, original_del = Table.on_key_set, Table.on_key_del
    original_revoked = TransactionManager.on_partitions_revoked

    def on_key_set(self, key, value) -> None:
        partition = self.partition_for_key(key) if self.app.in_transaction else None
        if partition is None:  # not exactly-once, or the producer's partitioner decides
            return original_set(self, key, value)
        changelog_writes(self.app).note(self, key, partition)
        self._maybe_set_key_ttl(key, partition)
        self._sensor_on_set(self, key, value)

    def on_key_del(self, key) -> None:
        partition = self.partition_for_key(key) if self.app.in_transaction else None
        if partition is None:
            return original_del(self, key)
        changelog_writes(self.app).note(self, key, partition)
        self._maybe_del_key_ttl(key, partition)
        self._sensor_on_del(self, key)

    async def on_partitions_revoked(self, revoked) -> None:
        changelog_writes(self.app).flush()
        await drain_producer_buffer(self.app.producer.buffer)
        return await original_revoked(self, revoked)

    for f in (on_key_set, on_key_del, on_partitions_revoked):
        f._spanrl_patched = True
    Table.on_key_set, Table.on_key_del = on_key_set, on_key_del
    TransactionManager.on_partitions_revoked = on_partitions_revoked
