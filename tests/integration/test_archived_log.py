"""An archived log, on the real stack: tests/fixtures/archived/topic_dump.jsonl (two rollouts of
one task: rollout events, proxy spans and final rewards, written with the 0x53 framing and span,
reward and rollout v1, before the Confluent wire format and span v2) is restored into the
stack's topics (spanrl/infra/topic_dump.py, timestamps moved to now), replayed over its time
window into ``*.<suffix>`` topics, and a run trained from the base model on the replay's samples
publishes version 1.

The dump's returns are 1 and 0 for one group of two: GRPO advantages +1 and -1 (mean 0.5,
population std 0.5); each transition carries the recorded token ids and log-probs.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest

from spanrl.infra.replay import ReplayConfig, output_topics, read_topic, replay
from spanrl.infra.topic_dump import parse_dump, restore, shifted
from spanrl.schemas import decode
from spanrl.trainer import checkpoint

pytestmark = pytest.mark.integration

ARCHIVE = Path(__file__).parents[1] / "fixtures" / "archived" / "topic_dump.jsonl"


def test_an_archived_log_restores_replays_and_trains(stack, settings, scratch_run):
    records = parse_dump(ARCHIVE.read_text())
    restored_at = int(time.time() * 1000)
    records = shifted(records, restored_at)
    since_ms = min(r.timestamp_ms for r in records)
    counts = asyncio.run(restore(settings.kafka_bootstrap, records))
    assert counts == {"rollouts": 4, "spans": 2, "rewards": 2}
    time.sleep(1.5)
    until_ms = int(time.time() * 1000)

    suffix = f"arc{uuid.uuid4().hex[:8]}"
    scratch_run(f"replay-{suffix}")
    result = replay(ReplayConfig(suffix=suffix, since_ms=since_ms, until_ms=until_ms, train_from="base",
                                 train_updates=1, train_max_batch=2, timeout_s=300, quiet_s=4))

    spans = {r.key.decode(): decode("span", r.value)["llm"] for r in records if r.topic == "spans"}
    transitions_topic, samples_topic, _, _ = output_topics(suffix)
    mine = [t for t in asyncio.run(read_topic(settings.kafka_bootstrap, transitions_topic)) if t["rollout_id"] in spans]
    assert sorted((t["rollout_id"], t["episode_return"]) for t in mine) == [("r-archive-0", 1.0), ("r-archive-1", 0.0)]
    for t in mine:
        llm = spans[t["rollout_id"]]
        assert t["task_id"] == "t-archive"
        assert list(t["prompt_token_ids"]) == llm["prompt_token_ids"]
        assert list(t["completion_token_ids"]) == llm["completion_token_ids"]
        assert list(t["behaviour_logprobs"]) == pytest.approx(llm["completion_logprobs"], abs=1e-6)
    samples = [s for s in asyncio.run(read_topic(settings.kafka_bootstrap, samples_topic))
               if s["transition"]["rollout_id"] in spans]
    assert len(samples) == 2
    for s in samples:
        assert s["group_mean"] == pytest.approx(0.5) and s["group_std"] == pytest.approx(0.5)
        assert s["advantage"] == pytest.approx(1.0 if s["transition"]["episode_return"] == 1.0 else -1.0, abs=1e-4)

    run = result["training"]["run"]
    manifest = checkpoint.read_manifest(checkpoint.make_client(settings), settings.checkpoint_bucket, run, 1)
    assert manifest is not None and manifest["parent_version"] == 0
    assert list(manifest["trained_offsets"]) == [f"{samples_topic.name}:0"]
