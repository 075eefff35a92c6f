"""stream_jobs/faust_patches.py: the installed Faust is one the patches were verified
against, and install() patches each internal once."""
from faust.transport.consumer import TransactionManager
from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread
from faust.transport.producer import ProducerBuffer
from mode.utils.queues import FlowControlEvent

from spanrl.stream_jobs import faust_patches


def test_installed_faust_is_a_verified_version():
    # an upgrade fails here on purpose: re-verify (make chaos, worker fault), then add it
    assert faust_patches.check_version() in faust_patches.VERIFIED_VERSIONS


def _patched_internals() -> tuple:
    from faust.tables.table import Table

    return (TransactionManager.send, TransactionManager.commit, ProducerBuffer._send_pending,
            AIOKafkaConsumerThread._highwaters, FlowControlEvent.resume, Table.on_key_set, Table.on_key_del,
            TransactionManager.on_partitions_revoked)


def test_install_patches_each_internal_once():
    faust_patches.install()
    patched = _patched_internals()
    assert all(getattr(f, "_spanrl_patched", False) for f in patched)
    faust_patches.install()  # idempotent: the same functions, not wrappers of wrappers
    assert _patched_internals() == patched


def test_resume_of_a_flowing_queue_keeps_its_records():
    """The records the fetcher hands an agent while Recovery awaits its seek sit in a
    clear_on_resume queue when Recovery calls flow_control.resume() on a flow that is already
    active; upstream that resume() dropped them (after their read offset had passed them)."""
    import asyncio

    from mode.utils.queues import FlowControlQueue

    faust_patches.install()

    async def main():
        flow = FlowControlEvent(initially_suspended=False)
        q = FlowControlQueue(flow_control=flow, clear_on_resume=True)
        await q.put("span@28")
        flow.resume()  # already flowing: nothing is dropped
        kept = q.qsize()
        flow.suspend()  # a rebalance: ending the suspension still clears, as upstream
        flow.resume()
        return kept, q.qsize()

    assert asyncio.run(main()) == (1, 0)


# Each patch against a stand-in for the Faust object it patches: these fail without it
# (checked by disabling each patch in install(): see the report of issue 22 item 3).

import asyncio  # noqa: E402
import weakref  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
from faust.streams import _current_event  # noqa: E402
from faust.types import TP  # noqa: E402


class _Recorder:
    """A producer stand-in: what was sent, with which transactional id; what was committed."""

    def __init__(self, log=None):
        self.sent, self.log = [], log if log is not None else []

    async def send(self, topic, key, value, partition, timestamp, headers, *, transactional_id=None):
        self.sent.append((topic, partition, transactional_id))

    async def flush(self):
        self.log.append("flush")

    async def commit_transactions(self, by_transactional_id, group_id, start_new_transaction=True):
        self.log.append(("commit", {t: dict(o) for t, o in by_transactional_id.items()}))


def _manager(producer, log=None):
    """A TransactionManager's attributes as its send and commit read them: app id "app",
    co-partition groups 0 (the rollout inputs) and 1 (transitions), no group for an output
    the app only writes; the consumer's partitioner puts every keyed record on partition 3."""
    groups = {"spans": 0, "rewards": 0, "transitions": 1}
    return SimpleNamespace(
        app=SimpleNamespace(conf=SimpleNamespace(id="app"),
                            assignor=SimpleNamespace(group_for_topic=lambda t: groups[t]),
                            producer=SimpleNamespace(buffer=None)),
        consumer=SimpleNamespace(key_partition=lambda topic, key, partition: 3 if partition is None else partition),
        producer=producer)


def test_a_record_sent_while_handling_an_event_joins_its_source_partitions_transaction():
    """Patch 1 (send): upstream picks the transaction from the destination (samples has no
    co-partition group: KeyError; transitions partition 3: another transaction than the
    span's, committed on its own)."""
    faust_patches.install()
    producer = _Recorder()
    tm = _manager(producer)
    class Event:  # Faust holds the current event by weak reference
        message = SimpleNamespace(tp=TP("spans", 2))

    event = Event()

    async def handle():
        token = _current_event.set(weakref.ref(event))
        try:
            await TransactionManager.send(tm, "samples", b"t", b"v", None, None, None)
            await TransactionManager.send(tm, "transitions", b"t", b"v", None, None, None)
        finally:
            _current_event.reset(token)

    asyncio.run(handle())
    assert producer.sent == [("samples", None, "app-0-2"), ("transitions", None, "app-0-2")]


class _Channel:
    """Where the producer buffer's writes end up (a changelog topic): each takes 10 ms."""

    def __init__(self, log):
        self.log = log

    async def publish_message(self, fut, wait: bool = False):
        await asyncio.sleep(0.01)
        self.log.append(("changelog", fut.message.key))


