"""Held-out evaluation and the release gate on the real stack (Kafka, MinIO, vLLM, the
proxy, the real math agent).

- ``spanrl eval``'s evaluate(): the base model and a checkpoint ``RUN:1`` (the base weights
  under a manifest, so the two must agree exactly at temperature 0) on the same held-out
  tasks; both reports, paired differences, calls only on the evaluation topics, vLLM
  restored afterwards; clear errors for an unknown version, a tampered checkpoint and an
  empty task set.
- The release gate: a checkpoint with noised weights is refused (vLLM goes back to the
  incumbent, the decision is in MinIO, the history and the checkpoints topic); a good one
  is served.

These tests own the reloader port: the stack's reloader steps aside and comes back after.
"""
from __future__ import annotations

import asyncio
import io
import os
import shutil
import time
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from spanrl.core.settings import get_settings
from spanrl.infra import evaluation as E
from spanrl.infra.replay import topics_end_offsets
from spanrl.producers.kafka import Topics
from spanrl.schemas import topics as T
from spanrl.schemas.codec import encode
from spanrl.trainer import checkpoint
from spanrl.trainer.reloader import Reloader, ReloaderConfig
from tests.integration.services import admin_headers

pytestmark = pytest.mark.integration


def _checkpoint_dir(base: Path, out: Path, run: str, version: int, noise: float = 0.0) -> Path:
    """A checkpoint dir of ``run``/``version``: the base weights (hard links) or, with
    ``noise``, every tensor plus N(0, (noise * its std)^2) (a model made worse on purpose)."""
    shutil.copytree(base, out, copy_function=os.link)
    if noise:
        weights = out / "model.safetensors"
        tensors = load_file(str(weights))
        gen = torch.Generator().manual_seed(version)
        noised = {k: (v + torch.randn(v.shape, generator=gen) * noise * v.float().std()).to(v.dtype)
                  if v.numel() > 1 else v for k, v in tensors.items()}
        weights.unlink()  # a hard link: never write through it into the base model
        save_file(noised, str(weights), metadata={"format": "pt"})
    checkpoint.write_manifest(out, run=run, version=version, parent_version=version - 1, base_model="base",
                              step=version, trained_offsets={}, metrics={})
    key = get_settings().checkpoint_key()  # signed as the trainer signs: the reloader serves only what verifies
    if key is not None:
        checkpoint.sign_manifest(out, key)
    return out


async def _announce(topic: str, run: str, version: int, uri: str, ckpt: Path) -> None:
    from aiokafka import AIOKafkaProducer

    p = AIOKafkaProducer(bootstrap_servers=get_settings().kafka_bootstrap, enable_idempotence=True)
    await p.start()
    try:
        await p.send_and_wait(topic, encode("checkpoint", {
            "run": run, "version": version, "uri": uri, "step": version, "parent_version": version - 1,
            "manifest_sha256": checkpoint.manifest_sha256(ckpt), "created_ms": int(time.time() * 1000),
            "metrics": {}}), key=run.encode())
    finally:
        await p.stop()


async def _read_all(topic: str) -> list[dict]:
    from spanrl.infra.replay import read_topic

    return await read_topic(get_settings().kafka_bootstrap, T.BY_NAME.get(topic) or T.Topic(topic, "run", "checkpoint", 1))


async def _served(http: httpx.AsyncClient, s) -> dict:
    return (await http.get(f"http://{s.host}:{s.reloader_port}/status", headers=admin_headers())).json()


