"""The worker's tables read back on recovery what they write (stream_jobs/app.py)."""
from spanrl.stream_jobs.app import StreamConfig, make_app

def test_every_changelog_is_read_with_the_serializer_it_is_written_with():
    """Recovery decodes with the changelog topic's serializer (cloned for the recovery
    consumer), writes use the table's: they must agree."""
    app = make_app(StreamConfig(app_id="unit-tables"))
    seen = {}
    for name, table in app.tables.items():
        recovery_side = table.changelog_topic.clone()
        assert recovery_side.value_serializer == table.value_serializer, name
        seen[name] = table.value_serializer
    # the calls' token data and the waiting transitions are held in memory, not in tables:
    # they are re-read from spans / transitions after a restart (issue 11)
    assert sorted(seen) == ["groups", "orphans", "rollouts", "traces"]
    assert (seen["rollouts"], seen["orphans"]) == ("json", "raw")


def test_the_worker_leaves_the_root_logger_at_the_level_asked_for():
    """faust.Worker at -l warn sets the root logger to DEBUG for its spinner (every debug call
    then builds a LogRecord); the app's QuietWorker does not."""
    import logging

    import faust

    from spanrl.stream_jobs.app import QuietWorker

    app = make_app(StreamConfig(app_id="unit-worker"))
    assert app.conf.Worker is QuietWorker
    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    try:
        for cls, expected in ((faust.Worker, logging.DEBUG), (QuietWorker, logging.WARNING)):
            root.handlers[:] = [logging.NullHandler()]
            root.setLevel(logging.WARNING)
            worker = cls(app, loglevel="warn")
            worker.on_setup_root_logger(root, logging.WARNING)
            assert root.level == expected, cls
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]


def test_reads_of_one_spans_reader_do_not_interleave():
    """Two agents of one worker re-reading at once shared a consumer: the second read's assign
    broke the first one's seek (IllegalStateError, the grouper crashed mid-event). Reads are
    serialized: the second starts after the first returned."""
    import asyncio

    from spanrl.stream_jobs.spans_reader import SpansReader

    order = []

    class Probe(SpansReader):
        async def _read(self, positions, found):
            order.append(("start", positions[0][0]))
            await asyncio.sleep(0.05)
            order.append(("end", positions[0][0]))
            return found

    async def both():
        r = Probe("127.0.0.1:1")
        await asyncio.gather(r.read([("spans", 0, 1)]), r.read([("transitions", 0, 1)]))

    asyncio.run(both())
    assert order == [("start", "spans"), ("end", "spans"), ("start", "transitions"), ("end", "transitions")]