def test_a_commit_carries_the_changelog_writes_queued_before_it():
    """Patch 1 (commit): upstream commits the offsets with the table writes still queued in
    Faust's ProducerBuffer (a crash then loses them while their inputs' offsets are committed)."""
    from faust.types.tuples import FutureMessage, PendingMessage

    faust_patches.install()
    log: list = []
    tm = _manager(_Recorder(log), log)

    async def main():
        buf = ProducerBuffer()
        buf.app = SimpleNamespace(conf=SimpleNamespace(producer_threaded=False))
        ch = _Channel(log)
        for key in ("rollout-a", "rollout-b"):
            buf.put(FutureMessage(PendingMessage(ch, key, b"state", 0, None, None, None, None, None)))
        tm.app.producer.buffer = buf
        await TransactionManager.commit(tm, {TP("spans", 2): 41})

    asyncio.run(main())
    assert log == [("changelog", "rollout-a"), ("changelog", "rollout-b"), "flush",
                   ("commit", {"app-0-2": {TP("spans", 2): 41}})]


def test_a_commit_waits_for_the_event_being_handled_and_holds_the_next_off():
    """Patch 4: upstream's timer commit runs beside the agents, so an agent's state write and
    first outputs could be committed while its later sends (each ``await topic.send()`` yields
    to the loop) went into the next transaction - lost with it on a SIGKILL, while the
    re-delivered event finds the state that says they were made. Patched: the commit waits for
    the event being handled; an event that comes while it waits is handled after it; two
    agents still handle their events side by side."""
    faust_patches.install()
    log: list = []
    tm = _manager(_Recorder(log), log)

    async def agent(name: str, start_s: float) -> None:
        await asyncio.sleep(start_s)
        async with faust_patches.handling(tm.app):
            log.append((name, "state"))
            await asyncio.sleep(0.03)  # a send that yields to the loop
            log.append((name, "samples"))

    async def commit(start_s: float) -> None:
        await asyncio.sleep(start_s)
        await TransactionManager.commit(tm, {TP("transitions", 1): 8})

    async def main():
        buf = ProducerBuffer()
        buf.app = SimpleNamespace(conf=SimpleNamespace(producer_threaded=False))
        tm.app.producer.buffer = buf
        await asyncio.gather(agent("group", 0), agent("assemble", 0.005), commit(0.01), agent("join", 0.02))
        barrier = faust_patches.event_barrier(tm.app)
        return barrier.handling_now, barrier.committing_now

    assert asyncio.run(main()) == (0, 0)
    assert log == [("group", "state"), ("assemble", "state"), ("group", "samples"), ("assemble", "samples"),
                   "flush", ("commit", {"app-1-1": {TP("transitions", 1): 8}}),
                   ("join", "state"), ("join", "samples")]


def test_recovery_reads_each_changelogs_end_from_the_broker():
    """Patch 2: in a transaction upstream takes the last stable offset from the fetch state,
    unknown (-1 here, as aiokafka answers before a fetch) at recovery: every changelog reads
    as empty. Patched: ListOffsets (end_offsets, read_committed) from the broker."""
    faust_patches.install()
    tp = TP("app-rollouts-changelog", 1)

    class Consumer:
        def last_stable_offset(self, tp):
            return -1  # nothing fetched yet

        async def end_offsets(self, partitions):
            return {p: 57 for p in partitions}

    thread = SimpleNamespace(_ensure_consumer=lambda: Consumer(),
                             consumer=SimpleNamespace(in_transaction=True))
    assert asyncio.run(AIOKafkaConsumerThread._highwaters(thread, [tp])) == {tp: 57}


@pytest.mark.parametrize("dist,installed", [("faust-streaming", "0.16.0"), ("mode-streaming", "0.8.0")])
def test_an_unverified_faust_is_refused_with_what_to_do(monkeypatch, dist, installed):
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: installed if d == dist else real(d))
    with pytest.raises(RuntimeError) as exc:
        faust_patches.check_version()
    verified = faust_patches.VERIFIED_VERSIONS if dist == "faust-streaming" else faust_patches.VERIFIED_MODE_VERSIONS
    assert str(exc.value).startswith(
        f"{dist} {installed} is installed, but stream_jobs/faust_patches.py was verified against "
        f"{', '.join(verified)} only: install one of those")
    assert f"add {installed} to its verified versions" in str(exc.value)


