"""Runner: takes tasks from Kafka, runs the agent ``group_size`` times per task.

Each attempt gets a fresh ``rollout_id`` and publishes its lifecycle on ``rollouts``
(``started``, then ``succeeded | failed | timeout``). The agent callable receives a
:class:`RolloutContext` whose ``base_url`` is the proxy's per-rollout OpenAI URL (with
``api_key`` to use there: the proxy's bearer token when ``SPANRL_AUTH_TOKEN`` is set), and
runs inside :func:`spanrl.producers.instrument.rollout_context`, so its OTel spans are stamped.
A task's offset is committed only after all its attempts published a terminal event; each
attempt's end commits the attempts finished so far in the commit's metadata, so that runners
sharing the consumer group hand tasks over without running a finished attempt again
(:meth:`Runner.run`).
"""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition

from spanrl.core.edge import token_value
from spanrl.producers import instrument, seeding
from spanrl.producers.kafka import KafkaUnavailable, Sink, Topics, now_ms
from spanrl.schemas import codec

log = logging.getLogger("spanrl.runner")
NO_API_KEY = "spanrl"  # what an OpenAI client sends when the proxy has no token (it must send something)


@dataclass
class RolloutContext:
    """What the agent callable gets for one attempt: the task, the proxy URL its LLM calls go
    to (each call is recorded and trained on), and :meth:`emit_reward`.

    Example::

        import openai

        async def my_agent(ctx: spanrl.RolloutContext) -> None:
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
            reply = await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": ctx.task["question"]}])
            correct = reply.choices[0].message.content.strip() == ctx.task["answer"]
            ctx.emit_reward(float(correct), correct=float(correct))
    """

    task: dict          # the task payload (parsed JSON)
    task_id: str
    rollout_id: str
    attempt_id: str
    base_url: str       # OpenAI base URL through the proxy for this attempt
    rewards: list[dict] = field(default_factory=list)
    #: the OpenAI ``api_key`` for ``base_url``: the proxy's bearer token when auth is on
    #: (``SPANRL_AUTH_TOKEN``), else a placeholder the proxy ignores
    api_key: str = field(default=NO_API_KEY, repr=False)

    def emit_reward(self, value: float, final: bool = True, name: str = "reward",
                    span_id: str | None = None, **components: float) -> None:
        """Record a reward; the runner produces it to ``rewards`` before the terminal event."""
        instrument.check_reward(value, components)
        self.rewards.append({
            "rollout_id": self.rollout_id, "attempt_id": self.attempt_id, "value": float(value),
            "final": bool(final), "name": name, "span_id": span_id, "timestamp_ms": now_ms(),
            "components": {k: float(v) for k, v in components.items()},
        })


@dataclass
class AttemptResult:
    task_id: str
    rollout_id: str
    attempt_id: str
    status: str                     # succeeded | failed | timeout
    error: str | None = None
    result: Any = None


def make_task(payload: Any, group_size: int = 4, task_id: str | None = None, timeout_s: float = 120.0) -> dict:
    """A Task record (payload dicts are JSON-encoded): each runner that takes it runs the agent
    ``group_size`` times on it (one GRPO group).

    Example: ``make_task({"question": "2 + 2?", "answer": "4"}, group_size=6, task_id="t1")``
    -> ``{"task_id": "t1", "payload": '{"question": "2 + 2?", "answer": "4"}', "group_size": 6,
    "timeout_s": 120.0, "created_ms": ...}``."""
    return {"task_id": task_id or uuid.uuid4().hex,
            "payload": payload if isinstance(payload, str) else json.dumps(payload),
            "group_size": group_size, "timeout_s": timeout_s, "created_ms": now_ms()}


async def publish_tasks(tasks: list[dict], bootstrap: str | None = None, topics: Topics | None = None,
                        settings=None) -> list[str]:
    """Produce Task records (see :func:`make_task`; missing fields filled) keyed by task_id.

    ``bootstrap`` defaults to ``settings.kafka_bootstrap`` (``settings``: infra Settings,
    default ``get_settings()``). Returns the task ids.

    Example::

        await spanrl.publish_tasks([spanrl.make_task({"question": "2 + 2?", "answer": "4"})])
    """
    if bootstrap is None:
        from spanrl.core.settings import get_settings

        bootstrap = (settings or get_settings()).kafka_bootstrap
    sink = Sink(bootstrap, topics)
    records = [{**make_task(t.get("payload", "{}"), t.get("group_size", 4), t.get("task_id"),
                            t.get("timeout_s", 120.0)), **t} for t in tasks]
    try:
        await sink.produce([(sink.topics.tasks, r["task_id"], r) for r in records])
    finally:
        await sink.stop()
    return [r["task_id"] for r in records]


