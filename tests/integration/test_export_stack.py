"""``spanrl export`` from the real stack's topics: an attempt run through the stack's proxy
(real vLLM) comes out as an episode, its transitions and samples, with the messages the
client sent and got, and ``datasets`` reads the files."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import datasets
import openai
import pytest

from spanrl.infra.export import SCHEMAS, read_export, write_tables
from spanrl.infra.replay import read_topic
from spanrl.producers.runner import Runner
from spanrl.schemas import topics as T

pytestmark = pytest.mark.integration


def _agent(model: str):
    async def agent(ctx) -> float:
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
            await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Say yes."}], max_tokens=4)
        return 1.0
    return agent


def test_export_of_the_stack_topics(stack, settings, tmp_path):
    task = {"task_id": f"export-{uuid.uuid4().hex[:8]}", "payload": json.dumps({}), "group_size": 2, "timeout_s": 60}
    [attempts] = asyncio.run(Runner(_agent(settings.model_name), settings=settings, concurrency=2,
                                    timeout_s=60).run_tasks([task]))
    assert [a.status for a in attempts] == ["succeeded"] * 2, [a.error for a in attempts]
    ids = {a.rollout_id for a in attempts}
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # the stack's worker groups the two attempts into samples
        samples = [s for s in asyncio.run(read_topic(settings.kafka_bootstrap, T.SAMPLES))
                   if s["transition"]["rollout_id"] in ids]
        if len(samples) == 2:
            break
        time.sleep(1.0)
    rows = asyncio.run(read_export(settings))
    write_tables(rows, tmp_path)
    for name in ("episodes", "transitions", "samples"):
        ds = datasets.load_dataset("parquet", data_files=str(tmp_path / f"{name}.parquet"), split="train")
        assert ds.column_names == SCHEMAS[name].names
        mine = ds.filter(lambda r: r["rollout_id"] in ids)
        assert mine.num_rows == 2, name
        for r in mine:
            assert r["messages"][0] == {"role": "user", "content": "Say yes."}
            assert r["messages"][-1]["role"] == "assistant"
        if name != "episodes":
            for r in mine:
                assert r["tokenizer_sha256"] and len(r["tokenizer_sha256"]) == 64 and r["completion_token_ids"]
                assert json.loads(r["input_messages_json"]) == [{"role": "user", "content": "Say yes."}]