def test_the_worker_refuses_an_unverified_faust_at_start_up(monkeypatch):
    """make_app (what ``python -m spanrl.stream_jobs.app worker`` runs at import) checks the
    version before it builds anything."""
    import importlib.metadata

    import faust

    from spanrl.stream_jobs.app import StreamConfig, make_app

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda d: "0.16.0" if d == "faust-streaming" else real(d))
    built = []
    monkeypatch.setattr(faust, "App", lambda *a, **kw: built.append(a))
    with pytest.raises(RuntimeError, match=r"^faust-streaming 0\.16\.0 is installed"):
        make_app(StreamConfig(app_id="unit-unverified"))
    assert built == []


class _Table:
    """A Faust Table as patch 5 uses it: writes go through ``Table.on_key_set`` /
    ``on_key_del`` before the store changes (as mode's ManagedUserDict does); the changelog
    partition is the current event's (3 here); each changelog record sent is logged."""

    def __init__(self, app, log):
        self.app, self.log, self.data = app, log, {}

    def __setitem__(self, key, value):
        from faust.tables.table import Table
        Table.on_key_set(self, key, value)
        self.data[key] = value

    def __delitem__(self, key):
        from faust.tables.table import Table
        Table.on_key_del(self, key)
        del self.data[key]

    def partition_for_key(self, key):
        return 3

    def send_changelog(self, partition, key, value, key_serializer=None, value_serializer=None):
        self.log.append(("changelog", partition, key, dict(value) if value is not None else None))
        return SimpleNamespace(message=SimpleNamespace(partition=partition))

    def _maybe_set_key_ttl(self, key, partition):
        pass

    _maybe_del_key_ttl = _maybe_set_key_ttl

    def _sensor_on_set(self, table, key, value):
        pass

    def _sensor_on_del(self, table, key):
        pass


def _writes_between_two_commits(in_transaction: bool):
    faust_patches.install()
    log: list = []
    tm = _manager(_Recorder(log), log)
    tm.app.in_transaction = in_transaction

    async def main():
        buf = ProducerBuffer()
        buf.app = SimpleNamespace(conf=SimpleNamespace(producer_threaded=False))
        tm.app.producer.buffer = buf
        rollouts = _Table(tm.app, log)
        state = {"calls": 0}
        for _ in range(3):  # the same rollout state updated by three spans
            state["calls"] += 1
            rollouts["rollout-a"] = state
        rollouts["rollout-b"] = {"calls": 1}
        del rollouts["rollout-b"]  # evicted in the same transaction
        await TransactionManager.commit(tm, {TP("spans", 3): 12})

    asyncio.run(main())
    return log, faust_patches.changelog_writes(tm.app)


def test_a_commit_writes_each_changed_table_key_once_with_its_last_value():
    """Patch 5: upstream queues a changelog record on every table write (here 5 records for 2
    keys, the first two of rollout-a already stale when they are sent). Patched: one record
    per key, its value at the commit (or a tombstone), before the offsets' commit."""
    log, writes = _writes_between_two_commits(in_transaction=True)
    assert log == [("changelog", 3, "rollout-a", {"calls": 3}), ("changelog", 3, "rollout-b", None),
                   "flush", ("commit", {"app-0-3": {TP("spans", 3): 12}})]
    assert (writes.noted, writes.sent, writes.keys) == (5, 2, {})


def test_without_transactions_every_table_write_is_sent_as_upstream():
    """Nothing but the transactional commit flushes the noted keys, so without exactly-once
    the writes go out one by one (no key may wait for a flush that never comes)."""
    log, writes = _writes_between_two_commits(in_transaction=False)
    assert [entry[2] for entry in log if entry[0] == "changelog"] == \
        ["rollout-a", "rollout-a", "rollout-a", "rollout-b", "rollout-b"]
    assert (writes.noted, writes.sent) == (0, 0)


def test_a_revocation_sends_the_noted_writes_before_its_transactions_stop():
    """Patch 5 at a rebalance: Faust flushes the producer (``TransactionManager.on_partitions_revoked``)
    before it stops the revoked partitions' transactions; the noted keys go into them first,
    where upstream's queued writes would have been (fails with the key noting but without
    the revocation's flush: the write would wait for a commit of a transaction that stops)."""
    faust_patches.install()
    log: list = []
    tm = _manager(_Recorder(log), log)
    tm.app.in_transaction = True
    tm.flush = tm.producer.flush

    async def main():
        buf = ProducerBuffer()
        buf.app = SimpleNamespace(conf=SimpleNamespace(producer_threaded=False))
        tm.app.producer.buffer = buf
        groups = _Table(tm.app, log)
        groups["task-7"] = {"open": 1}
        await TransactionManager.on_partitions_revoked(tm, {TP("transitions", 3)})

    asyncio.run(main())
    assert log == [("changelog", 3, "task-7", {"open": 1}), "flush"]