#: Kafka's default limit on a commit's metadata (broker ``offset.metadata.max.bytes``)
COMMIT_METADATA_MAX = 4096


def progress_metadata(done: dict[int, set[int]], limit: int = COMMIT_METADATA_MAX) -> str:
    """A partition commit's metadata: the finished attempt indices of the tasks at or past the
    committed offset (``{offset: indices}``), as compact JSON, nearest offsets first; offsets
    that would take it past ``limit`` bytes are left out (their finished attempts would run
    again after a hand-over)."""
    kept: dict[str, list[int]] = {}
    for offset in sorted(done):
        if not done[offset]:
            continue
        trial = {**kept, str(offset): sorted(done[offset])}
        if len(json.dumps({"attempts_done": trial}, separators=(",", ":"))) > limit:
            break
        kept = trial
    return json.dumps({"attempts_done": kept}, separators=(",", ":")) if kept else ""


def parse_progress(metadata: str | None) -> dict[int, frozenset[int]]:
    """:func:`progress_metadata`'s ``{offset: indices}`` back; {} for none or for metadata
    another client wrote."""
    try:
        raw = json.loads(metadata)["attempts_done"] if metadata else {}
        return {int(o): frozenset(int(i) for i in idx) for o, idx in raw.items()}
    except (ValueError, TypeError, KeyError, AttributeError):
        return {}


class _OffsetTracker:
    """Per partition of the tasks topic: the commit offset = one past the longest prefix of
    finished tasks, and the attempts finished of the tasks after it (the commit's metadata,
    :func:`progress_metadata`), so that a runner taking the partition over runs only the
    attempts that did not finish."""

    def __init__(self) -> None:
        self.pending: dict[TopicPartition, list[int]] = {}
        self.done: dict[TopicPartition, set[int]] = {}
        self.attempts: dict[TopicPartition, dict[int, set[int]]] = {}

    def start(self, tp: TopicPartition, offset: int, done_before: frozenset[int] = frozenset()) -> None:
        """Task at ``offset`` started; ``done_before``: its attempts a previous owner finished."""
        self.pending.setdefault(tp, []).append(offset)
        if done_before:
            self.attempts.setdefault(tp, {})[offset] = set(done_before)

    def attempt_done(self, tp: TopicPartition, offset: int, index: int) -> tuple[int, str]:
        """Attempt ``index`` of the task at ``offset`` finished: the partition's commit now,
        (offset, metadata). The offset stays at the first unfinished task."""
        self.attempts.setdefault(tp, {}).setdefault(offset, set()).add(index)
        return self.commit_point(tp)

    def finish(self, tp: TopicPartition, offset: int) -> int | None:
        """The task at ``offset`` finished: the new commit offset when the finished prefix grew."""
        self.done.setdefault(tp, set()).add(offset)
        commit = None
        pend = self.pending[tp]
        while pend and pend[0] in self.done[tp]:
            self.done[tp].discard(pend[0])
            self.attempts.get(tp, {}).pop(pend[0], None)
            commit = pend.pop(0) + 1
        return commit

    def commit_point(self, tp: TopicPartition) -> tuple[int, str] | None:
        """(offset, metadata) to commit for ``tp``: the first unfinished task and the attempts
        finished at or past it; None when no task of ``tp`` is pending."""
        pend = self.pending.get(tp)
        if not pend:
            return None
        return pend[0], progress_metadata({o: a for o, a in self.attempts.get(tp, {}).items() if o >= pend[0]})

    def forget(self, tps) -> None:
        """The partitions went to another runner (after their tasks were drained)."""
        for tp in tps:
            self.pending.pop(tp, None)
            self.done.pop(tp, None)
            self.attempts.pop(tp, None)


class _HandOver(ConsumerRebalanceListener):
    """aiokafka's rebalance callbacks, to the runner's consumer loop (:meth:`Runner.run`)."""

    def __init__(self, revoked: Callable[[set], Awaitable[None]], assigned: Callable[[set], Awaitable[None]]):
        self._revoked, self._assigned = revoked, assigned

    async def on_partitions_revoked(self, revoked) -> None:
        await self._revoked(set(revoked))

    async def on_partitions_assigned(self, assigned) -> None:
        await self._assigned(set(assigned))


