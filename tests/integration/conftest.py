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
