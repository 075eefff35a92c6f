"""The one declaration of spanrl's Kafka topics: key, record type, partitions, retention.

The stack (``infra``) creates topics from this table and every producer and consumer
names topics through it, so a topic name is typed once. Topics keyed by rollout_id
share a partition count so that Faust can co-partition them (Faust docs, "Streams:
co-partitioning").
"""
from __future__ import annotations

from dataclasses import dataclass

from spanrl.core.settings import TopicSettings

DAY_MS = 24 * 3600 * 1000


@dataclass(frozen=True)
class Topic:
    """One Kafka topic.

    name: topic name; key: what the record key holds; record: spanrl.schemas.codec record type;
    partitions: partition count; retention_ms: -1 keeps forever;
    compact: log compaction (latest value per key) instead of deletion;
    max_message_bytes: broker-side per-record limit (Kafka ``max.message.bytes``).
    """

    name: str
    key: str
    record: str
    partitions: int
    retention_ms: int = 7 * DAY_MS
    compact: bool = False
    max_message_bytes: int = 4 * 1024 * 1024

    def config(self) -> dict[str, str]:
        """Topic-level configs for CreateTopics (Kafka doc: "Topic Configs")."""
        return {
            "retention.ms": str(self.retention_ms),
            "cleanup.policy": "compact" if self.compact else "delete",
            "max.message.bytes": str(self.max_message_bytes),
            "compression.type": "zstd",
        }


#: partitions of the rollout-keyed topics (and of tasks, transitions, the stream app's tables
#: and tick topics): ``SPANRL_ROLLOUT_PARTITIONS``, the same in every process of a deployment,
#: at least the number of Faust workers (infra/README.md, "Growing past one machine"). Fixed
#: once the topics exist: a keyed topic's partition count is part of where its keys live.
ROLLOUT_PARTITIONS = TopicSettings().rollout_partitions

SPANS = Topic("spans", "rollout_id", "span", ROLLOUT_PARTITIONS, retention_ms=-1)
REWARDS = Topic("rewards", "rollout_id", "reward", ROLLOUT_PARTITIONS, retention_ms=-1)
ROLLOUTS = Topic("rollouts", "rollout_id", "rollout", ROLLOUT_PARTITIONS, retention_ms=-1)
TASKS = Topic("tasks", "task_id", "task", ROLLOUT_PARTITIONS)
TRANSITIONS = Topic("transitions", "task_id", "transition", ROLLOUT_PARTITIONS, retention_ms=-1)
SAMPLES = Topic("samples", "task_id", "sample", 1, retention_ms=-1)
CHECKPOINTS = Topic("checkpoints", "run", "checkpoint", 1, retention_ms=-1, compact=False)
DEAD_LETTER = Topic("dead-letter", "rollout_id", "dead_letter", 1, retention_ms=-1)
#: one record per ended attempt: each LLM call, its resolved agent, trained or not (selective training)
CALL_ACCOUNTS = Topic("call-accounts", "rollout_id", "call_account", ROLLOUT_PARTITIONS, retention_ms=-1)
#: OTLP spans that carry no rollout id (a framework's own instrumentation, no spanrl rollout
#: context), keyed by trace id: the stream app joins them to the rollout attempt of a proxy
#: call of the same trace and writes them to ``spans`` (stream_jobs/joining.py), or
#: dead-letters them ``no_rollout_id``. Not a replay source: what joined is on ``spans``.
ORPHAN_SPANS = Topic("orphan-spans", "trace_id", "span", ROLLOUT_PARTITIONS)



def derived(base: Topic, suffix: str) -> Topic:
    """A topic shaped like ``base`` named ``base.name + '.' + suffix`` (replay outputs,
    evaluation topics)."""
    return Topic(f"{base.name}.{suffix}", base.key, base.record, base.partitions,
                 base.retention_ms, base.compact, base.max_message_bytes)


#: Evaluation records (``spanrl eval``, the release gate): the same shapes as the training
#: inputs under ``<name>.eval``. The proxy's ``/eval/...`` routes and the evaluator's runner
#: write them; no stream job or trainer reads them (one log, several consumers).
EVAL_SUFFIX = "eval"
SPANS_EVAL = derived(SPANS, EVAL_SUFFIX)
REWARDS_EVAL = derived(REWARDS, EVAL_SUFFIX)
ROLLOUTS_EVAL = derived(ROLLOUTS, EVAL_SUFFIX)
DEAD_LETTER_EVAL = derived(DEAD_LETTER, EVAL_SUFFIX)
TRAINING_INPUTS = (SPANS, REWARDS, ROLLOUTS)
EVAL_TOPICS = (SPANS_EVAL, REWARDS_EVAL, ROLLOUTS_EVAL, DEAD_LETTER_EVAL)

ALL: tuple[Topic, ...] = (SPANS, REWARDS, ROLLOUTS, TASKS, TRANSITIONS, SAMPLES, CHECKPOINTS, DEAD_LETTER, CALL_ACCOUNTS,
                          ORPHAN_SPANS, *EVAL_TOPICS)
BY_NAME = {t.name: t for t in ALL}
