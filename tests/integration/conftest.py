"""Fixtures of the integration tests that read the proxy's records of their own calls."""
from __future__ import annotations

import asyncio

import pytest

from spanrl.infra.replay import read_records, topics_end_offsets
from spanrl.schemas import codec
from spanrl.schemas import topics as T


@pytest.fixture(scope="module")
def tokenizer(settings):
    """The served model's tokenizer, to decode recorded token ids."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(settings.model_dir)


@pytest.fixture(scope="module")
def base_policy(stack, settings):
    """vLLM serves the base weights during the module's tests (an evaluation pin of version 0,
    ``trainer/reloader.py``), and the run's newest checkpoint again afterwards. Earlier tests of
    the session (test_main_job, and every rewarded rollout while the trainer streams) train the
    stack's run and the reloader serves each version they publish, so which policy answers a
    later test depends on timing; a test that relies on the base model's greedy answer (one
    that stops within ``max_tokens``) asks for it."""
    from spanrl.infra import evaluation

    evaluation.pin(settings, None, 0)
    yield
    evaluation.unpin(settings)


@pytest.fixture
def spans_of(stack, settings):
    """``spans_of(rollout_id)``: the proxy's spans of a rollout produced since the test began
    (the proxy produces a call's span before it answers). Only the proxy's: when an earlier
    test of the process turned on OTel (a runner's ``instrument()``), the client's own HTTP
    spans join the rollout by trace id too (stream_jobs/joining.py), as context."""
    start = {tp.partition: off for tp, off in asyncio.run(topics_end_offsets(settings, [T.SPANS])).items()}

    def read(rollout_id: str) -> list[dict]:
        recs = [codec.decode(T.SPANS.record, v)
                for _, _, _, v in asyncio.run(read_records(settings.kafka_bootstrap, T.SPANS.name, start))]
        return sorted((r for r in recs if r["rollout_id"] == rollout_id and r["source"] == "proxy"),
                      key=lambda r: r["sequence_id"])

    return read