@pytest.fixture
async def own_reloader(stack, tmp_path, scratch_run):
    """A Reloader of a fresh run on its own checkpoints topic, on the reloader port; the
    stack's reloader is stopped for the test and started again after (with vLLM on the base)."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    s = get_settings()
    tag = uuid.uuid4().hex[:8]
    run, topic = scratch_run(f"evaltest-{tag}"), f"evaltest-checkpoints-{tag}"
    admin = AIOKafkaAdminClient(bootstrap_servers=s.kafka_bootstrap)
    await admin.start()
    await admin.create_topics([NewTopic(topic, 1, 1)])
    displaced = stack.running("reloader")
    if displaced:
        await asyncio.to_thread(stack.stop, "reloader")
    holder: dict = {"run": run, "topic": topic, "tmp": tmp_path, "reloaders": []}

    async def start(**cfg) -> Reloader:
        rl = Reloader(ReloaderConfig(run=run, checkpoints_topic=topic, start="end", watch_interval_s=1.0, **cfg))
        task = asyncio.create_task(rl.serve())
        holder["reloaders"].append((rl, task))
        async with httpx.AsyncClient(timeout=5) as http:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if (await http.get(f"http://{s.host}:{s.reloader_port}/health")).status_code == 200 \
                            and rl.vllm_synced:
                        return rl
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
        raise AssertionError("own reloader did not come up")

    holder["start"] = start
    try:
        yield holder
    finally:
        for rl, task in holder["reloaders"]:
            rl.stop()
            await asyncio.wait_for(task, 60)
        await admin.delete_topics([topic])
        await admin.close()
        if displaced:
            await asyncio.to_thread(stack.start, "reloader")


def _upload(s, ckpt: Path, run: str, version: int) -> str:
    uri = checkpoint.checkpoint_uri(s.checkpoint_bucket, run, version)
    checkpoint.upload_checkpoint(checkpoint.make_client(s), ckpt, uri)
    return uri


async def test_eval_base_and_checkpoint_on_the_evaluation_topics(own_reloader, tmp_path):
    s = get_settings()
    run = own_reloader["run"]
    await own_reloader["start"]()
    ckpt = _checkpoint_dir(s.model_dir, tmp_path / "v1", run, 1)
    await asyncio.to_thread(_upload, s, ckpt, run, 1)
    train_topics = Topics()
    train_start = await topics_end_offsets(s, [train_topics.spans, train_topics.rewards, train_topics.rollouts])
    cfg = E.EvalConfig(policies=["base", f"{run}:1"], tasks=4, concurrency=4, out_dir=tmp_path / "out",
                       name="evaltest")
    report = await asyncio.to_thread(E.evaluate, cfg, s)

    assert list(report["policies"]) == ["base", f"{run}:1"]
    for rep in report["policies"].values():
        assert rep["episodes"] == 4 and rep["tasks"] == 4 and rep["failed_attempts"] == 0
        assert rep["mean_llm_calls"]["estimate"] >= 1 and rep["tool_use_rate"] is not None
        assert rep["success_rate"]["n"] == 4 and 0.0 <= rep["success_rate"]["low"] <= rep["success_rate"]["high"]
    assert report["task_ids"] == [f"arith_word-1000-{i}" for i in range(4)]
    # the same weights at temperature 0: the same answers, a paired difference of exactly 0
    paired = report["paired"][f"{run}:1 - base"]
    assert paired["tasks"] == 4
    assert paired["mean_reward"]["estimate"] == 0.0 and paired["mean_reward"]["high"] == 0.0
    base_eps, ckpt_eps = (E.episodes_of(report["policies"][p]) for p in report["policies"])
    assert [e.reward for e in base_eps] == [e.reward for e in ckpt_eps]
    assert Path(report["paths"]["json"]).exists() and Path(report["paths"]["png"]).stat().st_size > 0

    # every call is on spans.eval with the policy version that served it; none on the training topics
    ours = {e.rollout_id: p for p in report["policies"] for e in E.episodes_of(report["policies"][p])}
    on_eval = [sp for sp in await _read_all(T.SPANS_EVAL.name) if sp["rollout_id"] in ours]
    spans = [sp for sp in on_eval if sp["source"] == "proxy"]
    # AutoGen's own spans of these episodes (OpenInference, via the bridge) are there too,
    # stamped spanrl.record_to=eval; nothing of them reached the training topics (below)
    assert any(sp["source"] == "otlp" and sp["agent_name"] == "math_agent" for sp in on_eval)
    assert len(spans) == sum(e.llm_calls for p in report["policies"] for e in E.episodes_of(report["policies"][p]))
    assert {sp["llm"]["policy_version"] for sp in spans if ours[sp["rollout_id"]] == "base"} == {0}
    assert {sp["llm"]["policy_version"] for sp in spans if ours[sp["rollout_id"]] != "base"} == {1}
    assert all(sp["attributes"].get("gen_ai.request.temperature") == "0.0" for sp in spans)
    rewards = [r for r in await _read_all(T.REWARDS_EVAL.name) if r["rollout_id"] in ours]
    assert len(rewards) == 8 and all(r["final"] for r in rewards)
    leaked = await E.read_since(s, train_start)
    assert not [r for recs in leaked.values() for r in recs if r.get("rollout_id") in ours]

    # vLLM is back on what the reloader serves (the base: nothing announced), nothing pinned
    async with httpx.AsyncClient(timeout=10) as http:
        st = await _served(http, s)
    assert st["pinned"] is None and st["served_version"] == 0 and st["vllm_synced"]
    # the pin's download (~0.5 GB) went with the pin
    assert not (s.cache_dir / "checkpoints" / "pinned" / run).exists()


async def test_eval_refuses_unknown_tampered_and_empty(own_reloader, tmp_path):
    s = get_settings()
    run = own_reloader["run"]
    await own_reloader["start"]()
    base_cfg = dict(tasks=2, concurrency=2, out_dir=tmp_path / "out")
    with pytest.raises(E.EvalError, match="unknown checkpoint"):
        await asyncio.to_thread(E.evaluate, E.EvalConfig(policies=[f"{run}:7"], **base_cfg), s)
    with pytest.raises(E.EvalError, match="policy must be"):
        await asyncio.to_thread(E.evaluate, E.EvalConfig(policies=["latest-please"], **base_cfg), s)
    # tampered: the weights in MinIO no longer match the manifest
    ckpt = _checkpoint_dir(s.model_dir, tmp_path / "v3", run, 3)
    uri = await asyncio.to_thread(_upload, s, ckpt, run, 3)
    bucket, prefix = checkpoint.parse_uri(uri)
    junk = b"not the weights"
    checkpoint.make_client(s).put_object(bucket, prefix + "model.safetensors", io.BytesIO(junk), len(junk))
    with pytest.raises(E.EvalError, match="does not verify"):
        await asyncio.to_thread(E.evaluate, E.EvalConfig(policies=[f"{run}:3"], **base_cfg), s)
    with pytest.raises(E.EvalError, match="empty task set"):
        await asyncio.to_thread(E.evaluate, E.EvalConfig(policies=["base"], **{**base_cfg, "tasks": 0}), s)
    with pytest.raises(E.EvalError, match="empty task set"):
        await asyncio.to_thread(E.evaluate, E.EvalConfig(policies=["base"], **base_cfg), s, [])
    async with httpx.AsyncClient(timeout=10) as http:
        st = await _served(http, s)
    assert st["pinned"] is None and st["served_version"] == 0


# slow tier: ~150 s (the degraded model rambles through 12 math episodes of 3 x 128 tokens); the gate is
# off by default and its rule is unit-tested (tests/unit/test_trainer_gate.py)
@pytest.mark.slow
async def test_release_gate_refuses_a_degraded_checkpoint_and_serves_a_good_one(own_reloader, tmp_path):
    s = get_settings()
    run, topic = own_reloader["run"], own_reloader["topic"]
    rl = await own_reloader["start"](gate=True, gate_tasks=12, gate_concurrency=6)
    minio = checkpoint.make_client(s)

    async def wait_for(cond, what: str, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {rl.history}")
            await asyncio.sleep(1)

    bad = _checkpoint_dir(s.model_dir, tmp_path / "v1", run, 1, noise=0.5)
    uri1 = await asyncio.to_thread(_upload, s, bad, run, 1)
    await _announce(topic, run, 1, uri1, bad)
    await wait_for(lambda: any(h.get("event") == "gate_restore" and h["reloaded"] for h in rl.history),
                   "the degraded v1 to be refused")
    v1 = next(h for h in rl.history if h.get("version") == 1 and "gate" in h)
    decision = v1["gate"]["decision"]
    assert not decision["accept"] and decision["reason"] == "worse_beyond_tolerance" and decision["tasks"] == 12
    assert decision["difference"]["high"] < 0 and decision["incumbent_mean"] > decision["candidate_mean"]
    assert rl.served_version == 0 and rl.target["version"] == 0 and rl.vllm_synced and rl.pinned is None
    stored = checkpoint.read_gate_record(minio, uri1)
    assert stored["decision"] == decision and stored["incumbent_version"] == 0
    # the checkpoint itself stays in MinIO and still verifies (gate.json is beside, not in it)
    checkpoint.download_checkpoint(minio, uri1, tmp_path / "check1")

    good = _checkpoint_dir(s.model_dir, tmp_path / "v2", run, 2)
    uri2 = await asyncio.to_thread(_upload, s, good, run, 2)
    await _announce(topic, run, 2, uri2, good)
    await wait_for(lambda: rl.served_version == 2 and rl.pinned is None, "the good v2 to be served")
    v2 = next(h for h in rl.history if h.get("version") == 2 and "gate" in h)
    assert v2["gate"]["decision"]["accept"] and v2["gate"]["decision"]["difference"]["estimate"] == 0.0
    assert rl.target["version"] == 2

    records = [r for r in await _read_all(topic) if r["run"] == run]
    assert [(r["version"], r["event"]) for r in records] == [(1, "published"), (1, "refused"), (2, "published"),
                                                            (2, "served")]
    assert records[1]["metrics"]["gate_accept"] == 0.0 and "worse_beyond_tolerance" in records[1]["detail"]
    # the gate's own calls went to the evaluation topics
    async with httpx.AsyncClient(timeout=10) as http:
        assert (await _served(http, s))["served_version"] == 2
