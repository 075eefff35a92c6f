"""Rollout stamping, reward spans and the runner's reward/offset logic (no network)."""
from __future__ import annotations

import math

import pytest
from aiokafka import TopicPartition
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from spanrl.producers import instrument
from spanrl.producers.instrument import RolloutStampProcessor, emit_reward, rollout_context
from spanrl.producers.kafka import Topics
from spanrl.producers.runner import RolloutContext, _OffsetTracker


@pytest.fixture
def exported(monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(RolloutStampProcessor())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(instrument, "_provider", provider)
    return provider, exporter


def test_spans_stamped_with_rollout_and_sequence(exported):
    provider, exporter = exported
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("outside"):
        pass
    with rollout_context("r1", "0", agent_name="solver"):
        with tracer.start_as_current_span("a"):
            with tracer.start_as_current_span("b"):
                pass
        with rollout_context("r1", "0", agent_name="critic"):  # sub-agent keeps the counter
            with tracer.start_as_current_span("c"):
                pass
    with rollout_context("r2", "1"):
        with tracer.start_as_current_span("d"):
            pass
    spans = {s.name: dict(s.attributes) for s in exporter.get_finished_spans()}
    assert spans["outside"] == {}
    assert spans["a"] == {"spanrl.rollout_id": "r1", "spanrl.attempt_id": "0", "spanrl.sequence_id": 0,
                          "spanrl.agent_name": "solver"}
    assert (spans["b"]["spanrl.sequence_id"], spans["c"]["spanrl.sequence_id"]) == (1, 2)
    assert spans["c"]["spanrl.agent_name"] == "critic"
    assert spans["d"] == {"spanrl.rollout_id": "r2", "spanrl.attempt_id": "1", "spanrl.sequence_id": 0}


def test_emit_reward_span(exported):
    _, exporter = exported
    with rollout_context("r1", "0"):
        emit_reward(0.5, final=False, name="tool_ok", span_id="ab" * 8, format=1.0)
    [s] = exporter.get_finished_spans()
    assert s.name == "spanrl.reward"
    assert dict(s.attributes) == {
        "spanrl.rollout_id": "r1", "spanrl.attempt_id": "0", "spanrl.sequence_id": 0,
        "spanrl.reward.value": 0.5, "spanrl.reward.final": False, "spanrl.reward.name": "tool_ok",
        "spanrl.reward.span_id": "ab" * 8, "spanrl.reward.component.format": 1.0}


@pytest.mark.parametrize("value,components", [(math.nan, {}), (math.inf, {}), (1.0, {"x": -math.inf}), ("1", {})])
def test_emit_reward_rejects_non_finite(exported, value, components):
    with rollout_context("r1", "0"), pytest.raises(ValueError):
        emit_reward(value, **components)
    with pytest.raises(ValueError):
        RolloutContext({}, "t", "r", "0", "u").emit_reward(value, **components)
    assert exported[1].get_finished_spans() == ()


def test_emit_reward_outside_rollout_raises(exported):
    with pytest.raises(RuntimeError):
        emit_reward(1.0)


def test_offset_tracker_commits_contiguous_prefix():
    tp = TopicPartition("t", 0)
    tr = _OffsetTracker()
    for o in (5, 6, 7):
        tr.start(tp, o)
    assert tr.finish(tp, 6) is None
    assert tr.finish(tp, 5) == 7
    assert tr.finish(tp, 7) == 8


def test_topics_prefix():
    t = Topics.with_prefix("prtest-x-")
    assert (t.spans.name, t.rewards.name, t.dead_letter.name) == ("prtest-x-spans", "prtest-x-rewards", "prtest-x-dead-letter")
    assert t.spans.partitions == Topics().spans.partitions


def test_emit_reward_for_a_named_rollout_outside_any_context(exported):
    """A production agent rewards a rollout later: ``rollout_id=`` (attempt "0" by default),
    outside any rollout_context, and inside another rollout's context without touching it."""
    _, exporter = exported
    emit_reward(1.0, rollout_id="prod-1", name="user_rating")
    with rollout_context("r9", "2"):
        emit_reward(0.0, rollout_id="prod-2", attempt_id="a1")
        emit_reward(0.5)
    got = [(dict(s.attributes)["spanrl.rollout_id"], dict(s.attributes)["spanrl.attempt_id"],
            dict(s.attributes)["spanrl.reward.value"], dict(s.attributes)["spanrl.reward.name"])
           for s in exporter.get_finished_spans()]
    assert got == [("prod-1", "0", 1.0, "user_rating"), ("prod-2", "a1", 0.0, "reward"), ("r9", "2", 0.5, "reward")]