class Runner:
    """Runs ``agent(ctx)`` (sync in a thread, or async) for every task of the tasks topic,
    ``group_size`` attempts each, ``ctx`` a :class:`RolloutContext`.

    Example::

        import asyncio

        asyncio.run(spanrl.Runner(my_agent, concurrency=4).run())  # until stopped
    """

    def __init__(self, agent: Callable[[RolloutContext], Any], group_size_default: int = 4,
                 timeout_s: float | None = None, concurrency: int = 8, group_id: str = "spanrl-runners",
                 bootstrap: str | None = None, proxy_url: str | None = None, topics: Topics | None = None,
                 runner_id: str | None = None, settings=None, record_to: str | None = None,
                 telemetry: bool = True, external_spans: bool = False, seed: int | None = None):
        """``record_to="eval"``: evaluation episodes (their OTel spans go to the evaluation
        topics; see :func:`spanrl.producers.instrument.rollout_context`). ``telemetry``: make sure
        this process exports OTel spans to the bridge, the agent frameworks' included
        (:func:`spanrl.producers.instrument.ensure_instrumented`), so that each LLM call's agent is
        known from the framework's own spans. ``external_spans``: the agent's spans also come
        from an exporter this runner cannot flush (another process, its own tracer provider);
        its terminal events then do not claim ``inputs_acked`` and the stream job waits its
        ``settle_s`` grace for them (stream_jobs/assembly.py). ``seed``: the run seed (default
        ``SPANRL_SEED``; None: unseeded); each attempt's LLM requests then carry sampling seeds
        derived from it, the task, the rollout's index and the attempt (producers/seeding.py)."""
        from spanrl.core.settings import get_settings

        s = settings or get_settings()
        self.record_to = record_to
        self.seed = s.seed if seed is None else seed
        self.external_spans = external_spans
        if telemetry:
            instrument.ensure_instrumented(runner_id or "spanrl-runner", bridge_url=s.bridge_url,
                                           auth_token=s.auth_token)
        self.agent = agent
        self.group_size_default = group_size_default
        self.timeout_s = timeout_s  # None: the task's timeout_s
        self.concurrency = concurrency
        self.group_id = group_id
        self.bootstrap = bootstrap or s.kafka_bootstrap
        self.proxy_url = (proxy_url or s.proxy_url).rstrip("/")
        self.topics = topics or Topics.from_env()
        self.runner_id = runner_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.sink = Sink(self.bootstrap, self.topics, send_timeout_s=s.kafka_send_timeout_s)
        self.api_key = token_value(s.auth_token) or NO_API_KEY
        self._slots = asyncio.Semaphore(concurrency)
        #: how long lifecycle/reward records and task commits are retried while Kafka is down
        self.kafka_deadline_s = 300.0

    async def _retrying(self, what: str, op: Callable[[], Any]) -> Any:
        """Await ``op()`` until it succeeds; retry Kafka errors with backoff (1 s doubling to
        10 s) for ``kafka_deadline_s``, then re-raise. A lifecycle record that never reached
        Kafka would leave its attempt to the stream job's rollout timeout."""
        from aiokafka.errors import KafkaError

        deadline, wait = time.monotonic() + self.kafka_deadline_s, 1.0
        while True:
            try:
                return await op()
            except (KafkaUnavailable, KafkaError, OSError) as exc:
                if time.monotonic() + wait > deadline:
                    raise
                log.warning("%s: %s; retrying in %.0fs", what, exc, wait)
                await asyncio.sleep(wait)
                wait = min(10.0, wait * 2)

    # ---- one attempt
    def _event(self, ctx: RolloutContext, status: str, group_size: int, error: str | None = None,
               inputs_acked: bool = False) -> dict:
        return {"rollout_id": ctx.rollout_id, "attempt_id": ctx.attempt_id, "task_id": ctx.task_id,
                "status": status, "group_size": group_size, "runner_id": self.runner_id,
                "timestamp_ms": now_ms(), "error": error, "inputs_acked": inputs_acked}

    async def run_attempt(self, task: dict, index: int = 0) -> AttemptResult:
        """Run one attempt of ``task``; ``index``: the rollout's index in its group (or an
        evaluation's sample index), part of its sampling seed."""
        rollout_id, attempt_id = uuid.uuid4().hex, "0"
        sampling_seed = None if self.seed is None else \
            seeding.rollout_seed(self.seed, task["task_id"], index, attempt_id)
        group_size = int(task.get("group_size") or self.group_size_default)
        timeout = self.timeout_s if self.timeout_s is not None else float(task.get("timeout_s") or 120.0)
        try:
            payload = json.loads(task["payload"]) if task.get("payload") else {}
        except ValueError:
            payload = {"text": task["payload"]}
        ctx = RolloutContext(payload, task["task_id"], rollout_id, attempt_id,
                             f"{self.proxy_url}/rollouts/{rollout_id}/attempts/{attempt_id}/v1",
                             api_key=self.api_key)
        async with self._slots:
            started = [(self.topics.rollouts, rollout_id, self._event(ctx, "started", group_size))]
            await self._retrying(f"rollout {rollout_id} started", lambda: self.sink.produce(started))
            status, error, result = "succeeded", None, None
            try:
                with instrument.rollout_context(rollout_id, attempt_id, record_to=self.record_to,
                                                sampling_seed=sampling_seed):
                    if inspect.iscoroutinefunction(self.agent):
                        coro = self.agent(ctx)
                    else:  # to_thread copies the context, so the thread's spans are stamped too
                        coro = asyncio.to_thread(self.agent, ctx)
                    result = await asyncio.wait_for(coro, timeout)
                if isinstance(result, (int, float)) and not isinstance(result, bool):
                    ctx.emit_reward(float(result), final=True)
            except asyncio.TimeoutError:
                status, error = "timeout", f"attempt exceeded {timeout}s"
            except Exception as exc:  # noqa: BLE001 - the agent's failure is data
                status, error = "failed", f"{type(exc).__name__}: {exc}"[:2000]
            # The terminal event goes out only after Kafka acknowledged every record of the
            # attempt: the proxy acks each call's span before it answers, the flush exports the
            # OTel spans to the bridge (which answers after its Kafka ack), and the rewards are
            # produced first. So the event may say inputs_acked, and the stream job emits the
            # attempt as soon as it has read up to where the partitions ended at this event.
            flushed = await asyncio.to_thread(instrument.flush)
            rewards = [(self.topics.rewards, rollout_id, r) for r in ctx.rewards]
            await self._retrying(f"rollout {rollout_id} rewards", lambda: self.sink.produce(rewards))
            end = [(self.topics.rollouts, rollout_id,
                    self._event(ctx, status, group_size, error, inputs_acked=flushed and not self.external_spans))]
            await self._retrying(f"rollout {rollout_id} {status}", lambda: self.sink.produce(end))
        log.info("task %s rollout %s: %s%s", ctx.task_id, rollout_id, status, f" ({error})" if error else "")
        return AttemptResult(ctx.task_id, rollout_id, attempt_id, status, error, result)

    async def run_task(self, task: dict, skip: frozenset[int] = frozenset(),
                       finished: Callable[[int], Awaitable[None]] | None = None) -> list[AttemptResult]:
        """The task's attempts (indices ``0 .. group_size - 1``) but those in ``skip`` (finished
        by a previous owner of its partition), at once; ``finished(index)`` is awaited after
        each attempt's terminal event."""
        n = int(task.get("group_size") or self.group_size_default)

        async def attempt(k: int) -> AttemptResult:
            result = await self.run_attempt(task, k)
            if finished is not None:
                await finished(k)
            return result
        return list(await asyncio.gather(*(attempt(k) for k in range(n) if k not in skip)))

    async def run_tasks(self, tasks: list[dict]) -> list[list[AttemptResult]]:
        """Run a fixed batch of Task dicts directly (no tasks topic, no consumer group)."""
        try:
            return list(await asyncio.gather(*(self.run_task({**make_task("{}"), **t}) for t in tasks)))
        finally:
            await self.sink.stop()

    # ---- the consumer loop
    async def run(self, max_tasks: int | None = None, stop_event: asyncio.Event | None = None,
                  idle_timeout_s: float | None = None) -> list[list[AttemptResult]]:
        """Consume tasks until ``max_tasks`` are done, ``stop_event`` is set or no task came
        for ``idle_timeout_s``; in-flight tasks are finished and committed before returning.

        Several runners share the consumer group (``group_id``). After each attempt's terminal
        event the runner commits its partition: the offset of the first unfinished task, with
        the attempts finished past it in the commit's metadata (:class:`_OffsetTracker`). When
        the group rebalances (a runner joins or leaves), the runner finishes the tasks it has
        in flight before it lets its partitions go (aiokafka's ``on_partitions_revoked``), so
        the next owner starts after them; on being assigned partitions it reads their commits'
        metadata and, of the tasks there, runs only the attempts not finished. A runner killed
        mid-task leaves its unfinished attempts ``started`` (the stream job times them out);
        the next owner runs those attempts again under new rollout ids, the finished ones not.
        One window remains: an attempt whose terminal event Kafka acknowledged just before the
        kill, its commit not yet made, runs again."""
        from aiokafka.admin import AIOKafkaAdminClient
        from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

        tracker, results, inflight = _OffsetTracker(), [], set()
        resumed: dict[TopicPartition, dict[int, frozenset[int]]] = {}
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        task_slots = asyncio.Semaphore(max(1, self.concurrency))
        commit_lock = asyncio.Lock()
        draining = asyncio.Event()  # a rebalance is under way: start nothing
        started = 0
        stop_event = stop_event or asyncio.Event()
        last_msg = time.monotonic()

        async def revoked(tps: set) -> None:
            draining.set()
            if inflight:
                log.info("rebalance: finishing %d task(s) before partitions %s go", len(inflight), sorted(tps))
                await asyncio.gather(*list(inflight), return_exceptions=True)
            tracker.forget(tps)
            for tp in tps:
                resumed.pop(tp, None)

        async def assigned(tps: set) -> None:
            try:
                committed = await self._retrying("committed offsets", lambda: admin.list_consumer_group_offsets(
                    self.group_id, partitions=sorted(tps))) if tps else {}
            except (KafkaError, OSError) as exc:
                log.error("partitions %s: their commits unread (%s); finished attempts of tasks there may run "
                          "again", sorted(tps), exc)
                committed = {}
            finally:
                draining.clear()
            for tp, meta in committed.items():
                progress = parse_progress(meta.metadata)
                if progress:
                    resumed[tp] = progress
                    log.info("partition %s: resuming tasks with finished attempts %s", tp, progress)

        consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, group_id=self.group_id,
                                    enable_auto_commit=False, auto_offset_reset="earliest")

        async def commit(tp: TopicPartition, point: tuple[int, str] | None) -> None:
            """Commit ``point`` for ``tp`` (with the lock held); a partition that went to
            another runner meanwhile is not committed (that runner resumes from the last commit)."""
            if point is None:
                return

            async def op() -> None:
                try:
                    await consumer.commit({tp: point})
                except (CommitFailedError, IllegalStateError) as exc:
                    log.warning("commit %s@%s refused (%s): the partition moved to another runner", tp, point, exc)
            await self._retrying(f"commit {tp.topic}:{tp.partition}@{point}", op)

        async def handle(msg) -> None:
            tp = TopicPartition(msg.topic, msg.partition)
            try:
                try:
                    task = codec.decode(self.topics.tasks.record, msg.value)
                except codec.SchemaError as exc:
                    await self.sink.produce([(self.topics.dead_letter, None, {
                        "reason": exc.reason, "detail": exc.detail, "stage": "runner",
                        "source_topic": msg.topic, "source_partition": msg.partition, "source_offset": msg.offset,
                        "rollout_id": None, "task_id": msg.key.decode(errors="replace") if msg.key else None,
                        "payload": msg.value, "timestamp_ms": now_ms()})])
                else:
                    async def finished(index: int) -> None:
                        async with commit_lock:
                            await commit(tp, tracker.attempt_done(tp, msg.offset, index))
                    skip = resumed.get(tp, {}).get(msg.offset, frozenset())
                    ran = await self.run_task(task, skip, finished)
                    if ran:  # [] when a previous owner finished every attempt
                        results.append(ran)
                async with commit_lock:
                    if (offset := tracker.finish(tp, msg.offset)) is not None:  # with the later tasks' progress
                        await commit(tp, tracker.commit_point(tp) or (offset, ""))
            finally:
                task_slots.release()

        await admin.start()
        try:
            await consumer.start()
            consumer.subscribe([self.topics.tasks.name], listener=_HandOver(revoked, assigned))  # aiokafka's order
            try:
                while not stop_event.is_set() and (max_tasks is None or started < max_tasks):
                    await task_slots.acquire()
                    batch = await consumer.getmany(timeout_ms=500, max_records=1)
                    msgs = [m for ms in batch.values() for m in ms]
                    if not msgs or draining.is_set():  # fetched before a rebalance: the next owner reads it again
                        task_slots.release()
                        if idle_timeout_s is not None and time.monotonic() - last_msg > idle_timeout_s:
                            break
                        continue
                    last_msg = time.monotonic()
                    msg = msgs[0]
                    tp = TopicPartition(msg.topic, msg.partition)
                    tracker.start(tp, msg.offset, resumed.get(tp, {}).get(msg.offset, frozenset()))
                    started += 1
                    t = asyncio.create_task(handle(msg))
                    inflight.add(t)
                    t.add_done_callback(inflight.discard)
                if inflight:
                    await asyncio.gather(*inflight)
            finally:
                await consumer.stop()
        finally:
            await admin.close()
            await self.sink.stop()
        return results
