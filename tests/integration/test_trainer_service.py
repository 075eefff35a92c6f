"""Trainer + reloader against the real stack (Kafka, MinIO, vLLM): real samples from vLLM
-> one update -> verified checkpoint in MinIO + announcement -> resume point -> vLLM
reloads it; a tampered checkpoint is refused while vLLM keeps serving."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest

from infra.settings import get_settings
from schemas.codec import encode
from trainer import checkpoint
from trainer.reloader import Reloader, ReloaderConfig, reload_vllm
from trainer.train import Trainer, TrainerConfig, read_announcements

pytestmark = pytest.mark.integration

PROMPTS = ["Name a colour.", "Say hello in French.", "What is 2+2?", "Name a fruit."]


async def _vllm_ready(url: str, wait_s: float = 180.0) -> None:
    deadline = time.monotonic() + wait_s
    async with httpx.AsyncClient(timeout=5.0) as c:
        while True:
            try:
                if (await c.get(f"{url}/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM at {url} not healthy after {wait_s:.0f}s (is the stack up?)")
            await asyncio.sleep(2)


async def _chat(url: str, prompt: str, max_tokens: int = 12) -> dict:
    async with httpx.AsyncClient(timeout=120.0) as c:
        r = await c.post(f"{url}/v1/chat/completions", json={
            "model": get_settings().model_name, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 1.0, "logprobs": True, "return_token_ids": True})
        r.raise_for_status()
        return r.json()


def _sample_from(resp: dict, task_id: str, ret: float, adv: float) -> dict:
    choice = resp["choices"][0]
    lps = [t["logprob"] for t in choice["logprobs"]["content"]]
    assert len(lps) == len(choice["token_ids"])
    transition = {
        "rollout_id": f"r-{uuid.uuid4().hex[:8]}", "attempt_id": "a0", "span_id": uuid.uuid4().hex[:16],
        "task_id": task_id, "group_size": 2, "sequence_id": 0, "call_index": 0, "rollout_transition_count": 1,
        "agent_name": None, "model": "policy", "policy_version": 0,
        "prompt_token_ids": resp["prompt_token_ids"], "completion_token_ids": choice["token_ids"],
        "behaviour_logprobs": lps, "episode_return": ret, "reward": ret, "credit_rule": "identical",
        "status": "succeeded"}
    return {"transition": transition, "advantage": adv, "group_id": task_id, "group_rollouts": 2,
            "group_mean": 0.5, "group_std": 0.5}


async def test_trainer_publishes_and_reloader_serves(tmp_path, stack):
    from aiokafka import AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    s = get_settings()
    tag = uuid.uuid4().hex[:8]
    run, samples_topic, ckpt_topic = f"trtest-{tag}", f"trtest-samples-{tag}", f"trtest-checkpoints-{tag}"
    await _vllm_ready(s.vllm_url)
    admin = AIOKafkaAdminClient(bootstrap_servers=s.kafka_bootstrap)
    await admin.start()
    await admin.create_topics([NewTopic(samples_topic, 1, 1), NewTopic(ckpt_topic, 1, 1)])
    minio = checkpoint.make_client(s)
    try:
        # real samples: token ids and behaviour log-probs as vLLM reports them
        samples = []
        for i, p in enumerate(PROMPTS):
            resp = await _chat(s.vllm_url, p)
            samples.append(_sample_from(resp, f"task-{i // 2}", float(i % 2), 1.0 if i % 2 else -1.0))
        producer = AIOKafkaProducer(bootstrap_servers=s.kafka_bootstrap, enable_idempotence=True)
        await producer.start()
        for smp in samples:
            await producer.send_and_wait(samples_topic, encode("sample", smp), key=smp["transition"]["task_id"].encode())
        await producer.stop()

        # trainer: one update, checkpoint_every=1
        cfg = TrainerConfig(run=run, samples_topic=samples_topic, checkpoints_topic=ckpt_topic, min_batch=4,
                            micro_batch=2, max_updates=1, checkpoint_every=1, http=False, start="earliest",
                            log_path=tmp_path / "trainer.jsonl")
        trainer = Trainer(cfg)
        await asyncio.wait_for(trainer.serve(), timeout=240)
        assert trainer.state.version == 1
        assert trainer.state.trained_offsets == {f"{samples_topic}:0": len(samples)}
        lines = [json.loads(x) for x in (tmp_path / "trainer.jsonl").read_text().splitlines()]
        upd = next(x for x in lines if x["event"] == "update")
        assert upd["samples"] == 4 and upd["approx_kl"] < 0.5, upd  # vLLM and HF agree on log-probs
        print("update", {k: upd[k] for k in ("loss", "approx_kl", "clip_frac", "update_s", "tokens_per_s")})

        # the manifest in MinIO verifies and the announcement arrived
        uri = checkpoint.checkpoint_uri(s.checkpoint_bucket, run, 1)
        manifest = await asyncio.to_thread(checkpoint.download_checkpoint, minio, uri, tmp_path / "dl")
        assert manifest["trained_offsets"] == {f"{samples_topic}:0": 4}
        assert manifest["parent_version"] == 0 and manifest["step"] == 1
        assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(manifest["files"])
        anns = await read_announcements(ckpt_topic, run, s.kafka_bootstrap)
        assert [(a["version"], a["uri"]) for a in anns] == [(1, uri)]
        assert anns[0]["manifest_sha256"] == checkpoint.manifest_sha256(tmp_path / "dl")

        # a restarted trainer resumes at version 1 and at the trained offsets
        again = Trainer(cfg)
        m = await again.resume()
        assert m["version"] == 1 and again.state.trained_offsets == {f"{samples_topic}:0": 4}

        # reloader: loads the announced version into vLLM
        rl = Reloader(ReloaderConfig(run=run, checkpoints_topic=ckpt_topic, start="latest",
                                     max_announcements=1, http=False))
        await asyncio.wait_for(rl.serve(), timeout=180)
        st = rl.status()
        assert st["served_version"] == 1, st
        assert st["history"][-1]["verified"] and st["history"][-1]["reloaded"], st
        print("reload_s", st["history"][-1]["reload_s"])
        assert (await _chat(s.vllm_url, "Say hi", 4))["choices"][0]["token_ids"]

        # tampered checkpoint v2: manifest says one hash, object store holds other bytes
        prefix2 = f"{run}/000002/"
        m2 = dict(manifest, version=2, parent_version=1)
        (tmp_path / "m2.json").write_text(json.dumps(m2))
        (tmp_path / "evil").write_bytes(b"not the weights")
        for name in manifest["files"]:
            if name != "model.safetensors":
                minio.fput_object(s.checkpoint_bucket, prefix2 + name, str(tmp_path / "dl" / name))
        minio.fput_object(s.checkpoint_bucket, prefix2 + "model.safetensors", str(tmp_path / "evil"))
        minio.fput_object(s.checkpoint_bucket, prefix2 + "manifest.json", str(tmp_path / "m2.json"))
        ann2 = dict(anns[0], version=2, uri=f"s3://{s.checkpoint_bucket}/{prefix2}", parent_version=1,
                    manifest_sha256=checkpoint.sha256_file(tmp_path / "m2.json"))
        assert await rl.handle(ann2) is False
        st = rl.status()
        assert st["served_version"] == 1
        assert st["history"][-1]["verified"] is False and "sha256 mismatch" in st["history"][-1]["error"]
        assert not (s.cache_dir / "checkpoints" / run / "000002").exists()
        assert (await _chat(s.vllm_url, "Say hi", 4))["choices"][0]["token_ids"]
    finally:
        # give vLLM its base weights back, drop our topics and objects
        try:
            await reload_vllm(s.vllm_url, s.model_dir)
        finally:
            await admin.delete_topics([samples_topic, ckpt_topic])
            await admin.close()
            if minio.bucket_exists(s.checkpoint_bucket):
                for o in minio.list_objects(s.checkpoint_bucket, prefix=f"{run}/", recursive=True):
                    minio.remove_object(s.checkpoint_bucket, o.object_name)
